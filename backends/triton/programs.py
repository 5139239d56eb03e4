"""Mask programs (docs/semantics.md §17) as Triton code: one ``@triton.jit`` helper per program, generated from
:func:`attnkit.contract.programs.nodes`, that the kernels call on a partial tile.

The helper is ``mask_program(b, h, rows, cols, Captured, layout)``: ``b`` and ``h`` the tile's batch element and query
head, ``rows`` and ``cols`` its query and key positions (int32 vectors), ``Captured`` a tuple of the program's captured
tensors (pointers) and ``layout`` a flat tuple of their sizes then strides, slot after slot. It returns a boolean
tile broadcasting to (rows, cols). Everything a call changes (captured values, their sizes, the sequence lengths) is
a runtime argument: the source depends only on the expression and the captured tensors' ranks and dtypes, so one
compiled kernel serves every call of a program.

The source is compiled from memory: registered with :mod:`linecache` under a name of its own, which is where
``@triton.jit`` reads a function's source (for the interpreter and for the compiler alike). A kernel takes the helper
as a constexpr; Triton keys its compiled kernels by the helper's source, so equal programs share them across
processes too.
"""

from __future__ import annotations

import functools
import hashlib
import linecache
import threading
from typing import Any

import torch

from attnkit.contract.programs import BOOL_BINARY, COMPARISONS, BoundProgram, CapturedSpec, Expr, MaskProgram, nodes

#: How each operation is written, from its operands' temporaries ({0}, {1}, {2}). Triton's // and % on integers
#: round as C's (toward zero; the remainder takes the dividend's sign): tdiv and trem are theirs.
_FORMS = {
    **{name: f"{{0}} {symbol} {{1}}" for name, symbol in {"add": "+", "sub": "-", "mul": "*"}.items()},
    **{name: f"{{0}} {symbol} {{1}}" for name, symbol in {**COMPARISONS, **BOOL_BINARY}.items()},
    "tdiv": "{0} // {1}",
    "trem": "{0} % {1}",
    "min": "tl.minimum({0}, {1})",
    "max": "tl.maximum({0}, {1})",
    "neg": "-{0}",
    "abs": "tl.abs({0})",
    "not": "{0} == 0",
    "int": "{0}.to(tl.int32)",
    "bool": "{0} != 0",
    "where": "tl.where({0}, {1}, {2})",
}


def source(program: MaskProgram) -> str:
    """The helper's source for ``program``: one temporary per node (``tN``), in int32 throughout (the contract's
    integers: bind refuses a program whose values leave int32)."""
    lines = [
        "import triton",
        "import triton.language as tl",
        "",
        "",
        "@triton.jit",
        "def mask_program(b, h, rows, cols, Captured, layout):",
        "    q = rows[:, None]",
        "    kv = cols[None, :]",
    ]
    place = 0
    for slot, spec in enumerate(program.captured):  # each tensor's pointer, sizes and strides, by name
        rank = len(spec.shape)
        lines.append(f"    c{slot} = Captured[{slot}]")
        for dim in range(rank):
            lines.append(f"    c{slot}_size{dim} = layout[{place + dim}]")
            lines.append(f"    c{slot}_stride{dim} = layout[{place + rank + dim}]")
        place += 2 * rank
    order = nodes(program.expr)
    names = {node: f"t{n}" for n, node in enumerate(order)}
    for node in order:
        lines.append(f"    {names[node]} = {_expression(node, [names[arg] for arg in node.args], program)}")
    lines.append(f"    return {names[program.expr]}")
    return "\n".join(lines) + "\n"


def _expression(node: Expr, args: list[str], program: MaskProgram) -> str:
    op = node.op
    if op == "index":
        return {"b": "b", "h": "h", "q": "q", "kv": "kv"}[str(node.value)]
    if op == "const":
        if node.kind == "bool":
            return f"tl.full((), {int(bool(node.value))}, tl.int1)"
        return f"tl.full((), {int(node.value)}, tl.int32)"  # type: ignore[arg-type]
    if op == "read":
        slot = int(node.value)  # type: ignore[arg-type]
        # Each index clamped into the tensor (the contract: an edge tile's out-of-range lanes never fault), in int64
        # so that a large tensor's offsets cannot wrap.
        offsets = " + ".join(
            f"tl.minimum(tl.maximum({index}, 0), c{slot}_size{dim} - 1).to(tl.int64) * c{slot}_stride{dim}"
            for dim, index in enumerate(args)
        )
        value = f"tl.load(c{slot} + {offsets})" if args else f"tl.load(c{slot})"
        return f"{value} != 0" if node.kind == "bool" else f"{value}.to(tl.int32)"
    if op in _FORMS:
        return _FORMS[op].format(*args)
    a, b = args
    # Python's rounding from C's: a nonzero remainder whose sign differs from the divisor's moves the quotient down
    # by one and the remainder by one divisor.
    off = f"(({a} % {b} != 0) & (({a} % {b} < 0) != ({b} < 0)))"
    if op == "floordiv":
        return f"{a} // {b} - {off}.to(tl.int32)"
    if op == "mod":
        return f"{a} % {b} + tl.where({off}, {b}, 0)"
    raise ValueError(f"a mask program node of unknown operation {op!r}")


_lock = threading.Lock()
#: The helpers by source: programs that differ only in their captured tensors' sizes share one.
_by_source: dict[str, Any] = {}


def helper(program: MaskProgram) -> Any:
    """The ``@triton.jit`` helper of ``program`` (cached: by program, then by source)."""
    return _helper(_erased(program))


def _erased(program: MaskProgram) -> MaskProgram:
    """``program`` without what its source does not depend on (captured sizes but for their count, its name)."""
    captured = tuple(CapturedSpec((0,) * len(spec.shape), spec.dtype) for spec in program.captured)
    return MaskProgram(program.expr, captured, name="mask_mod")


@functools.lru_cache(maxsize=256)
def _helper(program: MaskProgram) -> Any:
    text = source(program)
    with _lock:
        if text not in _by_source:
            filename = f"<attnkit mask program {hashlib.sha256(text.encode()).hexdigest()[:16]}>"
            linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
            namespace: dict[str, Any] = {}
            exec(compile(text, filename, "exec"), namespace)  # our own generated source
            _by_source[text] = namespace["mask_program"]
        return _by_source[text]


def arguments(bound: BoundProgram, device: torch.device) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The kernels' ``Captured`` and ``layout`` of a bound program: the captured tensors where they lie (a boolean one
    read through a uint8 view: no copy), and their sizes then strides."""
    tensors, layout = [], []
    for tensor in bound.captured:
        tensor = torch.as_tensor(tensor, device=device)
        if tensor.dtype == torch.bool:
            tensor = tensor.view(torch.uint8)
        tensors.append(tensor)
        layout.extend(tensor.shape)
        layout.extend(tensor.stride())
    return tuple(tensors), tuple(int(n) for n in layout)
