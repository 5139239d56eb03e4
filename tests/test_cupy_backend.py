"""Extras of the cupy backend: on CPU through the emulation harness (``cupy-emulated``): several tiles per sequence,
tiles the geometry hides are never loaded, strided inputs read in place; on a CUDA device, the real CuPy path.
Agreement on everything else comes from the conformance suite, which runs on ``cupy-emulated``."""

from __future__ import annotations

import numpy as np
import pytest

import attnkit
from attnkit import AttentionSpec
from attnkit.testing import Case, assert_backends_agree, make_arrays
from attnkit.testing.agreement import rounded
from attnkit.testing.runners import run_torch
from tests.conftest import available_backends

EMULATED = "cupy-emulated"
emulated = pytest.mark.skipif(EMULATED not in available_backends(), reason="no host C++ compiler for the emulator")

# Sequences of several 16-wide emulator tiles (the conformance shapes stay within two), not multiples of it.
MULTI_TILE_CASES = [
    Case(spec=AttentionSpec(causal=True), len_q=50, len_k=70, heads_q=4, heads_kv=2),
    Case(spec=AttentionSpec(causal=True, causal_alignment="top_left"), len_q=70, len_k=41, kv_lengths=(41, 17)),
    Case(spec=AttentionSpec(window=(9, 3), softcap=8.0), len_q=49, len_k=49, bias_shape=(1, 2, 49, 49), bias_grad=True),
    Case(spec=AttentionSpec(causal=True), len_q=1, len_k=67, heads_q=8, heads_kv=1, dtype="bfloat16"),
    Case(spec=AttentionSpec(variant="cosine"), len_q=35, len_k=36, q_lengths=(35, 3), mask_shape=(2, 1, 35, 36)),
    Case(spec=AttentionSpec(causal=True), len_q=33, len_k=33, head_dim=80, head_dim_v=48, dtype="float16"),
]


@emulated
@pytest.mark.parametrize("case", MULTI_TILE_CASES, ids=range(len(MULTI_TILE_CASES)))
def test_several_tiles_agree_with_the_oracle(case: Case) -> None:
    assert_backends_agree(case, backends=[EMULATED])


def _tile() -> int:
    from attnkit.backends.cupy import launch

    assert launch.EMULATOR_TILE.block_m == launch.EMULATOR_TILE.block_n
    return launch.EMULATOR_TILE.block_m


def _poisoned(case: Case, keys: slice = slice(0, 0), rows: slice = slice(0, 0)) -> dict[str, np.ndarray]:
    arrays = rounded(case, make_arrays(case))
    arrays["k"][:, :, keys] = arrays["v"][:, :, keys] = np.nan
    arrays["q"][:, :, rows] = arrays["dout"][:, :, rows] = np.nan
    return arrays


@emulated
def test_forward_never_loads_key_tiles_outside_the_band() -> None:
    """NaN keys in a tile the causal band hides from a query tile must not reach it: a kernel that loaded the tile
    and only masked it would compute 0·NaN = NaN in P·V (docs/semantics.md §5)."""
    tile = _tile()
    case = Case(spec=AttentionSpec(causal=True), len_q=4 * tile, len_k=4 * tile, grad=False)
    results = run_torch(case, _poisoned(case, keys=slice(3 * tile, 4 * tile)), EMULATED)
    assert np.isfinite(results["out"][:, :, : 3 * tile]).all()
    assert np.isnan(results["out"][:, :, 3 * tile :]).all(axis=-1).all()


@emulated
def test_window_loads_only_the_band() -> None:
    tile = _tile()
    case = Case(spec=AttentionSpec(causal=True, window=(4, 0)), len_q=4 * tile, len_k=4 * tile, grad=False)
    results = run_torch(case, _poisoned(case, keys=slice(0, tile)), EMULATED)
    assert np.isfinite(results["out"][:, :, 2 * tile :]).all()


@emulated
def test_backward_never_visits_query_tiles_outside_the_band() -> None:
    """NaN queries and output cotangents in the first row tile: causal, no later key tile sees those rows, so
    their dk and dv stay finite, which they would not if the dK/dV loop visited the row tile and masked it."""
    tile = _tile()
    case = Case(spec=AttentionSpec(causal=True), len_q=3 * tile, len_k=3 * tile)
    results = run_torch(case, _poisoned(case, rows=slice(0, tile)), EMULATED)
    for name in ("dk", "dv"):
        assert np.isfinite(results[name][:, :, tile:]).all(), name
        assert np.isnan(results[name][:, :, :tile]).any(), name
    assert np.isfinite(results["dq"][:, :, tile:]).all()


@emulated
def test_strided_inputs_give_the_contiguous_result() -> None:
    import torch
    from attnkit.backends.cupy import launch

    torch.manual_seed(0)
    wide = torch.randn(2, 9, 3, 40)
    sliced = wide[..., :32]  # (B, L, H, 32) with a row stride of 40: read in place
    view = launch.bhsd(AttentionSpec(layout="bshd"), sliced)
    assert view.data_ptr() == sliced.data_ptr() and view.stride() == (9 * 3 * 40, 40, 3 * 40, 1)
    spec = AttentionSpec(causal=True, layout="bshd")
    q, k, v = (torch.randn(2, 21, 4, 48)[..., :24] for _ in range(3))
    out = attnkit.attend(spec, q, k[:, :, :2], v[:, :, :2], backend=EMULATED)
    expected = attnkit.attend(
        spec, q.contiguous(), k[:, :, :2].contiguous(), v[:, :, :2].contiguous(), backend=EMULATED
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_cupy_reports_why_it_is_unavailable() -> None:
    reasons = attnkit.get_backend("cupy").available()
    if not reasons:
        pytest.skip("cupy runs here")
    assert any("cupy" in reason or "CUDA" in reason for reason in reasons), reasons


def test_emulated_backend_is_test_only_outside_the_suite() -> None:
    from attnkit.backends.cupy.backend import TEST_ONLY_REASON, CupyBackend

    assert CupyBackend.emulated().available() == [TEST_ONLY_REASON]
    assert CupyBackend.emulated().capabilities == attnkit.get_backend(EMULATED).capabilities


# ---------------------------------------------------------------------------------------------- on a GPU

on_cuda = pytest.mark.skipif(
    "cupy" not in available_backends(),
    reason="the real CuPy path needs cupy and a CUDA device: "
    + "; ".join(attnkit.get_backend("cupy").available() or ["available"]),
)


@on_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(
    "spec", [AttentionSpec(), AttentionSpec(causal=True, window=(100, 0), softcap=20.0)], ids=["plain", "features"]
)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_agrees_with_the_oracle(dtype: str, spec: AttentionSpec, head_dim: int) -> None:
    """The real path: NVRTC-compiled kernels on CUDA tensors, outputs and gradients against torch-naive in float64
    on the same (rounded) inputs, within a bound per dtype (GPU shapes: several 64-wide tiles, a ragged cache)."""
    import torch

    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    shapes = {"q": (2, 4, 300, head_dim), "k": (2, 2, 333, head_dim), "v": (2, 2, 333, head_dim)}
    leaves = {name: torch.randn(shape).to(torch_dtype) for name, shape in shapes.items()}
    lengths = torch.tensor([333, 170])
    results = {}
    for backend, device, compute in (("cupy", "cuda", torch_dtype), ("torch-naive", "cpu", torch.float64)):
        inputs = {n: x.to(device=device, dtype=compute).requires_grad_(True) for n, x in leaves.items()}
        out, lse = attnkit.attend(spec, **inputs, kv_lengths=lengths.to(device), return_lse=True, backend=backend)
        grads = torch.autograd.grad((out.float().square().sum() + lse.sum()), list(inputs.values()))
        results[backend] = [out, lse, *grads]
    bound = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), results["cupy"], results["torch-naive"]):
        error = (got.double().cpu() - want.detach()).abs().max().item()
        scale = max(1.0, want.detach().abs().max().item())
        assert error <= bound * scale, f"{name}: max error {error:.3g} > {bound * scale:.3g}"


@on_cuda
def test_cupy_arrays_in_and_out() -> None:
    """CuPy arrays through DLPack, no copy: the result equals the torch call on the same memory."""
    import cupy
    import torch
    from attnkit.backends.cupy import attend_cupy

    q, k, v = (cupy.random.standard_normal((2, 4, 130, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    spec = AttentionSpec(causal=True)
    out, lse = attend_cupy(spec, q, k, v, return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.shape == (2, 4, 130, 64) and lse.dtype == cupy.float32
    expected = attnkit.attend(spec, *(torch.from_dlpack(x) for x in (q, k, v)), backend="cupy")
    torch.testing.assert_close(torch.from_dlpack(out), expected, rtol=0, atol=0)
