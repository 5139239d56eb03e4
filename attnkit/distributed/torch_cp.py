"""Context parallelism over torch.distributed (docs/semantics.md §14): every rank of a process group holds a shard of
the sequence of q, k and v, and together they compute the single-device ``attnkit.attend`` call on the whole tensors,
outputs and gradients.

Each strategy cuts the global call into blocks (a chunk of queries against a chunk of keys, planned by
:func:`attnkit.distributed.sharding.block_plan`), runs each visible block as a local ``attnkit.attend`` call with its
lse, and merges the blocks of a query chunk by their lse (§6):

    lse = log Σ_s exp(lse_s);   out = Σ_s exp(lse_s − lse) · out_s

``allgather`` and ``ulysses`` are differentiated by autograd through differentiable collectives; the ring has a
backward of its own that runs the ring again (one remote K/V chunk at a time), recomputing each block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from attnkit import errors, programs
from attnkit.api import attend as local_attend
from attnkit.backend import Dropout
from attnkit.contract import conjoin, within_band
from attnkit.contract.programs import EMPTY, tile_classes
from attnkit.contract.torch import block_of, compute_dtype
from attnkit.distributed.sharding import (
    AlibiSide,
    BlockKind,
    Sharding,
    Strategy,
    alibi_plan,
    alibi_sides,
    at_global_positions,
    block_plan,
    chunk_size,
    dropout_at,
    gather_order,
    rank_spans,
    ring_hops,
)
from attnkit.errors import InvalidInputError, InvalidInputTypeError
from attnkit.frontends import ops_for
from attnkit.sinks import check_sinks, with_sinks
from attnkit.spec import AttentionSpec, CausalAlignment, Layout
from attnkit.validation import checked_dropout, checked_probability, checked_slopes, prepare

Group = Any  # a torch.distributed ProcessGroup, or None for the default group
Partial = tuple[torch.Tensor, torch.Tensor]  # (out, lse) of one block


# ---------------------------------------------------------------------------------------------------------------------
# What a rank moves and waits for (``attnkit bench --what context-parallel``)


@dataclass
class Traffic:
    """This rank's sharded calls while :func:`recording`: the bytes it handed to each kind of transfer (what it
    sends), the blocks it computed, and per ring transfer ``(what, busy, waited)``: the wall seconds from posting the
    transfer to the end of the compute it overlaps, then the seconds spent waiting for it."""

    sent_bytes: dict[str, int] = field(default_factory=dict)
    blocks: int = 0
    ring_transfers: list[tuple[str, float, float]] = field(default_factory=list)


_traffic: Traffic | None = None


@contextmanager
def recording() -> Iterator[Traffic]:
    """Record this rank's :class:`Traffic` for the calls made inside the block."""
    global _traffic
    _traffic = traffic = Traffic()
    try:
        yield traffic
    finally:
        _traffic = None


def _note_sent(what: str, nbytes: int) -> None:
    if _traffic is not None:
        _traffic.sent_bytes[what] = _traffic.sent_bytes.get(what, 0) + nbytes


def _waited_for(what: str, requests: list[Any], posted: float) -> None:
    """Wait for a posted ring transfer, noting how long the compute since ``posted`` hid it and what was left."""
    busy = time.perf_counter() - posted
    _wait(requests)
    if _traffic is not None and requests:  # a shift that moved nothing is no transfer
        _traffic.ring_transfers.append((what, busy, time.perf_counter() - posted - busy))


# ---------------------------------------------------------------------------------------------------------------------
# Groups and differentiable collectives


def _world(group: Group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidInputError(
            "group: torch.distributed is not initialised; call torch.distributed.init_process_group first"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def _global_rank(group: Group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _gathered(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (differentiable)."""
    return _AllGather.apply(x, group, dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:  # type: ignore[override]
        world, rank = _world(group)
        ctx.group, ctx.dim, ctx.rank, ctx.size = group, dim, rank, x.shape[dim]
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        _note_sent("all-gather", x.nbytes * (world - 1))
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        # Every rank's output took gradients: this rank's slice, summed over the ranks.
        parts = [part.contiguous() for part in grad.split(ctx.size, ctx.dim)]
        mine = torch.empty_like(parts[ctx.rank])
        dist.reduce_scatter(mine, parts, group=ctx.group)
        _note_sent("reduce-scatter", sum(part.nbytes for index, part in enumerate(parts) if index != ctx.rank))
        return mine, None, None


class _AllToAll(torch.autograd.Function):
    """Split ``x`` into P parts along ``split_dim``, part p to rank p; the parts received concatenated along
    ``concat_dim`` in rank order. Its gradient is the same exchange with the two axes swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, split_dim: int, concat_dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.split_dim, ctx.concat_dim = group, split_dim, concat_dim
        return _all_to_all(x, group, split_dim, concat_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return _all_to_all(grad, ctx.group, ctx.concat_dim, ctx.split_dim), None, None, None


def _all_to_all(x: torch.Tensor, group: Group, split_dim: int, concat_dim: int) -> torch.Tensor:
    world, rank = _world(group)
    sends = [part.contiguous() for part in x.chunk(world, split_dim)]
    receives = [torch.empty_like(part) for part in sends]
    dist.all_to_all(receives, sends, group=group)
    _note_sent("all-to-all", sum(part.nbytes for part in sends) - sends[rank].nbytes)
    return torch.cat(receives, concat_dim)


def _reordered(x: torch.Tensor, dim: int, positions: Sequence[int]) -> torch.Tensor:
    return x.index_select(dim, torch.tensor(positions, device=x.device))


def _to_global_order(x: torch.Tensor, dim: int, world: int, sharding: Sharding) -> torch.Tensor:
    """Rank-major local order (the ranks' shards concatenated) to global positions."""
    order = gather_order(x.shape[dim], world, sharding)
    inverse = [0] * len(order)
    for local, position in enumerate(order):
        inverse[position] = local
    return _reordered(x, dim, inverse)


def shard_torch(x: torch.Tensor, group: Group = None, sharding: str = "zigzag", seq_axis: int = 2) -> torch.Tensor:
    """This rank's shard of the whole tensor ``x`` along ``seq_axis``: its chunks concatenated (§14)."""
    world, rank = _world(group)
    spans = rank_spans(x.shape[seq_axis], world, rank, _sharding(sharding), "x")
    return torch.cat([x.narrow(seq_axis, span.start, len(span)) for span in spans], seq_axis)


def unshard_torch(
    x_local: torch.Tensor, group: Group = None, sharding: str = "zigzag", seq_axis: int = 2
) -> torch.Tensor:
    """The whole tensor from every rank's shard (a collective; differentiable): the inverse of :func:`shard_torch`."""
    world, _ = _world(group)
    return _to_global_order(_gathered(x_local, group, seq_axis), seq_axis, world, _sharding(sharding))


# ---------------------------------------------------------------------------------------------------------------------
# Validation, and agreement across ranks before any data moves


def _sharding(value: str) -> Sharding:
    try:
        return Sharding(value)
    except ValueError:
        raise InvalidInputError(
            f"sharding is {value!r}, expected one of {', '.join(repr(s.value) for s in Sharding)}"
        ) from None


def _strategy(value: str) -> Strategy:
    try:
        return Strategy(value)
    except ValueError:
        raise InvalidInputError(
            f"strategy is {value!r}, expected one of {', '.join(repr(s.value) for s in Strategy)}"
        ) from None


def _describe(name: str, x: Any) -> dict[str, Any]:
    """What the ranks must agree on about one argument: kind, shape, dtype, device type (and lengths' values)."""
    if x is None:
        return {name: None}
    if not isinstance(x, torch.Tensor):
        raise InvalidInputTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    facts: dict[str, Any] = {f"{name} shape": tuple(x.shape), f"{name} dtype": str(x.dtype)}
    facts[f"{name} device type"] = x.device.type
    if name.endswith("lengths") and x.ndim == 1 and not x.is_floating_point():
        facts[f"{name} values"] = x.tolist()  # global lengths: the same on every rank
    return facts


def _agree(
    group: Group, world: int, rank: int, describe: Callable[[], tuple[dict[str, Any], Any]]
) -> tuple[dict[str, Any], Any]:
    """Each rank's ``describe()`` (or the typed error it raised), exchanged: an error on any rank, or a fact that
    differs between ranks, raises the same typed error on every rank, so none is left waiting in a collective.
    ``describe()`` returns (facts, offer): rank 0's offer is returned to every rank (a value each rank drew alike,
    such as a dropout seed, which must then be one value)."""
    error: tuple[str, str] | None = None
    facts: dict[str, Any] = {}
    offer = None
    try:
        facts, offer = describe()
    except Exception as raised:  # any failure here must reach the other ranks, or they wait in the exchange below
        known = isinstance(raised, errors.AttnkitError)
        error = (type(raised).__name__, str(raised) if known else f"{type(raised).__name__}: {raised}")
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (error, facts, offer), group=group)
    for other, (reported, _, _) in enumerate(everyone):
        if reported is not None:
            kind, message = reported
            cls = getattr(errors, kind, None)
            cls = cls if isinstance(cls, type) and issubclass(cls, errors.AttnkitError) else InvalidInputError
            prefix = "" if other == rank else f"on rank {other} of {world}: "
            raise cls(f"{prefix}{message}" + ("" if other == rank else " (every rank of the group raises)"))
    for other, (_, theirs, _) in enumerate(everyone):
        for key in [*facts, *(key for key in theirs if key not in facts)]:  # q's facts first
            mine, given = facts.get(key), theirs.get(key)
            if mine != given:
                cls = InvalidInputTypeError if key.endswith(("dtype", "device type")) else InvalidInputError
                raise cls(
                    f"{key} differs across ranks: rank {rank} has {mine}, rank {other} has {given}; every rank of the "
                    "group must pass shards of the same call"
                )
    return facts, everyone[0][2]


@dataclass(frozen=True)
class _Call:
    """One sharded call, as every rank agreed on it."""

    spec: AttentionSpec
    group: Group
    world: int
    rank: int
    sharding: Sharding
    seq_axis: int  # of q, k, v and out in the spec's layout
    len_q: int  # global lengths of the sequence axes
    len_k: int
    q_lengths: torch.Tensor | None
    kv_lengths: torch.Tensor | None
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    backend: str
    alibi_slopes: torch.Tensor | None  # as given: (Hq,) or (B, Hq), float32, the same on every rank
    mask_mod: Callable[..., Any] | None = None  # §17, on global positions: the same program on every rank
    dropout: Dropout | None = None  # §18, the global call's: one seed on every rank

    @property
    def chunk_q(self) -> int:
        return chunk_size("q", self.len_q, self.world, self.sharding)

    @property
    def chunk_k(self) -> int:
        return chunk_size("k", self.len_k, self.world, self.sharding)

    def q_spans(self) -> tuple[range, ...]:
        return rank_spans(self.len_q, self.world, self.rank, self.sharding, "q")

    def k_spans(self, rank: int) -> tuple[range, ...]:
        return rank_spans(self.len_k, self.world, rank, self.sharding, "k")

    @property
    def hops(self) -> int:
        """How far the ring carries K/V (``sharding.ring_hops``)."""
        has_lengths = self.q_lengths is not None or self.kv_lengths is not None
        return ring_hops(self.spec, self.len_q, self.len_k, self.world, self.sharding, has_lengths)


def _validated(
    spec: AttentionSpec,
    tensors: dict[str, Any],
    group: Group,
    strategy: Strategy | str,
    sharding: Sharding | str,
    backend: str,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    mask_mod: Callable[..., Any] | None = None,
    dropout: tuple[Any, Any, Any] = (0.0, None, None),
) -> _Call:
    """The call every rank agreed on. ``dropout``: (dropout_p, dropout_seed, dropout_key) as given; a seed not given
    is drawn on every rank (each rank's generator advancing as one call's would) and rank 0's is used."""
    world, rank = _world(group)
    checked: Dropout | None = None

    def describe() -> tuple[dict[str, Any], Any]:
        nonlocal checked
        if type(spec) is not AttentionSpec:
            raise InvalidInputTypeError(f"spec must be an attnkit.AttentionSpec, got {type(spec).__name__}")
        facts: dict[str, Any] = {"spec": spec.model_dump_json(), "strategy": _strategy(strategy).value}
        facts.update(sharding=_sharding(sharding).value, backend=backend)
        for name, tensor in {**tensors, "sinks": sinks, "alibi_slopes": alibi_slopes}.items():
            facts.update(_describe(name, tensor))
        q, k = tensors["q"], tensors["k"]
        if q.ndim != 4 or k.ndim != 4:
            raise InvalidInputError(
                f"q is {q.ndim}-D and k {k.ndim}-D: attnkit.distributed.attend takes 4-D q, k, v (the spec's layout)"
            )
        if sinks is not None:
            check_sinks(ops_for(q), spec, q, sinks)
        if alibi_slopes is not None:  # its values too: a negative slope on one rank raises on every rank
            heads_q = q.shape[2 if spec.layout is Layout.BSHD else 1]
            checked_slopes(ops_for(q), alibi_slopes, q.shape[0], heads_q, ops_for(q).device(q), check_values=True)
        facts["mask_mod"] = None if mask_mod is None else _global_program(spec, q, k, world, mask_mod)
        p, seed, key = dropout
        checked = checked_dropout(ops_for(q), p, seed, key, q)
        facts["dropout_p"] = checked_probability(p)
        if checked is None:
            return facts, None
        if seed is None:  # drawn: rank 0's is used
            return facts, _unsigned(checked.seed)
        facts["dropout_seed"] = _unsigned(checked.seed)  # given: the same value on every rank
        return facts, None

    facts, drawn = _agree(group, world, rank, describe)
    if checked is not None and drawn is not None:  # rank 0's draw, on every rank
        checked = checked._replace(seed=ops_for(tensors["q"]).dropout_seed(drawn, None, tensors["q"]))
    # From here on every check reads agreed facts only: it raises alike on every rank, with no further exchange.
    strategy, sharding = _strategy(strategy), _sharding(sharding)
    q, k = tensors["q"], tensors["k"]
    seq_axis = 1 if spec.layout is Layout.BSHD else 2
    len_q, len_k = q.shape[seq_axis] * world, k.shape[seq_axis] * world
    chunk_size("q", len_q, world, sharding)
    chunk_size("k", len_k, world, sharding)
    heads_axis = 3 - seq_axis
    if strategy is Strategy.ULYSSES:
        heads_q, heads_kv = q.shape[heads_axis], k.shape[heads_axis]
        if heads_q % world or heads_kv % world:
            raise InvalidInputError(
                f"strategy 'ulysses' splits the heads across the {world} ranks: Hq={heads_q} and Hkv={heads_kv} must "
                f"both be multiples of {world}; use 'ring' or 'allgather'"
            )
        if tensors["mask"] is not None or tensors["bias"] is not None:
            raise InvalidInputError(
                "strategy 'ulysses' does not take mask or bias yet (they would need an all-to-all of their own); "
                "use 'ring' or 'allgather'"
            )
    for name in ("mask", "bias"):  # as attend broadcasts them: leading axes of size 1 (blocks slice 4-D ones)
        x = tensors[name]
        if x is not None and x.ndim < 4:
            tensors = {**tensors, name: x[(None,) * (4 - x.ndim)]}
    _check_global_call(spec, tensors, seq_axis, len_q, len_k, facts)
    return _Call(spec, group, world, rank, sharding, seq_axis, len_q, len_k, tensors["q_lengths"],
                 tensors["kv_lengths"], tensors["mask"], tensors["bias"], backend, alibi_slopes, mask_mod,
                 checked)  # fmt: skip


def _unsigned(seed: torch.Tensor) -> int:
    """A torch dropout seed's 64 bits read unsigned (§18), as a Python int the ranks can compare."""
    return int(seed) % (1 << 64)


def _global_program(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, world: int, mask_mod: Any) -> str:
    """``mask_mod`` bound to the global call (traced, its captured tensors checked, its integers within int32 over
    every global position), as the ranks compare it: the program and its captured tensors' shapes and dtypes."""
    seq_axis = 1 if spec.layout is Layout.BSHD else 2
    heads_q = q.shape[3 - seq_axis]
    bound = programs.bind(mask_mod, ops_for(q), q, q.shape[0], heads_q, q.shape[seq_axis] * world,
                          k.shape[seq_axis] * world)  # fmt: skip
    return f"{bound.program} over {[(c.shape, c.dtype) for c in bound.program.captured]}"


def _check_global_call(
    spec: AttentionSpec,
    tensors: dict[str, Any],
    seq_axis: int,
    len_q: int,
    len_k: int,
    facts: dict[str, Any],
) -> None:
    """attend's own checks on the global call, run on meta tensors of its shapes (no data is read): every rank
    raises alike. Local shapes must be the global ones with the sequence axes cut (rows of mask/bias: local)."""

    local_q = tensors["q"].shape[seq_axis]
    global_lengths = {"q": (seq_axis, len_q), "k": (seq_axis, len_k), "v": (seq_axis, len_k),
                      "q_segment_ids": (1, len_q), "kv_segment_ids": (1, len_k),
                      "mask": (2, len_q), "bias": (2, len_q)}  # fmt: skip

    def global_shape(name: str) -> torch.Tensor | None:
        x = tensors[name]
        if x is None:
            return None
        shape = list(x.shape)
        if name in global_lengths and len(shape) > global_lengths[name][0]:
            axis, length = global_lengths[name]
            if name in ("mask", "bias") and shape[axis] not in (1, local_q):
                raise InvalidInputError(
                    f"{name} has shape {tuple(x.shape)}: its query axis must hold this rank's {local_q} queries (or "
                    f"1) and its key axis all {len_k} keys in global order"
                )
            shape[axis] = length if shape[axis] != 1 or name not in ("mask", "bias") else 1
        return torch.empty(shape, dtype=x.dtype, device="meta")

    metas = {name: global_shape(name) for name in tensors}
    prepare(spec, metas["q"], metas["k"], metas["v"], metas["mask"], metas["bias"], metas["q_lengths"],
            metas["kv_lengths"], True, metas["q_segment_ids"], metas["kv_segment_ids"], check_values=False)  # fmt: skip
    for name, limit in (("q_lengths", len_q), ("kv_lengths", len_k)):
        values = facts.get(f"{name} values") or []
        if any(not 0 <= value <= limit for value in values):
            raise InvalidInputError(f"{name} are {values}, expected global lengths in [0, {limit}]")


# ---------------------------------------------------------------------------------------------------------------------
# Blocks and their merge


@dataclass(frozen=True)
class _KeyShard:
    """One rank's keys as they travel: its k, v (and kv segment ids) shards and their global positions."""

    k: torch.Tensor
    v: torch.Tensor
    segment_ids: torch.Tensor | None
    spans: tuple[range, ...]

    def chunks(self, call: _Call) -> Iterator[tuple[range, slice]]:
        """(global span, local slice) of each chunk."""
        for index, span in enumerate(self.spans):
            yield span, slice(index * call.chunk_k, (index + 1) * call.chunk_k)


def _clipped(lengths: torch.Tensor | None, span: range) -> torch.Tensor | None:
    """Global lengths seen from a chunk: how many of its positions are real."""
    return None if lengths is None else (lengths - span.start).clamp(0, len(span))


def _element_offsets(call: _Call, q_span: range, k_span: range, offset: int, device: torch.device) -> Any:
    """The block's offset c (``Block.offset``) as (B|1, 1, 1, 1): per batch element where bottom-right follows the
    lengths, off_b = kv_len_b − q_len_b (§4.3) shifted by the block's place like the plan's offset."""
    per_element = call.spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT and (
        call.q_lengths is not None or call.kv_lengths is not None
    )
    if not per_element:
        return torch.tensor(offset, device=device).view(1, 1, 1, 1)
    kv_len = call.kv_lengths if call.kv_lengths is not None else torch.tensor(call.len_k, device=device)
    q_len = call.q_lengths if call.q_lengths is not None else torch.tensor(call.len_q, device=device)
    return ((kv_len.long() - q_len.long()).to(device) - (k_span.start - q_span.start)).view(-1, 1, 1, 1)


def _band_mask(
    call: _Call, q_span: range, k_span: range, offset: int, band: tuple[int | None, int | None], device: torch.device
) -> Any:
    """(B|1, 1, chunk q, chunk k) boolean: §4's band on global positions, rel = j − i − off_b in block indices."""
    rows = torch.arange(len(q_span), device=device).view(-1, 1)
    cols = torch.arange(len(k_span), device=device).view(1, -1)
    return within_band(cols - rows - _element_offsets(call, q_span, k_span, offset, device), *band)


def _segment_range(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per batch element, the least and greatest non-negative id (lo > hi when every position is padding)."""
    real = ids >= 0
    lo = torch.where(real, ids, torch.iinfo(ids.dtype).max).amin(1)
    return lo, torch.where(real, ids, -1).amax(1)


def _segments_meet(q_ids: torch.Tensor, kv_ids: Any) -> bool:
    """Whether some query of a block may share a segment with some key of it, by id ranges per batch element (§4.5):
    a block of other documents only, or of padding, is skipped like a hidden one."""
    (q_lo, q_hi), (k_lo, k_hi) = _segment_range(q_ids), _segment_range(kv_ids)
    return bool(((q_lo <= k_hi) & (k_lo <= q_hi)).any())


def _HIDDEN(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """What :func:`_block_program` gives for a block the program hides whole (never called)."""
    raise AssertionError("a hidden block is not computed")


def _block_program(call: _Call, q: torch.Tensor, q_span: range, k_span: range) -> Callable[..., Any] | None:
    """The call's program at the block's global positions (0-d offsets it captures), :func:`_HIDDEN` where it sees
    no pair of the block (its tile classes, the block one tile), None without a program."""
    if call.mask_mod is None:
        return None
    device = q.device
    mask_mod = at_global_positions(
        call.mask_mod,
        torch.tensor(q_span.start, dtype=torch.int32, device=device),
        torch.tensor(k_span.start, dtype=torch.int32, device=device),
    )
    batch, heads = q.shape[0], q.shape[3 - call.seq_axis]
    rows, cols = len(q_span), len(k_span)
    bound = programs.bind(mask_mod, ops_for(q), q, batch, heads, rows, cols)
    classes = tile_classes(bound, batch, heads, rows, cols, rows, cols, q)
    return _HIDDEN if bool((classes == EMPTY).all()) else mask_mod


def _block(
    call: _Call, q: torch.Tensor, q_span: range, q_rows: slice, q_ids: torch.Tensor | None, keys: _KeyShard,
    k_span: range, k_cols: slice, bias: torch.Tensor | None,
) -> Partial | None:  # fmt: skip
    """The (queries ``q_span`` × keys ``k_span``) block as a local attend call, or None when nothing is visible.
    ``q`` is the query chunk; ``q_rows`` its rows in the local tensors (mask, bias), ``k_cols`` the key chunk's in
    ``keys``. ``bias``: the call's bias, or a leaf standing for it (the ring's backward)."""
    spec = call.spec
    has_lengths = call.q_lengths is not None or call.kv_lengths is not None
    plan = block_plan(spec, q_span, k_span, call.len_q, call.len_k, has_lengths)
    kv_ids = keys.segment_ids[:, k_cols] if keys.segment_ids is not None else None
    if plan.kind is BlockKind.HIDDEN or (q_ids is not None and not _segments_meet(q_ids, kv_ids)):
        return None
    mask_mod = _block_program(call, q, q_span, k_span)
    if mask_mod is _HIDDEN:
        return None
    if _traffic is not None:
        _traffic.blocks += 1
    side = None
    if call.alibi_slopes is not None:  # the plan's spec may be realigned to make the block's offset native
        plan, side = alibi_plan(plan, len(q_span), len(k_span), has_lengths)
    columns = slice(k_span.start, k_span.stop)
    masked = plan.kind is BlockKind.MASKED
    band = _band_mask(call, q_span, k_span, plan.offset, plan.band, q.device) if masked else None
    mask = conjoin(band, block_of(call.mask, q_rows, columns) if call.mask is not None else None)
    bias = block_of(bias, q_rows, columns) if bias is not None else None
    axis = call.seq_axis
    k, v = keys.k.narrow(axis, k_cols.start, len(k_span)), keys.v.narrow(axis, k_cols.start, len(k_span))

    def attended(mask: Any, bias: Any, alibi_slopes: Any) -> Partial:
        return local_attend(  # type: ignore[no-any-return]
            plan.spec, q, k, v, mask=mask, bias=bias, q_lengths=_clipped(call.q_lengths, q_span),
            kv_lengths=_clipped(call.kv_lengths, k_span), q_segment_ids=q_ids, kv_segment_ids=kv_ids,
            return_lse=True, backend=call.backend, alibi_slopes=alibi_slopes, mask_mod=mask_mod,
            **dropout_at(call.dropout, queries=q_span.start, keys=k_span.start),
        )  # fmt: skip

    if side is None or side is AlibiSide.NATIVE:
        return attended(mask, bias, call.alibi_slopes)
    parts = []
    assert call.alibi_slopes is not None
    dtype = compute_dtype(q.dtype)
    slope = call.alibi_slopes.to(dtype).view(-1, call.alibi_slopes.shape[-1], 1, 1)  # (B|1, Hq, 1, 1)
    rows = torch.arange(len(q_span), device=q.device, dtype=dtype).view(-1, 1)
    cols = torch.arange(len(k_span), device=q.device, dtype=dtype).view(1, -1)
    offset = _element_offsets(call, q_span, k_span, plan.offset, q.device)
    for side_mask, key_bias, row_constant in alibi_sides(side, slope, rows, cols, offset):
        out, lse = attended(conjoin(mask, side_mask), key_bias if bias is None else bias + key_bias, None)
        parts.append((out, lse + row_constant.to(lse.dtype)))  # −inf (nothing seen) stays −inf
    return parts[0] if len(parts) == 1 else _merge(call, parts, _empty_like(call, q, v))


def _weights(lse_part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(lse_s − lse): a part with no visible key, or a row with none at all, weighs exactly 0 (never NaN)."""
    safe = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    return torch.exp(lse_part - safe)


def _per_row(call: _Call, x: torch.Tensor) -> torch.Tensor:
    """A (B, H, L) row quantity broadcast against out in the spec's layout."""
    return (x.transpose(1, 2) if call.seq_axis == 1 else x).unsqueeze(-1)


def _merge(call: _Call, parts: list[Partial], empty: Callable[[], Partial]) -> Partial:
    """§6's merge of one query chunk's blocks, differentiable: out in the accumulation dtype, lse float32."""
    if not parts:
        return empty()
    lses = torch.stack([lse for _, lse in parts])
    top = lses.amax(0).detach()  # cancels; made finite so that empty rows stay −inf without NaN
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    total = torch.exp(lses - top).sum(0)
    has_keys = total != 0  # NaN counts as having keys: NaN in, NaN out
    lse = torch.where(has_keys, top + torch.log(torch.where(has_keys, total, torch.ones_like(total))), -torch.inf)
    out = torch.stack([_per_row(call, _weights(part_lse, lse)) * part_out for part_out, part_lse in parts]).sum(0)
    return out, lse


def _empty_like(call: _Call, q: torch.Tensor, v: torch.Tensor) -> Callable[[], Partial]:
    """A query chunk that sees no key: out 0, lse −inf."""

    def empty() -> Partial:
        shape = list(q.shape)
        shape[-1] = v.shape[-1]
        heads = q.shape[3 - call.seq_axis]
        lse = torch.full((q.shape[0], heads, q.shape[call.seq_axis]), -torch.inf, device=q.device)
        return torch.zeros(shape, dtype=compute_dtype(q.dtype), device=q.device), lse

    return empty


def _query_chunks(call: _Call, q: torch.Tensor, q_ids: torch.Tensor | None) -> Iterator[tuple[range, slice, Any, Any]]:
    """(global span, local rows, q chunk, q segment ids chunk) of each of this rank's query chunks."""
    for index, span in enumerate(call.q_spans()):
        rows = slice(index * call.chunk_q, (index + 1) * call.chunk_q)
        ids = q_ids[:, rows] if q_ids is not None else None
        yield span, rows, q.narrow(call.seq_axis, rows.start, len(span)), ids


def _attend_blocks(
    call: _Call, q: torch.Tensor, q_ids: torch.Tensor | None, key_shards: Sequence[_KeyShard], bias: Any
) -> Partial:
    """This rank's queries against every key of ``key_shards``, merged: (out in q's dtype, lse)."""
    outs, lses, visible = [], [], False
    for q_span, rows, q_chunk, ids in _query_chunks(call, q, q_ids):
        parts = [
            part
            for keys in key_shards
            for k_span, cols in keys.chunks(call)
            if (part := _block(call, q_chunk, q_span, rows, ids, keys, k_span, cols, bias)) is not None
        ]
        visible = visible or bool(parts)
        out, lse = _merge(call, parts, _empty_like(call, q_chunk, key_shards[0].v))
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs, call.seq_axis).to(q.dtype), torch.cat(lses, 2)
    if not visible:  # still functions of the inputs (zero gradients), so that this rank's backward joins the
        # collectives of the others' (the gathered keys'); where() takes nothing from the side it does not select.
        inputs = [q, bias, *(x for keys in key_shards for x in (keys.k, keys.v))]
        anchor = sum(x.sum() for x in inputs if x is not None)
        never = torch.zeros((), dtype=torch.bool, device=out.device)
        out, lse = torch.where(never, anchor.to(out.dtype), out), torch.where(never, anchor.to(lse.dtype), lse)
    return out, lse


# ---------------------------------------------------------------------------------------------------------------------
# Strategies


def _allgather(call: _Call, q: Any, k: Any, v: Any, q_ids: Any, kv_ids: Any) -> Partial:
    """K and V (and kv segment ids) all-gathered; the rank's queries against every chunk, by autograd throughout."""
    axis = call.seq_axis
    every_k, every_v = _gathered(k, call.group, axis), _gathered(v, call.group, axis)
    every_ids = _gathered(kv_ids, call.group, 1) if kv_ids is not None else None
    shards, size = [], k.shape[axis]
    for rank in range(call.world):
        ids = every_ids[:, rank * size : (rank + 1) * size] if every_ids is not None else None
        local = slice(rank * size, (rank + 1) * size)
        shards.append(
            _KeyShard(
                every_k.narrow(axis, local.start, size),
                every_v.narrow(axis, local.start, size),
                ids,
                call.k_spans(rank),
            )  # fmt: skip
        )
    return _attend_blocks(call, q, q_ids, shards, call.bias)


def _ulysses(call: _Call, q: Any, k: Any, v: Any, q_ids: Any, kv_ids: Any) -> Partial:
    """Sequence shards to head shards (all-to-all), one whole-sequence attend call, and back."""
    seq, heads, group, world = call.seq_axis, 3 - call.seq_axis, call.group, call.world

    def heads_of(x: torch.Tensor) -> torch.Tensor:
        return _to_global_order(_AllToAll.apply(x, group, heads, seq), seq, world, call.sharding)

    def everywhere(ids: torch.Tensor | None) -> torch.Tensor | None:
        return None if ids is None else _to_global_order(_gathered(ids, group, 1), 1, world, call.sharding)

    slopes = call.alibi_slopes
    if slopes is not None:  # this rank's query heads, as the all-to-all hands them out: the r-th of P equal groups
        heads_here = slopes.shape[-1] // world
        slopes = slopes[..., call.rank * heads_here : (call.rank + 1) * heads_here]
    # The whole sequence in global order; this rank's query heads are the r-th of P groups.
    first_head = q.shape[heads] // world * call.rank
    mask_mod = call.mask_mod
    if mask_mod is not None:
        mask_mod = at_global_positions(mask_mod, h_start=torch.tensor(first_head, dtype=torch.int32, device=q.device))
    out, lse = local_attend(
        call.spec, heads_of(q), heads_of(k), heads_of(v),
        q_lengths=call.q_lengths, kv_lengths=call.kv_lengths,
        q_segment_ids=everywhere(q_ids), kv_segment_ids=everywhere(kv_ids),
        return_lse=True, backend=call.backend, alibi_slopes=slopes, mask_mod=mask_mod,
        **dropout_at(call.dropout, heads=first_head),
    )  # fmt: skip
    order = gather_order(call.len_q, world, call.sharding)
    out = _AllToAll.apply(_reordered(out, seq, order), group, seq, heads)
    lse = _AllToAll.apply(_reordered(lse, 2, order), group, 2, 1)
    return out, lse


def _shifted(
    call: _Call, tensors: Sequence[torch.Tensor], what: str, distance: int = 1
) -> tuple[list[torch.Tensor], list[Any]]:
    """Post sending ``tensors`` to the rank ``distance`` ahead on the ring and receiving those of the rank as far
    behind: (buffers, requests). A shift by a multiple of the ring (a ring of one rank) moves nothing."""
    if distance % call.world == 0:
        return list(tensors), []
    _note_sent(what, sum(t.nbytes for t in tensors))
    following = _global_rank(call.group, (call.rank + distance) % call.world)
    preceding = _global_rank(call.group, (call.rank - distance) % call.world)
    buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    operations = [dist.P2POp(dist.isend, t.contiguous(), following, call.group) for t in tensors]
    operations += [dist.P2POp(dist.irecv, buffer, preceding, call.group) for buffer in buffers]
    return buffers, dist.batch_isend_irecv(operations)


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _ring_steps(
    call: _Call, k: torch.Tensor, v: torch.Tensor, kv_ids: Any, phase: str
) -> Iterator[tuple[_KeyShard, Callable]]:
    """The ring: at step s this rank holds the keys of rank r − s, for s up to ``call.hops`` (no rank needs keys from
    further behind); the next step's transfer is posted before the caller computes on them (``finish()`` waits for
    it)."""
    keys = [k, v] + ([kv_ids] if kv_ids is not None else [])
    for step in range(call.hops + 1):
        source = (call.rank - step) % call.world
        pending = _shifted(call, keys, f"ring k/v ({phase})") if step < call.hops else None
        posted = time.perf_counter()
        held = _KeyShard(keys[0], keys[1], keys[2] if kv_ids is not None else None, call.k_spans(source))

        def finish(pending: Any = pending, posted: float = posted) -> None:
            nonlocal keys
            if pending is not None:
                buffers, requests = pending
                _waited_for(f"k/v ({phase})", requests, posted)
                keys = buffers

        yield held, finish


def _merged_into(call: _Call, running: Partial | None, part: Partial) -> Partial:
    """§6's merge of one more block into a query chunk's running (out float32, lse), in place: the ring's forward,
    where no gradient flows, holds one partial per query chunk and no stack of them."""
    part_out, part_lse = part
    if running is None:
        return part_out.to(compute_dtype(part_out.dtype), memory_format=torch.contiguous_format, copy=True), part_lse
    out, lse = running
    merged_lse = torch.logaddexp(lse, part_lse)
    out.mul_(_per_row(call, _weights(lse, merged_lse))).addcmul_(
        _per_row(call, _weights(part_lse, merged_lse)), part_out
    )
    return out, merged_lse


def _ring_forward(call: _Call, q: Any, k: Any, v: Any, q_ids: Any, kv_ids: Any) -> Partial:
    chunks = list(_query_chunks(call, q, q_ids))
    running: list[Partial | None] = [None] * len(chunks)
    for keys, finish in _ring_steps(call, k, v, kv_ids, "forward"):
        for index, (q_span, rows, q_chunk, ids) in enumerate(chunks):
            for k_span, cols in keys.chunks(call):
                part = _block(call, q_chunk, q_span, rows, ids, keys, k_span, cols, call.bias)
                if part is not None:
                    running[index] = _merged_into(call, running[index], part)
        finish()
    results = [merged or _empty_like(call, chunk, v)() for merged, (_, _, chunk, _) in zip(running, chunks)]
    return torch.cat([out for out, _ in results], call.seq_axis).to(q.dtype), torch.cat([lse for _, lse in results], 2)


class _Ring(torch.autograd.Function):
    """The ring, with a backward that runs the ring again: each block is recomputed and pulled back from its share of
    the merged cotangents, dq accumulating here and dk/dv following their keys round the ring back to their rank,
    each step's sum in flight while the next step computes:

        w_s = exp(lse_s − lse);  d out_s = w_s · dout;  d lse_s = w_s · (dlse + ⟨dout, out_s − out⟩)
    """

    @staticmethod
    def forward(ctx: Any, call: _Call, q: Any, k: Any, v: Any, bias: Any, q_ids: Any, kv_ids: Any) -> Partial:  # type: ignore[override]
        with torch.no_grad():
            out, lse = _ring_forward(call, q, k, v, q_ids, kv_ids)
        ctx.call = call
        ctx.save_for_backward(q, k, v, bias, q_ids, kv_ids, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        call: _Call = ctx.call
        q, k, v, bias, q_ids, kv_ids, out, lse = ctx.saved_tensors
        accumulate = compute_dtype(q.dtype)
        want_bias = bias is not None and ctx.needs_input_grad[4]
        dq = torch.zeros_like(q, dtype=accumulate)
        dbias = torch.zeros_like(bias, dtype=accumulate) if want_bias else None
        if dlse is None:
            dlse = torch.zeros_like(lse)
        dlse = torch.where(torch.isneginf(lse), torch.zeros_like(dlse), dlse)  # an empty row's lse takes none
        arriving: tuple[list[torch.Tensor], list[Any], float] | None = None  # the preceding rank's sum of dk/dv
        # for the keys held now, in flight
        for step, (keys, finish) in enumerate(_ring_steps(call, k, v, kv_ids, "backward")):
            dkv = [torch.zeros_like(k, dtype=accumulate), torch.zeros_like(v, dtype=accumulate)]
            for query, key in _backward_pieces(call, q, q_ids, keys):
                _block_backward(call, query, keys, key, (out, lse, dout, dlse), (dq, dkv, bias, dbias))
            finish()
            if arriving is not None:  # (read in place: a name bound to its buffers would keep them a step longer)
                _waited_for("dk/dv", arriving[1], arriving[2])
                for mine, theirs in zip(dkv, arriving[0]):
                    mine.add_(theirs)
            # The sum follows the keys to the next rank, which adds its share at its next step; after the last step
            # it goes home to the keys' rank, ``hops`` behind (the next rank when the ring went all the way round).
            distance = 1 if step < call.hops else -call.hops
            arriving = (*_shifted(call, dkv, "ring dk/dv", distance), time.perf_counter())
        assert arriving is not None  # a ring has at least one step
        dkv, requests, posted = arriving
        _waited_for("dk/dv", requests, posted)
        return None, dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dbias, None, None


#: The ring's backward recomputes each block in pieces of at most this many queries and keys: a recompute holds
#: temporaries of its block's size (its out, the cotangents, the backend's own), which for whole chunks outweighed
#: the K/V buffers (docs/performance.md, context parallelism).
_BACKWARD_PIECE = 512


def _pieces(span: range, local: slice, limit: int) -> Iterator[tuple[range, slice]]:
    """(global span, local slice) of consecutive pieces of a chunk, at most ``limit`` positions each."""
    for start in range(0, len(span), limit):
        stop = min(start + limit, len(span))
        yield range(span.start + start, span.start + stop), slice(local.start + start, local.start + stop)


def _backward_pieces(
    call: _Call, q: torch.Tensor, q_ids: torch.Tensor | None, keys: _KeyShard
) -> Iterator[tuple[tuple, tuple[range, slice]]]:
    """((q piece, its span, its local rows, its ids), (key span, key columns)) of every piece of every block."""
    for q_span, rows, _, _ in _query_chunks(call, q, q_ids):
        for q_piece, piece_rows in _pieces(q_span, rows, _BACKWARD_PIECE):
            q_chunk = q.narrow(call.seq_axis, piece_rows.start, len(q_piece))
            ids = q_ids[:, piece_rows] if q_ids is not None else None
            for k_span, cols in keys.chunks(call):
                for key in _pieces(k_span, cols, _BACKWARD_PIECE):
                    yield (q_chunk, q_piece, piece_rows, ids), key


def _block_backward(call: _Call, query: tuple, keys: _KeyShard, key: tuple, merged: tuple, grads: tuple) -> None:
    """Recompute one block and add its share of the gradients into ``grads`` (dq, [dk, dv], bias, dbias)."""
    q_chunk, q_span, rows, ids = query
    k_span, cols = key
    out, lse, dout, dlse = merged
    dq, dkv, bias, dbias = grads
    axis = call.seq_axis
    q_leaf = q_chunk.detach().requires_grad_(True)
    # Leaves of the block's keys only: a leaf of the whole shard would take a whole-shard gradient per block.
    k_leaf, v_leaf = (x.narrow(axis, cols.start, len(k_span)).detach().requires_grad_(True) for x in (keys.k, keys.v))
    bias_leaf = bias.detach().requires_grad_(True) if dbias is not None else bias
    with torch.enable_grad():
        kv_ids = keys.segment_ids[:, cols] if keys.segment_ids is not None else None
        leaf_keys = _KeyShard(k_leaf, v_leaf, kv_ids, keys.spans)
        part = _block(call, q_leaf, q_span, rows, ids, leaf_keys, k_span, slice(0, len(k_span)), bias_leaf)
        if part is None:
            return
        part_out, part_lse = part
        row_lse, row_dlse = lse[:, :, rows], dlse[:, :, rows]
        row_out, row_dout = out.narrow(axis, rows.start, len(q_span)), dout.narrow(axis, rows.start, len(q_span))
        weight = _weights(part_lse.detach(), row_lse)
        inner = (row_dout.to(weight.dtype) * (part_out.detach() - row_out).to(weight.dtype)).sum(-1)
        if axis == 1:
            inner = inner.transpose(1, 2)
        lse_cotangent = weight * (row_dlse + inner)
        lse_cotangent = torch.where(torch.isneginf(part_lse.detach()), torch.zeros_like(lse_cotangent), lse_cotangent)
        finite_lse = torch.where(torch.isfinite(part_lse), part_lse, torch.zeros_like(part_lse))
        leaves = [q_leaf, k_leaf, v_leaf] + ([bias_leaf] if dbias is not None else [])
        found = torch.autograd.grad(
            (part_out, finite_lse),
            leaves,
            ((_per_row(call, weight) * row_dout).to(part_out.dtype), lse_cotangent),
            allow_unused=True,
        )
    if found[0] is not None:
        dq.narrow(axis, rows.start, len(q_span)).add_(found[0])
    for accumulator, grad in zip(dkv, found[1:3]):
        if grad is not None:
            accumulator.narrow(axis, cols.start, len(k_span)).add_(grad)
    if dbias is not None and found[3] is not None:
        dbias.add_(found[3])


def _ring(call: _Call, q: Any, k: Any, v: Any, q_ids: Any, kv_ids: Any) -> Partial:
    return _Ring.apply(call, q, k, v, call.bias, q_ids, kv_ids)


_STRATEGIES = {Strategy.RING: _ring, Strategy.ALLGATHER: _allgather, Strategy.ULYSSES: _ulysses}


def attend_torch(
    spec: AttentionSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Group = None,
    strategy: str = "ring",
    sharding: str = "zigzag",
    q_lengths: torch.Tensor | None = None,
    kv_lengths: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
    kv_segment_ids: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    mask_mod: Callable[..., Any] | None = None,
    dropout_p: float = 0.0,
    dropout_seed: Any = None,
    dropout_key: Any = None,
) -> Any:
    """§14 on torch tensors: this rank's shards in, this rank's shard of out (and lse) back. A collective: every rank
    of ``group`` calls it; a bad input on any rank raises a typed error on every rank. ``sinks`` join each local row
    once, after its blocks are merged (§15); ``alibi_slopes`` (§16) enter each block at its global distances;
    ``mask_mod`` (§17) sees global positions, and blocks it hides whole are not computed. Dropout (§18) keeps what the
    single-device call keeps: one seed on every rank (``dropout_seed`` the same on each, or drawn by rank 0)."""
    tensors = {"q": q, "k": k, "v": v, "q_lengths": q_lengths, "kv_lengths": kv_lengths, "q_segment_ids": q_segment_ids,
               "kv_segment_ids": kv_segment_ids, "mask": mask, "bias": bias}  # fmt: skip
    call = _validated(spec, tensors, group, strategy, sharding, backend, sinks, alibi_slopes, mask_mod,
                      (dropout_p, dropout_seed, dropout_key))  # fmt: skip
    out, lse = _STRATEGIES[_strategy(strategy)](call, q, k, v, q_segment_ids, kv_segment_ids)
    if sinks is not None:  # the local rows' global positions count q_lengths
        positions = torch.cat([torch.arange(span.start, span.stop, device=q.device) for span in call.q_spans()])
        out, lse = with_sinks(spec, out, lse, sinks, q_lengths, q_segment_ids, positions)
    return (out, lse) if return_lse else out
