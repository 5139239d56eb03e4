"""attend() as a framework's graph operator runs it (attnkit/frontends/torch_graph.py): the operator's
implementation sees tensors without autograd, so the caller's grad flags come with the call, and the operator's
backward asks for the gradients of the call its forward made.

Each call is validated and dispatched here, where its tensors are real, exactly as attend() would dispatch it
eagerly: a call traced once with dynamic lengths is dispatched per length without being traced again, and
attnkit.explain() on the same tensors names the backend that ran. Decisions come from dispatch's cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attnkit import dispatch
from attnkit.backend import AttentionInputs, Backend, Gradients, Problem
from attnkit.call_cache import CACHE
from attnkit.frontends import FrameworkOps, ops_for
from attnkit.spec import AttentionSpec, Layout
from attnkit.validation import check_length_values, prepare


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """One validated, dispatched call: the backend and what it is given (4-D tensors)."""

    ops: FrameworkOps
    problem: Problem
    inputs: AttentionInputs
    was_3d: bool
    backend: Backend


def decide(
    spec: AttentionSpec,
    backend: str,
    given: AttentionInputs,
    return_lse: bool,
    needs_grad: bool,
    needs_bias_grad: bool,
) -> Call:
    """Validate the call with the caller's grad flags, and choose the backend. A call whose metadata was seen before
    reuses that work, as attend's fast path does: only the lengths' values, which are data, are checked again."""
    ops = ops_for(given.q)
    signature = ops.signature(*given[:7])
    if given.q_segment_ids is not None or given.kv_segment_ids is not None:
        signature = ops.segment_signature(signature, given.q_segment_ids, given.kv_segment_ids)
    dropout = given.dropout
    key = (spec, signature, backend, return_lse, needs_grad, needs_bias_grad, dropout is None, CACHE.scope_serial())
    hit = CACHE.operator_calls.get(key) if signature is not None else None
    if hit is not None:
        problem, chosen = hit
        check_length_values(ops, problem, given.q_lengths, given.kv_lengths)
        return Call(ops, problem, given, False, chosen)
    epoch = CACHE.epoch
    ops, problem, inputs, was_3d = prepare(
        spec, *given[:7], return_lse, given.q_segment_ids, given.kv_segment_ids, given.alibi_slopes,
        dropout_p=0.0 if dropout is None else dropout.p, dropout_seed=None if dropout is None else dropout.seed,
    )  # fmt: skip
    inputs = inputs._replace(dropout=dropout)  # prepare checked it and made an equal one: keep the call's own
    problem = dataclasses.replace(problem, needs_grad=needs_grad, needs_bias_grad=needs_bias_grad)
    chosen = dispatch.select(spec, problem, backend)
    if signature is not None and all(a is b for a, b in zip(inputs, given)):  # nothing reshaped: reusable as given
        CACHE.remember(CACHE.operator_calls, key, (problem, chosen), epoch)
    return Call(ops, problem, inputs, was_3d, chosen)


def output_shapes(spec: AttentionSpec, given: AttentionInputs) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(out's shape, lse's shape) as attend() returns them, from metadata alone (meta and fake tensors, whose sizes
    may be symbolic): no value is read and no backend chosen."""
    _, problem, _, was_3d = prepare(
        spec, *given[:7], True, given.q_segment_ids, given.kv_segment_ids, given.alibi_slopes, check_values=False
    )
    out_shape = (*given.q.shape[:-1], problem.head_dim_v)
    if was_3d:
        return out_shape, (problem.batch, problem.len_q)
    return out_shape, (problem.batch, problem.heads_q, problem.len_q)


def forward(call: Call, spec: AttentionSpec, need_lse: bool) -> tuple[Any, Any]:
    """(out, lse) in the caller's shapes; lse is None unless ``need_lse``."""
    out, lse = call.backend.forward(spec, call.inputs, need_lse=need_lse)
    if call.was_3d:
        out, lse = as_3d(call.ops, spec, out, lse)
    return out, lse if need_lse else None


def as_3d(ops: FrameworkOps, spec: AttentionSpec, out: Any, lse: Any) -> tuple[Any, Any]:
    """A 3-D call's out and lse (or None) from the 4-D ones its backend computed (one head)."""
    return _drop_head_axis(ops, spec, out), None if lse is None else ops.reshape(lse, (lse.shape[0], lse.shape[2]))


def backward(call: Call, spec: AttentionSpec, out: Any, lse: Any, dout: Any, dlse: Any, need_dbias: bool) -> Gradients:
    """The backend's gradients for a call :func:`forward` ran, given in the caller's shapes (out, lse, dout and dlse
    as the forward returned them); dq, dk and dv come back in the caller's shapes, dbias as the backend gives it."""
    if call.was_3d:
        out, dout = (_restore_head_axis(call.ops, spec, x) for x in (out, dout))
        lse, dlse = (None if x is None else call.ops.reshape(x, (x.shape[0], 1, x.shape[1])) for x in (lse, dlse))
    grads = call.backend.backward(spec, call.inputs, out, lse, dout, dlse, need_dbias=need_dbias)
    if not call.was_3d:
        return grads
    dq, dk, dv = (_drop_head_axis(call.ops, spec, g) for g in (grads.dq, grads.dk, grads.dv))
    return Gradients(dq, dk, dv, grads.dbias)


def _head_axis(spec: AttentionSpec) -> int:
    return 1 if spec.layout is Layout.BHSD else 2


def _drop_head_axis(ops: FrameworkOps, spec: AttentionSpec, x: Any) -> Any:
    axis = _head_axis(spec)
    return ops.reshape(x, tuple(size for index, size in enumerate(x.shape) if index != axis))


def _restore_head_axis(ops: FrameworkOps, spec: AttentionSpec, x: Any) -> Any:
    axis = _head_axis(spec)
    return ops.reshape(x, (*x.shape[:axis], 1, *x.shape[axis:]))
