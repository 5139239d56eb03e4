"""Extras of cpu-flash: shapes that span several of its tiles (64 query rows x 256 keys; a window: 32 query rows x
one key tile as wide as their band), masks and biases read per tile, which the conformance suite's small cases never
reach. Band edges on its tile
boundaries and key tiles outside the band that it never reads are tests/test_tile_edges.py's; agreement on
everything else is the conformance suite's."""

from __future__ import annotations

import pytest

from attnkit import AttentionSpec
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
