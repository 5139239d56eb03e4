"""``torch-sdpa``: the contract lowered onto torch's scaled-dot-product attention (its CPU flash kernel).

Three paths, chosen per call from the spec and the optional tensors:

* **native**: visibility SDPA expresses (none, top-left causal, bottom-right with Lq = Lk or a single query), no
  bias, no lse, D = Dv: ``F.scaled_dot_product_attention`` itself, differentiated by torch's own autograd. This is
  the call a user would write, so ``auto`` costs only its dispatch over it. With a user mask (no window, bias,
  lengths or lse) it is the same call with the boolean mask as SDPA takes it (§4.4 and SDPA agree: True = may
  attend), no empty-row scan or lse of ours (issue 16); causal with its diagonal at key 0 and CAUSAL_OP_MIN_KEYS
  keys or more runs the op with its own causal flag beside the mask (it skips the key blocks past the diagonal,
  which SDPA given one mask cannot), other causal calls fold the band into the mask. Rows that see no key come out
  0 with zero gradients from the kernel itself, and NaN propagates at every key count there
  (tests/test_torch_sdpa.py).
* **flash op**: the op under it, ``aten::_scaled_dot_product_flash_attention_for_cpu``, which also returns lse, on
  query blocks (:class:`_BlockedFlash`). Causal with another alignment, windows and lengths give each block of
  BLOCK_Q queries only the key span its band can reach, with an additive 0/−inf mask of (block × span) built per
  block (and rebuilt in backward, never kept), so memory stays linear in L and hidden key ranges are never read.
  A user mask or bias is added to that mask (float32, §7). The backward op takes no lse cotangent; ``dlse`` is
  folded in exactly by one extra value column: with v' = [v, 1], out' = [out, 0], dout' = [dout, dlse] the kernel's
  dP' = dP + dlse and Δ' = Δ, so dS = P ⊙ (dP − (Δ − dlse)), which is §8 of docs/semantics.md.
* **literal**: the contract in torch ops (``attnkit.contract.torch.literal_attention``), only when the kernel's
  result cannot be trusted: it skips a row whose first scores are all NaN as if it were fully masked (out 0 and
  lse 0 instead of NaN, §5). Such rows are found from the lse the op returns; the native path is used only where
  that cannot happen (at least NAN_SAFE_KEYS keys, see tests/test_native_backends.py).

Fully masked rows come out 0 with lse −inf (the kernel gives lse 0), and padding beyond lengths is never read.
Segment ids (§4.5) become a boolean (B, 1, Lq, Lk) mask (:func:`_segments_as_mask`) and run on the masked paths,
with q, k, v zeroed at negative ids: O(L²) memory, no tile skipped for the documents.

On CUDA the same paths run on CUDA's kernels: the native one is SDPA itself (flash, cuDNN or memory-efficient, as SDPA
picks), the op one ``aten::_efficient_attention_forward``/``_backward`` in place of the CPU op (:func:`_ops_for`),
with the kernel's own requirements met in :func:`_cuda_forward`/:func:`_cuda_backward`. float64 and head dims over
MAX_CUDA_HEAD_DIM are refused there (``Capabilities.per_device``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from attnkit.backend import (
    ALL_FEATURES,
    AttentionInputs,
    AttentionSpec,
    Capabilities,
    DeviceLimits,
    Feature,
    Framework,
    Layout,
    PlainCall,
    Problem,
    Runner,
    Unverified,
    Variant,
    pending_hardware,
)
from attnkit.contract import alignment_offset
from attnkit.contract.programs import dense
from attnkit.contract.torch import (
    Band,
    RecomputingBackend,
    block_of,
    compute_dtype,
    cosine_normalize,
    literal_attention,
    segment_visibility,
    without_segment_padding,
    zero_padding,
)

MIN_TORCH = (2, 5)  # enable_gqa, and the CPU flash op with masks and GQA
# Queries per flash-op call when visibility needs a mask (mask memory BLOCK_Q × span); a window's blocks are
# narrower, so that the (block × span) rectangle the op computes is mostly inside the band.
BLOCK_Q = 256
WINDOW_BLOCK_Q = 64
# The CPU kernel's first max over a row is vectorised; a row shorter than one vector whose scores are all NaN is
# taken for a fully masked row. 64 keys cover vectors up to 2048 bits of float32.
NAN_SAFE_KEYS = 64
# A causal masked call from this many keys on runs the op with its causal flag, which skips the key blocks past the
# diagonal (B=4, H=8, D=64, one thread, forward against SDPA with the (B, 1, L, L) mask: 0.87 at L=512, 0.68 at
# 1024); below it nothing is skipped and folding the band into the mask for the public call (C++ autograd, no
# autograd.Function) was as fast or faster (1.02 against 1.03 at L=64 forward, 0.96 against 1.00 at 256 fwd+bwd).
CAUSAL_OP_MIN_KEYS = 512


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _flash_ops() -> tuple[Any, Any] | None:
    aten = torch.ops.aten
    if _torch_version() < MIN_TORCH or not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return None
    return aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward


_OPS = _flash_ops()

# CUDA: the memory-efficient kernel (``aten::_efficient_attention_forward``/``_backward``), the one SDPA kernel that
# returns lse and takes an additive mask (flash and cuDNN take none), for float32 and the half types. It reads
# (B, L, H, D) views, rows in 16-byte vectors (head dims padded to CUDA_ALIGN; the mask's rows to MASK_ALIGN, as
# SDPA's own preprocess_mask does), a mask of q's dtype shaped (B, H, Lq, Lk), and equal head counts (GQA expanded).
CUDA_DTYPES = frozenset({"float16", "bfloat16", "float32"})
MAX_CUDA_HEAD_DIM = 256  # the kernels' backward has tiles up to 256 on every architecture SDPA builds for
CUDA_ALIGN = 8
MASK_ALIGN = 16
_NO_MASK, _CAUSAL_FROM_TOP_LEFT = 0, 1  # the kernel's custom_mask_type


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _cuda_mask(mask: torch.Tensor | None, q: torch.Tensor, len_k: int) -> torch.Tensor | None:
    """The additive (block) mask as the kernel reads it: q's dtype, rows aligned, expanded to (B, H, rows, Lk)."""
    if mask is None:
        return None
    *lead, rows, cols = mask.shape
    aligned = mask.new_zeros((*lead, rows, _round_up(cols, MASK_ALIGN)), dtype=q.dtype)[..., :cols]
    return aligned.copy_(mask).expand(q.shape[0], q.shape[1], q.shape[2], len_k)


def _bmhk(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) as the kernel's (B, L, H, D) view, D padded to CUDA_ALIGN."""
    return _pad_last(x, _round_up(x.shape[-1], CUDA_ALIGN)).transpose(1, 2)


def _cuda_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: Any,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU op's (out, lse) from the CUDA kernel; its lse comes padded to a multiple of 32 queries."""
    mask_type = _CAUSAL_FROM_TOP_LEFT if is_causal else _NO_MASK
    out, lse, *_ = torch.ops.aten._efficient_attention_forward(
        _bmhk(q), _bmhk(k), _bmhk(v), _cuda_mask(attn_mask, q, k.shape[2]), None, None, None, None, dropout_p,
        mask_type, True, scale=scale,
    )  # fmt: skip
    return out.transpose(1, 2)[..., : v.shape[-1]], lse[..., : q.shape[2]]


def _cuda_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: Any,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU backward op's (dq, dk, dv) from the CUDA kernel. It recomputes P = exp(S − lse): a row no key is
    visible to has lse −inf, and +inf there makes P 0 instead of NaN.

    In float16 and bfloat16 the kernel computes Δ = rowsum(dO ⊙ O) itself, reading ``out`` with the row stride of a
    contiguous (B, L, H, Dv) tensor (its ``o_strideM`` is Dv · H, not ``out.stride(1)``); float32 computes Δ with
    torch ops that honour strides. So ``out`` is passed contiguous in that layout: the transposed (B, H, L, Dv) view
    gave every half-precision row a wrong Δ, and dq, dk of inf or ~1e37 on an H200 (docs/gpu.md)."""
    unused = torch.empty((), dtype=torch.int64, device=q.device)  # philox seed and offset: no dropout
    # Padded again to the forward's multiple of 32 queries: the kernel reads lse by whole query tiles.
    padding = _round_up(q.shape[2], 32) - q.shape[2]
    lse = F.pad(lse.masked_fill(lse == float("-inf"), float("inf")), (0, padding), value=float("inf"))
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        _bmhk(grad_out).contiguous(), _bmhk(q), _bmhk(k), _bmhk(v), _cuda_mask(attn_mask, q, k.shape[2]),
        _bmhk(out).contiguous(),
        None, None, q.shape[2], k.shape[2], lse, dropout_p, unused, unused,
        _CAUSAL_FROM_TOP_LEFT if is_causal else _NO_MASK, False, scale=scale,
    )  # fmt: skip
    return tuple(g.transpose(1, 2)[..., : x.shape[-1]] for g, x in ((dq, q), (dk, k), (dv, v)))  # type: ignore[return-value]


def _ops_for(device: torch.device) -> tuple[Any, Any]:
    """(forward, backward) with the CPU flash op's signatures, for tensors on ``device``."""
    if device.type == "cuda":
        return _cuda_forward, _cuda_backward
    assert _OPS is not None
    return _OPS


@dataclass(frozen=True, slots=True)
class _Block:
    """Queries ``rows`` against keys ``cols``; ``causal``: the op's own top-left causal flag is the whole visibility;
    ``masked``: visibility inside the block needs the additive mask."""

    rows: slice
    cols: slice
    causal: bool
    masked: bool


class _Plan:
    """How one call is cut into flash-op calls, and the masks those calls need."""

    def __init__(self, spec: AttentionSpec, inputs: AttentionInputs, q: torch.Tensor, k: torch.Tensor) -> None:
        self.inputs = inputs
        self.band = Band(spec, inputs, q.shape[2], k.shape[2])
        self.blocks = _blocks(spec, inputs, self.band)
        self.mask_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        # Without lengths or a user mask, visibility depends on j − i only: blocks at the same diagonal offset
        # share one mask (all the interior blocks of a window do).
        self.shift_invariant = inputs.mask is None and inputs.q_lengths is None and inputs.kv_lengths is None
        self._shared: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def mask(self, block: _Block) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(additive mask or None, boolean empty rows (B|1, H|1, rows) or None) for one block."""
        bias = self.inputs.bias
        bias_block = None if bias is None else block_of(bias, block.rows, block.cols).to(self.mask_dtype)
        if not block.masked:
            return bias_block, None
        rows, cols = block.rows, block.cols
        key = (rows.start - cols.start, rows.stop - rows.start, cols.stop - cols.start)
        shared = self._shared.get(key) if self.shift_invariant else None
        if shared is None:
            visible = self.band.visible(rows, cols, self.inputs.mask)
            assert visible is not None
            # One pass each: where() writes the 0/−inf mask directly (zeros then masked_fill was two, plus a ~);
            # a bool any() over the last axis is a scalar loop in torch 2.13 (21 ms at B=4, L=2048), the same
            # bytes read as uint8 reduce vectorised (0.7 ms).
            additive = torch.zeros((), dtype=self.mask_dtype, device=visible.device).where(visible, float("-inf"))
            shared = additive, _sees_nothing(visible)
            if self.shift_invariant:
                self._shared[key] = shared
        additive, empty = shared
        return (additive if bias_block is None else additive + bias_block), empty


def _sees_nothing(visible: torch.Tensor) -> torch.Tensor:
    """The rows of a boolean visibility (…, rows, cols) with no visible key: ``~visible.any(-1)``, read as uint8
    (torch's bool any() over an axis does not vectorise)."""
    return visible.view(torch.uint8).amax(dim=-1) == 0


def _blocks(spec: AttentionSpec, inputs: AttentionInputs, band: Band) -> list[_Block]:
    len_q, len_k = band.len_q, band.len_k
    user_mask = inputs.mask is not None
    if not band.banded and not band.has_lengths:
        return [_Block(slice(0, len_q), slice(0, len_k), causal=False, masked=user_mask)]
    if spec.causal and spec.window is None and not band.has_lengths and alignment_offset(spec, len_q, len_k) == 0:
        return [_Block(slice(0, len_q), slice(0, len_k), causal=True, masked=user_mask)]
    # Each block of queries reads only the keys its band reaches (per batch element with lengths: the widest).
    max_q = band.extremes[0][1]
    block_q = WINDOW_BLOCK_Q if band.lower is not None else BLOCK_Q
    blocks = []
    for start in range(0, min(max_q, len_q), block_q):
        rows = range(start, min(start + block_q, len_q, max_q))
        keys = band.key_span(rows)
        if not keys:
            continue  # every row of the block is empty: out 0, lse −inf as initialised
        # The block needs no mask only when every row sees the whole span (and lengths always take one).
        whole = not band.has_lengths and band.wholly_visible(rows, keys)
        blocks.append(
            _Block(
                slice(rows.start, rows.stop), slice(keys.start, keys.stop), causal=False, masked=not whole or user_mask
            )
        )
    return blocks


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


class _BlockedFlash(torch.autograd.Function):
    """(out, lse, kernel lse) of the flash op over the plan's blocks, for bhsd q, k, v with equal head dims.

    out starts at 0 and lse at −inf, which is the contract's answer for rows no block covers and for empty rows.
    The kernel's own lse (0 for a row it took as empty) is returned as well, so rows it skipped can be found.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flash_forward = _ops_for(q.device)[0]
        batch, heads, len_q, _ = q.shape
        out = q.new_zeros(batch, heads, len_q, v.shape[-1])
        lse = q.new_full((batch, heads, len_q), float("-inf"), dtype=compute_dtype(q.dtype))  # §6
        # The op's own lse, in its dtype (float64 for float64 inputs): its backward takes it back as it gave it.
        kernel_lse = torch.full_like(lse, float("-inf"), dtype=compute_dtype(q.dtype))
        for block in plan.blocks:
            mask, empty = plan.mask(block)
            k_span, v_span = k[:, :, block.cols], v[:, :, block.cols]
            block_out, block_lse = flash_forward(
                q[:, :, block.rows], k_span, v_span, 0.0, block.causal, attn_mask=mask, scale=scale
            )
            kernel_lse[:, :, block.rows] = block_lse
            if empty is not None:
                block_out = block_out.masked_fill(empty.unsqueeze(-1), 0.0)
                block_lse = block_lse.masked_fill(empty, float("-inf"))
            out[:, :, block.rows] = block_out
            lse[:, :, block.rows] = block_lse
        ctx.save_for_backward(q, k, v, out, kernel_lse)
        ctx.plan, ctx.scale = plan, scale
        ctx.mark_non_differentiable(kernel_lse)
        return out, lse, kernel_lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None, _: Any) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, kernel_lse = ctx.saved_tensors
        flash_backward = _ops_for(q.device)[1]
        plan, scale = ctx.plan, ctx.scale
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        with_dlse = dlse is not None and bool(dlse.any())
        for block in plan.blocks:
            mask, _ = plan.mask(block)
            rows, cols = block.rows, block.cols
            q_b, k_b, v_b, out_b, dout_b = (
                q[:, :, rows],
                k[:, :, cols],
                v[:, :, cols],
                out[:, :, rows],
                dout[:, :, rows],
            )
            if with_dlse:
                assert dlse is not None
                width = v.shape[-1] + 1
                q_b, k_b, out_b = _pad_last(q_b, width), _pad_last(k_b, width), _pad_last(out_b, width)
                v_b = torch.cat([v_b, torch.ones_like(v_b[..., :1])], dim=-1)
                dout_b = torch.cat([dout_b, dlse[:, :, rows].unsqueeze(-1).to(dout.dtype)], dim=-1)
            grads = flash_backward(
                dout_b.contiguous(), q_b, k_b, v_b, out_b, kernel_lse[:, :, rows], 0.0, block.causal,
                attn_mask=mask, scale=scale,
            )  # fmt: skip
            dq[:, :, rows] += grads[0][..., : q.shape[-1]]
            dk[:, :, cols] += grads[1][..., : k.shape[-1]]
            dv[:, :, cols] += grads[2][..., : v.shape[-1]]
        return dq, dk, dv, None, None


def _native_causal(
    spec: AttentionSpec, len_q: int, len_k: int, plain: bool, equal_dims: bool, masked: bool = False
) -> bool | None:
    """SDPA's ``is_causal`` for a call the public SDPA call computes exactly, or None when it cannot.

    ``plain``: no bias or lengths, and no lse wanted (and no mask unless ``masked``); ``equal_dims``: D = Dv.
    ``masked``: a boolean mask, which SDPA takes as it is (True = may attend, as §4.4); True then means causal in any
    alignment, which :func:`_masked_runner` applies beside the mask. With a mask the kernel propagates NaN at every
    key count and gives rows that see no key out 0 and zero gradients (both checked in tests/test_torch_sdpa.py and
    drawn by the conformance suite), so no key count is excluded.
    """
    if not plain or not equal_dims or spec.window is not None or (len_k < NAN_SAFE_KEYS and not masked):
        return None
    if not spec.causal:
        return False
    if alignment_offset(spec, len_q, len_k) == 0:  # the diagonal starts at key 0, as SDPA's own causal one
        return True
    if len_q == 1:  # one bottom-right query sees every key
        return False
    return True if masked else None


@functools.lru_cache(maxsize=16)
def _causal_band(spec: AttentionSpec, len_q: int, len_k: int, device: torch.device) -> torch.Tensor:
    """§4.1's causal band as a boolean (1, 1, Lq, Lk), made once per shape: a mask call folds it into its mask."""
    anchor = torch.empty(1, 0, 0, 0, device=device)
    band = Band(spec, AttentionInputs(anchor, anchor, anchor), len_q, len_k).visible()
    assert band is not None
    return band


def _causal_masked_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, the kernel's lse, the 0/−inf mask) of the flash op with its causal flag beside the boolean ``mask``."""
    assert _OPS is not None
    additive = torch.zeros((), dtype=compute_dtype(q.dtype), device=mask.device).where(mask, float("-inf"))
    out, lse = _OPS[0](q, k, v, 0.0, True, attn_mask=additive, scale=scale)
    return out, lse, additive


class _CausalMaskedFlash(torch.autograd.Function):
    """out of the flash op with its own top-left causal flag and the user mask as a 0/−inf float mask, for bhsd q, k,
    v with equal head dims: the kernel skips the key blocks past the diagonal, which SDPA given the same visibility
    as one mask cannot. No lse is returned and no empty row is looked for: with a mask the kernel gives rows that see
    no key out 0 and zero gradients, and propagates NaN (tests/test_torch_sdpa.py)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        out, lse, additive = _causal_masked_op(q, k, v, mask, scale)
        ctx.save_for_backward(q, k, v, out, lse, additive)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        assert _OPS is not None
        q, k, v, out, lse, additive = ctx.saved_tensors
        grads = _OPS[1](dout.contiguous(), q, k, v, out, lse, 0.0, True, attn_mask=additive, scale=ctx.scale)
        return grads[0], grads[1], grads[2], None, None


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """The op reads rows with unit stride (the public call checks that and copies; the op does not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _masked_runner(
    spec: AttentionSpec, is_causal: bool, grouped: bool, head_dim: int, len_q: int, len_k: int
) -> Runner:
    """The caller's boolean mask and what SDPA makes of it, with no empty-row scan or lse of ours around it; made
    once per (spec, problem), so the per-call work is the call itself.

    Without causal: the public SDPA call with the mask, what a user of SDPA writes. Causal with its diagonal at key
    0 (top-left, or Lq = Lk) and at least CAUSAL_OP_MIN_KEYS keys: the flash op with its causal flag and the mask
    (:class:`_CausalMaskedFlash`), which skips the key blocks past the diagonal. Otherwise the band folded into the
    mask, then the public call.
    """
    scale = spec.resolved_scale(head_dim)
    options = _sdpa_options(spec, False, grouped, scale)
    sdpa = F.scaled_dot_product_attention
    if not is_causal:

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return sdpa(q, k, v, attn_mask=mask, **options)

    elif alignment_offset(spec, len_q, len_k) == 0 and len_k >= CAUSAL_OP_MIN_KEYS:

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                return _CausalMaskedFlash.apply(q, k, v, mask, scale)
            return _causal_masked_op(q, k, v, mask, scale)[0]  # inference: no autograd.Function around it

    else:  # the band of this call's lengths: a runner serves every length of its class (Capabilities.length_generic)

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            band = _causal_band(spec, q.shape[2], k.shape[2], q.device)
            return sdpa(q, k, v, attn_mask=mask & band, **options)

    if spec.variant is not Variant.COSINE and spec.layout is Layout.BHSD:
        return lambda inputs: (attention(inputs.q, inputs.k, inputs.v, inputs.mask), None)
    bshd = spec.layout is Layout.BSHD

    def masked(inputs: AttentionInputs) -> tuple[Any, None]:
        q, k, v, mask = inputs.q, inputs.k, inputs.v, inputs.mask
        dtype = v.dtype
        if bshd:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if spec.variant is Variant.COSINE:
            q, k, v = _normalized(q), _normalized(k), v.to(compute_dtype(dtype))
        out = attention(q, k, v, mask).to(dtype)
        return (out.transpose(1, 2) if bshd else out), None

    return masked


def _normalized(x: torch.Tensor) -> torch.Tensor:
    """q̂ or k̂ in float32 (float64 stays): rounding q̂ to a half type before q̂·k̂ costs more than the tolerance."""
    return cosine_normalize(x.to(compute_dtype(x.dtype)))


def _native_runner(spec: AttentionSpec, is_causal: bool, grouped: bool, head_dim: int) -> Runner:
    """The public SDPA call, specialised once per (spec, problem): the per-call work is the call itself."""
    scale = spec.resolved_scale(head_dim)
    bshd = spec.layout is Layout.BSHD
    sdpa = F.scaled_dot_product_attention
    if spec.variant is Variant.COSINE:

        def cosine(inputs: AttentionInputs) -> tuple[torch.Tensor, None]:
            q, k, v = inputs.q, inputs.k, inputs.v
            if bshd:
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            wide = compute_dtype(v.dtype)
            out = sdpa(_normalized(q), _normalized(k), v.to(wide), is_causal=is_causal, scale=scale, enable_gqa=grouped)
            out = out.to(v.dtype)
            return (out.transpose(1, 2) if bshd else out), None

        return cosine
    options = _sdpa_options(spec, is_causal, grouped, scale)
    # The other fields are always None here (a plain call).
    if bshd:

        def transposed(inputs: AttentionInputs) -> tuple[torch.Tensor, None]:
            q, k, v = inputs.q.transpose(1, 2), inputs.k.transpose(1, 2), inputs.v.transpose(1, 2)
            return sdpa(q, k, v, **options).transpose(1, 2), None

        return transposed
    return lambda inputs: (sdpa(inputs.q, inputs.k, inputs.v, **options), None)


def _sdpa_options(spec: AttentionSpec, is_causal: bool, grouped: bool, scale: float) -> dict[str, Any]:
    """Only the keyword arguments that differ from SDPA's defaults: each one costs the call time at decode sizes."""
    options: dict[str, Any] = {}
    if is_causal:
        options["is_causal"] = True
    if spec.scale is not None or spec.variant is Variant.COSINE:  # cosine's default scale is 16, not SDPA's 1/√D
        options["scale"] = scale
    if grouped:
        options["enable_gqa"] = True
    return options


def _native_path(
    spec: AttentionSpec,
    heads_q: int,
    heads_kv: int,
    len_q: int,
    len_k: int,
    head_dim: int,
    head_dim_v: int,
    device: str,
    has_mask: bool,
    others_plain: bool,
) -> Runner | None:
    """The runner of SDPA's native path for a call, or None where it takes the blocked path (:func:`_flash_attention`).
    ``others_plain``: no bias or lengths, and no lse wanted."""
    # A mask takes SDPA's native path on the CPU only, where its empty rows and NaN were checked (tests): on CUDA the
    # lse path, which finds empty rows itself, until a GPU run shows what SDPA's kernels do with them.
    plain = others_plain and (not has_mask or device == "cpu")
    is_causal = _native_causal(spec, len_q, len_k, plain, head_dim == head_dim_v, has_mask)
    if is_causal is None:
        return None
    grouped = heads_q != heads_kv
    if has_mask:
        return _masked_runner(spec, is_causal, grouped, head_dim, len_q, len_k)
    return _native_runner(spec, is_causal, grouped, head_dim)


def _segments_as_mask(spec: AttentionSpec, inputs: AttentionInputs) -> AttentionInputs:
    """Segment ids (§4.5) as SDPA can take them: their clause ANDed into the boolean mask, (B, 1|Hq, Lq, Lk), so
    O(B·Lq·Lk) memory; and q, k, v zeroed at negative ids, where the kernel's P · V would multiply a weight of 0 by
    whatever the padding holds (NaN included). The masked paths then serve the call as they serve any mask."""
    if inputs.q_segment_ids is None:
        return inputs
    visible = segment_visibility(inputs.q_segment_ids, inputs.kv_segment_ids)
    mask = visible if inputs.mask is None else visible & inputs.mask
    return without_segment_padding(spec, inputs)._replace(mask=mask, q_segment_ids=None, kv_segment_ids=None)


def _program_as_mask(spec: AttentionSpec, inputs: AttentionInputs) -> AttentionInputs:
    """A mask program (§17) as SDPA can take it: materialised, (B|1, Hq|1, Lq, Lk), and ANDed into the boolean mask,
    so the masked paths serve it as any mask (O(Lq·Lk) memory, no key block skipped for it)."""
    bound = inputs.mask_program
    if bound is None:
        return inputs
    q, k = inputs.q, inputs.k
    seq, heads = (1, 2) if spec.layout is Layout.BSHD else (2, 1)
    visible = dense(bound, q.shape[0], q.shape[heads], q.shape[seq], k.shape[seq], q)
    mask = visible if inputs.mask is None else visible & inputs.mask
    return inputs._replace(mask=mask, mask_program=None)


def sdpa_attention(spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[torch.Tensor, Any]:
    """(out, lse or None) per the contract; differentiable by torch autograd wherever grad is enabled."""
    inputs = _segments_as_mask(spec, _program_as_mask(spec, inputs))
    q, k, v = inputs.q, inputs.k, inputs.v
    if spec.layout is Layout.BSHD:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    others_plain = not need_lse and all(t is None for t in inputs[4:])  # no bias, lengths or lse
    runner = _native_path(
        spec, q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3], q.device.type,
        inputs.mask is not None, others_plain,
    )  # fmt: skip
    if runner is not None:
        return runner(inputs)
    return _flash_attention(spec, inputs, q, k, v, spec.resolved_scale(q.shape[3]))


def _flash_attention(
    spec: AttentionSpec, inputs: AttentionInputs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = q.dtype
    batch, heads_q, len_q, head_dim = q.shape
    len_k, dim_v = k.shape[2], v.shape[-1]
    if q.numel() == 0 or len_k == 0:  # §9; the kernel faults on Lk = 0
        # Sums over empty extents are exactly 0 (NaN-free) and keep out in the autograd graph.
        out = q[..., :0].sum(-1, keepdim=True).expand(batch, heads_q, len_q, dim_v) + (k.sum() + v.sum()).to(dtype)
        lse = q[..., :0].sum(-1).to(compute_dtype(dtype)) + float("-inf")
        return (out.transpose(1, 2) if spec.layout is Layout.BSHD else out), lse
    q, k, v = zero_padding(q, inputs.q_lengths), zero_padding(k, inputs.kv_lengths), zero_padding(v, inputs.kv_lengths)
    if spec.variant is Variant.COSINE:
        q, k, v = _normalized(q), _normalized(k), v.to(compute_dtype(dtype))
    width = max(head_dim, dim_v)
    # The op reads rows with unit stride (the public call checks that and copies; the op does not).
    q, k, v = (_pad_last(x, width) for x in (q, k, v))
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if q.is_cuda and k.shape[1] != heads_q:  # the CUDA kernel takes equal head counts; autograd sums dk, dv back
        k, v = (x.repeat_interleave(heads_q // x.shape[1], dim=1) for x in (k, v))
    out, lse, kernel_lse = _BlockedFlash.apply(q, k, v, _Plan(spec, inputs, q, k), scale)
    if bool(((kernel_lse == 0) & (lse != float("-inf"))).any()):
        # A row the kernel skipped though the contract sees keys: its first scores were NaN (or −inf from bias).
        out, lse = literal_attention(spec, inputs, compute_dtype(dtype))
        return out.to(dtype), lse.to(compute_dtype(dtype))
    out = out[..., :dim_v].to(dtype)
    return (out.transpose(1, 2) if spec.layout is Layout.BSHD else out), lse


def _problem_native_path(spec: AttentionSpec, problem: Problem) -> Runner | None:
    """:func:`_native_path` for a call's signature; segment ids and a mask program run as a mask
    (:func:`_segments_as_mask`, :func:`_program_as_mask`)."""
    masked = problem.has_mask or problem.has_segment_ids or problem.has_mask_program
    others_plain = replace(problem, has_mask=False, has_segment_ids=False, has_mask_program=False).is_plain()
    return _native_path(
        spec, problem.heads_q, problem.heads_kv, problem.len_q, problem.len_k, problem.head_dim, problem.head_dim_v,
        problem.device, masked, others_plain,
    )  # fmt: skip


def _takes_op_path(spec: AttentionSpec, problem: Problem) -> bool:
    """Whether a call runs the flash op (on CUDA, aten::_efficient_attention_forward/_backward) rather than SDPA."""
    return _problem_native_path(spec, problem) is None


#: The path refused on CUDA until a GPU run has passed it (Capabilities.unverified).
CUDA_HALF_OP_BACKWARD = "the float16/bfloat16 backward through aten::_efficient_attention_backward"


class TorchSdpaBackend(RecomputingBackend):
    """torch's scaled-dot-product attention: the CPU flash kernel, with lse, through the public call or its op."""

    name = "torch-sdpa"
    capabilities = Capabilities(
        length_generic=True,
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        devices=frozenset({"cpu", "cuda"}),
        features=ALL_FEATURES - {Feature.SOFTCAP, Feature.DBIAS, Feature.PAGED, Feature.ALIBI, Feature.DROPOUT},
        unsupported_because=(
            (Feature.DROPOUT, "SDPA draws dropout from its own generator, which cannot give the contract's keep-mask"),
        ),
        materialises_mask_programs=True,
        per_device=(("cuda", DeviceLimits(dtypes=CUDA_DTYPES, head_dims=(1, MAX_CUDA_HEAD_DIM))),),
        unverified=(
            Unverified(
                "cuda",
                CUDA_HALF_OP_BACKWARD,
                "2026-11-27, H200: dq and dk inf or ~1e37 in every half-precision case with gradients on this path; "
                "cause: the kernel reads out by contiguous rows and was given a transposed view; now passed contiguous",
            ),
        ),
        description="torch scaled_dot_product_attention (CPU flash kernel, CUDA's own; lse, windows and lengths "
        "through the kernel's op)",
        notes=(
            "softcap: SDPA has no score modifier, and a float mask is added after the scale, not before a tanh",
            "dbias: the flash backward returns no gradient for attn_mask",
            "cuda: plain calls are SDPA itself (its flash, cuDNN or memory-efficient kernel, as SDPA picks); lse, "
            "masks, bias, windows and lengths run aten::_efficient_attention_forward/_backward (float16, bfloat16, "
            f"float32; head dims up to {MAX_CUDA_HEAD_DIM}; GQA by repeating k and v); float64: not on cuda",
            f"bottom-right causal with Lq != Lk, window, lengths: blocks of {BLOCK_Q} queries over the key span their "
            "band reaches, with a (block, span) mask; memory linear in L",
            "mask programs: SDPA takes no mask_mod; the program is materialised as a boolean (B|1, Hq|1, Lq, Lk) mask "
            "and ANDed into the call's (O(L²) memory, no key block skipped for it)",
            "segment ids: SDPA has no document clause; they become a boolean (B, 1, Lq, Lk) mask (O(L²) memory, "
            "no key block skipped for the documents), with q, k, v zeroed at negative ids; the shipped order puts "
            "the backends that skip the tiles documents hide first",
            "Dv != D: q, k, v zero-padded to max(D, Dv) for the op",
            "paged: SDPA reads contiguous k and v only; a block table would need the cache gathered into a copy, "
            "which attend_paged exists to avoid",
            f"needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} and aten::_scaled_dot_product_flash_attention_for_cpu",
        ),
    )

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        reasons = super().supports(spec, problem)
        half = problem.dtype in ("float16", "bfloat16")
        if problem.device == "cuda" and half and problem.needs_grad and _takes_op_path(spec, problem):
            reasons += pending_hardware(self, "cuda", CUDA_HALF_OP_BACKWARD)
        return reasons

    def available(self) -> list[str]:
        if _OPS is None:
            return [
                f"torch {torch.__version__} lacks enable_gqa or aten::_scaled_dot_product_flash_attention_for_cpu "
                f"(needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]})"
            ]
        return []

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[torch.Tensor, Any]:
        return sdpa_attention(spec, inputs, need_lse)

    def differentiable_forward(self, spec: AttentionSpec, problem: Problem) -> Runner:
        runner = _problem_native_path(spec, problem)
        if runner is not None and (problem.has_segment_ids or problem.has_mask_program):
            return lambda inputs: runner(_segments_as_mask(spec, _program_as_mask(spec, inputs)))
        if runner is not None:
            return runner
        return functools.partial(sdpa_attention, spec, need_lse=problem.return_lse)

    def plain_call(self, spec: AttentionSpec, problem: Problem) -> PlainCall | None:
        """SDPA itself (or a partial of it) where the native path is the public call on bhsd tensors."""
        if spec.variant is Variant.COSINE or spec.layout is Layout.BSHD:
            return None
        is_causal = _native_causal(spec, problem.len_q, problem.len_k, True, problem.head_dim == problem.head_dim_v)
        if is_causal is None:
            return None
        options = _sdpa_options(
            spec, is_causal, problem.heads_q != problem.heads_kv, spec.resolved_scale(problem.head_dim)
        )
        sdpa = F.scaled_dot_product_attention
        return functools.partial(sdpa, **options) if options else sdpa

    def recompute(self, spec: AttentionSpec, inputs: AttentionInputs) -> tuple[torch.Tensor, Any]:
        """For callers of the protocol's backward: the forward again under torch autograd."""
        return sdpa_attention(spec, inputs, need_lse=True)
