"""The contract's geometry in jax.numpy (docs/semantics.md §3–§5), written once for the JAX backends.

jax-reference, jax-xla and pallas take their visibility, padding and cosine normalisation from here. The band is
:func:`attnkit.contract.diagonal_band` and the offset :func:`attnkit.contract.alignment_offset`, which serves per
batch element as it is: given arrays of lengths it returns an array of offsets. Lengths and segment ids may be
tracers; nothing here reads their values. The pallas kernels, whose band is per batch element and traced, call
:func:`attnkit.contract.within_band`, :func:`length_visibility` and :func:`segment_visibility` inside the kernel.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from attnkit.backend import AttentionSpec
from attnkit.contract import COSINE_EPS, alignment_offset, conjoin, diagonal_band, within_band
from attnkit.contract.philox import MULTIPLIERS, ROUNDS, WEYL

# The visibility helpers return a boolean array, or None where they hide nothing (typed Any, as jnp results are);
# attnkit.contract.conjoin joins them.


def band_visibility(spec: AttentionSpec, i: Any, j: Any, q_len: Any, kv_len: Any) -> Any:
    """Causal and window (§4) for query indices ``i`` and key indices ``j`` (broadcast against each other), aligned
    by the lengths (ints, or per batch element arrays that broadcast against i and j); None when the spec has
    neither."""
    band = diagonal_band(spec)
    if band == (None, None):
        return None
    return within_band(j - i - alignment_offset(spec, q_len, kv_len), *band)


def alibi_distance(spec: AttentionSpec, i: Any, j: Any, q_len: Any, kv_len: Any) -> Any:
    """|i + off − j|, the distance ALiBi's slopes multiply (§16), aligned by the lengths as :func:`band_visibility`."""
    return jnp.abs(i + alignment_offset(spec, q_len, kv_len) - j)


def length_visibility(i: Any, j: Any, q_len: Any, kv_len: Any) -> Any:
    """i < q_len and j < kv_len (§5); a None length limits nothing on its side, and None comes back when neither
    does."""
    return conjoin(None if q_len is None else i < q_len, None if kv_len is None else j < kv_len)


def segment_visibility(q_ids: Any, kv_ids: Any) -> Any:
    """q_ids == kv_ids >= 0 (§4.5) for query ids and key ids already shaped to broadcast against each other (e.g.
    (…, Lq, 1) and (…, 1, Lk)); None when there are no ids (both or neither, as validation makes them)."""
    if q_ids is None:
        return None
    return (q_ids == kv_ids) & (q_ids >= 0)


def zero_padding(x: Any, lengths: Any, axis: int, segment_ids: Any = None) -> Any:
    """x with the padding along ``axis`` set to 0 (batch is axis 0): positions at or beyond lengths[b], and those
    whose segment id (B, L) is negative (§4.5). Padding is not input (§5): zeroed, its garbage (NaN included) cannot
    leak through 0·NaN."""
    keep = conjoin(
        None if lengths is None else jnp.arange(x.shape[axis]) < lengths.reshape(-1, 1),
        None if segment_ids is None else segment_ids >= 0,
    )
    return x if keep is None else _zero_where_not(x, keep, axis)


def _zero_where_not(x: Any, keep: Any, axis: int) -> Any:
    """x with 0 where ``keep`` (B|1, L), laid along batch (axis 0) and ``axis``, is False."""
    axis %= x.ndim
    keep = keep.reshape(keep.shape[0], *([1] * (axis - 1)), keep.shape[1], *([1] * (x.ndim - 1 - axis)))
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


class Normalization(NamedTuple):
    """x̂ = x / max(‖x‖, eps) along the last axis, with what its backward reads."""

    unit: Any
    denominator: Any  # max(‖x‖, eps)
    norm: Any  # ‖x‖


def normalize(x: Any) -> Normalization:
    """The cosine variant's unit rows (§3), in x's dtype; as torch.nn.functional.normalize."""
    norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    denominator = jnp.maximum(norm, COSINE_EPS)
    return Normalization(x / denominator, denominator, norm)


def normalize_backward(normalization: Normalization, d_unit: Any) -> Any:
    """dx from dx̂: (dx̂ − x̂ (x̂·dx̂)) / ‖x‖. Below eps the denominator is a constant and only the division
    contributes (no NaN for a zero vector); at a tie torch's clamp_min passes the gradient through the norm, and
    so does this."""
    unit, denominator, norm = normalization
    radial = jnp.where(norm >= COSINE_EPS, jnp.sum(unit * d_unit, axis=-1, keepdims=True), 0)
    return (d_unit - unit * radial) / denominator


def gather_pages(cache: Any, block_table: Any) -> Any:
    """A paged cache (num_blocks, block_size, H, D) read through ``block_table`` (B, max_blocks) as contiguous keys
    (B, max_blocks · block_size, H, D), key j of sequence b being slot j mod block_size of block table[b, j //
    block_size] (§13); attnkit.contract.torch.gather_pages in jax.numpy. Entries past a sequence's blocks may hold
    anything (the table may be traced): clamped into the cache, the slots they give lie past kv_lengths, padding.
    A copy of every block the table names: the literal reading, not a fused path."""
    batch, max_blocks = block_table.shape
    table = jnp.clip(block_table, 0, max(cache.shape[0] - 1, 0))
    return cache[table].reshape(batch, max_blocks * cache.shape[1], *cache.shape[2:])


def merge_partials(out: Any, lse: Any, seq_axis: int) -> tuple[Any, Any]:
    """§6's merge of partial results over disjoint key ranges, stacked on a leading axis: out (S, B, …, Dv) with its
    sequence axis at ``seq_axis`` + 1 (q's layout: 1 for bshd, 2 for bhsd), lse (S, B, H, L) float32. Returns out
    float32 and lse. An empty part (lse −inf) weighs 0; where all are empty, lse is −inf and out 0; NaN propagates.
    Differentiable through out and lse: in an all-empty row no log(0) or −inf − (−inf) is even computed (jnp.where
    passes NaN gradients from the branch it discards), so that row's gradients are 0 (§5)."""
    top = jnp.max(lse, axis=0)
    empty = top == -jnp.inf
    shift = jnp.where(empty, 0.0, top)
    total_sum = jnp.sum(jnp.exp(lse - shift), axis=0)
    total = jnp.where(empty, -jnp.inf, shift + jnp.log(jnp.where(empty, 1.0, total_sum)))
    weights = jnp.where(empty, 0.0, jnp.exp(lse - jnp.where(empty, 0.0, total)))
    if seq_axis == 1:  # (S, B, H, L) -> (S, B, L, H), along bshd rows
        weights = jnp.swapaxes(weights, 2, 3)
    return jnp.sum(weights[..., None] * out.astype(jnp.float32), axis=0), total


def _mulhilo(multiplier: int, word: Any) -> tuple[Any, Any]:
    """(high, low) uint32 words of multiplier · word from 16-bit halves: no 64-bit type is needed (JAX without x64,
    Pallas)."""
    a_hi, a_lo = jnp.uint32(multiplier >> 16), jnp.uint32(multiplier & 0xFFFF)
    b_hi, b_lo = word >> 16, word & jnp.uint32(0xFFFF)
    low_low, low_high, high_low = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo
    carry = (low_low >> 16) + (low_high & jnp.uint32(0xFFFF)) + (high_low & jnp.uint32(0xFFFF))
    return a_hi * b_hi + (low_high >> 16) + (high_low >> 16) + (carry >> 16), word * jnp.uint32(multiplier)


def philox4x32(counter: tuple[Any, Any, Any, Any], key: tuple[Any, Any]) -> tuple[Any, Any, Any, Any]:
    """Philox4x32-10 (attnkit.contract.philox, the reference) on uint32 arrays that broadcast together."""
    c0, c1, c2, c3 = (jnp.asarray(word).astype(jnp.uint32) for word in counter)
    k0, k1 = (jnp.asarray(word).astype(jnp.uint32) for word in key)
    for round_ in range(ROUNDS):
        if round_:
            k0, k1 = k0 + jnp.uint32(WEYL[0]), k1 + jnp.uint32(WEYL[1])
        hi0, lo0 = _mulhilo(MULTIPLIERS[0], c0)
        hi1, lo1 = _mulhilo(MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def dropout_keep(seed_low: Any, seed_high: Any, threshold: int, b: Any, h: Any, i: Any, j: Any) -> Any:
    """§18's keep decision for batch rows ``b``, query heads ``h``, queries ``i`` and keys ``j`` (integer arrays that
    broadcast together, indices into the unsharded sequence); the seed as its two uint32 words. Each element
    computes its own counter's four words and takes word j & 3 (no reshapes: Pallas kernels call it too)."""
    j = jnp.asarray(j).astype(jnp.uint32)
    words = philox4x32((j >> 2, i, h, b), (seed_low, seed_high))
    lane = j & jnp.uint32(3)
    word = jnp.where(lane == 0, words[0], jnp.where(lane == 1, words[1], jnp.where(lane == 2, words[2], words[3])))
    return word >= jnp.uint32(threshold)
