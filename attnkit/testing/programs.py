"""Random mask programs for the conformance harness (docs/semantics.md §17, docs/testing.md).

A drawn program is data: an :class:`~attnkit.contract.programs.Expr` from the grammar (integer + − * // % and C
rounding, min/max/abs, comparisons, & | ^ ~, where, reads of captured tables at clamped indices; depth up to 4) and
the tables' shapes (drawn by attnkit.testing.strategies.programs). :func:`program_function` writes it as the
function a user would pass as ``mask_mod``, in torch or JAX operations, so a backend's call goes through attnkit's
tracer like a user's. The oracle's dense mask is that same function called on broadcast index tensors
(:func:`dense_by_calling`): torch's own semantics of the function, not attnkit's evaluation of its trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnkit.contract.programs import Expr


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


def program_function(program: ProgramCase, tables: Sequence[Any], framework: str = "torch") -> Callable[..., Any]:
    """The program as a user writes a ``mask_mod``: torch operations, or jax.numpy ones for ``framework="jax"``
    (the tables then JAX arrays). Called with traced indices (attnkit's tracer) or real broadcast index arrays
    (:func:`dense_by_calling`)."""
    fns = _JaxFunctions() if framework == "jax" else _TorchFunctions()

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
