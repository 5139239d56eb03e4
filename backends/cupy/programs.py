"""Mask programs in the CUDA C kernels: a traced ``mask_mod`` (:class:`attnkit.contract.programs.MaskProgram`) as a
``__device__`` function spliced into kernels/attention.cu.

The generated code defines ``mask_program(b, h, q_idx, kv_idx, <captured pointers and sizes>)``, one temporary per
node of :func:`attnkit.contract.programs.nodes` in int32 (the contract's integers; bind refuses programs that leave
them), and the macros through which the kernels take the captured tensors as arguments (``CAPTURED_PARAMETERS``,
``ProgramCaptured``, ``PROGRAM_CAPTURED``). Captured tensors arrive as contiguous int32 with their sizes as int
arguments, so the code depends on the expression and on each slot's number of dimensions only: new captured values,
new shapes and new sequence lengths reuse the compiled module.
"""

from __future__ import annotations

import functools

from attnkit.contract.programs import (
    BOOL_BINARY,
    COMPARISONS,
    INT32_MIN,
    Expr,
    MaskProgram,
    index,
    nodes,
)

#: The line of attention.cu the generated code replaces.
SPLICE_MARKER = "// MASK_PROGRAM: backends/cupy/programs.py splices the generated program here"

#: The C names of the index leaves (the generated function's parameters).
INDEX_NAMES = {"b": "b", "h": "h", "q": "q_idx", "kv": "kv_idx"}
#: Integer operations of two operands written through attention.cu's helpers (Python's rounding from C's / and %,
#: and a zero divisor giving 0 rather than a trap).
HELPERS = {
    "floordiv": "floor_div",
    "mod": "floor_mod",
    "tdiv": "trunc_div",
    "trem": "trunc_rem",
    "min": "min",
    "max": "max",
}
INFIX = {"add": "+", "sub": "-", "mul": "*", **COMPARISONS, **BOOL_BINARY}


def _captured(slot: int) -> str:
    return f"captured_{slot}"


def _size(slot: int, dim: int) -> str:
    return f"captured_{slot}_size_{dim}"


def _literal(value: int | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "(-2147483647 - 1)" if value == INT32_MIN else str(value)


def _read(node: Expr, operands: list[str]) -> str:
    """The captured tensor at its indices, each clamped into the shape (row-major, contiguous)."""
    slot = int(node.value)  # type: ignore[arg-type]
    offset = "0"
    for dim, position in enumerate(operands):
        clamped = f"min(max({position}, 0), {_size(slot, dim)} - 1)"
        offset = clamped if dim == 0 else f"({offset}) * (index_t){_size(slot, dim)} + {clamped}"
    value = f"{_captured(slot)}[{offset}]"
    return f"{value} != 0" if node.kind == "bool" else value


def _expression(node: Expr, operands: list[str]) -> str:
    op = node.op
    if op == "index":
        return INDEX_NAMES[str(node.value)]
    if op == "const":
        return _literal(node.value)  # type: ignore[arg-type]
    if op == "read":
        return _read(node, operands)
    if op == "where":
        return f"{operands[0]} ? {operands[1]} : {operands[2]}"
    if op == "neg":
        return f"-{operands[0]}"
    if op == "abs":
        return f"{operands[0]} < 0 ? -{operands[0]} : {operands[0]}"
    if op == "not":
        return f"!{operands[0]}" if node.args[0].kind == "bool" else f"~{operands[0]}"
    if op == "int":
        return f"(int){operands[0]}"
    if op == "bool":
        return f"{operands[0]} != 0"
    if op in HELPERS:
        return f"{HELPERS[op]}({operands[0]}, {operands[1]})"
    return f"{operands[0]} {INFIX[op]} {operands[1]}"


def captured_dims(program: MaskProgram) -> tuple[int, ...]:
    return tuple(len(spec.shape) for spec in program.captured)


def _pointer_and_sizes(program: MaskProgram, declare: bool) -> list[str]:
    parts = []
    for slot, dims in enumerate(captured_dims(program)):
        parts.append(f"const int* __restrict__ {_captured(slot)}" if declare else _captured(slot))
        parts += [f"int {_size(slot, d)}" if declare else _size(slot, d) for d in range(dims)]
    return parts


@functools.lru_cache(maxsize=128)
def program_code(program: MaskProgram) -> str:
    """The C code of one program, for :data:`SPLICE_MARKER` (cached by program: a kernel's source per program)."""
    parameters = _pointer_and_sizes(program, declare=True)
    names = _pointer_and_sizes(program, declare=False)
    temporaries: dict[Expr, str] = {}
    body = []
    for number, node in enumerate(nodes(program.expr)):
        name = f"t{number}"
        kind = "bool" if node.kind == "bool" else "int"
        body.append(f"    const {kind} {name} = {_expression(node, [temporaries[arg] for arg in node.args])};")
        temporaries[node] = name
    result = temporaries[program.expr]
    root = result if program.expr.kind == "bool" else f"{result} != 0"
    fields = "".join(f" {parameter};" for parameter in parameters).replace("__restrict__ ", "")
    return "\n".join(
        [
            f"// The mask program {program.name}: {_comment(str(program))}",
            "#define MASK_PROGRAM_SPLICED 1",
            f"#define CAPTURED_PARAMETERS {''.join(f', {p}' for p in parameters)}",
            f"struct ProgramCaptured {{{fields} }};",
            f"#define PROGRAM_CAPTURED {{{', '.join(names)}}}",
            "__device__ __forceinline__ bool mask_program(int b, int h, int q_idx, int kv_idx"
            + "".join(f", {p}" for p in parameters)
            + ") {",
            *body,
            f"    return {root};",
            "}",
            "__device__ __forceinline__ bool mask_program(int b, int h, int q_idx, int kv_idx, "
            "const ProgramCaptured& captured) {",
            f"    return mask_program(b, h, q_idx, kv_idx{''.join(f', captured.{n}' for n in names)});",
            "}",
        ]
    )


def _comment(text: str) -> str:
    """The program's Python spelling on one comment line (no line break or comment end in it)."""
    return " ".join(text.replace("*/", "* /").split())[:400]


def splice(source: str, code: str) -> str:
    """attention.cu's text with a program's code in place of :data:`SPLICE_MARKER` (unchanged without code)."""
    if not code:
        return source
    if source.count(SPLICE_MARKER) != 1:
        raise ValueError("the kernel source has no single mask-program marker line")
    return source.replace(SPLICE_MARKER, code)


def every_operation() -> MaskProgram:
    """A program with every operation and leaf kind (the static check's program): document ids and a prefix length
    read from captured tensors of one and two dimensions, Python's and C's division and remainder, comparisons,
    boolean algebra, casts and ``where``."""
    from attnkit.contract.programs import CapturedSpec, const

    b, h, q, kv = index("b"), index("h"), index("q"), index("kv")

    def op(name: str, *args: Expr, kind: str = "int") -> Expr:
        return Expr(name, tuple(args), kind=kind)

    def read(slot: int, *indices: Expr, kind: str = "int") -> Expr:
        return Expr("read", tuple(indices), value=slot, kind=kind)

    same_document = op("eq", read(0, b, q), read(0, b, kv), kind="bool")
    prefix = op("lt", kv, read(1, b), kind="bool")
    chunk = op("eq", op("floordiv", q, const(64)), op("tdiv", kv, const(64)), kind="bool")
    stripes = op("ne", op("mod", op("sub", q, kv), const(3)), op("trem", op("neg", kv), const(5)), kind="bool")
    bounded = op(
        "le", op("abs", op("sub", q, kv)), op("max", op("min", op("mul", h, const(7)), const(100)), b), kind="bool"
    )
    flag = op("bool", op("int", read(2, q, kind="bool")), kind="bool")
    either = op("or", op("xor", stripes, flag, kind="bool"), op("not", bounded, kind="bool"), kind="bool")
    shifted = op("add", kv, op("where", op("gt", q, const(INT32_MIN), kind="bool"), const(1), const(0)))
    causal = op("ge", q, shifted, kind="bool")
    expr = op("and", op("and", same_document, op("or", prefix, chunk, kind="bool"), kind="bool"),
              op("or", either, op("and", causal, op("not", const(False), kind="bool"), kind="bool"), kind="bool"),
              kind="bool")  # fmt: skip
    return MaskProgram(
        expr, (CapturedSpec((2, 256), "int64"), CapturedSpec((2,), "int32"), CapturedSpec((256,), "bool"))
    )
