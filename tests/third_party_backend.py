"""A third-party backend written against the backend door alone (attnkit.backend) and torch: what a plugin author
writes. tests/test_third_party_backend.py installs it through the ``attnkit.backends`` entry-point group and runs
``attnkit check --backend`` on it. Its arithmetic is its own (not attnkit's contract helpers), as a plugin's is."""

from __future__ import annotations

import torch

from attnkit.backend import (
    AttentionInputs,
    AttentionSpec,
    BaseBackend,
    Capabilities,
    CausalAlignment,
    Feature,
    Framework,
    Gradients,
    Layout,
)

NAME = "door-tiny"


def _attention(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(out, lse) by materialised scores, in float64 for float64 inputs and float32 otherwise."""
    if spec.layout is Layout.BSHD:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1).to(wide) for x in (k, v))
    scores = q.to(wide) @ k.transpose(-1, -2) * spec.resolved_scale(q.shape[-1])
    if spec.causal:
        len_q, len_k = scores.shape[-2:]
        offset = len_k - len_q if spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT else 0
        visible = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril(offset)
        scores = scores.masked_fill(~visible, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True).detach()
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # a row with no key: exp(-inf) = 0
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1, keepdim=True)
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    out = (weights / safe_total) @ v
    lse = torch.where(total > 0, peak + torch.log(safe_total), torch.full_like(total, float("-inf"))).squeeze(-1)
    out = out.to(q.dtype)
    return (out.transpose(1, 2) if spec.layout is Layout.BSHD else out), lse  # in `wide`: float64 for float64 (§6)


class TinyBackend(BaseBackend):
    name = NAME
    capabilities = Capabilities(
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float32", "float64"}),
        devices=frozenset({"cpu"}),
        features=frozenset({Feature.CAUSAL, Feature.TOP_LEFT, Feature.BSHD, Feature.LSE, Feature.GRAD}),
        description="a plugin written against the backend door alone",
    )

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return _attention(spec, inputs.q, inputs.k, inputs.v)

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
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(True) for x in (inputs.q, inputs.k, inputs.v)]
            out_again, lse_again = _attention(spec, *leaves)
            outputs, cotangents = [out_again], [dout]
            if dlse is not None:  # a row with no key has lse -inf and no dependence on the inputs
                outputs.append(torch.where(torch.isfinite(lse_again), lse_again, torch.zeros_like(lse_again)))
                cotangents.append(dlse)
            found = torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True)
        dq, dk, dv = (g if g is not None else torch.zeros_like(x) for g, x in zip(found, leaves))
        return Gradients(dq=dq, dk=dk, dv=dv)
