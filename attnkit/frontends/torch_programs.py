"""Tracing a torch ``mask_mod(b, h, q_idx, kv_idx)`` into a mask program (docs/semantics.md §17).

The function runs once on four symbolic indices (:class:`_Symbol`). Python operators on them, the torch functions
a FlexAttention mask_mod uses (``torch.where``, ``minimum``, ``logical_and`` …) and reads of captured tensors at
them (``document_id[b, q_idx]``, through ``__torch_function__``) build the expression; anything else raises
:class:`attnkit.MaskProgramError` naming the operation. A captured tensor enters as a slot, never as values: new
values in it never re-trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnkit.contract.programs import Expr, const, index
from attnkit.errors import MaskProgramError


class _Tracer:
    """The captured tensors met while tracing one function, by identity."""

    def __init__(self) -> None:
        self.captured: list[torch.Tensor] = []

    def slot(self, tensor: torch.Tensor) -> int:
        for slot, seen in enumerate(self.captured):
            if seen is tensor:
                return slot
        if tensor.is_floating_point() or tensor.is_complex():
            raise MaskProgramError(
                f"mask_mod captured a tensor of dtype {str(tensor.dtype).removeprefix('torch.')} and shape "
                f"{tuple(tensor.shape)}; a mask program reads integer or boolean tensors only"
            )
        self.captured.append(tensor)
        return len(self.captured) - 1


_DEVICE = torch.device("cpu")


def _operator(op: str, reflected: bool = False) -> Callable[[_Symbol, Any], _Symbol]:
    def apply(self: _Symbol, other: Any) -> _Symbol:
        return self._binary(op, other, reflected)

    return apply


class _Symbol:
    """A traced value: an :class:`Expr`, or a captured tensor indexed at fewer positions than it has dimensions."""

    __slots__ = ("expr", "tracer", "view", "view_indices")

    def __init__(
        self, expr: Expr | None, tracer: _Tracer, view: torch.Tensor | None = None, view_indices: tuple[Expr, ...] = ()
    ) -> None:
        self.expr, self.tracer, self.view, self.view_indices = expr, tracer, view, view_indices

    # What FlexAttention's and transformers' helpers ask of an index (b.new_ones(()), q_idx.device).
    device = _DEVICE
    shape = torch.Size(())

    def dim(self) -> int:
        return 0

    @property
    def dtype(self) -> torch.dtype:
        return torch.bool if self._expr().kind == "bool" else torch.int64

    def _expr(self) -> Expr:
        if self.expr is None:
            assert self.view is not None
            raise MaskProgramError(
                f"mask_mod read a captured tensor of shape {tuple(self.view.shape)} at "
                f"{len(self.view_indices)} index(es); a read takes one index per dimension"
            )
        return self.expr

    def _wrap(self, expr: Expr) -> _Symbol:
        return _Symbol(expr, self.tracer)

    def _operand(self, other: Any) -> Expr:
        return _operand(self.tracer, other)

    def _binary(self, op: str, other: Any, reflected: bool = False) -> _Symbol:
        a, b = self._expr(), self._operand(other)
        return self._wrap(_build(op, b, a) if reflected else _build(op, a, b))

    __add__ = _operator("add")
    __radd__ = _operator("add", reflected=True)
    __sub__ = _operator("sub")
    __rsub__ = _operator("sub", reflected=True)
    __mul__ = _operator("mul")
    __rmul__ = _operator("mul", reflected=True)
    __floordiv__ = _operator("floordiv")
    __rfloordiv__ = _operator("floordiv", reflected=True)
    __mod__ = _operator("mod")
    __rmod__ = _operator("mod", reflected=True)
    __and__ = _operator("and")
    __rand__ = _operator("and", reflected=True)
    __or__ = _operator("or")
    __ror__ = _operator("or", reflected=True)
    __xor__ = _operator("xor")
    __rxor__ = _operator("xor", reflected=True)
    __eq__ = _operator("eq")  # type: ignore[assignment]
    __ne__ = _operator("ne")  # type: ignore[assignment]
    __lt__ = _operator("lt")
    __le__ = _operator("le")
    __gt__ = _operator("gt")
    __ge__ = _operator("ge")
    __hash__ = object.__hash__

    def __neg__(self) -> _Symbol:
        return self._wrap(_build("neg", self._expr()))

    def __pos__(self) -> _Symbol:
        return self

    def __abs__(self) -> _Symbol:
        return self._wrap(_build("abs", self._expr()))

    def __invert__(self) -> _Symbol:
        return self._wrap(_build("not", self._expr()))

    def __bool__(self) -> bool:
        raise MaskProgramError(
            "mask_mod branched on a traced value in Python (if/and/or/not, or bool()); write it with &, |, ~ and "
            "torch.where, which a mask program contains"
        )

    def __index__(self) -> int:
        raise MaskProgramError(
            "mask_mod used a traced index as a Python int (range(), a list index, int()); a mask program reads "
            "captured tensors at traced indices, and computes with them by operators"
        )

    __int__ = __index__

    def __truediv__(self, other: Any) -> Any:
        raise MaskProgramError("mask_mod divided with / (a float); a mask program's arithmetic is integer: use //")

    __rtruediv__ = __truediv__

    def __float__(self) -> float:
        raise MaskProgramError("mask_mod made a float of a traced index; a mask program's arithmetic is integer")

    def __getitem__(self, item: Any) -> Any:
        if self.view is None:
            raise MaskProgramError("mask_mod indexed a traced index; only captured tensors are read at indices")
        return _read(self.tracer, self.view, item, self.view_indices)

    def __iter__(self) -> Any:
        raise MaskProgramError("mask_mod iterated over a traced value; a mask program has no loops over data")

    # Tensor methods a mask_mod calls on an index.
    def new_ones(self, *size: Any, **kwargs: Any) -> _Symbol:
        return self._wrap(_constant_of(kwargs.get("dtype"), 1))

    def new_zeros(self, *size: Any, **kwargs: Any) -> _Symbol:
        return self._wrap(_constant_of(kwargs.get("dtype"), 0))

    def new_full(self, size: Any, fill_value: Any, **kwargs: Any) -> _Symbol:
        return self._wrap(_constant_of(kwargs.get("dtype"), fill_value))

    def to(self, *args: Any, **kwargs: Any) -> _Symbol:
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
        return self if dtype is None else _cast(self, dtype)

    def bool(self) -> _Symbol:
        return _cast(self, torch.bool)

    def int(self) -> _Symbol:
        return _cast(self, torch.int32)

    def long(self) -> _Symbol:
        return _cast(self, torch.int64)

    def abs(self) -> _Symbol:
        return abs(self)

    def clamp(self, min: Any = None, max: Any = None) -> _Symbol:  # noqa: A002
        return _clamp(self, min, max)

    clip = clamp

    def __repr__(self) -> str:
        return f"<traced {self._expr()}>"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tracer = next(arg.tracer for arg in _flat(args, kwargs) if isinstance(arg, _Symbol))
        if func is torch.Tensor.__getitem__:
            tensor, item = args
            return _read(tracer, tensor, item, ())
        handler = _TORCH_FUNCTIONS.get(func)
        if handler is None:
            name = getattr(func, "__name__", repr(func))
            owner = "Tensor" if "Tensor" in getattr(func, "__qualname__", "") else "torch"
            raise MaskProgramError(
                f"mask_mod called {owner}.{name}, which a mask program cannot contain (it takes integer + - * // %, "
                f"comparisons, & | ~, torch.where, minimum/maximum, abs, clamp, and reads of captured integer or "
                f"boolean tensors)"
            )
        return handler(tracer, *args, **kwargs)


def _flat(args: Any, kwargs: dict[str, Any]) -> list[Any]:
    flat: list[Any] = []
    for arg in (*args, *kwargs.values()):
        flat.extend(arg if isinstance(arg, (tuple, list)) else (arg,))
    return flat


def _operand(tracer: _Tracer, value: Any) -> Expr:
    if isinstance(value, _Symbol):
        return value._expr()
    if isinstance(value, bool):
        return const(value)
    if isinstance(value, int):
        return const(value)
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise MaskProgramError(
                f"mask_mod used a captured tensor of shape {tuple(value.shape)} whole; a mask program reads it at "
                f"one index per dimension (tensor[b, q_idx])"
            )
        slot = tracer.slot(value)
        return Expr("read", (), slot, "bool" if value.dtype == torch.bool else "int")
    raise MaskProgramError(
        f"mask_mod used a value of type {type(value).__name__} ({value!r}); a mask program takes Python ints and "
        f"bools, traced indices and captured integer or boolean tensors"
    )


def _read(tracer: _Tracer, tensor: torch.Tensor, item: Any, earlier: tuple[Expr, ...]) -> Any:
    items = item if isinstance(item, tuple) else (item,)
    if any(i is Ellipsis or i is None or isinstance(i, slice) for i in items):
        raise MaskProgramError(
            "mask_mod indexed a captured tensor with a slice, ... or None; a mask program reads one element per "
            "(b, h, q_idx, kv_idx): one integer index per dimension"
        )
    indices = (*earlier, *(_index_operand(tracer, i) for i in items))
    if len(indices) > tensor.dim():
        raise MaskProgramError(
            f"mask_mod read a captured tensor of shape {tuple(tensor.shape)} at {len(indices)} indices"
        )
    if len(indices) < tensor.dim():
        return _Symbol(None, tracer, tensor, indices)
    slot = tracer.slot(tensor)
    return _Symbol(Expr("read", indices, slot, "bool" if tensor.dtype == torch.bool else "int"), tracer)


def _index_operand(tracer: _Tracer, value: Any) -> Expr:
    expr = _operand(tracer, value)
    if expr.kind != "int":
        raise MaskProgramError("mask_mod indexed a captured tensor with a boolean; a read takes integer indices")
    return expr


def _build(op: str, *args: Expr) -> Expr:
    """A node with its kind checked, constants folded."""
    from attnkit.contract.programs import BOOL_BINARY, COMPARISONS, INT_BINARY, array_ops, evaluate

    kinds = [a.kind for a in args]
    if op in INT_BINARY or op in ("neg", "abs"):
        if "bool" in kinds:
            raise MaskProgramError(f"mask_mod applied {op} to a boolean; convert it with .int() or torch.where first")
        kind = "int"
    elif op in COMPARISONS:
        if len(set(kinds)) > 1:
            raise MaskProgramError(f"mask_mod compared an integer with a boolean ({op})")
        kind = "bool"
    elif op in BOOL_BINARY or op == "not":
        if "int" in kinds:
            raise MaskProgramError(
                f"mask_mod applied {'~' if op == 'not' else BOOL_BINARY[op]} to an integer; a mask program's "
                f"& | ~ ^ take booleans (bitwise integer operations are not in it)"
            )
        kind = "bool"
    elif op == "where":
        condition, a, b = args
        if condition.kind != "bool" or a.kind != b.kind:
            raise MaskProgramError("mask_mod called torch.where with a non-boolean condition or mixed branches")
        kind = a.kind
    else:  # int, bool casts
        kind = "bool" if op == "bool" else "int"
    node = Expr(op, args, None, kind)
    constants = [a for a in args if a.op == "const"]
    if op in ("and", "or") and len(constants) == 1:  # True & x is x, False | x is x; False & x, True | x constant
        other = args[1] if args[0].op == "const" else args[0]
        return other if bool(constants[0].value) == (op == "and") else constants[0]
    if all(a.op == "const" for a in args):
        import numpy as np

        value = evaluate(node, array_ops(np.zeros(())), {}, ())
        return const(bool(value) if kind == "bool" else int(value))
    return node


def _constant_of(dtype: Any, value: Any) -> Expr:
    return const(bool(value)) if dtype is torch.bool else const(int(value))


def _cast(symbol: _Symbol, dtype: torch.dtype) -> _Symbol:
    expr = symbol._expr()
    if dtype.is_floating_point or dtype.is_complex:
        raise MaskProgramError(f"mask_mod converted a traced value to {dtype}; a mask program's values are integers")
    want = "bool" if dtype is torch.bool else "int"
    return symbol if expr.kind == want else symbol._wrap(_build(want, expr))


def _clamp(value: Any, low: Any, high: Any) -> _Symbol:
    result = value
    if low is not None:
        result = _minmax(result.tracer, "max", result, low)
    if high is not None:
        result = _minmax(result.tracer, "min", result, high)
    return result


def _minmax(tracer: _Tracer, op: str, a: Any, b: Any) -> _Symbol:
    return _Symbol(_build(op, _operand(tracer, a), _operand(tracer, b)), tracer)


def _where(tracer: _Tracer, condition: Any, a: Any = None, b: Any = None) -> _Symbol:
    if a is None or b is None:
        raise MaskProgramError("mask_mod called torch.where with one argument (nonzero); give it three")
    return _Symbol(_build("where", *(_operand(tracer, x) for x in (condition, a, b))), tracer)


def _div(tracer: _Tracer, a: Any, b: Any, rounding_mode: str | None = None) -> _Symbol:
    if rounding_mode is None:
        raise MaskProgramError("mask_mod called torch.div without rounding_mode (a float); use // or rounding_mode")
    op = "floordiv" if rounding_mode == "floor" else "tdiv"
    return _Symbol(_build(op, _operand(tracer, a), _operand(tracer, b)), tracer)


def _op(op: str, unary: bool = False, reflected: bool = False) -> Callable[..., _Symbol]:
    def apply(tracer: _Tracer, *args: Any, **kwargs: Any) -> _Symbol:
        operands = [_operand(tracer, a) for a in (*args, *kwargs.values())][: 1 if unary else 2]
        return _Symbol(_build(op, *(operands[::-1] if reflected else operands)), tracer)

    return apply


def _tensor_cast(tracer: _Tracer, symbol: Any, *args: Any, **kwargs: Any) -> Any:
    return symbol.to(*args, **kwargs)


_TORCH_FUNCTIONS: dict[Any, Callable[..., Any]] = {
    torch.where: _where,
    torch.Tensor.where: lambda tracer, a, condition, b: _where(tracer, condition, a, b),
    torch.minimum: _op("min"),
    torch.maximum: _op("max"),
    torch.min: _op("min"),
    torch.max: _op("max"),
    torch.clamp: lambda tracer, a, min=None, max=None: _clamp(_Symbol(_operand(tracer, a), tracer), min, max),  # noqa: A006
    torch.clip: lambda tracer, a, min=None, max=None: _clamp(_Symbol(_operand(tracer, a), tracer), min, max),  # noqa: A006
    torch.div: _div,
    torch.Tensor.div: _div,
    torch.floor_divide: _op("floordiv"),
    torch.remainder: _op("mod"),
    torch.fmod: _op("trem"),
    torch.abs: _op("abs", unary=True),
    torch.neg: _op("neg", unary=True),
    torch.logical_and: _op("and"),
    torch.logical_or: _op("or"),
    torch.logical_xor: _op("xor"),
    torch.logical_not: _op("not", unary=True),
    torch.bitwise_and: _op("and"),
    torch.bitwise_or: _op("or"),
    torch.bitwise_xor: _op("xor"),
    torch.bitwise_not: _op("not", unary=True),
    torch.add: _op("add"),
    torch.sub: _op("sub"),
    torch.mul: _op("mul"),
    torch.eq: _op("eq"),
    torch.ne: _op("ne"),
    torch.lt: _op("lt"),
    torch.le: _op("le"),
    torch.gt: _op("gt"),
    torch.ge: _op("ge"),
    torch.Tensor.to: _tensor_cast,
}
# Tensor operators whose left operand is a real tensor (a captured 0-d tensor) and right one a traced value, and the
# Tensor methods of the same operations.
_PAIRS = ("add", "sub", "mul", "floordiv", "mod", "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge")
for _name in _PAIRS:
    _TORCH_FUNCTIONS[getattr(torch.Tensor, f"__{_name}__")] = _op(_name)
    if hasattr(torch.Tensor, f"__r{_name}__"):
        _TORCH_FUNCTIONS[getattr(torch.Tensor, f"__r{_name}__")] = _op(_name, reflected=True)
_METHODS = {
    "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "logical_and": "and", "logical_or": "or",
    "logical_not": "not", "abs": "abs", "remainder": "mod", "fmod": "trem", "floor_divide": "floordiv",
    "minimum": "min", "maximum": "max", "__invert__": "not", "__neg__": "neg",
}  # fmt: skip
for _name, _expr_op in _METHODS.items():
    _TORCH_FUNCTIONS[getattr(torch.Tensor, _name)] = _op(_expr_op, unary=_expr_op in ("not", "abs", "neg"))


def trace(function: Callable[..., Any]) -> tuple[Expr, list[torch.Tensor]]:
    """``function``'s program and the tensors it captured (by slot)."""
    tracer = _Tracer()
    symbols = [_Symbol(index(name), tracer) for name in ("b", "h", "q", "kv")]
    result = function(*symbols)
    if isinstance(result, bool):
        return const(result), tracer.captured
    if isinstance(result, torch.Tensor) and result.dim() == 0 and result.dtype == torch.bool:
        return _operand(tracer, result), tracer.captured
    if not isinstance(result, _Symbol) or result._expr().kind != "bool":
        raise MaskProgramError(
            f"mask_mod returned {result!r}; it must return a boolean (True where query q_idx may see key kv_idx)"
        )
    return result._expr(), tracer.captured
