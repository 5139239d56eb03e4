"""The contract (docs/semantics.md) written in torch ops: visibility, scores, layouts, and the literal attention the
oracle runs. Public, for backends: the reference backends are built from it, and native backends use it for what
their library call cannot express."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnkit.backend import AttentionInputs, AttentionSpec, CausalAlignment, Gradients, Layout, Variant
from attnkit.contract import COSINE_EPS


def to_bhsd(spec: AttentionSpec, x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2) if spec.layout is Layout.BSHD else x


def from_bhsd(spec: AttentionSpec, x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2) if spec.layout is Layout.BSHD else x


def normalize_if_cosine(spec: AttentionSpec, x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=-1, eps=COSINE_EPS) if spec.variant is Variant.COSINE else x


def zero_padding(x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """bhsd x with positions at or beyond lengths[b] set to 0: padding is never read (§5), so garbage
    there, NaN included, cannot leak through 0·NaN."""
    if lengths is None:
        return x
    positions = torch.arange(x.shape[2], device=x.device).view(1, 1, -1, 1)
    return torch.where(positions < lengths.view(-1, 1, 1, 1), x, torch.zeros((), dtype=x.dtype, device=x.device))


def block_of(x: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
    """The (rows, cols) block of a 4-D mask or bias (B|1, Hq|1, Lq|1, Lk|1), leaving broadcast (size-1) axes whole:
    slicing one of those past its first row would leave nothing."""
    return x[:, :, rows if x.shape[2] != 1 else slice(None), cols if x.shape[3] != 1 else slice(None)]


#: (spec, inputs, Lq, Lk) -> boolean visibility broadcastable to (B, Hq, Lq, Lk), or None when every pair is visible.
VisibilityRule = Callable[[AttentionSpec, AttentionInputs, int, int], torch.Tensor | None]


def visibility(
    spec: AttentionSpec,
    inputs: AttentionInputs,
    len_q: int,
    len_k: int,
    rows: slice | None = None,
    cols: slice | None = None,
) -> torch.Tensor | None:
    """Boolean (B|1, Hq|1, rows, cols): may query i see key j (docs/semantics.md §4). None = all visible.

    Causal and window use the alignment offset, per batch element when lengths are given:
    ``off = kv_len[b] - q_len[b]`` for bottom-right, 0 for top-left.
    """
    device = inputs.q.device
    rows = rows or slice(0, len_q)
    cols = cols or slice(0, len_k)
    i = torch.arange(rows.start, rows.stop, device=device).view(1, 1, -1, 1)
    j = torch.arange(cols.start, cols.stop, device=device).view(1, 1, 1, -1)
    q_len = inputs.q_lengths.view(-1, 1, 1, 1).long() if inputs.q_lengths is not None else None
    kv_len = inputs.kv_lengths.view(-1, 1, 1, 1).long() if inputs.kv_lengths is not None else None
    visible: torch.Tensor | None = None

    def conjoin(condition: torch.Tensor) -> None:
        nonlocal visible
        visible = condition if visible is None else visible & condition

    if spec.causal or spec.window is not None:
        if spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT:
            offset = (kv_len if kv_len is not None else len_k) - (q_len if q_len is not None else len_q)
        else:
            offset = 0
        aligned = i + offset
        if spec.causal:
            conjoin(j <= aligned)
        if spec.window is not None:
            left, right = spec.window
            if left is not None:
                conjoin(j >= aligned - left)
            if right is not None:
                conjoin(j <= aligned + right)
    if kv_len is not None:
        conjoin(j < kv_len)
    if q_len is not None:
        conjoin(i < q_len)
    if inputs.mask is not None:
        conjoin(block_of(inputs.mask, rows, cols))
    return visible


def scores(
    spec: AttentionSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """S = softcap(scale · q kᵀ) + bias for bhsd q (B, Hq, Lq, D) and k (B, Hkv, Lk, D), without repeating k.

    Returns (B, Hq, Lq, Lk). q and k must already be normalised for the cosine variant.
    """
    batch, heads_q, len_q, head_dim = q.shape
    heads_kv = k.shape[1]
    group = heads_q // heads_kv
    grouped = q.reshape(batch, heads_kv, group * len_q, head_dim)
    s = torch.matmul(grouped, k.transpose(-1, -2)).reshape(batch, heads_q, len_q, k.shape[2]) * scale
    if spec.softcap is not None:
        s = torch.tanh(s / spec.softcap) * spec.softcap
    if bias is not None:
        s = s + bias
    return s


def weighted_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """P (B, Hq, Lq, Lk) times v (B, Hkv, Lk, Dv) for grouped heads, without repeating v."""
    batch, heads_q, len_q, len_k = p.shape
    heads_kv = v.shape[1]
    grouped = p.reshape(batch, heads_kv, (heads_q // heads_kv) * len_q, len_k)
    return torch.matmul(grouped, v).reshape(batch, heads_q, len_q, v.shape[-1])


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 accumulation for the half types (docs/semantics.md §7); float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def literal_attention(
    spec: AttentionSpec, inputs: AttentionInputs, dtype: torch.dtype, visibility_rule: VisibilityRule | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) computed in ``dtype`` throughout; differentiable by torch autograd.

    ``visibility_rule`` defaults to :func:`visibility`; the oracle passes its own, written independently
    (backends/reference/torch_naive.py), so that a slip in this one cannot pass the oracle and the backends alike.

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
    visible = (visibility_rule or visibility)(spec, inputs, len_q, len_k)
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


def gradients_by_autograd(
    forward: Callable[[AttentionInputs], tuple[torch.Tensor, torch.Tensor]],
    inputs: AttentionInputs,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
) -> Gradients:
    """The protocol's ``backward`` for a backend whose forward is differentiable torch code: ``forward`` (inputs ->
    out, lse) once more under autograd, pulled back from (dout, dlse). An empty row's −inf lse takes no cotangent."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v)]
        out, lse = forward(inputs._replace(q=leaves[0], k=leaves[1], v=leaves[2]))
        outputs, cotangents = [out], [dout]
        if dlse is not None:
            outputs.append(torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
            cotangents.append(dlse)
        grads = torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True)
    dq, dk, dv = (g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(grads, leaves))
    return Gradients(dq=dq, dk=dk, dv=dv)
