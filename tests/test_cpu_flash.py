"""Extras of cpu-flash: shapes that span several of its tiles (64 query rows x 256 keys; a window: 32 query rows x
one key tile as wide as their band), masks and biases read per tile, which the conformance suite's small cases never
reach. Band edges on its tile
boundaries and key tiles outside the band that it never reads are tests/test_tile_edges.py's; agreement on
everything else is the conformance suite's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from attnkit import AttentionSpec
from attnkit.backend import AttentionInputs, Dropout
from attnkit.contract import philox
from attnkit.testing import Case, assert_backends_agree
from tests.conftest import available_backends

BACKEND = "cpu-flash"
pytestmark = pytest.mark.skipif(BACKEND not in available_backends(), reason=f"{BACKEND} is not available here")

MULTI_TILE_CASES = [
    # bottom-right causal with Lq < Lk, softcap, GQA: every query block starts mid key tile
    Case(spec=AttentionSpec(causal=True, softcap=30.0), len_q=300, len_k=600, heads_q=4, heads_kv=2),
    # a window narrower than a key tile, a ragged cache: masked tiles on both sides of the band
    Case(spec=AttentionSpec(causal=True, window=(100, 0)), len_q=530, len_k=530, kv_lengths=(530, 290)),
    # two-sided window, top-left, query lengths, bfloat16
    Case(
        spec=AttentionSpec(window=(70, 40), causal_alignment="top_left"),
        len_q=400,
        len_k=333,
        q_lengths=(400, 130),
        dtype="bfloat16",
    ),
    # cosine, top-left with Lq > Lk, float16, Dv != D
    Case(
        spec=AttentionSpec(variant="cosine", causal=True, causal_alignment="top_left"),
        len_q=520,
        len_k=260,
        head_dim=24,
        head_dim_v=40,
        dtype="float16",
    ),
    # a band wider than one tile may be (1024 keys): the 64-row blocks over several masked key tiles
    Case(spec=AttentionSpec(causal=True, window=(1100, 0)), len_q=1300, len_k=1300),
    # a decode step over a long cache
    Case(spec=AttentionSpec(causal=True), len_q=1, len_k=700, heads_q=8, heads_kv=2),
    # dropout on a window's masked tiles (the keep step runs on the band's columns alone), GQA's query heads, a
    # ragged cache
    Case(
        spec=AttentionSpec(causal=True, window=(300, 0)),
        len_q=400,
        len_k=530,
        heads_q=4,
        heads_kv=2,
        kv_lengths=(530, 290),
        dropout=(0.2, 0xF00D_CAFE_1234_5678),
    ),
    # softcap with a per-head mask with fully masked rows and a full bias with its gradient: both read per tile
    # through their strides on every query block and key tile
    Case(
        spec=AttentionSpec(softcap=20.0),
        len_q=300,
        len_k=600,
        heads_q=4,
        heads_kv=2,
        mask_shape=(2, 4, 300, 600),
        masked_rows=(0, 130),
        bias_shape=(2, 4, 300, 600),
        bias_grad=True,
        dropout=(0.4, 12345),  # the backward's rows that see no key: nothing generated, P = 0
    ),
    # cosine, a window and a ragged cache with a key-padding mask and an ALiBi-like bias broadcast over batch and
    # queries (its gradient summed over both), bfloat16
    Case(
        spec=AttentionSpec(variant="cosine", causal=True, window=(90, 0)),
        len_q=400,
        len_k=400,
        kv_lengths=(400, 270),
        mask_shape=(2, 1, 1, 400),
        bias_shape=(1, 4, 1, 400),
        bias_grad=True,
        heads_q=4,
        heads_kv=4,
        dtype="bfloat16",
    ),
    # a per-query bias broadcast over the keys (stride 0 along them: read and its gradient summed lane by lane) and a
    # per-head mask, GQA, softcap; the conformance suite draws no key-broadcast bias
    Case(
        spec=AttentionSpec(softcap=15.0, causal=True),
        len_q=70,
        len_k=300,
        heads_q=4,
        heads_kv=2,
        mask_shape=(1, 4, 70, 300),
        bias_shape=(2, 4, 70, 1),
        bias_grad=True,
    ),
]


# Ids name the backend, so that scripts/mutate_tiles.py's ``-k cpu-flash`` selects these cases.
@pytest.mark.parametrize("case", MULTI_TILE_CASES, ids=[f"{BACKEND}-{i}" for i in range(len(MULTI_TILE_CASES))])
def test_several_tiles_agree_with_the_oracle(case: Case) -> None:
    assert_backends_agree(case, [BACKEND])


@pytest.mark.parametrize("counter, key, expected", philox.KNOWN_ANSWERS)
def test_kernel_philox_gives_known_answers(counter: Any, key: Any, expected: Any) -> None:
    """kernel.cpp's Philox4x32-10, the vector code its keep step runs: Random123's answer for a block's first counter,
    and the reference's words for every counter of the block (counter[0] + n: each lane of each vector)."""
    from backends.cpu_flash.backend import _kernel

    words = np.array(_kernel().philox4x32(list(counter), list(key)), dtype=np.uint64).reshape(-1, 4)
    assert tuple(int(word) for word in words[0]) == expected
    n = np.arange(len(words))
    reference = philox.philox4x32(((counter[0] + n) & 0xFFFFFFFF, *(np.full_like(n, c) for c in counter[1:])), key)
    np.testing.assert_array_equal(words, np.stack(reference, axis=-1))


def test_dropout_offsets_take_the_larger_calls_mask() -> None:
    """A part of a larger call (head_start, query_start and a key_start off a counter's four keys, §18): out, lse and
    the gradients as the oracle's, which cuts the part from the whole call's reference mask."""
    from backends.cpu_flash.backend import flash_attention
    from backends.reference.torch_naive import oracle_attention

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 70, 32, generator=generator)
    k, v = (torch.randn(2, 2, 300, 32, generator=generator) for _ in range(2))
    dout = torch.randn(2, 4, 70, 32, generator=generator)
    spec = AttentionSpec(causal=True)
    dropout = Dropout(0.3, torch.tensor(-5, dtype=torch.int64), head_start=4, query_start=37, key_start=301)
    results = []
    for run in (flash_attention, lambda s, i: oracle_attention(s, i, torch.float64)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = run(spec, AttentionInputs(*leaves, dropout=dropout))
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        results.append([t.detach().double() for t in (out, lse, *grads)])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
