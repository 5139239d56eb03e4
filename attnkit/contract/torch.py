"""The contract (docs/semantics.md) written in torch ops: visibility, scores, layouts, and the literal attention the
oracle runs. Public, for backends: the reference backends are built from it, and native backends use it for what
their library call cannot express. :class:`Band` is the one torch reading of §4's causal/window band and lengths
(masks, per-row key ranges, tile planning) that every torch backend plans and masks by; only the oracle keeps a
visibility of its own (backends/reference/torch_naive.py), so that the two can be held against each other."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnkit.backend import (
    AttentionInputs,
    AttentionSpec,
    BaseBackend,
    CausalAlignment,
    Dropout,
    Gradients,
    Layout,
    Variant,
)
from attnkit.contract import (
    COSINE_EPS,
    TileVisibility,
    alignment_offset,
    conjoin,
    diagonal_band,
    programs,
    tile_visibility,
    within_band,
)


def to_bhsd(spec: AttentionSpec, x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2) if spec.layout is Layout.BSHD else x


def from_bhsd(spec: AttentionSpec, x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2) if spec.layout is Layout.BSHD else x


def cosine_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / max(‖x‖, eps) along the head dim: the cosine variant's q̂ and k̂ (§3).

    In float16, where eps = 1e-12 rounds to 0, eps is float16's smallest positive value 2⁻²⁴ instead: no nonzero
    float16 row has a smaller norm, so only a zero row (padding) changes, to 0 rather than 0/0 = NaN, which 0·NaN
    would carry into dk (from a query row) or dq (from a key row): the harness's float16 baseline, docs/testing.md.
    """
    info = torch.finfo(x.dtype)
    return F.normalize(x, dim=-1, eps=max(COSINE_EPS, info.smallest_normal * info.eps))


def normalize_if_cosine(spec: AttentionSpec, x: torch.Tensor) -> torch.Tensor:
    return cosine_normalize(x) if spec.variant is Variant.COSINE else x


def zero_padding(
    x: torch.Tensor, lengths: torch.Tensor | None, segment_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """bhsd x with the padding set to 0: positions at or beyond lengths[b], and those whose segment id is negative
    (§4.5). Padding is never read (§5), so garbage there, NaN included, cannot leak through 0·NaN."""
    keep = None
    if lengths is not None:
        keep = torch.arange(x.shape[2], device=x.device).view(1, 1, -1, 1) < lengths.view(-1, 1, 1, 1)
    if segment_ids is not None:
        keep = conjoin(keep, (segment_ids >= 0).view(segment_ids.shape[0], 1, segment_ids.shape[1], 1))
    if keep is None:
        return x
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def without_segment_padding(spec: AttentionSpec, inputs: AttentionInputs) -> AttentionInputs:
    """``inputs`` with q, k and v zeroed where their segment id is negative (§4.5, in the spec's layout): for a library
    call that computes P · V over every key, where a weight of 0 times NaN at a padding position is still NaN."""
    if inputs.q_segment_ids is None:
        return inputs
    q_ids, kv_ids = inputs.q_segment_ids, inputs.kv_segment_ids
    q, k, v = (
        from_bhsd(spec, zero_padding(to_bhsd(spec, x), None, ids))
        for x, ids in ((inputs.q, q_ids), (inputs.k, kv_ids), (inputs.v, kv_ids))
    )
    return inputs._replace(q=q, k=k, v=v)


def segment_visibility(
    q_segment_ids: torch.Tensor, kv_segment_ids: torch.Tensor, rows: slice | None = None, cols: slice | None = None
) -> torch.Tensor:
    """Boolean (B, 1, rows, cols): query i and key j share a segment id and it is not negative (§4.5)."""
    q_ids = q_segment_ids[:, rows or slice(None)].unsqueeze(1).unsqueeze(-1)  # (B, 1, rows, 1), B = 0 included
    kv_ids = kv_segment_ids[:, cols or slice(None)].unsqueeze(1).unsqueeze(2)
    return (q_ids == kv_ids) & (q_ids >= 0)


class SegmentTiles(NamedTuple):
    """One side's segment ids summarised per batch element and tile of ``block`` positions (the last tile may be
    short): (B, tiles) tensors. Tiling code plans by these, never by the ids themselves, so planning costs O(B·L)."""

    least: torch.Tensor  # int64: the least non-negative id in the tile; greater than ``greatest`` if none
    greatest: torch.Tensor  # int64: the greatest non-negative id; −1 if none
    uniform: torch.Tensor  # bool: every position of the tile holds one and the same non-negative id

    @classmethod
    def of(cls, segment_ids: torch.Tensor, block: int) -> SegmentTiles:
        ids = segment_ids.long()
        batch, length = ids.shape
        tiles = -(-length // block)
        none = torch.iinfo(torch.long).max

        def per_tile(values: torch.Tensor, fill: int, reduce: str) -> torch.Tensor:
            padded = values.new_full((batch, tiles * block), fill)
            padded[:, :length] = values
            return getattr(padded.view(batch, tiles, block), reduce)(dim=-1)

        real = ids >= 0
        least = per_tile(torch.where(real, ids, none), none, "amin")
        greatest = per_tile(torch.where(real, ids, -1), -1, "amax")
        # Padding past the last position takes each reduction's neutral value: a short tile is its positions' alone.
        lowest = per_tile(ids, none, "amin")
        return cls(least, greatest, (lowest == greatest) & (lowest >= 0))

    def pairs(self, keys: SegmentTiles) -> tuple[torch.Tensor, torch.Tensor]:
        """(meet, whole), (B, query tiles, key tiles) booleans for these query tiles against ``keys``: ``meet`` is
        False where no query and key of the pair can share an id (the segment clause hides the pair of tiles: it is
        never computed); ``whole`` is True where every query and key of it share one id (the clause hides nothing)."""
        least = torch.maximum(self.least.unsqueeze(2), keys.least.unsqueeze(1))
        greatest = torch.minimum(self.greatest.unsqueeze(2), keys.greatest.unsqueeze(1))
        same = self.least.unsqueeze(2) == keys.least.unsqueeze(1)
        return least <= greatest, self.uniform.unsqueeze(2) & keys.uniform.unsqueeze(1) & same

    def packed(self) -> torch.Tensor:
        """(B, tiles, 3) int64 contiguous: least, greatest, uniform (0 or 1) side by side, as a kernel reads them."""
        return torch.stack((self.least, self.greatest, self.uniform.long()), dim=-1).contiguous()


class SegmentPairs(NamedTuple):
    """Host-side, per (query tile, key tile), over a whole batch: :meth:`Band.segment_pairs`."""

    meet: list[list[bool]]
    whole: list[list[bool]]


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """A paged cache (num_blocks, block_size, H, D) read through ``block_table`` (B, max_blocks) as contiguous keys
    (B, max_blocks · block_size, H, D), key j of sequence b being slot j mod block_size of block table[b, j //
    block_size] (§13). Entries past a sequence's blocks may hold anything: clamped into the cache, the slots they give
    lie past kv_lengths, padding. A copy of every block the table names: the literal reading, not a fused path."""
    batch, max_blocks = block_table.shape
    table = block_table.long().clamp(0, max(cache.shape[0] - 1, 0))
    return cache[table].reshape(batch, max_blocks * cache.shape[1], *cache.shape[2:])


def block_of(x: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
    """The (rows, cols) block of a 4-D mask or bias (B|1, Hq|1, Lq|1, Lk|1), leaving broadcast (size-1) axes whole:
    slicing one of those past its first row would leave nothing."""
    return x[:, :, rows if x.shape[2] != 1 else slice(None), cols if x.shape[3] != 1 else slice(None)]


class Band:
    """§4's causal and window band, the lengths and the segment ids, for one call, per batch element (a user mask
    joins in :meth:`visible`). The host-side planning (:meth:`key_span`, :meth:`band_wholly_visible`,
    :meth:`key_ranges`) reads the band and lengths only: segment ids hide more, which :meth:`visible` adds, and
    which tiled code skips by :meth:`segment_tiles` (:class:`SegmentTiles`).

    Query i of element b sees key j iff ``lower ≤ j − i − offset[b] ≤ upper``, ``i < q_len[b]`` and ``j < kv_len[b]``,
    with ``(lower, upper)`` from :func:`attnkit.contract.diagonal_band` and ``offset[b]`` from
    :func:`attnkit.contract.alignment_offset` of the element's lengths. Tiled code plans from its host side (lengths
    read once, on first use); masks come from its tensors.
    """

    def __init__(self, spec: AttentionSpec, inputs: AttentionInputs, len_q: int, len_k: int) -> None:
        self.spec = spec
        self.lower, self.upper = diagonal_band(spec)
        self.len_q, self.len_k = len_q, len_k
        self.batch = inputs.q.shape[0]
        self.device = inputs.q.device
        self.q_lengths, self.kv_lengths = inputs.q_lengths, inputs.kv_lengths
        self.has_lengths = self.q_lengths is not None or self.kv_lengths is not None
        self.q_segment_ids, self.kv_segment_ids = inputs.q_segment_ids, inputs.kv_segment_ids
        self.has_segments = self.q_segment_ids is not None

    @property
    def banded(self) -> bool:
        return self.lower is not None or self.upper is not None

    # Host side: plain integers per batch element.

    @functools.cached_property
    def q_lens(self) -> list[int]:
        return self.q_lengths.tolist() if self.q_lengths is not None else [self.len_q] * self.batch

    @functools.cached_property
    def kv_lens(self) -> list[int]:
        return self.kv_lengths.tolist() if self.kv_lengths is not None else [self.len_k] * self.batch

    @functools.cached_property
    def offsets(self) -> list[int]:
        return [alignment_offset(self.spec, q_len, kv_len) for q_len, kv_len in zip(self.q_lens, self.kv_lens)]

    @functools.cached_property
    def extremes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(min, max) over the batch of the query lengths, key lengths and offsets; all (0, 0) for an empty batch."""
        if not self.batch:
            return (0, 0), (0, 0), (0, 0)
        return (
            (min(self.q_lens), max(self.q_lens)),
            (min(self.kv_lens), max(self.kv_lens)),
            (min(self.offsets), max(self.offsets)),
        )

    def key_span(self, rows: range) -> range:
        """The keys any query of ``rows`` may see in some batch element (the band at its widest over the batch);
        empty, or with first > last, when none. Keys in it may still be hidden: tiles there are masked."""
        (_, q_max), (_, kv_max), (off_min, off_max) = self.extremes
        last_row = min(rows.stop, q_max) - 1
        if last_row < rows.start:
            return range(0)
        first = 0 if self.lower is None else max(0, rows.start + off_min + self.lower)
        last = kv_max - 1 if self.upper is None else min(kv_max - 1, last_row + off_max + self.upper)
        return range(first, last + 1)

    def wholly_visible(self, rows: range, cols: range) -> bool:
        """Whether every pair of the tile is visible in every batch element: it needs no mask. With segment ids,
        never: :meth:`segment_pairs` says which tiles their clause leaves whole."""
        return not self.has_segments and self.band_wholly_visible(rows, cols)

    def band_wholly_visible(self, rows: range, cols: range) -> bool:
        """Whether the band and the lengths show every pair of the tile in every batch element (segment ids aside).
        Each condition of :func:`attnkit.contract.tile_visibility`'s FULL is monotone in the lengths and the offset,
        so the shortest lengths with the smallest and the largest offset decide it for the whole batch."""
        (q_min, _), (kv_min, _), (off_min, off_max) = self.extremes
        band = (self.lower, self.upper)
        return bool(self.batch) and all(
            tile_visibility(band, offset, rows, cols, q_min, kv_min) is TileVisibility.FULL
            for offset in (off_min, off_max)
        )

    def segment_tiles(self, block_q: int, block_k: int) -> tuple[SegmentTiles, SegmentTiles]:
        """The query side's ids per tile of ``block_q`` rows and the key side's per tile of ``block_k`` keys."""
        assert self.q_segment_ids is not None and self.kv_segment_ids is not None, "a call without segment ids"
        return SegmentTiles.of(self.q_segment_ids, block_q), SegmentTiles.of(self.kv_segment_ids, block_k)

    def segment_pairs(self, block_q: int, block_k: int) -> SegmentPairs | None:
        """Host-side (meet, whole) per (query tile, key tile) over the whole batch, tiles of ``block_q`` rows and
        ``block_k`` keys from 0: ``meet[r][c]``: the ids may show a pair of the tile in some element (where not, the
        tile is never computed); ``whole[r][c]``: they show every pair in every element (no mask for them). None
        without segment ids. For code that runs a tile for the whole batch at once (torch-chunked)."""
        if not self.has_segments:
            return None
        meet, whole = SegmentTiles.pairs(*self.segment_tiles(block_q, block_k))
        return SegmentPairs(meet.any(dim=0).tolist(), whole.all(dim=0).tolist())

    # Device side: (B,) int64 tensors, and the band as masks.

    @functools.cached_property
    def q_len(self) -> torch.Tensor:
        return self._per_element(self.q_lengths, self.len_q)

    @functools.cached_property
    def kv_len(self) -> torch.Tensor:
        return self._per_element(self.kv_lengths, self.len_k)

    @functools.cached_property
    def offset(self) -> torch.Tensor:
        return torch.tensor(self.offsets, dtype=torch.long, device=self.device)

    def _per_element(self, lengths: torch.Tensor | None, full: int) -> torch.Tensor:
        if lengths is None:
            return torch.full((self.batch,), full, dtype=torch.long, device=self.device)
        return lengths.to(self.device, torch.long)

    @functools.cached_property
    def _positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.arange(self.len_q, device=self.device), torch.arange(self.len_k, device=self.device)

    def visible(
        self, rows: slice | None = None, cols: slice | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Boolean (B|1, Hq|1, rows, cols): may query i see key j, with the (rows, cols) block of the user ``mask``
        (4-D, broadcastable) where one is given. None: every pair is visible."""
        rows, cols = rows or slice(0, self.len_q), cols or slice(0, self.len_k)
        query_positions, key_positions = self._positions
        i = query_positions[rows].view(1, 1, -1, 1)
        j = key_positions[cols].view(1, 1, 1, -1)
        visible: torch.Tensor | None = None
        if self.banded:
            off_min, off_max = self.extremes[2]
            # One offset for the whole batch unless lengths make them differ.
            offset: int | torch.Tensor = off_min if off_min == off_max else self.offset.view(-1, 1, 1, 1)
            # lower ≤ j − i − off as j ≥ (i + off) + lower: the bounds stay a column, only the result is a matrix.
            aligned = i + offset
            visible = within_band(
                j,
                None if self.lower is None else aligned + self.lower,
                None if self.upper is None else aligned + self.upper,
            )
        if self.kv_lengths is not None:
            visible = conjoin(visible, j < self.kv_len.view(-1, 1, 1, 1))
        if self.q_lengths is not None:
            visible = conjoin(visible, i < self.q_len.view(-1, 1, 1, 1))
        if self.has_segments:
            visible = conjoin(visible, segment_visibility(self.q_segment_ids, self.kv_segment_ids, rows, cols))
        if mask is not None:
            visible = conjoin(visible, block_of(mask, rows, cols))
        return visible

    def distance(self, rows: slice, cols: slice) -> torch.Tensor:
        """(B, 1, rows, cols) int64: |i + off_b − j|, the distance ALiBi's slopes multiply (§16)."""
        query_positions, key_positions = self._positions
        aligned = query_positions[rows].view(1, 1, -1, 1) + self.offset.view(-1, 1, 1, 1)
        return (aligned - key_positions[cols].view(1, 1, 1, -1)).abs()

    def key_ranges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first, last): per batch element and query row, the keys it sees are ``first ≤ j ≤ last`` (none when
        first > last); (B, Lq) int64, memory linear in L."""
        rows = self._positions[0].view(1, -1)
        aligned = rows + self.offset.view(-1, 1)
        first = aligned + self.lower if self.lower is not None else torch.zeros_like(aligned)
        last = aligned + self.upper if self.upper is not None else torch.full_like(aligned, self.len_k - 1)
        last = torch.minimum(last, self.kv_len.view(-1, 1) - 1)
        last = torch.where(rows < self.q_len.view(-1, 1), last, torch.full_like(last, -1))
        return first.clamp(min=0), last

    def empty_rows(self) -> torch.Tensor:
        """(B, Lq) bool: the query rows that see no key through the band, the lengths and the segment ids (a user
        mask aside); memory linear in L. With ids, a row sees a key iff some key of its own id lies in its
        :meth:`key_ranges`: the keys sorted by (id, position) answer that by two binary searches per row."""
        first, last = self.key_ranges()
        empty = first > last
        if self.q_segment_ids is None or self.kv_segment_ids is None:
            return empty
        q_ids, kv_ids = self.q_segment_ids.long(), self.kv_segment_ids.long()
        # Ids ranked densely, so that rank · (Lk + 1) + position cannot overflow whatever the ids are.
        ranks = torch.unique(torch.cat([q_ids, kv_ids], dim=1), return_inverse=True)[1]
        q_rank, kv_rank = ranks[:, : self.len_q], ranks[:, self.len_q :]
        stride = self.len_k + 1
        # Padding keys sort first as −1, below every search: a query of a negative id finds no key of its rank.
        keys = torch.where(kv_ids >= 0, kv_rank * stride + self._positions[1], -1).sort(dim=1).values
        low = torch.searchsorted(keys, q_rank * stride + first)
        high = torch.searchsorted(keys, q_rank * stride + last, right=True)
        return empty | (high <= low)


#: (spec, inputs, Lq, Lk) -> boolean visibility broadcastable to (B, Hq, Lq, Lk), or None when every pair is visible.
VisibilityRule = Callable[[AttentionSpec, AttentionInputs, int, int], torch.Tensor | None]
#: (dropout, batch, heads, len_q, len_k, device) -> the bool keep-mask (batch, heads, len_q, len_k) of §18.
KeepRule = Callable[[Dropout, int, int, int, int, torch.device], torch.Tensor]


def visibility(
    spec: AttentionSpec,
    inputs: AttentionInputs,
    len_q: int,
    len_k: int,
    rows: slice | None = None,
    cols: slice | None = None,
) -> torch.Tensor | None:
    """Boolean (B|1, Hq|1, rows, cols): may query i see key j (docs/semantics.md §4): the :class:`Band`, the
    user mask and a mask program, materialised (§17). None = all visible."""
    visible = Band(spec, inputs, len_q, len_k).visible(rows, cols, inputs.mask)
    if inputs.mask_program is None:
        return visible
    heads = inputs.q.shape[2 if spec.layout is Layout.BSHD else 1]
    program = programs.dense(inputs.mask_program, inputs.q.shape[0], heads, len_q, len_k, inputs.q)
    return conjoin(visible, program[:, :, rows or slice(None), cols or slice(None)])


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


def literal_alibi(
    spec: AttentionSpec, inputs: AttentionInputs, len_q: int, len_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """§16 as written: −slope[b, h] · |i + off_b − j| for every (i, j), (B|1, Hq, Lq, Lk) in ``dtype``, with off_b the
    alignment offset of each element's lengths (§4.1, §4.3). Materialised: the oracle's and torch-naive's way only."""
    batch, device = inputs.q.shape[0], inputs.q.device
    q_len = inputs.q_lengths.long() if inputs.q_lengths is not None else torch.full((batch,), len_q, device=device)
    kv_len = inputs.kv_lengths.long() if inputs.kv_lengths is not None else torch.full((batch,), len_k, device=device)
    offset = kv_len - q_len if spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT else torch.zeros_like(q_len)
    i = torch.arange(len_q, device=device).view(1, 1, -1, 1)
    j = torch.arange(len_k, device=device).view(1, 1, 1, -1)
    distance = (i + offset.view(-1, 1, 1, 1) - j).abs().to(dtype)
    slopes = inputs.alibi_slopes.to(dtype)
    return -slopes.view(*slopes.shape, 1, 1) * distance


def _keep_mask(dropout: Dropout, batch: int, heads: int, len_q: int, len_k: int, device: torch.device) -> torch.Tensor:
    from attnkit.contract.dropout import keep_mask

    return keep_mask(dropout, batch, heads, len_q, len_k, device)


def literal_attention(
    spec: AttentionSpec,
    inputs: AttentionInputs,
    dtype: torch.dtype,
    visibility_rule: VisibilityRule | None = None,
    sinks: torch.Tensor | None = None,
    keep_rule: KeepRule | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) computed in ``dtype`` throughout; differentiable by torch autograd.

    ``visibility_rule`` defaults to :func:`visibility`; the oracle passes its own, written independently
    (backends/reference/torch_naive.py), so that a slip in this one cannot pass the oracle and the backends alike.

    ``sinks`` (Hq,): §15 as gpt-oss writes it, one more logit column per row (−∞ in padding rows), softmaxed with the
    scores and dropped before the values (attend composes it from lse instead: this is the oracle's way).

    With ``inputs.dropout`` (§18), the normalised probabilities are multiplied by the keep-mask ``keep_rule`` gives
    (default: :func:`attnkit.contract.dropout.keep_mask`; the oracle passes the reference's) and by 1 / (1 − p), after
    lse and before the values.

    out is bhsd/bshd per the spec in ``dtype``; lse is (B, Hq, Lq) in ``dtype``. Rows with no visible
    key give out 0 and lse -inf, and (because every -inf and 0/0 is kept out of the graph with
    ``where``) zero, finite gradients.
    """
    q_ids, kv_ids = inputs.q_segment_ids, inputs.kv_segment_ids
    q = to_bhsd(spec, inputs.q).to(dtype)
    k = to_bhsd(spec, inputs.k).to(dtype)
    q = normalize_if_cosine(spec, zero_padding(q, inputs.q_lengths, q_ids))
    k = normalize_if_cosine(spec, zero_padding(k, inputs.kv_lengths, kv_ids))
    v = zero_padding(to_bhsd(spec, inputs.v).to(dtype), inputs.kv_lengths, kv_ids)
    bias = inputs.bias.to(dtype) if inputs.bias is not None else None
    len_q, len_k = q.shape[2], k.shape[2]
    s = scores(spec, q, k, bias, spec.resolved_scale(q.shape[-1]))
    if inputs.alibi_slopes is not None:
        s = s + literal_alibi(spec, inputs, len_q, len_k, dtype)
    visible = (visibility_rule or visibility)(spec, inputs, len_q, len_k)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.to(dtype).view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        padding = ~zero_padding(torch.ones_like(column, dtype=torch.bool), inputs.q_lengths, q_ids)
        s = torch.cat([s, column.masked_fill(padding, float("-inf"))], dim=-1)
    # lse = m + log Σ exp(S − m), with m detached (it cancels) and made finite for empty rows.
    row_max = s.amax(dim=-1, keepdim=True).detach() if len_k else s.new_zeros(*s.shape[:-1], 1)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(s - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    has_keys = total != 0  # NaN counts as having keys: NaN in gives NaN lse, never a quiet -inf (§5)
    safe_total = torch.where(has_keys, total, torch.ones_like(total))
    lse = torch.where(has_keys, row_max + torch.log(safe_total), torch.full_like(total, float("-inf")))
    probabilities = weights[..., :len_k] / safe_total  # the sink's column carries no value
    if inputs.dropout is not None:
        batch, heads, len_q, len_k = probabilities.shape
        keep = (keep_rule or _keep_mask)(inputs.dropout, batch, heads, len_q, len_k, probabilities.device)
        scale = inputs.dropout.scale(inputs.q.dtype == torch.float64)
        probabilities = probabilities * keep * scale  # a float32 value (float64 for float64 inputs), exact in dtype
    out = weighted_values(probabilities, v)
    return from_bhsd(spec, out), lse.squeeze(-1)


def gradients_by_autograd(
    forward: Callable[[AttentionInputs], tuple[torch.Tensor, torch.Tensor | None]],
    inputs: AttentionInputs,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    *,
    need_dbias: bool = False,
    dtype: torch.dtype | None = None,
) -> Gradients:
    """The protocol's ``backward`` for a backend whose forward is differentiable torch code: ``forward`` (inputs ->
    out, lse) once more under autograd, pulled back from (dout, dlse). An empty row's −inf lse takes no cotangent.

    ``need_dbias``: the bias is a leaf too, and ``dbias`` is returned. ``dtype``: the forward runs again on q, k, v
    (and bias) cast to it, as the oracle computes in float64; the gradients come back in the inputs' dtypes."""

    def detached(t: torch.Tensor) -> torch.Tensor:
        return t.detach() if dtype is None else t.detach().to(dtype)

    q, k, v = (detached(t).requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    bias = detached(inputs.bias) if inputs.bias is not None else None
    leaves, given = [q, k, v], [inputs.q, inputs.k, inputs.v]
    if need_dbias and bias is not None:
        leaves.append(bias.requires_grad_(True))
        given.append(inputs.bias)
    with torch.enable_grad():
        out, lse = forward(inputs._replace(q=q, k=k, v=v, bias=bias))
        outputs, cotangents = [out], [dout if dtype is None else dout.to(dtype)]
        if dlse is not None:
            assert lse is not None, "a forward without lse cannot take its cotangent"
            outputs.append(torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
            cotangents.append(dlse if dtype is None else dlse.to(dtype))
        found = torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True)
    grads = [(g if g is not None else torch.zeros_like(leaf)).to(x.dtype) for g, leaf, x in zip(found, leaves, given)]
    return Gradients(dq=grads[0], dk=grads[1], dv=grads[2], dbias=grads[3] if len(grads) > 3 else None)


class RecomputingBackend(BaseBackend):
    """A backend whose forward is differentiable torch code (:meth:`recompute`): its protocol ``backward`` runs that
    forward again under autograd (:func:`gradients_by_autograd`)."""

    def recompute(self, spec: AttentionSpec, inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out, lse) as differentiable torch code."""
        raise NotImplementedError(f"{type(self).__name__}.recompute")

    def recompute_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """The dtype the backward recomputes in, for inputs of ``dtype``; None: their own."""
        return None

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
        dtype = self.recompute_dtype(inputs.q.dtype)
        recompute = functools.partial(self.recompute, spec)
        return gradients_by_autograd(recompute, inputs, dout, dlse, need_dbias=need_dbias, dtype=dtype)
