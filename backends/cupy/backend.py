"""The ``cupy`` backend (and its test-only twin ``cupy-emulated``): the CUDA C kernels of kernels/attention.cu."""

from __future__ import annotations

from attnkit.backend import AttentionSpec, Capabilities, Problem, Unverified, pending_hardware
from attnkit.contract.kernels import DETERMINISTIC_OPTION, KernelBackend, KernelLauncher, kernel_capabilities

from . import launch

EMULATED_NAME = "cupy-emulated"
#: Why ``cupy-emulated`` cannot run outside the test suite.
TEST_ONLY_REASON = (
    "test-only path: the CPU emulation harness in tests/cupy_emulator (host C++ compiler) attaches its launcher "
    "when the test suite starts (tests/conftest.py); it is not a way to run attention"
)


#: The paths refused on CUDA until a hardware run passes them (Capabilities.unverified, docs/gpu.md).
PROGRAM_PATH = "mask programs (generated mask_program, tile classes)"
DROPOUT_PATH = "attention dropout (the kernels' Philox4x32-10 keep-mask)"
UNRUN_HISTORY = (
    "never run on a GPU: written and checked on the CPU emulation harness, and compiled by nvcc for sm_80 / sm_90, "
    "without a device"
)


def capabilities(device: str, description: str) -> Capabilities:
    """The same declaration for ``cupy`` and ``cupy-emulated``: the kernels are the same; only the device differs."""
    return kernel_capabilities(
        device,
        launch.MAX_HEAD_DIM,
        description,
        notes=(
            "float16/bfloat16 matrix products on tensor cores (nvcuda::wmma 16x16x16), float32 accumulation; "
            "float32 in IEEE float32 FMA loops (no TF32)",
            "compile-time -D options (head dim, tiles, feature switches) from launch.compile_options, shared by "
            "NVRTC, nvcc and the emulator",
            "mask programs: a generated __device__ mask_program spliced into the source, compiled once per program "
            "(captured tensors and lengths are kernel arguments); EMPTY tiles skipped, FULL ones unevaluated",
            "dropout: one -DHAS_DROPOUT switch; the seed (read by the kernel from its tensor), threshold, scale and "
            "offsets are kernel arguments, so a new seed or p compiles nothing; the backward regenerates the mask",
        ),
        # Off: the backward adds dq atomically in one pass where dK/dV runs its register body, last bits varying by run.
        options=(DETERMINISTIC_OPTION,),
        unverified=tuple(Unverified("cuda", path, UNRUN_HISTORY) for path in (PROGRAM_PATH, DROPOUT_PATH))
        if device == "cuda"
        else (),
        mask_programs=True,
        dropout=True,
    )


class CupyBackend(KernelBackend):
    """FlashAttention-2 in CUDA C, launched through a :class:`launch.Launcher`: CuPy (NVRTC) on CUDA tensors, or
    the CPU emulation harness of the test suite on CPU tensors (``cupy-emulated``)."""

    def __init__(self, name: str, launcher: launch.Launcher | None, device: str, description: str) -> None:
        self.name = name
        self.launcher = launcher
        self.capabilities = capabilities(device, description)

    @classmethod
    def on_cuda(cls) -> CupyBackend:
        return cls(
            "cupy",
            launch.CupyLauncher(),
            "cuda",
            "FlashAttention-2 CUDA C kernels (backends/cupy/kernels/attention.cu) compiled at run time by NVRTC "
            "through cupy.RawModule",
        )

    @classmethod
    def emulated(cls, launcher: launch.Launcher | None = None) -> CupyBackend:
        return cls(
            EMULATED_NAME,
            launcher,
            "cpu",
            "test-only: the cupy backend's CUDA C kernels compiled by the host C++ compiler and run on CPU "
            "tensors by the emulation harness of tests/cupy_emulator (slow; conformance, not performance)",
        )

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        reasons = super().supports(spec, problem)
        if problem.device == "cuda" and problem.has_mask_program:
            reasons += pending_hardware(self, "cuda", PROGRAM_PATH)
        if problem.device == "cuda" and problem.has_dropout:
            reasons += pending_hardware(self, "cuda", DROPOUT_PATH)
        return reasons

    def available(self) -> list[str]:
        if self.launcher is None:
            return [TEST_ONLY_REASON]
        return self.launcher.unavailable()

    def interpreted(self, device: str) -> bool:
        return device == "cpu"  # the emulation harness; CUDA tensors run the compiled kernels

    def kernel_launcher(self) -> KernelLauncher:
        if self.launcher is None:
            raise RuntimeError(TEST_ONLY_REASON)
        return launch.CudaKernels(self.launcher)
