"""torch-naive: the contract written literally in torch, materialising the score matrix. The oracle."""

from __future__ import annotations

import torch

from attnkit import (
    AttentionInputs,
    AttentionSpec,
    Capabilities,
    Framework,
    Gradients,
    Problem,
    capability_reasons,
)
from attnkit.backend import ALL_FEATURES
from attnkit.torch_contract import compute_dtype, literal_attention


class TorchNaiveBackend:
    name = "torch-naive"
    capabilities = Capabilities(
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        devices=frozenset({"cpu", "cuda"}),
        features=ALL_FEATURES,
        description="the contract written literally; materialises (Lq, Lk) scores; the float64 oracle",
    )

    def available(self) -> list[str]:
        return []

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        return capability_reasons(self.capabilities, spec, problem)

    def forward(
        self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            out, lse = literal_attention(spec, inputs, compute_dtype(inputs.q.dtype))
        return out.to(inputs.q.dtype), lse.float()

    def backward(
        self,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
    ) -> Gradients:
        dtype = compute_dtype(inputs.q.dtype)
        with torch.enable_grad():
            leaves = [inputs.q.detach().to(dtype), inputs.k.detach().to(dtype), inputs.v.detach().to(dtype)]
            bias = inputs.bias.detach().to(dtype) if inputs.bias is not None else None
            if bias is not None:
                leaves.append(bias)
            for leaf in leaves:
                leaf.requires_grad_(True)
            recomputed = AttentionInputs(
                leaves[0], leaves[1], leaves[2], inputs.mask, bias, inputs.q_lengths, inputs.kv_lengths
            )
            out_again, lse_again = literal_attention(spec, recomputed, dtype)
            outputs, cotangents = [out_again], [dout.to(dtype)]
            if dlse is not None:
                # −inf rows have no dependence on the inputs; keep their cotangent out of the graph.
                outputs.append(torch.where(torch.isfinite(lse_again), lse_again, torch.zeros_like(lse_again)))
                cotangents.append(dlse.to(dtype))
            grads = torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(grads, leaves)]
        return Gradients(
            dq=grads[0].to(inputs.q.dtype),
            dk=grads[1].to(inputs.k.dtype),
            dv=grads[2].to(inputs.v.dtype),
            dbias=grads[3].to(inputs.bias.dtype) if bias is not None else None,
        )
