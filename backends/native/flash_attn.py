"""``flash-attn``: the contract lowered onto flash-attn 2's ``flash_attn_func`` (CUDA, float16/bfloat16, bshd).

Lowered exactly, and nothing else declared:

* layout: flash-attn takes (B, L, H, D) = bshd; bhsd views are transposed (its autograd makes them contiguous);
* causal: bottom-right, as flash-attn ≥ 2.1 (top-left is not declared: it has no top-left mode for Lq ≠ Lk);
* window: ``window_size=(left, right)`` with ``-1`` for an unbounded side, aligned like causal (bottom-right);
* softcap: ``softcap=c`` (flash-attn ≥ 2.6, applied after scale, as §3);
* GQA: native, ``h // G``; scale: ``softmax_scale``; cosine: q, k normalised first;
* grad: flash-attn's own backward (torch autograd; ``differentiable_forward``).

Not declared: lse (its gradient is not supported by flash-attn), mask and bias (no arbitrary mask or bias),
lengths (varlen needs unpadded cu_seqlens; not lowered here), segment ids (``flash_attn_func`` takes none; documents
reach flash-attn only as ``flash_attn_varlen_func``'s cu_seqlens, which ``attend_varlen`` may route to later),
float32/float64, Dv != D, head dims above 256.
Fully masked rows (bottom-right causal with Lq > Lk, or a window) give out 0 in flash-attn, as the contract says.
Not run on this project's CPU CI: available() says why.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from attnkit.backend import (
    SPEC_FEATURES,
    AttentionInputs,
    AttentionSpec,
    Capabilities,
    Feature,
    Framework,
    Layout,
    Problem,
    Runner,
    Variant,
)
from attnkit.contract.torch import RecomputingBackend, cosine_normalize

MAX_HEAD_DIM = 256


class FlashAttnBackend(RecomputingBackend):
    name = "flash-attn"
    capabilities = Capabilities(
        length_generic=True,
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16"}),
        devices=frozenset({"cuda"}),
        features=SPEC_FEATURES | {Feature.GRAD},
        unsupported_because=(
            (Feature.DROPOUT, "flash-attn keys its dropout by warp lane and MMA tile, not the contract's keep-mask"),
        ),
        head_dims=(1, MAX_HEAD_DIM),
        description="flash-attn 2 flash_attn_func (CUDA), its own forward and backward",
        notes=(
            "top_left: only where it is bottom-right too (Lq = Lk); flash-attn's causal is bottom-right",
            "lse: returned by flash-attn but its gradient is not supported",
            "mask, bias: no arbitrary mask or bias in flash-attn; q_lengths/kv_lengths: varlen not lowered",
            "segment ids: flash_attn_func takes no ids; flash_attn_varlen_func takes documents as cu_seqlens offsets, "
            "the form of attnkit.attend_varlen, which may route to it later (padded rows with ids are not that form)",
            "Dv != D: rejected at call time (flash-attn needs equal head dims)",
            "paged: flash_attn_with_kvcache takes a block table (page sizes a multiple of 256); not lowered yet, as "
            "nothing here could run it (no CUDA)",
        ),
    )

    def available(self) -> list[str]:
        reasons = []
        if importlib.util.find_spec("flash_attn") is None:
            reasons.append("flash_attn is not installed (pip install flash-attn; needs CUDA)")
        if not torch.cuda.is_available():
            reasons.append("no CUDA device (torch.cuda.is_available() is False)")
        return reasons

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        reasons = super().supports(spec, problem)
        if problem.framework not in self.capabilities.frameworks:
            return reasons  # the one reason (capability_reasons)
        if Feature.TOP_LEFT in spec.features() and problem.len_q != problem.len_k:
            reasons.append(f"top-left alignment with len_q={problem.len_q} != len_k={problem.len_k} (supported: equal)")
        if problem.head_dim != problem.head_dim_v:
            reasons.append(f"head_dim_v={problem.head_dim_v} (supported: equal to head_dim={problem.head_dim})")
        return reasons

    def differentiable_forward(self, spec: AttentionSpec, problem: Problem) -> Runner:
        """flash-attn's own autograd function records the backward; the frontend does not wrap it."""
        return functools.partial(self.forward, spec, need_lse=False)

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[Any, Any]:
        from flash_attn import flash_attn_func

        q, k, v = inputs.q, inputs.k, inputs.v
        if spec.layout is Layout.BHSD:
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if spec.variant is Variant.COSINE:
            q, k = (cosine_normalize(x.float()).to(x.dtype) for x in (q, k))
        left, right = spec.window if spec.window is not None else (None, None)
        out = flash_attn_func(
            q,
            k,
            v,
            softmax_scale=spec.resolved_scale(q.shape[-1]),
            causal=spec.causal,
            window_size=(-1 if left is None else left, -1 if right is None else right),
            softcap=spec.softcap or 0.0,
        )
        return (out.transpose(1, 2) if spec.layout is Layout.BHSD else out), None

    def recompute(self, spec: AttentionSpec, inputs: AttentionInputs) -> tuple[Any, None]:
        """For callers of the protocol's backward: flash-attn's forward again, under torch autograd."""
        return self.forward(spec, inputs, need_lse=False)
