"""The ``triton`` backend: FlashAttention-2 Triton kernels for the whole contract of docs/semantics.md."""

from __future__ import annotations

import torch

from attnkit.backend import AttentionSpec, Problem, Unverified, backend_option, pending_hardware
from attnkit.contract.kernels import DETERMINISTIC_OPTION, KernelBackend, KernelLauncher, kernel_capabilities

from . import launch

MAX_HEAD_DIM = 256
#: Off until a GPU has run it: on Hopper the autotuner then also times the warp-specialised forward and dQ tile
#: (launch.WARP_SPECIALIZED) on calls where every tile is interior.
WARP_SPECIALIZE_OPTION = ("warp_specialize", False)
#: The path refused on CUDA until a GPU run has passed it (Capabilities.unverified).
COMPILED_BACKWARD = "the compiled backward"


class TritonBackend(KernelBackend):
    """FlashAttention-2 in Triton. Compiled for CUDA tensors, or, in a process started with TRITON_INTERPRET=1,
    interpreted on CPU tensors (how CI and ``attnkit check`` run it without a GPU)."""

    name = "triton"

    def __init__(self) -> None:
        mode = (
            "interpreted: TRITON_INTERPRET=1, CPU tensors only (slow; for conformance, not performance)"
            if launch.INTERPRETED
            else "compiled: CUDA tensors, tiles autotuned per (head dim, dtype, causal, window, paged, split-K)"
        )
        self.capabilities = kernel_capabilities(
            launch.KERNEL_DEVICE,
            MAX_HEAD_DIM,
            f"FlashAttention-2 Triton kernels, {mode}",
            notes=(
                "float32 dots in IEEE float32 (no TF32); float16/bfloat16 dots on tensor cores, float32 accumulation",
            ),
            how_to_run=(
                "without a CUDA device, start the process with TRITON_INTERPRET=1 to run the kernels interpreted",
            ),
            # Off: at head dims up to 128 on Hopper the backward adds dq atomically, its last bits varying by run.
            options=(DETERMINISTIC_OPTION, WARP_SPECIALIZE_OPTION),
            unverified=(
                Unverified(
                    "cuda",
                    COMPILED_BACKWARD,
                    "2026-11-27, H200, Triton 3.6: every half-precision backward on sm_90 raised KeyError "
                    "Kernel.DELTA in launch.descriptors_pay, and dq was wrong on the first call of each autotune key "
                    "(the autotuner's timing runs of the one-pass dK/dV kernel added into the dq sum); both fixed",
                ),
            ),
        )

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        reasons = super().supports(spec, problem)
        if problem.device == "cuda" and problem.needs_grad:
            reasons += pending_hardware(self, "cuda", COMPILED_BACKWARD)
        return reasons

    def available(self) -> list[str]:
        if not launch.INTERPRETED and not torch.cuda.is_available():
            return [
                "no CUDA device (torch.cuda.is_available() is False); set TRITON_INTERPRET=1 before attnkit "
                "loads its backends to run the kernels in the Triton interpreter on CPU tensors"
            ]
        return []

    def interpreted(self, device: str) -> bool:
        return launch.INTERPRETED

    def kernel_launcher(self) -> KernelLauncher:
        if backend_option(self, WARP_SPECIALIZE_OPTION[0]):
            return launch.WARP_SPECIALIZING_LAUNCHER
        return launch.LAUNCHER
