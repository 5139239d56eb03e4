"""Extras of the cupy backend: where it reports itself unavailable and test-only, and on a CUDA device the real CuPy
path. Tiling, skipping and strides are proven on ``cupy-emulated`` by tests/test_kernel_backends.py, agreement on
everything else by the conformance suite."""

from __future__ import annotations

from typing import Any

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
    # rows that see no key (the second batch element's first queries, bottom-right): lse −inf in both, exactly
    _assert_near_the_oracle(results["cupy"], results["torch-naive"], dtype)


def _assert_near_the_oracle(got_all: list[Any], want_all: list[Any], dtype: str) -> None:
    """out, lse, dq, dk, dv within a bound per dtype of the float64 oracle's, relative to its largest entry; −inf
    (rows that see nothing) exactly where the oracle has it."""
    import torch

    bound = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), got_all, want_all):
        got, want = got.detach().double().cpu(), want.detach()
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


@on_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("program", ["document-causal", "chunked-prefix"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_mask_program_agrees_with_the_oracle(dtype: str, program: str, head_dim: int) -> None:
    """The mask-program path on hardware (unverified until this passes; docs/gpu.md): the generated mask_program and
    the tile classes at the GPU tiles, forward and backward through the backend (its refusal on CUDA is the
    dispatcher's), 4 query heads on 2 kv heads, a ragged cache, against torch-naive in float64 given the program as
    a dense mask."""
    import torch

    from attnkit.backend import AttentionInputs
    from attnkit.contract.programs import dense
    from attnkit.frontends import ops_for
    from attnkit.programs import bind

    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    batch, heads_q, len_q, len_k = 2, 4, 300, 333
    q = torch.randn(batch, heads_q, len_q, head_dim, device="cuda").to(torch_dtype)
    k, v = (torch.randn(batch, 2, len_k, head_dim, device="cuda").to(torch_dtype) for _ in range(2))
    dout = torch.randn_like(q)
    lengths = torch.tensor([333, 170], device="cuda")
    doc = torch.cat([torch.full((len_k // 3,), i) for i in range(3)] + [torch.full((len_k % 3,), -1)]).cuda()
    doc = torch.stack([doc, doc.roll(37)])
    chunk, prefix = torch.tensor([64, 50], device="cuda"), torch.tensor([0, 128, 7, 0], device="cuda")

    def document_causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (doc[b, q_idx] == doc[b, kv_idx]) & (doc[b, q_idx] >= 0) & (q_idx >= kv_idx)

    def chunked_prefix(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (q_idx // chunk[b] == kv_idx // chunk[b]) | (kv_idx < prefix[h])

    mask_mod = document_causal if program == "document-causal" else chunked_prefix
    bound = bind(mask_mod, ops_for(q, "q"), q, batch, heads_q, len_q, len_k)
    spec = AttentionSpec()
    backend = attnkit.get_backend("cupy")
    inputs = AttentionInputs(q, k, v, kv_lengths=lengths, mask_program=bound)
    out, lse = backend.forward(spec, inputs, True)
    grads = backend.backward(spec, inputs, out, lse, dout, None, need_dbias=False)
    mask = dense(bound, batch, heads_q, len_q, len_k, q).cpu()
    leaves = [x.detach().double().cpu().requires_grad_(True) for x in (q, k, v)]
    want_out, want_lse = attnkit.attend(
        spec, *leaves, mask=mask, kv_lengths=lengths.cpu(), return_lse=True, backend="torch-naive"
    )
    want = [want_out, want_lse, *torch.autograd.grad(want_out, leaves, dout.double().cpu())]
    _assert_near_the_oracle([out, lse, *grads], want, dtype)


@on_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_dropout_agrees_with_the_oracle(dtype: str, head_dim: int) -> None:
    """The dropout path on hardware (unverified until this passes; docs/gpu.md): the kernels' Philox keep-mask at the
    GPU tiles, forward and backward through the backend (its refusal on CUDA is the dispatcher's), a seed on the device
    read by the kernels, offsets as a shard has them, 4 query heads on 2 kv heads, causal, a ragged cache,
    against torch-naive in float64 with the reference keep-mask."""
    import torch

    from attnkit.backend import AttentionInputs, Dropout

    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    q = torch.randn(2, 4, 300, head_dim, device="cuda").to(torch_dtype)
    k, v = (torch.randn(2, 2, 333, head_dim, device="cuda").to(torch_dtype) for _ in range(2))
    dout = torch.randn_like(q)
    lengths = torch.tensor([333, 170], device="cuda")
    seed = torch.tensor(0xF00D_CAFE_1234_5678 - (1 << 64), device="cuda")
    dropout = Dropout(0.2, seed, head_start=3, query_start=100, key_start=6)
    spec = AttentionSpec(causal=True)
    backend = attnkit.get_backend("cupy")
    inputs = AttentionInputs(q, k, v, kv_lengths=lengths, dropout=dropout)
    out, lse = backend.forward(spec, inputs, True)
    grads = backend.backward(spec, inputs, out, lse, dout, None, need_dbias=False)
    oracle = attnkit.get_backend("torch-naive")
    exact = AttentionInputs(
        *(x.double().cpu() for x in (q, k, v)), kv_lengths=lengths.cpu(), dropout=dropout._replace(seed=seed.cpu())
    )
    want_out, want_lse = oracle.forward(spec, exact, True)
    want_grads = oracle.backward(spec, exact, want_out, want_lse, dout.double().cpu(), None, need_dbias=False)
    want = [want_out, want_lse, want_grads.dq, want_grads.dk, want_grads.dv]
    _assert_near_the_oracle([out, lse, grads.dq, grads.dk, grads.dv], want, dtype)
