"""Mask programs (docs/semantics.md §17): the expression a traced ``mask_mod(b, h, q_idx, kv_idx)`` became, its
evaluation in any array framework, and the classification of tiles as empty, partial or full.

A program is an :class:`Expr` tree over four index leaves (``b``, ``h``, ``q``, ``kv``), integer and boolean
constants, and reads of *captured* integer or boolean tensors at integer expressions of them. Its integers are the
contract's 32-bit signed integers (a value outside that range is refused when a call binds the program, from the
value ranges below), so a kernel may compute it in int32. Division and remainder round as Python's ``//`` and ``%``
(``floordiv``, ``mod``) or as C's (``tdiv``, ``trem``, what JAX's primitives are); a zero divisor is the program's
error. A read clamps each index into the tensor's shape: in-range reads are the contract, the clamp only keeps an
edge tile's out-of-range lanes from faulting.

Every backend reads a program through this module: :func:`evaluate` (broadcasting, for references, per-tile
evaluation in jnp or torch, and materialisation), :func:`tile_classes` (block sparsity) and :func:`nodes` (the
program in dependency order, one temporary per node, for code generators).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from attnkit.errors import MaskProgramError

INDICES = ("b", "h", "q", "kv")
#: Integer operations of two operands, and their spelling in Python (for messages and generated code).
INT_BINARY = {
    "add": "+",
    "sub": "-",
    "mul": "*",
    "floordiv": "//",
    "mod": "%",
    "tdiv": "tdiv",
    "trem": "trem",
    "min": "min",
    "max": "max",
}
COMPARISONS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
BOOL_BINARY = {"and": "&", "or": "|", "xor": "^"}
UNARY = {"neg": "-", "abs": "abs", "not": "~", "int": "int", "bool": "bool"}
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

#: Tile classes, one byte each (:func:`tile_classes`).
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Expr:
    """One node of a program. ``op`` is ``"index"`` (``value`` one of :data:`INDICES`), ``"const"`` (``value`` an int
    or bool), ``"read"`` (``value`` the captured tensor's slot, ``args`` one index per dimension), ``"where"``
    (condition, then, else), or an operation of :data:`INT_BINARY`, :data:`COMPARISONS`, :data:`BOOL_BINARY` or
    :data:`UNARY`. ``kind`` is ``"int"`` or ``"bool"``."""

    op: str
    args: tuple[Expr, ...] = ()
    value: int | bool | str | None = None
    kind: str = "int"

    def __str__(self) -> str:
        if self.op == "index":
            return {"q": "q_idx", "kv": "kv_idx"}.get(str(self.value), str(self.value))
        if self.op == "const":
            return repr(self.value)
        if self.op == "read":
            return f"captured[{self.value}][{', '.join(map(str, self.args))}]"
        if self.op in INT_BINARY and INT_BINARY[self.op].isalpha() or self.op == "where":
            return f"{self.op}({', '.join(map(str, self.args))})"
        if self.op in UNARY:
            symbol = UNARY[self.op]
            return f"{symbol}({self.args[0]})" if symbol.isalpha() else f"{symbol}{self.args[0]}"
        symbol = {**INT_BINARY, **COMPARISONS, **BOOL_BINARY}[self.op]
        return f"({self.args[0]} {symbol} {self.args[1]})"

    def walk(self) -> Iterator[Expr]:
        yield self
        for arg in self.args:
            yield from arg.walk()

    def indices(self) -> frozenset[str]:
        """The index leaves this expression depends on (through reads too)."""
        return frozenset(str(node.value) for node in self.walk() if node.op == "index")


def index(name: str) -> Expr:
    return Expr("index", value=name)


def const(value: int | bool) -> Expr:
    return Expr("const", value=value, kind="bool" if isinstance(value, bool) else "int")


def nodes(expr: Expr) -> list[Expr]:
    """The distinct nodes of ``expr``, each after its operands: a code generator gives node n the temporary ``tN``
    and writes it from its operands' temporaries."""
    order: dict[Expr, None] = {}

    def visit(node: Expr) -> None:
        if node in order:
            return
        for arg in node.args:
            visit(arg)
        order[node] = None

    visit(expr)
    return list(order)


def build(op: str, *args: Expr) -> Expr:
    """The node ``op(*args)`` with its operands' kinds checked (:class:`attnkit.MaskProgramError` naming mask_mod
    and the operation otherwise) and constants folded: what a tracer builds a program with."""
    kinds = [a.kind for a in args]
    if op in INT_BINARY or op in ("neg", "abs"):
        if "bool" in kinds:
            raise MaskProgramError(
                f"mask_mod applied {op} to a boolean; convert it to an integer (.int(), .astype(int)) or use where"
            )
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
            raise MaskProgramError("mask_mod called where with a non-boolean condition or mixed branches")
        if condition.op == "const" or a == b:  # the branch taken is known
            return a if a == b or condition.value else b
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


@dataclass(frozen=True)
class CapturedSpec:
    """What a program knows of a captured tensor when traced: its shape and dtype (new values never re-trace)."""

    shape: tuple[int, ...]
    dtype: str  # "bool", "int8" .. "int64", "uint8"


@dataclass(frozen=True)
class MaskProgram:
    """A traced mask_mod: the expression and the captured tensors it reads (by slot). Hashable: kernels cache their
    generated code by it."""

    expr: Expr
    captured: tuple[CapturedSpec, ...]
    #: The function's name, for messages and ``explain``.
    name: str = "mask_mod"

    def __str__(self) -> str:
        return str(self.expr)

    def __hash__(self) -> int:
        # Computed once: a program keys the per-call caches (class cache, range checks), and hashing the expression
        # walks every node.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.expr, self.captured, self.name))
            object.__setattr__(self, "_hash", cached)
        return cached


@dataclass(frozen=True, eq=False)
class BoundProgram:
    """A program with the captured tensors of one call (torch tensors or JAX arrays, in the call's framework and on
    its device)."""

    program: MaskProgram
    captured: tuple[Any, ...]

    @property
    def expr(self) -> Expr:
        return self.program.expr


# --- Evaluation -------------------------------------------------------------------------------------------------


class ArrayOps:
    """The handful of array operations a program needs, in one framework (:func:`array_ops`)."""

    def __init__(self, module: Any, name: str) -> None:
        self.xp, self.name = module, name

    def arange(self, n: int, like: Any = None) -> Any:
        if self.name == "torch":
            return self.xp.arange(n, dtype=self.xp.int64, device=None if like is None else like.device)
        return self.xp.arange(n, dtype=self.integer)

    @property
    def integer(self) -> Any:
        """The integer dtype values are computed in: int64 where the framework always has it (torch, NumPy: value
        ranges past int32 stay exact, so that :func:`whole_range` sees them), JAX's int32 otherwise."""
        return self.xp.int32 if self.name == "jax" else self.xp.int64

    @property
    def unbounded(self) -> int:
        """A bound standing for "no bound" in value ranges, representable in :attr:`integer`."""
        return INT32_MAX if self.name == "jax" else _UNBOUNDED

    def where(self, c: Any, a: Any, b: Any) -> Any:
        if self.name == "torch":
            return self.xp.where(self.xp.as_tensor(c), self.xp.as_tensor(a), self.xp.as_tensor(b))
        return self.xp.where(c, a, b)

    def minimum(self, a: Any, b: Any) -> Any:
        if self.name == "torch":
            return self.xp.minimum(self.xp.as_tensor(a), self.xp.as_tensor(b))
        return self.xp.minimum(a, b)

    def maximum(self, a: Any, b: Any) -> Any:
        if self.name == "torch":
            return self.xp.maximum(self.xp.as_tensor(a), self.xp.as_tensor(b))
        return self.xp.maximum(a, b)

    def tdiv(self, a: Any, b: Any) -> Any:
        """C's division, rounding toward zero."""
        quotient = a // b
        return quotient + ((quotient < 0) & (quotient * b != a))

    def trem(self, a: Any, b: Any) -> Any:
        return a - self.tdiv(a, b) * b

    def to_int(self, x: Any) -> Any:
        if isinstance(x, (bool, int)):
            return int(x)
        if self.name == "torch":
            return x.to(self.xp.int64)
        return x.astype(self.integer)

    def broadcast(self, value: Any, shape: tuple[int, ...], like: Any) -> Any:
        """``value`` (an array, or a Python int or bool) as an array of ``shape`` in ``like``'s framework, device."""
        if self.name == "torch":
            return self.xp.broadcast_to(self.xp.as_tensor(value, device=like.device), shape)
        return self.xp.broadcast_to(self.xp.asarray(value), shape)

    def read(self, tensor: Any, indices: Sequence[Any]) -> Any:
        """``tensor`` at the broadcast ``indices`` (one per dimension), each clamped into the tensor's shape."""
        if not indices:  # a 0-d tensor (a closure read at a Python int index before tracing saw it): a torch tensor
            return tensor if self.name == "torch" else tensor[()]  # as it is (dynamo refuses t[()]); a ref loads
        clamped = []
        for size, position in zip(tensor.shape, indices):
            if isinstance(position, int):
                clamped.append(min(max(position, 0), size - 1))
            elif self.name == "torch":
                clamped.append(position.clamp(0, size - 1))
            else:
                clamped.append(self.xp.clip(position, 0, size - 1))
        return tensor[tuple(clamped)]


def array_ops(x: Any) -> ArrayOps:
    """The :class:`ArrayOps` of ``x``'s framework (torch tensor, JAX array or NumPy array)."""
    module = type(x).__module__
    if module.startswith("torch"):
        import torch

        return ArrayOps(torch, "torch")
    if module.startswith(("jax", "jaxlib")):
        import jax.numpy as jnp

        return ArrayOps(jnp, "jax")
    import numpy as np

    return ArrayOps(np, "numpy")


def evaluate(expr: Expr, ops: ArrayOps, env: dict[str, Any], captured: Sequence[Any]) -> Any:
    """The value of ``expr`` with the index leaves bound to broadcasting integer arrays (``env``: ``b``, ``h``,
    ``q``, ``kv``; those the expression does not use may be absent) and the captured tensors by slot. The result
    broadcasts against the indices it uses (a constant program gives a Python bool)."""
    values: dict[Expr, Any] = {}
    for node in nodes(expr):
        values[node] = _apply(node, [values[arg] for arg in node.args], ops, env, captured)
    return values[expr]


def _apply(node: Expr, args: list[Any], ops: ArrayOps, env: dict[str, Any], captured: Sequence[Any]) -> Any:
    op = node.op
    if op == "index":
        return env[str(node.value)]
    if op == "const":
        return node.value
    if op == "read":
        value = ops.read(captured[int(node.value)], args)  # type: ignore[arg-type]
        return value if node.kind == "bool" else ops.to_int(value)
    if op == "where":
        return ops.where(*args)
    if op in UNARY:
        (a,) = args
        if op == "neg":
            return -a
        if op == "abs":
            return abs(a)
        if op == "not":
            return not a if isinstance(a, bool) else ~a
        if op == "int":
            return ops.to_int(a)
        return a != 0  # bool
    a, b = args
    binary = {
        "add": lambda: a + b,
        "sub": lambda: a - b,
        "mul": lambda: a * b,
        "floordiv": lambda: a // b,
        "mod": lambda: a % b,
        "tdiv": lambda: ops.tdiv(a, b),
        "trem": lambda: ops.trem(a, b),
        "min": lambda: ops.minimum(a, b) if not _scalars(a, b) else min(a, b),
        "max": lambda: ops.maximum(a, b) if not _scalars(a, b) else max(a, b),
        "eq": lambda: a == b,
        "ne": lambda: a != b,
        "lt": lambda: a < b,
        "le": lambda: a <= b,
        "gt": lambda: a > b,
        "ge": lambda: a >= b,
        "and": lambda: a & b,
        "or": lambda: a | b,
        "xor": lambda: a ^ b,
    }
    return binary[op]()


def _scalars(*values: Any) -> bool:
    return all(isinstance(value, (bool, int)) for value in values)


def dense(bound: BoundProgram, batch: int, heads: int, len_q: int, len_k: int, like: Any) -> Any:
    """The program's visibility as a boolean array of shape (B|1, H|1, Lq, Lk): size 1 on an index it does not
    read. ``like``: an array of the framework and device to build it in. What a backend that materialises programs
    (or the oracle) ANDs into the call's mask."""
    ops = array_ops(like)
    used = bound.expr.indices()
    sizes = {"b": batch if "b" in used else 1, "h": heads if "h" in used else 1, "q": len_q, "kv": len_k}
    env = {name: _axis(ops, sizes[name], axis, like) for axis, name in enumerate(INDICES)}
    value = evaluate(bound.expr, ops, env, bound.captured)
    return ops.broadcast(value, (sizes["b"], sizes["h"], len_q, len_k), like)


def _axis(ops: ArrayOps, size: int, axis: int, like: Any) -> Any:
    """arange(size) laid along ``axis`` of four."""
    shape = [1, 1, 1, 1]
    shape[axis] = size
    return ops.arange(size, like).reshape(shape)


# --- Value ranges and tile classes ------------------------------------------------------------------------------

_UNBOUNDED = 2**62  # past int32 either way; JAX's int32 ranges take its largest value (:meth:`ArrayOps.unbounded`)


class _Range:
    """Inclusive bounds (lo, hi) of a node's values, as broadcasting integer arrays or ints (bools as 0/1)."""

    __slots__ = ("lo", "hi")

    def __init__(self, lo: Any, hi: Any) -> None:
        self.lo, self.hi = lo, hi


def value_ranges(
    expr: Expr, ops: ArrayOps, boxes: dict[str, tuple[Any, Any]], captured: Sequence[Any], tables: _RangeTables
) -> dict[Expr, _Range]:
    """Sound bounds of every node's values over index boxes: ``boxes[name] = (lo, hi)`` broadcasting arrays (each
    index within [lo, hi]). Never narrower than the truth; as narrow as interval arithmetic gives, with exact range
    minima and maxima of captured tensors along one ranging dimension (:class:`_RangeTables`)."""
    ranges: dict[Expr, _Range] = {}
    for node in nodes(expr):
        ranges[node] = _range_of(node, [ranges[arg] for arg in node.args], ops, boxes, captured, tables)
    return ranges


def _range_of(
    node: Expr, args: list[_Range], ops: ArrayOps, boxes: dict[str, tuple[Any, Any]], captured: Sequence[Any],
    tables: _RangeTables,
) -> _Range:  # fmt: skip
    op, mn, mx, where = node.op, ops.minimum, ops.maximum, ops.where
    if op == "index":
        return _Range(*boxes[str(node.value)])
    if op == "const":
        return _Range(int(node.value), int(node.value))  # type: ignore[arg-type]
    if op == "read":
        return tables.read(int(node.value), captured[int(node.value)], node, args)  # type: ignore[arg-type]
    if op == "where":
        c, a, b = args
        lo, hi = mn(a.lo, b.lo), mx(a.hi, b.hi)
        return _Range(
            where(c.lo == 1, a.lo, where(c.hi == 0, b.lo, lo)), where(c.lo == 1, a.hi, where(c.hi == 0, b.hi, hi))
        )
    if op in UNARY:
        (a,) = args
        if op == "neg":
            return _Range(-a.hi, -a.lo)
        if op == "abs":
            lo = where(a.lo >= 0, a.lo, where(a.hi <= 0, -a.hi, 0))
            return _Range(lo, mx(-a.lo, a.hi))
        if op == "not":
            return _Range(1 - a.hi, 1 - a.lo)
        if op == "int":
            return a
        certain_true = (a.lo > 0) | (a.hi < 0)
        return _Range(ops.to_int(certain_true), 1 - ops.to_int((a.lo == 0) & (a.hi == 0)))
    a, b = args
    if op == "add":
        return _Range(a.lo + b.lo, a.hi + b.hi)
    if op == "sub":
        return _Range(a.lo - b.hi, a.hi - b.lo)
    if op == "min":
        return _Range(mn(a.lo, b.lo), mn(a.hi, b.hi))
    if op == "max":
        return _Range(mx(a.lo, b.lo), mx(a.hi, b.hi))
    if op in ("mul", "floordiv", "tdiv"):
        if op == "mul":
            corners = [a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi]
        else:  # monotone in each operand while the divisor keeps its sign: the corners bound it
            divide = (lambda x, y: x // y) if op == "floordiv" else ops.tdiv
            safe_lo, safe_hi = where(b.lo == 0, 1, b.lo), where(b.hi == 0, -1, b.hi)
            corners = [divide(a.lo, safe_lo), divide(a.lo, safe_hi), divide(a.hi, safe_lo), divide(a.hi, safe_hi)]
        lo, hi = (
            mn(mn(corners[0], corners[1]), mn(corners[2], corners[3])),
            mx(mx(corners[0], corners[1]), mx(corners[2], corners[3])),
        )
        if op != "mul":  # a divisor range holding 0 (or both signs) bounds nothing
            straddles = (b.lo <= 0) & (b.hi >= 0)
            lo, hi = where(straddles, -ops.unbounded, lo), where(straddles, ops.unbounded, hi)
        return _Range(lo, hi)
    if op in ("mod", "trem"):
        return _remainder_range(op, a, b, ops)
    if op in COMPARISONS:
        return _compare_range(op, a, b, ops)
    if op == "and":
        return _Range(a.lo & b.lo, a.hi & b.hi)
    if op == "or":
        return _Range(a.lo | b.lo, a.hi | b.hi)
    # xor: decided only where both operands are
    both = (a.lo == a.hi) & (b.lo == b.hi)
    exact = a.lo ^ b.lo
    return _Range(where(both, exact, 0), where(both, exact, 1))


def _remainder_range(op: str, a: _Range, b: _Range, ops: ArrayOps) -> _Range:
    mn, mx, where = ops.minimum, ops.maximum, ops.where
    magnitude = mx(abs(b.lo), abs(b.hi)) - 1  # |remainder| < |divisor|
    if op == "mod":  # the divisor's sign; exact where a constant positive divisor sees a short run of a
        lo = where(b.lo > 0, 0, -magnitude)
        hi = where(b.hi < 0, 0, magnitude)
        constant = (b.lo == b.hi) & (b.lo > 0)
        divisor = where(b.lo > 0, b.lo, 1)
        run = constant & (a.hi - a.lo < divisor) & (a.lo % divisor <= a.hi % divisor)
        return _Range(where(run, a.lo % divisor, lo), where(run, a.hi % divisor, hi))
    # trem: the dividend's sign, no larger than it
    lo = where(a.lo >= 0, 0, mx(-magnitude, a.lo))
    hi = where(a.hi <= 0, 0, mn(magnitude, a.hi))
    return _Range(lo, hi)


def _compare_range(op: str, a: _Range, b: _Range, ops: ArrayOps) -> _Range:
    if op in ("gt", "ge"):  # a > b is b < a
        op, a, b = {"gt": "lt", "ge": "le"}[op], b, a
    if op == "lt":
        true, false = a.hi < b.lo, a.lo >= b.hi
    elif op == "le":
        true, false = a.hi <= b.lo, a.lo > b.hi
    else:
        point_equal = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
        disjoint = (a.hi < b.lo) | (b.hi < a.lo)
        true, false = (point_equal, disjoint) if op == "eq" else (disjoint, point_equal)
    return _Range(ops.to_int(true), 1 - ops.to_int(false))


class _RangeTables:
    """Range minima and maxima of captured tensors along one dimension (sparse tables: O(n log n) to build, O(1) per
    query), so that a read whose index ranges over a tile (``doc[b, q_idx]``) is bounded exactly."""

    def __init__(self, ops: ArrayOps) -> None:
        self.ops = ops
        self.built: dict[tuple[int, int], tuple[Any, Any, Any]] = {}

    def read(self, slot: int, tensor: Any, node: Expr, indices: list[_Range]) -> _Range:
        ops = self.ops
        if not indices:
            value = ops.to_int(tensor[()])
            return _Range(value, value)
        lows = [_clamp(ops, r.lo, size) for r, size in zip(indices, tensor.shape)]
        highs = [_clamp(ops, r.hi, size) for r, size in zip(indices, tensor.shape)]
        ranging = [d for d, arg in enumerate(node.args) if arg.indices() & {"q", "kv"}]
        if not ranging:
            value = ops.to_int(tensor[tuple(lows)])
            return _Range(value, value)
        if len(ranging) > 1:  # bounds of the whole tensor: sound, and loose
            values = ops.to_int(tensor)
            return _Range(values.min(), values.max())
        (axis,) = ranging
        minima, maxima, log2 = self._tables(slot, tensor, axis)
        lo, hi = lows[axis], highs[axis]
        level = log2[hi - lo]
        second = hi - _pow2(level) + 1
        head = [*lows[:axis], lo, *lows[axis + 1 :]]
        tail = [*lows[:axis], second, *lows[axis + 1 :]]
        low = ops.minimum(minima[(level, *head)], minima[(level, *tail)])
        high = ops.maximum(maxima[(level, *head)], maxima[(level, *tail)])
        return _Range(low, high)

    def _tables(self, slot: int, tensor: Any, axis: int) -> tuple[Any, Any, Any]:
        if (slot, axis) not in self.built:
            ops = self.ops
            values = ops.to_int(tensor)
            size = tensor.shape[axis]
            minima, maxima = [values], [values]
            step = 1
            while 2 * step <= size:
                minima.append(_shifted_pair(ops, minima[-1], step, axis, ops.minimum))
                maxima.append(_shifted_pair(ops, maxima[-1], step, axis, ops.maximum))
                step *= 2
            stack = ops.xp.stack
            log2 = ops.xp.asarray([max(n.bit_length() - 1, 0) for n in range(1, size + 1)])
            if ops.name == "torch":
                log2 = log2.to(values.device)
            self.built[(slot, axis)] = (stack(minima), stack(maxima), log2)
        return self.built[(slot, axis)]


def _pow2(level: Any) -> Any:
    return (level * 0 + 1) << level


def _shifted_pair(ops: ArrayOps, table: Any, step: int, axis: int, combine: Any) -> Any:
    """combine(table[i], table[min(i + step, n − 1)]) along ``axis``: the next level of a sparse table."""
    size = table.shape[axis]
    positions = ops.arange(size, table if ops.name == "torch" else None) + step
    positions = ops.minimum(positions, size - 1)
    shifted = ops.xp.take(table, positions, axis) if ops.name != "torch" else table.index_select(axis, positions)
    return combine(table, shifted)


def _clamp(ops: ArrayOps, value: Any, size: int) -> Any:
    if isinstance(value, int):
        return min(max(value, 0), size - 1)
    return value.clamp(0, size - 1) if ops.name == "torch" else ops.xp.clip(value, 0, size - 1)


def tile_classes(
    bound: BoundProgram,
    batch: int,
    heads: int,
    len_q: int,
    len_k: int,
    block_q: int,
    block_k: int,
    like: Any,
    refine: bool = True,
) -> Any:
    """One byte per (query tile, key tile) pair, shaped (B|1, H|1, ⌈Lq/block_q⌉, ⌈Lk/block_k⌉): :data:`EMPTY` (no
    pair of the tile visible under the program), :data:`FULL` (every pair visible) or :data:`PARTIAL`. Only in-range
    pairs count (an edge tile's rows past Lq are not the program's). Sound by construction: value ranges over the
    tile's index box, then, where they cannot decide and there are few such tiles, the tile evaluated. Time linear in
    the tile pairs (and the refined tiles' elements)."""
    ops = array_ops(like)
    tiles_q, tiles_k = -(-len_q // block_q), -(-len_k // block_k)
    used = bound.expr.indices()
    b_axis = _axis(ops, batch if "b" in used else 1, 0, like)
    h_axis = _axis(ops, heads if "h" in used else 1, 1, like)
    q_lo = _axis(ops, tiles_q, 2, like) * block_q
    k_lo = _axis(ops, tiles_k, 3, like) * block_k
    boxes = {
        "b": (b_axis, b_axis),
        "h": (h_axis, h_axis),
        "q": (q_lo, ops.minimum(q_lo + block_q - 1, len_q - 1)),
        "kv": (k_lo, ops.minimum(k_lo + block_k - 1, len_k - 1)),
    }
    root = value_ranges(bound.expr, ops, boxes, bound.captured, _RangeTables(ops))[bound.expr]
    shape = (b_axis.shape[0], h_axis.shape[1], tiles_q, tiles_k)
    lo, hi = ops.broadcast(root.lo, shape, like), ops.broadcast(root.hi, shape, like)
    classes = ops.where(lo == 1, FULL, ops.where(hi == 0, EMPTY, PARTIAL))
    classes = classes.to(ops.xp.uint8) if ops.name == "torch" else classes.astype(ops.xp.uint8)
    if refine and ops.name == "torch":
        classes = _refine(bound, classes, block_q, block_k, len_q, len_k, ops)
    return classes


#: At most this share of a call's tile pairs is evaluated element by element to refine its classes, this many
#: elements at a time.
REFINE_SHARE = 8
REFINE_ELEMENTS = 1 << 20


def _refine(
    bound: BoundProgram, classes: Any, block_q: int, block_k: int, len_q: int, len_k: int, ops: ArrayOps
) -> Any:
    """Partial tiles evaluated pair by pair, and reclassified where all or none are visible (eager torch only: the
    set of tiles is data)."""
    torch = ops.xp
    partial = (classes == PARTIAL).nonzero()
    count = partial.shape[0]
    if count == 0 or count > 16 + classes.numel() // REFINE_SHARE:
        return classes
    classes = classes.clone()
    # A bounded number of tiles at a time: the evaluation's temporaries stay O(REFINE_ELEMENTS), never O(Lq·Lk).
    step = max(1, REFINE_ELEMENTS // (block_q * block_k))
    for start in range(0, count, step):
        chunk = partial[start : start + step]
        b, h, tq, tk = (chunk[:, axis].reshape(-1, 1, 1) for axis in range(4))
        rows = torch.arange(block_q, device=classes.device).reshape(1, -1, 1) + tq * block_q
        cols = torch.arange(block_k, device=classes.device).reshape(1, 1, -1) + tk * block_k
        visible = evaluate(bound.expr, ops, {"b": b, "h": h, "q": rows, "kv": cols}, bound.captured)
        visible = torch.broadcast_to(torch.as_tensor(visible, device=classes.device), (len(chunk), block_q, block_k))
        in_range = (rows < len_q) & (cols < len_k)
        any_visible = (visible & in_range).flatten(1).any(1)
        all_visible = (visible | ~in_range).flatten(1).all(1)
        refined = torch.where(all_visible, FULL, torch.where(any_visible, PARTIAL, EMPTY)).to(torch.uint8)
        classes[chunk[:, 0], chunk[:, 1], chunk[:, 2], chunk[:, 3]] = refined
    return classes


def whole_range(bound: BoundProgram, batch: int, heads: int, len_q: int, len_k: int, like: Any) -> Iterator[Expr]:
    """The nodes whose values may leave the int32 range over the whole call (from value ranges over the index
    domain): a call binding such a program is refused."""
    ops = array_ops(like)
    boxes = {"b": (0, batch - 1), "h": (0, heads - 1), "q": (0, len_q - 1), "kv": (0, len_k - 1)}
    for node, bounds in value_ranges(bound.expr, ops, boxes, bound.captured, _RangeTables(ops)).items():
        if node.kind == "int" and (int(_least(bounds.lo)) < INT32_MIN or int(_most(bounds.hi)) > INT32_MAX):
            yield node


def _least(x: Any) -> Any:
    return x if isinstance(x, int) else x.min()


def _most(x: Any) -> Any:
    return x if isinstance(x, int) else x.max()


# --- The class cache -------------------------------------------------------------------------------------------


class _ClassCache:
    """Tile classes per program, captured tensors (identity and version) and shapes: a training step or a decode
    step reuses them."""

    def __init__(self, size: int = 64) -> None:
        self.entries: OrderedDict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = OrderedDict()
        self.size = size
        self.lock = threading.Lock()

    def get(self, bound: BoundProgram, shape: tuple[int, int, int, int, int, int], like: Any) -> Any:
        versions = tuple((id(t), getattr(t, "_version", None)) for t in bound.captured)
        key = (bound.program, versions, shape, str(getattr(like, "device", "")))
        with self.lock:
            hit = self.entries.get(key)
            if hit is not None and all(a is b for a, b in zip(hit[0], bound.captured)):
                self.entries.move_to_end(key)
                return hit[1]
        batch, heads, len_q, len_k, block_q, block_k = shape
        classes = tile_classes(bound, batch, heads, len_q, len_k, block_q, block_k, like)
        with self.lock:
            self.entries[key] = (bound.captured, classes)  # holding the tensors keeps their ids from reuse
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return classes


CLASS_CACHE = _ClassCache()


def cached_tile_classes(
    bound: BoundProgram, batch: int, heads: int, len_q: int, len_k: int, block_q: int, block_k: int, like: Any
) -> Any:
    """:func:`tile_classes`, cached (eager calls; under a JAX trace the captured arrays are tracers and this
    computes them in the trace)."""
    if any(type(t).__module__.startswith("jax") and "Tracer" in type(t).__name__ for t in bound.captured):
        return tile_classes(bound, batch, heads, len_q, len_k, block_q, block_k, like)
    return CLASS_CACHE.get(bound, (batch, heads, len_q, len_k, block_q, block_k), like)


def replace_captured(bound: BoundProgram, captured: Sequence[Any]) -> BoundProgram:
    return dataclasses.replace(bound, captured=tuple(captured))


# --- Bands in a program -----------------------------------------------------------------------------------------
# A conjunct that bounds t = kv_idx − q_idx is a band: causal, or a window, in raw positions (top-left alignment).
# Moved into the spec, a backend's own band machinery trims each query block's keys, where the program could only
# classify whole tiles.

_Linear = tuple[int, int, int]  # (coefficient of q_idx, of kv_idx, constant)


def _linear(expr: Expr) -> _Linear | None:
    """``expr`` as a·q_idx + c·kv_idx + k, or None where it is not one (reads, b, h, products of indices)."""
    if expr.op == "index":
        return {"q": (1, 0, 0), "kv": (0, 1, 0)}.get(str(expr.value))
    if expr.op == "const" and expr.kind == "int":
        return 0, 0, int(expr.value)  # type: ignore[arg-type]
    parts = [_linear(arg) for arg in expr.args]
    if any(part is None for part in parts):
        return None
    if expr.op == "neg":
        ((a, c, k),) = parts  # type: ignore[misc]
        return -a, -c, -k
    if expr.op in ("add", "sub"):
        (a1, c1, k1), (a2, c2, k2) = parts  # type: ignore[misc]
        sign = 1 if expr.op == "add" else -1
        return a1 + sign * a2, c1 + sign * c2, k1 + sign * k2
    if expr.op == "mul":
        (a1, c1, k1), (a2, c2, k2) = parts  # type: ignore[misc]
        if a1 == c1 == 0:
            return k1 * a2, k1 * c2, k1 * k2
        if a2 == c2 == 0:
            return k2 * a1, k2 * c1, k2 * k1
    return None


_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}


def _band_bounds(expr: Expr) -> tuple[float, float] | None:
    """(lo, hi): the conjunct is exactly lo ≤ kv_idx − q_idx ≤ hi (an infinite side unbounded); None otherwise."""
    if expr.op not in _FLIPPED or len(expr.args) != 2:
        return None
    left, right = expr.args
    if right.op == "abs" and left.op != "abs":  # w >= |t| as |t| <= w
        left, right, op = right, left, _FLIPPED[expr.op]
    else:
        op = expr.op
    if left.op == "abs":  # |±t| <= w (or < w)
        inner, limit = _linear(left.args[0]), _linear(right)
        if inner is None or limit is None or inner[2] != 0 or abs(inner[0]) != 1 or inner[0] != -inner[1]:
            return None
        if limit[0] or limit[1] or op not in ("le", "lt"):
            return None
        width = limit[2] - (op == "lt")
        return -width, width
    a, b = _linear(left), _linear(right)
    if a is None or b is None:
        return None
    cq, ckv, k = a[0] - b[0], a[1] - b[1], a[2] - b[2]  # cq·q + ckv·kv + k (op) 0
    if (cq, ckv) == (-1, 1):  # t + k (op) 0: t (op) −k
        edge = -k
    elif (cq, ckv) == (1, -1):  # −t + k (op) 0: t (flipped op) k
        edge, op = k, _FLIPPED[op]
    else:
        return None
    inf = float("inf")
    return {
        "le": (-inf, edge), "lt": (-inf, edge - 1), "ge": (edge, inf), "gt": (edge + 1, inf), "eq": (edge, edge)
    }[op]  # fmt: skip


def conjuncts(expr: Expr) -> list[Expr]:
    """The terms of ``expr``'s top-level AND (``expr`` itself when it is no AND)."""
    if expr.op == "and" and expr.kind == "bool":
        return [term for arg in expr.args for term in conjuncts(arg)]
    return [expr]


def band_of(expr: Expr) -> tuple[tuple[float, float], Expr | None] | None:
    """((lo, hi), the rest): ``expr`` is lo ≤ kv_idx − q_idx ≤ hi AND the rest (None: nothing else), with lo ≤ 0 ≤ hi
    so that a top-left causal clause or window expresses the band; None where no conjunct is such a band."""
    lo, hi, rest = -float("inf"), float("inf"), []
    for term in conjuncts(expr):
        bounds = _band_bounds(term)
        if bounds is None:
            rest.append(term)
        else:
            lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    if len(rest) == len(conjuncts(expr)) or not lo <= 0 <= hi:
        return None
    remaining = None
    for term in rest:
        remaining = term if remaining is None else build("and", remaining, term)
    return (lo, hi), remaining
