"""pallas: attention in ``jax.experimental.pallas`` kernels (kernels.py), for JAX arrays and, bridged
through DLPack, for torch tensors.

This module is the plumbing around the kernels: layouts, segment ids padded to the block sizes (q, k, v and the
outputs never are: the kernels bound their edge tiles' loads and stores), the cosine normalisation's
backward (the kernels scale raw scores by float32 inverse norms), per-batch geometry, dbias reduced to the bias's
shape, empty extents, the torch bridge, the paged forward's configuration (a key tile inside one cache block) and
the split-K rule (``decode_splits``).
Forward and backward are plain functions of arrays; the frontends' custom_vjp (JAX) and autograd.Function
(torch) tie them together, so jit, grad and vmap work as for any backend.

On a GPU the kernels lower through Pallas' Triton path; elsewhere they run with ``interpret=True`` (a
``jax.jit`` of a loop over the grid), which is exact but slow: a test and debugging vehicle.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

from attnkit.backend import (
    ALL_FEATURES,
    AttentionInputs,
    AttentionSpec,
    BaseBackend,
    Capabilities,
    DeviceLimits,
    Dropout,
    Framework,
    Gradients,
    Layout,
    PagedInputs,
    Problem,
    Sizes,
    Unverified,
    Variant,
    pending_hardware,
)
from attnkit.contract import alignment_offset, diagonal_band
from attnkit.contract.programs import BoundProgram, MaskProgram, tile_classes

try:
    import jax
    import jax.numpy as jnp

    from attnkit.contract.jax import normalize, normalize_backward, zero_padding

    from . import kernels
except Exception as error:  # missing or broken (e.g. a jaxlib mismatch): available() reports it
    _JAX_ERROR: str | None = f"jax.experimental.pallas cannot be imported ({type(error).__name__}: {error})"
else:
    _JAX_ERROR = None

MAX_HEAD_DIM = 256
# Interpreted on CPU: small tiles keep the padded work small, and still several per row; not square, as on a GPU, and
# the dK/dV kernel's the other way round from the forward's, so a bound that takes block_q for block_k, or one
# kernel's tile for the other's, is wrong here. The kernels branch on a tile only by how it meets the lengths
# (a ragged last tile, a tile wider than the array), which the tests vary: the GPU tiles run the same code.
INTERPRET_BLOCKS = ((32, 16), (16, 32))  # (block_q, block_k) of the forward/dQ kernels, then of the dK/dV kernel
# Split-K decode (kernels._split_range): a forward with one query tile per (batch, head) leaves a GPU mostly idle
# when B·Hq is small, so its keys are cut into ranges on a fourth grid axis, until about SPLIT_CELLS cells (an H100
# has 132 SMs), each range at least SPLIT_MIN_TILES key tiles, at most SPLIT_MAX ranges. Interpreted (CPU), cells run
# one after another and splitting buys nothing: there only PallasBackend(decode_splits=n) splits.
SPLIT_CELLS, SPLIT_MIN_TILES, SPLIT_MAX = 128, 4, 16


class _Config(NamedTuple):
    """The static part of a call (a jit static argument): everything else is an array argument."""

    kernel: Any  # kernels.Static for the forward/dQ kernels
    kernel_dkdv: Any  # kernels.Static for the dK/dV kernel


class _Sizes(NamedTuple):
    batch: int
    len_q: int
    len_k: int
    pad_q: int  # the segment ids' padded lengths: a multiple of every kernel's tiles
    pad_k: int


class _Tiles(NamedTuple):
    """The tiles of a call: (block_q, block_k) and num_warps of the forward/dQ kernels, then of the dK/dV kernel,
    and the dK/dV kernel's stages of buffered loads (the forward/dQ kernels keep Static's default). One stage, as
    Triton's own dK/dV kernel: two read 1.2 more instructions per score at D = 64 and spill kilobytes at D = 256 on
    sm_90, and at D = 128 on sm_80 (performance.md, Pallas dK/dV follow-up)."""

    forward: tuple[int, int]
    dkdv: tuple[int, int]
    warps: int
    dkdv_warps: int
    dkdv_stages: int = 1


def _blocks(interpret: bool, len_q: int, len_k: int, dim: int) -> _Tiles:
    """The tiles for these lengths and head dim, never wider than the length's power of two (>= 16). Triton keeps
    wgmma on sm_90 when a product's M is a multiple of 64 per warpgroup (4 warps): M is block_q for S and dP, block_k
    for dV and dK in the dK/dV kernel. Chosen from the static view (performance.md, Pallas kernels on sm_90)."""
    if interpret:
        (fwd, bwd), warps, bwd_warps = INTERPRET_BLOCKS, 4, 4
    elif dim <= 64:
        fwd, bwd, warps, bwd_warps = (128, 64), (64, 64), 4, 4
    elif dim <= 128:  # 8 warps: each warpgroup takes 64 query rows; on 4 warps the float32 tiles spill
        fwd, bwd, warps, bwd_warps = (128, 64), (128, 64), 8, 8
    else:  # forward/dQ on wgmma within an A100's shared memory; dK/dV on mma.sync (its wgmma tiles spill)
        fwd, bwd, warps, bwd_warps = (64, 32), (32, 32), 8, 8

    def clip(pair: tuple[int, int]) -> tuple[int, int]:
        return min(pair[0], kernels.width(len_q)), min(pair[1], kernels.width(len_k))

    return _Tiles(clip(fwd), clip(bwd), warps, bwd_warps)


def decode_splits(cells: int, query_tiles: int, key_tiles: int) -> int:
    """Key ranges for a forward of ``cells`` = B·Hq (batch, head) pairs: split-K only with one query tile each."""
    if query_tiles > 1:
        return 1
    return max(1, min(SPLIT_MAX, key_tiles // SPLIT_MIN_TILES, -(-SPLIT_CELLS // max(cells, 1))))


def _splits(forced: int | None, interpret: bool, cells: int, len_q: int, len_k: int, blocks: tuple[int, int]) -> int:
    if forced is not None:
        return max(1, min(forced, len_k // blocks[1]))
    if interpret:
        return 1
    return decode_splits(cells, -(-len_q // blocks[0]), -(-len_k // blocks[1]))


@functools.lru_cache(maxsize=4096)
def _config(
    spec: AttentionSpec, len_q: int, len_k: int, dim: int, interpret: bool, cells: int = 1, forced: int | None = None
) -> _Config:
    tiles = _blocks(interpret, len_q, len_k, dim)
    fwd, bwd = tiles.forward, tiles.dkdv
    common: dict[str, Any] = {
        "bshd": spec.layout is Layout.BSHD,
        "softcap": spec.softcap is not None,
        "cosine": spec.variant is Variant.COSINE,
        "interpret": interpret,
    }
    padded_k = -(-len_k // max(fwd[1], bwd[1])) * max(fwd[1], bwd[1])
    splits = _splits(forced, interpret, cells, len_q, padded_k, fwd)
    return _Config(
        kernel=kernels.Static(block_q=fwd[0], block_k=fwd[1], num_warps=tiles.warps, splits=splits, **common),
        kernel_dkdv=kernels.Static(
            block_q=bwd[0], block_k=bwd[1], num_warps=tiles.dkdv_warps, num_stages=tiles.dkdv_stages, **common
        ),
    )


def _band(spec: AttentionSpec) -> tuple[int, int]:
    """The spec's :func:`diagonal_band` (lower, upper), an open side as ∓FAR: array values, not static ones."""
    lower, upper = diagonal_band(spec)
    return (-kernels.FAR if lower is None else lower), (kernels.FAR if upper is None else upper)


@functools.lru_cache(maxsize=4096)
def _scalar_values(spec: AttentionSpec, dim: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    lower, upper = _band(spec)
    # The alignment offset is linear in kv_len − q_len: its factor (1 bottom-right, 0 top-left) rides as a value.
    alignment = alignment_offset(spec, q_len=0, kv_len=1)
    return (spec.resolved_scale(dim), spec.softcap or 1.0, 0.0, 0.0), (lower, upper, alignment)


def _scalars(spec: AttentionSpec, dim: int) -> tuple[Any, Any]:
    """Values that change without recompiling: params [scale, softcap, 0, 0] and band [lower, upper, alignment]."""
    params, band = _scalar_values(spec, dim)
    return jnp.asarray(params, jnp.float32), jnp.asarray(band, jnp.int32)


# --------------------------------------------------------------------------------------------- array plumbing


def _axes(config: _Config) -> tuple[int, int]:
    return (1, 2) if config.kernel.bshd else (2, 1)


def _sizes(config: _Config, q: Any, k: Any, v: Any) -> _Sizes:
    seq_axis, _ = _axes(config)
    len_q, len_k = q.shape[seq_axis], k.shape[seq_axis]
    step_q = max(config.kernel.block_q, config.kernel_dkdv.block_q)
    step_k = max(config.kernel.block_k, config.kernel_dkdv.block_k)
    pad_q, pad_k = -(-len_q // step_q) * step_q, -(-len_k // step_k) * step_k
    return _Sizes(q.shape[0], len_q, len_k, pad_q, pad_k)


def _pad_axis(x: Any, axis: int, size: int, value: float = 0) -> Any:
    axis %= x.ndim
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _geometry(band: Any, sizes: _Sizes, q_lengths: Any, kv_lengths: Any) -> Any:
    """(B, 5) int32 [q_len, kv_len, lo, hi, off] (kernels.py); lengths may be tracers: clamped.

    ``lo, hi`` is the band (lower, upper) of ``band`` shifted by each element's alignment offset ``off``, so the
    kernels test ``lo ≤ j − i ≤ hi``; an open side stays ∓FAR. ALiBi's distance is |i + off − j|."""
    batch, len_q, len_k = sizes.batch, sizes.len_q, sizes.len_k
    q_len = jnp.full((batch,), len_q, jnp.int32) if q_lengths is None else jnp.clip(q_lengths, 0, len_q)
    kv_len = jnp.full((batch,), len_k, jnp.int32) if kv_lengths is None else jnp.clip(kv_lengths, 0, len_k)
    q_len, kv_len = q_len.astype(jnp.int32), kv_len.astype(jnp.int32)
    lower, upper, alignment = band[0], band[1], band[2]
    offset = (kv_len - q_len) * alignment
    lo = jnp.where(lower <= -kernels.FAR, -kernels.FAR, offset + lower)
    hi = jnp.where(upper >= kernels.FAR, kernels.FAR, offset + upper)
    return jnp.stack([q_len, kv_len, lo, hi, offset], axis=1)


def _pairwise(x: Any, sizes: _Sizes, dtype: Any) -> Any:
    """A 4-D mask/bias broadcastable to (B, Hq, Lq, Lk): sequence axes broadcast, batch/head kept."""
    return jnp.broadcast_to(x, (*x.shape[:2], sizes.len_q, sizes.len_k)).astype(dtype)


def _segments(config: _Config, sizes: _Sizes, inputs: AttentionInputs) -> tuple[Any, Any]:
    """The segment-id operands of the forward/dQ kernels and of the dK/dV kernel (None, None without ids): ids as
    int32, padded with −1, and their per-tile ranges for each kernel's blocks."""
    if inputs.q_segment_ids is None:
        return None, None
    q_ids = _pad_axis(inputs.q_segment_ids.astype(jnp.int32), 1, sizes.pad_q, -1)
    kv_ids = _pad_axis(inputs.kv_segment_ids.astype(jnp.int32), 1, sizes.pad_k, -1)
    return kernels.segments_for(config.kernel, q_ids, kv_ids), kernels.segments_for(config.kernel_dkdv, q_ids, kv_ids)


def _program(config: _Config, sizes: _Sizes, q: Any, captured: tuple[Any, ...] | None) -> tuple[Any, Any]:
    """The program operands of the forward/dQ kernels and of the dK/dV kernel (None, None without a program): the
    tile classes for each kernel's blocks, computed here in jnp from the captured arrays (int32; values, so new ones
    never recompile), and the captured arrays."""
    program = config.kernel.program
    if program is None or captured is None:
        return None, None
    bound = BoundProgram(program, captured)
    heads = q.shape[_axes(config)[1]]

    def operands(static: Any) -> Any:
        classes = tile_classes(bound, sizes.batch, heads, sizes.len_q, sizes.len_k, static.block_q, static.block_k, q)
        return kernels.program_for(static, classes, captured)

    return operands(config.kernel), operands(config.kernel_dkdv)


def _prepare(config: _Config, band: Any, inputs: AttentionInputs) -> dict[str, Any]:
    """Kernel operands: q, k, v as given (raw for cosine too; zero at negative segment ids), int8 mask, float32
    bias, ALiBi's float32 slopes (B|1, Hq) as given, geometry, segment ids, a program's tile classes and captured
    arrays (``inputs.mask_program``: the captured arrays alone, the program itself is in ``config``) and dropout's
    words (its p is in ``config`` too)."""
    sizes = _sizes(config, inputs.q, inputs.k, inputs.v)
    seq_axis, _ = _axes(config)
    q = zero_padding(inputs.q, None, seq_axis, inputs.q_segment_ids)
    k, v = (zero_padding(x, None, seq_axis, inputs.kv_segment_ids) for x in (inputs.k, inputs.v))
    geom = _geometry(band, sizes, inputs.q_lengths, inputs.kv_lengths)
    prepared: dict[str, Any] = {"geom": geom}
    prepared["segments"], prepared["segments_dkdv"] = _segments(config, sizes, inputs)
    prepared["q"], prepared["k"], prepared["v"] = q, k, v
    prepared["mask"] = None if inputs.mask is None else _pairwise(inputs.mask, sizes, jnp.int8)
    prepared["bias"] = None if inputs.bias is None else _pairwise(inputs.bias, sizes, jnp.float32)
    prepared["slopes"] = inputs.alibi_slopes
    prepared["program"], prepared["program_dkdv"] = _program(config, sizes, inputs.q, inputs.mask_program)
    prepared["dropout"] = _dropout_words(inputs.dropout)
    return prepared


def _dropout_words(dropout: Dropout | None) -> Any:
    """The kernels' dropout operand: the seed's words and the offsets as one (5,) uint32 array (kernels.DropoutWords),
    so that a new seed or offset is a value, never a recompile."""
    if dropout is None:
        return None
    offsets = [jnp.asarray(x).astype(jnp.uint32) for x in (dropout.head_start, dropout.query_start, dropout.key_start)]
    return kernels.DropoutWords(jnp.concatenate([dropout.seed, jnp.stack(offsets)]))


def _empty(inputs: AttentionInputs, config: _Config) -> bool:
    seq_axis, _ = _axes(config)
    return 0 in (inputs.q.shape[0], inputs.q.shape[seq_axis], inputs.k.shape[seq_axis])


def _empty_forward(inputs: AttentionInputs, config: _Config) -> tuple[Any, Any]:
    q, v = inputs.q, inputs.v
    seq_axis, head_axis = _axes(config)
    out_shape = (*q.shape[:-1], v.shape[-1])
    lse_shape = (q.shape[0], q.shape[head_axis], q.shape[seq_axis])
    return jnp.zeros(out_shape, q.dtype), jnp.full(lse_shape, -jnp.inf, jnp.float32)


class _Stages(NamedTuple):
    """The pieces of a call. Jitted as one program (GPU, or under the caller's jit), or one jit each (the
    interpreter on CPU: there compiling the interpreted kernels dominates, and a kernel jitted alone is shared
    by every call of the same shapes, whatever its lengths, scale, window or values)."""

    prepare: Any
    forward_kernel: Any
    backward_rows: Any
    dkdv_kernel: Any
    dq_kernel: Any
    finish_backward: Any


def _forward(stages: _Stages, config: _Config, params: Any, band: Any, inputs: AttentionInputs) -> tuple[Any, Any]:
    if _empty(inputs, config):
        return _empty_forward(inputs, config)
    p = stages.prepare(config, band, inputs)
    operands = (p["geom"], params, p["q"], p["k"], p["v"], p["mask"], p["bias"], p["slopes"], p["segments"])
    return stages.forward_kernel(config.kernel, *operands, p["program"], p["dropout"])


def _backward_rows(config: _Config, out: Any, lse: Any, dout: Any, dlse: Any) -> tuple[Any, Any]:
    """lse and Δ = rowsum(dO ⊙ O) − dlse; an empty row (lse −inf) gets lse +inf (so P = 0) and Δ 0."""
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = jnp.swapaxes(delta, 1, 2) if config.kernel.bshd else delta
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)
    empty = lse == -jnp.inf
    return jnp.where(empty, jnp.inf, lse), jnp.where(empty, 0.0, delta)


def _unit_backward(config: _Config, x: Any, lengths: Any, segment_ids: Any, d_unit: Any) -> Any:
    """The cosine chain rule from dx̂ (float32, from the kernels) to dx, through x̂ = x/‖x‖ in float32; padding
    (past lengths, negative ids) zeroed first, so its NaN cannot reach it."""
    seq_axis, _ = _axes(config)
    return normalize_backward(normalize(zero_padding(x, lengths, seq_axis, segment_ids).astype(jnp.float32)), d_unit)


def _finish_backward(config: _Config, inputs: AttentionInputs, grads: tuple[Any, ...]) -> tuple[Any, Any, Any, Any]:
    dq, dk, dv, dbias = grads
    q, k, v, bias = inputs.q, inputs.k, inputs.v, inputs.bias
    if config.kernel.cosine:
        dq = _unit_backward(config, q, inputs.q_lengths, inputs.q_segment_ids, dq)
        dk = _unit_backward(config, k, inputs.kv_lengths, inputs.kv_segment_ids, dk)
    if dbias is not None:
        axes = tuple(axis for axis, size in enumerate(bias.shape) if size == 1 and dbias.shape[axis] != 1)
        dbias = (dbias.sum(axis=axes, keepdims=True) if axes else dbias).astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias


def _backward(
    stages: _Stages,
    config: _Config,
    need_dbias: bool,
    params: Any,
    band: Any,
    inputs: AttentionInputs,
    out: Any,
    lse: Any,
    dout: Any,
    dlse: Any,
) -> tuple[Any, Any, Any, Any]:
    if _empty(inputs, config):
        dbias = None if not need_dbias else jnp.zeros(inputs.bias.shape, inputs.bias.dtype)
        return jnp.zeros_like(inputs.q), jnp.zeros_like(inputs.k), jnp.zeros_like(inputs.v), dbias
    p = stages.prepare(config, band, inputs)
    lse, delta = stages.backward_rows(config, out, lse, dout, dlse)
    operands = (p["geom"], params, p["q"], p["k"], p["v"], dout, lse, delta, p["mask"], p["bias"], p["slopes"])
    dk, dv = stages.dkdv_kernel(config.kernel_dkdv, *operands, p["segments_dkdv"], p["program_dkdv"], p["dropout"])
    dq, dbias = stages.dq_kernel(config.kernel, *operands, p["segments"], p["program"], p["dropout"], need_dbias)
    return stages.finish_backward(config, inputs, (dq, dk, dv, dbias))


_PLAIN = _Stages(
    _prepare,
    kernels.forward_call,
    _backward_rows,
    kernels.dkdv_call,
    kernels.dq_call,
    _finish_backward,
)


@functools.cache
def _compiled() -> tuple[Any, Any, Any, Any]:
    """(forward, backward) jitted whole, and (forward, backward) staged with one jit per piece.

    Scale, softcap, window, alignment and lengths are array arguments: changing them does not recompile.
    The interpreted kernels are compiled without XLA's backend optimisations (about 30% faster to compile,
    the same to run at test sizes). Nested under a caller's jit, all of these are inlined.
    """
    fast = {"xla_backend_optimization_level": 0}
    staged = _Stages(
        jax.jit(_prepare, static_argnums=(0,)),
        jax.jit(kernels.forward_call, static_argnums=(0,), compiler_options=fast),
        jax.jit(_backward_rows, static_argnums=(0,)),
        jax.jit(kernels.dkdv_call, static_argnums=(0,), compiler_options=fast),
        jax.jit(kernels.dq_call, static_argnums=(0, 15), compiler_options=fast),
        jax.jit(_finish_backward, static_argnums=(0,)),
    )
    whole_forward = jax.jit(functools.partial(_forward, _PLAIN), static_argnums=(0,))
    whole_backward = jax.jit(functools.partial(_backward, _PLAIN), static_argnums=(0, 1))
    return (
        whole_forward,
        whole_backward,
        functools.partial(_forward, staged),
        functools.partial(_backward, staged),
    )


# ------------------------------------------------------------------------------------------------ paged cache


def _page_tile(page: int, block_k: int) -> int:
    """The paged kernel's key tile: the whole block when it fits the forward's tile, else the largest divisor of the
    block that does, so that no tile straddles two blocks (on a GPU both are powers of two: the smaller)."""
    if page <= block_k:
        return page
    return max(tile for tile in range(1, block_k + 1) if page % tile == 0)


@functools.lru_cache(maxsize=4096)
def _paged_config(
    spec: AttentionSpec, len_q: int, page: int, max_blocks: int, dim: int, interpret: bool, cells: int,
    forced: int | None,
) -> Any:  # fmt: skip
    """The paged forward's kernels.Static: the forward's query tile, a key tile inside one block."""
    capacity = page * max_blocks
    tiles = _blocks(interpret, len_q, capacity, dim)
    (block_q, block_k), warps = tiles.forward, tiles.warps
    block_k = _page_tile(page, block_k)
    return kernels.Static(
        bshd=spec.layout is Layout.BSHD,
        softcap=spec.softcap is not None,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        num_warps=warps,
        splits=_splits(forced, interpret, cells, len_q, capacity, (block_q, block_k)),
        cosine=spec.variant is Variant.COSINE,
    )


def _paged_forward(static: Any, params: Any, band: Any, inputs: PagedInputs) -> tuple[Any, Any]:
    """(out, lse) of attend_paged (§13): q and the cache as they lie; ALiBi's key positions are the sequence's."""
    q, k_cache, v_cache, block_table, kv_lengths, slopes = inputs
    seq_axis, head_axis = (1, 2) if static.bshd else (2, 1)
    batch, len_q, heads_q = q.shape[0], q.shape[seq_axis], q.shape[head_axis]
    capacity = block_table.shape[1] * k_cache.shape[1]
    if 0 in (batch, len_q, capacity, k_cache.shape[0]):  # nothing to compute, or no key to see
        out = jnp.zeros((*q.shape[:-1], v_cache.shape[-1]), q.dtype)
        return out, jnp.full((batch, heads_q, len_q), -jnp.inf, jnp.float32)
    geom = _geometry(band, _Sizes(batch, len_q, capacity, len_q, capacity), None, kv_lengths)
    table = block_table.astype(jnp.int32)
    return kernels.paged_forward_call(static, geom, params, table, q, k_cache, v_cache, slopes)


@functools.cache
def _compiled_paged() -> Any:
    return jax.jit(_paged_forward, static_argnums=(0,))


#: What the paged kernel takes on a GPU: Triton tiles are powers of two (a dot at least 16 wide) and a key tile lies
#: inside one block, so the block size must be one; the head dims are kept to powers of two too (the kernel would read
#: them wider, masked, as the other kernels do, but that path has not run on a GPU). The interpreter takes any.
GPU_PAGED_LIMITS = DeviceLimits(
    paged_block_sizes=Sizes(16, power_of_two=True), paged_head_dims=Sizes(16, MAX_HEAD_DIM, power_of_two=True)
)


# ----------------------------------------------------------------------------------------------- torch bridge


def _to_jax(x: Any) -> Any:
    """torch -> JAX through DLPack. bool and int64 have no JAX twin by default, so they are narrowed first."""
    import torch

    if x is None:
        return None
    x = x.detach()
    if x.dtype == torch.bool:
        x = x.to(torch.int8)
    elif not x.is_floating_point():
        x = x.to(torch.int32)
    return jax.dlpack.from_dlpack(x.contiguous())


def _program_to_jax(bound: BoundProgram | None) -> BoundProgram | None:
    """A torch call's program with its captured tensors bridged as q, k, v are (bool as int8, integers as int32)."""
    return None if bound is None else BoundProgram(bound.program, tuple(_to_jax(t) for t in bound.captured))


def _inputs_to_jax(inputs: AttentionInputs) -> AttentionInputs:
    tensors = AttentionInputs(*(_to_jax(x) for x in inputs._replace(mask_program=None, dropout=None)))
    dropout = _dropout_to_jax(inputs.dropout, inputs.q.device)
    return _mask_from_int8(tensors._replace(mask_program=_program_to_jax(inputs.mask_program), dropout=dropout))


def _split_program(config: _Config, inputs: AttentionInputs) -> tuple[_Config, AttentionInputs]:
    """The program's code into the kernels' static configuration, its captured arrays (int32) into the inputs, in
    place of the BoundProgram: jit specialises on the one and takes the other as array arguments."""
    bound = inputs.mask_program
    if bound is None:
        return config, inputs
    program: MaskProgram = bound.program
    config = _Config(
        dataclasses.replace(config.kernel, program=program), dataclasses.replace(config.kernel_dkdv, program=program)
    )
    captured = tuple(t if t.dtype == jnp.int32 else jnp.asarray(t).astype(jnp.int32) for t in bound.captured)
    return config, inputs._replace(mask_program=captured)


def _with_dropout(config: _Config, dropout: Dropout | None) -> _Config:
    """Dropout's p in the kernels' static configuration (its seed and offsets are an operand: ``_dropout_words``)."""
    if dropout is None:
        return config
    return _Config(*(dataclasses.replace(static, dropout_p=dropout.p) for static in config))


def _dropout_to_jax(dropout: Dropout | None, device: Any) -> Dropout | None:
    """A torch call's dropout with its seed (a 0-d int64 tensor, its bits read unsigned) as JAX's (2,) uint32
    (low, high) words, computed on ``device`` without reading the seed on the host; the offsets as they are."""
    if dropout is None:
        return None
    import torch

    seed = dropout.seed.to(device)
    words = torch.stack([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF])
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # the same bits, as int32
    return dropout._replace(seed=jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(words), jnp.uint32))


def _to_torch(x: Any) -> Any:
    import torch

    return None if x is None else torch.from_dlpack(x)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _mask_from_int8(inputs: AttentionInputs) -> AttentionInputs:
    return inputs if inputs.mask is None else inputs._replace(mask=inputs.mask != 0)


#: The Unverified paths of mask programs and dropout on a GPU.
MASK_PROGRAMS = "mask programs (mask_mod)"
DROPOUT = "attention dropout (dropout_p)"


class PallasBackend(BaseBackend):
    name = "pallas"
    capabilities = Capabilities(
        length_generic=True,
        frameworks=frozenset({Framework.JAX, Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        devices=frozenset({"cpu", "cuda"}),
        features=ALL_FEATURES,
        native_framework=Framework.JAX,  # the harness drives it through JAX; the torch bridge has its own tests
        head_dims=(1, MAX_HEAD_DIM),
        per_device=(("cuda", GPU_PAGED_LIMITS),),
        unverified=(
            Unverified(
                "cuda",
                MASK_PROGRAMS,
                "never run on a GPU: the kernels evaluate the program on each partial tile with gathers from the "
                "captured arrays, which Pallas' Triton lowering accepts (tests/test_pallas.py -k lower_for_gpu) but "
                "no GPU has compiled or run",
            ),
            Unverified(
                "cuda",
                DROPOUT,
                "never run on a GPU: the kernels regenerate the keep-mask per tile with Philox4x32-10 in uint32 "
                "(shifts, xor, multiplies, unsigned compares), which Pallas' Triton lowering accepts "
                "(tests/test_pallas.py -k lower_for_gpu) but no GPU has compiled or run",
            ),
        ),
        description=(
            "FlashAttention-2 in jax.experimental.pallas kernels (Triton path on GPU); "
            "torch tensors bridged through DLPack"
        ),
        notes=(
            "on CPU the kernels run with interpret=True (a jit of a loop over the grid): exact but slow, "
            "for testing; on a GPU they lower through Pallas' Triton path",
            "float64: not declared (Triton's GPU dot has no float64 path)",
            "head dims up to 256 (read in tiles a power of two >= 16 wide, masked), any sequence length: nothing is "
            "padded or copied (the last, partial tile's loads are masked)",
            "dense mask/bias: their sequence axes are materialised (batch/head broadcast is kept)",
            "segment ids: narrowed to int32; tile pairs whose id ranges cannot meet are skipped, so a packed row "
            "of contiguous documents costs Σ Lᵢ²",
            "ALiBi: the (B|1, Hq) slopes go in as they are and each tile computes −slope·|i + off − j| from its own "
            "indices (forward, both backward kernels and the paged forward); on a GPU not yet run on hardware",
            "paged KV cache (forward only): the kernel reads each key tile where it lies, through the block table "
            "(a tile never straddles two blocks); on a GPU the block size and head dims must be powers of two >= 16",
            "split-K decode on a GPU: one query tile per (batch, head) and few of those: the keys are cut into up "
            "to 16 ranges (at least 4 key tiles each) until about 128 grid cells, merged by lse; the backward is "
            "not split",
            "mask programs (mask_mod): evaluated in the kernels on each tile's indices with jnp, captured tensors read "
            "by gathers from whole int32 kernel operands (new values never recompile); tiles classified EMPTY are "
            "skipped and FULL ones not evaluated, forward and backward; on a GPU not yet run on hardware",
            "dropout (§18): each kernel regenerates its tiles' keep-mask from the seed (an operand with the offsets: "
            "new seeds never recompile; p is compiled in); nothing (Lq, Lk) is saved; on a GPU not yet run on "
            "hardware",
        ),
    )

    def __init__(self, interpret: bool | None = None, decode_splits: int | None = None) -> None:
        """``decode_splits`` forces that many key ranges on every forward (at most one per key tile), whatever the
        rule (SPLIT_CELLS): for tests of split-K where the interpreter runs the kernels."""
        self._interpret = interpret
        self._decode_splits = decode_splits

    def available(self) -> list[str]:
        return [_JAX_ERROR] if _JAX_ERROR is not None else []

    def interpret(self) -> bool:
        """True where kernels run in Pallas' interpreter: no GPU in JAX's default backend."""
        if self._interpret is not None:
            return self._interpret
        return jax.default_backend() not in ("gpu", "cuda")

    def interpreted(self, device: str) -> bool:
        return device == "cpu" or self.interpret()

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        reasons = super().supports(spec, problem)
        if problem.device == "cuda" and problem.framework is Framework.TORCH and _JAX_ERROR is None:
            if jax.default_backend() not in ("gpu", "cuda"):
                reasons.append("device=cuda torch tensors need JAX with CUDA (pip install 'jax[cuda13]')")
        if problem.device == "cuda" and problem.has_mask_program:
            reasons += pending_hardware(self, "cuda", MASK_PROGRAMS)
        if problem.device == "cuda" and problem.has_dropout:
            reasons += pending_hardware(self, "cuda", DROPOUT)
        return reasons

    def _call(self, spec: AttentionSpec, inputs: AttentionInputs) -> tuple[Any, Any, _Config, Any, Any, Any]:
        """(forward, backward, config, params, band, inputs): the functions to run and their arguments, a program's
        code moved into the config (``_split_program``) and dropout's p copied there."""
        seq_axis = 1 if spec.layout is Layout.BSHD else 2
        len_q, len_k, dim = inputs.q.shape[seq_axis], inputs.k.shape[seq_axis], inputs.q.shape[-1]
        interpret = self.interpret()
        cells = inputs.q.shape[0] * inputs.q.shape[3 - seq_axis]  # B·Hq
        config = _config(spec, len_q, len_k, max(dim, inputs.v.shape[-1]), interpret, cells, self._decode_splits)
        config, inputs = _split_program(config, inputs)
        config = _with_dropout(config, inputs.dropout)
        params, band = _scalars(spec, dim)
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(inputs)):  # the caller's jit: inline
            forward, backward = functools.partial(_forward, _PLAIN), functools.partial(_backward, _PLAIN)
            return forward, backward, config, params, band, inputs
        forward, backward, staged_forward, staged_backward = _compiled()
        if interpret:
            forward, backward = staged_forward, staged_backward
        return forward, backward, config, params, band, inputs

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[Any, Any]:
        if _is_torch(inputs.q):
            out, lse = self.forward(spec, _inputs_to_jax(inputs), need_lse)
            return _to_torch(out), _to_torch(lse)
        forward, _, config, params, band, inputs = self._call(spec, inputs)
        return forward(config, params, band, inputs)

    def forward_paged(self, spec: AttentionSpec, inputs: PagedInputs, need_lse: bool) -> tuple[Any, Any]:
        if _is_torch(inputs.q):
            out, lse = self.forward_paged(spec, PagedInputs(*(_to_jax(x) for x in inputs)), need_lse)
            return _to_torch(out), _to_torch(lse)
        q, k_cache = inputs.q, inputs.k_cache
        len_q, heads_q = (q.shape[1], q.shape[2]) if spec.layout is Layout.BSHD else (q.shape[2], q.shape[1])
        dim = max(q.shape[-1], inputs.v_cache.shape[-1])
        static = _paged_config(spec, len_q, k_cache.shape[1], inputs.block_table.shape[1], dim, self.interpret(),
                               q.shape[0] * heads_q, self._decode_splits)  # fmt: skip
        params, band = _scalars(spec, q.shape[-1])
        if any(isinstance(x, jax.core.Tracer) for x in inputs):  # under the caller's jit: inline
            return _paged_forward(static, params, band, inputs)
        return _compiled_paged()(static, params, band, inputs)

    def backward(
        self,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        out: Any,
        lse: Any,
        dout: Any,
        dlse: Any | None,
        *,
        need_dbias: bool,
    ) -> Gradients:
        need_dbias = need_dbias and inputs.bias is not None
        if _is_torch(inputs.q):
            cotangents = (_to_jax(x) for x in (out, lse, dout, dlse))
            grads = self.backward(spec, _inputs_to_jax(inputs), *cotangents, need_dbias=need_dbias)
            return Gradients(*(_to_torch(x) for x in (grads.dq, grads.dk, grads.dv, grads.dbias)))
        _, backward, config, params, band, inputs = self._call(spec, inputs)
        return Gradients(*backward(config, need_dbias, params, band, inputs, out, lse, dout, dlse))
