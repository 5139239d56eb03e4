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

from .torch_common import (
    compute_dtype,
    from_bhsd,
    normalize_if_cosine,
    scores,
    to_bhsd,
    visibility,
    weighted_values,
    zero_padding,
)


def naive_attention(
    spec: AttentionSpec, inputs: AttentionInputs, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) computed in ``dtype`` throughout; differentiable by torch autograd.

    out is bhsd/bshd per the spec in ``dtype``; lse is (B, Hq, Lq) in ``dtype``. Rows with no visible
    key give out 0 and lse -inf, and (because every -inf and 0/0 is kept out of the graph with
    ``where``) zero, finite gradients.
    """
    q = normalize_if_cosine(spec, zero_padding(to_bhsd(spec, inputs.q).to(dtype), inputs.q_lengths))
    k = normalize_if_cosine(spec, zero_padding(to_bhsd(spec, inputs.k).to(dtype), inputs.kv_lengths))
    v = zero_padding(to_bhsd(spec, inputs.v).to(dtype), inputs.kv_lengths)
    bias = inputs.bias.to(dtype) if inputs.bias is not None else None
    len_q, len_k = q.shape[2], k.shape[2]
    s = scores(spec, q, k, bias, spec.resolved_scale(q.shape[-1]))
    visible = visibility(spec, inputs, len_q, len_k)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    # lse = m + log Σ exp(S − m), with m detached (it cancels) and made finite for empty rows.
    row_max = s.amax(dim=-1, keepdim=True).detach() if len_k else s.new_zeros(*s.shape[:-1], 1)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(s - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    has_keys = total != 0  # NaN counts as having keys: NaN in gives NaN lse, never a quiet -inf (§5)
    safe_total = torch.where(has_keys, total, torch.ones_like(total))
    lse = torch.where(has_keys, row_max + torch.log(safe_total), torch.full_like(total, float("-inf")))
    out = weighted_values(weights / safe_total, v)
    return from_bhsd(spec, out), lse.squeeze(-1)


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
            out, lse = naive_attention(spec, inputs, compute_dtype(inputs.q.dtype))
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
            out_again, lse_again = naive_attention(spec, recomputed, dtype)
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
