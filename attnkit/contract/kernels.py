"""Torch-side pieces that kernel backends share (public; imports torch): strided bhsd views of their inputs, and
the assembly of their gradients.

Kernels for the cosine variant differentiate with respect to the normalised q̂ = q/‖q‖ and k̂; the chain rule
through the normalisation runs here, in float32, once per backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnkit.backend import AttentionInputs, AttentionSpec, Gradients, Layout, Variant
from attnkit.contract import COSINE_EPS


def cosine_input_gradient(x: torch.Tensor, lengths: torch.Tensor | None, grad_unit: torch.Tensor) -> torch.Tensor:
    """The gradient wrt bhsd ``x`` (B, H, L, D) of ``F.normalize(x, dim=-1, eps=1e-12)``, given the gradient wrt
    the normalised x; float32.

    Rows at or beyond ``lengths[b]`` are padding: zeroed first, so garbage there (NaN) cannot reach their zero
    gradient (docs/semantics.md §5).
    """
    if lengths is not None:
        positions = torch.arange(x.shape[2], device=x.device).view(1, 1, -1, 1)
        x = torch.where(positions < lengths.to(x.device).view(-1, 1, 1, 1), x, torch.zeros((), dtype=x.dtype))
    leaf = x.detach().float().requires_grad_(True)
    with torch.enable_grad():
        unit = F.normalize(leaf, dim=-1, eps=COSINE_EPS)
    return torch.autograd.grad(unit, leaf, grad_unit)[0]


def bhsd(spec: AttentionSpec, x: torch.Tensor) -> torch.Tensor:
    """A (B, H, L, D) view of a tensor in the spec's layout, copied only when its last stride is not 1: kernels
    take the other three strides as they are."""
    view = x.permute(0, 2, 1, 3) if spec.layout is Layout.BSHD else x
    return view if view.stride(-1) == 1 else view.contiguous()


def kernel_gradients(
    spec: AttentionSpec,
    inputs: AttentionInputs,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dscores: torch.Tensor | None,
) -> Gradients:
    """The Gradients of a kernel backend whose backward gives bhsd dq, dk, dv (with respect to q̂ and k̂, in float32,
    for the cosine variant) and, when dbias is wanted, dS at full (B, Hq, Lq, Lk) float32: the frontend sums it to
    the bias's shape and dtype."""
    if spec.variant is Variant.COSINE:
        dq = cosine_input_gradient(bhsd(spec, inputs.q), inputs.q_lengths, dq)
        dk = cosine_input_gradient(bhsd(spec, inputs.k), inputs.kv_lengths, dk)

    def in_layout(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return (x.transpose(1, 2) if spec.layout is Layout.BSHD else x).to(like.dtype)

    return Gradients(dq=in_layout(dq, inputs.q), dk=in_layout(dk, inputs.k), dv=in_layout(dv, inputs.v), dbias=dscores)
