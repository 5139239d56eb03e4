"""Context parallelism on JAX meshes (docs/semantics.md §14): attention over a sequence sharded along one mesh axis,
built on shard_map and its collectives (all_gather, ppermute, all_to_all), under jax.jit and jax.grad.

Inside the map each device holds its chunks of q, k and v (:mod:`attnkit.distributed.sharding`). A device's rank is a
traced value (``lax.axis_index``), so which block of the global call a (query chunk, key chunk) pair is — hidden, full,
aligned or masked — is read from a static table over every (query rank, key rank) pair built by
:func:`attnkit.distributed.sharding.block_plan`, and run with ``lax.switch`` among the few distinct plans: one traced
copy per plan, a hidden block really skipped at run time (only the taken branch executes), and the aligned blocks
keep the backends' own causal/window skipping. Masked blocks build their mask from traced global positions. Partial
results merge by lse (§6), exactly and differentiably (:func:`attnkit.contract.jax.merge_partials`):

    lse = logsumexp_s lse_s,    out = Σ_s exp(lse_s − lse) · out_s

``ring`` and ``allgather`` share that per-step visit of one rank's K/V chunks (a ``lax.scan`` over the P source
ranks): the ring receives them by ``ppermute`` (the next transfer issued before the current blocks run, so the two
can overlap; its backward is the reverse ppermute, derived by JAX), the all-gather slices them from gathered K/V.
``ulysses`` trades sequence shards for head shards with ``all_to_all`` and makes one whole-sequence call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as Spec

from attnkit import api, programs
from attnkit.backend import Dropout
from attnkit.contract import alignment_offset, conjoin
from attnkit.contract.jax import band_visibility, merge_partials
from attnkit.distributed.sharding import (
    AlibiSide,
    Block,
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
    rank_chunks,
    rank_spans,
    ring_hops,
)
from attnkit.errors import InvalidInputError
from attnkit.frontends import ops_for
from attnkit.sinks import check_sinks, with_sinks
from attnkit.spec import AttentionSpec, CausalAlignment, Layout
from attnkit.validation import checked_dropout, prepare

__all__ = ["attend_jax", "shard_jax", "unshard_jax"]


def _choice(enum: type[Sharding] | type[Strategy], name: str, value: Any) -> Any:
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in enum)
        raise InvalidInputError(f"{name}={value!r} is not one of {allowed}") from None


def _world(mesh: Any, axis_name: str) -> int:
    if axis_name not in mesh.shape:
        raise InvalidInputError(f"axis_name={axis_name!r} is not an axis of the mesh (axes: {tuple(mesh.shape)})")
    return int(mesh.shape[axis_name])


def _seq_spec(ndim: int, seq_axis: int, axis_name: str) -> Spec:
    return Spec(*(axis_name if axis == seq_axis else None for axis in range(ndim)))


def shard_jax(x: Any, mesh: Any, axis_name: str, sharding: str = "zigzag", seq_axis: int = 2) -> Any:
    """A whole array laid out for ``attend_jax(mesh=...)``: its sequence axis permuted to ``gather_order`` and placed
    on ``mesh`` so that device r of ``axis_name`` holds its chunks (rank r's local array, §14)."""
    world, kind = _world(mesh, axis_name), _choice(Sharding, "sharding", sharding)
    seq_axis %= x.ndim
    order = np.asarray(gather_order(x.shape[seq_axis], world, kind))
    placed = NamedSharding(mesh, _seq_spec(x.ndim, seq_axis, axis_name))
    return jax.device_put(jnp.take(x, order, axis=seq_axis), placed)


def unshard_jax(x: Any, mesh: Any, axis_name: str, sharding: str = "zigzag", seq_axis: int = 2) -> Any:
    """The inverse of :func:`shard_jax`: the sequence axis back in global order (for out, lse and gradients too)."""
    world, kind = _world(mesh, axis_name), _choice(Sharding, "sharding", sharding)
    seq_axis %= x.ndim
    order = gather_order(x.shape[seq_axis], world, kind)
    return jnp.take(x, np.argsort(order), axis=seq_axis)


def attend_jax(
    spec: AttentionSpec,
    q: Any,
    k: Any,
    v: Any,
    *,
    mesh: Any = None,
    axis_name: str,
    strategy: str = "ring",
    sharding: str = "zigzag",
    q_lengths: Any = None,
    kv_lengths: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    mask: Any = None,
    bias: Any = None,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: Any = None,
    alibi_slopes: Any = None,
    mask_mod: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: Any = None,
    dropout_key: Any = None,
) -> Any:
    """``attnkit.attend`` on a sequence sharded along mesh axis ``axis_name`` (§14), equal to the single-device call
    on the whole arrays in outputs and gradients; ``sinks`` (Hq,), replicated, join each row once after its blocks
    are merged (§15); ``alibi_slopes`` (Hq,) or (B, Hq), replicated, are ALiBi's at global distances (§16);
    ``mask_mod`` (§17) sees global positions (and under ulysses global heads), its captured arrays replicated;
    dropout (§18) keeps what the single-device call keeps, its ``dropout_seed`` or ``dropout_key`` replicated (the
    same on every device: inside a shard_map, not one drawn per device).

    With ``mesh``: q, k, v (and segment ids) are whole arrays laid out by :func:`shard_jax`; out and lse come back
    so laid out (:func:`unshard_jax` restores global order). Without: called inside the caller's shard_map over
    ``axis_name``, they are the device's local shards, and so are out and lse. Lengths are global, (B,), replicated."""
    for name, value in (("mask", mask), ("bias", bias)):
        if value is not None:
            raise InvalidInputError(
                f"{name} is not taken by attnkit.distributed.attend on JAX arrays yet (got one of shape "
                f"{tuple(value.shape)}); express the visibility with lengths or segment ids"
            )
    if mask_mod is not None:
        programs.check_arity(mask_mod)
    dropout = checked_dropout(ops_for(q, "q"), dropout_p, dropout_seed, dropout_key, q)
    config = _Config.make(
        spec, strategy, sharding, axis_name, backend, mask_mod, None if dropout is None else dropout.p
    )
    if sinks is not None:
        check_sinks(ops_for(q, "q"), spec, q, sinks)
    optional = {"q_lengths": q_lengths, "kv_lengths": kv_lengths, "q_ids": q_segment_ids, "kv_ids": kv_segment_ids,
                "sinks": sinks, "alibi_slopes": alibi_slopes,
                "dropout_seed": None if dropout is None else dropout.seed}  # fmt: skip
    if mesh is None:
        world = lax.axis_size(axis_name)
        # Local shards: metadata only (the lengths are global and traced here; attend checks each block's).
        prepare(spec, q, k, v, None, None, q_lengths, kv_lengths, return_lse, q_segment_ids, kv_segment_ids,
                alibi_slopes, check_values=False)  # fmt: skip
        out, lse = _attend_local(config, world, q, k, v, optional)
    else:
        world = _world(mesh, axis_name)
        prepare(spec, q, k, v, None, None, q_lengths, kv_lengths, return_lse, q_segment_ids, kv_segment_ids,
                alibi_slopes)  # fmt: skip
        out, lse = _attend_on_mesh(config, mesh, world, q, k, v, optional)
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class _Config:
    """What every device computes with: the spec, strategy, sharding, axis, backend, mask program (§17) and dropout
    probability (§18; its seed is an operand, ``optional["dropout_seed"]``)."""

    spec: AttentionSpec
    strategy: Strategy
    sharding: Sharding
    axis_name: str
    backend: str
    mask_mod: Any = None
    dropout_p: float | None = None

    @classmethod
    def make(
        cls, spec: AttentionSpec, strategy: str, sharding: str, axis_name: str, backend: str, mask_mod: Any = None,
        dropout_p: float | None = None,
    ) -> _Config:  # fmt: skip
        strategy_, sharding_ = _choice(Strategy, "strategy", strategy), _choice(Sharding, "sharding", sharding)
        return cls(spec, strategy_, sharding_, axis_name, backend, mask_mod, dropout_p)

    def block_program(self, q_start: Any = None, k_start: Any = None, h_start: Any = None) -> Any:
        """The mask program of one local call: global positions from the (traced) starts on."""
        if self.mask_mod is None:
            return None
        return at_global_positions(self.mask_mod, q_start, k_start, h_start)

    def block_dropout(self, seed: Any, heads: Any = 0, queries: Any = 0, keys: Any = 0) -> dict[str, Any]:
        """attend's dropout arguments for one local call: the global call's keep-mask from the (traced) starts on."""
        return dropout_at(None if self.dropout_p is None else Dropout(self.dropout_p, seed), heads, queries, keys)

    @property
    def seq_axis(self) -> int:
        return 2 if self.spec.layout is Layout.BHSD else 1

    @property
    def head_axis(self) -> int:
        return 3 - self.seq_axis


def _attend_on_mesh(
    config: _Config, mesh: Any, world: int, q: Any, k: Any, v: Any, optional: dict[str, Any]
) -> tuple[Any, Any]:
    """Form (a): shard_map over ``mesh``, each device its contiguous slice of the gather-ordered arrays."""
    seq_axis = 1 if q.ndim == 3 else config.seq_axis
    for name, x in (("q", q), ("k", k)):
        chunk_size(name, x.shape[seq_axis], world, config.sharding)
    present = {name: value for name, value in optional.items() if value is not None}
    sequence = _seq_spec(q.ndim, seq_axis, config.axis_name)
    specs = {"q_lengths": Spec(), "kv_lengths": Spec(), "q_ids": Spec(None, config.axis_name), "sinks": Spec(),
             "alibi_slopes": Spec(), "dropout_seed": Spec()}  # fmt: skip
    specs["kv_ids"] = specs["q_ids"]
    lse_spec = _seq_spec(q.ndim - 1, q.ndim - 2, config.axis_name)

    def local(q: Any, k: Any, v: Any, present: dict[str, Any]) -> tuple[Any, Any]:
        return _attend_local(config, world, q, k, v, {**optional, **present})

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(sequence, sequence, sequence, {name: specs[name] for name in present}),
        out_specs=(sequence, lse_spec),
    )
    return mapped(q, k, v, present)  # type: ignore[no-any-return]


def _attend_local(config: _Config, world: int, q: Any, k: Any, v: Any, optional: dict[str, Any]) -> tuple[Any, Any]:
    """One device's shards in, its shards of out and lse back; 3-D calls run as one head."""
    if q.ndim == 3:
        head_axis = config.head_axis
        q, k, v = (jnp.expand_dims(x, head_axis) for x in (q, k, v))
        out, lse = _attend_local(config, world, q, k, v, optional)
        return jnp.squeeze(out, head_axis), jnp.squeeze(lse, 1)
    out, lse = _merged(config, world, q, k, v, optional)
    if optional["sinks"] is None:
        return out, lse
    # Once per row, after the merge (§15); the local rows' global positions count q_lengths.
    local_q = q.shape[config.seq_axis]
    positions = np.stack([np.concatenate([np.arange(span.start, span.stop) for span in
                                          rank_spans(local_q * world, world, rank, config.sharding, "q")])
                          for rank in range(world)])  # fmt: skip
    return with_sinks(config.spec, out, lse, optional["sinks"], optional["q_lengths"], optional["q_ids"],
                      jnp.asarray(positions)[lax.axis_index(config.axis_name)])  # fmt: skip


def _merged(config: _Config, world: int, q: Any, k: Any, v: Any, optional: dict[str, Any]) -> tuple[Any, Any]:
    """One device's 4-D shards in, its shards of out and lse merged over every block back (§14)."""
    seq_axis, local_k = config.seq_axis, k.shape[config.seq_axis]
    geometry = _Geometry(config, world, q.shape[seq_axis] * world, local_k * world, optional)
    if config.strategy is Strategy.ULYSSES:
        return _ulysses(geometry, q, k, v)
    rank = lax.axis_index(config.axis_name)
    queries = geometry.split(q, optional["q_ids"])
    # Running (out float32, lse) per local query chunk, from nothing seen: out 0, lse −inf (full_like keeps the
    # chunk's device-varying type, which scan's carry must match).
    state = [
        (
            lax.full_like(chunk, 0, jnp.float32, (*chunk.shape[:-1], v.shape[-1])),
            lax.full_like(chunk, -jnp.inf, jnp.float32, geometry.lse_shape(chunk)),
        )
        for chunk, _ in queries
    ]
    held = (k, v, optional["kv_ids"])
    if config.strategy is Strategy.RING:
        ring = [(source, (source + 1) % world) for source in range(world)]

        def ring_step(carry: Any, step: Any) -> tuple[Any, None]:
            held, state = carry
            arriving = lax.ppermute(held, config.axis_name, ring)  # issued first: it may overlap this step's blocks
            return (arriving, geometry.visit(queries, rank, held, (rank - step) % world, state)), None

        # No device needs keys from further behind than `hops` (causal or a window may hide the rest).
        hops = ring_hops(config.spec, geometry.len_q, geometry.len_k, world, config.sharding, geometry.has_lengths)
        (held, state), _ = lax.scan(ring_step, (held, state), jnp.arange(hops))
        state = geometry.visit(queries, rank, held, (rank - hops) % world, state)  # the last arrival: no further send
    else:
        gathered = [
            None if x is None else lax.all_gather(x, config.axis_name, axis=axis, tiled=True)
            for x, axis in zip(held, (seq_axis, seq_axis, 1))
        ]

        def gather_step(state: Any, source: Any) -> tuple[Any, None]:
            own = [
                None if x is None else lax.dynamic_slice_in_dim(x, source * local_k, local_k, axis=axis)
                for x, axis in zip(gathered, (seq_axis, seq_axis, 1))
            ]
            return geometry.visit(queries, rank, own, source, state), None

        state, _ = lax.scan(gather_step, state, jnp.arange(world))
    outs, lses = zip(*state)
    return jnp.concatenate(outs, axis=seq_axis).astype(q.dtype), jnp.concatenate(lses, axis=2)


class _Geometry:
    """The global call as seen from one device: global lengths, chunk sizes, and for each (local query chunk, local
    key chunk) pair the distinct block plans over all (query rank, key rank) pairs with a table choosing among them."""

    def __init__(self, config: _Config, world: int, len_q: int, len_k: int, optional: dict[str, Any]):
        self.config, self.world, self.len_q, self.len_k = config, world, len_q, len_k
        sharding = config.sharding
        self.chunk_q = chunk_size("q", len_q, world, sharding)
        self.chunk_k = chunk_size("k", len_k, world, sharding)
        self.optional = optional
        self.q_lengths, self.kv_lengths = optional["q_lengths"], optional["kv_lengths"]
        self.has_lengths = has_lengths = self.q_lengths is not None or self.kv_lengths is not None
        self.per_element = has_lengths and config.spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT
        self.slopes = optional["alibi_slopes"]
        self.count = len(rank_chunks(world, 0, sharding))
        self.plans: dict[tuple[int, int], tuple[list[tuple[Block, AlibiSide | None]], np.ndarray]] = {}
        for q_chunk in range(self.count):
            for k_chunk in range(self.count):
                distinct: dict[Any, int] = {}
                blocks: list[tuple[Block, AlibiSide | None]] = []
                table = np.zeros((world, world), np.int32)
                for rank in range(world):
                    q_span = rank_spans(len_q, world, rank, sharding, "q")[q_chunk]
                    for source in range(world):
                        k_span = rank_spans(len_k, world, source, sharding, "k")[k_chunk]
                        block = block_plan(config.spec, q_span, k_span, len_q, len_k, has_lengths)
                        side = None
                        if self.slopes is not None:
                            block, side = alibi_plan(block, self.chunk_q, self.chunk_k, has_lengths)
                        # A masked block's mask, and a linear side's ALiBi, come from traced positions: one branch
                        # serves every offset.
                        key = block.kind if block.kind is BlockKind.HIDDEN else (block.kind, block.spec, side)
                        if key not in distinct:
                            distinct[key] = len(blocks)
                            blocks.append((block, side))
                        table[rank, source] = distinct[key]
                self.plans[q_chunk, k_chunk] = blocks, table

    def lse_shape(self, chunk: Any) -> tuple[int, int, int]:
        seq_axis = self.config.seq_axis
        return chunk.shape[0], chunk.shape[3 - seq_axis], chunk.shape[seq_axis]

    def split(self, x: Any, ids: Any) -> list[tuple[Any, Any]]:
        """A local array cut into its chunks, each with its segment ids (or None)."""
        chunks = jnp.split(x, self.count, axis=self.config.seq_axis)
        return list(zip(chunks, [None] * self.count if ids is None else jnp.split(ids, self.count, axis=1)))

    def visit(self, queries: list[tuple[Any, Any]], rank: Any, held: Any, source: Any, state: list[Any]) -> list[Any]:
        """Every block of this device's query chunks against ``source``'s key chunks ``held`` = (k, v, kv_ids),
        merged into the running (out, lse) of each query chunk."""
        k, v, kv_ids = held
        keys = self.split(k, kv_ids)
        values = jnp.split(v, self.count, axis=self.config.seq_axis)
        merged = []
        for q_chunk, ((q, q_ids), (out, lse)) in enumerate(zip(queries, state)):
            outs, lses = [out], [lse]
            for k_chunk, ((k_part, k_ids), v_part) in enumerate(zip(keys, values)):
                block_out, block_lse = self.block(q_chunk, k_chunk, rank, source, q, q_ids, k_part, v_part, k_ids)
                outs.append(block_out)
                lses.append(block_lse)
            merged.append(merge_partials(jnp.stack(outs), jnp.stack(lses), self.config.seq_axis))
        return merged

    def block(
        self, q_chunk: int, k_chunk: int, rank: Any, source: Any, q: Any, q_ids: Any, k: Any, v: Any, kv_ids: Any
    ) -> tuple[Any, Any]:
        """One (query chunk × key chunk) block of the global call as a local attend, its plan chosen by the traced
        ranks among the distinct plans this pair of local chunks can take."""
        blocks, table = self.plans[q_chunk, k_chunk]
        q_start = rank_chunks(self.world, rank, self.config.sharding)[q_chunk] * self.chunk_q
        k_start = rank_chunks(self.world, source, self.config.sharding)[k_chunk] * self.chunk_k
        operands = (q, k, v, q_ids, kv_ids, q_start, k_start)
        branches = [functools.partial(self._run, block, side) for block, side in blocks]

        def run(*operands: Any) -> tuple[Any, Any]:
            if len(branches) == 1:
                return branches[0](*operands)
            return lax.switch(jnp.asarray(table)[rank, source], branches, *operands)  # type: ignore[no-any-return]

        if q_ids is None:
            return run(*operands)
        # A block of other documents only, or of padding, is skipped like a hidden one (decided on the device).
        return lax.cond(  # type: ignore[no-any-return]
            _segments_meet(q_ids, kv_ids), run, lambda q, k, v, *_: self._nothing_seen(q, v), *operands
        )

    def _nothing_seen(self, q: Any, v: Any) -> tuple[Any, Any]:
        """A block no query sees a key of: out 0, lse −inf."""
        return (
            lax.full_like(q, 0, q.dtype, (*q.shape[:-1], v.shape[-1])),
            lax.full_like(q, -jnp.inf, jnp.float32, self.lse_shape(q)),
        )

    def _run(
        self, block: Block, side: AlibiSide | None, q: Any, k: Any, v: Any, q_ids: Any, kv_ids: Any, q_start: Any,
        k_start: Any,
    ) -> tuple[Any, Any]:  # fmt: skip
        seq_axis = self.config.seq_axis
        if block.kind is BlockKind.HIDDEN:
            return self._nothing_seen(q, v)
        mask = None
        if block.kind is BlockKind.MASKED:  # the global band on global positions (per element with lengths)
            rows = q_start + jnp.arange(q.shape[seq_axis]).reshape(1, 1, -1, 1)
            cols = k_start + jnp.arange(k.shape[seq_axis]).reshape(1, 1, 1, -1)
            mask = band_visibility(
                self.config.spec, rows, cols, self._global_lengths(self.q_lengths, self.len_q),
                self._global_lengths(self.kv_lengths, self.len_k),
            )  # fmt: skip

        def attended(mask: Any, bias: Any, alibi_slopes: Any) -> tuple[Any, Any]:
            return api.attend(  # type: ignore[no-any-return]
                block.spec, q, k, v, mask=mask, bias=bias,
                q_lengths=self._local_lengths(self.q_lengths, q_start, q.shape[seq_axis]),
                kv_lengths=self._local_lengths(self.kv_lengths, k_start, k.shape[seq_axis]),
                q_segment_ids=q_ids, kv_segment_ids=kv_ids, return_lse=True, backend=self.config.backend,
                alibi_slopes=alibi_slopes, mask_mod=self.config.block_program(q_start, k_start),
                **self.config.block_dropout(self.optional["dropout_seed"], queries=q_start, keys=k_start),
            )  # fmt: skip

        if side is None or side is AlibiSide.NATIVE:
            return attended(mask, None, self.slopes)
        offset = self._block_offset(q_start, k_start)
        dtype = jnp.promote_types(q.dtype, jnp.float32)
        outs, lses = [], []
        slope = jnp.reshape(self.slopes, (-1, self.slopes.shape[-1], 1, 1)).astype(dtype)  # (B|1, Hq, 1, 1)
        rows = jnp.arange(q.shape[seq_axis], dtype=dtype).reshape(-1, 1)
        cols = jnp.arange(k.shape[seq_axis], dtype=dtype).reshape(1, -1)
        for side_mask, key_bias, row_constant in alibi_sides(side, slope, rows, cols, offset.astype(dtype)):
            # The row constant joins the bias here, not the block's lse as in torch: added to lse, jitted allgather
            # runs gave NaN dq/dk (unexplained; ring runs and torch agree). The sum is the term itself, rounded as
            # a backend's own float32 ALiBi term is.
            out, lse = attended(conjoin(mask, side_mask), key_bias + row_constant[..., None], None)
            outs.append(out)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        out, lse = merge_partials(jnp.stack(outs), jnp.stack(lses), seq_axis)
        return out.astype(q.dtype), lse  # as every other branch of the switch returns

    def _block_offset(self, q_start: Any, k_start: Any) -> Any:
        """The block's offset c (``Block.offset``, traced: one branch serves several blocks) as (B|1, 1, 1, 1), per
        element where bottom-right follows the lengths (off_b = kv_len_b − q_len_b, §4.3)."""
        if self.per_element:
            off = self._global_lengths(self.kv_lengths, self.len_k) - self._global_lengths(self.q_lengths, self.len_q)
        else:
            off = alignment_offset(self.config.spec, self.len_q, self.len_k)
        return jnp.reshape(off + q_start - k_start, (-1, 1, 1, 1))

    def _global_lengths(self, lengths: Any, full: int) -> Any:
        """Per element (B, 1, 1, 1) where the band's offset follows the lengths, else the full length."""
        return lengths.reshape(-1, 1, 1, 1) if self.per_element and lengths is not None else full

    @staticmethod
    def _local_lengths(lengths: Any, start: Any, size: int) -> Any:
        """A chunk's lengths: the global ones counted from its first position, clipped to it."""
        return None if lengths is None else jnp.clip(lengths - start, 0, size).astype(lengths.dtype)


def _segment_range(ids: Any) -> tuple[Any, Any]:
    """Per batch element, the least and greatest non-negative id (lo > hi when every position is padding)."""
    real = ids >= 0
    return jnp.where(real, ids, jnp.iinfo(ids.dtype).max).min(1), jnp.where(real, ids, -1).max(1)


def _segments_meet(q_ids: Any, kv_ids: Any) -> Any:
    """Whether some query of a block may share a segment with some key of it, by id ranges per element (§4.5)."""
    (q_lo, q_hi), (k_lo, k_hi) = _segment_range(q_ids), _segment_range(kv_ids)
    return jnp.any((q_lo <= k_hi) & (k_lo <= q_hi))


def _ulysses(geometry: _Geometry, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
    """Sequence shards to head shards (all_to_all), one whole-sequence attend in global order, and back."""
    config, world = geometry.config, geometry.world
    seq_axis, head_axis, axis_name = config.seq_axis, config.head_axis, config.axis_name
    for name, x in (("q", q), ("k", k)):
        if x.shape[head_axis] % world:
            raise InvalidInputError(
                f"strategy='ulysses' needs {name}'s heads divisible by the {world} devices of axis "
                f"{axis_name!r}: {name} has {x.shape[head_axis]} heads"
            )
    q_order = np.asarray(gather_order(geometry.len_q, world, config.sharding))
    to_global, kv_to_global = np.argsort(q_order), np.argsort(gather_order(geometry.len_k, world, config.sharding))

    def heads_sharded(x: Any, order: np.ndarray) -> Any:  # (…, H, L_local, …) -> (…, H/P, L global order, …)
        whole = lax.all_to_all(x, axis_name, head_axis, seq_axis, tiled=True)
        return jnp.take(whole, order, axis=seq_axis)

    def whole_ids(ids: Any, order: np.ndarray) -> Any:
        return None if ids is None else jnp.take(lax.all_gather(ids, axis_name, axis=1, tiled=True), order, axis=1)

    q_ids = whole_ids(geometry.optional["q_ids"], to_global)
    kv_ids = whole_ids(geometry.optional["kv_ids"], kv_to_global)
    slopes = geometry.slopes
    heads_here = q.shape[head_axis] // world  # this device's query heads after the all-to-all: the r-th of P groups
    first_head = lax.axis_index(axis_name) * heads_here
    if slopes is not None:
        slopes = lax.dynamic_slice_in_dim(slopes, first_head, heads_here, axis=slopes.ndim - 1)
    out, lse = api.attend(
        config.spec, heads_sharded(q, to_global), heads_sharded(k, kv_to_global), heads_sharded(v, kv_to_global),
        q_lengths=geometry.q_lengths, kv_lengths=geometry.kv_lengths, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
        return_lse=True, backend=config.backend, alibi_slopes=slopes, mask_mod=config.block_program(h_start=first_head),
        **config.block_dropout(geometry.optional["dropout_seed"], heads=first_head),
    )  # fmt: skip
    out = lax.all_to_all(jnp.take(out, q_order, axis=seq_axis), axis_name, seq_axis, head_axis, tiled=True)
    lse = lax.all_to_all(jnp.take(lse, q_order, axis=2), axis_name, 2, 1, tiled=True)
    return out, lse
