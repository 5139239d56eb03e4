"""``torch-flex``: the contract lowered onto ``torch.nn.attention.flex_attention``, compiled by inductor for CPU.

What flex_attention does on CPU in torch 2.13 (measured; docs/native.md): the compiled forward lowers to a fused
C++ template that skips hidden key blocks, for float32, bfloat16 and float16 only. It cannot return the
logsumexp ("torch.compile on CPU only supports inference and `return_lse` is not supported yet") and it has no
backward at all, compiled or eager ("FlexAttention does not support backward on CPU"). Eager flex_attention
materialises the full (Lq, Lk) scores. Dynamic shapes (``dynamic=True``) fail in the C++ compiler for most
shapes, so every shape compiles once, statically (a few seconds each).

The lowering:

* Scores: ``score_mod`` applies scale, softcap and bias in that order (§3) to the float32 score the kernel
  accumulates; flex's own ``scale`` is 1. Scale, softcap, offsets and window sides are 0-d or (B,) tensors
  captured by the mods, never Python numbers, so a new value does not recompile (dynamo specialises on floats).
* Visibility: ``mask_mod`` is §4 (causal and window aligned per batch, lengths); a user mask is folded into one
  dense visibility tensor it reads (the user mask is (Lq, Lk) already). The :class:`BlockMask` is built from
  per-row key ranges, block by block, never from a dense (Lq, Lk) grid, so memory stays linear in L.
* lse, which the CPU kernel cannot return, comes out of the same fused pass through a sink key: key Lk is
  appended with score ``t`` (a per-row bound of the scores, below) and v gets two columns, 1 on the real keys
  and 1 on the sink. The kernel then returns ``o_real = Σ_real p`` and ``o_sink = p_sink``, and
  ``lse = t + log(o_real) − log(o_sink)``, ``out = out' / o_real``. Both are exact up to float32 rounding while
  ``|t − lse|`` is within float32's exponent range; ``t`` is an upper bound of the row's scores less a margin,
  and a row where either column underflows sends the whole call to ``torch-chunked`` (exact, linear memory).
  This pass runs in float32 (float16 cannot hold the small columns).
* Gradients: flex has none on CPU, so ``backward`` is ``torch-chunked``'s FlashAttention-2 backward, from this
  forward's ``out`` and ``lse``.
* Fully masked rows: found from the row ranges (or the dense visibility), set to out 0 and lse −inf.
* Padding beyond lengths is zeroed before the kernel (0·NaN would otherwise reach visible rows).
* NaN: the CPU kernel can turn a row whose scores include NaN into a finite one, so a call with NaN in q, k, v or
  bias (outside padding) runs on ``torch-chunked``, which propagates it (§5).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from attnkit.backends.reference.torch_chunked import TorchChunkedBackend
from attnkit.backends.reference.torch_common import visibility, zero_padding

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
MIN_TORCH = (2, 6)  # BlockMask.from_kv_blocks with seq_lengths, the CPU C++ flex template
BLOCK_SIZE = 128  # the BlockMask block; the CPU kernel's default
# The sink's score sits this far below the row's score bound: lse lies in [max score, bound + log Lk], so the two
# columns stay inside float32's normal range (e^±87) for bounds up to ~(87 + margin) above the true maximum.
SINK_MARGIN = 32.0
TINY = torch.finfo(torch.float32).tiny  # below it a column has lost precision (subnormal): fall back
HUGE = 1e30  # a finite stand-in for an unbounded score bound; the underflow check then sends the call to fallback

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch < 2.5
    flex_attention = None  # type: ignore[assignment]
    BlockMask = None  # type: ignore[assignment,misc]


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _cpu_template_reason() -> str | None:
    """Why inductor's C++ flex template cannot run here, or None."""
    try:
        from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
    except ImportError:
        return None  # older layout of inductor: its lowering says so at compile time
    return None if check_cpu_supported() else "inductor's CPU flex_attention template needs AVX2 (x86)"


def _flex_call(q: Any, k: Any, v: Any, score_mod: Any, block_mask: Any, enable_gqa: bool) -> Any:
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=1.0, enable_gqa=enable_gqa)


class _CompiledCache:
    """One compiled ``flex_attention`` per call signature (shapes, dtype, which mods, threads).

    Each entry compiles a copy of ``_flex_call`` with its own code object: dynamo keeps its graphs and its
    recompile limit (8) per code object, so one shared function would fall back to eager (unfused, quadratic
    memory) after eight shapes. Compiled statically: ``dynamic=True`` fails in the C++ compiler (torch 2.13).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._functions: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def __len__(self) -> int:
        return len(self._functions)

    def get(self, key: tuple[Any, ...]) -> Callable[..., Any]:
        with self._lock:
            function = self._functions.get(key)
            if function is None:
                code = _flex_call.__code__.replace(co_name=f"_flex_call_{len(self._functions)}")
                fresh = types.FunctionType(code, _flex_call.__globals__, code.co_name)
                function = torch.compile(fresh, dynamic=False, fullgraph=True)
                self._functions[key] = function
            return function


COMPILED = _CompiledCache()
_FALLBACK = TorchChunkedBackend()


def _bhsd(spec: AttentionSpec, x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2) if spec.layout is Layout.BSHD else x


class _Rows:
    """Per batch element and query row, the keys causal, window and lengths allow: ``first <= j <= last``.

    ``first > last`` means none. Shapes (B, Lq), int64; memory linear in L.
    """

    def __init__(self, spec: AttentionSpec, inputs: AttentionInputs, batch: int, len_q: int, len_k: int) -> None:
        device = inputs.q.device
        self.kv_len = (
            inputs.kv_lengths.to(device, torch.long)
            if inputs.kv_lengths is not None
            else torch.full((batch,), len_k, device=device)
        )
        self.q_len = (
            inputs.q_lengths.to(device, torch.long)
            if inputs.q_lengths is not None
            else torch.full((batch,), len_q, device=device)
        )
        if spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT:
            self.offset = self.kv_len - self.q_len
        else:
            self.offset = torch.zeros(batch, dtype=torch.long, device=device)
        left, right = spec.window or (None, None)
        self.left = left
        highs = [bound for bound in (0 if spec.causal else None, right) if bound is not None]
        self.high = min(highs) if highs else None  # j - (i + offset) <= high
        rows = torch.arange(len_q, device=device).view(1, -1)
        aligned = rows + self.offset.view(-1, 1)
        first = aligned - left if left is not None else torch.zeros_like(aligned)
        last = aligned + self.high if self.high is not None else torch.full_like(aligned, len_k - 1)
        self.first = first.clamp(min=0)
        self.last = torch.minimum(last, self.kv_len.view(-1, 1) - 1)
        self.last = torch.where(rows < self.q_len.view(-1, 1), self.last, torch.full_like(self.last, -1))

    def empty(self) -> torch.Tensor:
        """(B, 1, Lq) bool: rows that see no key."""
        return (self.first > self.last).unsqueeze(1)


def _dense_blocks_to_mask(
    partial: torch.Tensor, full: torch.Tensor, len_q: int, len_k: int, mask_mod: Any
) -> BlockMask:
    """A BlockMask from (B, H|1, nQ, nK) booleans: blocks that need mask_mod, and blocks seen whole."""

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = blocks.sum(-1, dtype=torch.int32)
        indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts, indices

    kv_num, kv_indices = ordered(partial)
    full_num, full_indices = ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=BLOCK_SIZE,
        mask_mod=mask_mod,
        seq_lengths=(len_q, len_k),
    )


def _row_blocks(rows: _Rows, len_q: int, kernel_len_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 1, nQ, nK) partial and full blocks from the row ranges: B·Lq·nK work and memory, no (Lq, Lk) grid."""
    batch = rows.first.shape[0]
    n_q, n_k = -(-len_q // BLOCK_SIZE), -(-kernel_len_k // BLOCK_SIZE)
    pad = n_q * BLOCK_SIZE - len_q
    big = kernel_len_k + 1
    # Rows past Lq do not exist: they see nothing for "any", and do not spoil "all".
    first_any = F.pad(rows.first, (0, pad), value=big).view(batch, n_q, BLOCK_SIZE, 1)
    last_any = F.pad(rows.last, (0, pad), value=-1).view(batch, n_q, BLOCK_SIZE, 1)
    first_all = F.pad(rows.first, (0, pad), value=0).view(batch, n_q, BLOCK_SIZE, 1)
    last_all = F.pad(rows.last, (0, pad), value=big).view(batch, n_q, BLOCK_SIZE, 1)
    starts = torch.arange(n_k, device=rows.first.device) * BLOCK_SIZE
    ends = torch.clamp(starts + BLOCK_SIZE, max=kernel_len_k) - 1
    seen = (torch.maximum(first_any, starts) <= torch.minimum(last_any, ends)).any(dim=2)
    whole = ((first_all <= starts) & (last_all >= ends)).all(dim=2)
    return (seen & ~whole).unsqueeze(1), whole.unsqueeze(1)


def _dense_blocks(visible: torch.Tensor, kernel_len_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B|1, H|1, nQ, nK) partial blocks (any visible pair) of a dense visibility; no block is taken as whole."""
    len_q, len_k = visible.shape[-2:]
    n_q, n_k = -(-len_q // BLOCK_SIZE), -(-kernel_len_k // BLOCK_SIZE)
    padded = F.pad(visible, (0, n_k * BLOCK_SIZE - len_k, 0, n_q * BLOCK_SIZE - len_q), value=False)
    seen = padded.view(*visible.shape[:2], n_q, BLOCK_SIZE, n_k, BLOCK_SIZE).any(dim=5).any(dim=3)
    return seen, torch.zeros_like(seen)


def _index(tensor_shape: torch.Size, b: Any, h: Any, i: Any) -> tuple[Any, Any, Any]:
    """Indices into a (B|1, H|1, Lq|1, ...) tensor: 0 along a broadcast axis."""
    return (b if tensor_shape[0] > 1 else 0, h if tensor_shape[1] > 1 else 0, i if tensor_shape[2] > 1 else 0)


def _mods(
    spec: AttentionSpec,
    rows: _Rows,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: float,
    len_k: int,
    sink: torch.Tensor | None,
    device: torch.device,
) -> tuple[Any, Any, tuple[Any, ...]]:
    """(score_mod, mask_mod, structure): the mods for this call, and what of them changes the compiled graph."""
    scale_t = torch.tensor(scale, dtype=torch.float32, device=device)
    softcap = torch.tensor(spec.softcap, dtype=torch.float32, device=device) if spec.softcap is not None else None
    sink_index = len_k  # the appended key; only ever read when ``sink`` is given

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        score = score * scale_t
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            bb, bh, bi = _index(bias.shape, b, h, q_idx)
            bj = torch.clamp(kv_idx, max=bias.shape[3] - 1) if bias.shape[3] > 1 else 0
            score = score + bias[bb, bh, bi, bj]
        if sink is not None:
            score = torch.where(kv_idx == sink_index, sink[b, h, q_idx], score)
        return score

    offset, q_len, kv_len = rows.offset, rows.q_len, rows.kv_len
    left, high = rows.left, rows.high

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if visible is not None:  # the dense visibility: user mask, and everything else, already folded in
            vb, vh, vi = _index(visible.shape, b, h, q_idx)
            allowed = visible[vb, vh, vi, torch.clamp(kv_idx, max=visible.shape[3] - 1)] & (kv_idx < len_k)
        else:
            allowed = (kv_idx < kv_len[b]) & (q_idx < q_len[b])
            if high is not None:
                allowed = allowed & (kv_idx - q_idx - offset[b] <= high)
            if left is not None:
                allowed = allowed & (kv_idx - q_idx - offset[b] >= -left)
        if sink is not None:
            allowed = allowed | (kv_idx == sink_index)
        return allowed

    # What the traced graph depends on besides q, k, v: which branches run, the shapes the mods index, and the
    # window sides (Python ints in the graph: a new side is a new graph, as a new shape is).
    structure = (
        spec.softcap is not None,
        None if bias is None else tuple(bias.shape),
        None if visible is None else tuple(visible.shape),
        sink is not None,
        high,
        left,
    )
    return score_mod, mask_mod, structure


def _score_bound(
    spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """(B, Hq, Lq) float64: an upper bound of each row's scores (Cauchy–Schwarz, softcap, bias max).

    Non-finite norms count as 0: a NaN key poisons only the rows that see it, through the kernel itself.
    """
    heads_q, heads_kv = q.shape[1], k.shape[1]
    q_norm = torch.linalg.vector_norm(q.double(), dim=-1).nan_to_num(0.0, 0.0, 0.0)
    k_norm = torch.linalg.vector_norm(k.double(), dim=-1).nan_to_num(0.0, 0.0, 0.0)
    k_max = k_norm.amax(dim=-1).repeat_interleave(heads_q // heads_kv, dim=1)
    bound = (scale * q_norm * k_max.unsqueeze(-1)).clamp(max=HUGE)
    if spec.softcap is not None:
        bound = spec.softcap * torch.tanh(bound / spec.softcap)
    if bias is not None:
        bias_max = bias.double().nan_to_num(0.0, HUGE, -HUGE).amax(dim=-1).clamp(-HUGE, HUGE)
        bound = bound + bias_max.expand(q.shape[0], heads_q, q.shape[2])
    return bound


def flex_forward(spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[torch.Tensor, Any]:
    """(out, lse) per the contract; lse None when not asked for. Not differentiable (see ``backward``)."""
    # detach: flex refuses inputs that require grad on CPU, even under no_grad; gradients come from ``backward``.
    q, k, v = (_bhsd(spec, x).detach() for x in (inputs.q, inputs.k, inputs.v))
    batch, heads_q, len_q, head_dim = q.shape
    heads_kv, len_k, dim_v = k.shape[1], k.shape[2], v.shape[-1]
    if q.numel() == 0 or len_k == 0:  # §9: nothing for a kernel to do
        return _FALLBACK.forward(spec, inputs, need_lse)
    dtype = q.dtype
    # With lse the two normaliser columns need float32's range, so that pass computes in float32 (§7 accumulation).
    kernel_dtype = torch.float32 if need_lse else dtype
    scale = spec.resolved_scale(head_dim)
    if inputs.q_lengths is not None:
        q = zero_padding(q, inputs.q_lengths)
    if inputs.kv_lengths is not None:
        k, v = zero_padding(k, inputs.kv_lengths), zero_padding(v, inputs.kv_lengths)
    if spec.variant is Variant.COSINE:
        # In float32: 1e-12 underflows to 0 in float16, and 0/0 would make a zero (padding) row NaN.
        q, k = (F.normalize(x.float(), dim=-1, eps=COSINE_EPS) for x in (q, k))
    q, k, v = q.to(kernel_dtype), k.to(kernel_dtype), v.to(kernel_dtype)
    if any(bool(x.isnan().any()) for x in (q, k, v, inputs.bias) if x is not None):
        # The CPU kernel does not propagate NaN scores reliably (a row that sees a NaN key can come out finite);
        # §5 wants NaN out wherever a visible input is NaN. Rare, so the exact path takes the whole call.
        return _FALLBACK.forward(spec, inputs, need_lse)
    rows = _Rows(spec, inputs, batch, len_q, len_k)
    dense = visibility(spec, inputs, len_q, len_k) if inputs.mask is not None else None
    empty = ~dense.any(dim=-1) if dense is not None else rows.empty()  # (B|1, H|1, Lq)
    bias = inputs.bias.float() if inputs.bias is not None else None

    sink = None
    kernel_len_k = len_k
    if need_lse:
        sink = (_score_bound(spec, q, k, bias, scale) - SINK_MARGIN).float()
        kernel_len_k = len_k + 1
        k = F.pad(k, (0, 0, 0, 1))  # the sink key: its score comes from score_mod, not from q·k
        # Value columns [v, 1 on real keys, 0] and the sink's row [0, 0, 1].
        v = F.pad(F.pad(v, (0, 1), value=1.0), (0, 1, 0, 1))
        v[:, :, len_k, dim_v + 1] = 1.0
    score_mod, mask_mod, structure = _mods(spec, rows, dense, bias, scale, len_k, sink, q.device)
    partial, full = _dense_blocks(dense, kernel_len_k) if dense is not None else _row_blocks(rows, len_q, kernel_len_k)
    if sink is not None:  # the sink's block is read by every query block
        sink_block = len_k // BLOCK_SIZE
        partial[..., sink_block] |= ~full[..., sink_block]
    block_mask = _dense_blocks_to_mask(partial, full, len_q, kernel_len_k, mask_mod)
    key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, structure, torch.get_num_threads())
    out = COMPILED.get(key)(q, k, v, score_mod, block_mask, heads_q != heads_kv)

    lse = None
    if sink is not None:
        real_weight, sink_weight = out[..., dim_v].double(), out[..., dim_v + 1].double()
        live = ~empty.expand(batch, heads_q, len_q)
        underflow = live & ((real_weight < TINY) | (sink_weight < TINY))
        if bool(underflow.any()):  # the bound was too loose for float32: exact, linear memory
            return _FALLBACK.forward(spec, inputs, need_lse)
        lse = (sink.double() + torch.log(real_weight) - torch.log(sink_weight)).float()
        lse = lse.masked_fill(~live, float("-inf"))
        out = out[..., :dim_v] / out[..., dim_v : dim_v + 1]
    out = out.masked_fill(empty.unsqueeze(-1), 0.0).to(dtype)
    return (out.transpose(1, 2) if spec.layout is Layout.BSHD else out), lse


class TorchFlexBackend:
    """torch flex_attention, compiled for CPU: block-sparse causal/window/lengths, score_mod softcap and bias."""

    name = "torch-flex"
    capabilities = Capabilities(
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        devices=frozenset({"cpu"}),
        features=frozenset(
            {
                "causal",
                "top_left",
                "window",
                "cosine",
                "softcap",
                "bshd",
                "mask",
                "bias",
                "q_lengths",
                "kv_lengths",
                "lse",
                "grad",
                "dbias",
            }
        ),
        description="torch flex_attention compiled by inductor (CPU C++ template, block-sparse); lse via a sink key",
        notes=(
            "float64: inductor's CPU flex template takes float32, bfloat16 and float16 only",
            "cuda: not lowered yet (flex's Triton path; flash-attn and triton serve CUDA)",
            "grad, dbias: torch 2.13 flex has no CPU backward; torch-chunked's backward runs from flex's out and lse",
            "lse: the CPU kernel cannot return it; one sink key and two value columns give it in the same pass, "
            "computed in float32; a row outside float32's range sends the call to torch-chunked",
            "every new shape compiles once (seconds): dynamic shapes fail to compile on CPU in torch 2.13",
            "a user mask is read densely (it is (Lq, Lk) already); causal, window and lengths are block-sparse",
            f"needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} with the C++ flex template (x86 with AVX2)",
        ),
    )

    def available(self) -> list[str]:
        if flex_attention is None or _torch_version() < MIN_TORCH:
            return [f"torch {torch.__version__} has no CPU flex_attention template (needs torch >= 2.6)"]
        reason = _cpu_template_reason()
        return [reason] if reason else []

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        return capability_reasons(self.capabilities, spec, problem)

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[torch.Tensor, Any]:
        with torch.no_grad():
            return flex_forward(spec, inputs, need_lse)

    def backward(
        self,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
    ) -> Gradients:
        """torch-chunked's FlashAttention-2 backward: flex has no backward on CPU (torch 2.13)."""
        return _FALLBACK.backward(spec, inputs, out, lse, dout, dlse)
