"""attend_varlen and attend_paged (docs/semantics.md §12, §13): the named ragged cases of the conformance harness on
every backend that serves them, against the float64 oracle under the tolerance rule (the drawn ones are in
tests/test_conformance.py); what the harness cannot draw (JAX under jit, cpu-flash's split-K, a shared block read by
hand); and each bad input's typed error."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import attnkit
from attnkit import AttentionSpec, Feature, InvalidInputError, InvalidInputTypeError
from attnkit.testing import backends_for, check_backend
from attnkit.testing.cases import paged_case, shuffled_table
from attnkit.testing.check import ragged_edge_shapes
from tests.conftest import backend_params

RAGGED_CASES = dict(ragged_edge_shapes())


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)


def _assert_agrees(case: Any, backend: str) -> None:
    if Feature.GRAD not in attnkit.get_backend(backend).capabilities.features:
        case = case.with_(grad=False)  # a forward-only backend is checked forward, as the strategies draw it
    reasons = backends_for(case, [backend])[backend]
    if reasons:
        pytest.skip(f"{backend} declares it cannot serve this call: {reasons}")
    failures = [str(c) for c in check_backend(case, backend) if not c.ok]
    assert not failures, f"{backend} on {case.describe()}:\n" + "\n".join(failures)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", list(RAGGED_CASES))
def test_ragged_call_agrees_with_the_oracle(name: str, backend: str) -> None:
    """§12: outputs, lse and gradients of attend_varlen equal the oracle's on the attend call it stands for; §13:
    attend_paged equals attend on the gathered keys, whatever the blocks' order and sharing, with NaN in every slot
    no sequence reads."""
    _assert_agrees(RAGGED_CASES[name], backend)


def test_cpu_flash_split_k_merges_like_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split-K (each row's keys cut into ranges, merged by lse, §6) gives the oracle's result, for rows whose keys
    fill every range, some ranges and none (kv_lengths 600, 257, 16 with three ranges of 256-key tiles)."""
    cpu_flash = attnkit.get_backend("cpu-flash")
    if cpu_flash.available():
        pytest.skip(f"cpu-flash: {cpu_flash.available()}")
    from attnkit.backends.cpu_flash import backend as cpu_flash_module

    monkeypatch.setattr(cpu_flash_module, "decode_splits", lambda tasks, keys, threads: 3)
    kv_lengths = (600, 257, 16)
    table, num_blocks = shuffled_table(kv_lengths, block_size=16, seed=1, shared=2)
    case = paged_case(AttentionSpec(causal=True, layout="bshd"), 16, table, kv_lengths, num_blocks, len_q=1, heads_kv=2)
    _assert_agrees(case, "cpu-flash")


def test_varlen_in_jax_under_jit_is_each_sequence_alone() -> None:
    """§12 in JAX under jit, with static maxima: the same as one attend call per sequence (float64, x64)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    with jax.enable_x64(True):
        spec = AttentionSpec(causal=True)
        q_lens, kv_lens = [2, 0, 3], [4, 1, 3]
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((sum(q_lens), 2, 8)))
        k, v = (jnp.asarray(rng.standard_normal((sum(kv_lens), 1, 8))) for _ in range(2))
        cu_q, cu_k = (jnp.asarray(_offsets(lens).numpy()) for lens in (q_lens, kv_lens))

        @jax.jit
        def loss(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any) -> Any:
            out = attnkit.attend_varlen(spec, q, k, v, cu_q, cu_k, max_seqlen_q=3, max_seqlen_k=4,
                                        backend="jax-reference")  # fmt: skip
            return jnp.sum(out * out), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, cu_q, cu_k)
    tq, tk, tv = (torch.tensor(np.asarray(x)).requires_grad_(True) for x in (q, k, v))
    expected = []
    for s in range(3):
        rows, keys = slice(*_offsets(q_lens)[s : s + 2].tolist()), slice(*_offsets(kv_lens)[s : s + 2].tolist())
        expected.append(
            attnkit.attend(
                spec.replace(layout="bshd"), tq[None, rows], tk[None, keys], tv[None, keys], backend="torch-naive"
            )[0]
        )
    reference = torch.cat(expected)
    reference_grads = torch.autograd.grad((reference * reference).sum(), (tq, tk, tv))
    np.testing.assert_allclose(np.asarray(out), reference.detach().numpy(), rtol=1e-12, atol=1e-12)
    for grad, reference_grad in zip(grads, reference_grads):
        np.testing.assert_allclose(np.asarray(grad), reference_grad.numpy(), rtol=1e-12, atol=1e-12)


def test_varlen_per_sequence_alibi_slopes_in_one_packed_row() -> None:
    """§16 in §12: equal offsets with (n, Hq) slopes, which one packed row cannot carry, are still each sequence's
    call with its own slopes."""
    spec, lengths = AttentionSpec(causal=True), [3, 0, 4]
    q, k, v = (torch.randn(7, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([[0.5, 0.0], [1.0, 1.0], [0.25, 2.0]])
    cu = _offsets(lengths)
    out = attnkit.attend_varlen(spec, q, k, v, cu, cu, alibi_slopes=slopes)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = []
    for s in (0, 2):
        rows = slice(*cu[s : s + 2].tolist())
        expected.append(attnkit.attend(spec.replace(layout="bshd"), q[None, rows], k[None, rows], v[None, rows],
                                       alibi_slopes=slopes[s], backend="torch-naive")[0])  # fmt: skip
    reference = torch.cat(expected)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    for grad, reference_grad in zip(grads, torch.autograd.grad(reference.square().sum(), (q, k, v))):
        torch.testing.assert_close(grad, reference_grad, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# attend_paged


def test_paged_blocks_may_be_shared_between_sequences() -> None:
    """§13: two sequences reading one block (a shared prefix) see the same keys there."""
    spec = AttentionSpec(causal=True, layout="bshd")
    k_cache, v_cache = (torch.randn(4, 2, 1, 8, dtype=torch.float64) for _ in range(2))
    table = torch.tensor([[3, 1, -1], [3, 0, 2]], dtype=torch.int32)
    q = torch.randn(2, 1, 2, 8, dtype=torch.float64)
    kv_lengths = torch.tensor([3, 6])
    out = attnkit.attend_paged(spec, q, k_cache, v_cache, table, kv_lengths, dropout_p=0.0)  # (0: no dropout)
    for b, blocks in enumerate(([3, 1], [3, 0, 2])):
        keys, values = (torch.cat([cache[i] for i in blocks])[None] for cache in (k_cache, v_cache))
        n = int(kv_lengths[b])
        expected = attnkit.attend(spec, q[b : b + 1], keys[:, :n], values[:, :n], backend="torch-naive")
        torch.testing.assert_close(out[b : b + 1], expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# bad input

SPEC = AttentionSpec(causal=True, layout="bshd")


def _varlen_args(**changes: Any) -> dict[str, Any]:
    args = dict(q=torch.randn(6, 2, 8), k=torch.randn(6, 1, 8), v=torch.randn(6, 1, 8),
                cu_seqlens_q=_offsets([2, 4]), cu_seqlens_k=_offsets([2, 4]))  # fmt: skip
    return {**args, **changes}


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"cu_seqlens_q": torch.tensor([1, 2, 6], dtype=torch.int32)}, InvalidInputError, r"cu_seqlens_q\[0\]=1"),
        (
            {"cu_seqlens_k": torch.tensor([0, 4, 2], dtype=torch.int32), "cu_seqlens_q": _offsets([4, -2])},
            InvalidInputError,
            r"non-decreasing.*\[1\]=4 > .*\[2\]=2",
        ),  # fmt: skip
        ({"cu_seqlens_k": _offsets([2, 3])}, InvalidInputError, r"end at the packed length 6.*=5"),
        ({"cu_seqlens_q": _offsets([2, 4]).float()}, InvalidInputTypeError, "cu_seqlens_q has dtype float32"),
        ({"cu_seqlens_q": _offsets([6])}, InvalidInputError, "same number of sequences"),
        ({"q": torch.randn(1, 6, 2, 8)}, InvalidInputError, r"q must be 3-D"),
        ({"max_seqlen_q": 3}, InvalidInputError, r"max_seqlen_q=3 is less than the longest sequence's length 4"),
        ({"alibi_slopes": torch.ones(3, 2)}, InvalidInputError, r"alibi_slopes has shape \(3, 2\), expected"),
        ({"alibi_slopes": torch.tensor([0.5, -1.0])}, InvalidInputError, r"alibi_slopes must be finite and >= 0"),
        ({"dropout_p": 1.0}, InvalidInputError, r"dropout_p=1.0 is outside \[0, 1\)"),
        ({"dropout_p": "0.1"}, InvalidInputTypeError, "dropout_p must be a Python float"),
        ({"dropout_p": 0.1, "dropout_seed": -1}, InvalidInputError, r"dropout_seed=-1 is outside"),
    ],
)
def test_bad_varlen_input_names_the_argument(changes: dict[str, Any], error: type, message: str) -> None:
    args = _varlen_args(**changes)
    with pytest.raises(error, match=message):
        attnkit.attend_varlen(SPEC, *(args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")), **args)


def _paged_args(**changes: Any) -> dict[str, Any]:
    args = dict(q=torch.randn(2, 1, 2, 8), k_cache=torch.randn(5, 4, 1, 8), v_cache=torch.randn(5, 4, 1, 8),
                block_table=torch.tensor([[0, 3], [4, -1]], dtype=torch.int32),
                kv_lengths=torch.tensor([7, 4]))  # fmt: skip
    return {**args, **changes}


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        (
            {"block_table": torch.tensor([[0, 5], [4, -1]], dtype=torch.int32)},
            InvalidInputError,
            r"block_table\[0, 1\]=5 points outside the cache \(num_blocks=5\)",
        ),  # fmt: skip
        ({"kv_lengths": torch.tensor([7, 9])}, InvalidInputError, r"kv_lengths\[1\]=9 lies outside \[0, 8\]"),
        ({"kv_lengths": torch.tensor([7, 5])}, InvalidInputError, r"block_table\[1, 1\]=-1 points outside"),
        ({"block_table": torch.zeros(2, 2)}, InvalidInputTypeError, "block_table has dtype float32"),
        ({"block_table": torch.zeros(3, 2, dtype=torch.int32)}, InvalidInputError, r"block_table has shape \(3, 2\)"),
        ({"v_cache": torch.randn(5, 2, 1, 8)}, InvalidInputError, "v_cache has shape"),
        ({"q": torch.randn(2, 1, 2, 8, requires_grad=True)}, InvalidInputError, "q requires grad.*forward only"),
        ({"alibi_slopes": torch.ones(2, dtype=torch.float64)}, InvalidInputTypeError, "alibi_slopes has dtype float64"),
        (
            {"alibi_slopes": torch.tensor([[0.5, 1.0], [float("nan"), 0.0]])},
            InvalidInputError,
            r"alibi_slopes must be finite and >= 0, got \[nan\]",
        ),  # fmt: skip
        ({"dropout_p": 0.1}, InvalidInputError, r"dropout_p=0.1, but attend_paged is forward-only inference"),
        ({"dropout_p": None}, InvalidInputTypeError, "dropout_p must be a Python float"),
    ],
)
def test_bad_paged_input_names_the_argument(changes: dict[str, Any], error: type, message: str) -> None:
    args = _paged_args(**changes)
    with pytest.raises(error, match=message):
        attnkit.attend_paged(SPEC, *(args.pop(n) for n in ("q", "k_cache", "v_cache", "block_table", "kv_lengths")),
                             **args)  # fmt: skip
