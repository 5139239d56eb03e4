"""Validation of an attend() call: every argument checked, 3-D calls brought to 4-D, and the call described as a
:class:`Problem`. Shared by attend(), explain() and the graph operators that run calls traced by a compiler."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from attnkit import programs
from attnkit.backend import AttentionInputs, Dropout, Problem, dropout_threshold
from attnkit.errors import InvalidInputError, InvalidInputTypeError
from attnkit.frontends import FLOATING, INTEGER, FrameworkOps, ops_for
from attnkit.spec import AttentionSpec, Layout


def _broadcastable(argument: str, shape: tuple[int, ...], target: tuple[int, ...], names: str) -> None:
    if len(shape) > len(target) or any(size not in (1, want) for size, want in zip(shape[::-1], target[::-1])):
        raise InvalidInputError(
            f"{argument} has shape {tuple(shape)}, expected a shape broadcastable to {names}={target}"
        )


def prepare(
    spec: AttentionSpec,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    bias: Any,
    q_lengths: Any,
    kv_lengths: Any,
    return_lse: bool,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    alibi_slopes: Any = None,
    *,
    check_values: bool = True,
    mask_mod: Any = None,
    dropout_p: Any = 0.0,
    dropout_seed: Any = None,
    dropout_key: Any = None,
) -> tuple[FrameworkOps, Problem, AttentionInputs, bool]:
    """Check every argument, and bring 3-D calls to 4-D. Returns (ops, problem, inputs, was_3d). ``mask_mod`` is
    traced (or its trace reused) and bound to the call (attnkit/programs.py).

    ``check_values=False`` reads metadata only, for tensors that have no values (meta and fake tensors, a
    compiler's trace): the length ranges are then checked where the call runs."""
    if not isinstance(spec, AttentionSpec):
        raise InvalidInputTypeError(f"spec must be an attnkit.AttentionSpec, got {type(spec).__name__}")
    ops = ops_for(q, "q")
    for name, tensor in (("k", k), ("v", v)):
        if not ops.is_array(tensor):
            raise InvalidInputTypeError(
                f"{name} must be the same kind of array as q ({ops.framework.value}), got {type(tensor).__name__}"
            )
    dtype = ops.dtype_name(q)
    if dtype not in FLOATING:
        raise InvalidInputTypeError(f"q has dtype {dtype}, expected a floating dtype ({', '.join(sorted(FLOATING))})")
    for name, tensor in (("k", k), ("v", v)):
        if ops.dtype_name(tensor) != dtype:
            raise InvalidInputTypeError(f"{name} has dtype {ops.dtype_name(tensor)}, expected q's dtype {dtype}")
    device = ops.device(q)
    for name, tensor in (("k", k), ("v", v)):
        if ops.device(tensor) != device:
            raise InvalidInputTypeError(f"{name} is on device {ops.device(tensor)}, expected q's device {device}")

    ndim = q.ndim
    if ndim not in (3, 4) or k.ndim != ndim or v.ndim != ndim:
        raise InvalidInputError(
            f"q, k, v must all be 4-D ({spec.layout.value}) or all 3-D (B, L, D); "
            f"got q.ndim={q.ndim}, k.ndim={k.ndim}, v.ndim={v.ndim}"
        )
    was_3d = ndim == 3
    head_axis = 1 if spec.layout is Layout.BHSD else 2
    if was_3d:
        q, k, v = (ops.reshape(t, (*t.shape[:head_axis], 1, *t.shape[head_axis:])) for t in (q, k, v))
    try:
        batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v = _geometry(q, k, v, head_axis)
    except InvalidInputError as error:
        other = Layout.BSHD if spec.layout is Layout.BHSD else Layout.BHSD
        if was_3d or not _fits(q, k, v, 3 - head_axis):
            raise
        raise InvalidInputError(
            f"{error} (reading q, k, v as layout={spec.layout.value!r}); in layout={other.value!r} these shapes fit: "
            f"pass AttentionSpec(layout={other.value!r}) if they are {_LAYOUT_AXES[other]}"
        ) from error

    full = (batch, heads_q, len_q, len_k)
    if mask is not None:
        if not ops.is_array(mask):
            raise InvalidInputTypeError(f"mask must be a {ops.framework.value} array, got {type(mask).__name__}")
        if ops.dtype_name(mask) != "bool":
            raise InvalidInputTypeError(
                f"mask has dtype {ops.dtype_name(mask)}, expected bool (True = may attend); an additive float mask "
                "(0 and −inf, or any scores to add) goes in bias="
            )
        mask = _to_4d(ops, "mask", mask, full, was_3d)
    if bias is not None:
        if not ops.is_array(bias):
            raise InvalidInputTypeError(f"bias must be a {ops.framework.value} array, got {type(bias).__name__}")
        if ops.dtype_name(bias) not in FLOATING:
            raise InvalidInputTypeError(f"bias has dtype {ops.dtype_name(bias)}, expected a floating dtype")
        bias = _to_4d(ops, "bias", bias, full, was_3d)
    for name, lengths, limit in (("q_lengths", q_lengths, len_q), ("kv_lengths", kv_lengths, len_k)):
        if lengths is None:
            continue
        if not ops.is_array(lengths):
            raise InvalidInputTypeError(
                f"{name} must be a {ops.framework.value} integer array of shape (B,) on q's device (e.g. "
                f"{_ARRAY_EXAMPLE[ops.framework.value]}), got {type(lengths).__name__}"
            )
        if ops.dtype_name(lengths) not in INTEGER:
            raise InvalidInputTypeError(f"{name} has dtype {ops.dtype_name(lengths)}, expected an integer dtype")
        if tuple(lengths.shape) != (batch,):
            raise InvalidInputError(f"{name} has shape {tuple(lengths.shape)}, expected (batch,)=({batch},)")
        if ops.device(lengths) != device:
            raise InvalidInputTypeError(f"{name} is on device {ops.device(lengths)}, expected q's device {device}")
        if check_values:
            _check_range(ops, name, lengths, limit)
    for name, tensor in (("mask", mask), ("bias", bias)):
        if tensor is not None and ops.device(tensor) != device:
            raise InvalidInputTypeError(f"{name} is on device {ops.device(tensor)}, expected q's device {device}")
    _check_segment_ids(ops, q_segment_ids, kv_segment_ids, batch, len_q, len_k, device)
    if alibi_slopes is not None:
        alibi_slopes = checked_slopes(ops, alibi_slopes, batch, heads_q, device, check_values)

    program = None
    if mask_mod is not None:  # (the tracers are imported by the first trace)
        program = programs.bind(mask_mod, ops, q, batch, heads_q, len_q, len_k)
    dropout = checked_dropout(ops, dropout_p, dropout_seed, dropout_key, q)
    inputs = AttentionInputs(
        q, k, v, mask, bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, alibi_slopes, program, dropout
    )
    needs_grad, needs_bias_grad = ops.needs_grad(inputs)
    problem = Problem(
        framework=ops.framework,
        device=device,
        dtype=dtype,
        batch=batch,
        heads_q=heads_q,
        heads_kv=heads_kv,
        len_q=len_q,
        len_k=len_k,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        has_mask=mask is not None,
        has_bias=bias is not None,
        has_q_lengths=q_lengths is not None,
        has_kv_lengths=kv_lengths is not None,
        needs_grad=needs_grad,
        needs_bias_grad=needs_bias_grad,
        return_lse=return_lse,
        has_segment_ids=q_segment_ids is not None,
        has_alibi=alibi_slopes is not None,
        has_mask_program=program is not None,
        has_dropout=dropout is not None,
    )
    return ops, problem, inputs, was_3d


_ARRAY_EXAMPLE = {"torch": "torch.tensor([512, 300])", "jax": "jnp.array([512, 300])"}
_LAYOUT_AXES = {Layout.BHSD: "(B, H, L, D)", Layout.BSHD: "(B, L, H, D)"}


def _geometry(q: Any, k: Any, v: Any, head_axis: int) -> tuple[int, ...]:
    """(B, Hq, Hkv, Lq, Lk, D, Dv) of 4-D q, k, v read with heads on ``head_axis``; InvalidInputError naming the
    first shape that does not fit."""
    seq_axis = 3 - head_axis
    batch, heads_q, len_q, head_dim = q.shape[0], q.shape[head_axis], q.shape[seq_axis], q.shape[3]
    batch_k, heads_kv, len_k, head_dim_k = k.shape[0], k.shape[head_axis], k.shape[seq_axis], k.shape[3]
    batch_v, heads_v, len_v, head_dim_v = v.shape[0], v.shape[head_axis], v.shape[seq_axis], v.shape[3]
    if batch_k != batch or batch_v != batch:
        raise InvalidInputError(f"batch sizes differ: q has {batch}, k has {batch_k}, v has {batch_v}")
    if head_dim_k != head_dim:
        raise InvalidInputError(f"k has head_dim={head_dim_k}, expected q's head_dim={head_dim}")
    if head_dim == 0 or head_dim_v == 0:
        raise InvalidInputError(f"{head_dim=} (q and k) and {head_dim_v=} (v) must both be positive")
    if len_v != len_k:
        raise InvalidInputError(f"v has {len_v} keys, expected k's {len_k}")
    if heads_v != heads_kv:
        raise InvalidInputError(f"v has num_heads_kv={heads_v}, expected k's {heads_kv}")
    if heads_q == 0 or heads_kv == 0:
        raise InvalidInputError(f"{heads_q=} and {heads_kv=} must both be positive")
    if heads_q % heads_kv:
        raise InvalidInputError(f"{heads_q=} (query heads) is not a multiple of {heads_kv=} (key/value heads)")
    return batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v


def _fits(q: Any, k: Any, v: Any, head_axis: int) -> bool:
    try:
        _geometry(q, k, v, head_axis)
    except InvalidInputError:
        return False
    return True


def _check_segment_ids(
    ops: FrameworkOps, q_ids: Any, kv_ids: Any, batch: int, len_q: int, len_k: int, device: str
) -> None:
    """§4.5: both or neither; integer arrays of the framework, (B, Lq) and (B, Lk), on q's device."""
    if (q_ids is None) != (kv_ids is None):
        given, missing = ("q_segment_ids", "kv_segment_ids") if kv_ids is None else ("kv_segment_ids", "q_segment_ids")
        raise InvalidInputError(f"{given} was given without {missing}: segment ids are given for both or neither")
    if q_ids is None:
        return
    for name, ids, length in (("q_segment_ids", q_ids, len_q), ("kv_segment_ids", kv_ids, len_k)):
        if not ops.is_array(ids):
            raise InvalidInputTypeError(f"{name} must be a {ops.framework.value} array, got {type(ids).__name__}")
        if ops.dtype_name(ids) not in INTEGER:
            raise InvalidInputTypeError(f"{name} has dtype {ops.dtype_name(ids)}, expected an integer dtype")
        if tuple(ids.shape) != (batch, length):
            which = "Lq" if name == "q_segment_ids" else "Lk"
            raise InvalidInputError(f"{name} has shape {tuple(ids.shape)}, expected (B, {which})=({batch}, {length})")
        if ops.device(ids) != device:
            raise InvalidInputTypeError(f"{name} is on device {ops.device(ids)}, expected q's device {device}")


def checked_slopes(ops: FrameworkOps, slopes: Any, batch: int, heads_q: int, device: str, check_values: bool) -> Any:
    """§16: float32 (Hq,) or (B, Hq) on q's device, finite and ≥ 0 (read eagerly), taking no gradient; returned as
    (1|B, Hq)."""
    if not ops.is_array(slopes):
        raise InvalidInputTypeError(
            f"alibi_slopes must be a {ops.framework.value} float32 array of shape (Hq,) or (B, Hq), got "
            f"{type(slopes).__name__}"
        )
    if ops.dtype_name(slopes) != "float32":
        raise InvalidInputTypeError(
            f"alibi_slopes has dtype {ops.dtype_name(slopes)}, expected float32 (as flash-attn takes them)"
        )
    if tuple(slopes.shape) not in ((heads_q,), (batch, heads_q)):
        raise InvalidInputError(
            f"alibi_slopes has shape {tuple(slopes.shape)}, expected (Hq,)=({heads_q},) or (B, Hq)=({batch}, {heads_q})"
        )
    if ops.device(slopes) != device:
        raise InvalidInputTypeError(f"alibi_slopes is on device {ops.device(slopes)}, expected q's device {device}")
    if getattr(slopes, "requires_grad", False):  # a torch tensor; JAX differentiates what the caller asks
        raise InvalidInputError(
            "alibi_slopes requires grad, but ALiBi slopes take no gradient (§16): pass alibi_slopes.detach()"
        )
    if check_values:
        values = ops.host_values(slopes)
        wrong = values[~((values >= 0) & np.isfinite(values))] if values is not None else ()
        if len(wrong):
            raise InvalidInputError(f"alibi_slopes must be finite and >= 0, got {np.unique(wrong)[:4].tolist()}")
    return ops.reshape(slopes, (1, heads_q)) if slopes.ndim == 1 else slopes


def checked_probability(p: Any) -> float:
    """§18's dropout_p: a real number in [0, 1) whose threshold round(p · 2³²) stays below 2³², as a float."""
    if not isinstance(p, numbers.Real) or isinstance(p, bool):
        raise InvalidInputTypeError(f"dropout_p must be a Python float in [0, 1), got {type(p).__name__}")
    p = float(p)
    # NaN and ±inf fail the comparisons (no math.isfinite: it cannot take a float torch.compile traces symbolically)
    if not (0 <= p < 1 and dropout_threshold(p) < 1 << 32):
        raise InvalidInputError(f"dropout_p={p} is outside [0, 1) (at 32 bits: below 1 − 2**-33)")
    return p


def checked_dropout(ops: FrameworkOps, p: Any, seed: Any, key: Any, q: Any) -> Dropout | None:
    """§18: ``p`` a Python float in [0, 1) whose threshold round(p · 2³²) stays below 2³², and the seed (or JAX key)
    in the framework's form (:meth:`FrameworkOps.dropout_seed`). None where p = 0: no dropout, and no seed drawn.

    ``seed`` may be a :class:`Dropout` of the same ``p``: the call is a part of a larger one (a block or head group
    of attnkit.distributed), its seed checked and its offsets kept."""
    p = checked_probability(p)
    if isinstance(seed, Dropout):
        if seed.p != p:
            raise InvalidInputError(f"dropout_seed is a Dropout of p={seed.p}, but dropout_p={p}")
        return seed._replace(seed=ops.dropout_seed(seed.seed, key, q)) if p else None
    if p == 0:
        if seed is not None or key is not None:  # checked all the same: a wrong seed is wrong at any p
            ops.dropout_seed(seed, key, q)
        return None
    return Dropout(p, ops.dropout_seed(seed, key, q))


def _check_range(ops: FrameworkOps, name: str, lengths: Any, limit: int) -> None:
    low, high = ops.value_range(lengths)
    if low < 0 or high > limit:
        raise InvalidInputError(f"{name} values must lie in [0, {limit}], got min={low}, max={high}")


def check_length_values(ops: FrameworkOps, problem: Problem, q_lengths: Any, kv_lengths: Any) -> None:
    _check_lengths(ops, q_lengths, kv_lengths, problem.len_q, problem.len_k)


def check_lengths_against_shapes(
    ops: FrameworkOps, spec: AttentionSpec, q: Any, k: Any, q_lengths: Any, kv_lengths: Any
) -> None:
    """:func:`check_length_values` of a 4-D call whose Problem was made for another length of its class."""
    seq_axis = 1 if spec.layout is Layout.BSHD else 2
    _check_lengths(ops, q_lengths, kv_lengths, q.shape[seq_axis], k.shape[seq_axis])


def _check_lengths(ops: FrameworkOps, q_lengths: Any, kv_lengths: Any, len_q: int, len_k: int) -> None:
    if q_lengths is not None:
        _check_range(ops, "q_lengths", q_lengths, len_q)
    if kv_lengths is not None:
        _check_range(ops, "kv_lengths", kv_lengths, len_k)


def _to_4d(ops: FrameworkOps, argument: str, tensor: Any, full: tuple[int, ...], was_3d: bool) -> Any:
    """Check broadcastability and prepend unit axes so backends always see 4-D mask and bias."""
    if was_3d:
        target = (full[0], full[2], full[3])
        _broadcastable(argument, tuple(tensor.shape), target, "(B, Lq, Lk)")
        shape3 = (1,) * (3 - tensor.ndim) + tuple(tensor.shape)
        return ops.reshape(tensor, (shape3[0], 1, shape3[1], shape3[2]))
    _broadcastable(argument, tuple(tensor.shape), full, "(B, Hq, Lq, Lk)")
    if tensor.ndim < 4:
        tensor = ops.reshape(tensor, (1,) * (4 - tensor.ndim) + tuple(tensor.shape))
    return tensor
