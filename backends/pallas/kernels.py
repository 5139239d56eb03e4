"""The Pallas kernels: FlashAttention-2 forward, a backward in two kernels (dK/dV, then dQ), and the forward over
a paged KV cache (attend_paged, docs/semantics.md §13), read through its block table where the blocks lie.

Each kernel has a launcher (grid, BlockSpecs and index maps: ``forward_call``, ``dkdv_call``, ``dq_call``,
``paged_forward_call``) and a tile function (``_fwd_tile``, ``_bwd_dkdv``, ``_bwd_dq``, ``_paged_tile``) that runs
on one grid cell and holds the tiled loop; the two forwards share the online softmax (``_softmax_over_tiles``) and
the launch (``_launch_forward``). With ``Static.splits`` > 1 a forward is split-K: a fourth grid axis of key ranges
whose partial (out, lse) are merged by lse (§6).

Operands arrive at their own shapes, never padded: each kernel takes a head's whole sequence (BlockSpec) and cuts
its tiles with pl.ds (``_load``, ``_store``), so blocks need not divide the sequence and a head dim is read to the
next power of two >= 16 (``width``) with its extra columns masked to 0. q/k are raw for the cosine variant too
(below); mask comes as int8 and bias as float32 in (B|1, Hq|1, Lq, Lk). Two small operands carry everything that
may change without recompiling:

* ``geom`` (B, 5) int32, per batch element ``[q_len, kv_len, lo, hi, off]``: query ``i`` sees key ``j`` when
  ``i < q_len``, ``j < kv_len`` and ``lo <= j - i <= hi``. That band is causal and window together
  (docs/semantics.md §4): ``lo = off + lower``, ``hi = off + upper`` with ``(lower, upper)`` the spec's
  ``attnkit.contract.diagonal_band`` (an open side: ``∓FAR``) and ``off`` the per-batch alignment offset, which
  ALiBi's distance reads too.
* ``params`` (4,) float32: ``[scale, softcap, 0, 0]``.

ALiBi (§16), when given, arrives as its slopes (B|1, Hq) float32, a grid cell reading its own query heads' (one, or
the dK/dV kernel's G). A tile's term −slope·|i + off − j| is computed from the tile's row and column indices
(``_alibi_term``) and added to the scores beside the bias in every kernel, so the backward recomputes the forward's
scores; no (Lq, Lk) bias is ever formed, and the slopes get no gradient. It hides nothing: the tiles skipped and
the interior runs are those without it.

Segment ids (§4.5), when given, arrive as :class:`Segments`: the ids of the padded rows (−1 on padding, which
``backend.py`` has also zeroed in q, k, v) and, per tile of the kernel's blocks, the smallest and largest
non-negative id. A (query tile, key tile) pair whose ranges cannot meet is skipped inside the loop, never loaded:
a packed row of documents costs Σ Lᵢ², not (Σ Lᵢ)², when each document's positions are contiguous.

A mask program (docs/semantics.md §17), when given, arrives as :class:`ProgramTiles`: per tile pair of the kernel's
blocks its class (EMPTY, PARTIAL, FULL from ``attnkit.contract.programs.tile_classes``) and the captured arrays,
whole; its code is ``Static.program``. EMPTY pairs are skipped like segment ids' (``_where_tiles_meet``), never
loaded; a FULL tile takes every pair as visible without evaluating the program; a PARTIAL one evaluates it with
``programs.evaluate`` in jnp on the tile's row and key positions, b the cell's batch element and h its query head,
reading a captured array by a gather at clamped indices (``_CapturedRef``; ``_program_visibility``).

Dropout (docs/semantics.md §18), when given, arrives as :class:`DropoutWords`, one (5,) uint32 operand ``[seed low,
seed high, head_start, query_start, key_start]`` (new seeds and a rank's offsets never recompile); p is
``Static.dropout_p``. Every kernel regenerates a tile's keep-mask with ``attnkit.contract.jax.dropout_keep`` on the
tile's own indices (``_dropout_step``): b the cell's batch element, h its query head, i and j its rows and keys, each
plus its offset. The forward multiplies P·V's P by it, the dK/dV kernel dV's P and dP, the dQ kernel dP; row sums
and lse stay those before dropout, and nothing (Lq, Lk) is saved.

GQA/MQA: query head ``h`` reads kv head ``h // G`` through the K/V index maps; the dK/dV kernel runs per kv head
and loops over its G query heads, so nothing is repeated and nothing is written twice (no atomics).

Loops run over the tiles the band and lengths leave visible and no others: hidden tiles are never loaded. Among
them, the run of *interior* tiles (every pair visible: ``_interior_keys``, ``_interior_queries``) runs without any
mask or select; the *edge* tiles around it zero rows at or beyond ``q_len`` and keys at or beyond ``kv_len`` after
loading, so padding (NaN included) never reaches a product (§5), and mask their hidden scores. A mask or segment ids
make every tile an edge tile. In the forward and dQ kernels an edge tile inside the array is loaded whole and
selected; only the array's last, partial tile (when the block does not divide the sequence) is a masked load, run
once after the loops (``_edge_interior_edge``'s ``ragged``): a masked load in a loop costs their interior loop
registers (spills, in the sm_90 SASS). The dK/dV kernel is the other way round: its edge query tiles are masked
loads (the selects after a whole load spill in its edge loops), so its last, partial tile is one of them. The
softmax is base 2 with the scale folded into exp2's argument (``_score_fold``); lse is natural-log at the API. The
dK/dV kernel keeps queries on rows as Triton's own does (S = Q·Kᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q): on 128-row query tiles
and 8 warps every product has a multiple of 64 rows per warpgroup, which Triton needs for wgmma.

Cosine (``Static.cosine``, docs/semantics.md §10): q̂ = q/‖q‖ is never rounded to the input dtype. The products take
the raw q and k (half types on tensor cores, exact products, float32 sums) and the score tile is scaled by both
float32 inverse norms, computed per tile from the rows as loaded (``_inverse_norms``): U = scale·(q·kᵀ)/(‖q‖‖k‖).
The backward kernels return the gradients with respect to q̂ and k̂, dq̂ = scale·Σ (dU/‖k‖)·k and dk̂ = scale·Σ
(dU/‖q‖)ᵀ·q; backend.py chains them through the normalisation in float32.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attnkit.backend import dropout_scale, dropout_threshold
from attnkit.contract import COSINE_EPS, conjoin, programs, within_band
from attnkit.contract.jax import dropout_keep, length_visibility, merge_partials, segment_visibility

FAR = 1 << 30  # an unbounded window side; |i + off| stays far below it, so i + lo never overflows int32
NO_ID = (1 << 31) - 1  # the smallest id of a tile of padding only: above every largest id, so it meets nothing
LOG2E = 1.4426950408889634  # scores go to exp2 in log₂ units: exp(x) = 2^(x·log₂e)
LN2 = 0.6931471805599453


@dataclass(frozen=True)
class Static:
    """What a kernel is specialised on (hashable; a jit static argument). Shapes come from the operands."""

    bshd: bool  # q/k/v/out are (B, L, H, D) instead of (B, H, L, D)
    softcap: bool
    block_q: int
    block_k: int
    interpret: bool
    num_warps: int = 4
    num_stages: int = 2
    splits: int = 1  # forward only: key ranges on a fourth grid axis, merged by lse (split-K decode)
    cosine: bool = False  # scores scaled by the rows' float32 inverse norms (the raw q, k are multiplied)
    program: programs.MaskProgram | None = None  # a mask program evaluated on each partial tile (its code)
    dropout_p: float | None = None  # attention dropout's p (§18): the seed and offsets are an operand

    def compiler_params(self) -> Any:
        # Triton, not Mosaic GPU: the Mosaic GPU path does not take these dot_general shapes.
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


class Segments(NamedTuple):
    """The segment-id operands (arrays outside the kernels, refs inside): ids (B, L_pad) int32 and, per tile of
    the kernel's blocks, (B, 2, tiles) int32 ``[smallest, largest]`` non-negative id (``[NO_ID, −1]`` for none)."""

    q_ids: Any
    kv_ids: Any
    q_ranges: Any
    kv_ranges: Any


def segments_for(static: Static, q_ids: Any, kv_ids: Any) -> Segments:
    """The operands for a kernel with ``static``'s blocks, from padded ids (B, Lq_pad) and (B, Lk_pad)."""
    return Segments(q_ids, kv_ids, _tile_ranges(q_ids, static.block_q), _tile_ranges(kv_ids, static.block_k))


class ProgramTiles(NamedTuple):
    """The mask-program operands (arrays outside the kernels, refs inside): the tile classes (B|1, H|1, query tiles,
    key tiles) int32 for the kernel's blocks (programs.EMPTY, PARTIAL, FULL), and the captured arrays, whole, int32
    (a 0-d one as (1,))."""

    classes: Any
    captured: tuple[Any, ...]


def program_for(static: Static, classes: Any, captured: tuple[Any, ...]) -> ProgramTiles:
    """The operands for a kernel with ``static``'s program: its tile classes and the captured arrays, 0-d ones as
    (1,) (a kernel operand has an axis)."""
    return ProgramTiles(classes.astype(jnp.int32), tuple(c.reshape(1) if c.ndim == 0 else c for c in captured))


class _CapturedRef:
    """A captured array's ref as ``programs.evaluate`` reads it: ``shape`` as the program knows it and indexing
    at broadcast (clamped) positions, a gather from the whole array; a boolean tensor reads as bool."""

    def __init__(self, ref: Any, spec: programs.CapturedSpec) -> None:
        self.ref, self.shape, self.boolean = ref, spec.shape, spec.dtype == "bool"

    def __getitem__(self, at: tuple) -> Any:
        value = self.ref[at if self.shape else (0,)]
        return value != 0 if self.boolean else value


class DropoutWords(NamedTuple):
    """The dropout operand (an array outside the kernels, a ref inside): (5,) uint32 ``[seed low, seed high,
    head_start, query_start, key_start]``."""

    words: Any


def _tile_ranges(ids: Any, block: int) -> Any:
    tiles = ids.reshape(ids.shape[0], -1, block)
    real = tiles >= 0
    smallest = jnp.where(real, tiles, NO_ID).min(axis=-1)
    largest = jnp.where(real, tiles, -1).max(axis=-1)
    return jnp.stack([smallest, largest], axis=1)


# ------------------------------------------------------------------------------------------ shared tile helpers


def _dot(a: Any, b: Any, *, trans_a: bool = False, trans_b: bool = False) -> Any:
    """float32-accumulated product; float32 operands at full precision (no TF32), half types on tensor cores."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _inverse_norms(x: Any, static: Static) -> Any:
    """1 / max(‖x‖, eps) per row of a (n, d) tile in float32 for the cosine variant (as
    torch.nn.functional.normalize; a zero row of padding gets 1/eps, times its zero products); None otherwise."""
    if not static.cosine:
        return None
    x = x.astype(jnp.float32)
    return 1.0 / jnp.maximum(jnp.sqrt(jnp.sum(x * x, axis=1)), COSINE_EPS)


def _geometry(geom_ref: Any) -> tuple[Any, Any, Any, Any]:
    return geom_ref[0], geom_ref[1], geom_ref[2], geom_ref[3]


class Alibi(NamedTuple):
    """ALiBi inside a kernel (§16): the ref of the cell's query heads' slopes, (1,) or the dK/dV kernel's (G,)
    float32, and the batch element's alignment offset (``geom``'s last column)."""

    slopes: Any
    offset: Any


def _alibi(slopes_ref: Any, geom_ref: Any) -> Alibi | None:
    return None if slopes_ref is None else Alibi(slopes_ref, geom_ref[4])


def _alibi_term(alibi: Alibi | None, head: Any, i0: Any, j0: Any, block_q: int, block_k: int) -> Any:
    """ALiBi's term on the tile of rows i0.. and keys j0.., for query head ``head`` of the cell's slopes:
    −slope·|i + off − j| from the tile's own indices; None without slopes. The row (i + off − j0) and column
    (j − j0) positions are made float32 as vectors, so the tile costs a float subtract, abs and multiply per score
    (exact: positions stay below 2²⁴)."""
    if alibi is None:
        return None
    shape = (block_q, block_k)
    rows = (i0 + alibi.offset - j0 + _iota(shape, 0)).astype(jnp.float32)
    columns = _iota(shape, 1).astype(jnp.float32)
    return -alibi.slopes[head] * jnp.abs(rows - columns)


class _Dropout(NamedTuple):
    """Dropout inside a kernel (§18): the seed's words, the cell's batch element and the offsets of its first query
    head, first query and first key (uint32 scalars), and p's threshold and scale (constants)."""

    seed_low: Any
    seed_high: Any
    batch: Any
    first_head: Any
    query_start: Any
    key_start: Any
    threshold: int
    scale: float


def _dropout(static: Static, words: DropoutWords | None, group: int = 1) -> _Dropout | None:
    """The cell's dropout: its batch element is grid axis 0, its first query head axis 1 times ``group`` (the dK/dV
    kernel's G query heads a cell)."""
    if words is None:
        return None
    assert static.dropout_p is not None
    ref = words.words
    head = ref[2] + (pl.program_id(1) * group).astype(jnp.uint32)
    batch = pl.program_id(0).astype(jnp.uint32)
    p = static.dropout_p
    return _Dropout(ref[0], ref[1], batch, head, ref[3], ref[4], dropout_threshold(p), dropout_scale(p, False))


def _dropout_step(dropout: _Dropout | None, head: Any, i0: Any, j0: Any, static: Static) -> Any:
    """The tile of rows i0.. and keys j0.. of query head ``head`` (within the cell's group) as a function
    x ↦ x ⊙ M / (1 − p), M §18's keep-mask at the call's offsets; x itself without dropout. The mask is computed
    once per tile, for the tile's every use."""
    if dropout is None:
        return lambda x: x
    shape = (static.block_q, static.block_k)
    rows = dropout.query_start + (i0 + _iota(shape, 0)).astype(jnp.uint32)
    keys = dropout.key_start + (j0 + _iota(shape, 1)).astype(jnp.uint32)
    head = dropout.first_head + jnp.asarray(head).astype(jnp.uint32)
    threshold = dropout.threshold
    keep = dropout_keep(dropout.seed_low, dropout.seed_high, threshold, dropout.batch, head, rows, keys)
    return lambda x: jnp.where(keep, x * dropout.scale, 0.0)


def _kv_range(geom: tuple[Any, ...], i0: Any, block_q: int, block_k: int) -> tuple[Any, Any]:
    """[first, end) of the key tiles that rows [i0, i0 + block_q) can see (empty when none)."""
    q_len, kv_len, lo, hi = geom
    last_row = jnp.minimum(i0 + block_q, q_len) - 1
    j_first = jnp.maximum(i0 + lo, 0)
    j_last = jnp.minimum(last_row + hi, kv_len - 1)
    first = lax.div(j_first, jnp.int32(block_k))
    empty = (last_row < i0) | (j_last < j_first)
    return first, jnp.where(empty, first, lax.div(jnp.maximum(j_last, 0), jnp.int32(block_k)) + 1)


def _q_range(geom: tuple[Any, ...], j0: Any, block_q: int, block_k: int) -> tuple[Any, Any]:
    """[first, end) of the query tiles that can see keys [j0, j0 + block_k) (empty when none)."""
    q_len, kv_len, lo, hi = geom
    last_col = jnp.minimum(j0 + block_k, kv_len) - 1
    i_first = jnp.maximum(j0 - hi, 0)
    i_last = jnp.minimum(last_col - lo, q_len - 1)
    first = lax.div(i_first, jnp.int32(block_q))
    empty = (last_col < j0) | (i_last < i_first)
    return first, jnp.where(empty, first, lax.div(jnp.maximum(i_last, 0), jnp.int32(block_q)) + 1)


def _visible(geom: tuple[Any, ...], i0: Any, j0: Any, block_q: int, block_k: int) -> Any:
    """The tile's visible pairs (block_q, block_k): the contract's band and lengths, with this element's offset
    already in lo, hi."""
    q_len, kv_len, lo, hi = geom
    shape = (block_q, block_k)
    i, j = i0 + _iota(shape, 0), j0 + _iota(shape, 1)
    return conjoin(length_visibility(i, j, q_len, kv_len), within_band(j - i, lo, hi))


def _tile_run(first: Any, end: Any, least: Any, last: Any, block: int, whole: Any) -> tuple[Any, Any]:
    """[low, high) of the tiles t in [first, end) whose start t·block lies in [least, last] (least >= 0), always
    with first <= low <= high <= end; empty (low = high = end) unless ``whole``."""
    low = jnp.clip(lax.div(least + (block - 1), jnp.int32(block)), first, end)
    high = jnp.where(last >= 0, lax.div(jnp.maximum(last, 0), jnp.int32(block)) + 1, 0)
    high = jnp.clip(high, low, end)
    return jnp.where(whole, low, end), jnp.where(whole, high, end)


def _interior_keys(geom: tuple[Any, ...], i0: Any, first: Any, end: Any, block_q: int, block_k: int) -> Any:
    """[low, high) of the key tiles in [first, end) whose every pair with rows [i0, i0 + block_q) is visible: keys
    inside kv_len and the whole tile inside the band (its least j − i is j0 − (i0 + block_q − 1), its greatest
    j0 + block_k − 1 − i0). Empty when the query tile holds rows at or past q_len."""
    q_len, kv_len, lo, hi = geom
    least = jnp.maximum(i0 + block_q - 1 + lo, 0)
    last = jnp.minimum(i0 + hi - block_k + 1, kv_len - block_k)
    return _tile_run(first, end, least, last, block_k, i0 + block_q <= q_len)


def _interior_queries(geom: tuple[Any, ...], j0: Any, first: Any, end: Any, block_q: int, block_k: int) -> Any:
    """_interior_keys seen from the key tile [j0, j0 + block_k): the query tiles in [first, end) it shares only
    visible pairs with. Empty when the key tile holds keys at or past kv_len."""
    q_len, kv_len, lo, hi = geom
    least = jnp.maximum(j0 + block_k - 1 - hi, 0)
    last = jnp.minimum(j0 - block_q + 1 - lo, q_len - block_q)
    return _tile_run(first, end, least, last, block_q, j0 + block_k <= kv_len)


def _edge_interior_edge(
    first: Any, end: Any, interior: Any, edge: Any, inside: Any, carry: Any, ragged: tuple[int, Any] | None = None
) -> Any:
    """fori_loop over [first, end) with ``inside`` on the interior run [low, high) and ``edge`` around it; with
    ``interior`` None (masks, segment ids, paged) every tile is an edge tile. ``ragged`` = (last, body): the
    array's last tile, ``last``, is partial: it runs ``body`` (an edge tile whose loads stop at the array's end),
    once, after the loops, when in [first, end). An interior tile lies inside the lengths, so never past it."""
    stop = end if ragged is None else jnp.minimum(end, ragged[0])
    if interior is None:
        carry = lax.fori_loop(first, stop, edge, carry)
    else:
        low, high = interior
        carry = lax.fori_loop(first, jnp.minimum(low, stop), edge, carry)
        carry = lax.fori_loop(low, high, inside, carry)
        carry = lax.fori_loop(high, stop, edge, carry)
    if ragged is None:
        return carry
    last, body = ragged
    return lax.cond(end > last, lambda c: body(jnp.int32(last), c), lambda c: c, carry)


def _ragged(length: int, block: int, body: Any) -> tuple[int, Any] | None:
    """_edge_interior_edge's ``ragged`` for a sequence of ``length`` in tiles of ``block``: None when they divide it."""
    return (length // block, body) if length % block else None


def _all_edge(hiders: _Hiders) -> bool:
    """A mask, segment ids or a program may hide any pair: no tile is known visible without reading them."""
    return any(hider is not None for hider in hiders)


def width(dim: int) -> int:
    """A tile's extent along a head dim: the power of two >= 16 (and >= dim) that Triton's tiles and dots need.
    The operands keep their own dim; the columns past it are read as 0 and never written."""
    return max(16, 1 << max(0, dim - 1).bit_length())


def _columns(ref: Any) -> Any:
    return pl.ds(0, width(ref.shape[-1]))


def _tile_axes(ref: Any, at: tuple) -> list[tuple[int, Any]]:
    """(extent, slice) of each axis a tile ``ref[at]`` keeps: those indexed by a pl.ds slice, in order."""
    return [(extent, index) for extent, index in zip(ref.shape, at) if isinstance(index, pl.Slice)]


def _iota(shape: tuple[int, ...], axis: int) -> Any:
    """Positions along ``axis`` of a tile of ``shape``, 1 along the other axes: a mask built from these stays a
    row and a column until it meets the tile (a full-tile index tensor would be held in registers)."""
    return lax.broadcasted_iota(jnp.int32, tuple(n if a == axis else 1 for a, n in enumerate(shape)), axis)


def _load(ref: Any, at: tuple, limits: tuple = (), other: float = 0.0, overrun: bool | None = None) -> Any:
    """ref[at], with no operand padded: ``limits`` gives, per tile axis, the position (absolute: a length) from
    which the tile reads ``other``, or None where the tile lies inside (an interior tile). ``overrun``: the tile may
    reach past the array (the last, partial tile; None: wherever the array's extent is not a multiple of the
    tile's), so the load itself is masked; a tile inside the array is loaded whole and ``other`` selected past the
    limits (Triton pipelines plain loads in a loop without the registers its masked loads cost). A tile wider than
    the array (a head dim read to a power of two by ``_columns``, a tile longer than the sequence) is always a masked
    load."""
    axes = _tile_axes(ref, at)
    shape = tuple(index.size for _, index in axes)
    wide = any(index.size > extent for extent, index in axes)  # always a masked load: no branch to choose
    if overrun is None and not wide and any(extent % index.size for extent, index in axes):  # the last tile overruns
        inside = functools.reduce(
            jnp.logical_and, [index.start + index.size <= extent for extent, index in axes if extent % index.size]
        )
        fits = functools.partial(_load, ref, at, limits, other, False)
        return lax.cond(inside, fits, functools.partial(_load, ref, at, limits, other, True))
    mask = None
    for axis, ((extent, index), limit) in enumerate(itertools.zip_longest(axes, limits[: len(axes)])):
        if index.size > extent:  # a head dim's columns past it, or a tile longer than the sequence
            limit, overrun = extent if limit is None else limit, True
        if limit is not None:
            mask = conjoin(mask, index.start + _iota(shape, axis) < limit)
    if mask is None:
        return ref[at]
    fill = jnp.asarray(other, ref.dtype)
    if overrun:
        return plgpu.load(ref.at[at], mask=jnp.broadcast_to(mask, shape), other=fill)
    return jnp.where(mask, ref[at], fill)


def _store(ref: Any, at: tuple, value: Any, overrun: bool = True) -> None:
    """ref[at] = value, masked along each tile axis the tile may overrun (the array's last, partial tile; a head
    dim held wider than it is); unmasked where every tile fits, or where the caller knows this one does
    (``overrun`` False)."""
    mask = None
    for axis, (extent, index) in enumerate(_tile_axes(ref, at)):
        if (overrun and extent % index.size) or index.size > extent:
            mask = conjoin(mask, index.start + _iota(value.shape, axis) < extent)
    if mask is None:
        ref[at] = value
        return
    # The interpreter's masked store takes the starts as they are: give a traced one the default integer type of
    # the Python ints beside it (int64 under jax_enable_x64; a no-op otherwise).
    at = tuple(pl.ds(jnp.asarray(i.start, int), i.size) if _traced_slice(i) else i for i in at)
    plgpu.store(ref.at[at], value, mask=jnp.broadcast_to(mask, value.shape))


def _traced_slice(index: Any) -> bool:
    return isinstance(index, pl.Slice) and not isinstance(index.start, int)


def _score_fold(params_ref: Any, static: Static, has_terms: bool) -> Any:
    """What turns _scores' tile into log₂ units: scale·log₂e when the scale is left to it (no softcap and no added
    terms, bias or ALiBi: the tile is q·kᵀ), else log₂e. The scale is > 0, so max(S)·fold = max(S·fold)."""
    if static.softcap or has_terms:
        return jnp.float32(LOG2E)
    return params_ref[0] * LOG2E


def _scores(
    a: Any,
    b: Any,
    params_ref: Any,
    static: Static,
    bias: Any,
    visible: Any,
    norms: tuple[Any, Any] = (None, None),
    alibi: Any = None,
) -> tuple[Any, Any]:
    """S = softcap(scale·â·b̂ᵀ) + bias + alibi (``_alibi_term``'s tile, or None), −inf where hidden (``visible``
    None: an interior tile, nothing hidden); also tanh(raw/c) for the softcap derivative. Without softcap, bias and
    ALiBi S is left unscaled (â·b̂ᵀ): _score_fold carries the scale into exp2's argument. â = a unless ``norms``
    holds a's and b's inverse norms (cosine): â·b̂ᵀ = (a·bᵀ)·(1/‖a‖)·(1/‖b‖) in float32."""
    s = _dot(a, b, trans_b=True)
    a_inverse, b_inverse = norms
    if a_inverse is not None:
        s = s * a_inverse[:, None] * b_inverse[None, :]
    tanh = None
    if static.softcap:
        cap = params_ref[1]
        tanh = jnp.tanh(s * params_ref[0] / cap)
        s = tanh * cap
    elif bias is not None or alibi is not None:
        s = s * params_ref[0]
    if bias is not None:
        s = s + bias
    if alibi is not None:
        s = s + alibi
    if visible is None:
        return s, tanh
    return jnp.where(visible, s, -jnp.inf), tanh


class _Program(NamedTuple):
    """A mask program inside a kernel: its expression, the cell's tile classes ((query tiles, key tiles), or the
    dK/dV kernel's (G, …) of its query heads), the captured arrays' refs, the cell's batch element and its first
    query head (the program's h is the query head under GQA)."""

    expr: programs.Expr
    classes: Any
    captured: list[_CapturedRef]
    batch: Any
    first_head: Any


def _program(static: Static, operands: ProgramTiles | None, group: int = 1) -> _Program | None:
    if operands is None:
        return None
    assert static.program is not None
    captured = [_CapturedRef(ref, spec) for ref, spec in zip(operands.captured, static.program.captured)]
    return _Program(static.program.expr, operands.classes, captured, pl.program_id(0), pl.program_id(1) * group)


def _tile_class(program: _Program, head: Any, q_tile: Any, kv_tile: Any) -> Any:
    """The class of a tile pair; ``head``: the cell's query head within its group (0 but in the dK/dV kernel)."""
    at = (q_tile, kv_tile) if len(program.classes.shape) == 2 else (head, q_tile, kv_tile)
    return program.classes[at]


def _program_visibility(program: _Program, head: Any, i0: Any, j0: Any, static: Static) -> Any:
    """The program on the tile of rows i0.. and keys j0..: evaluated with the tile's indices on a PARTIAL tile,
    all visible on a FULL one without evaluating it (EMPTY tiles never get here: ``_where_tiles_meet``)."""
    shape = (static.block_q, static.block_k)
    q_tile, kv_tile = lax.div(i0, jnp.int32(static.block_q)), lax.div(j0, jnp.int32(static.block_k))
    tile_class = _tile_class(program, head, q_tile, kv_tile)

    def evaluate() -> Any:
        rows, columns = i0 + _iota(shape, 0), j0 + _iota(shape, 1)
        env = {"b": program.batch, "h": program.first_head + head, "q": rows, "kv": columns}
        value = programs.evaluate(program.expr, programs.array_ops(rows), env, program.captured)
        return jnp.broadcast_to(jnp.asarray(value, jnp.bool_), shape)

    return lax.cond(tile_class == programs.FULL, lambda: jnp.ones(shape, jnp.bool_), evaluate)


class _Hiders(NamedTuple):
    """What may hide any pair of a tile, beyond the band and lengths: a dense mask's ref, segment ids, a program."""

    mask: Any
    segments: Segments | None
    program: _Program | None


def _tile_visibility(geom: Any, hiders: _Hiders, i0: Any, j0: Any, static: Static, head: Any = None) -> Any:
    """The tile's visible pairs: band and lengths, the mask (of query head ``head`` of the cell's group where it has
    a head axis), segment ids and the program, ANDed."""
    visible = _visible(geom, i0, j0, static.block_q, static.block_k)
    if hiders.mask is not None:
        visible = visible & (_read(hiders.mask, head, i0, j0, static, geom) != 0)
    if hiders.segments is not None:
        q_ids = hiders.segments.q_ids[pl.ds(i0, static.block_q)]
        kv_ids = hiders.segments.kv_ids[pl.ds(j0, static.block_k)]
        visible = visible & segment_visibility(q_ids[:, None], kv_ids[None, :])
    if hiders.program is not None:
        visible = visible & _program_visibility(hiders.program, 0 if head is None else head, i0, j0, static)
    return visible


def _keep(tile: Any, carry: Any) -> Any:
    return carry


def _where_tiles_meet(hiders: _Hiders, pair: Any, visit: Any, skip: Any = _keep, head: Any = None) -> Any:
    """A loop body that runs ``visit(tile, carry)`` only where the tile pair ``pair(tile)`` = (query tile, key
    tile) can hold a visible pair, else ``skip``: the query and key tiles' segment-id ranges meet and the program's
    class of the pair (for the group's query head ``head(carry)``) is not EMPTY. The other tiles are never loaded."""
    segments, program = hiders.segments, hiders.program
    if segments is None and program is None:
        return visit

    def body(tile: Any, carry: Any) -> Any:
        q_tile, kv_tile = pair(tile)
        meet = None
        if segments is not None:
            q_low, q_high = segments.q_ranges[0, q_tile], segments.q_ranges[1, q_tile]
            kv_low, kv_high = segments.kv_ranges[0, kv_tile], segments.kv_ranges[1, kv_tile]
            meet = (q_low <= kv_high) & (kv_low <= q_high)
        if program is not None:
            tile_class = _tile_class(program, 0 if head is None else head(carry), q_tile, kv_tile)
            meet = conjoin(meet, tile_class != programs.EMPTY)
        return lax.cond(meet, visit, skip, tile, carry)

    return body


def _read(ref: Any, head: Any, i0: Any, j0: Any, static: Static, geom: Any = None) -> Any:
    """The (block_q, block_k) tile of a mask/bias ref that is (Lq, Lk), or (G, Lq, Lk) indexed by ``head``; on an
    edge tile (``geom`` given) pairs past q_len or kv_len read 0, so the tile may overrun the array."""
    at: tuple = (pl.ds(i0, static.block_q), pl.ds(j0, static.block_k))
    if head is not None and len(ref.shape) == 3:
        at = (head, *at)
    return _load(ref, at, () if geom is None else (geom[0], geom[1]))


def _split(refs: tuple[Any, ...], present: tuple[Any, ...]) -> list[Any]:
    """Pop the optional refs in order: mask, bias, ALiBi's slopes, then the four of :class:`Segments` (one entry),
    then :class:`ProgramTiles` (one entry), then :class:`DropoutWords` (one entry), then the outputs;
    ``present[n]`` says whether the n-th optional operand was passed (for the program: the number of its captured
    arrays, or None)."""
    refs_list = list(refs)
    mask_present, bias_present, slopes_present, segments_present, captured_count, dropout_present = present
    mask = refs_list.pop(0) if mask_present else None
    bias = refs_list.pop(0) if bias_present else None
    slopes = refs_list.pop(0) if slopes_present else None
    segments = Segments(*(refs_list.pop(0) for _ in Segments._fields)) if segments_present else None
    program = None
    if captured_count is not None:
        classes = refs_list.pop(0)
        program = ProgramTiles(classes, tuple(refs_list.pop(0) for _ in range(captured_count)))
    dropout = DropoutWords(refs_list.pop(0)) if dropout_present else None
    return [mask, bias, slopes, segments, program, dropout, *refs_list]


def _optional_operands(
    in_specs: list[Any],
    operands: list[Any],
    pair_spec: Any,
    mask: Any,
    bias: Any,
    slopes: Any,
    segments: Segments | None,
    program: ProgramTiles | None,
    dropout: DropoutWords | None,
    group: int = 1,
) -> tuple[Any, ...]:
    """Append mask, bias (each with ``pair_spec(shape)``), ALiBi's slopes (``group`` query heads a grid cell), the
    segment operands (whole rows of the batch element), the program's (its tile classes with ``pair_spec``, the
    captured arrays whole) and dropout's words (whole) to a call's specs and operands; the kernel's ``has``."""
    for extra in (mask, bias):
        if extra is not None:
            in_specs.append(pair_spec(extra.shape))
            operands.append(extra)
    if slopes is not None:
        in_specs.append(_slopes_spec(slopes.shape, group))
        operands.append(slopes)
    if segments is not None:
        for array in segments:
            in_specs.append(pl.BlockSpec((None, *array.shape[1:]), lambda b, *_, n=array.ndim: (b,) + (0,) * (n - 1)))
            operands.append(array)
    if program is not None:
        in_specs.append(pair_spec(program.classes.shape))
        operands.append(program.classes)
        for array in program.captured:
            in_specs.append(pl.BlockSpec(array.shape, lambda *_, n=array.ndim: (0,) * n))
            operands.append(array)
    if dropout is not None:
        in_specs.append(pl.BlockSpec(dropout.words.shape, lambda *_: (0,)))
        operands.append(dropout.words)
    captured_count = None if program is None else len(program.captured)
    present = (mask, bias, slopes, segments)
    return (*(operand is not None for operand in present), captured_count, dropout is not None)


def _key_tile(
    k_ref: Any, v_ref: Any, bias_ref: Any, hiders: _Hiders, geom: Any, i0: Any, tile: Any, static: Static,
    kind: tuple[bool, bool],
) -> tuple[Any, Any, Any, Any]:  # fmt: skip
    """K, V, bias and visible pairs of key tile ``tile`` for the query tile at row i0 (forward and dQ kernels).
    ``kind`` = (edge, ragged): an interior tile lies inside kv_len (so inside the array) with every pair visible,
    loaded whole, nothing masked (visible None); an edge tile reads 0 for keys at or past kv_len; a ragged one is
    the keys' last, partial tile (masked loads)."""
    edge, ragged = kind
    j0 = tile * static.block_k
    keys = pl.ds(j0, static.block_k)
    limits: tuple = ()
    visible = None
    if edge:
        limits, visible = (geom[1],), _tile_visibility(geom, hiders, i0, j0, static)
    k = _load(k_ref, (keys, _columns(k_ref)), limits, overrun=ragged)
    v = _load(v_ref, (keys, _columns(v_ref)), limits, overrun=ragged)
    bias = None if bias_ref is None else _read(bias_ref, None, i0, j0, static, geom if edge else None)
    return k, v, bias, visible


# ------------------------------------------------------------------------------------------------- forward


def _fwd_tile(
    geom_ref: Any, params_ref: Any, q_ref: Any, k_ref: Any, v_ref: Any, *refs: Any, static: Static, has: tuple
) -> None:
    mask_ref, bias_ref, slopes_ref, segments, program, dropout_words, o_ref, lse_ref = _split(refs, has)
    hiders = _Hiders(mask_ref, segments, _program(static, program))
    dropout = _dropout(static, dropout_words)
    block_q, block_k = static.block_q, static.block_k
    geom = _geometry(geom_ref)
    alibi = _alibi(slopes_ref, geom_ref)
    q_len = geom[0]
    q_tile = pl.program_id(2)
    i0 = q_tile * block_q
    rows = pl.ds(i0, block_q)
    q = _load(q_ref, (rows, _columns(q_ref)), (q_len,))
    q_inverse = _inverse_norms(q, static)

    def scores(tile: Any, edge: bool, ragged: bool) -> tuple[Any, Any]:
        kind = (edge, ragged)
        k, v, bias, visible = _key_tile(k_ref, v_ref, bias_ref, hiders, geom, i0, tile, static, kind)
        norms = (q_inverse, _inverse_norms(k, static))
        term = _alibi_term(alibi, 0, i0, tile * block_k, block_q, block_k)
        return _scores(q, k, params_ref, static, bias, visible, norms, term)[0], v

    first, end = _split_range(static, k_ref.shape[0], *_kv_range(geom, i0, block_q, block_k))
    interior = None if _all_edge(hiders) else _interior_keys(geom, i0, first, end, block_q, block_k)
    guard = functools.partial(_where_tiles_meet, hiders, lambda tile: (q_tile, tile))
    fold = _score_fold(params_ref, static, bias_ref is not None or alibi is not None)
    tiles = (k_ref.shape[0], block_k)
    dropped = None if dropout is None else lambda tile: _dropout_step(dropout, 0, i0, tile * block_k, static)
    state = _softmax_over_tiles(
        first, end, interior, scores, fold, block_q, width(v_ref.shape[-1]), tiles, guard, bias_ref is not None,
        dropped,
    )  # fmt: skip
    _store_rows(o_ref, lse_ref, rows, *state)


def _softmax_over_tiles(
    first: Any,
    end: Any,
    interior: Any,
    scores: Any,
    fold: Any,
    rows: int,
    dim_v: int,
    tiles: tuple[int, int],
    guard: Any = None,
    may_be_empty: bool = False,
    dropped: Any = None,
) -> tuple[Any, Any, Any]:
    """(row max in log₂ units, row sum, accumulator) over key tiles [first, end) of ``tiles`` = (keys, block_k),
    the ``interior`` run (or None) without masks; ``scores(tile, edge, ragged)`` gives S (−inf where hidden on an
    edge tile) and the tile's V (``ragged``: the keys' last, partial tile), ``fold`` turns S into log₂ units, and
    ``guard(visit)`` may wrap the edge tiles' bodies (segment ids and programs skip tiles).
    ``may_be_empty``: a bias may hide a whole row of an interior tile (−inf), so its shift keeps the select.
    ``dropped(tile)``: dropout's x ↦ x ⊙ M / (1 − p) on the tile (``_dropout_step``), or None without dropout."""

    # Online softmax (FlashAttention-2) in base 2, S₂ = S·fold: m' = max(m, rowmax S₂), α = 2^(m − m'),
    # P = 2^(S₂ − m'), l' = α·l + rowsum P, acc' = α·acc + (P ⊙ M/(1−p))·V (M dropout's keep-mask, §18; P·V
    # without); at the end O = acc / l, lse = (m + log₂ l)·ln 2: l and lse are those before dropout.
    # On an edge tile a row with nothing visible yet keeps m = −inf and is shifted by 0, so P stays 0, not NaN;
    # on an interior tile every m' is finite and needs no such select.
    def visit(edge: bool, ragged: bool = False) -> Any:
        def body(tile: Any, carry: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
            row_max, row_sum, acc = carry
            s, v = scores(tile, edge, ragged)
            new_max = jnp.maximum(row_max, jnp.max(s, axis=1) * fold)
            shift = jnp.where(new_max == -jnp.inf, 0.0, new_max) if edge or may_be_empty else new_max
            p = jnp.exp2(s * fold - shift[:, None])
            alpha = jnp.exp2(row_max - shift)
            row_sum = alpha * row_sum + jnp.sum(p, axis=1)
            if dropped is not None:
                p = dropped(tile)(p)
            acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
            return new_max, row_sum, acc

        return body

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, dim_v), jnp.float32),
    )
    guard = guard or (lambda body: body)
    ragged = _ragged(*tiles, guard(visit(True, ragged=True)))
    return _edge_interior_edge(first, end, interior, guard(visit(True)), visit(False), init, ragged)


def _store_rows(o_ref: Any, lse_ref: Any, rows: Any, row_max: Any, row_sum: Any, acc: Any) -> None:
    """O = acc / l and lse = (m + log₂ l)·ln 2 (natural log at the API) into ``rows``; l = 0 only where no key is
    visible: out 0, lse −inf. A NaN l propagates to both."""
    empty = row_sum == 0
    safe = jnp.where(empty, 1.0, row_sum)
    out = jnp.where(empty[:, None], 0.0, acc / safe[:, None]).astype(o_ref.dtype)
    _store(o_ref, (rows, _columns(o_ref)), out)
    _store(lse_ref, (rows,), jnp.where(empty, -jnp.inf, (row_max + jnp.log2(safe)) * LN2))


def _split_range(static: Static, len_k: int, first: Any, end: Any) -> tuple[Any, Any]:
    """[first, end) cut to this cell's key range (grid axis 3) under split-K: range s holds tiles [s·n, (s+1)·n),
    n = ⌈tiles / splits⌉; a range the row cannot see comes out empty (its cell writes out 0, lse −inf)."""
    if static.splits == 1:
        return first, end
    per_split = -(-pl.cdiv(len_k, static.block_k) // static.splits)
    start = pl.program_id(3) * per_split
    first = jnp.maximum(first, start)
    return first, jnp.maximum(first, jnp.minimum(end, start + per_split))


def _seq_spec(static: Static, length: int, dim: int, head: Any = None) -> pl.BlockSpec:
    """BlockSpec of one head's whole sequence (length, dim) of a q/k/v-like operand in either layout, head ``h``
    of the grid or ``head(h)``. Kernels take their tiles from it with pl.ds (``_load``, ``_store``): blocks never
    have to divide the sequence, so nothing is padded."""
    head = head or (lambda h: h)
    if static.bshd:
        return pl.BlockSpec((None, length, None, dim), lambda b, h, *_: (b, 0, head(h), 0))
    return pl.BlockSpec((None, None, length, dim), lambda b, h, *_: (b, head(h), 0, 0))


def _rows_spec(length: int, group: int | None = None) -> pl.BlockSpec:
    """BlockSpec of a per-row float32 operand (B, Hq, Lq) (lse, Δ): one head's row, or ``group`` heads' from h·G."""
    return pl.BlockSpec((None, group, length), lambda b, h, *_: (b, h, 0))


def _pair_spec(shape: tuple[int, ...], group: int = 1) -> Any:
    """BlockSpec of a mask/bias operand (B|1, Hq|1, Lq, Lk) whose batch/head axes may be broadcast (size 1): one
    head's whole (Lq, Lk), or with ``group`` > 1 the (group, Lq, Lk) block of consecutive heads (the dK/dV
    kernel's G query heads)."""
    batch_broadcast, head_broadcast = shape[0] == 1, shape[1] == 1
    heads = None if head_broadcast else (group if group > 1 else None)

    def index(b: Any, h: Any, *_: Any) -> tuple[Any, ...]:
        return (0 if batch_broadcast else b, 0 if head_broadcast else h, 0, 0)

    return pl.BlockSpec((None, heads, *shape[2:]), index)


def _slopes_spec(shape: tuple[int, ...], group: int = 1) -> pl.BlockSpec:
    """BlockSpec of ALiBi's slopes (B|1, Hq): the ``group`` query heads from h·G of the cell's batch element (one
    head but in the dK/dV kernel); a batch of 1 is read by every element."""
    batch_broadcast = shape[0] == 1
    return pl.BlockSpec((None, group), lambda b, h, *_: (0 if batch_broadcast else b, h))


def _geom_specs() -> list[pl.BlockSpec]:
    return [pl.BlockSpec((None, 5), lambda b, h, *_: (b, 0)), pl.BlockSpec((4,), lambda *_: (0,))]


def forward_call(
    static: Static,
    geom: Any,
    params: Any,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    bias: Any,
    slopes: Any,
    segments: Segments | None,
    program: ProgramTiles | None = None,
    dropout: DropoutWords | None = None,
) -> tuple[Any, Any]:
    """out (q's layout) and lse (B, Hq, Lq) float32; grid (B, Hq, query tiles[, key ranges])."""
    seq_axis, head_axis = (1, 2) if static.bshd else (2, 1)
    len_k, heads_kv, dim_v = k.shape[seq_axis], k.shape[head_axis], v.shape[-1]
    group = q.shape[head_axis] // heads_kv
    in_specs = [
        *_geom_specs(),
        _seq_spec(static, q.shape[seq_axis], q.shape[-1]),
        _seq_spec(static, len_k, k.shape[-1], lambda h: h // group),
        _seq_spec(static, len_k, dim_v, lambda h: h // group),
    ]
    operands = [geom, params, q, k, v]
    has = _optional_operands(in_specs, operands, _pair_spec, mask, bias, slopes, segments, program, dropout)
    kernel = functools.partial(_fwd_tile, static=static, has=has)
    return _launch_forward(static, kernel, in_specs, operands, q, dim_v, "attnkit_pallas_fwd")


def _launch_forward(
    static: Static, kernel: Any, in_specs: list[Any], operands: list[Any], q: Any, dim_v: int, name: str
) -> tuple[Any, Any]:
    """The forward's pallas_call over (B, Hq, query tiles), with a fourth axis of key ranges under split-K whose
    partial (out, lse), float32, are merged by lse (docs/semantics.md §6)."""
    seq_axis, head_axis = (1, 2) if static.bshd else (2, 1)
    batch, len_q, heads_q = q.shape[0], q.shape[seq_axis], q.shape[head_axis]
    block_q, splits = static.block_q, static.splits
    out_shape = (*q.shape[:-1], dim_v)
    out_spec, lse_spec = _seq_spec(static, len_q, dim_v), _rows_spec(len_q)
    out_dtype, grid = q.dtype, (batch, heads_q, pl.cdiv(len_q, block_q))
    if splits > 1:  # each key range's partial results, float32, on a leading axis
        if static.bshd:
            out_spec = pl.BlockSpec((None, None, len_q, None, dim_v), lambda b, h, x, s: (s, b, 0, h, 0))
        else:
            out_spec = pl.BlockSpec((None, None, None, len_q, dim_v), lambda b, h, x, s: (s, b, h, 0, 0))
        lse_spec = pl.BlockSpec((None, None, None, len_q), lambda b, h, x, s: (s, b, h, 0))
        out_dtype = jnp.float32
    lead = (splits,) if splits > 1 else ()
    out, lse = pl.pallas_call(
        kernel,
        grid=(*grid, splits) if splits > 1 else grid,
        in_specs=in_specs,
        out_specs=[out_spec, lse_spec],
        out_shape=[
            jax.ShapeDtypeStruct((*lead, *out_shape), out_dtype),
            jax.ShapeDtypeStruct((*lead, batch, heads_q, len_q), jnp.float32),
        ],
        interpret=static.interpret,
        compiler_params=static.compiler_params(),
        name=name,
    )(*operands)
    if splits > 1:
        out, lse = merge_partials(out, lse, seq_axis)
    return out.astype(q.dtype), lse


# --------------------------------------------------------------------------------------------- paged forward


def _paged_tile(
    geom_ref: Any, params_ref: Any, table_ref: Any, q_ref: Any, k_ref: Any, v_ref: Any, *refs: Any,
    static: Static, page: int, has_slopes: bool,
) -> None:  # fmt: skip
    """The forward over a paged cache: key j of this sequence is slot j mod page of block table[j // page]. A key
    tile (block_k keys) lies inside one block, read where it lies; tiles at or past kv_len are never loaded. ALiBi's
    j is the key's position in the sequence, not its slot."""
    slopes_ref, o_ref, lse_ref = refs if has_slopes else (None, *refs)
    block_q, block_k = static.block_q, static.block_k
    geom = _geometry(geom_ref)
    alibi = _alibi(slopes_ref, geom_ref)
    q_len, kv_len = geom[0], geom[1]
    i0 = pl.program_id(2) * block_q
    rows = pl.ds(i0, block_q)
    q = _load(q_ref, (rows, _columns(q_ref)), (q_len,))
    q_inverse = _inverse_norms(q, static)

    def scores(tile: Any, edge: bool, ragged: bool) -> tuple[Any, Any]:
        j0 = tile * block_k
        block = jnp.clip(table_ref[lax.div(j0, jnp.int32(page))], 0, k_ref.shape[0] - 1)  # a traced table: in range
        slot = lax.rem(j0, jnp.int32(page))
        limits = (kv_len - j0 + slot,)  # kv_len in this block's slots
        k = _load(k_ref, (block, pl.ds(slot, block_k), _columns(k_ref)), limits)
        v = _load(v_ref, (block, pl.ds(slot, block_k), _columns(v_ref)), limits)
        norms = (q_inverse, _inverse_norms(k, static))
        visible = _visible(geom, i0, j0, block_q, block_k)
        term = _alibi_term(alibi, 0, i0, j0, block_q, block_k)
        return _scores(q, k, params_ref, static, None, visible, norms, term)[0], v

    capacity = table_ref.shape[0] * page
    first, end = _split_range(static, capacity, *_kv_range(geom, i0, block_q, block_k))
    fold = _score_fold(params_ref, static, alibi is not None)
    state = _softmax_over_tiles(first, end, None, scores, fold, block_q, width(v_ref.shape[-1]), (capacity, block_k))
    _store_rows(o_ref, lse_ref, rows, *state)


def paged_forward_call(
    static: Static, geom: Any, params: Any, block_table: Any, q: Any, k_cache: Any, v_cache: Any, slopes: Any = None
) -> tuple[Any, Any]:
    """attend_paged's forward: out (q's layout) and lse (B, Hq, Lq_pad); grid (B, Hq, query tiles[, key ranges]).
    k_cache/v_cache (num_blocks, page, Hkv, D|Dv) go in whole (one kv head per cell) and are read a tile at a time
    through the table (B, max_blocks) int32; ``static.block_k`` divides the page. ``slopes``: ALiBi's (B|1, Hq)
    float32, or None."""
    num_blocks, page, heads_kv, dim = k_cache.shape
    head_axis = 2 if static.bshd else 1
    group = q.shape[head_axis] // heads_kv
    dim_v = v_cache.shape[-1]
    in_specs = [
        *_geom_specs(),
        pl.BlockSpec((None, block_table.shape[1]), lambda b, *_: (b, 0)),
        _seq_spec(static, q.shape[1 if static.bshd else 2], dim),
        pl.BlockSpec((num_blocks, page, None, dim), lambda b, h, *_: (0, 0, h // group, 0)),
        pl.BlockSpec((num_blocks, page, None, dim_v), lambda b, h, *_: (0, 0, h // group, 0)),
    ]
    operands = [geom, params, block_table, q, k_cache, v_cache]
    if slopes is not None:
        in_specs.append(_slopes_spec(slopes.shape))
        operands.append(slopes)
    kernel = functools.partial(_paged_tile, static=static, page=page, has_slopes=slopes is not None)
    return _launch_forward(static, kernel, in_specs, operands, q, dim_v, "attnkit_pallas_paged_fwd")


# ------------------------------------------------------------------------------------------------ backward


def _bwd_dkdv(
    geom_ref: Any,
    params_ref: Any,
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    do_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    *refs: Any,
    static: Static,
    has: tuple,
    group: int,
) -> None:
    mask_ref, bias_ref, slopes_ref, segments, program, dropout_words, dk_ref, dv_ref = _split(refs, has)
    hiders = _Hiders(mask_ref, segments, _program(static, program, group))
    dropout = _dropout(static, dropout_words, group)
    block_q, block_k = static.block_q, static.block_k
    geom = _geometry(geom_ref)
    alibi = _alibi(slopes_ref, geom_ref)
    q_len, kv_len = geom[0], geom[1]
    kv_tile = pl.program_id(2)
    j0 = kv_tile * block_k
    keys = pl.ds(j0, block_k)
    k = _load(k_ref, (keys, _columns(k_ref)), (kv_len,))
    v = _load(v_ref, (keys, _columns(v_ref)), (kv_len,))
    k_inverse = _inverse_norms(k, static)

    def q_tile(g: Any, rows: Any, limits: tuple, overrun: bool) -> tuple[Any, ...]:
        """q, dO, lse (log₂ units) and Δ of query head g's rows; past ``limits`` 0 (lse +inf: P = 0)."""
        at = (lambda ref: (rows, g, _columns(ref))) if static.bshd else (lambda ref: (g, rows, _columns(ref)))
        q, do = (_load(ref, at(ref), limits, overrun=overrun) for ref in (q_ref, do_ref))
        lse = _load(lse_ref, (g, rows), limits, jnp.inf, overrun) * LOG2E
        return q, do, lse, _load(delta_ref, (g, rows), limits, overrun=overrun)

    fold = _score_fold(params_ref, static, bias_ref is not None or alibi is not None)

    # Per query tile of each of the G query heads reading this kv head, P recomputed from lse (log₂ units):
    # P = 2^(S·fold − lse·log₂e), dV += (P ⊙ M/(1−p))ᵀ·dO, dP = dO·Vᵀ ⊙ M/(1−p) (M dropout's keep-mask, §18, all
    # ones and p = 0 without), dS = P ⊙ (dP − Δ) with Δ = rowsum(dO ⊙ O) − dlse,
    # dS ⊙= 1 − tanh² through the softcap, dK += scale · dSᵀ·Q (cosine: dK̂ += scale · (dS/‖q‖)ᵀ·Q). Empty rows
    # carry lse = +inf: P = 0. Queries on rows, as Triton's dK/dV kernel: with block_q = 128 on 8 warps each
    # warpgroup takes 64 rows of S and dP, and dV, dK (block_k rows) are split between them.
    def visit(edge: bool) -> Any:
        def body(tile: Any, carry: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
            g, dk, dv = carry
            i0 = tile * block_q
            # An edge tile's rows past q_len come in as zeros from a masked load: a select after a whole load
            # costs the edge loops registers they spill at D = 128 (performance.md, Pallas on sm_90).
            q, do, lse, delta = q_tile(g, pl.ds(i0, block_q), (q_len,) if edge else (), edge)
            visible = None  # an interior tile has every row inside q_len
            if edge:
                visible = _tile_visibility(geom, hiders, i0, j0, static, head=g)
            bias = None if bias_ref is None else _read(bias_ref, g, i0, j0, static, geom if edge else None)
            term = _alibi_term(alibi, g, i0, j0, block_q, block_k)
            q_inverse = _inverse_norms(q, static)
            s, tanh = _scores(q, k, params_ref, static, bias, visible, (q_inverse, k_inverse), term)
            p = jnp.exp2(s * fold - lse[:, None])
            dropped = _dropout_step(dropout, g, i0, j0, static)
            dv = dv + _dot(dropped(p).astype(do.dtype), do, trans_a=True)
            ds = p * (dropped(_dot(do, v, trans_b=True)) - delta[:, None])
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            if q_inverse is not None:
                ds = ds * q_inverse[:, None]
            dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
            return g, dk, dv

        return body

    edge = _where_tiles_meet(hiders, lambda tile: (tile, kv_tile), visit(True), head=lambda carry: carry[0])

    def head(g: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
        first, end = _q_range(geom, j0, block_q, block_k)
        interior = None if _all_edge(hiders) else _interior_queries(geom, j0, first, end, block_q, block_k)
        # The array's last, partial query tile is an edge tile like any other: its loads are masked already.
        _, dk, dv = _edge_interior_edge(first, end, interior, edge, visit(False), (g, *carry))
        return dk, dv

    init = (jnp.zeros((block_k, k.shape[-1]), jnp.float32), jnp.zeros((block_k, v.shape[-1]), jnp.float32))
    dk, dv = lax.fori_loop(0, group, head, init)
    _store(dk_ref, (keys, _columns(dk_ref)), (dk * params_ref[0]).astype(dk_ref.dtype))
    _store(dv_ref, (keys, _columns(dv_ref)), dv.astype(dv_ref.dtype))


def _bwd_dq(
    geom_ref: Any,
    params_ref: Any,
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    do_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    *refs: Any,
    static: Static,
    has: tuple,
) -> None:
    mask_ref, bias_ref, slopes_ref, segments, program, dropout_words, dq_ref, *dbias = _split(refs, has)
    hiders = _Hiders(mask_ref, segments, _program(static, program))
    dropout = _dropout(static, dropout_words)
    dbias_ref = dbias[0] if dbias else None
    block_q, block_k = static.block_q, static.block_k
    geom = _geometry(geom_ref)
    alibi = _alibi(slopes_ref, geom_ref)
    q_len = geom[0]
    q_tile = pl.program_id(2)
    i0 = q_tile * block_q
    rows = pl.ds(i0, block_q)
    q = _load(q_ref, (rows, _columns(q_ref)), (q_len,))
    q_inverse = _inverse_norms(q, static)
    do = _load(do_ref, (rows, _columns(do_ref)), (q_len,))
    lse = _load(lse_ref, (rows,), (q_len,), other=jnp.inf) * LOG2E
    delta = _load(delta_ref, (rows,), (q_len,))

    fold = _score_fold(params_ref, static, bias_ref is not None or alibi is not None)

    # Per visible key tile: P = 2^(S·fold − lse·log₂e), dS = P ⊙ (dO·Vᵀ ⊙ M/(1−p) − Δ) (this is dbias; M dropout's
    # keep-mask, §18, all ones and p = 0 without),
    # dS' = dS ⊙ (1 − tanh²), dQ += scale · dS'·K (cosine: dQ̂ += scale · (dS'/‖k‖)·K).
    def visit(edge: bool, ragged: bool = False) -> Any:
        def body(tile: Any, dq: Any) -> Any:
            kind = (edge, ragged)
            k, v, bias, visible = _key_tile(k_ref, v_ref, bias_ref, hiders, geom, i0, tile, static, kind)
            keys = pl.ds(tile * block_k, block_k)
            k_inverse = _inverse_norms(k, static)
            term = _alibi_term(alibi, 0, i0, tile * block_k, block_q, block_k)
            s, tanh = _scores(q, k, params_ref, static, bias, visible, (q_inverse, k_inverse), term)
            p = jnp.exp2(s * fold - lse[:, None])
            dropped = _dropout_step(dropout, 0, i0, tile * block_k, static)
            ds = p * (dropped(_dot(do, v, trans_b=True)) - delta[:, None])
            if dbias_ref is not None:
                _store(dbias_ref, (rows, keys), ds, overrun=edge)
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            if k_inverse is not None:
                ds = ds * k_inverse[None, :]
            return dq + _dot(ds.astype(k.dtype), k)

        return body

    first, end = _kv_range(geom, i0, block_q, block_k)
    skip = _keep
    if dbias_ref is not None:  # tiles the loop skips hold no gradient: write their zeros
        zeros = jnp.zeros((block_q, block_k), dbias_ref.dtype)

        def skip(tile: Any, carry: Any) -> Any:
            _store(dbias_ref, (rows, pl.ds(tile * block_k, block_k)), zeros)
            return carry

        lax.fori_loop(0, first, skip, 0)
        lax.fori_loop(end, pl.cdiv(dbias_ref.shape[-1], block_k), skip, 0)
    guard = functools.partial(_where_tiles_meet, hiders, lambda tile: (q_tile, tile), skip=skip)
    ragged = _ragged(k_ref.shape[0], block_k, guard(visit(True, ragged=True)))
    interior = None if _all_edge(hiders) else _interior_keys(geom, i0, first, end, block_q, block_k)
    init = jnp.zeros((block_q, q.shape[-1]), jnp.float32)
    dq = _edge_interior_edge(first, end, interior, guard(visit(True)), visit(False), init, ragged)
    _store(dq_ref, (rows, _columns(dq_ref)), (dq * params_ref[0]).astype(dq_ref.dtype))


def dkdv_call(
    static: Static,
    geom: Any,
    params: Any,
    q: Any,
    k: Any,
    v: Any,
    do: Any,
    lse: Any,
    delta: Any,
    mask: Any,
    bias: Any,
    slopes: Any,
    segments: Segments | None,
    program: ProgramTiles | None = None,
    dropout: DropoutWords | None = None,
) -> tuple[Any, Any]:
    """dk, dv float32 in k's layout; grid (B, Hkv, key tiles), each looping over its G query heads."""
    seq_axis, head_axis = (1, 2) if static.bshd else (2, 1)
    batch, len_q, heads_q, dim = q.shape[0], q.shape[seq_axis], q.shape[head_axis], q.shape[-1]
    len_k, heads_kv, dim_v = k.shape[seq_axis], k.shape[head_axis], v.shape[-1]
    group = heads_q // heads_kv
    if static.bshd:
        grouped = [pl.BlockSpec((None, len_q, group, d), lambda b, h, x: (b, 0, h, 0)) for d in (dim, dim_v)]
    else:
        grouped = [pl.BlockSpec((None, group, len_q, d), lambda b, h, x: (b, h, 0, 0)) for d in (dim, dim_v)]
    rows = _rows_spec(len_q, group)
    keys, keys_v = _seq_spec(static, len_k, dim), _seq_spec(static, len_k, dim_v)
    in_specs = [*_geom_specs(), grouped[0], keys, keys_v, grouped[1], rows, rows]
    operands = [geom, params, q, k, v, do, lse, delta]
    pair_spec = lambda shape: _pair_spec(shape, group)  # noqa: E731
    has = _optional_operands(in_specs, operands, pair_spec, mask, bias, slopes, segments, program, dropout, group)
    kernel = functools.partial(_bwd_dkdv, static=static, has=has, group=group)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads_kv, pl.cdiv(len_k, static.block_k)),
        in_specs=in_specs,
        out_specs=[keys, keys_v],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, jnp.float32),
            jax.ShapeDtypeStruct(v.shape, jnp.float32),
        ],
        interpret=static.interpret,
        compiler_params=static.compiler_params(),
        name="attnkit_pallas_bwd_dkdv",
    )(*operands)


def dq_call(
    static: Static,
    geom: Any,
    params: Any,
    q: Any,
    k: Any,
    v: Any,
    do: Any,
    lse: Any,
    delta: Any,
    mask: Any,
    bias: Any,
    slopes: Any,
    segments: Segments | None,
    program: ProgramTiles | None,
    dropout: DropoutWords | None,
    need_dbias: bool,
) -> tuple[Any, Any]:
    """dq float32 in q's layout and, when asked, dS as dbias (B, Hq, Lq, Lk); grid (B, Hq, query tiles)."""
    seq_axis, head_axis = (1, 2) if static.bshd else (2, 1)
    batch, len_q, heads_q, dim = q.shape[0], q.shape[seq_axis], q.shape[head_axis], q.shape[-1]
    len_k, heads_kv, dim_v = k.shape[seq_axis], k.shape[head_axis], v.shape[-1]
    group = heads_q // heads_kv
    rows = _rows_spec(len_q)
    in_specs = [
        *_geom_specs(),
        _seq_spec(static, len_q, dim),
        _seq_spec(static, len_k, dim, lambda h: h // group),
        _seq_spec(static, len_k, dim_v, lambda h: h // group),
        _seq_spec(static, len_q, dim_v),
        rows,
        rows,
    ]
    operands = [geom, params, q, k, v, do, lse, delta]
    has = _optional_operands(in_specs, operands, _pair_spec, mask, bias, slopes, segments, program, dropout)
    out_specs = [_seq_spec(static, len_q, dim)]
    out_shape = [jax.ShapeDtypeStruct(q.shape, jnp.float32)]
    if need_dbias:
        out_specs.append(pl.BlockSpec((None, None, len_q, len_k), lambda b, h, *_: (b, h, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((batch, heads_q, len_q, len_k), jnp.float32))
    kernel = functools.partial(_bwd_dq, static=static, has=has)
    results = pl.pallas_call(
        kernel,
        grid=(batch, heads_q, pl.cdiv(len_q, static.block_q)),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=static.interpret,
        compiler_params=static.compiler_params(),
        name="attnkit_pallas_bwd_dq",
    )(*operands)
    return results[0], (results[1] if need_dbias else None)
