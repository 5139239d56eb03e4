"""The contract's geometry in jax.numpy (docs/semantics.md §3–§5), written once for the JAX backends.

jax-reference, jax-xla and pallas take their visibility, padding and cosine normalisation from here. The band is
:func:`attnkit.contract.diagonal_band` and the offset :func:`attnkit.contract.alignment_offset`, which serves per
batch element as it is: given arrays of lengths it returns an array of offsets. Lengths may be tracers; nothing
here reads their values. The pallas kernels, whose band is per batch element and traced, call
:func:`attnkit.contract.within_band` and :func:`length_visibility` inside the kernel with that band.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from attnkit.backend import AttentionSpec
from attnkit.contract import COSINE_EPS, alignment_offset, conjoin, diagonal_band, within_band

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


def length_visibility(i: Any, j: Any, q_len: Any, kv_len: Any) -> Any:
    """i < q_len and j < kv_len (§5); a None length limits nothing on its side, and None comes back when neither
    does."""
    return conjoin(None if q_len is None else i < q_len, None if kv_len is None else j < kv_len)


def zero_padding(x: Any, lengths: Any, axis: int) -> Any:
    """x with the positions along ``axis`` at or beyond lengths[b] set to 0 (batch is axis 0). Padding is not
    input (§5): zeroed, its garbage (NaN included) cannot leak through 0·NaN."""
    if lengths is None:
        return x
    axis %= x.ndim
    positions = jnp.arange(x.shape[axis]).reshape(-1, *([1] * (x.ndim - 1 - axis)))
    return jnp.where(positions < lengths.reshape(-1, *([1] * (x.ndim - 1))), x, jnp.zeros((), x.dtype))


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
