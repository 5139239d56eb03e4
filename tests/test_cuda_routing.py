"""What ``auto`` picks for CUDA calls, and why (dispatch only: no GPU is needed, no kernel runs).

On CUDA the libraries' own kernels (flash-attn, torch SDPA) come before attnkit's (triton, cupy), which were measured
at 0.42-0.59x and 0.02-0.06x SDPA's throughput on an H100 (docs/performance.md); the shipped CUDA cost table speaks
only for the GPU model it was measured on. Stand-ins for flash-attn and triton "as on a GPU machine" (available,
declaring CUDA) are installed as a plugin that replaces the built-ins, so each decision is made between backends
that can all serve.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from attnkit.backends.native import torch_sdpa

import attnkit
from attnkit import cost, dispatch, environment
from attnkit.backend import ALLOW_UNVERIFIED_ENV, Framework, PendingHardware, Problem
from attnkit.spec import AttentionSpec
from tests.conftest import installed_plugin

H100 = "NVIDIA H100 80GB HBM3"

GPU_STAND_INS = """
import dataclasses

from attnkit.backends.native.flash_attn import FlashAttnBackend
from attnkit.backends.triton.backend import TritonBackend


class OnGpu:
    replaces_builtin = True

    def available(self):
        return []


class FlashAttn(OnGpu, FlashAttnBackend):
    pass


class Triton(OnGpu, TritonBackend):
    def __init__(self):
        super().__init__()
        self.capabilities = dataclasses.replace(self.capabilities, devices=frozenset({"cuda"}))


flash_attn = FlashAttn()
triton = Triton()
"""


def on_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> Iterator[None]:
    """The stand-ins installed, with the paths pending hardware verification let run: these tests are about the
    order among backends that can serve (test_paths_pending_hardware_are_passed_over_on_cuda is about those)."""
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "1")
    (tmp_path / "attnkit_gpu_stand_ins.py").write_text(GPU_STAND_INS)
    entry_points = {name: f"attnkit_gpu_stand_ins:{name.replace('-', '_')}" for name in names}
    with installed_plugin(tmp_path, monkeypatch, "attnkit-gpu-stand-ins 0.1", entry_points):
        yield


@pytest.fixture
def triton_on_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """triton available on CUDA; flash-attn as here (not installed)."""
    yield from on_gpu(tmp_path, monkeypatch, ("triton",))


@pytest.fixture
def both_on_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """flash-attn and triton available on CUDA."""
    yield from on_gpu(tmp_path, monkeypatch, ("triton", "flash-attn"))


def cuda_problem(dtype: str = "bfloat16", length: int = 256, head_dim: int = 64, **flags: bool) -> Problem:
    return Problem(Framework.TORCH, "cuda", dtype, 2, 8, 8, length, length, head_dim, head_dim, **flags)


def chosen(spec: AttentionSpec, problem: Problem) -> tuple[str, dict[str, tuple[str, ...]]]:
    """The backend ``auto`` selects, and each priority row's reasons (``()``: it could serve)."""
    rows = {row.name: row.reasons for row in dispatch.candidates(spec, problem) if row.in_priority}
    return dispatch.select(spec, problem).name, rows


CAUSAL = AttentionSpec(causal=True)
# (spec, problem, chosen without flash-attn, chosen with it)
CALLS = {
    "plain bfloat16": (CAUSAL, cuda_problem(), "torch-sdpa", "flash-attn"),
    "plain float16 with grad": (AttentionSpec(), cuda_problem("float16", needs_grad=True), "torch-sdpa", "flash-attn"),
    "float32": (CAUSAL, cuda_problem("float32"), "torch-sdpa", "torch-sdpa"),  # flash-attn: half types only
    "mask": (AttentionSpec(), cuda_problem(has_mask=True), "torch-sdpa", "torch-sdpa"),  # flash-attn: no mask
    "lse with grad": (CAUSAL, cuda_problem(return_lse=True, needs_grad=True), "torch-sdpa", "torch-sdpa"),
    "cosine": (AttentionSpec(variant="cosine"), cuda_problem(), "torch-sdpa", "flash-attn"),
    "head_dim 256": (CAUSAL, cuda_problem(head_dim=256), "torch-sdpa", "flash-attn"),
    # No native SDPA form (torch-sdpa would launch its kernel per query block with a mask): the tile-skipping kernels.
    "window": (AttentionSpec(causal=True, window=(32, 0)), cuda_problem(), "triton", "flash-attn"),
    "kv_lengths": (AttentionSpec(), cuda_problem(has_kv_lengths=True), "triton", "triton"),
}


@pytest.mark.parametrize("call", CALLS, ids=str)
def test_without_flash_attn_sdpa_serves_what_it_serves_natively_before_triton(triton_on_gpu: None, call: str) -> None:
    spec, problem, expected, _ = CALLS[call]
    name, rows = chosen(spec, problem)
    assert rows["triton"] == () and rows["torch-sdpa"] == ()  # both could serve: the order decides
    assert name == expected


@pytest.mark.parametrize("call", CALLS, ids=str)
def test_flash_attn_comes_first_where_it_serves(both_on_gpu: None, call: str) -> None:
    spec, problem, _, expected = CALLS[call]
    name, rows = chosen(spec, problem)
    assert rows["torch-sdpa"] == ()
    assert name == expected
    if expected != "flash-attn":
        assert rows["flash-attn"], "flash-attn was passed over, so it must have said why"


def test_paths_pending_hardware_are_passed_over_on_cuda(triton_on_gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Until a GPU run has passed them (docs/gpu.md), triton's compiled backward and torch-sdpa's half-precision op
    backward are refused on CUDA with a PendingHardware reason, so auto trains on a path that has passed there; the
    forward and SDPA's own plain training call are not held back."""
    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV)
    dispatch.clear_cache()
    spec, problem = CALLS["lse with grad"][:2]
    name, rows = chosen(spec, problem)
    for held_back in ("triton", "torch-sdpa"):
        assert len(rows[held_back]) == 1 and isinstance(rows[held_back][0], PendingHardware), rows[held_back]
    assert name not in ("triton", "torch-sdpa")
    assert chosen(*CALLS["plain float16 with grad"][:2])[0] == "torch-sdpa"
    assert chosen(CAUSAL, cuda_problem(has_kv_lengths=True))[0] == "triton"  # no gradient: the verified forward
    # Dropout in the compiled kernels waits for hardware even forward only.
    rows = {row.name: row.reasons for row in dispatch.candidates(CAUSAL, cuda_problem(has_dropout=True))}
    assert len(rows["triton"]) == 1 and isinstance(rows["triton"][0], PendingHardware), rows["triton"]
    assert "dropout in the compiled kernels" in rows["triton"][0]


def test_what_sdpa_cannot_take_on_cuda_goes_on_with_its_reason(triton_on_gpu: None) -> None:
    """float64 and head dims over 256 have no SDPA kernel with lse on CUDA: refused there with the value and what is
    allowed on that device, while the CPU serves them."""
    float64 = cuda_problem("float64")
    name, rows = chosen(CAUSAL, float64)
    assert rows["torch-sdpa"] == ("dtype=float64 (supported on cuda: bfloat16, float16, float32)",)
    assert name == "torch-chunked"  # triton takes no float64 either
    wide = cuda_problem(head_dim=320)
    assert chosen(CAUSAL, wide)[1]["torch-sdpa"] == (
        "head_dim=320 (supported on cuda: 1..256)",
        "head_dim_v=320 (supported on cuda: 1..256)",
    )
    sdpa = attnkit.get_backend("torch-sdpa")
    for problem in (float64, wide):
        on_cpu = Problem(**{**{f: getattr(problem, f) for f in Problem.__slots__}, "device": "cpu"})
        assert sdpa.supports(CAUSAL, on_cpu) == []


@pytest.fixture
def on_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost, "accelerator_name", lambda framework, device: H100 if device == "cuda" else "")


@pytest.mark.parametrize("length", [1, 512, 4096])
@pytest.mark.parametrize("grad", [False, True])
def test_on_an_h100_the_shipped_table_keeps_sdpa_ahead_of_triton(
    triton_on_gpu: None, on_h100: None, length: int, grad: bool
) -> None:
    spec, problem = CAUSAL, cuda_problem(length=length, needs_grad=grad)
    predicted = {row.name: row.predicted_us for row in dispatch.candidates(spec, problem)}
    assert predicted["torch-sdpa"] is not None and predicted["triton"] is not None
    assert predicted["torch-sdpa"] < predicted["triton"]
    assert dispatch.select(spec, problem).name == "torch-sdpa"


def test_the_cuda_table_speaks_only_for_the_gpu_model_it_was_measured_on(
    triton_on_gpu: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A table measured on an H100 saying triton is 100x faster moves it first there, and nowhere else."""
    rows = [
        cost.CostEntry("torch-sdpa", "cuda", "bfloat16", cost.FORWARD, 1000.0, 0.0, 0.0, device_name=H100),
        cost.CostEntry("triton", "cuda", "bfloat16", cost.FORWARD, 10.0, 0.0, 0.0, device_name=H100),
    ]
    cost.write_table(rows, tmp_path / "h100.toml", "test table")
    spec, problem = CAUSAL, cuda_problem()
    with attnkit.use_config({"costs": str(tmp_path / "h100.toml")}):
        for gpu, expected in ((H100, "triton"), ("NVIDIA A100-SXM4-80GB", "torch-sdpa"), ("", "torch-sdpa")):
            monkeypatch.setattr(cost, "accelerator_name", lambda framework, device, gpu=gpu: gpu)
            dispatch.clear_cache()
            assert dispatch.select(spec, problem).name == expected, gpu


def test_a_machine_with_two_gpu_models_is_no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    models = iter(["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: next(models))
    environment.accelerator_name.cache_clear()
    try:
        assert environment.accelerator_name("torch", "cuda") == ""
        assert environment.accelerator_name("torch", "cpu") == ""
    finally:
        environment.accelerator_name.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_cuda_op_is_called_by_its_schema_and_its_lse_trimmed_to_the_queries(dtype: torch.dtype) -> None:
    """Meta tensors run aten's schema binding and shape rules without a GPU: a misplaced argument fails here. The
    kernel pads head dims to 8 and lse to a multiple of 32 queries; the wrapper gives back (B, H, Lq, Dv) and
    float32 (B, H, Lq), as the CPU op does. GQA comes in expanded (the kernel needs equal head counts)."""
    q = torch.empty(2, 3, 37, 40, device="meta", dtype=dtype)
    k = torch.empty(2, 3, 45, 40, device="meta", dtype=dtype)
    v = torch.empty(2, 3, 45, 20, device="meta", dtype=dtype)
    mask = torch.empty(1, 3, 37, 45, device="meta")
    out, lse = torch_sdpa._cuda_forward(q, k, v, 0.0, False, attn_mask=mask, scale=0.5)
    assert (out.shape, out.dtype) == ((2, 3, 37, 20), dtype)
    assert (lse.shape, lse.dtype) == ((2, 3, 37), torch.float32)


def test_the_cuda_backward_op_gets_out_and_grad_out_as_contiguous_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """In half precision aten::_efficient_attention_backward computes Δ = rowsum(dO ⊙ O) itself, stepping through out
    by the row stride of a contiguous (B, L, H, Dv) tensor whatever its strides say (an H200 gave dq and dk of inf
    when out came as a transposed view): both reach the op contiguous in that layout."""
    seen = {}

    def backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: object,
                    out: torch.Tensor, *rest: object, **options: object) -> tuple[torch.Tensor, ...]:  # fmt: skip
        seen.update(grad_out=grad_out, out=out)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.empty(0)

    monkeypatch.setattr(torch.ops.aten, "_efficient_attention_backward", backward_op)
    q, k, v = (torch.randn(2, 3, length, 40, dtype=torch.float16) for length in (37, 45, 45))
    out, dout = torch.randn(2, 3, 37, 40, dtype=torch.float16), torch.randn(2, 3, 37, 40, dtype=torch.float16)
    lse = torch.randn(2, 3, 37)
    torch_sdpa._cuda_backward(dout, q, k, v, out, lse, 0.0, False, attn_mask=None, scale=0.5)
    for name in ("grad_out", "out"):
        assert seen[name].shape == (2, 37, 3, 40) and seen[name].is_contiguous(), name


#: Issue 33's H200 shapes (B, H, Lq, Lk, D, causal), where SDPA (cuDNN) was measured faster than triton and cupy in
#: every pass timed, and two between them (L = 4096 at D = 128, a decode step against 4096 keys).
H200_SHAPES = [(2, 16, 8192, 8192, 128, False), (2, 16, 8192, 8192, 128, True), (4, 32, 4096, 4096, 64, True),
               (8, 16, 2048, 2048, 128, True), (1, 32, 1, 8192, 128, False), (4, 16, 4096, 4096, 128, True),
               (1, 32, 1, 4096, 128, False)]  # fmt: skip


@pytest.mark.parametrize("shape", H200_SHAPES, ids=str)
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "forward+backward"])
def test_on_an_h200_the_shipped_table_puts_no_attnkit_kernel_ahead_of_sdpa(
    triton_on_gpu: None, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], grad: bool
) -> None:
    monkeypatch.setattr(cost, "accelerator_name", lambda framework, device: "NVIDIA H200" if device == "cuda" else "")
    batch, heads, len_q, len_k, head_dim, causal = shape
    spec = AttentionSpec(causal=causal)
    problem = Problem(Framework.TORCH, "cuda", "bfloat16", batch, heads, heads, len_q, len_k, head_dim, head_dim,
                      needs_grad=grad)  # fmt: skip
    table = attnkit.current_config().cost_table()
    assert table is not None
    predicted = table.predictions(spec, problem, ("torch-sdpa", "triton", "cupy"))
    sdpa, triton, cupy = (predicted[name] for name in ("torch-sdpa", "triton", "cupy"))
    assert sdpa is not None and triton is not None and cupy is not None, predicted  # all from the H200 entries
    assert sdpa < min(triton, cupy), predicted
    assert dispatch.select(spec, problem).name == "torch-sdpa"
