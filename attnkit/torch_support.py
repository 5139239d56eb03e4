"""Torch-side pieces that kernel backends share (public; imports torch).

Kernels for the cosine variant differentiate with respect to the normalised q̂ = q/‖q‖ and k̂; the chain rule
through the normalisation runs here, in float32, once per backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

COSINE_EPS = 1e-12  # as torch.nn.functional.normalize (docs/semantics.md §3)


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
