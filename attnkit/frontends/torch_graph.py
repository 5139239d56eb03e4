"""attend() as a torch operator, for calls a compiler traces and for meta tensors.

``torch.ops.attnkit.attend`` is a ``torch.library.custom_op`` with a fake implementation (the output shapes, from
metadata alone) and an autograd formula that calls ``torch.ops.attnkit.attend_backward``. Under
``torch.compile(fullgraph=True)`` Dynamo records one operator per attend call, with no graph break, and symbolic
sequence lengths pass through it, so a dynamic shape is traced once. Where the compiled graph runs, the operator's
implementation validates and dispatches the call as attend() does eagerly (attnkit/op_calls.py). On meta tensors
the dispatcher runs the fake implementation, forward and backward: outputs of the right shapes and dtypes, and no
backend chosen.

The spec crosses the operator boundary as its JSON (a constant of the traced graph, ' for "), read back once per
process. Dropout's seed (§18) crosses it as a tensor, an input of the graph or drawn inside it from torch's
generator, never a constant: a new seed runs the same graph. Its backward regenerates the keep-mask from that seed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, TypeAlias

import torch
from torch.utils._python_dispatch import _disable_current_modes

from attnkit import op_calls
from attnkit.backend import AttentionInputs, Dropout
from attnkit.frontends.torch_frontend import OPS, sum_to_shape
from attnkit.spec import AttentionSpec
from attnkit.validation import checked_dropout, prepare

Tensor: TypeAlias = torch.Tensor
_specs: dict[str, AttentionSpec] = {}


@torch.compiler.assume_constant_result
def _spec_key(spec: AttentionSpec) -> str:
    """The spec's JSON with ' for ": inductor's C++ wrapper (``cpp_wrapper=True``) writes a string argument into
    the C++ source between quotes, unescaped (torch 2.13). A spec's JSON holds no ' (its strings are enum values)."""
    return spec.model_dump_json().replace('"', "'")


def _spec(key: str) -> AttentionSpec:
    spec = _specs.get(key)
    if spec is None:
        if len(_specs) >= 1024:
            _specs.clear()
        spec = _specs[key] = AttentionSpec.model_validate_json(key.replace("'", '"'))
    return spec


def _fresh_thread_key_sets() -> tuple[torch._C.DispatchKeySet, torch._C.DispatchKeySet]:
    """The dispatcher's thread-local (included, excluded) key sets as eager code has them: a new thread's."""
    found = []
    reader = threading.Thread(
        target=lambda: found.append(
            (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())
        )
    )
    reader.start()
    reader.join()
    return found[0]


_EAGER_KEY_SETS = _fresh_thread_key_sets()


@contextlib.contextmanager
def _as_eager() -> Iterator[None]:
    """The backend runs as it does eagerly. An operator's implementation runs with autograd switched off, and,
    inside a compiled graph's runtime, below the dispatch modes it may have pushed (AOTAutograd's aliasing check on
    a first run), with their keys excluded. But a backend's backward may pull its gradients back through its forward
    (contract.torch.gradients_by_autograd), and a library a backend calls may need autograd and functorch even
    forward (eager flex_attention's vmap): the operator is opaque to all of these anyway."""
    with _disable_current_modes(), torch._C._ForceDispatchKeyGuard(*_EAGER_KEY_SETS):
        yield


def _absent(q: Tensor) -> Tensor:
    """An empty tensor in place of an output not asked for (lse, dbias): an operator returns tensors, never None."""
    return q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("attnkit::attend", mutates_args=())
def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    q_lengths: Tensor | None,
    kv_lengths: Tensor | None,
    q_segment_ids: Tensor | None,
    kv_segment_ids: Tensor | None,
    spec_json: str,
    backend: str,
    return_lse: bool,
    needs_grad: bool,
    needs_bias_grad: bool,
    # No defaults: inductor's C++ wrapper leaves an argument equal to its default out of the call's stack (torch 2.13)
    dropout_seed: Tensor | None,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    spec = _spec(spec_json)
    given = AttentionInputs(q, k, v, mask, bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)
    given = given._replace(dropout=_dropout(dropout_seed, dropout_p))
    call = op_calls.decide(spec, backend, given, return_lse, needs_grad, needs_bias_grad)
    with _as_eager():
        out, lse = op_calls.forward(call, spec, need_lse=return_lse or needs_grad)
    # Contiguous, as the fake implementation describes them.
    return out.contiguous(), _absent(q) if lse is None else lse.contiguous()


@_attend.register_fake
def _attend_shapes(*args: Any) -> tuple[Tensor, Tensor]:
    (
        q,
        k,
        v,
        mask,
        bias,
        q_lengths,
        kv_lengths,
        q_segment_ids,
        kv_segment_ids,
        spec_json,
        _,
        return_lse,
        needs_grad,
        *_,
    ) = args  # as _attend has them (the dropout's seed and p change no shape)
    given = AttentionInputs(q, k, v, mask, bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)
    out_shape, lse_shape = op_calls.output_shapes(_spec(spec_json), given)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # §6
    lse = q.new_empty(lse_shape, dtype=lse_dtype) if return_lse or needs_grad else _absent(q)
    return q.new_empty(out_shape), lse


@torch.library.custom_op("attnkit::attend_backward", mutates_args=())
def _attend_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    q_lengths: Tensor | None,
    kv_lengths: Tensor | None,
    q_segment_ids: Tensor | None,
    kv_segment_ids: Tensor | None,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    spec_json: str,
    backend: str,
    return_lse: bool,
    needs_bias_grad: bool,
    dropout_seed: Tensor | None,
    dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    spec = _spec(spec_json)
    given = AttentionInputs(q, k, v, mask, bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)
    given = given._replace(dropout=_dropout(dropout_seed, dropout_p))
    call = op_calls.decide(spec, backend, given, return_lse, True, needs_bias_grad)
    with _as_eager():
        grads = op_calls.backward(call, spec, out, lse, dout, dlse, needs_bias_grad)
    dbias = _absent(q)
    if needs_bias_grad and bias is not None:
        bias_4d = call.inputs.bias
        dbias = sum_to_shape(grads.dbias, bias_4d.shape).reshape(bias.shape).to(bias.dtype)
    return grads.dq.contiguous(), grads.dk.contiguous(), grads.dv.contiguous(), dbias.contiguous()


@_attend_backward.register_fake
def _attend_backward_shapes(*args: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    q, k, v, _, bias, *_, needs_bias_grad, _, _ = args  # as _attend_backward takes them
    # Contiguous whatever the inputs' strides, as the implementation returns them.
    dbias = bias.new_empty(bias.shape) if needs_bias_grad and bias is not None else _absent(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _save(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    # q, k, v, mask, ... kv_segment_ids, then the constants, the seed and p
    *tensors, spec_json, backend, return_lse, _, needs_bias_grad, seed, p = inputs
    ctx.save_for_backward(*tensors, seed, *output)
    ctx.spec_json, ctx.backend, ctx.return_lse, ctx.needs_bias_grad = spec_json, backend, return_lse, needs_bias_grad
    ctx.dropout_p = p


def _gradients(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    # q, k, v, mask, bias, lengths and segment ids as _attend takes them, and the dropout's seed
    *tensors, seed, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dbias = torch.ops.attnkit.attend_backward(
        *tensors, out, lse, dout, dlse if ctx.return_lse else None,
        ctx.spec_json, ctx.backend, ctx.return_lse, ctx.needs_bias_grad, seed, ctx.dropout_p,
    )  # fmt: skip
    no_gradient = (None,) * 11  # mask, lengths, segment ids, the operator's five constants, the seed and p
    return dq, dk, dv, None, dbias if ctx.needs_bias_grad else None, *no_gradient


_attend.register_autograd(_gradients, setup_context=_save)


def attend(
    spec: AttentionSpec,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    q_lengths: Tensor | None,
    kv_lengths: Tensor | None,
    q_segment_ids: Tensor | None,
    kv_segment_ids: Tensor | None,
    return_lse: bool,
    backend: str,
    dropout_p: Any,
    dropout_seed: Any,
    dropout_key: Any,
) -> Any:
    """attnkit.attend through the operator. Outside a trace (meta tensors) the arguments are checked here first,
    so bad input gets attend's typed errors rather than the operator schema's. A dropout seed not given is drawn
    here, inside the trace, from torch's generator: each run of the compiled graph draws its own."""
    if torch.compiler.is_compiling():
        dropout = checked_dropout(OPS, dropout_p, dropout_seed, dropout_key, q)
    else:
        dropout = prepare(
            spec, q, k, v, mask, bias, q_lengths, kv_lengths, return_lse, q_segment_ids, kv_segment_ids,
            check_values=False, dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_key=dropout_key,
        )[2].dropout  # fmt: skip
    grad_on = torch.is_grad_enabled()
    needs_bias_grad = grad_on and bias is not None and bias.requires_grad
    needs_grad = needs_bias_grad or (grad_on and (q.requires_grad or k.requires_grad or v.requires_grad))
    out, lse = torch.ops.attnkit.attend(
        q, k, v, mask, bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
        _spec_key(spec), backend, return_lse, needs_grad, needs_bias_grad,
        None if dropout is None else dropout.seed, 0.0 if dropout is None else dropout.p,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def _dropout(seed: Tensor | None, p: float) -> Dropout | None:
    return None if seed is None or p == 0 else Dropout(p, seed)
