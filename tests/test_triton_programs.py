"""Mask programs in the triton backend's tiles (interpreted): the generated helper against the contract's evaluation
for every operation, and forward and backward against the float64 oracle given the program as a dense mask, where
the program's edges fall on and off the interpreter's tiles (32 query rows, 16 keys), tiles it hides are never read,
a full tile is never evaluated, and a row sees nothing. The conformance harness draws random programs over every
backend; these target what it cannot: tile edges, skipped tiles and the generated code."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from attnkit import AttentionSpec
from attnkit.backend import AttentionInputs
from attnkit.contract.programs import (
    EMPTY,
    FULL,
    PARTIAL,
    BoundProgram,
    CapturedSpec,
    Expr,
    MaskProgram,
    array_ops,
    const,
    dense,
    evaluate,
    index,
)
from attnkit.frontends import ops_for
from attnkit.programs import bind
from attnkit.testing.agreement import compare_outputs
from tests.conftest import available_backends

pytestmark = [
    pytest.mark.skipif("triton" not in available_backends(), reason="triton not available here"),
    pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning"),  # Triton's interpreter, on empty rows
]

# The interpreter's tiles (launch.INTERPRETER_CONFIG): the edges below are placed by them.
BLOCK_M, BLOCK_N = 32, 16
#: CPU tensors in the interpreter; on a GPU (scripts/gpu_check.sh runs the document case and the helper there, where
#: the compiled tiles differ and the edges fall elsewhere), CUDA tensors.
DEVICE = "cuda" if torch.cuda.is_available() and "triton" in available_backends() else "cpu"
interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="placed on the interpreter's tiles")


def _backend() -> Any:
    from attnkit.registry import get_backend

    return get_backend("triton")


def _results(out: torch.Tensor, lse: torch.Tensor, grads: tuple[torch.Tensor, ...]) -> dict[str, np.ndarray]:
    named = {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv"), grads))}
    return {name: value.detach().double().cpu().numpy() for name, value in named.items()}


def _oracle(spec: AttentionSpec, inputs: AttentionInputs, dout: torch.Tensor, dtype: torch.dtype) -> dict:
    from backends.reference.torch_naive import oracle_attention

    leaves = [x.to(dtype).requires_grad_(True) for x in inputs[:3]]
    out, lse = oracle_attention(spec, inputs._replace(q=leaves[0], k=leaves[1], v=leaves[2]), dtype)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return _results(out, lse, grads)


def _assert_agrees(
    spec: AttentionSpec,
    inputs: AttentionInputs,
    visible: torch.Tensor,
    zero_keys: torch.Tensor | None = None,
) -> None:
    """The backend's out, lse, dq, dk, dv on ``inputs`` (with their program) against the oracle's on the same call
    with ``visible`` (B|1, H|1, Lq, Lk) ANDed into its mask, the program removed. ``zero_keys``: keys no query sees,
    read by the oracle as zeros (the backend must never load them: they hold NaN)."""
    backend = _backend()
    out, lse = backend.forward(spec, inputs, True)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = backend.backward(spec, inputs, out, lse, dout, None, need_dbias=False)
    batch, heads_q, len_q, _ = inputs.q.shape
    len_k = inputs.k.shape[2]
    mask = visible.expand(batch, heads_q, len_q, len_k)
    if inputs.mask is not None:
        mask = mask & inputs.mask
    reference = inputs._replace(mask=mask, mask_program=None)
    if zero_keys is not None:
        reference = reference._replace(
            k=torch.where(zero_keys[None, None, :, None], 0.0, inputs.k),
            v=torch.where(zero_keys[None, None, :, None], 0.0, inputs.v),
        )
    exact = _oracle(spec, reference, dout, torch.float64)
    baseline = _oracle(spec, reference, dout, torch.float32)
    actual = _results(out, lse, (grads.dq, grads.dk, grads.dv))
    if zero_keys is not None:  # their gradients are zero, never NaN
        for name in ("dk", "dv"):
            exact[name][:, :, zero_keys.cpu().numpy()] = 0.0
    wrong = [c for c in compare_outputs("float32", actual, exact, baseline) if not c.error <= c.allowed]
    assert not wrong, wrong


def _operands(batch: int, heads_q: int, heads_kv: int, len_q: int, len_k: int, head_dim: int = 16) -> tuple:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads_q, len_q, head_dim, generator=generator)
    k = torch.randn(batch, heads_kv, len_k, head_dim, generator=generator)
    v = torch.randn(batch, heads_kv, len_k, head_dim, generator=generator)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def _bound(mask_mod: Any, q: torch.Tensor, heads_q: int, len_k: int) -> BoundProgram:
    batch, _, len_q, _ = q.shape
    return bind(mask_mod, ops_for(q, "q"), q, batch, heads_q, len_q, len_k)


def _classes(bound: BoundProgram, q: torch.Tensor, len_k: int) -> torch.Tensor:
    from attnkit.contract.programs import cached_tile_classes

    batch, heads_q, len_q, _ = q.shape
    return cached_tile_classes(bound, batch, heads_q, len_q, len_k, BLOCK_M, BLOCK_N, q)


def test_document_causal_agrees_with_the_oracle() -> None:
    """Documents ending off a tile edge (13, 37, 40) in one batch element, on one (16) in the other; id −1 marks
    queries and keys in no document, so rows 40.. of the first see nothing. The program reads the query head under
    GQA (its second head sees a short window of its document)."""
    batch, heads_q, heads_kv, length = 2, 2, 1, 64
    documents = torch.tensor([[0] * 13 + [1] * 24 + [2] * 3 + [-1] * 24, [0] * 16 + [1] * 48], device=DEVICE)

    def document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        same = (documents[b, q_idx] == documents[b, kv_idx]) & (documents[b, q_idx] >= 0)
        return same & (kv_idx <= q_idx) & ((h == 0) | (kv_idx + 4 >= q_idx) | (kv_idx == 0))

    q, k, v = _operands(batch, heads_q, heads_kv, length, length)
    bound = _bound(document_causal, q, heads_q, length)
    if DEVICE == "cpu":
        assert {EMPTY, PARTIAL, FULL} <= set(_classes(bound, q, length).unique().tolist())  # every class met
    visible = dense(bound, batch, heads_q, length, length, q)
    assert not visible[0, :, 40:].any()  # rows that see nothing
    _assert_agrees(AttentionSpec(), AttentionInputs(q, k, v, mask_program=bound), visible)


@interpreter_only
@pytest.mark.parametrize("prefix", [(16, 21), (21, 32)], ids=["on-edge", "off-edge"])
def test_prefix_and_chunks_with_causal_and_lengths_agree(prefix: tuple[int, int]) -> None:
    """A per-batch prefix seen by all (on a key tile's edge, then off one) or chunks of 24 keys, ANDed with causal
    bottom-right, key lengths and a dense mask."""
    batch, heads, len_q, len_k = 2, 1, 40, 50
    prefixes = torch.tensor(prefix, dtype=torch.int32)

    def prefix_or_chunk(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < prefixes[b]) | (q_idx // 24 == kv_idx // 24)

    q, k, v = _operands(batch, heads, heads, len_q, len_k)
    bound = _bound(prefix_or_chunk, q, heads, len_k)
    mask = torch.rand(batch, 1, len_q, len_k, generator=torch.Generator().manual_seed(2)) > 0.1
    inputs = AttentionInputs(q, k, v, mask=mask, kv_lengths=torch.tensor([50, 37]), mask_program=bound)
    visible = dense(bound, batch, heads, len_q, len_k, q)
    _assert_agrees(AttentionSpec(causal=True), inputs, visible)


@interpreter_only
def test_tiles_the_program_hides_are_never_read() -> None:
    """Keys 16..31, one whole key tile, are seen by no query: they hold NaN, which any load would spread into out,
    dq, dk or dv; the oracle reads them as zeros."""
    batch, heads, length = 1, 1, 48

    def skip_second_tile(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return ((kv_idx < 16) | (kv_idx >= 32)) & (kv_idx <= q_idx + 8)

    q, k, v = _operands(batch, heads, heads, length, length)
    hidden = (torch.arange(length) >= 16) & (torch.arange(length) < 32)
    k[:, :, hidden] = float("nan")
    v[:, :, hidden] = float("nan")
    bound = _bound(skip_second_tile, q, heads, length)
    visible = dense(bound, batch, heads, length, length, q)
    _assert_agrees(AttentionSpec(), AttentionInputs(q, k, v, mask_program=bound), visible, zero_keys=hidden)


@interpreter_only
def test_the_kernels_follow_the_tile_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Classes given in place of the program's (per batch element, query head and tile pair): an empty tile shows
    nothing and a full one everything, whatever the program says (it is evaluated on partial tiles only), at every
    (b, h) with the query head under GQA."""
    from attnkit.backends.triton import launch

    batch, heads_q, heads_kv, len_q, len_k = 2, 2, 1, 40, 40
    tiles_q, tiles_k = -(-len_q // BLOCK_M), -(-len_k // BLOCK_N)

    def checker(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx + kv_idx + b + h) % 3 != 0

    q, k, v = _operands(batch, heads_q, heads_kv, len_q, len_k)
    bound = _bound(checker, q, heads_q, len_k)
    classes = torch.randint(0, 3, (batch, heads_q, tiles_q, tiles_k), generator=torch.Generator().manual_seed(3))
    classes = classes.to(torch.uint8)
    monkeypatch.setattr(launch, "cached_tile_classes", lambda *args: classes)
    per_pair = classes.repeat_interleave(BLOCK_M, 2).repeat_interleave(BLOCK_N, 3)[:, :, :len_q, :len_k]
    program = dense(bound, batch, heads_q, len_q, len_k, q)
    visible = (per_pair == FULL) | ((per_pair == PARTIAL) & program)
    _assert_agrees(AttentionSpec(), AttentionInputs(q, k, v, mask_program=bound), visible)


# --- The generated helper --------------------------------------------------------------------------------------


def _every_operation() -> tuple[MaskProgram, tuple[torch.Tensor, ...]]:
    """A program using every operation kind, with negative operands and divisors of both signs (Python's and C's
    rounding differ there), reads of an int64 and a boolean captured tensor (indexed past their ends: clamped)."""
    b, h, q, kv = (index(name) for name in ("b", "h", "q", "kv"))

    def op(name: str, *args: Expr, kind: str = "int") -> Expr:
        return Expr(name, tuple(args), kind=kind)

    def boolean(name: str, *args: Expr) -> Expr:
        return op(name, *args, kind="bool")

    table = Expr("read", (b, op("add", q, const(3))), value=0)  # (B, 20) int64: q + 3 runs past its end
    flags = Expr("read", (op("sub", kv, h),), value=1, kind="bool")  # (Lk,) bool: kv − h runs below 0
    shifted = op("sub", q, op("mul", kv, const(2)))  # from −2 Lk to Lq
    divisor = op("where", boolean("lt", kv, const(7)), const(-5), const(3))
    quotients = [op(name, shifted, divisor) for name in ("floordiv", "mod", "tdiv", "trem")]
    mixed = op("add", op("min", quotients[0], quotients[1]), op("max", quotients[2], op("neg", quotients[3])))
    mixed = op("add", mixed, op("abs", op("sub", table, q)))
    compares = [boolean(name, mixed, op("int", flags)) for name in ("eq", "ne", "lt", "le", "gt", "ge")]
    either = boolean("or", boolean("and", compares[0], compares[1]), boolean("xor", compares[2], compares[3]))
    result = boolean("xor", either, boolean("not", boolean("and", compares[4], boolean("bool", compares[5]))))
    result = boolean("or", result, boolean("eq", op("mod", mixed, const(4)), const(1)))
    program = MaskProgram(result, (CapturedSpec((2, 20), "int64"), CapturedSpec((24,), "bool")))
    generator = torch.Generator().manual_seed(4)
    captured = (torch.randint(-30, 30, (2, 20), generator=generator), torch.rand(24, generator=generator) > 0.5)
    return program, tuple(x.to(DEVICE) for x in captured)


def test_every_operation_kind_is_generated() -> None:
    from attnkit.backends.triton import programs

    program, _ = _every_operation()
    text = programs.source(program)
    spelled = [" // ", " % ", "tl.minimum", "tl.maximum", "tl.abs", "tl.where", "tl.load", " == ", " != ", " < "]
    spelled += [" <= ", " > ", " >= ", " & ", " | ", " ^ ", "-t", ".to(tl.int32)"]
    assert all(piece in text for piece in spelled), text
    operations = {node.op for node in program.expr.walk()}
    assert operations >= {"floordiv", "mod", "tdiv", "trem", "min", "max", "neg", "abs", "not", "int", "bool"}
    # One helper per program, whatever its captured tensors' sizes: a new length never compiles anew.
    longer = MaskProgram(program.expr, (CapturedSpec((2, 99), "int64"), CapturedSpec((7,), "bool")))
    assert programs.helper(program) is programs.helper(longer)


def _helper_tile(program: MaskProgram, captured: tuple[torch.Tensor, ...], len_q: int, len_k: int) -> torch.Tensor:
    from attnkit.backends.triton import programs

    from tests import triton_program_kernel

    batch, heads = captured[0].shape[0], 2
    out = torch.zeros(batch, heads, len_q, len_k, dtype=torch.int8, device=DEVICE)
    tensors, layout = programs.arguments(BoundProgram(program, captured), out.device)
    for b in range(batch):
        for h in range(heads):
            triton_program_kernel.program_tile[(1,)](
                out[b, h], b, h, len_q, len_k, tensors, layout, programs.helper(program), BLOCK_M, BLOCK_N
            )
    return out.bool()


def test_the_generated_helper_agrees_with_the_contract() -> None:
    """Every operation, run by the interpreter on a (32, 16) tile with out-of-range lanes (clamped reads), against
    attnkit.contract.programs.evaluate in torch."""
    program, captured = _every_operation()
    len_q, len_k = 20, 13
    actual = _helper_tile(program, captured, len_q, len_k)
    captured = tuple(x.cpu() for x in captured)
    ops = array_ops(captured[0])
    env = {
        "b": torch.arange(2).reshape(-1, 1, 1, 1),
        "h": torch.arange(2).reshape(1, -1, 1, 1),
        "q": torch.arange(len_q).reshape(1, 1, -1, 1),
        "kv": torch.arange(len_k).reshape(1, 1, 1, -1),
    }
    expected = torch.broadcast_to(torch.as_tensor(evaluate(program.expr, ops, env, captured)), actual.shape)
    assert expected.any() and not expected.all()
    assert torch.equal(actual.cpu(), expected)
