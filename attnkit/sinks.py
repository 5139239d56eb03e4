"""Attention sinks (docs/semantics.md §15): one logit per query head that joins every row's softmax as an extra
column and is then dropped. Composed with any backend's differentiable (out, lse) by the merge of §6, in the caller's
framework, so every backend serves it and ``dsinks`` comes from the framework's own autodiff:

    lse = logaddexp(lse₀, s)          out = out₀ · σ(lse₀ − s)        (= out₀ · exp(lse₀ − lse))

Rows that are padding (past q_lengths, or a negative segment id) get no sink: their lse stays −∞ and they add nothing
to dsinks. Written with ``where`` so that no NaN is formed in a branch autodiff walks back through (an empty row's
lse₀ = −∞ meets a finite sink; a padding row's −∞ meets the −∞ that stands for no sink).
"""

from __future__ import annotations

import functools
from typing import Any

from attnkit.errors import InvalidInputError, InvalidInputTypeError
from attnkit.frontends import FLOATING, FrameworkOps
from attnkit.spec import AttentionSpec, Layout


def query_heads(spec: AttentionSpec, q: Any) -> int:
    """Hq of a call's q as given: 1 for a 3-D call, else the layout's head axis."""
    if len(q.shape) == 3:
        return 1
    return int(q.shape[2] if spec.layout is Layout.BSHD else q.shape[1])


def check_sinks(ops: FrameworkOps, spec: AttentionSpec, q: Any, sinks: Any) -> None:
    """§15's errors: an array of q's framework, floating, of shape (Hq,), on q's device."""
    if not ops.is_array(sinks):
        raise InvalidInputTypeError(
            f"sinks must be a {ops.framework.value} array like q (one logit per query head), "
            f"got {type(sinks).__module__}.{type(sinks).__qualname__}"
        )
    dtype = ops.dtype_name(sinks)
    if dtype not in FLOATING:
        raise InvalidInputTypeError(
            f"sinks has dtype {dtype}, expected a floating dtype ({', '.join(sorted(FLOATING))})"
        )
    expected = (query_heads(spec, q),)
    if tuple(sinks.shape) != expected:
        raise InvalidInputError(
            f"sinks has shape {tuple(sinks.shape)}, expected (Hq,)={expected}: one logit per query head"
        )
    if ops.device(sinks) != ops.device(q):
        raise InvalidInputTypeError(f"sinks is on device {ops.device(sinks)}, expected q's device {ops.device(q)}")


def with_sinks(
    spec: AttentionSpec, out: Any, lse: Any, sinks: Any, q_lengths: Any = None, q_segment_ids: Any = None,
    positions: Any = None,
) -> tuple[Any, Any]:  # fmt: skip
    """(out, lse) of the call with ``sinks`` from ``(out₀, lse₀)`` of the call without them (§15), in the caller's
    framework and shapes: out in its layout and dtype, lse as the call's (§6) (B, Hq, Lq) or (B, Lq) for 3-D calls.
    ``positions``: the place in the sequence of each of lse's rows, which ``q_lengths`` count (a sharded call's
    local rows, §14); None: 0..Lq−1."""
    bshd = spec.layout is Layout.BSHD
    if type(out).__module__.startswith("torch"):
        return _composed(bshd, out, lse, sinks, q_lengths, q_segment_ids, positions)
    return _jax_composed()(bshd, out, lse, sinks, q_lengths, q_segment_ids, positions)  # type: ignore[no-any-return]


@functools.cache
def _jax_composed() -> Any:
    """:func:`_composed` as one compiled JAX program per shape: eagerly, JAX compiles each of its dozen ops apart."""
    import jax

    return jax.jit(_composed, static_argnums=0)


def _composed(
    bshd: bool, out: Any, lse: Any, sinks: Any, q_lengths: Any, q_segment_ids: Any, positions: Any
) -> tuple[Any, Any]:
    xp, sigmoid, cast, arange, wide = _namespace(out)
    # The per-row factors and dsinks' sum over rows in the widest float (they are (B, Hq, Lq), cheap; in float32 a
    # gpt-oss layer's dsinks missed the tolerance against eager's softmax backward); out itself in its compute dtype.
    out_wide = xp.float64 if out.dtype == xp.float64 else xp.float32
    three_d = len(lse.shape) == 2
    sink = cast(sinks, wide).reshape((1, 1) if three_d else (1, -1, 1))
    lse0 = cast(lse, wide)
    rows = arange(lse.shape[-1], lse) if positions is None else positions
    in_play = _rows_in_play(rows, lse.shape[0], q_lengths, q_segment_ids)
    if in_play is None:
        kept, lse_new = sigmoid(lse0 - sink), xp.logaddexp(lse0, sink)
    else:
        play = in_play if three_d else in_play[:, None, :]
        lse_in = xp.where(play, lse0, 0.0)
        sink_in = xp.where(play, sink, float("-inf"))  # no sink: weight 0, lse unchanged
        kept = sigmoid(lse_in - sink_in)
        lse_new = xp.where(play, xp.logaddexp(lse_in, sink_in), lse0)
    if not three_d and bshd:
        kept = kept.swapaxes(1, 2)
    return cast(cast(out, out_wide) * cast(kept, out_wide)[..., None], out.dtype), cast(lse_new, lse.dtype)


def _rows_in_play(rows: Any, batch: int, q_lengths: Any, q_segment_ids: Any) -> Any:
    """(B, Lq) True where a row (``rows``: the rows' positions) is a query, not padding; None when every row is
    one."""
    in_play = None
    if q_lengths is not None:
        in_play = rows[None, :] < q_lengths.reshape(batch, 1)
    if q_segment_ids is not None:
        real = q_segment_ids.reshape(batch, rows.shape[0]) >= 0
        in_play = real if in_play is None else in_play & real
    return in_play


def _namespace(x: Any) -> tuple[Any, Any, Any, Any, Any]:
    """(array namespace, sigmoid, cast, arange(n, like), its widest float) of x's framework."""
    if type(x).__module__.startswith("torch"):
        import torch

        return (torch, torch.sigmoid, lambda array, dtype: array.to(dtype),
                lambda n, like: torch.arange(n, device=like.device), torch.float64)  # fmt: skip
    import jax
    import jax.numpy as jnp

    widest = jnp.float64 if jax.config.read("jax_enable_x64") else jnp.float32
    return jnp, jax.nn.sigmoid, lambda array, dtype: array.astype(dtype), lambda n, like: jnp.arange(n), widest
