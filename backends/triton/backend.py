"""The ``triton`` backend: FlashAttention-2 Triton kernels for the whole contract of docs/semantics.md."""

from __future__ import annotations

import numpy
import torch
import triton

from attnkit.backend import AttentionSpec, Problem, Unverified, backend_option, pending_hardware
from attnkit.contract.kernels import DETERMINISTIC_OPTION, KernelBackend, KernelLauncher, kernel_capabilities

from . import launch
from .versions import minor_version, unsupported_triton

MAX_HEAD_DIM = 256
#: Off until a GPU has run it: on Hopper the autotuner then also times the warp-specialised forward and dQ tile
#: (launch.WARP_SPECIALIZED) on calls where every tile is interior.
WARP_SPECIALIZE_OPTION = ("warp_specialize", False)
#: The path refused on CUDA until a GPU run has passed it (Capabilities.unverified).
COMPILED_BACKWARD = "the compiled backward"
#: Mask programs evaluated in the compiled kernels' tiles: refused on CUDA until a GPU run has passed them.
COMPILED_MASK_PROGRAMS = "mask programs in the compiled kernels"
#: Dropout (§18) in the compiled kernels: refused on CUDA until a GPU run has passed it.
COMPILED_DROPOUT = "dropout in the compiled kernels"


def interpreter_refusals(triton_version: str, numpy_version: str) -> list[str]:
    """Why Triton's interpreter cannot run the kernels here (empty: it can). Triton 3.6's interpreter turns a scalar
    tensor (a one-element array) into a Python int with int(), which NumPy 2.4 refuses (triton-lang/triton#9171;
    3.7.1 and later squeeze it first): every kernel whose loop bounds are tensors, ours all, would fail."""
    old_triton = (minor_version(triton_version) or (0, 0)) < (3, 7)
    if old_triton and (minor_version(numpy_version) or (0, 0)) >= (2, 4):
        return [
            f"triton {triton_version}'s interpreter cannot run under numpy {numpy_version} (it needs numpy<2.4; "
            "triton>=3.7 has no such limit)"
        ]
    return []


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
            mask_programs=True,
            dropout=True,
            unverified=(
                Unverified(
                    "cuda",
                    COMPILED_BACKWARD,
                    "2026-11-27, H200, Triton 3.6: every half-precision backward on sm_90 raised KeyError "
                    "Kernel.DELTA in launch.descriptors_pay, and dq was wrong on the first call of each autotune key "
                    "(the autotuner's timing runs of the one-pass dK/dV kernel added into the dq sum); both fixed",
                ),
                Unverified(
                    "cuda",
                    COMPILED_MASK_PROGRAMS,
                    "written and tested in the Triton interpreter, and compiled for sm_80 and sm_90 without a GPU; "
                    "never run on one",
                ),
                Unverified(
                    "cuda",
                    COMPILED_DROPOUT,
                    "written and tested in the Triton interpreter (the keep-mask bit for bit, out, lse and gradients "
                    "against the oracle), and compiled for sm_80 and sm_90 without a GPU; never run on one",
                ),
            ),
        )

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        reasons = super().supports(spec, problem)
        if problem.device == "cuda" and problem.needs_grad:
            reasons += pending_hardware(self, "cuda", COMPILED_BACKWARD)
        if problem.device == "cuda" and problem.has_mask_program:
            reasons += pending_hardware(self, "cuda", COMPILED_MASK_PROGRAMS)
        if problem.device == "cuda" and problem.has_dropout:
            reasons += pending_hardware(self, "cuda", COMPILED_DROPOUT)
        return reasons

    def available(self) -> list[str]:
        unsupported = unsupported_triton(triton.__version__)
        if unsupported:
            return unsupported
        if launch.INTERPRETED:
            return interpreter_refusals(triton.__version__, numpy.__version__)
        if not torch.cuda.is_available():
            return [
                "no CUDA device (torch.cuda.is_available() is False); set TRITON_INTERPRET=1 before the triton "
                "backend's first use to run the kernels in the Triton interpreter on CPU tensors"
            ]
        return []

    def interpreted(self, device: str) -> bool:
        return launch.INTERPRETED

    def kernel_launcher(self) -> KernelLauncher:
        if backend_option(self, WARP_SPECIALIZE_OPTION[0]):
            return launch.WARP_SPECIALIZING_LAUNCHER
        return launch.LAUNCHER
