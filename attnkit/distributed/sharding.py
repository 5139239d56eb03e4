"""Sequence sharding for context parallelism (docs/semantics.md §14), in plain integers for every framework: which
global positions each rank holds, and how one block of the global call (a chunk of queries against a chunk of keys)
runs as a local ``attnkit.attend`` call.

A sequence of L positions is cut into equal chunks: ``contiguous`` gives rank r chunk r of P; ``zigzag`` gives it
chunks r and 2P−1−r of 2P (in that order), so that under causal attention every rank sees as many visible pairs.
A rank's local tensor is its chunks concatenated along the sequence axis.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from attnkit.backend import Dropout
from attnkit.contract import TileVisibility, alignment_offset, diagonal_band, tile_visibility
from attnkit.errors import InvalidInputError
from attnkit.spec import AttentionSpec, CausalAlignment


class Sharding(enum.StrEnum):
    """How a sequence of L positions is cut among P ranks: ``contiguous``, P chunks, rank r holding chunk r;
    ``zigzag``, 2P chunks, rank r holding chunks r and 2P−1−r, so that under causal attention every rank sees as many
    visible pairs."""

    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"


class Strategy(enum.StrEnum):
    """What runs a sharded call (each computes the same): ``ring`` passes K/V chunks around the ring, one block per
    step; ``allgather`` gathers K and V, then the local queries meet every key; ``ulysses`` turns sequence shards
    into head shards with an all-to-all and makes one whole-sequence call per head group."""

    RING = "ring"  # K/V chunks passed around the ring, one block computed per step
    ALLGATHER = "allgather"  # K and V all-gathered, the local queries against every key
    ULYSSES = "ulysses"  # all-to-all from sequence shards to head shards, a whole-sequence call per head group


def chunk_count(sharding: Sharding, world: int) -> int:
    """How many equal chunks the sequence is cut into."""
    return world if sharding is Sharding.CONTIGUOUS else 2 * world


def chunk_size(name: str, length: int, world: int, sharding: Sharding) -> int:
    """The length of one chunk of a ``length``-long sequence; a typed error naming ``name`` if it does not divide."""
    chunks = chunk_count(sharding, world)
    if length % chunks:
        raise InvalidInputError(
            f"{name} is {length} positions long along the sequence, not divisible into {chunks} equal chunks "
            f"({sharding.value} sharding over {world} ranks): pad it to a multiple of {chunks} and pass the true "
            "lengths as q_lengths/kv_lengths"
        )
    return length // chunks


def rank_chunks(world: int, rank: int, sharding: Sharding) -> tuple[int, ...]:
    """The chunks rank ``rank`` holds, in its local order."""
    if sharding is Sharding.CONTIGUOUS:
        return (rank,)
    return (rank, 2 * world - 1 - rank)


def rank_spans(length: int, world: int, rank: int, sharding: Sharding, name: str = "the sequence") -> tuple[range, ...]:
    """The global positions rank ``rank`` holds, one range per chunk, in its local order."""
    size = chunk_size(name, length, world, sharding)
    return tuple(range(chunk * size, (chunk + 1) * size) for chunk in rank_chunks(world, rank, sharding))


def gather_order(length: int, world: int, sharding: Sharding) -> list[int]:
    """Global positions in rank-major local order: the local tensors of ranks 0..P−1 concatenated hold positions
    ``gather_order(...)``; ``shard`` takes rank r's slice of ``x[gather_order]`` and ``unshard`` inverts it."""
    spans = (span for rank in range(world) for span in rank_spans(length, world, rank, sharding))
    return [position for span in spans for position in span]


class BlockKind(enum.Enum):
    HIDDEN = "hidden"  # no pair visible: neither computed nor, where the schedule allows, sent
    FULL = "full"  # every pair visible under causal/window: the block spec has neither
    ALIGNED = "aligned"  # the band falls on the block as the block spec's own causal/window with an alignment
    MASKED = "masked"  # the band crosses the block off its alignments: a boolean mask of the global band


@dataclass(frozen=True)
class Block:
    """How one (query chunk × key chunk) block of the global call runs locally. ``spec``: the local call's spec
    (the global one, its causal/window dropped for FULL and MASKED, its alignment chosen for ALIGNED). ``offset``:
    the global alignment offset of the block's first query against its first key, ``rel = j − i − offset`` in
    block-local indices (for MASKED blocks, which build ``lower ≤ rel ≤ upper`` from ``band``)."""

    kind: BlockKind
    spec: AttentionSpec
    offset: int
    band: tuple[int | None, int | None]


def block_plan(spec: AttentionSpec, q_span: range, k_span: range, len_q: int, len_k: int, has_lengths: bool) -> Block:
    """The block of the global call with queries ``q_span`` and keys ``k_span`` (global positions) of a call with
    ``len_q`` queries and ``len_k`` keys. With lengths under bottom-right alignment the offset differs per batch
    element (``kv_len − q_len``): such blocks are MASKED by the caller with each element's offset, unless hidden or
    full by the band alone, which this reads at the full lengths."""
    band = diagonal_band(spec)
    offset = alignment_offset(spec, len_q, len_k) - (k_span.start - q_span.start)
    open_band = spec.replace(causal=False, window=None)
    if band == (None, None):
        return Block(BlockKind.FULL, open_band, offset, band)
    per_element = has_lengths and spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT
    if not per_element:
        seen = tile_visibility(band, offset, range(len(q_span)), range(len(k_span)), len(q_span), len(k_span))
        if seen is TileVisibility.HIDDEN:
            return Block(BlockKind.HIDDEN, spec, offset, band)
        if seen is TileVisibility.FULL:
            return Block(BlockKind.FULL, open_band, offset, band)
        if offset == 0:
            return Block(BlockKind.ALIGNED, spec.replace(causal_alignment=CausalAlignment.TOP_LEFT), offset, band)
        if offset == len(k_span) - len(q_span) and not has_lengths:  # with lengths, bottom-right follows them
            return Block(BlockKind.ALIGNED, spec.replace(causal_alignment=CausalAlignment.BOTTOM_RIGHT), offset, band)
    return Block(BlockKind.MASKED, open_band, offset, band)


class AlibiSide(enum.Enum):
    """How a block takes ALiBi's ``−slope · |i + c − j|`` (§16), ``c`` its ``Block.offset`` in block-local indices."""

    NATIVE = "native"  # the local call's own ALiBi offset is c: the slopes pass straight through
    BEHIND = "behind"  # every key at or behind its query's diagonal (i + c − j ≥ 0): a key bias + a row constant
    AHEAD = "ahead"  # every key at or ahead of it (i + c − j ≤ 0): linear the other way
    BOTH = "both"  # keys on both sides, or c per batch element: split by a mask into the two linear sides


def alibi_plan(block: Block, rows: int, cols: int, has_lengths: bool) -> tuple[Block, AlibiSide]:
    """How ``block`` (``rows`` queries × ``cols`` keys) takes ALiBi, with the spec its local call then runs. An
    ALIGNED block's alignment is c's; a FULL or MASKED block has no causal or window left, so its alignment only
    steers ALiBi and may be chosen to make c native. Bottom-right with lengths has c per element (``kv_len − q_len``
    shifted by the block's place): split by masks, which read each element's c."""
    if block.kind in (BlockKind.HIDDEN, BlockKind.ALIGNED):
        return block, AlibiSide.NATIVE
    if has_lengths and block.spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT:
        return block, AlibiSide.BOTH
    offset = block.offset
    if offset == 0:  # top-left's own offset is 0, whatever the lengths
        return replace(block, spec=block.spec.replace(causal_alignment=CausalAlignment.TOP_LEFT)), AlibiSide.NATIVE
    if offset == cols - rows and not has_lengths:  # bottom-right's own offset, lk − lq without lengths
        return replace(block, spec=block.spec.replace(causal_alignment=CausalAlignment.BOTTOM_RIGHT)), AlibiSide.NATIVE
    if offset - (cols - 1) >= 0:  # the least i + c − j of the block, at i = 0, j = cols − 1
        return block, AlibiSide.BEHIND
    if rows - 1 + offset <= 0:  # the greatest, at i = rows − 1, j = 0
        return block, AlibiSide.AHEAD
    return block, AlibiSide.BOTH


def alibi_sides(side: AlibiSide, slope: Any, rows: Any, cols: Any, offset: Any) -> list[tuple[Any, Any, Any]]:
    """A non-native block's ALiBi as (side mask or None, key bias (B|1, Hq, 1, chunk k), row constant (B|1, Hq,
    chunk q)) per side it has keys on: −slope·|i + c − j| = key bias_j + row constant_i on that side, the key bias 0
    at the key nearest the diagonal (float32 keeps its precision there), the row constant for the side's lse (out does
    not see a per-row constant). Framework arrays: ``slope`` (B|1, Hq, 1, 1), ``rows`` (chunk q, 1) and ``cols``
    (1, chunk k) block-local positions in the slope's dtype, ``offset`` c, a number or (B|1, 1, 1, 1)."""
    last = cols.shape[-1] - 1
    # behind (i + c − j ≥ 0): −slope·(i + c − j) = slope·(j − last) − slope·(i + c − last)
    behind = (None, slope * (cols - last), (-slope * (rows + offset - last))[..., 0])
    # ahead (i + c − j ≤ 0): −slope·(j − i − c) = −slope·j + slope·(i + c)
    ahead = (None, -slope * cols, (slope * (rows + offset))[..., 0])
    if side is AlibiSide.BEHIND:
        return [behind]
    if side is AlibiSide.AHEAD:
        return [ahead]
    at_or_behind = rows + offset - cols >= 0  # (B|1, 1, chunk q, chunk k)
    return [(at_or_behind, *behind[1:]), (~at_or_behind, *ahead[1:])]


def at_global_positions(
    mask_mod: Callable[..., Any], q_start: Any = None, k_start: Any = None, h_start: Any = None
) -> Callable[..., Any]:
    """``mask_mod`` (§17) as one local call of a sharded one runs it: its queries and keys are the contiguous global
    positions from ``q_start`` and ``k_start`` on (a block is one chunk of each, zigzag too), its query heads from
    ``h_start`` (Ulysses' head shard); None leaves an index as the local call's. The starts are 0-d integer tensors
    or arrays the wrapper captures: every block shares one program (and a kernel's cache of it), its place being a
    captured value, never a constant of the program."""

    def shifted(index: Any, start: Any) -> Any:
        return index if start is None else index + start

    def at_global(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mask_mod(b, shifted(h, h_start), shifted(q_idx, q_start), shifted(kv_idx, k_start))

    return at_global


def dropout_at(dropout: Dropout | None, heads: Any = 0, queries: Any = 0, keys: Any = 0) -> dict[str, Any]:
    """attend's dropout arguments (§18) for one local call of a sharded one whose query heads, queries and keys start
    at ``heads``, ``queries`` and ``keys`` of the global call (ints, or traced 0-d arrays on JAX): its keep-mask is
    the global call's there. None: no dropout (no arguments)."""
    if dropout is None:
        return {}
    return {"dropout_p": dropout.p, "dropout_seed": dropout.shifted(heads, queries, keys)}


def ring_hops(spec: AttentionSpec, len_q: int, len_k: int, world: int, sharding: Sharding, has_lengths: bool) -> int:
    """How far the ring must carry K/V: the largest (r − s) mod P over the ranks r whose queries see some key of rank
    s (a block not HIDDEN). P − 1 unless causal or a window hides whole shards from the ranks behind them (a sliding
    window over contiguous shards needs the nearest ones only); the ring then stops after that many hops."""
    hops = 0
    for rank in range(world):
        for source in range(world):
            distance = (rank - source) % world
            if distance <= hops:
                continue
            q_spans = rank_spans(len_q, world, rank, sharding, "q")
            k_spans = rank_spans(len_k, world, source, sharding, "k")
            if any(block_plan(spec, q_span, k_span, len_q, len_k, has_lengths).kind is not BlockKind.HIDDEN
                   for q_span in q_spans for k_span in k_spans):  # fmt: skip
                hops = distance
    return hops
