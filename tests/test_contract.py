"""Each clause of docs/semantics.md, on every available backend, against the float64 oracle.

The property test (test_conformance.py) draws everything; these pin the clauses that a random draw
reaches only rarely, and the exact structural promises (zeros, -inf, NaN) that tolerances cannot show.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit
from attnkit import AttentionSpec
from attnkit.testing import Case, assert_backends_agree, backends_for, check_backend
from attnkit.testing.agreement import compare, oracle_results, rounded
from attnkit.testing.cases import make_arrays
from attnkit.testing.runners import native_framework, run_backend, run_torch
from tests.conftest import backend_params

BACKENDS = backend_params()

# Drawn by the dev profile: one element without queries, whose zero padding row the float16 literal baseline (the
# tolerance rule's) once normalised to 0/0, so that its dk was NaN and the rule fell to its floor (test_oracle.py).
COSINE_WITHOUT_QUERIES = Case(
    spec=AttentionSpec(variant="cosine"),
    heads_q=1,
    len_q=1,
    len_k=2,
    head_dim=32,
    head_dim_v=32,
    dtype="float16",
    q_lengths=(1, 0),
)

# §4.5's drawings: packed documents (element 1's ids unsorted and split), left padding, decode against a left-padded
# cache, and an element with no real query or key. Most at the default shape, so that compiled backends reuse it.
PACKED = ((0, 0, 0, 1, 1, 2, -1, -1), (5, 5, 1, 1, 1, 5, 5, -1))
LEFT_PADDED = ((-1, -1, -1, 0, 0, 0, 0, 0), (0,) * 8)
LEFT_PADDED_CACHE = ((-1, -1, -1, 0, 0, 0, 0, 0, 0), (-1, 0, 0, 0, 0, 0, 0, 0, 0))
ALL_PADDING = ((-1,) * 8, (0, 0, 1, 1, -1, 2, 2, 2))
# Padding in every place a packed row has it (before, between and after documents), and an element all padding.
SEGMENT_PADDING = Case(
    spec=AttentionSpec(causal=True),
    q_segment_ids=((-1, 0, 0, 1, 1, -1, 2, -1), (-1,) * 8),
    kv_segment_ids=((-1, 0, 0, 1, 1, -1, 2, -1), (-1,) * 8),
)

CLAUSES = {
    # §1 layouts and shapes
    "§1 bshd": Case(spec=AttentionSpec(layout="bshd", causal=True), heads_q=4, heads_kv=2),
    "§1 3-D": Case(spec=AttentionSpec(causal=True), heads_q=1, three_d=True, mask_shape=(2, 8, 8)),
    "§1 Lq<Lk, Dv≠D": Case(spec=AttentionSpec(), len_q=3, len_k=11, head_dim=24, head_dim_v=40),
    "§1 decode Lq=1": Case(spec=AttentionSpec(causal=True), len_q=1, len_k=37, heads_q=8, heads_kv=2),
    # §2 GQA / MQA
    "§2 GQA 4:1": Case(spec=AttentionSpec(), heads_q=8, heads_kv=2),
    "§2 MQA": Case(spec=AttentionSpec(causal=True), heads_q=4, heads_kv=1),
    # §3 scores
    "§3 scale": Case(spec=AttentionSpec(scale=0.37)),
    "§3 cosine": Case(spec=AttentionSpec(variant="cosine")),
    "§3 cosine float16, no queries in one element": COSINE_WITHOUT_QUERIES,
    "§3 softcap": Case(spec=AttentionSpec(softcap=1.5, scale=1.0)),
    "§3 bias+dbias": Case(spec=AttentionSpec(softcap=5.0), bias_shape=(1, 2, 8, 8), bias_grad=True),
    "§3 broadcast bias": Case(spec=AttentionSpec(), bias_shape=(8,), bias_grad=True),
    # §4 visibility
    "§4.1 bottom-right Lq>Lk": Case(spec=AttentionSpec(causal=True), len_q=9, len_k=4),
    "§4.1 top-left Lq<Lk": Case(spec=AttentionSpec(causal=True, causal_alignment="top_left"), len_q=4, len_k=9),
    "§4.2 window": Case(spec=AttentionSpec(window=(2, 1)), len_q=12, len_k=12),
    "§4.2 sliding causal": Case(spec=AttentionSpec(causal=True, window=(3, 0)), len_q=5, len_k=12),
    "§4.2 window top-left open": Case(spec=AttentionSpec(window=(None, 2), causal_alignment="top_left")),
    "§4.3 kv_lengths ragged cache": Case(spec=AttentionSpec(causal=True), len_q=3, len_k=8, kv_lengths=(8, 5)),
    "§4.3 both lengths": Case(spec=AttentionSpec(causal=True), len_q=6, len_k=6, q_lengths=(6, 2), kv_lengths=(6, 2)),
    "§4.3 zero lengths": Case(spec=AttentionSpec(), q_lengths=(0, 3), kv_lengths=(5, 0)),
    "§4.4 mask": Case(spec=AttentionSpec(), mask_shape=(2, 2, 8, 8)),
    "§4.5 packed documents": Case(spec=AttentionSpec(causal=True), q_segment_ids=PACKED, kv_segment_ids=PACKED),
    "§4.5 left padding": Case(spec=AttentionSpec(causal=True), q_segment_ids=LEFT_PADDED, kv_segment_ids=LEFT_PADDED),
    "§4.5 decode, left-padded cache": Case(
        spec=AttentionSpec(causal=True),
        len_q=1,
        len_k=9,
        heads_q=4,
        heads_kv=2,
        q_segment_ids=((0,), (0,)),
        kv_segment_ids=LEFT_PADDED_CACHE,
    ),
    "§4.5 all-padding row, window": Case(
        spec=AttentionSpec(window=(2, 1)), q_segment_ids=ALL_PADDING, kv_segment_ids=ALL_PADDING[::-1]
    ),
    # §5 fully masked rows
    "§5 masked rows": Case(spec=AttentionSpec(causal=True), mask_shape=(2, 1, 8, 8), masked_rows=(0, 5)),
    # §7 dtypes
    "§7 float16": Case(spec=AttentionSpec(causal=True), dtype="float16", len_q=16, len_k=16),
    "§7 bfloat16": Case(spec=AttentionSpec(causal=True), dtype="bfloat16", len_q=16, len_k=16),
    "§7 head_dim 80": Case(spec=AttentionSpec(causal=True), head_dim=80, head_dim_v=80),
    "§7 head_dim 256": Case(spec=AttentionSpec(), head_dim=256, head_dim_v=256, len_q=4, len_k=6),
    # §16 ALiBi: per query head under GQA, bottom-right; per batch element with lengths moving each element's offset,
    # top-left window; across packed documents
    "§16 ALiBi, GQA, causal Lq<Lk": Case(
        spec=AttentionSpec(causal=True), heads_q=4, heads_kv=2, len_q=5, len_k=9, alibi_shape=(4,)
    ),
    "§16 ALiBi (B, Hq), lengths, top-left window": Case(
        spec=AttentionSpec(window=(3, 1), causal_alignment="top_left"),
        q_lengths=(8, 3),
        kv_lengths=(6, 8),
        alibi_shape=(2, 2),
    ),
    "§16 ALiBi (B, Hq), lengths, bottom-right": Case(
        spec=AttentionSpec(), len_q=4, len_k=8, kv_lengths=(8, 5), q_lengths=(4, 2), alibi_shape=(2, 2)
    ),
    "§16 ALiBi, packed documents": Case(
        spec=AttentionSpec(causal=True), q_segment_ids=PACKED, kv_segment_ids=PACKED, alibi_shape=(2,)
    ),
}


def _runnable(case: Case, backend: str) -> None:
    reasons = backends_for(case, [backend])[backend]
    if reasons:
        pytest.skip(f"{backend} declares it cannot serve this clause: {reasons}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clause", list(CLAUSES))
def test_clause_agrees_with_oracle(clause: str, backend: str) -> None:
    case = CLAUSES[clause]
    _runnable(case, backend)
    # Each clause again in bfloat16, except on JAX backends, where each is a second compiled program (seconds in CI):
    # their half precision is the §7 clauses' and the conformance draws'.
    twice = case.dtype == "float32" and native_framework(backend) is not attnkit.Framework.JAX
    for dtype in ("float32", "bfloat16") if twice else (case.dtype,):
        assert_backends_agree(case.with_(dtype=dtype), backends=[backend])


def _run(case: Case, backend: str) -> dict[str, np.ndarray]:
    return run_backend(case, rounded(case, make_arrays(case)), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_exact_zeros_with_zero_gradients(backend: str) -> None:
    """§5: out exactly 0, lse exactly -inf, gradients exactly 0 for rows that see no key; no NaN anywhere."""
    case = Case(
        spec=AttentionSpec(causal=True),
        len_q=10,
        len_k=4,  # bottom-right: rows 0..5 see no key
        mask_shape=(1, 1, 10, 4),
        masked_rows=(8,),
        kv_lengths=(4, 2),
        bias_shape=(1, 2, 10, 4),
        bias_grad=True,
    )
    _runnable(case, backend)
    results = _run(case, backend)
    empty_rows = [0, 1, 2, 3, 4, 5, 8]
    assert np.all(results["out"][:, :, empty_rows] == 0)
    assert np.all(np.isneginf(results["lse"][:, :, empty_rows]))
    assert np.all(results["dq"][:, :, empty_rows] == 0)
    assert np.all(results["dbias"][:, :, empty_rows] == 0)
    for name, value in results.items():
        finite_expected = value if name != "lse" else value[~np.isneginf(value)]
        assert np.isfinite(finite_expected).all(), f"{name} has NaN/Inf for finite inputs"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_nan_at_a_visible_position_propagates(backend: str, tensor: str) -> None:
    """§5: NaN in never becomes a quiet 0."""
    case = Case(spec=AttentionSpec(causal=True), batch=1, heads_q=1, len_q=4, len_k=4, grad=False)
    _runnable(case, backend)
    arrays = make_arrays(case)
    arrays[tensor][0, 0, 0, 0] = np.nan  # query 0 / key 0 are visible to row 0 (and key 0 to every row)
    results = run_backend(case, arrays, backend)
    assert np.isnan(results["out"][0, 0, 0]).any()
    if tensor != "v":
        assert np.isnan(results["lse"][0, 0, 0]), "a NaN score must give a NaN lse, not -inf or a number"
    if tensor != "q":
        assert np.isnan(results["out"][0, 0]).any(axis=-1).all(), "key 0 is visible to every row"


def _poisoned_at_padding(case: Case, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The (bhsd) arrays with NaN in q and k and Inf in v wherever the segment id is negative."""
    poisoned = dict(arrays)
    for name, ids, value in (
        ("q", "q_segment_ids", np.nan),
        ("k", "kv_segment_ids", np.nan),
        ("v", "kv_segment_ids", np.inf),
    ):
        padding = (arrays[ids] < 0)[:, None, :, None]
        poisoned[name] = np.where(padding, value, arrays[name])
    return poisoned


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_by_segment_ids_is_not_input(backend: str) -> None:
    """§5, §4.5: NaN and Inf at positions whose segment id is negative reach no output or gradient: the backend on
    poisoned inputs agrees with the oracle on finite ones. Torch backends also without lse, which some serve by
    another path (torch-sdpa's masked SDPA call)."""
    _runnable(SEGMENT_PADDING, backend)
    arrays = rounded(SEGMENT_PADDING, make_arrays(SEGMENT_PADDING))
    poisoned = _poisoned_at_padding(SEGMENT_PADDING, arrays)
    comparisons = compare(
        SEGMENT_PADDING, run_backend(SEGMENT_PADDING, poisoned, backend), *oracle_results(SEGMENT_PADDING, arrays)
    )
    if native_framework(backend) is attnkit.Framework.TORCH:
        arrays["dlse"] = poisoned["dlse"] = np.zeros_like(arrays["dlse"])  # out alone is differentiated
        exact, baseline = oracle_results(SEGMENT_PADDING, arrays)
        results = run_torch(SEGMENT_PADDING, poisoned, backend, return_lse=False)
        comparisons += compare(SEGMENT_PADDING, results, {name: exact[name] for name in results}, baseline)
    assert all(c.ok for c in comparisons), [str(c) for c in comparisons if not c.ok]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("segment_ids", [False, True], ids=["", "segment ids"])
@pytest.mark.parametrize("extent", [{"batch": 0}, {"len_q": 0}, {"len_k": 0}], ids=["B=0", "Lq=0", "Lk=0"])
def test_empty_extents_work(backend: str, extent: dict[str, int], segment_ids: bool) -> None:
    """§9: empty batch or queries give empty outputs; no keys give zeros and lse -inf; with segment ids too (§4.5)."""
    case = Case(spec=AttentionSpec(causal=True), **extent)
    if segment_ids:  # every id drawn from −1..1, padding included
        ids = [tuple(position % 3 - 1 for position in range(length)) for length in (case.len_q, case.len_k)]
        case = case.with_(q_segment_ids=(ids[0],) * case.batch, kv_segment_ids=(ids[1],) * case.batch)
    _runnable(case, backend)
    results = _run(case, backend)
    assert results["out"].shape == (case.batch, 2, case.len_q, 16)
    assert results["lse"].shape == (case.batch, 2, case.len_q)
    assert results["dk"].shape == (case.batch, 1, case.len_k, 16)
    if extent.get("len_k") == 0:
        assert np.all(results["out"] == 0) and np.all(np.isneginf(results["lse"]))
        assert np.all(results["dq"] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_flows_through_lse_alone(backend: str) -> None:
    """§6: d(lse)/dq is not zero and matches the oracle when out gets no cotangent."""
    case = Case(spec=AttentionSpec(causal=True))
    _runnable(case, backend)
    comparisons = {c.output: c for c in check_backend(case.with_(dtype="float32"), backend)}
    assert all(c.ok for c in comparisons.values()), comparisons
    # and separately, with dout = 0, through the public API
    if native_framework(backend) is not attnkit.Framework.TORCH:
        return
    q = torch.randn(1, 2, 5, 16, dtype=torch.float32, requires_grad=True)
    k, v = torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16)
    _, lse = attnkit.attend(case.spec, q, k, v, return_lse=True, backend=backend)
    (grad,) = torch.autograd.grad(lse.sum(), q)
    q64 = q.detach().double().requires_grad_(True)
    _, lse64 = attnkit.attend(case.spec, q64, k.double(), v.double(), return_lse=True, backend="torch-naive")
    (expected,) = torch.autograd.grad(lse64.sum(), q64)
    assert grad.abs().max() > 0
    torch.testing.assert_close(grad.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend: str) -> None:
    """§1: strided views give the same answer as their contiguous copies."""
    if "torch" not in {f.value for f in attnkit.get_backend(backend).capabilities.frameworks}:
        pytest.skip(f"{backend} does not take torch tensors (JAX arrays have no strides)")
    spec = AttentionSpec(causal=True)
    base = torch.randn(2, 6, 2, 16 * 2)
    q = base[..., ::2]  # last-dim stride 2
    k = torch.randn(2, 7, 1, 16).transpose(1, 2)  # bshd storage viewed as bhsd
    q = q.transpose(1, 2)
    v = torch.randn(2, 1, 16, 7).transpose(-1, -2)
    out = attnkit.attend(spec, q, k, v, backend=backend)
    expected = attnkit.attend(spec, q.contiguous(), k.contiguous(), v.contiguous(), backend="torch-naive")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_protocol_backward_gives_the_oracle_gradients(backend: str) -> None:
    """The protocol's own ``forward`` then ``backward`` (what a plugin that wraps a backend calls; ``attend`` may take
    another route, ``differentiable_forward``) give the oracle's gradients, lse's cotangent included (§6)."""
    if native_framework(backend) is not attnkit.Framework.TORCH:
        pytest.skip(f"{backend} runs JAX arrays (its backward is exercised through jax.vjp)")
    case = Case(spec=AttentionSpec(causal=True, window=(4, None)), heads_q=4, heads_kv=2, len_q=6, len_k=9)
    _runnable(case, backend)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, length, 16, generator=generator) for heads, length in ((4, 6), (2, 9), (2, 9)))
    inputs = attnkit.AttentionInputs(q, k, v, None, None, None, None)
    chosen = attnkit.get_backend(backend)
    out, lse = chosen.forward(case.spec, inputs, need_lse=True)
    dout, dlse = torch.randn(out.shape, generator=generator), torch.randn(lse.shape, generator=generator)
    gradients = chosen.backward(case.spec, inputs, out, lse, dout, dlse, need_dbias=False)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    out64, lse64 = attnkit.attend(case.spec, *leaves, return_lse=True, backend="torch-naive")
    expected = torch.autograd.grad((out64, lse64), leaves, (dout.double(), dlse.double()))
    for name, got, want in zip(("dq", "dk", "dv"), (gradients.dq, gradients.dk, gradients.dv), expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=name)
