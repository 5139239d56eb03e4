"""Random mask programs for the conformance harness (docs/semantics.md §17, docs/testing.md).

A drawn program is data: an :class:`~attnkit.contract.programs.Expr` from the grammar (integer + − * // % and C
rounding, min/max/abs, comparisons, & | ^ ~, where, reads of captured tables at clamped indices; depth up to 4) and
the tables' shapes. :func:`program_function` writes it as the function a user would pass as ``mask_mod``, in torch
or JAX operations, so a backend's call goes through attnkit's tracer like a user's. The oracle's dense mask is that
same function called on broadcast index tensors (:func:`dense_by_calling`): torch's own semantics of the
function, not attnkit's evaluation of its trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

from attnkit.contract.programs import Expr, const, index


@dataclass(frozen=True)
class Table:
    """A captured table: ``shape``; ``kind`` "documents" (per batch row, non-decreasing ids from 0, as packing makes
    them), "ids" (small integers, negatives included) or "flags" (booleans)."""

    shape: tuple[int, ...]
    kind: str


@dataclass(frozen=True)
class ProgramCase:
    """A drawn program: its expression (reads name tables by slot) and its tables, whose values make_arrays draws."""

    expr: Expr
    tables: tuple[Table, ...]

    def __str__(self) -> str:
        return f"mask_mod={self.expr} tables={[t.shape for t in self.tables]}"


def table_values(table: Table, rng: np.random.Generator) -> np.ndarray:
    if table.kind == "flags":
        return rng.random(table.shape) < 0.5
    if table.kind == "ids":
        return rng.integers(-2, 6, size=table.shape)
    steps = rng.random(table.shape) < 0.3  # documents: a new one starts where a step falls
    return np.cumsum(steps, axis=-1) - steps[..., :1]


_INDEX_NAMES = ("b", "h", "q", "kv")


@st.composite
def programs(draw: st.DrawFn, batch: int, heads: int, len_q: int, len_k: int, max_depth: int = 4) -> ProgramCase:
    """A program over a call of these sizes: a model's mask (document causal, prefix-LM, chunked, image groups, a
    window with global tokens, strided) in a third of the draws, else one drawn from the grammar; either may then be
    combined with another drawn clause."""
    length = max(len_q, len_k)
    tables = (Table((batch, length), draw(st.sampled_from(["documents", "ids"]))), Table((length,), "flags"))
    depth = draw(st.integers(1, max_depth))
    if draw(st.integers(0, 2)) == 0:
        expr = draw(_model_masks(len_q, len_k, length))
        if draw(st.booleans()):
            combine = draw(st.sampled_from(["and", "or"]))
            expr = Expr(combine, (expr, draw(_bools(depth - 1, tables))), kind="bool")
    else:
        expr = draw(_bools(depth, tables))
    if not any(node.op == "index" and node.value in ("q", "kv") for node in expr.walk()):
        # a program of b and h alone is a per-head mask: keep one, and make most depend on positions
        if draw(st.booleans()):
            expr = Expr("and", (expr, _cmp("ge", index("q"), index("kv"))), kind="bool")
    used = {int(node.value) for node in expr.walk() if node.op == "read"}  # type: ignore[arg-type]
    kept = tuple(tables[slot] for slot in sorted(used))
    renumber = {slot: new for new, slot in enumerate(sorted(used))}
    return ProgramCase(_renumber(expr, renumber), kept)


def _renumber(expr: Expr, slots: dict[int, int]) -> Expr:
    args = tuple(_renumber(arg, slots) for arg in expr.args)
    value = slots[int(expr.value)] if expr.op == "read" else expr.value  # type: ignore[arg-type]
    return Expr(expr.op, args, value, expr.kind)


def _cmp(op: str, a: Expr, b: Expr) -> Expr:
    return Expr(op, (a, b), kind="bool")


def _int(op: str, *args: Expr) -> Expr:
    return Expr(op, args)


def _clamped(position: Expr, size: int) -> Expr:
    return _int("min", _int("max", position, const(0)), const(size - 1))


@st.composite
def _model_masks(draw: st.DrawFn, len_q: int, len_k: int, length: int) -> Expr:
    q, kv = index("q"), index("kv")
    causal = _cmp("ge", q, kv)
    name = draw(st.sampled_from(["document", "prefix", "chunked", "images", "window_global", "strided", "dilated"]))
    if name == "document":  # packed documents, causal within each
        ids = Expr("read", (index("b"), _clamped(q, length)), 0), Expr("read", (index("b"), _clamped(kv, length)), 0)
        return Expr("and", (_cmp("eq", *ids), causal), kind="bool")
    if name == "prefix":  # a bidirectional prefix, causal after it
        return Expr("or", (_cmp("lt", kv, const(draw(st.integers(0, len_k)))), causal), kind="bool")
    if name == "chunked":  # Llama 4: causal within chunks of C
        chunk = draw(st.integers(1, 8))
        same = _cmp("eq", _int("floordiv", q, const(chunk)), _int("floordiv", kv, const(chunk)))
        return Expr("and", (same, causal), kind="bool")
    if name == "images":  # Gemma 3: causal text, image tokens (flags) bidirectional within their group (ids)
        flag_q = Expr("read", (_clamped(q, length),), 1, "bool")
        flag_kv = Expr("read", (_clamped(kv, length),), 1, "bool")
        group = _cmp(
            "eq",
            Expr("read", (index("b"), _clamped(q, length)), 0),
            Expr("read", (index("b"), _clamped(kv, length)), 0),
        )
        return Expr("or", (causal, Expr("and", (Expr("and", (flag_q, flag_kv), kind="bool"), group), kind="bool")),
                    kind="bool")  # fmt: skip
    if name == "window_global":  # ModernBERT-style local window, plus global tokens that see and are seen by all
        window = _cmp("le", _int("abs", _int("sub", q, kv)), const(draw(st.integers(0, 6))))
        globals_ = const(draw(st.integers(0, 3)))
        return Expr("or", (window, Expr("or", (_cmp("lt", q, globals_), _cmp("lt", kv, globals_)), kind="bool")),
                    kind="bool")  # fmt: skip
    stride = const(draw(st.integers(1, 4)))
    if name == "strided":
        return Expr("and", (causal, _cmp("eq", _int("mod", _int("sub", q, kv), stride), const(0))), kind="bool")
    return Expr("and", (causal, _cmp("eq", _int("trem", kv, stride), _int("trem", q, stride))), kind="bool")


def _ints(depth: int, tables: tuple[Table, ...]) -> st.SearchStrategy[Expr]:
    leaves = st.one_of(st.sampled_from([index(name) for name in _INDEX_NAMES]), st.integers(-2, 6).map(const))
    if depth <= 0:
        return leaves
    smaller = _ints(depth - 1, tables)
    positive = st.integers(1, 5).map(const)
    length = tables[0].shape[1]
    return st.one_of(
        leaves,
        st.tuples(st.sampled_from(["add", "sub", "min", "max"]), smaller, smaller).map(lambda t: _int(*t)),
        st.tuples(smaller, st.integers(-2, 3).map(const)).map(lambda t: _int("mul", *t)),
        st.tuples(st.sampled_from(["floordiv", "mod", "tdiv", "trem"]), smaller, positive).map(lambda t: _int(*t)),
        st.tuples(st.sampled_from(["abs", "neg"]), smaller).map(lambda t: _int(*t)),
        st.tuples(_bools(depth - 1, tables), smaller, smaller).map(lambda t: _int("where", *t)),
        smaller.map(lambda position: Expr("read", (index("b"), _clamped(position, length)), 0)),
    )


def _bools(depth: int, tables: tuple[Table, ...]) -> st.SearchStrategy[Expr]:
    position = st.sampled_from([index("q"), index("kv")])
    comparison = st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge"])
    leaves = st.tuples(comparison, position, st.one_of(position, _ints(0, tables))).map(lambda t: _cmp(*t))
    if depth <= 0:
        return leaves
    smaller, ints = _bools(depth - 1, tables), _ints(depth - 1, tables)
    flags = tables[1].shape[0]
    return st.one_of(
        leaves,
        st.tuples(comparison, ints, ints).map(lambda t: _cmp(*t)),
        st.tuples(st.sampled_from(["and", "or", "xor"]), smaller, smaller).map(
            lambda t: Expr(t[0], t[1:], kind="bool")
        ),
        smaller.map(lambda a: Expr("not", (a,), kind="bool")),
        ints.map(lambda position: Expr("read", (_clamped(position, flags),), 1, "bool")),
    )


def program_function(program: ProgramCase, tables: Sequence[Any]) -> Callable[..., Any]:
    """The program as a user writes a ``mask_mod``: torch operations where the tables are torch tensors, jax.numpy
    ones where they are JAX arrays. Called with traced indices (attnkit's tracer) or real broadcast index arrays
    (:func:`dense_by_calling`)."""
    jax_tables = bool(tables) and not type(tables[0]).__module__.startswith("torch")
    fns = _JaxFunctions() if jax_tables else _TorchFunctions()

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        env = {"b": b, "h": h, "q": q_idx, "kv": kv_idx}
        return _call(program.expr, env, tables, fns)

    return mask_mod


def _call(expr: Expr, env: dict[str, Any], tables: Sequence[Any], fns: Any) -> Any:
    op = expr.op
    args = [_call(arg, env, tables, fns) for arg in expr.args]
    if op == "index":
        return env[str(expr.value)]
    if op == "const":
        return expr.value
    if op == "read":
        return tables[int(expr.value)][tuple(args)]  # type: ignore[arg-type]
    if op == "where":
        condition, a, b = args
        return (a if condition else b) if isinstance(condition, bool) else fns.where(condition, a, b)
    if op in ("min", "max"):
        return fns.min(*args) if op == "min" else fns.max(*args)
    if op in ("tdiv", "trem"):
        a, b = args
        if isinstance(a, int) and isinstance(b, int):  # C's rounding toward zero
            quotient = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)
            return quotient if op == "tdiv" else a - quotient * b
        return fns.tdiv(a, b) if op == "tdiv" else fns.trem(a, b)
    unary = {
        "neg": lambda a: -a,
        "abs": abs,
        "not": lambda a: (not a) if isinstance(a, bool) else ~a,
        "int": lambda a: int(a) if isinstance(a, bool) else fns.to_int(a),
        "bool": lambda a: a != 0,
    }
    if op in unary:
        return unary[op](*args)
    a, b = args
    return {
        "add": lambda: a + b,
        "sub": lambda: a - b,
        "mul": lambda: a * b,
        "floordiv": lambda: a // b,
        "mod": lambda: a % b,
        "eq": lambda: a == b,
        "ne": lambda: a != b,
        "lt": lambda: a < b,
        "le": lambda: a <= b,
        "gt": lambda: a > b,
        "ge": lambda: a >= b,
        "and": lambda: a & b,
        "or": lambda: a | b,
        "xor": lambda: a ^ b,
    }[op]()


class _TorchFunctions:
    """The torch calls a mask_mod makes, on traced values and on real tensors alike (a Python int never reaches
    torch.minimum, which takes tensors only)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def where(self, c: Any, a: Any, b: Any) -> Any:
        return self.torch.where(c, a, b)

    def min(self, a: Any, b: Any) -> Any:
        return self._bound(a, b, "max")

    def max(self, a: Any, b: Any) -> Any:
        return self._bound(a, b, "min")

    def _bound(self, a: Any, b: Any, side: str) -> Any:
        """min(a, b) is a clamped from above by b (side "max"), max(a, b) from below (side "min")."""
        ints = [isinstance(x, int) for x in (a, b)]
        if all(ints):
            return min(a, b) if side == "max" else max(a, b)
        if ints[0]:
            a, b = b, a
        if ints[0] or ints[1]:
            return self.torch.clamp(a, **{side: b})
        return self.torch.minimum(a, b) if side == "max" else self.torch.maximum(a, b)

    def tdiv(self, a: Any, b: Any) -> Any:
        return self.torch.div(a, b, rounding_mode="trunc")

    def trem(self, a: Any, b: Any) -> Any:
        return self.torch.fmod(a, b)

    def to_int(self, a: Any) -> Any:
        return a.int()


class _JaxFunctions:
    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp

        self.jnp, self.lax = jnp, jax.lax

    def where(self, c: Any, a: Any, b: Any) -> Any:
        return self.jnp.where(c, a, b)

    def min(self, a: Any, b: Any) -> Any:
        return self.jnp.minimum(a, b)

    def max(self, a: Any, b: Any) -> Any:
        return self.jnp.maximum(a, b)

    def tdiv(self, a: Any, b: Any) -> Any:
        a, b = self.jnp.asarray(a, self.jnp.int32), self.jnp.asarray(b, self.jnp.int32)
        return self.lax.div(*self.jnp.broadcast_arrays(a, b))

    def trem(self, a: Any, b: Any) -> Any:
        return self.jnp.fmod(a, b)

    def to_int(self, a: Any) -> Any:
        return self.jnp.asarray(a, self.jnp.int32)


def dense_by_calling(function: Callable[..., Any], batch: int, heads: int, len_q: int, len_k: int) -> np.ndarray:
    """The visibility (B, H, Lq, Lk) a mask_mod gives, by calling it on broadcast torch index tensors: the oracle's
    reading of the function, with torch's own semantics (the tables it closes over must be torch tensors)."""
    import torch

    def axis(size: int, at: int) -> torch.Tensor:
        shape = [1, 1, 1, 1]
        shape[at] = size
        return torch.arange(size).reshape(shape)

    visible = function(axis(batch, 0), axis(heads, 1), axis(len_q, 2), axis(len_k, 3))
    visible = torch.as_tensor(visible)
    return np.asarray(torch.broadcast_to(visible, (batch, heads, len_q, len_k)).numpy(), dtype=bool)
