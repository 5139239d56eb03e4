"""The ``triton`` backend: FlashAttention-2 Triton kernels for the whole contract of docs/semantics.md."""

from __future__ import annotations

import torch

from attnkit.backend import (
    ALL_FEATURES,
    AttentionInputs,
    AttentionSpec,
    Capabilities,
    Framework,
    Gradients,
    Problem,
    Variant,
    capability_reasons,
)
from attnkit.contract.kernels import kernel_gradients

from . import launch

MAX_HEAD_DIM = 256


class TritonBackend:
    """FlashAttention-2 in Triton. Compiled for CUDA tensors, or, in a process started with TRITON_INTERPRET=1,
    interpreted on CPU tensors (how CI and ``attnkit check`` run it without a GPU)."""

    name = "triton"

    def __init__(self) -> None:
        mode = (
            "interpreted: TRITON_INTERPRET=1, CPU tensors only (slow; for conformance, not performance)"
            if launch.INTERPRETED
            else "compiled: CUDA tensors, tiles autotuned per (head dim, dtype, causal, window)"
        )
        self.capabilities = Capabilities(
            frameworks=frozenset({Framework.TORCH}),
            dtypes=frozenset({"float16", "bfloat16", "float32"}),
            devices=frozenset({launch.KERNEL_DEVICE}),
            features=ALL_FEATURES,
            head_dims=(1, MAX_HEAD_DIM),
            description=f"FlashAttention-2 Triton kernels, {mode}",
            notes=(
                "float32 dots in IEEE float32 (no TF32); float16/bfloat16 dots on tensor cores, float32 accumulation",
                "cosine: q·k on the raw inputs, scaled by both inverse norms in float32 (q̂ is never rounded)",
                "dbias is computed at full (B, Hq, Lq, Lk) float32, then summed to the bias's shape",
                "float64: not supported by the kernels (torch-chunked serves it)",
                "without a CUDA device, start the process with TRITON_INTERPRET=1 to run the kernels interpreted",
            ),
        )

    def available(self) -> list[str]:
        if not launch.INTERPRETED and not torch.cuda.is_available():
            return [
                "no CUDA device (torch.cuda.is_available() is False); set TRITON_INTERPRET=1 before attnkit "
                "loads its backends to run the kernels in the Triton interpreter on CPU tensors"
            ]
        return []

    def interpreted(self, device: str) -> bool:
        return launch.INTERPRETED

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        return capability_reasons(self.capabilities, spec, problem)

    def forward(
        self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return launch.attention_forward(spec, inputs)

    def backward(
        self,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        *,
        need_dbias: bool,
    ) -> Gradients:
        cosine = spec.variant is Variant.COSINE
        with torch.no_grad():
            dq, dk, dv, dscores = launch.attention_backward(
                spec, inputs, out, lse, dout, dlse, torch.float32 if cosine else None, need_dbias
            )
        return kernel_gradients(spec, inputs, dq, dk, dv, dscores)
