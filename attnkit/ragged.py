"""Ragged batches in the layouts other libraries use, defined by attend itself: packed sequences with cu_seqlens
(attend_varlen, docs/semantics.md §12) and a paged KV cache (attend_paged, §13)."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from attnkit import dispatch, spellings
from attnkit.api import attend
from attnkit.backend import AttentionInputs, Framework, PagedInputs, Problem
from attnkit.errors import InvalidInputError, InvalidInputTypeError
from attnkit.frontends import FLOATING, INTEGER, FrameworkOps, ops_for
from attnkit.sinks import check_sinks, with_sinks
from attnkit.spec import AttentionSpec, Layout
from attnkit.validation import checked_probability, checked_slopes


def _packed_spec(spec: AttentionSpec) -> AttentionSpec:
    """The spec with layout bshd: a packed (total, H, D) array is one row of a bshd batch."""
    return spec if spec.layout is Layout.BSHD else AttentionSpec(**{**spec.model_dump(), "layout": Layout.BSHD})


def _check_array(ops: FrameworkOps, name: str, x: Any, dtypes: frozenset[str], kind: str) -> None:
    if not ops.is_array(x):
        raise InvalidInputTypeError(f"{name} must be a {ops.framework.value} array, got {type(x).__name__}")
    if ops.dtype_name(x) not in dtypes:
        raise InvalidInputTypeError(f"{name} has dtype {ops.dtype_name(x)}, expected {kind}")


def _check_like_q(ops: FrameworkOps, q: Any, named: dict[str, Any]) -> None:
    for name, x in named.items():
        if not ops.is_array(x):
            raise InvalidInputTypeError(
                f"{name} must be the same kind of array as q ({ops.framework.value}), got {type(x).__name__}"
            )
        if ops.dtype_name(x) != ops.dtype_name(q):
            raise InvalidInputTypeError(f"{name} has dtype {ops.dtype_name(x)}, expected q's dtype {ops.dtype_name(q)}")
        if ops.device(x) != ops.device(q):
            raise InvalidInputTypeError(f"{name} is on device {ops.device(x)}, expected q's device {ops.device(q)}")


def _check_heads(q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...], kv: str) -> None:
    heads_q, head_dim = q_shape[-2], q_shape[-1]
    heads_kv, head_dim_k = k_shape[-2], k_shape[-1]
    if v_shape[:-1] != k_shape[:-1]:
        raise InvalidInputError(f"v{kv} has shape {tuple(v_shape)}, expected k{kv}'s {tuple(k_shape[:-1])} + (Dv,)")
    if head_dim_k != head_dim:
        raise InvalidInputError(f"k{kv} has head_dim={head_dim_k}, expected q's head_dim={head_dim}")
    if heads_q == 0 or heads_kv == 0 or heads_q % heads_kv:
        raise InvalidInputError(f"{heads_q=} (query heads) must be a positive multiple of {heads_kv=}")


# ---------------------------------------------------------------------------------------------------------------
# attend_varlen (§12)


def _check_offsets(name: str, offsets: np.ndarray, total: int) -> None:
    if offsets[0] != 0:
        raise InvalidInputError(f"{name} must start at 0, got {name}[0]={offsets[0]}")
    steps = np.diff(offsets)
    if (steps < 0).any():
        at = int(np.argmax(steps < 0))
        raise InvalidInputError(
            f"{name} must be non-decreasing, got {name}[{at}]={offsets[at]} > {name}[{at + 1}]={offsets[at + 1]}"
        )
    if offsets[-1] != total:
        raise InvalidInputError(f"{name} must end at the packed length {total}, got {name}[-1]={offsets[-1]}")


def attend_varlen(
    spec: AttentionSpec,
    q: Any,
    k: Any,
    v: Any = ...,  # required, as the two below: a call without a spec (flash-attn's) says what to write instead
    cu_seqlens_q: Any = ...,
    cu_seqlens_k: Any = ...,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: Any = None,
    alibi_slopes: Any = None,
    mask_mod: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: Any = None,
    dropout_key: Any = None,
    **peer_kwargs: Any,
) -> Any:
    """Attention over packed sequences (docs/semantics.md §12), flash-attn's varlen layout: sequence s is attended as
    its own :func:`attend` call on its queries ``cu_seqlens_q[s] ≤ t < cu_seqlens_q[s+1]`` and keys
    ``cu_seqlens_k[s] ≤ t < cu_seqlens_k[s+1]``, with its own causal alignment and window (the spec's ``layout`` is
    ignored). Differentiable as attend; no mask or bias.

    :param spec: the call's spec.
    :param q: (total_q, Hq, D), floating.
    :param k: (total_k, Hkv, D), q's dtype.
    :param v: (total_k, Hkv, Dv), q's dtype.
    :param cu_seqlens_q: integer (n + 1,) cumulative offsets of the n sequences' queries (int32, as flash-attn takes
        them): starting at 0, never decreasing, ending at total_q.
    :param cu_seqlens_k: integer (n + 1,) cumulative offsets of the keys, ending at total_k.
    :param max_seqlen_q: an upper bound on any sequence's query count (Python int); required under ``jax.jit``, where
        the offsets are traced and the caller answers for them.
    :param max_seqlen_k: the same for the keys.
    :param return_lse: also return lse.
    :param backend: ``"auto"`` or a registered name, as for :func:`attend`.
    :param sinks: (Hq,), as attend takes them (§15), joining every sequence's rows.
    :param alibi_slopes: float32 (Hq,) or (n, Hq), one row per sequence (§16, as flash-attn's varlen call takes
        them).
    :param mask_mod: a mask program (§17); it sees ``b`` as the sequence and positions within it.
    :param dropout_p: as for :func:`attend` (§18); the keep-mask's batch row is the sequence and its indices the
        positions within it.
    :param dropout_seed: as for :func:`attend`.
    :param dropout_key: as for :func:`attend`.
    :returns: out (total_q, Hq, Dv), or (out, lse) with lse (Hq, total_q), float32 (float64 for float64 inputs, §6).
    :raises attnkit.UnexpectedArgumentError: a call written as another library writes it (``causal=``,
        ``softmax_scale=``), or an unknown keyword: the message says what to write instead.
    """
    if type(spec) is not AttentionSpec or v is ... or cu_seqlens_q is ... or cu_seqlens_k is ... or peer_kwargs:
        positional = {"v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
        raise spellings.call_error(attend_varlen, spec, positional, peer_kwargs, AttentionSpec)
    ops = ops_for(q, "q")
    _check_array(ops, "q", q, FLOATING, "a floating dtype")
    _check_like_q(ops, q, {"k": k, "v": v})
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise InvalidInputError(f"{name} must be 3-D (total, heads, head_dim), got shape {tuple(x.shape)}")
    if k.shape[0] != v.shape[0]:
        raise InvalidInputError(f"v has {v.shape[0]} packed keys, expected k's {k.shape[0]}")
    _check_heads(tuple(q.shape), tuple(k.shape), tuple(v.shape), "")
    for name, offsets in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_array(ops, name, offsets, INTEGER, "an integer dtype (int32, as flash-attn takes it)")
        if offsets.ndim != 1 or offsets.shape[0] < 1:
            raise InvalidInputError(f"{name} must be 1-D (n + 1,), got shape {tuple(offsets.shape)}")
        if ops.device(offsets) != ops.device(q):
            raise InvalidInputTypeError(f"{name} is on device {ops.device(offsets)}, expected q's {ops.device(q)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise InvalidInputError(
            f"cu_seqlens_q has shape {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)}: "
            "expected the same number of sequences"
        )
    total_q, total_k = q.shape[0], k.shape[0]
    offsets_q, offsets_k = ops.host_values(cu_seqlens_q), ops.host_values(cu_seqlens_k)
    self_packed = False
    if offsets_q is None or offsets_k is None:  # traced (jax.jit): the values are the caller's to answer for
        if max_seqlen_q is None or max_seqlen_k is None:
            raise InvalidInputError(
                "max_seqlen_q and max_seqlen_k must be given (Python ints) when cu_seqlens are traced (jax.jit): "
                f"got max_seqlen_q={max_seqlen_q}, max_seqlen_k={max_seqlen_k}"
            )
    else:
        _check_offsets("cu_seqlens_q", offsets_q, total_q)
        _check_offsets("cu_seqlens_k", offsets_k, total_k)
        longest_q, longest_k = int(np.diff(offsets_q).max(initial=0)), int(np.diff(offsets_k).max(initial=0))
        for name, given, longest in (
            ("max_seqlen_q", max_seqlen_q, longest_q),
            ("max_seqlen_k", max_seqlen_k, longest_k),
        ):
            if given is not None and given < longest:
                raise InvalidInputError(f"{name}={given} is less than the longest sequence's length {longest}")
        max_seqlen_q, max_seqlen_k = longest_q, longest_k
        self_packed = bool(np.array_equal(offsets_q, offsets_k))
    # Dropout's keep-mask is indexed by (sequence, position within it): one packed row would index it by the row's
    # positions, so a call with dropout takes the padded batch, one row per sequence.
    dropout = {"dropout_p": checked_probability(dropout_p), "dropout_seed": dropout_seed, "dropout_key": dropout_key}
    self_packed = self_packed and dropout["dropout_p"] == 0
    if alibi_slopes is not None:  # per sequence: (n, Hq) makes the padded batch's (B, Hq)
        alibi_slopes = checked_slopes(ops, alibi_slopes, cu_seqlens_q.shape[0] - 1, q.shape[1], ops.device(q), True)
        # One packed row has one slope per head: slopes that differ between sequences take the padded batch.
        self_packed = self_packed and alibi_slopes.shape[0] == 1
    packed = _packed_spec(spec)
    xp = _array_namespace(ops)
    if self_packed:  # one packed row, the sequence index its segment id (§12: the same contract, no copy)
        ids = xp.sequence_of(cu_seqlens_q, total_q)[None]
        if mask_mod is not None:
            mask_mod = _within_sequences(mask_mod, ids[0], cu_seqlens_q)
        result = attend(packed, q[None], k[None], v[None], q_segment_ids=ids, kv_segment_ids=ids,
                        return_lse=return_lse, backend=backend, sinks=sinks, alibi_slopes=alibi_slopes,
                        mask_mod=mask_mod, **dropout)  # fmt: skip
        if not return_lse:
            return result[0]
        return result[0][0], result[1][0]
    return _as_padded_batch(
        xp, packed, q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), return_lse, backend,
        sinks, alibi_slopes, mask_mod, dropout,
    )  # fmt: skip


def _within_sequences(mask_mod: Any, sequence: Any, offsets: Any) -> Any:
    """``mask_mod`` over one packed row: b the query's sequence, and both positions within their sequence (segment
    ids keep a query to keys of its own sequence, so the key's sequence is the query's wherever the pair is seen)."""

    def within(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        own = sequence[q_idx]
        return mask_mod(own, h, q_idx - offsets[own], kv_idx - offsets[sequence[kv_idx]])

    return within


def _as_padded_batch(
    xp: Any, spec: AttentionSpec, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int,
    return_lse: bool, backend: str, sinks: Any, alibi_slopes: Any, mask_mod: Any, dropout: dict[str, Any],
) -> Any:  # fmt: skip
    """§12 as a batch of right-padded sequences with q_lengths and kv_lengths (§4.3); ``dropout``: attend's
    dropout arguments."""
    count = cu_q.shape[0] - 1
    if alibi_slopes is not None and alibi_slopes.shape[0] == 1:  # checked_slopes' (1, Hq): every sequence's
        alibi_slopes = alibi_slopes[0]
    q_pad, q_lengths = xp.pad_sequences(q, cu_q, max(max_q, 1))
    k_pad, kv_lengths = xp.pad_sequences(k, cu_k, max(max_k, 1))
    v_pad, _ = xp.pad_sequences(v, cu_k, max(max_k, 1))
    out_pad, lse_pad = attend(spec, q_pad, k_pad, v_pad, q_lengths=q_lengths, kv_lengths=kv_lengths,
                              return_lse=True, backend=backend, sinks=sinks, alibi_slopes=alibi_slopes,
                              mask_mod=mask_mod, **dropout)  # fmt: skip
    # Token t of sequence s sits at (s, t − cu_q[s]) of the padded batch.
    flat = xp.padded_position(cu_q, q.shape[0], max(max_q, 1))
    out = xp.take_rows(out_pad.reshape(count * max(max_q, 1), *out_pad.shape[2:]), flat)
    if not return_lse:
        return out
    lse_rows = xp.swap(lse_pad, 1, 2).reshape(count * max(max_q, 1), lse_pad.shape[1])  # (n·max_q, Hq)
    return out, xp.swap(xp.take_rows(lse_rows, flat), 0, 1)


class _TorchArrays:
    def __init__(self) -> None:
        import torch

        self.torch = torch

    def sequence_of(self, offsets: Any, total: int) -> Any:
        positions = self.torch.arange(total, device=offsets.device, dtype=offsets.dtype)
        return self.torch.searchsorted(offsets[1:].contiguous(), positions, right=True)

    def pad_sequences(self, x: Any, offsets: Any, width: int) -> tuple[Any, Any]:
        lengths = offsets[1:] - offsets[:-1]
        index = offsets[:-1, None].long() + self.torch.arange(width, device=x.device)
        index = index.clamp(0, max(x.shape[0] - 1, 0))  # past a sequence's end: padding, never read (§4.3)
        if x.shape[0] == 0:
            return x.new_zeros(index.shape[0], width, *x.shape[1:]), lengths
        return x[index], lengths

    def padded_position(self, offsets: Any, total: int, width: int) -> Any:
        sequence = self.sequence_of(offsets, total).long()
        positions = self.torch.arange(total, device=offsets.device)
        return sequence * width + positions - offsets.long()[sequence]

    def take_rows(self, x: Any, index: Any) -> Any:
        return x[index]

    def swap(self, x: Any, a: int, b: int) -> Any:
        return x.transpose(a, b)


class _JaxArrays:
    def __init__(self) -> None:
        import jax.numpy as jnp

        self.jnp = jnp

    def sequence_of(self, offsets: Any, total: int) -> Any:
        return self.jnp.searchsorted(offsets[1:], self.jnp.arange(total, dtype=offsets.dtype), side="right")

    def pad_sequences(self, x: Any, offsets: Any, width: int) -> tuple[Any, Any]:
        lengths = offsets[1:] - offsets[:-1]
        if x.shape[0] == 0:
            return self.jnp.zeros((offsets.shape[0] - 1, width, *x.shape[1:]), x.dtype), lengths
        index = offsets[:-1, None] + self.jnp.arange(width, dtype=offsets.dtype)
        return x[self.jnp.clip(index, 0, x.shape[0] - 1)], lengths

    def padded_position(self, offsets: Any, total: int, width: int) -> Any:
        sequence = self.sequence_of(offsets, total)
        return sequence * width + self.jnp.arange(total, dtype=offsets.dtype) - offsets[sequence]

    def take_rows(self, x: Any, index: Any) -> Any:
        return x[index]

    def swap(self, x: Any, a: int, b: int) -> Any:
        return self.jnp.swapaxes(x, a, b)


def _array_namespace(ops: FrameworkOps) -> Any:
    return _TorchArrays() if ops.framework.value == "torch" else _JaxArrays()


# ---------------------------------------------------------------------------------------------------------------
# attend_paged (§13)


def prepare_paged(
    spec: AttentionSpec, q: Any, k_cache: Any, v_cache: Any, block_table: Any, kv_lengths: Any, return_lse: bool,
    alibi_slopes: Any = None,
) -> tuple[Problem, PagedInputs]:  # fmt: skip
    """Check every argument of an attend_paged call (§13), values included; the call as a Problem."""
    if type(spec) is not AttentionSpec:
        raise InvalidInputTypeError(f"spec must be an attnkit.AttentionSpec, got {type(spec).__name__}")
    ops = ops_for(q, "q")
    _check_array(ops, "q", q, FLOATING, "a floating dtype")
    _check_like_q(ops, q, {"k_cache": k_cache, "v_cache": v_cache})
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            expected = "(num_blocks, block_size, Hkv, D)" if name != "q" else f"4-D ({spec.layout.value})"
            raise InvalidInputError(f"{name} must be {expected}, got shape {tuple(x.shape)}")
    _check_heads((q.shape[2], q.shape[3]) if spec.layout is Layout.BSHD else (q.shape[1], q.shape[3]),
                 tuple(k_cache.shape), tuple(v_cache.shape), "_cache")  # fmt: skip
    batch = q.shape[0]
    len_q = q.shape[1] if spec.layout is Layout.BSHD else q.shape[2]
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    if block_size == 0:
        raise InvalidInputError("k_cache has block_size=0 (shape[1]), expected a positive block size")
    _check_array(ops, "block_table", block_table, INTEGER, "an integer dtype (int32)")
    if block_table.ndim != 2 or block_table.shape[0] != batch:
        raise InvalidInputError(
            f"block_table has shape {tuple(block_table.shape)}, expected (B, max_blocks)=({batch}, ·)"
        )
    _check_array(ops, "kv_lengths", kv_lengths, INTEGER, "an integer dtype")
    if tuple(kv_lengths.shape) != (batch,):
        raise InvalidInputError(f"kv_lengths has shape {tuple(kv_lengths.shape)}, expected (batch,)=({batch},)")
    for name, x in (("block_table", block_table), ("kv_lengths", kv_lengths)):
        if ops.device(x) != ops.device(q):
            raise InvalidInputTypeError(f"{name} is on device {ops.device(x)}, expected q's device {ops.device(q)}")
    capacity = block_table.shape[1] * block_size
    table_values, length_values = ops.host_values(block_table), ops.host_values(kv_lengths)
    if table_values is not None and length_values is not None:  # under jax.jit they are traced: unchecked (§11)
        _check_table(table_values, length_values, num_blocks, block_size, capacity)
    heads_q = q.shape[2] if spec.layout is Layout.BSHD else q.shape[1]
    if alibi_slopes is not None:
        alibi_slopes = checked_slopes(ops, alibi_slopes, batch, heads_q, ops.device(q), check_values=True)
    inputs = PagedInputs(q, k_cache, v_cache, block_table, kv_lengths, alibi_slopes)
    if ops.needs_grad(AttentionInputs(q, k_cache, v_cache))[0]:  # torch with grad on; JAX differentiates later
        name = next(name for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)) if x.requires_grad)
        raise InvalidInputError(
            f"{name} requires grad, but attend_paged is forward only (docs/semantics.md §13): call it under "
            "torch.no_grad() or pass detached tensors"
        )
    problem = Problem(
        framework=ops.framework,
        device=ops.device(q),
        dtype=ops.dtype_name(q),
        batch=batch,
        heads_q=heads_q,
        heads_kv=k_cache.shape[2],
        len_q=len_q,
        len_k=capacity,
        head_dim=q.shape[3],
        head_dim_v=v_cache.shape[3],
        has_kv_lengths=True,
        return_lse=return_lse,
        paged_block_size=block_size,
        has_alibi=alibi_slopes is not None,
    )
    return problem, inputs


def _check_table(table: np.ndarray, lengths: np.ndarray, num_blocks: int, block_size: int, capacity: int) -> None:
    if lengths.size and (lengths.min() < 0 or lengths.max() > capacity):
        b = int(np.argmax((lengths < 0) | (lengths > capacity)))
        raise InvalidInputError(
            f"kv_lengths[{b}]={lengths[b]} lies outside [0, {capacity}] (max_blocks={table.shape[1]} blocks of "
            f"{block_size} slots)"
        )
    used = np.arange(table.shape[1])[None, :] < -(-lengths[:, None] // block_size)  # ⌈kv_len / block_size⌉ blocks
    outside = used & ((table < 0) | (table >= num_blocks))
    if outside.any():
        b, j = (int(x) for x in np.argwhere(outside)[0])
        raise InvalidInputError(
            f"block_table[{b}, {j}]={table[b, j]} points outside the cache (num_blocks={num_blocks}); sequence {b} "
            f"reads its first {math.ceil(lengths[b] / block_size)} blocks"
        )


def attend_paged(
    spec: AttentionSpec,
    q: Any,
    k_cache: Any,
    v_cache: Any = ...,  # required, as the two below: a call without a spec (flash-attn's) says what to write instead
    block_table: Any = ...,
    kv_lengths: Any = ...,
    *,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: Any = None,
    alibi_slopes: Any = None,
    mask_mod: Any = None,
    dropout_p: float = 0.0,
    **peer_kwargs: Any,
) -> Any:
    """Attention of new queries against a paged KV cache (docs/semantics.md §13): exactly attend(spec, q, K_b, V_b,
    kv_lengths=kv_lengths) on the keys the block table gathers, which backends declaring ``paged`` read where the
    blocks lie. Key j of sequence b is slot ``j mod block_size`` of block ``block_table[b, j // block_size]``; causal
    aligns bottom-right by default, so the Lq new queries are the sequence's last Lq positions. Forward only.

    :param spec: the call's spec; its ``layout`` is q's.
    :param q: (B, Hq, Lq, D) with layout ``"bhsd"``, (B, Lq, Hq, D) with ``"bshd"``; floating.
    :param k_cache: (num_blocks, block_size, Hkv, D), q's dtype.
    :param v_cache: (num_blocks, block_size, Hkv, Dv), q's dtype.
    :param block_table: int32 (B, max_blocks): the blocks of each sequence, in order; entries past a sequence's last
        block are never read (−1 is customary), and every entry that is read lies in [0, num_blocks).
    :param kv_lengths: integer (B,): each sequence's key count, at most ``max_blocks · block_size``.
    :param return_lse: also return lse.
    :param backend: ``"auto"`` or a registered name that declares ``paged``, as for :func:`attend`.
    :param sinks: (Hq,), as attend takes them (§15).
    :param alibi_slopes: float32 (Hq,) or (B, Hq), as attend takes them (§16), at distances between positions in the
        sequence.
    :param mask_mod: a mask program (§17) that sees ``kv_idx`` as the key's logical position; a call with one
        gathers the blocks it names (a copy of the sequences' keys, never an (Lq, Lk) mask) and runs attend on them.
    :param dropout_p: 0 only (a training model's dropout layer may pass its rate, 0 in evaluation).
    :returns: out, or (out, lse), as attend returns them for q.
    :raises attnkit.InvalidInputError: a block table entry outside the cache, a length past the table, or
        ``dropout_p > 0``.
    :raises attnkit.UnexpectedArgumentError: a call written as another library writes it (``cache_seqlens=``,
        ``causal=``), or an unknown keyword: the message says what to write instead.
    """
    if type(spec) is not AttentionSpec or v_cache is ... or block_table is ... or kv_lengths is ... or peer_kwargs:
        positional = {"v_cache": v_cache, "block_table": block_table, "kv_lengths": kv_lengths}
        raise spellings.call_error(attend_paged, spec, positional, peer_kwargs, AttentionSpec)
    if checked_probability(dropout_p) > 0:
        raise InvalidInputError(
            f"dropout_p={dropout_p}, but attend_paged is forward-only inference over a KV cache (docs/semantics.md "
            "§13), where attention dropout does not apply: pass dropout_p=0, or call attend to train with dropout"
        )
    if mask_mod is not None:
        return _paged_with_program(spec, q, k_cache, v_cache, block_table, kv_lengths, return_lse, backend, sinks,
                                   alibi_slopes, mask_mod)  # fmt: skip
    if sinks is not None:
        check_sinks(ops_for(q, "q"), spec, q, sinks)
    need_lse = return_lse or sinks is not None
    problem, inputs = prepare_paged(spec, q, k_cache, v_cache, block_table, kv_lengths, need_lse, alibi_slopes)
    chosen = dispatch.select(spec, problem, backend)
    forward_paged = getattr(chosen, "forward_paged")  # noqa: B009  # the method of Feature.PAGED (attnkit.backend)
    run = functools.partial(forward_paged, spec, need_lse=need_lse)
    out, lse = ops_for(q).forward_only("attend_paged (docs/semantics.md §13)", run, inputs)
    if sinks is not None:
        out, lse = with_sinks(spec, out, lse, sinks)
    return (out, lse) if return_lse else out


def _paged_with_program(
    spec: AttentionSpec, q: Any, k_cache: Any, v_cache: Any, block_table: Any, kv_lengths: Any, return_lse: bool,
    backend: str, sinks: Any, alibi_slopes: Any, mask_mod: Any,
) -> Any:  # fmt: skip
    """attend_paged with a mask program: every argument checked as attend_paged checks it, then attend on the keys in
    logical order (no backend reads a program from paged blocks yet)."""
    ops = ops_for(q, "q")
    prepare_paged(spec, q, k_cache, v_cache, block_table, kv_lengths, return_lse, alibi_slopes)
    if ops.framework is Framework.TORCH:
        from attnkit.contract.torch import gather_pages
    else:
        from attnkit.contract.jax import gather_pages  # type: ignore[assignment]
    keys, values = (gather_pages(cache, block_table) for cache in (k_cache, v_cache))  # (B, capacity, Hkv, D)
    if spec.layout is Layout.BHSD:
        keys, values = (x.swapaxes(1, 2) for x in (keys, values))
    return attend(spec, q, keys, values, kv_lengths=kv_lengths, return_lse=return_lse, backend=backend,
                  sinks=sinks, alibi_slopes=alibi_slopes, mask_mod=mask_mod)  # fmt: skip


def explain_paged(
    spec: AttentionSpec, q: Any, k_cache: Any, v_cache: Any, block_table: Any, kv_lengths: Any, *,
    return_lse: bool = False, alibi_slopes: Any = None,
) -> str:  # fmt: skip
    """The dispatch table of an attend_paged call, without running it."""
    from attnkit.api import explain_problem

    problem, _ = prepare_paged(spec, q, k_cache, v_cache, block_table, kv_lengths, return_lse, alibi_slopes)
    return explain_problem(spec, problem)
