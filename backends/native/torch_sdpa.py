"""``torch-sdpa``: the contract lowered onto torch's scaled-dot-product attention (CPU flash kernel).

* The plain cases (no mask, lengths, window or bias; top-left causal, or bottom-right with Lq = Lk; no lse) call
  ``torch.nn.functional.scaled_dot_product_attention`` itself, so forward and backward are torch's own, recorded by
  torch's autograd: the same cost as calling it directly.
* Everything else calls the op under it, ``aten::_scaled_dot_product_flash_attention_for_cpu``, which returns the
  logsumexp, through a :class:`torch.autograd.Function` whose backward is
  ``aten::_scaled_dot_product_flash_attention_for_cpu_backward``. That backward takes no lse cotangent; a ``dlse``
  is folded in exactly by one extra value column: with v' = [v, 1], out' = [out, 0], dout' = [dout, dlse] the
  kernel's dP' = dP + dlse and Δ' = Δ, so dS = P ⊙ (dP − (Δ − dlse)), which is §8 of docs/semantics.md.
* Visibility that SDPA cannot express (bottom-right with Lq ≠ Lk, window, lengths, a user mask) becomes one additive
  0/−inf mask of shape (B|1, Hq|1, Lq, Lk): memory quadratic in L, as a user mask already is.
* Fully masked rows: the CPU kernel returns out 0 but lse 0 for them, and older torch returned NaN, so empty rows
  are found from the visibility mask and set to out 0, lse −inf, which also zeroes their cotangents.
* Padding beyond lengths is zeroed before the kernel (0·NaN would otherwise reach visible rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attnkit.backends.reference.torch_common import compute_dtype, visibility, zero_padding
from attnkit.backends.reference.torch_naive import naive_attention

from attnkit import (
    AttentionInputs,
    AttentionSpec,
    Capabilities,
    CausalAlignment,
    Framework,
    Gradients,
    Layout,
    Problem,
    Variant,
    capability_reasons,
)

COSINE_EPS = 1e-12  # as torch.nn.functional.normalize
MIN_TORCH = (2, 5)  # enable_gqa, and the CPU flash op with masks and GQA


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _private_ops() -> tuple[object, object] | None:
    aten = torch.ops.aten
    if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu") or not hasattr(
        aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    ):
        return None
    return aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward


_OPS = _private_ops() if _torch_version() >= MIN_TORCH else None


def _pad_last(x: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]), value=value)


class _FlashCore(torch.autograd.Function):
    """out, lse = the CPU flash op on bhsd q, k, v (equal head dims) with an additive float mask; lse differentiable."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: object,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert _OPS is not None
        out, lse = _OPS[0](q, k, v, 0.0, causal, attn_mask=mask, scale=scale)  # type: ignore[operator]
        ctx.save_for_backward(q, k, v, mask, out, lse)  # type: ignore[attr-defined]
        ctx.causal, ctx.scale = causal, scale  # type: ignore[attr-defined]
        return out, lse

    @staticmethod
    def backward(ctx: object, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple[object, ...]:  # type: ignore[override]
        assert _OPS is not None
        q, k, v, mask, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        causal, scale = ctx.causal, ctx.scale  # type: ignore[attr-defined]
        head_dim, dim_v = q.shape[-1], v.shape[-1]
        if dlse is not None and bool(dlse.any()):
            width = dim_v + 1
            q2, k2 = _pad_last(q, width), _pad_last(k, width)
            v2 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
            out2 = _pad_last(out, width)
            dout2 = torch.cat([dout.to(out.dtype), dlse.to(out.dtype).unsqueeze(-1)], dim=-1)
            dq, dk, dv = _OPS[1](dout2, q2, k2, v2, out2, lse, 0.0, causal, attn_mask=mask, scale=scale)  # type: ignore[operator]
            dq, dk, dv = dq[..., :head_dim], dk[..., :head_dim], dv[..., :dim_v]
        else:
            dq, dk, dv = _OPS[1](dout.contiguous(), q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)  # type: ignore[operator]
        return dq, dk, dv, None, None, None


def _bhsd(spec: AttentionSpec, x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2) if spec.layout is Layout.BSHD else x


def _needs_visibility(spec: AttentionSpec, inputs: AttentionInputs, len_q: int, len_k: int) -> bool:
    """Whether visibility needs a mask: anything but no causal, or causal that SDPA's top-left expresses."""
    if inputs.mask is not None or inputs.q_lengths is not None or inputs.kv_lengths is not None:
        return True
    if spec.window is not None:
        return True
    bottom_right = spec.causal and spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT
    return bottom_right and len_q != len_k and len_q != 1


def _nan_rows_zeroed(out: torch.Tensor, inputs: AttentionInputs) -> bool:
    """Whether the kernel may have zeroed a row whose visible scores are all NaN.

    SDPA's CPU kernel treats such a row like a fully masked one (out 0, lse 0), where the contract wants NaN to
    propagate (§5). Only rows that came out exactly 0 can be affected, and only when q, k or bias hold a NaN.
    """
    if out.numel() == 0 or not bool((out == 0).all(dim=-1).any()):
        return False
    return any(t is not None and bool(t.isnan().any()) for t in (inputs.q, inputs.k, inputs.bias))


def sdpa_attention(
    spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) per the contract; differentiable by torch autograd wherever grad is enabled."""
    out, lse = _sdpa_attention(spec, inputs, need_lse)
    if _nan_rows_zeroed(out, inputs):  # rare: NaN in the inputs; the literal contract keeps it
        out, lse = naive_attention(spec, inputs, compute_dtype(inputs.q.dtype))
        out, lse = out.to(inputs.q.dtype), lse.float()
    return out, lse


def _sdpa_attention(
    spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    q, k, v = _bhsd(spec, inputs.q), _bhsd(spec, inputs.k), _bhsd(spec, inputs.v)
    batch, heads_q, len_q, head_dim = q.shape
    len_k, dim_v = k.shape[2], v.shape[-1]
    dtype = q.dtype
    scale = spec.resolved_scale(head_dim)
    if q.numel() == 0 or len_k == 0:  # §9; the CPU kernel faults on Lk = 0
        # Sums over empty extents are exactly 0 (NaN-free) and keep out in the autograd graph.
        out = q[..., :0].sum(-1, keepdim=True).expand(batch, heads_q, len_q, dim_v) + (k.sum() + v.sum()).to(dtype)
        lse = q[..., :0].sum(-1).float() + float("-inf")
        return (out.transpose(1, 2) if spec.layout is Layout.BSHD else out), lse
    masked = _needs_visibility(spec, inputs, len_q, len_k)
    if inputs.q_lengths is not None:
        q = zero_padding(q, inputs.q_lengths)
    if inputs.kv_lengths is not None:
        k, v = zero_padding(k, inputs.kv_lengths), zero_padding(v, inputs.kv_lengths)
    if spec.variant is Variant.COSINE:
        # In float32 at least: 1e-12 underflows to 0 in float16, and 0/0 would make a zero (padding) row NaN.
        q, k = (
            F.normalize(x.float() if x.dtype != torch.float64 else x, dim=-1, eps=COSINE_EPS).to(dtype) for x in (q, k)
        )
    # Bottom-right causal with one query and no lengths: that query sees every key.
    single = spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT and len_q == 1 and inputs.q_lengths is None
    causal = spec.causal and not masked and not single
    if not masked and inputs.bias is None and not need_lse and head_dim == dim_v:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=heads_q != k.shape[1])
        return (out.transpose(1, 2) if spec.layout is Layout.BSHD else out), None
    # The kernel takes a mask in q's dtype: with a bias and a half dtype, compute in float32 (bias is added in
    # float32 by the contract, §7).
    compute = torch.float32 if inputs.bias is not None and dtype in (torch.float16, torch.bfloat16) else dtype
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    additive = None
    empty = None
    if masked:
        visible = visibility(spec, inputs, len_q, len_k)
        assert visible is not None
        empty = ~visible.any(dim=-1)
        additive = torch.zeros(visible.shape, dtype=compute, device=q.device).masked_fill_(~visible, float("-inf"))
    if inputs.bias is not None:
        bias = inputs.bias.to(compute)
        additive = bias if additive is None else bias + additive
    width = max(head_dim, dim_v)
    # The op reads rows with unit stride (the public call checks that and falls back; the op does not).
    q, k, v = (_pad_last(x, width) for x in (q, k, v))
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out, lse = _FlashCore.apply(q, k, v, additive, causal, scale)
    out = out[..., :dim_v] if width != dim_v else out
    lse = lse.float()
    if empty is not None:
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(empty, float("-inf"))
    out = out.to(dtype)
    return (out.transpose(1, 2) if spec.layout is Layout.BSHD else out), lse


class TorchSdpaBackend:
    """torch's scaled-dot-product attention: the CPU flash kernel, with lse, through the public call or its op."""

    name = "torch-sdpa"
    #: forward() records torch's own autograd graph; the frontend does not wrap it (attnkit/backend.py).
    differentiable_forward = True
    capabilities = Capabilities(
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        devices=frozenset({"cpu"}),
        features=frozenset(
            {"causal", "top_left", "window", "cosine", "bshd", "mask", "bias", "q_lengths", "kv_lengths", "lse", "grad"}
        ),
        description="torch scaled_dot_product_attention (CPU flash kernel; lse through its aten op)",
        notes=(
            "softcap: SDPA has no score modifier, and a float mask is added after the scale, not before a tanh",
            "dbias: the flash backward returns no gradient for attn_mask",
            "cuda: not lowered yet (the CUDA ops return lse differently; flash-attn and triton serve CUDA)",
            "bottom-right causal with Lq != Lk, window, lengths and mask: one additive (B|1, Hq|1, Lq, Lk) mask",
            "bias with float16/bfloat16: computed in float32 (the kernel adds the mask in q's dtype)",
            "Dv != D: q, k, v zero-padded to max(D, Dv)",
            f"needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} and aten::_scaled_dot_product_flash_attention_for_cpu",
        ),
    )

    def available(self) -> list[str]:
        if _OPS is None:
            return [
                f"torch {torch.__version__} lacks enable_gqa or aten::_scaled_dot_product_flash_attention_for_cpu "
                f"(needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]})"
            ]
        return []

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        return capability_reasons(self.capabilities, spec, problem)

    def forward(
        self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return sdpa_attention(spec, inputs, need_lse)

    def backward(
        self,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
    ) -> Gradients:
        """For callers that use the generic protocol: recompute through torch autograd."""
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v)]
            again = inputs._replace(q=leaves[0], k=leaves[1], v=leaves[2])
            out2, lse2 = sdpa_attention(spec, again, need_lse=True)
            assert lse2 is not None
            outputs, cotangents = [out2], [dout]
            if dlse is not None:
                outputs.append(torch.where(torch.isfinite(lse2), lse2, torch.zeros_like(lse2)))
                cotangents.append(dlse)
            grads = torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True)
        dq, dk, dv = (g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(grads, leaves))
        return Gradients(dq=dq, dk=dk, dv=dv)
