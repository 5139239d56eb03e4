"""cpu-flash's mask programs at its tile edges: out, lse, dq, dk, dv against the float64 oracle given the program's
dense mask, with program boundaries on and off its 64 x 256 tiles, tiles the program hides entirely (which the kernel
must never read), rows that see nothing, and the program beside the kernel's own clauses. Random programs over every
clause are the conformance harness's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from attnkit import AttentionSpec
from attnkit.backend import AttentionInputs
from attnkit.contract.programs import EMPTY, dense, tile_classes
from attnkit.frontends import ops_for
from attnkit.programs import bind
from attnkit.registry import get_backend
from attnkit.testing.agreement import compare_outputs
from tests.conftest import available_backends

BACKEND = "cpu-flash"
pytestmark = pytest.mark.skipif(BACKEND not in available_backends(), reason=f"{BACKEND} is not available here")
TILE = (64, 256)  # cpu-flash's forward and backward tiles without a two-sided band


def _oracle(spec: AttentionSpec, inputs: AttentionInputs, dtype: torch.dtype, dout: torch.Tensor) -> dict[str, Any]:
    from attnkit.backends.reference.torch_naive import oracle_attention

    leaves = [x.to(dtype).requires_grad_(True) for x in inputs[:3]]
    out, lse = oracle_attention(spec, inputs._replace(q=leaves[0], k=leaves[1], v=leaves[2]), dtype)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return _numpy({"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]})


def _numpy(results: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {name: value.detach().double().numpy() for name, value in results.items()}


def check_program(
    mask_mod: Callable[..., Any],
    spec: AttentionSpec | None = None,
    batch: int = 2,
    heads_q: int = 4,
    heads_kv: int = 2,
    len_q: int = 600,
    len_k: int = 600,
    dtype: torch.dtype = torch.float32,
    **terms: Any,
) -> dict[str, Any]:
    """cpu-flash's out, lse and gradients with ``mask_mod`` against the oracle's with its dense mask ANDed in;
    ``terms``: further AttentionInputs fields. Returns cpu-flash's results."""
    spec = spec or AttentionSpec()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, heads, length, 32, generator=generator).to(dtype)
        for heads, length in ((heads_q, len_q), (heads_kv, len_k), (heads_kv, len_k))
    )
    dout = torch.randn(batch, heads_q, len_q, 32, generator=generator).to(dtype)
    bound = bind(mask_mod, ops_for(q, "q"), q, batch, heads_q, len_q, len_k)
    inputs = AttentionInputs(q, k, v, mask_program=bound, **terms)
    backend = get_backend(BACKEND)
    out, lse = backend.forward(spec, inputs, True)
    grads = backend.backward(spec, inputs, out, lse, dout, None, need_dbias=False)
    results = _numpy({"out": out, "lse": lse, "dq": grads.dq, "dk": grads.dk, "dv": grads.dv})
    visible = dense(bound, batch, heads_q, len_q, len_k, q)
    oracle_inputs = inputs._replace(mask=visible if inputs.mask is None else inputs.mask & visible, mask_program=None)
    exact = _oracle(spec, oracle_inputs, torch.float64, dout.double())
    baseline = _oracle(spec, oracle_inputs, dtype, dout)
    comparisons = compare_outputs(str(dtype).removeprefix("torch."), results, exact, baseline)
    failures = [str(c) for c in comparisons if not c.ok]
    assert not failures, failures
    return results


def documents(bounds: list[list[int]], length: int) -> torch.Tensor:
    """(B, length) document ids from each element's document starts."""
    positions = torch.arange(length)
    return torch.stack([(positions.unsqueeze(1) >= torch.tensor(b).unsqueeze(0)).sum(1) - 1 for b in bounds])


@pytest.mark.parametrize("starts", [[[0, 256, 512], [0, 64, 320]], [[0, 200, 457], [0, 1, 599]]], ids=["on", "off"])
def test_document_causal(starts: list[list[int]]) -> None:
    doc = documents(starts, 600)

    def document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    check_program(document_causal)


@pytest.mark.parametrize("prefix", [[256, 64], [100, 300]], ids=["on", "off"])
def test_prefix_lm(prefix: list[int]) -> None:
    prefixes = torch.tensor(prefix)

    def prefix_lm(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < prefixes[b]) | (q_idx >= kv_idx)

    check_program(prefix_lm)


@pytest.mark.parametrize("chunk", [128, 100])
def test_chunked_causal(chunk: int) -> None:
    def chunked_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx // chunk == kv_idx // chunk) & (q_idx >= kv_idx)

    check_program(chunked_causal, len_q=520, len_k=520)


def test_local_window_with_global_tokens_per_head() -> None:
    """Bidirectional window, 3 global tokens, and a window that grows with the query head (h is the query head under
    GQA: heads 0..3 over 2 kv heads)."""
    widths = torch.tensor([40, 64, 100, 200], dtype=torch.int32)

    def local_global(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return ((q_idx - kv_idx).abs() <= widths[h]) | (kv_idx < 3) | (q_idx < 3)

    check_program(local_global, len_q=700, len_k=700)


def test_rows_that_see_nothing_and_python_rounding() -> None:
    """Rows whose id is negative see nothing (out 0, lse -inf, zero gradients), through a bool captured tensor,
    Python's floor division and modulo of negative numbers, and where."""
    hidden = torch.zeros(600, dtype=torch.bool)
    hidden[130:200] = True  # a run inside one query tile and across the next one's edge
    hidden[256:320] = True  # one whole query tile

    def program(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        shifted = (kv_idx - 300) // 7 % 5  # negative dividends: Python's rounding
        return ~hidden[q_idx] & torch.where(q_idx % 2 == 0, shifted != 3, kv_idx <= q_idx + 50)

    results = check_program(program)
    assert np.isneginf(results["lse"][:, :, 256:320]).all() and (results["out"][:, :, 130:200] == 0).all()


def test_with_the_kernels_clauses() -> None:
    """Bottom-right causal with Lq < Lk, ragged lengths, softcap, ALiBi and GQA, AND a prefix-LM program; then a
    two-sided window, segment ids, a mask and a bias in bfloat16 with a document program (tile grid, not the window's
    tile)."""
    prefixes = torch.tensor([0, 400])

    def prefix_lm(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < prefixes[b]) | (q_idx + 300 >= kv_idx)

    check_program(
        prefix_lm,
        AttentionSpec(causal=True, softcap=20.0),
        len_q=300,
        len_k=600,
        q_lengths=torch.tensor([300, 170]),
        kv_lengths=torch.tensor([600, 450]),
        alibi_slopes=torch.tensor([[0.5, 0.25, 0.125, 0.0625]]),
    )
    doc = documents([[0, 180, 256], [0, 300, 301]], 600)
    segments = torch.tensor([[0] * 500 + [1] * 100, [0] * 250 + [1] * 350])
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(2, 1, 600, 600, generator=generator) > 0.2

    def document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return doc[b, q_idx] == doc[b, kv_idx]

    check_program(
        document,
        AttentionSpec(window=(90, 30)),
        dtype=torch.bfloat16,
        q_segment_ids=segments,
        kv_segment_ids=segments,
        mask=mask,
        bias=torch.randn(1, 4, 600, 1, generator=generator).to(torch.bfloat16),
    )


def test_empty_tiles_are_never_read() -> None:
    """NaN in the keys and values of a key tile the classes call EMPTY for every query tile reaches neither the
    outputs nor any gradient: read, even as 0 * NaN behind the mask, it would. Queries 384..699 of a document-causal
    program whose keys 0..255 all lie in document 0."""
    doc = documents([[0, 256, 512], [0, 320, 576]], 700)

    def later_rows(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (doc[b, q_idx + 384] == doc[b, kv_idx]) & (q_idx + 384 >= kv_idx)

    generator = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(2, 2, 316, 16, generator=generator) for _ in range(2))
    k, v = (torch.randn(2, 2, 700, 16, generator=generator) for _ in range(2))
    k[:, :, :256], v[:, :, :256] = float("nan"), float("nan")
    bound = bind(later_rows, ops_for(q, "q"), q, 2, 2, 316, 700)
    assert (tile_classes(bound, 2, 2, 316, 700, *TILE, q)[..., 0] == EMPTY).all()
    inputs = AttentionInputs(q, k, v, mask_program=bound)
    backend, spec = get_backend(BACKEND), AttentionSpec()
    out, lse = backend.forward(spec, inputs, True)
    grads = backend.backward(spec, inputs, out, lse, dout, None, need_dbias=False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all() and torch.isfinite(grads.dq).all()
    assert torch.isfinite(grads.dk[:, :, 256:]).all() and torch.isfinite(grads.dv[:, :, 256:]).all()
    assert (grads.dk[:, :, :256] == 0).all() and (grads.dv[:, :, :256] == 0).all()
