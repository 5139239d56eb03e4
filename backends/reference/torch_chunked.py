"""torch-chunked: the FlashAttention-2 algorithm in torch tensor ops, memory linear in sequence length.

Queries and keys are cut into tiles; the forward keeps a running max and sum per row (online softmax) and
saves only ``out`` and ``lse``; the backward recomputes each probability tile from ``lse``. Tiles that the
causal/window/length geometry, the segment ids or a mask program hide entirely (in every batch element and head)
are never computed, and tiles they show entirely are never masked. A mask program (§17) is read through its tile
classes (:func:`attnkit.contract.programs.cached_tile_classes`) for the plan and evaluated by broadcasting over the
index ranges of each tile that needs a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.backend import (
    ALL_FEATURES,
    AttentionInputs,
    AttentionSpec,
    BaseBackend,
    Capabilities,
    Dropout,
    Framework,
    Gradients,
    Layout,
    PagedInputs,
    Variant,
)
from attnkit.contract import conjoin
from attnkit.contract.dropout import keep_tile
from attnkit.contract.programs import EMPTY, FULL, BoundProgram, array_ops, cached_tile_classes, evaluate
from attnkit.contract.torch import (
    Band,
    compute_dtype,
    from_bhsd,
    gather_pages,
    normalize_if_cosine,
    to_bhsd,
    zero_padding,
)

NEG_INF = float("-inf")

# On a 2-core CPU (B=1, H=8, L=4096, D=64, float32, causal forward+backward) 128x128 and 256x256 were equally fast
# and 64 slower (Python overhead); 128 wastes less work on the diagonal tiles of causal calls.
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128

# Internal layouts. Query-side tensors (q, out, dout, dq) are (B, Hkv, L, G, D) with G = Hq // Hkv, and per-row
# statistics (lse, delta) are (B, Hkv, L, G): the rows of one query tile for all G heads sharing a kv head are then
# contiguous, so a tile is a (B, Hkv, tile_q * G, D) view and one batched matmul against the (B, Hkv, Lk, D) keys
# serves every query head, without repeating K or V. Mask and bias are viewed as (B|1, Hkv|1, Lq|1, G|1, Lk|1) so
# they broadcast onto a score tile seen as (B, Hkv, tile_q, G, tile_k).


def _query_side(x: torch.Tensor, heads_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, Hq, L, ...) with any strides -> contiguous (B, Hkv, L, G, ...) in ``dtype``, in one copy.

    For bhsd q, out, dout (B, Hq, L, D) and for per-row values such as lse (B, Hq, L).
    """
    grouped = x.unflatten(1, (heads_kv, x.shape[1] // heads_kv)).transpose(2, 3)
    return torch.empty(grouped.shape, dtype=dtype, device=x.device).copy_(grouped)


def _from_query_side(spec: AttentionSpec, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, Hkv, L, G, D) -> the spec's layout, (B, Hq, L, D) or (B, L, Hq, D)."""
    order = (0, 2, 1, 3, 4) if spec.layout is Layout.BSHD else (0, 1, 3, 2, 4)
    x = x.permute(order)
    x = x.flatten(1, 2) if spec.layout is Layout.BHSD else x.flatten(2, 3)
    return x.to(dtype)


def _grouped(x: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """A 4-D mask or bias (B|1, Hq|1, Lq|1, Lk|1) as a (B|1, Hkv|1, Lq|1, G|1, Lk|1) view."""
    x = x.unsqueeze(2) if x.shape[1] == 1 else x.unflatten(1, (heads_kv, x.shape[1] // heads_kv))
    return x.transpose(2, 3)


def _alibi(slopes: torch.Tensor | None, heads_kv: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Minus ALiBi's (B|1, Hq) slopes (§16) as a (B|1, Hq, 1, 1) bias would be, grouped; None without them."""
    return None if slopes is None else -_grouped(slopes.to(dtype)[..., None, None], heads_kv)


def _tile(x: torch.Tensor, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """The (rows, cols) tile of a grouped mask or bias, leaving broadcast (size-1) axes whole."""
    rows = slice(r0, r1) if x.shape[2] != 1 else slice(None)
    cols = slice(c0, c1) if x.shape[4] != 1 else slice(None)
    return x[:, :, rows, :, cols]


def _rows(x: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows r0:r1 of a contiguous query-side tensor as a (B, Hkv, (r1 - r0) * G, ...) view (writes go through)."""
    return x[:, :, r0:r1].view(*x.shape[:2], -1, *x.shape[4:])


class _Geometry:
    """Which (query, key) pairs the band (:class:`attnkit.contract.torch.Band`), the user mask and a mask program
    allow, per tile in the internal layouts, and which tiles need no mask."""

    def __init__(self, spec: AttentionSpec, inputs: AttentionInputs, heads_kv: int, len_q: int, len_k: int) -> None:
        self.band = Band(spec, inputs, len_q, len_k)
        self.mask = _grouped(inputs.mask, heads_kv) if inputs.mask is not None else None
        self.program: BoundProgram | None = inputs.mask_program
        self.heads_q = inputs.q.shape[2 if spec.layout is Layout.BSHD else 1]
        self.heads_kv = heads_kv
        self.like = inputs.q  # the device the program's tile classes are built on

    def program_tiles(self, block_q: int, block_k: int) -> tuple[list[list[bool]], list[list[bool]]] | None:
        """Host-side (empty, full) per (query tile, key tile): the program hides (shows) every pair of the tile in
        every batch element and query head. None without a program."""
        if self.program is None:
            return None
        batch, len_q, len_k = self.band.batch, self.band.len_q, self.band.len_k
        classes = cached_tile_classes(self.program, batch, self.heads_q, len_q, len_k, block_q, block_k, self.like)
        return (classes == EMPTY).all(1).all(0).tolist(), (classes == FULL).all(1).all(0).tolist()

    def is_full(self, rows: range, cols: range, segments_whole: bool, program_whole: bool = True) -> bool:
        """True when every pair in the tile is visible for every batch element, so it needs no masking
        (``segments_whole``, ``program_whole``: the segment ids and the mask program, if any, show the whole tile)."""
        whole = self.mask is None and segments_whole and program_whole
        return whole and self.band.band_wholly_visible(rows, cols)

    def visible(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Boolean (B|1, Hkv|1, tile_q, G|1, tile_k): may query i see key j."""
        band = self.band.visible(slice(r0, r1), slice(c0, c1))
        tile = _tile(self.mask, r0, r1, c0, c1) if self.mask is not None else None
        program = self._program_tile(r0, r1, c0, c1) if self.program is not None else None
        visible = conjoin(band.unsqueeze(3) if band is not None else None, tile, program)
        assert visible is not None, "a tile needs a mask only where the band, a mask or a program hides something"
        return visible

    def _program_tile(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """The program over the tile, (B|1, Hkv|1, tile_q, G|1, tile_k): query head h = kv head · G + g (§2)."""
        assert self.program is not None
        device, group = self.band.device, self.heads_q // max(self.heads_kv, 1)
        heads = torch.arange(self.heads_q, device=device).view(1, self.heads_kv, 1, group, 1)
        env = {
            "b": torch.arange(self.band.batch, device=device).view(-1, 1, 1, 1, 1),
            "h": heads,
            "q": torch.arange(r0, r1, device=device).view(1, 1, -1, 1, 1),
            "kv": torch.arange(c0, c1, device=device).view(1, 1, 1, 1, -1),
        }
        ops = array_ops(heads)
        return torch.as_tensor(evaluate(self.program.expr, ops, env, self.program.captured), device=device)

    def distance(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """(B, 1, tile_q, 1, tile_k) int64: ALiBi's |i + off_b − j| (§16)."""
        return self.band.distance(slice(r0, r1), slice(c0, c1)).unsqueeze(3)


# One entry per query tile with anything visible: (r0, r1, [(c0, c1, needs_mask), ...]).
Plan = list[tuple[int, int, list[tuple[int, int, bool]]]]


def _plan(geometry: _Geometry, len_q: int, len_k: int, block_q: int, block_k: int) -> Plan:
    plan: Plan = []
    segments = geometry.band.segment_pairs(block_q, block_k)
    program = geometry.program_tiles(block_q, block_k)
    for r0 in range(0, len_q, block_q):
        r1 = min(r0 + block_q, len_q)
        keys = geometry.band.key_span(range(r0, r1))
        key_tiles = []
        for c0 in range(keys.start - keys.start % block_k, keys.stop, block_k):
            c1 = min(c0 + block_k, len_k)
            row, column = r0 // block_q, c0 // block_k
            if segments is not None and not segments.meet[row][column]:
                continue  # no query of the tile shares a segment with a key of it, in any batch element
            if program is not None and program[0][row][column]:
                continue  # the mask program hides every pair of the tile, in every batch element and head
            whole = segments is None or segments.whole[row][column]
            program_whole = program is None or program[1][row][column]
            key_tiles.append((c0, c1, not geometry.is_full(range(r0, r1), range(c0, c1), whole, program_whole)))
        if key_tiles:
            plan.append((r0, r1, key_tiles))
    return plan


def _by_key_tile(plan: Plan) -> list[tuple[int, int, list[tuple[int, int, bool]]]]:
    """The same tiles, grouped by key tile: the backward accumulates dK and dV per key tile."""
    columns: dict[tuple[int, int], list[tuple[int, int, bool]]] = {}
    for r0, r1, key_tiles in plan:
        for c0, c1, needs_mask in key_tiles:
            columns.setdefault((c0, c1), []).append((r0, r1, needs_mask))
    return [(c0, c1, rows) for (c0, c1), rows in sorted(columns.items())]


@dataclass(frozen=True)
class _Pages:
    """A paged KV cache (§13) read a key tile at a time: only the tile's blocks are gathered, in the compute dtype,
    padding (slots at or past a sequence's length) zeroed and cosine's normalisation applied."""

    block_table: torch.Tensor
    kv_lengths: torch.Tensor
    spec: AttentionSpec
    dtype: torch.dtype

    def tile(self, cache: torch.Tensor, c0: int, c1: int, is_key: bool) -> torch.Tensor:
        """Keys (values) [c0, c1) of every sequence as (B, Hkv, c1 − c0, D); tiles span whole blocks."""
        block_size = cache.shape[1]
        gathered = gather_pages(cache, self.block_table[:, c0 // block_size : -(-c1 // block_size)])
        tile = zero_padding(gathered.transpose(1, 2).to(self.dtype), self.kv_lengths - c0)
        return normalize_if_cosine(self.spec, tile) if is_key else tile


@dataclass(frozen=True)
class _Operands:
    """What the tile loops read, in the internal layouts.

    ``q`` is the (normalised) query times ``q_scale`` = scale (÷ softcap), so ``q kᵀ`` is the tanh argument
    directly; ``softcap`` then multiplies tanh back. ``bias`` is the grouped view, in the caller's dtype. With
    ``pages``, ``k`` and ``v`` are the caches (num_blocks, block_size, Hkv, D), read through its table. ``alibi`` is
    minus the slopes, (B|1, Hkv, 1, G, 1) in the compute dtype (§16).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor | None
    q_scale: float
    softcap: float | None
    geometry: _Geometry
    pages: _Pages | None = None
    alibi: torch.Tensor | None = None
    dropout: Dropout | None = None

    @property
    def group(self) -> int:
        return self.q.shape[3]

    def dropped(self, p: torch.Tensor, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """P ⊙ M for a (B, Hkv, tile_q * G, tile_k) tile, M §18's keep-mask (query head h = kv head · G + g, §2);
        P itself without dropout. The scale 1 / (1 − p) is applied once, to out (forward) and dP (backward)."""
        if self.dropout is None:
            return p
        batch, heads_kv, _, group, _ = self.q.shape
        device, dropout = p.device, self.dropout
        keep = keep_tile(
            dropout,
            torch.arange(batch, device=device).view(-1, 1, 1, 1, 1),
            (torch.arange(heads_kv * group, device=device) + dropout.head_start).view(1, heads_kv, 1, group, 1),
            (torch.arange(r0, r1, device=device) + dropout.query_start).view(1, 1, -1, 1, 1),
            c0 + int(dropout.key_start),
            c1 + int(dropout.key_start),
        )
        return p * keep.view(p.shape)

    def dropout_scale(self) -> float:
        return 1.0 if self.dropout is None else self.dropout.scale(self.q.dtype == torch.float64)

    def keys(self, c0: int, c1: int) -> torch.Tensor:
        return self.k[:, :, c0:c1] if self.pages is None else self.pages.tile(self.k, c0, c1, is_key=True)

    def values(self, c0: int, c1: int) -> torch.Tensor:
        return self.v[:, :, c0:c1] if self.pages is None else self.pages.tile(self.v, c0, c1, is_key=False)


def _score_tile(
    ops: _Operands, q: torch.Tensor, r0: int, r1: int, c0: int, c1: int, needs_mask: bool, softcap_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """S for one tile as (B, Hkv, tile_q * G, tile_k), hidden pairs -inf.

    With ``softcap_grad`` and a softcap c, also dS/dU = c·(1 − tanh²U) for U = q kᵀ (else None).
    """
    s = torch.matmul(q, ops.keys(c0, c1).transpose(-1, -2))
    derivative = None
    if ops.softcap is not None:
        s = s.tanh_()
        if softcap_grad:
            derivative = torch.addcmul(torch.ones_like(s), s, s, value=-1.0).mul_(ops.softcap)
        s.mul_(ops.softcap)
    tiled = s.view(*s.shape[:2], r1 - r0, ops.group, c1 - c0)
    if ops.bias is not None:
        tiled.add_(_tile(ops.bias, r0, r1, c0, c1).to(s.dtype))
    if ops.alibi is not None:
        tiled.add_(ops.alibi * ops.geometry.distance(r0, r1, c0, c1))
    if needs_mask:
        tiled.masked_fill_(~ops.geometry.visible(r0, r1, c0, c1), NEG_INF)
    return s, derivative


def _forward_tiles(ops: _Operands, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, Hkv, Lq, G, Dv) and lse (B, Hkv, Lq, G) in the compute dtype."""
    batch, heads_kv, len_q, group, _ = ops.q.shape
    out = ops.q.new_zeros(batch, heads_kv, len_q, group, ops.v.shape[-1])
    lse = ops.q.new_full((batch, heads_kv, len_q, group), NEG_INF)
    # Per query tile, over its key tiles (online softmax):
    #   m' = max(m, rowmax S);  α = exp(m − m');  P = exp(S − m')
    #   l' = α·l + rowsum P;    acc' = α·acc + (P ⊙ M) V   (M: dropout's keep-mask, §18; all ones without)
    # then out = acc / l · 1/(1 − p) and lse = m + log l once at the end. A row that has seen no key keeps m = −inf: its
    # shift is taken as 0 so that P and α are exp(−inf) = 0, never exp(−inf + inf) = NaN.
    for r0, r1, key_tiles in plan:
        q = _rows(ops.q, r0, r1)
        row_max = q.new_full((*q.shape[:-1], 1), NEG_INF)
        row_sum = q.new_zeros(row_max.shape)
        acc = q.new_zeros(*q.shape[:-1], ops.v.shape[-1])
        for c0, c1, needs_mask in key_tiles:
            s, _ = _score_tile(ops, q, r0, r1, c0, c1, needs_mask)
            new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
            shift = torch.where(torch.isneginf(new_max), 0.0, new_max)
            p = s.sub_(shift).exp_()
            alpha = row_max.sub_(shift).exp_()
            row_sum.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
            acc.mul_(alpha).add_(torch.matmul(ops.dropped(p, r0, r1, c0, c1), ops.values(c0, c1)))
            row_max = new_max
        has_keys = ~torch.isneginf(row_max)
        safe_sum = torch.where(has_keys, row_sum, 1.0)
        _rows(out, r0, r1).copy_(torch.where(has_keys, acc / safe_sum * ops.dropout_scale(), 0.0))
        _rows(lse, r0, r1).copy_(torch.where(has_keys, row_max + torch.log(safe_sum), NEG_INF).squeeze(-1))
    return out, lse


def _refine_lse(ops: _Operands, plan: Plan, lse: torch.Tensor) -> torch.Tensor:
    """lse to the compute dtype's precision from its float32 copy: lse + log Σ exp(S − lse).

    The saved lse is float32 by contract; in float64 its rounding (~1e-7) would show in every gradient.
    """
    refined = lse.clone()
    for r0, r1, key_tiles in plan:
        q = _rows(ops.q, r0, r1)
        start = _rows(lse, r0, r1).unsqueeze(-1)
        shift = torch.where(torch.isneginf(start), 0.0, start)
        total = torch.zeros_like(start)
        for c0, c1, needs_mask in key_tiles:
            s, _ = _score_tile(ops, q, r0, r1, c0, c1, needs_mask)
            total.add_(s.sub_(shift).exp_().sum(dim=-1, keepdim=True))
        refined_rows = torch.where(torch.isneginf(start), NEG_INF, start + torch.log(total))
        _rows(refined, r0, r1).copy_(refined_rows.squeeze(-1))
    return refined


def _backward_tiles(
    ops: _Operands,
    plan: Plan,
    lse: torch.Tensor,
    dout: torch.Tensor,
    delta: torch.Tensor,
    bias_shape: torch.Size | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients wrt ops.q (the scaled query), k, v and the bias (in the bias's own 4-D shape)."""
    dq, dk, dv = torch.zeros_like(ops.q), torch.zeros_like(ops.k), torch.zeros_like(ops.v)
    dbias = ops.q.new_zeros(bias_shape) if bias_shape is not None else None
    dbias_grouped = _grouped(dbias, ops.k.shape[1]) if dbias is not None else None
    # A row with no visible key has lse = −inf; shifting it by +inf makes its P exactly 0.
    lse_shift = torch.where(torch.isneginf(lse), float("inf"), lse)
    scale = ops.dropout_scale()
    # Per key tile, over the query tiles that see it (U = q kᵀ, the tanh argument when softcapped):
    #   P = exp(S − lse);  dV += (P ⊙ M/(1−p))ᵀ dO;  dP = dO Vᵀ ⊙ M/(1−p);  dS = P ⊙ (dP − Δ), Δ = rowsum(dO ⊙ O) − dlse
    #   dbias += dS;  dU = dS ⊙ c(1 − tanh²U) (softcap) or dS;  dq += dU K;  dK += dUᵀ q
    for c0, c1, query_tiles in _by_key_tile(plan):
        k, v = ops.k[:, :, c0:c1], ops.v[:, :, c0:c1]
        dk_tile, dv_tile = dk[:, :, c0:c1], dv[:, :, c0:c1]
        for r0, r1, needs_mask in query_tiles:
            q, do = _rows(ops.q, r0, r1), _rows(dout, r0, r1)
            s, softcap_derivative = _score_tile(ops, q, r0, r1, c0, c1, needs_mask, softcap_grad=True)
            p = s.sub_(_rows(lse_shift, r0, r1).unsqueeze(-1)).exp_()
            dp = torch.matmul(do, v.transpose(-1, -2))
            if ops.dropout is not None:
                kept = ops.dropped(p, r0, r1, c0, c1).mul_(scale)
                dv_tile.add_(torch.matmul(kept.transpose(-1, -2), do))
                dp = ops.dropped(dp, r0, r1, c0, c1).mul_(scale)
            else:
                dv_tile.add_(torch.matmul(p.transpose(-1, -2), do))
            ds = dp.sub_(_rows(delta, r0, r1).unsqueeze(-1)).mul_(p)
            if dbias_grouped is not None:
                _accumulate_dbias(_tile(dbias_grouped, r0, r1, c0, c1), ds.view(*ds.shape[:2], r1 - r0, -1, c1 - c0))
            if softcap_derivative is not None:
                ds.mul_(softcap_derivative)
            _rows(dq, r0, r1).add_(torch.matmul(ds, k))
            dk_tile.add_(torch.matmul(ds.transpose(-1, -2), q))
    return dq, dk, dv, dbias


def _accumulate_dbias(target: torch.Tensor, ds: torch.Tensor) -> None:
    """target += ds summed over the axes along which the bias was broadcast."""
    axes = [axis for axis in range(5) if target.shape[axis] == 1 and ds.shape[axis] != 1]
    target.add_(ds.sum(dim=axes, keepdim=True) if axes else ds)


class TorchChunkedBackend(BaseBackend):
    name = "torch-chunked"
    capabilities = Capabilities(
        length_generic=True,
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        devices=frozenset({"cpu", "cuda"}),
        features=ALL_FEATURES,
        description="FlashAttention-2 in torch ops: tiled online softmax, memory linear in sequence length",
    )

    def __init__(self, block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K) -> None:
        if block_q < 1 or block_k < 1:
            raise ValueError(f"block_q={block_q} and block_k={block_k} must both be >= 1")
        self.block_q, self.block_k = block_q, block_k

    def __repr__(self) -> str:
        return f"TorchChunkedBackend(block_q={self.block_q}, block_k={self.block_k})"

    def _prepare(
        self, spec: AttentionSpec, inputs: AttentionInputs, track_normalisation: bool = False
    ) -> tuple[_Operands, Plan, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """Bring q, k, v to the internal layouts in the compute dtype and plan the tiles.

        Returns (operands, plan, tracked). With ``track_normalisation`` and the cosine variant, tracked is
        (q, qn, k, kn): q and k leaves, qn and kn their normalised values with autograd history; else None.
        """
        dtype = compute_dtype(inputs.q.dtype)
        # Padding (beyond the lengths, or a negative segment id) is zeroed, not only masked: a tile spanning it
        # would otherwise carry NaN there into dq, dk or P·V through 0·NaN (docs/semantics.md §5).
        q_ids, kv_ids = inputs.q_segment_ids, inputs.kv_segment_ids
        k = zero_padding(to_bhsd(spec, inputs.k), inputs.kv_lengths, kv_ids)
        heads_kv, len_k = k.shape[1], k.shape[2]
        q = zero_padding(to_bhsd(spec, inputs.q), inputs.q_lengths, q_ids)
        q = _query_side(q, heads_kv, dtype)
        # detach: when no copy is needed these alias the caller's tensors, and cosine marks k as a leaf.
        k = k.detach().to(dtype).contiguous()
        v = zero_padding(to_bhsd(spec, inputs.v), inputs.kv_lengths, kv_ids)
        v = v.detach().to(dtype).contiguous()
        len_q = q.shape[2]
        scale = spec.resolved_scale(q.shape[-1])
        q_scale = scale / spec.softcap if spec.softcap is not None else scale
        tracked = None
        if spec.variant is Variant.COSINE:
            if track_normalisation:
                q, k = q.requires_grad_(True), k.requires_grad_(True)
                with torch.enable_grad():
                    qn, kn = normalize_if_cosine(spec, q), normalize_if_cosine(spec, k)
                tracked = (q, qn, k, kn)
                q, k = qn.detach(), kn.detach()
            else:
                q, k = normalize_if_cosine(spec, q), normalize_if_cosine(spec, k)
        geometry = _Geometry(spec, inputs, heads_kv, len_q, len_k)
        bias = _grouped(inputs.bias, heads_kv) if inputs.bias is not None else None
        # q is a fresh copy here except when it is the detached normalised value autograd still holds.
        q = q * q_scale if tracked is not None else q.mul_(q_scale)
        alibi = _alibi(inputs.alibi_slopes, heads_kv, dtype)
        ops = _Operands(q, k, v, bias, q_scale, spec.softcap, geometry, alibi=alibi, dropout=inputs.dropout)
        return ops, _plan(geometry, len_q, len_k, self.block_q, self.block_k), tracked

    def forward(
        self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            ops, plan, _ = self._prepare(spec, inputs)
            out, lse = _forward_tiles(ops, plan)
        return _from_query_side(spec, out, inputs.q.dtype), lse.transpose(2, 3).flatten(1, 2).to(
            compute_dtype(inputs.q.dtype)
        )

    def forward_paged(
        self, spec: AttentionSpec, inputs: PagedInputs, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's tiles over a paged cache: key tiles of whole blocks, each gathered when its turn comes, so
        memory holds one tile of the cache at a time (a query tile gathers its key tiles again)."""
        dtype = compute_dtype(inputs.q.dtype)
        heads_kv, block_size = inputs.k_cache.shape[2], inputs.k_cache.shape[1]
        q = normalize_if_cosine(spec, _query_side(to_bhsd(spec, inputs.q), heads_kv, dtype))
        len_q, len_k = q.shape[2], inputs.block_table.shape[1] * block_size
        scale = spec.resolved_scale(q.shape[-1])
        q_scale = scale / spec.softcap if spec.softcap is not None else scale
        lengths = AttentionInputs(inputs.q, None, None, kv_lengths=inputs.kv_lengths)
        geometry = _Geometry(spec, lengths, heads_kv, len_q, len_k)
        pages = _Pages(inputs.block_table, inputs.kv_lengths, spec, dtype)
        alibi = _alibi(inputs.alibi_slopes, heads_kv, dtype)
        ops = _Operands(q.mul_(q_scale), inputs.k_cache, inputs.v_cache, None, q_scale, spec.softcap, geometry, pages,
                        alibi)  # fmt: skip
        block_k = max(1, self.block_k // block_size) * block_size
        with torch.no_grad():
            out, lse = _forward_tiles(ops, _plan(geometry, len_q, len_k, self.block_q, block_k))
        return _from_query_side(spec, out, inputs.q.dtype), lse.transpose(2, 3).flatten(1, 2).to(
            compute_dtype(inputs.q.dtype)
        )

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
        with torch.no_grad():
            ops, plan, tracked = self._prepare(spec, inputs, track_normalisation=True)
            dtype, heads_kv = ops.q.dtype, ops.k.shape[1]
            lse = _query_side(lse, heads_kv, dtype)
            if dtype == torch.float64:
                lse = _refine_lse(ops, plan, lse)
            dout = _query_side(to_bhsd(spec, dout), heads_kv, dtype)
            delta = (dout * _query_side(to_bhsd(spec, out), heads_kv, dtype)).sum(dim=-1)
            if dlse is not None:
                delta -= _query_side(dlse, heads_kv, dtype)
            bias_shape = inputs.bias.shape if need_dbias and inputs.bias is not None else None
            dq, dk, dv, dbias = _backward_tiles(ops, plan, lse, dout, delta, bias_shape)
            dq.mul_(ops.q_scale)
        if tracked is not None:
            q_leaf, qn, k_leaf, kn = tracked
            with torch.enable_grad():
                dq, dk = torch.autograd.grad((qn, kn), (q_leaf, k_leaf), (dq, dk))
        return Gradients(
            dq=_from_query_side(spec, dq, inputs.q.dtype),
            dk=from_bhsd(spec, dk).to(inputs.k.dtype),
            dv=from_bhsd(spec, dv).to(inputs.v.dtype),
            dbias=dbias.to(inputs.bias.dtype) if dbias is not None else None,
        )
