"""torch glue: metadata, and a torch.autograd.Function that calls the backend's backward."""

from __future__ import annotations

import contextvars
import functools
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from attnkit.backend import AttentionInputs, Backend, Framework, Problem, Runner, own_forward
from attnkit.errors import InvalidInputTypeError
from attnkit.frontends.seeds import unsigned_seed
from attnkit.spec import AttentionSpec, Layout


def sum_to_shape(gradient: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reduce a broadcast gradient back to the shape of the tensor that was broadcast."""
    if gradient.shape == shape:
        return gradient
    leading = gradient.dim() - len(shape)
    if leading:
        gradient = gradient.sum(dim=tuple(range(leading)))
    axes = tuple(axis for axis, size in enumerate(shape) if size == 1 and gradient.shape[axis] != 1)
    return gradient.sum(dim=axes, keepdim=True) if axes else gradient


class _AttendFunction(torch.autograd.Function):
    """``apply(backend, spec, return_lse, *inputs)``: the fields of an AttentionInputs as arguments of their own, so
    that autograd sees the tensors among them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, backend: Backend, spec: AttentionSpec, return_lse: bool, *fields: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = AttentionInputs(*fields)
        out, lse = backend.forward(spec, inputs, need_lse=True)
        ctx.backend, ctx.spec, ctx.return_lse = backend, spec, return_lse
        # The caller's context (attnkit.use_config scopes are context variables): autograd runs a CUDA backward on
        # its device thread, where they are unset, so the backward reads its options inside this copy.
        ctx.context = contextvars.copy_context()
        # The mask program and dropout, the last fields, are no tensors to differentiate: ctx keeps them.
        *tensors, ctx.mask_program, ctx.dropout = inputs
        ctx.save_for_backward(*tensors, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        *tensors, out, lse = ctx.saved_tensors
        inputs = AttentionInputs._make((*tensors, ctx.mask_program, ctx.dropout))
        need_dbias = inputs.bias is not None and ctx.needs_input_grad[_BIAS_ARGUMENT]
        grads = ctx.context.run(
            functools.partial(ctx.backend.backward, need_dbias=need_dbias),
            ctx.spec, inputs, out, lse, dout, dlse if ctx.return_lse else None,
        )  # fmt: skip
        dbias = None
        if need_dbias:
            dbias = sum_to_shape(grads.dbias, inputs.bias.shape).to(inputs.bias.dtype)
        # One gradient per argument of forward: none for backend, spec and return_lse, then one per field.
        return None, None, None, *AttentionInputs(grads.dq, grads.dk, grads.dv, bias=dbias)


#: Where bias sits among _AttendFunction.apply's arguments (after backend, spec and return_lse).
_BIAS_ARGUMENT = 3 + AttentionInputs._fields.index("bias")


# Read on every attend call: module globals, not attribute lookups on torch.
_Tensor = torch.Tensor
_BSHD = Layout.BSHD
_is_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling


class TorchOps:
    framework = Framework.TORCH

    def is_array(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def dtype_name(self, x: torch.Tensor) -> str:
        return str(x.dtype).removeprefix("torch.")

    def device(self, x: torch.Tensor) -> str:
        return x.device.type

    def value_range(self, x: torch.Tensor) -> tuple[int, int]:
        if x.numel() == 0:
            return 0, 0
        low, high = torch.aminmax(x)
        return int(low), int(high)

    def forward_only(self, what: str, run: Any, arrays: Any) -> Any:
        return run(arrays)  # grad is refused before the call (needs_grad), as torch knows it there

    def host_values(self, x: torch.Tensor) -> Any:
        return x.detach().cpu().numpy()

    def symbolic(self, q: torch.Tensor) -> bool:
        return _is_compiling() or q.device.type == "meta" or isinstance(q, FakeTensor)

    def needs_grad(self, inputs: AttentionInputs) -> tuple[bool, bool]:
        if not torch.is_grad_enabled():
            return False, False
        bias_grad = inputs.bias is not None and inputs.bias.requires_grad
        return bias_grad or inputs.q.requires_grad or inputs.k.requires_grad or inputs.v.requires_grad, bias_grad

    @staticmethod  # no bound method to build on every call
    def signature(q: Any, k: Any, v: Any, mask: Any, bias: Any, q_lengths: Any, kv_lengths: Any) -> Any:
        if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
            return None  # the full validation path names the wrong type
        grad = _is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)  # no_grad: one read
        if mask is None and bias is None and q_lengths is None and kv_lengths is None:  # the common call, first
            return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, grad)
        optional: list[Any] = []
        for tensor in (mask, bias, q_lengths, kv_lengths):
            if tensor is None:
                optional.append(None)
            elif type(tensor) is _Tensor:
                optional.append((tensor.shape, tensor.dtype, tensor.device))
            else:
                return None
        bias_grad = bias is not None and bias.requires_grad and _is_grad_enabled()
        grad = grad or bias_grad
        return (
            q.shape,
            k.shape,
            v.shape,
            q.dtype,
            k.dtype,
            v.dtype,
            q.device,
            k.device,
            v.device,
            grad,
            bias_grad,
            *optional,
        )

    @staticmethod
    def length_class_signature(
        spec: AttentionSpec,
        q: Any,
        k: Any,
        v: Any,
        q_lengths: Any,
        kv_lengths: Any,
        q_segment_ids: Any,
        kv_segment_ids: Any,
    ) -> Any:
        if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
            return None
        try:
            if spec.layout is _BSHD:
                batch_q, len_q, heads_q, dim_q = q.shape
                batch_k, len_k, heads_k, dim_k = k.shape
                batch_v, len_v, heads_v, dim_v = v.shape
            else:
                batch_q, heads_q, len_q, dim_q = q.shape
                batch_k, heads_k, len_k, dim_k = k.shape
                batch_v, heads_v, len_v, dim_v = v.shape
        except ValueError:  # not 4-D: the full path names it, or brings a 3-D call to 4-D
            return None
        if len_v != len_k:
            return None
        grad_mode = _is_grad_enabled()  # a decode step is measured or not by the grad mode (autotune.Trial)
        signature = (
            batch_q, heads_q, dim_q, batch_k, heads_k, dim_k, batch_v, heads_v, dim_v,
            q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            grad_mode, grad_mode and (q.requires_grad or k.requires_grad or v.requires_grad),
            2 * len_q.bit_length() - (len_q & (len_q - 1) == 0),  # length_class, inline: one call less
            2 * len_k.bit_length() - (len_k & (len_k - 1) == 0),
            (len_k > len_q) - (len_k < len_q),
        )  # fmt: skip
        if q_lengths is None and kv_lengths is None and q_segment_ids is None and kv_segment_ids is None:
            return signature
        optional: list[Any] = []
        for lengths in (q_lengths, kv_lengths):
            if lengths is None:
                optional.append(None)
            elif type(lengths) is _Tensor:
                optional.append((lengths.shape, lengths.dtype, lengths.device))
            else:
                return None
        for ids, length in ((q_segment_ids, len_q), (kv_segment_ids, len_k)):
            if ids is None:
                optional.append(None)
                continue
            if type(ids) is not _Tensor or ids.dim() != 2 or ids.shape[1] != length:
                return None  # the full path names what is wrong
            optional.append((ids.shape[0], ids.dtype, ids.device))
        return (*signature, *optional)

    @staticmethod
    def segment_signature(signature: Any, q_segment_ids: Any, kv_segment_ids: Any) -> Any:
        if signature is None or type(q_segment_ids) is not _Tensor or type(kv_segment_ids) is not _Tensor:
            return None
        q_ids, kv_ids = q_segment_ids, kv_segment_ids
        return (*signature, (q_ids.shape, q_ids.dtype, q_ids.device), (kv_ids.shape, kv_ids.dtype, kv_ids.device))

    def reshape(self, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return x.reshape(shape)

    def dropout_seed(self, seed: Any, key: Any, q: torch.Tensor) -> torch.Tensor:
        """A 0-d int64 tensor whose bits are the seed read unsigned: ``seed`` as given (a tensor on q's device or the
        CPU) or from a Python int, or drawn from torch's default generator for q's device."""
        if key is not None:
            raise InvalidInputTypeError(
                f"dropout_key is taken by JAX calls (a PRNG key), got {type(key).__name__} in a torch call: pass "
                "dropout_seed, an int in [0, 2**64) or a 0-d int64 tensor"
            )
        if seed is None:  # two 32-bit draws: torch.manual_seed makes the run repeat
            words = torch.randint(0, 1 << 32, (2,), dtype=torch.int64, device=q.device)
            return words[0] | (words[1] << 32)
        if isinstance(seed, torch.Tensor):
            if seed.dtype != torch.int64 or seed.dim() != 0:
                raise InvalidInputTypeError(
                    f"dropout_seed is a tensor of dtype {seed.dtype} and shape {tuple(seed.shape)}, expected a 0-d "
                    "int64 tensor (its 64 bits read unsigned)"
                )
            if seed.device != q.device and seed.device.type != "cpu":
                raise InvalidInputTypeError(f"dropout_seed is on device {seed.device}, expected q's {q.device} or cpu")
            return seed
        value = unsigned_seed(seed)
        return torch.tensor(value - (1 << 64) if value >= 1 << 63 else value, dtype=torch.int64, device=q.device)

    def runner(self, backend: Backend, spec: AttentionSpec, problem: Problem) -> Runner:
        own = own_forward(backend, spec, problem)
        if own is not None:
            return own
        return_lse = problem.return_lse
        if not problem.needs_grad:
            return lambda inputs: backend.forward(spec, inputs, need_lse=return_lse)

        def through_autograd(inputs: AttentionInputs) -> tuple[Any, Any]:
            out, lse = _AttendFunction.apply(backend, spec, return_lse, *inputs)
            return out, lse

        return through_autograd


def _signature_when_traced(q: Any, k: Any, v: Any, mask: Any, bias: Any, q_lengths: Any, kv_lengths: Any) -> None:
    """What Dynamo sees in place of the signature: no key, so a traced call is never looked up in attend's cache of
    eager calls and goes to the graph operator (torch_graph.py)."""
    return None


def _length_class_signature_when_traced(
    spec: Any,
    q: Any,
    k: Any,
    v: Any,
    q_lengths: Any,
    kv_lengths: Any,
    q_segment_ids: Any,
    kv_segment_ids: Any,
) -> None:
    """:func:`_signature_when_traced`'s counterpart for the length-class signature."""
    return None


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``action`` right after module ``name`` is first imported: at that import it steps aside (off
    sys.meta_path), finds the module's own spec and loader, and wraps their exec_module once."""

    def __init__(self, name: str, action: Callable[[], None]) -> None:
        self.name, self.action = name, action
        self.loader: Any = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the module keeps its own loader
        self.loader.exec_module(module)
        try:
            self.action()
        except Exception as error:  # torch's import goes on; compiled calls of attend may then graph-break
            warnings.warn(f"attnkit could not prepare {self.name} for attend: {error!r}", stacklevel=2)


def _when_dynamo_is_imported(action: Callable[[], None]) -> None:
    """``action`` now if Dynamo is imported, else right after its import. Importing it costs seconds (4-8 s on a
    2-core machine) that an eager attend never needs; nothing is traced before it is imported."""
    if "torch._dynamo" in sys.modules:
        action()
    else:
        sys.meta_path.insert(0, _AfterImport("torch._dynamo", action))


def _trace_past(
    signature: Callable[..., Any], stand_in: Callable[..., None] = _signature_when_traced, **options: Any
) -> None:
    """Dynamo traces ``stand_in`` (a function returning None) in place of ``signature`` (when it imports)."""
    _when_dynamo_is_imported(lambda: torch.compiler.substitute_in_graph(signature, **options)(stand_in))


_trace_past(TorchOps.signature)
_trace_past(TorchOps.length_class_signature, _length_class_signature_when_traced)
OPS = TorchOps()
#: The array type attend's table maps to OPS from the start (attnkit/frontends/__init__.py).
ARRAY_TYPE = torch.Tensor
#: "compiled" or "python (why not compiled)": which signature keys attend's cache of validated calls.
signature_in_use = "python"


def use_compiled_signature(build: bool = False) -> str:
    """Key attend's cache with the C++ signature (torch_compiled.py) where it is built, or after building it with
    ``build=True``. Returns :data:`signature_in_use`."""
    global signature_in_use
    from attnkit.frontends import torch_compiled

    try:
        function, reason = torch_compiled.load(TorchOps.signature, build=build)
        by_class, _ = torch_compiled.load_length_class(TorchOps.length_class_signature, _BSHD)
    except Exception as error:  # a failed build or load leaves the Python signature, which computes the same keys
        function, by_class, reason = None, None, f"{type(error).__name__}: {error}".splitlines()[0]
    if function is not None and by_class is not None:
        _trace_past(function, skip_signature_check=True)
        _trace_past(by_class, _length_class_signature_when_traced, skip_signature_check=True)
        OPS.signature = function  # type: ignore[method-assign]  # an instance attribute over the staticmethod
        OPS.length_class_signature = by_class  # type: ignore[method-assign]
        signature_in_use = "compiled"
    else:
        signature_in_use = f"python ({reason})"
    return signature_in_use


use_compiled_signature()
