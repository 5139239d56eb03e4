"""Tracing a JAX ``mask_mod(b, h, q_idx, kv_idx)`` into a mask program (docs/semantics.md §17).

``jax.make_jaxpr`` stages the function out on four int32 scalars; a small interpreter then turns the jaxpr's
equations into :class:`Expr` nodes. Arrays the function closes over are the jaxpr's constants: each becomes a
captured slot (read, never its values, so a tracer of an enclosing ``jax.jit`` is captured as well as a concrete
array). Indexing them (``dynamic_slice``, ``gather``, ``squeeze`` …) becomes a ``read`` with one index per dimension;
any other primitive raises :class:`attnkit.MaskProgramError` naming it.

Non-scalar values are lazy (:class:`_Lazy`): a shape and the element at given indices, so a (B, L) array costs
nothing until it is read at one position.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from attnkit.contract.programs import Expr, build, const, index
from attnkit.errors import MaskProgramError

#: What the message for an operation a program cannot contain lists.
_ALLOWED = (
    "integer + - * // % and lax.div/rem, comparisons, & | ~ ^ on booleans, where/select, minimum/maximum, abs, sign, "
    "clip, ** by a constant, and reads of captured integer or boolean arrays"
)
#: Integer dtypes arithmetic may run in: a narrower one wraps where the program's int32 does not.
_WIDE = (np.dtype(np.int32), np.dtype(np.int64))


class _Lazy:
    """A non-scalar value: its shape and ``at(indices)``, the element at constant or traced indices, each clamped
    into the shape (a captured array's ``read`` clamps; every view keeps that meaning)."""

    __slots__ = ("shape", "_at")

    def __init__(self, shape: tuple[int, ...], at: Callable[[tuple[Expr, ...]], Expr]) -> None:
        self.shape, self._at = shape, at

    def at(self, indices: Sequence[Expr]) -> Expr:
        # A dimension of size 1 has one element: a clamped index is 0 there.
        return self._at(tuple(const(0) if size == 1 else i for i, size in zip(indices, self.shape)))


class _Tracer:
    """The captured arrays of one trace, by identity, and the interpreter over its jaxpr."""

    def __init__(self) -> None:
        self.captured: list[Any] = []

    def slot(self, array: Any) -> int:
        for slot, seen in enumerate(self.captured):
            if seen is array:
                return slot
        self.captured.append(array)
        return len(self.captured) - 1

    def constant(self, value: Any) -> Expr | _Lazy:
        """A jaxpr constant: a closed-over JAX array (or tracer) as a captured slot; a NumPy constant (JAX bakes
        those into the computation) as a constant when a scalar, else as a captured copy."""
        dtype = np.dtype(value.dtype)
        if not (np.issubdtype(dtype, np.integer) or dtype == np.bool_):
            raise MaskProgramError(
                f"mask_mod captured an array of dtype {dtype} and shape {tuple(value.shape)}; a mask program reads "
                f"integer or boolean arrays only"
            )
        if not isinstance(value, jax.Array):
            if np.ndim(value) == 0:
                return const(bool(value) if dtype == np.bool_ else int(value))
            value = jnp.asarray(value)
        kind = "bool" if dtype == np.bool_ else "int"
        shape = tuple(value.shape)
        slot: list[int] = []

        def read(indices: tuple[Expr, ...]) -> Expr:
            if not slot:  # a slot only for an array the program reads
                slot.append(self.slot(value))
            return Expr("read", indices, slot[0], kind)

        return read(()) if not shape else _Lazy(shape, read)

    # --- The interpreter ---------------------------------------------------------------------------------------

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}
        for var, value in zip(jaxpr.constvars, consts):
            env[var] = self.constant(value)
        for var, value in zip(jaxpr.invars, args):
            env[var] = value

        def read(atom: Any) -> Any:
            if isinstance(atom, jax_core.Literal):
                return _literal(atom.val)
            return env[atom]

        for eqn in jaxpr.eqns:
            inputs = [read(atom) for atom in eqn.invars]
            outputs = self.equation(eqn, inputs)
            for var, value in zip(eqn.outvars, outputs):
                env[var] = value
        return [read(atom) for atom in jaxpr.outvars]

    def equation(self, eqn: Any, inputs: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        sub = _subjaxpr(eqn)
        if sub is not None:
            fused = _fused(eqn, inputs)
            if fused is not None:
                return [fused]
            jaxpr, consts = sub
            return self.run(jaxpr, consts, inputs)
        (out,) = eqn.outvars  # every primitive _check_primitives lets through has one result
        dtype = np.dtype(out.aval.dtype)
        if not (np.issubdtype(dtype, np.integer) or dtype == np.bool_):
            raise MaskProgramError(
                f"mask_mod computed a {dtype} value ({name}); a mask program's values are integers and booleans"
            )
        if name in _ARITHMETIC and dtype not in _WIDE:
            raise MaskProgramError(
                f"mask_mod computed {name} in {dtype}, which wraps where a mask program's int32 does not; convert "
                f"to int32 first (.astype(jnp.int32))"
            )
        in_dtypes = [np.dtype(atom.aval.dtype) for atom in eqn.invars]
        if name in _ELEMENTWISE:
            rule = _ELEMENTWISE[name]
            return [_elementwise(lambda *xs: rule(eqn.params, in_dtypes, dtype, *xs), inputs, out.aval.shape)]
        return [_STRUCTURAL[name](eqn.params, inputs, tuple(out.aval.shape), dtype)]


def _literal(value: Any) -> Expr:
    dtype = np.asarray(value).dtype
    if dtype == np.bool_:
        return const(bool(value))
    if np.issubdtype(dtype, np.integer):
        return const(int(value))
    raise MaskProgramError(f"mask_mod used the constant {value!r} ({dtype}); a mask program's values are integers")


def _subjaxpr(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """The jaxpr a call-like equation (jit, custom_jvp_call, closed_call, checkpoint …) runs, with its constants."""
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        if isinstance(inner, jax_core.ClosedJaxpr):
            return inner.jaxpr, inner.consts
        if isinstance(inner, jax_core.Jaxpr):
            return inner, ()
    return None


_CALLS = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
     "checkpoint", "remat", "remat2", "named_call"}
)  # fmt: skip
#: jnp functions on integers whose jaxpr spells an operation of the program at length (sign tests, selects).
_FUSED = {"floor_divide": ("floordiv", jnp.floor_divide), "remainder": ("mod", jnp.remainder)}


def _fused(eqn: Any, inputs: list[Any]) -> Expr | None:
    """``q // C`` and ``q % C`` as one node: where a jit's jaxpr is exactly the one jnp.floor_divide (remainder) gives
    for the same operand types (the name alone could be any function's)."""
    name = eqn.params.get("name")
    if name not in _FUSED or not all(isinstance(x, Expr) for x in inputs) or len(inputs) != 2:
        return None
    avals = tuple((tuple(a.aval.shape), str(a.aval.dtype), bool(a.aval.weak_type)) for a in eqn.invars)
    if any(np.dtype(dtype) not in _WIDE for _, dtype, _ in avals) or str(eqn.params["jaxpr"].jaxpr) != _reference(
        name, avals
    ):
        return None
    return build(_FUSED[name][0], *inputs)


@functools.lru_cache(maxsize=64)
def _reference(name: str, avals: tuple[tuple[tuple[int, ...], str, bool], ...]) -> str:
    structs = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in avals]
    outer = jax.make_jaxpr(_FUSED[name][1])(*structs).jaxpr
    calls = [e for e in outer.eqns if e.primitive.name in _CALLS]
    return str(calls[0].params["jaxpr"].jaxpr) if len(outer.eqns) == 1 and calls else ""


# --- Elementwise primitives -------------------------------------------------------------------------------------


def _elementwise(rule: Callable[..., Expr], inputs: list[Any], shape: Sequence[int]) -> Expr | _Lazy:
    if all(isinstance(x, Expr) for x in inputs):
        return rule(*inputs)
    return _Lazy(tuple(shape), lambda indices: rule(*(_element(x, indices) for x in inputs)))


def _element(value: Expr | _Lazy, indices: tuple[Expr, ...]) -> Expr:
    return value if isinstance(value, Expr) else value.at(indices)


def _nonnegative(expr: Expr) -> bool:
    """Whether ``expr`` is never negative, from its form (index leaves are positions)."""
    op, args = expr.op, expr.args
    if op == "index" or op == "abs":
        return True
    if op == "const":
        return expr.kind == "int" and int(expr.value) >= 0  # type: ignore[arg-type]
    if op in ("add", "mul", "min"):
        return all(_nonnegative(a) for a in args)
    if op == "max":
        return any(_nonnegative(a) for a in args)
    if op in ("floordiv", "tdiv", "mod", "trem"):
        return _nonnegative(args[0]) and args[1].op == "const" and int(args[1].value) > 0  # type: ignore[arg-type]
    if op == "where":
        return _nonnegative(args[1]) and _nonnegative(args[2])
    return False


def _compare(op: str, a: Expr, b: Expr) -> Expr:
    """A comparison, decided where a nonnegative value meets a constant at most 0 (jnp's wrap of negative indices
    tests ``i < 0`` on every read)."""
    if b.op == "const" and b.kind == "int" and int(b.value) <= 0 and _nonnegative(a):  # type: ignore[arg-type]
        if op in ("lt", "ge") or (op in ("le", "gt") and int(b.value) < 0):  # type: ignore[arg-type]
            return const(op in ("ge", "gt"))
    if a.op == "const" and a.kind == "int" and int(a.value) <= 0 and _nonnegative(b):  # type: ignore[arg-type]
        if op in ("gt", "le") or (op in ("ge", "lt") and int(a.value) < 0):  # type: ignore[arg-type]
            return const(op in ("le", "lt"))
    return build(op, a, b)


def _binary(op: str) -> Callable[..., Expr]:
    return lambda params, dtypes, dtype, a, b: build(op, a, b)


def _comparison(op: str) -> Callable[..., Expr]:
    return lambda params, dtypes, dtype, a, b: _compare(op, a, b)


def _logical(op: str) -> Callable[..., Expr]:
    return lambda params, dtypes, dtype, *xs: build(op, *xs)


def _sign(params: Any, dtypes: Any, dtype: Any, x: Expr) -> Expr:
    negative = build("where", _compare("lt", x, const(0)), const(-1), const(0))
    return build("where", _compare("gt", x, const(0)), const(1), negative)


def _select(params: Any, dtypes: Any, dtype: Any, which: Expr, *cases: Expr) -> Expr:
    if which.kind == "bool":
        return build("where", which, cases[1], cases[0]) if len(cases) == 2 else cases[0]
    result = cases[-1]  # an integer selector picks cases[i]; past the end, the last (as lax clamps it)
    for position in range(len(cases) - 2, -1, -1):
        result = build("where", _compare("le", which, const(position)), cases[position], result)
    return result


def _convert(params: Any, dtypes: Any, dtype: Any, x: Expr) -> Expr:
    (source,) = dtypes
    if dtype == np.bool_:
        return x if x.kind == "bool" else build("bool", x)
    if x.kind == "bool":
        return build("int", x)
    if dtype not in _WIDE and not np.can_cast(source, dtype, "safe"):
        raise MaskProgramError(
            f"mask_mod converted {source} to {dtype}, which wraps where a mask program's int32 does not"
        )
    return x


def _power(params: Any, dtypes: Any, dtype: Any, x: Expr) -> Expr:
    exponent = int(params["y"])
    if exponent < 0:
        raise MaskProgramError(f"mask_mod raised an integer to the power {exponent}; a program's powers are >= 0")
    result = const(1)
    for _ in range(exponent):
        result = build("mul", result, x)
    return result


def _clamp(params: Any, dtypes: Any, dtype: Any, low: Expr, x: Expr, high: Expr) -> Expr:
    return build("min", build("max", x, low), high)


_ELEMENTWISE: dict[str, Callable[..., Expr]] = {
    "add": _binary("add"),
    "sub": _binary("sub"),
    "mul": _binary("mul"),
    "div": _binary("tdiv"),  # lax.div rounds toward zero, as C
    "rem": _binary("trem"),
    "max": _binary("max"),
    "min": _binary("min"),
    "neg": lambda params, dtypes, dtype, x: build("neg", x),
    "abs": lambda params, dtypes, dtype, x: build("abs", x),
    "sign": _sign,
    "integer_pow": _power,
    "clamp": _clamp,
    **{op: _comparison(op) for op in ("eq", "ne", "lt", "le", "gt", "ge")},
    "and": _logical("and"),
    "or": _logical("or"),
    "xor": _logical("xor"),
    "not": _logical("not"),
    "select_n": _select,
    "convert_element_type": _convert,
    "copy": lambda params, dtypes, dtype, x: x,
    "copy_p": lambda params, dtypes, dtype, x: x,
    # shard_map's marking of a value as varying over a mesh axis (a program called on a device's block): its type
    # changes, not its value.
    "pvary": lambda params, dtypes, dtype, x: x,
}
_ARITHMETIC = frozenset({"add", "sub", "mul", "div", "rem", "neg", "abs", "integer_pow"})


# --- Indexing and shape primitives ------------------------------------------------------------------------------


def _lazy(value: Expr | _Lazy) -> _Lazy:
    return value if isinstance(value, _Lazy) else _Lazy((), lambda indices: value)


def _constant_index(expr: Expr, what: str) -> int:
    if expr.op != "const":
        raise MaskProgramError(
            f"mask_mod indexed a computed array ({what}) at a traced index; a mask program reads captured arrays at "
            f"traced indices, one index per dimension"
        )
    return int(expr.value)  # type: ignore[arg-type]


def _clamped(expr: Expr, low: int, high: int) -> Expr:
    floor = expr if low <= 0 and _nonnegative(expr) else build("max", expr, const(low))
    return build("min", floor, const(high))


def _window(parent: _Lazy, starts: Sequence[Expr], sizes: Sequence[int]) -> Callable[[tuple[Expr, ...]], Expr]:
    """Elements of ``parent`` in a window of ``sizes`` from ``starts``, each start clamped so that the window fits
    (as lax.dynamic_slice and gather's clip mode do)."""

    def at(indices: tuple[Expr, ...]) -> Expr:
        positions = []
        for start, offset, size, whole in zip(starts, indices, sizes, parent.shape):
            if size == whole:  # the start clamps to 0
                positions.append(offset)
            elif size == 1:  # the parent clamps the start itself
                positions.append(start)
            else:
                positions.append(build("add", _clamped(start, 0, whole - size), _clamped(offset, 0, size - 1)))
        return parent.at(tuple(positions))

    return at


def _dynamic_slice(params: Any, inputs: list[Any], shape: tuple[int, ...], dtype: Any) -> Expr | _Lazy:
    operand, *starts = inputs
    sizes = tuple(params["slice_sizes"])
    return _shaped(shape, _window(_lazy(operand), starts, sizes))


def _shaped(shape: tuple[int, ...], at: Callable[[tuple[Expr, ...]], Expr]) -> Expr | _Lazy:
    return at(()) if not shape else _Lazy(shape, at)


def _slice(params: Any, inputs: list[Any], shape: tuple[int, ...], dtype: Any) -> Expr | _Lazy:
    (operand,) = inputs
    parent = _lazy(operand)
    starts, strides = params["start_indices"], params["strides"] or (1,) * len(shape)

    def at(indices: tuple[Expr, ...]) -> Expr:
        positions = [
            build("add", const(int(start)), build("mul", _clamped(i, 0, size - 1), const(int(stride))))
            for i, start, stride, size in zip(indices, starts, strides, shape)
        ]
        return parent.at(tuple(positions))

    return _shaped(shape, at)


def _squeeze(params: Any, inputs: list[Any], shape: tuple[int, ...], dtype: Any) -> Expr | _Lazy:
    (operand,) = inputs
    parent = _lazy(operand)
    dropped = {d % len(parent.shape) for d in params["dimensions"]}

    def at(indices: tuple[Expr, ...]) -> Expr:
        kept = iter(indices)
        return parent.at(tuple(const(0) if d in dropped else next(kept) for d in range(len(parent.shape))))

    return _shaped(shape, at)


def _reshape(params: Any, inputs: list[Any], shape: tuple[int, ...], dtype: Any) -> Expr | _Lazy:
    """A reshape that only adds or drops dimensions of size 1 (what indexing and expand_dims give)."""
    (operand,) = inputs
    parent = _lazy(operand)
    if params.get("dimensions") is not None or [n for n in parent.shape if n != 1] != [n for n in shape if n != 1]:
        raise MaskProgramError(
            f"mask_mod reshaped an array of shape {parent.shape} to {shape}; a mask program reads captured arrays "
            f"as they are, one index per dimension"
        )

    def at(indices: tuple[Expr, ...]) -> Expr:
        real = iter(i for i, n in zip(indices, shape) if n != 1)
        return parent.at(tuple(next(real) if n != 1 else const(0) for n in parent.shape))

    return _shaped(shape, at)


def _broadcast(params: Any, inputs: list[Any], shape: tuple[int, ...], dtype: Any) -> Expr | _Lazy:
    operand, *dynamic = inputs
    if dynamic:
        raise MaskProgramError("mask_mod broadcast to a traced shape; a mask program's shapes are fixed")
    parent = _lazy(operand)
    dimensions = tuple(params["broadcast_dimensions"])
    return _shaped(shape, lambda indices: parent.at(tuple(indices[d] for d in dimensions)))


def _concatenate(params: Any, inputs: list[Any], shape: tuple[int, ...], dtype: Any) -> Expr | _Lazy:
    axis = int(params["dimension"])
    parts = [_lazy(x) for x in inputs]

    def at(indices: tuple[Expr, ...]) -> Expr:
        position = min(max(_constant_index(indices[axis], "a concatenation"), 0), shape[axis] - 1)
        for part in parts:
            if position < part.shape[axis]:
                return part.at((*indices[:axis], const(position), *indices[axis + 1 :]))
            position -= part.shape[axis]
        raise AssertionError("a position within the concatenation")

    return _shaped(shape, at)


def _iota(params: Any, inputs: list[Any], shape: tuple[int, ...], dtype: Any) -> Expr | _Lazy:
    axis = int(params["dimension"])
    return _shaped(shape, lambda indices: _clamped(indices[axis], 0, shape[axis] - 1))


def _gather(params: Any, inputs: list[Any], shape: tuple[int, ...], dtype: Any) -> Expr | _Lazy:
    """lax.gather of one window per index vector (jnp.take, ``.at[...].get``): clip modes clamp the starts, the fill
    mode gives ``fill_value`` for a window out of range."""
    operand, starts_array = (_lazy(x) for x in inputs)
    numbers = params["dimension_numbers"]
    if numbers.operand_batching_dims or numbers.start_indices_batching_dims:
        raise MaskProgramError("mask_mod gathered with batching dimensions; a mask program reads one element")
    sizes = tuple(params["slice_sizes"])
    offset_dims, collapsed = tuple(numbers.offset_dims), set(numbers.collapsed_slice_dims)
    start_map = tuple(numbers.start_index_map)
    fill = "FILL" in str(params["mode"]).upper()
    kept = [d for d in range(len(operand.shape)) if d not in collapsed]
    fill_value = params.get("fill_value")

    def at(indices: tuple[Expr, ...]) -> Expr:
        batch = tuple(i for d, i in enumerate(indices) if d not in offset_dims)
        offsets = dict(zip(kept, (indices[d] for d in offset_dims)))
        starts = [const(0)] * len(operand.shape)
        for component, dim in enumerate(start_map):
            starts[dim] = starts_array.at((*batch, const(component)))
        element = _window(operand, starts, sizes)(tuple(offsets.get(d, const(0)) for d in range(len(sizes))))
        if not fill:
            return element
        inside = const(True)
        for dim in start_map:
            fits = build(
                "and",
                _compare("ge", starts[dim], const(0)),
                _compare("le", starts[dim], const(operand.shape[dim] - sizes[dim])),
            )
            inside = build("and", inside, fits)
        return build("where", inside, element, _fill(fill_value, dtype))

    return _shaped(shape, at)


def _fill(value: Any, dtype: Any) -> Expr:
    """gather's fill value, or lax's default for the dtype (False; the least signed, the greatest unsigned)."""
    if dtype == np.bool_:
        return const(bool(value) if value is not None else False)
    if value is None:
        limits = np.iinfo(dtype)
        value = limits.min if limits.min < 0 else limits.max
    return const(int(value))


_STRUCTURAL: dict[str, Callable[[Any, list[Any], tuple[int, ...], Any], Expr | _Lazy]] = {
    "dynamic_slice": _dynamic_slice,
    "slice": _slice,
    "squeeze": _squeeze,
    "reshape": _reshape,
    "broadcast_in_dim": _broadcast,
    "concatenate": _concatenate,
    "iota": _iota,
    "gather": _gather,
}


def _check_primitives(jaxpr: Any) -> None:
    """Refuses the first primitive a program cannot contain, before interpreting: ``jnp.sin(q)`` is named sin, not
    the float conversion before it."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _CALLS:
            sub = _subjaxpr(eqn)
            if sub is not None:
                _check_primitives(sub[0])
                continue
        if name not in _ELEMENTWISE and name not in _STRUCTURAL:
            raise MaskProgramError(
                f"mask_mod used the JAX primitive {name}, which a mask program cannot contain ({_ALLOWED})"
            )


def trace(function: Callable[..., Any]) -> tuple[Expr, list[Any]]:
    """``function``'s program and the arrays it captured (by slot)."""
    index_type = jax.ShapeDtypeStruct((), jnp.int32)
    try:
        # A fresh wrapper each time: make_jaxpr caches traces by function, and would give the arrays the function
        # closed over when first traced.
        closed = jax.make_jaxpr(lambda *indices: function(*indices))(index_type, index_type, index_type, index_type)
    except jax.errors.TracerArrayConversionError:
        raise MaskProgramError(
            "mask_mod indexed or converted a NumPy array with a traced index; capture a jax array (jnp.asarray) and "
            "index that"
        ) from None
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError) as error:
        raise MaskProgramError(
            f"mask_mod branched on a traced index in Python (if/and/or/not, int(), range()): {type(error).__name__}; "
            f"write it with &, |, ~ and jnp.where, which a mask program contains"
        ) from None
    _check_primitives(closed.jaxpr)
    tracer = _Tracer()
    outputs = tracer.run(closed.jaxpr, closed.consts, [index(name) for name in ("b", "h", "q", "kv")])
    avals = [atom.aval for atom in closed.jaxpr.outvars]
    if len(outputs) != 1 or not isinstance(outputs[0], Expr) or outputs[0].kind != "bool" or avals[0].shape != ():
        described = ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals) or "nothing"
        raise MaskProgramError(
            f"mask_mod returned {described}; it must return one boolean (True where query q_idx may see key kv_idx)"
        )
    return outputs[0], tracer.captured
