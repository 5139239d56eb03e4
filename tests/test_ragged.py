"""attend_varlen and attend_paged (docs/semantics.md §12, §13) on every backend that serves them, against the float64
oracle under the tolerance rule: each call is run as the attend call the contract says it equals (a Case: one packed
row with segment ids, a right-padded batch with lengths, or contiguous keys with kv_lengths), its arrays converted to
the ragged layout and back. Plus each bad input's typed error."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import attnkit
from attnkit import AttentionSpec, Feature, InvalidInputError, InvalidInputTypeError
from attnkit.testing import Case, backends_for
from attnkit.testing.agreement import compare, oracle_results, rounded
from attnkit.testing.cases import make_arrays
from attnkit.testing.runners import harness_device, native_framework, run_torch
from tests.conftest import backend_params

TORCH_BACKENDS = [p for p in backend_params() if native_framework(p.values[0]).value == "torch"]


def _bshd(spec: AttentionSpec) -> AttentionSpec:
    return AttentionSpec(**{**spec.model_dump(), "layout": "bshd"})


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)


def _packed_case(spec: AttentionSpec, lengths: list[int], **shape: Any) -> Case:
    """Self-attention over packed documents: one bshd row whose segment id is the document's index."""
    ids = tuple(s for s, n in enumerate(lengths) for _ in range(n))
    return Case(spec=_bshd(spec), batch=1, len_q=len(ids), len_k=len(ids),
                q_segment_ids=(ids,), kv_segment_ids=(ids,), **shape)  # fmt: skip


def _varlen_self(case: Case, tensors: dict[str, Any], backend: str, return_lse: bool = True) -> Any:
    cu = _offsets([list(case.q_segment_ids[0]).count(s) for s in range(max(case.q_segment_ids[0]) + 1)])
    result = attnkit.attend_varlen(case.spec, tensors["q"][0], tensors["k"][0], tensors["v"][0], cu, cu,
                                   return_lse=return_lse, backend=backend)  # fmt: skip
    return (result[0][None], result[1][None]) if return_lse else result[None]


def _varlen_cross(case: Case, tensors: dict[str, Any], backend: str, return_lse: bool = True) -> Any:
    """The padded batch of the case packed (its real rows only), through attend_varlen, and padded back."""
    q_lens, kv_lens = list(case.q_lengths), list(case.kv_lengths)
    pack = lambda x, lens: torch.cat([x[b, :n] for b, n in enumerate(lens)])  # noqa: E731
    out, lse = attnkit.attend_varlen(
        case.spec, pack(tensors["q"], q_lens), pack(tensors["k"], kv_lens), pack(tensors["v"], kv_lens),
        _offsets(q_lens), _offsets(kv_lens), return_lse=True, backend=backend,
    )  # fmt: skip
    padded_out = out.new_zeros(case.batch, case.len_q, *out.shape[1:])
    padded_lse = lse.new_full((case.batch, lse.shape[0], case.len_q), float("-inf"))
    starts = _offsets(q_lens).tolist()
    for b, n in enumerate(q_lens):
        padded_out[b, :n] = out[starts[b] : starts[b] + n]
        padded_lse[b, :, :n] = lse[:, starts[b] : starts[b] + n]
    return (padded_out, padded_lse) if return_lse else padded_out


VARLEN = {
    "packed, causal window, one-token and crossing documents": (
        _varlen_self,
        _packed_case(AttentionSpec(causal=True, window=(5, 0)), [7, 1, 20, 4], heads_q=4, heads_kv=2),
    ),
    "packed, bidirectional, softcap": (_varlen_self, _packed_case(AttentionSpec(softcap=3.0), [3, 17, 2])),
    "cross lengths, bottom-right, an empty sequence of each kind": (
        _varlen_cross,
        Case(
            spec=AttentionSpec(causal=True, layout="bshd"),
            batch=4,
            heads_q=4,
            heads_kv=1,
            len_q=6,
            len_k=9,
            q_lengths=(1, 6, 0, 3),
            kv_lengths=(9, 4, 2, 0),
        ),  # fmt: skip
    ),
    "cross lengths, top-left": (
        _varlen_cross,
        Case(
            spec=AttentionSpec(causal=True, causal_alignment="top_left", layout="bshd"),
            batch=2,
            len_q=5,
            len_k=3,
            q_lengths=(5, 2),
            kv_lengths=(3, 3),
        ),  # fmt: skip
    ),
}


def _agree(case: Case, backend: str, call: Any) -> None:
    reasons = backends_for(case, [backend])[backend]
    if reasons:
        pytest.skip(f"{backend} declares it cannot serve the equivalent attend call: {reasons}")
    arrays = rounded(case, make_arrays(case))
    exact, baseline = oracle_results(case, arrays)
    results = run_torch(case, arrays, backend, device=harness_device(backend), call=call)
    failures = [str(c) for c in compare(case, results, exact, baseline) if not c.ok]
    assert not failures, f"{backend} on {case.describe()}:\n" + "\n".join(failures)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("name", list(VARLEN))
def test_varlen_agrees_with_the_oracle(name: str, backend: str) -> None:
    """§12: outputs, lse and gradients of attend_varlen equal the oracle's on the attend call it stands for."""
    call, case = VARLEN[name]
    _agree(case, backend, call)


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
            attnkit.attend(_bshd(spec), tq[None, rows], tk[None, keys], tv[None, keys], backend="torch-naive")[0]
        )
    reference = torch.cat(expected)
    reference_grads = torch.autograd.grad((reference * reference).sum(), (tq, tk, tv))
    np.testing.assert_allclose(np.asarray(out), reference.detach().numpy(), rtol=1e-12, atol=1e-12)
    for grad, reference_grad in zip(grads, reference_grads):
        np.testing.assert_allclose(np.asarray(grad), reference_grad.numpy(), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# attend_paged


def _paged_call(block_size: int, seed: int) -> Any:
    """attend on a case's contiguous keys, made into a paged cache: blocks in a shuffled order, unreferenced blocks and
    unread slots full of NaN, table entries past each sequence's blocks −1."""

    def call(case: Case, tensors: dict[str, Any], backend: str, return_lse: bool = True) -> Any:
        rng = np.random.default_rng(seed)
        k, v, lengths = tensors["k"], tensors["v"], tensors["kv_lengths"]
        if case.spec.layout.value == "bhsd":  # the cache's blocks hold (slot, head, dim) whatever q's layout
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        per_sequence = -(-case.len_k // block_size)
        num_blocks = case.batch * per_sequence + 2
        order = rng.permutation(num_blocks)
        caches = []
        for x in (k, v):
            cache = x.new_full((num_blocks, block_size, *x.shape[2:]), float("nan"))
            padded = torch.cat([x, x.new_full((case.batch, per_sequence * block_size - case.len_k, *x.shape[2:]),
                                              float("nan"))], dim=1)  # fmt: skip
            blocks = padded.reshape(case.batch * per_sequence, block_size, *x.shape[2:])
            cache[torch.as_tensor(order[: len(blocks)])] = blocks
            caches.append(cache)
        table = torch.as_tensor(order[: case.batch * per_sequence], dtype=torch.int32).reshape(case.batch, -1)
        table = torch.cat([table, torch.full((case.batch, 1), -1, dtype=torch.int32)], dim=1)
        with torch.no_grad():
            return attnkit.attend_paged(case.spec, tensors["q"], caches[0], caches[1], table, lengths,
                                        return_lse=return_lse, backend=backend)  # fmt: skip

    return call


PAGED = {
    "decode, GQA, partial last block": (
        Case(
            spec=AttentionSpec(causal=True, layout="bshd"),
            batch=3,
            heads_q=4,
            heads_kv=2,
            len_q=1,
            len_k=21,
            kv_lengths=(21, 5, 0),
            grad=False,
        ),  # fmt: skip
        4,
    ),
    "chunked prefill, window, block of 1": (
        Case(
            spec=AttentionSpec(causal=True, window=(6, 0)), batch=2, len_q=3, len_k=10, kv_lengths=(10, 7), grad=False
        ),  # fmt: skip
        1,
    ),
}


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", list(PAGED))
def test_paged_agrees_with_the_oracle(name: str, backend: str) -> None:
    """§13: attend_paged equals attend on the gathered keys, whatever the blocks' order, with NaN in every slot and
    block the table does not reach; on each backend declaring ``paged``."""
    case, block_size = PAGED[name]
    if Feature.PAGED not in attnkit.get_backend(backend).capabilities.features:
        pytest.skip(f"{backend} does not declare {Feature.PAGED}")
    if native_framework(backend).value != "torch":
        pytest.skip("the paged conformance runs torch tensors; JAX backends are checked in their own tests")
    _agree(case, backend, _paged_call(block_size, seed=len(name)))


def test_paged_blocks_may_be_shared_between_sequences() -> None:
    """§13: two sequences reading one block (a shared prefix) see the same keys there."""
    spec = AttentionSpec(causal=True, layout="bshd")
    k_cache, v_cache = (torch.randn(4, 2, 1, 8, dtype=torch.float64) for _ in range(2))
    table = torch.tensor([[3, 1, -1], [3, 0, 2]], dtype=torch.int32)
    q = torch.randn(2, 1, 2, 8, dtype=torch.float64)
    kv_lengths = torch.tensor([3, 6])
    out = attnkit.attend_paged(spec, q, k_cache, v_cache, table, kv_lengths)
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
    ],
)
def test_bad_paged_input_names_the_argument(changes: dict[str, Any], error: type, message: str) -> None:
    args = _paged_args(**changes)
    with pytest.raises(error, match=message):
        attnkit.attend_paged(SPEC, *(args[n] for n in ("q", "k_cache", "v_cache", "block_table", "kv_lengths")))
