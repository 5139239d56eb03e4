"""Extras of the cupy backend: where it reports itself unavailable and test-only, and on a CUDA device the real CuPy
path. Tiling, skipping and strides are proven on ``cupy-emulated`` by tests/test_kernel_backends.py, agreement on
everything else by the conformance suite."""

from __future__ import annotations

import pytest

import attnkit
from attnkit import AttentionSpec
from tests.conftest import available_backends

EMULATED = "cupy-emulated"


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
        got, want = got.detach().double().cpu(), want.detach()
        # rows that see no key (the second batch element's first queries, bottom-right): lse −inf in both, exactly
        assert torch.equal(got == -torch.inf, want == -torch.inf), f"{name}: −inf entries differ"
        finite = want != -torch.inf
        error = (got[finite] - want[finite]).abs().max().item()
        scale = max(1.0, want[finite].abs().max().item())
        assert error <= bound * scale, f"{name}: max error {error:.3g} > {bound * scale:.3g}"


@on_cuda
def test_cupy_arrays_in_and_out() -> None:
    """CuPy arrays through DLPack, no copy: the result equals the torch call on the same memory."""
    import cupy
    import torch

    from attnkit.frontends.cupy_arrays import attend_cupy

    q, k, v = (cupy.random.standard_normal((2, 4, 130, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    spec = AttentionSpec(causal=True)
    out, lse = attend_cupy(spec, q, k, v, return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.shape == (2, 4, 130, 64) and lse.dtype == cupy.float32
    expected = attnkit.attend(spec, *(torch.from_dlpack(x) for x in (q, k, v)), backend="cupy")
    torch.testing.assert_close(torch.from_dlpack(out), expected, rtol=0, atol=0)
