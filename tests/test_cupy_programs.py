"""Mask programs in the cupy backend's kernels, on ``cupy-emulated`` (the CUDA C kernels run by the CPU emulation
harness): out, lse, dq, dk and dv against the float64 oracle given the program as a dense mask, at the places the
conformance harness's random programs rarely reach: boundaries on and off the emulator's tile edges, EMPTY tiles
skipped and FULL tiles unevaluated in every kernel (both bodies: float32 runs the shared-memory kernels, float16 the
register-resident ones), rows that see nothing, GQA's query head, and the generated code's every operation. Compiles
are once per program: new captured values and a new sequence length reuse them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from attnkit.backends.cupy import launch, programs
from attnkit.backends.cupy.backend import CupyBackend

import attnkit
from attnkit import AttentionSpec
from attnkit.backend import AttentionInputs
from attnkit.contract import programs as contract
from attnkit.frontends import ops_for
from attnkit.programs import bind
from tests.cupy_emulator import EmulatorLauncher

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2}


def _backend() -> tuple[CupyBackend, EmulatorLauncher]:
    launcher = EmulatorLauncher()
    return CupyBackend.emulated(launcher), launcher


def _doc_causal(doc: torch.Tensor) -> Callable[..., Any]:
    """Document-causal; a negative document id is padding, whose rows see nothing."""

    def doc_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (doc[b, q_idx] == doc[b, kv_idx]) & (doc[b, q_idx] >= 0) & (q_idx >= kv_idx)

    return doc_causal


def _chunked_prefix(chunk: torch.Tensor, prefix: torch.Tensor) -> Callable[..., Any]:
    """Chunks of chunk[b] positions see each other; every query also sees the first prefix[h] keys (h: the query
    head)."""

    def chunked_prefix(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx // chunk[b] == kv_idx // chunk[b]) | (kv_idx < prefix[h])

    return chunked_prefix


def _run(
    backend: CupyBackend,
    mask_mod: Callable[..., Any],
    dtype: torch.dtype,
    shape: tuple[int, int, int, int, int] = (2, 2, 2, 40, 40),
) -> dict[str, float]:
    """Max |error| of out, lse, dq, dk, dv against torch-naive in float64 on the same (rounded) inputs, the
    program ANDed into its mask; lse's −inf entries must match exactly."""
    batch, heads_q, heads_kv, len_q, len_k = shape
    generator = torch.Generator().manual_seed(len_q + len_k)
    q = torch.randn(batch, heads_q, len_q, 16, generator=generator).to(dtype)
    k, v = (torch.randn(batch, heads_kv, len_k, 16, generator=generator).to(dtype) for _ in range(2))
    dout = torch.randn(batch, heads_q, len_q, 16, generator=generator).to(dtype)
    dlse = torch.randn(batch, heads_q, len_q, generator=generator)
    bound = bind(mask_mod, ops_for(q, "q"), q, batch, heads_q, len_q, len_k)
    inputs = AttentionInputs(q, k, v, mask_program=bound)
    spec = AttentionSpec()
    out, lse = backend.forward(spec, inputs, True)
    grads = backend.backward(spec, inputs, out, lse, dout, dlse, need_dbias=False)

    mask = contract.dense(bound, batch, heads_q, len_q, len_k, q)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    want_out, want_lse = attnkit.attend(spec, *leaves, mask=mask, return_lse=True, backend="torch-naive")
    finite = want_lse != -torch.inf
    cotangent = (want_out * dout.double()).sum() + (want_lse[finite] * dlse.double()[finite]).sum()
    want = [want_out, want_lse, *torch.autograd.grad(cotangent, leaves)]
    assert torch.equal(lse == -torch.inf, ~finite), "rows that see nothing differ"
    errors = {}
    for name, got, expected in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, grads.dq, grads.dk, grads.dv), want):
        got, expected = got.double(), expected.detach()
        if name == "lse":
            got, expected = got[finite], expected[finite]
        errors[name] = (got - expected).abs().max().item()
    return errors


def _classes(mask_mod: Callable[..., Any], shape: tuple[int, ...], block_q: int, block_k: int) -> torch.Tensor:
    batch, heads_q, _, len_q, len_k = shape
    q = torch.empty(batch, heads_q, len_q, 16)
    bound = bind(mask_mod, ops_for(q, "q"), q, batch, heads_q, len_q, len_k)
    return contract.tile_classes(bound, batch, heads_q, len_q, len_k, block_q, block_k, q)


DOCUMENTS = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 32 + [-1] * 8])  # boundaries off / on tile edges


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["shared-memory", "register"])
def test_document_causal_agrees_with_the_oracle(dtype: torch.dtype) -> None:
    """Documents ending off a tile edge (13, 33) and on one (32), padding rows that see nothing: EMPTY tiles
    between documents (skipped), FULL tiles inside one, PARTIAL ones across the diagonal and the boundaries."""
    mask_mod = _doc_causal(DOCUMENTS)
    for tile in {launch.EMULATOR_TILE, launch.EMULATOR_FORWARD_TILE}:
        classes = _classes(mask_mod, (2, 2, 2, 40, 40), tile.block_m, tile.block_n)
        assert {contract.EMPTY, contract.PARTIAL} <= set(classes.unique().tolist()), classes
    errors = _run(_backend()[0], mask_mod, dtype)
    assert max(errors.values()) < TOLERANCE[dtype], errors


def test_chunked_prefix_under_gqa_agrees_and_never_recompiles() -> None:
    """Chunks and prefixes on the tile edges (16, 32) and off them (12, 5), per batch element and per query head (4
    query heads on 2 kv heads), in the register-resident kernels; then new captured values and a new sequence
    length, which run without a compile."""
    dtype = torch.float16
    backend, launcher = _backend()
    on_edges = _chunked_prefix(torch.tensor([16, 32]), torch.tensor([0, 32, 16, 0]))
    errors = _run(backend, on_edges, dtype, shape=(2, 4, 2, 40, 40))
    assert max(errors.values()) < TOLERANCE[dtype], errors
    compiled = len(launcher._libraries)
    off_edges = _chunked_prefix(torch.tensor([12, 7]), torch.tensor([5, 0, 3, 17]))
    errors = _run(backend, off_edges, dtype, shape=(2, 4, 2, 37, 37))
    assert max(errors.values()) < TOLERANCE[dtype], errors
    assert len(launcher._libraries) == compiled, "new captured values or lengths compiled the kernels again"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["shared-memory", "register"])
@pytest.mark.parametrize("tile_class", [contract.EMPTY, contract.FULL], ids=["empty", "full"])
def test_kernels_obey_the_tile_classes(dtype: torch.dtype, tile_class: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Classes claiming every tile EMPTY give every row nothing (out 0, lse −inf, zero gradients): the forward, dQ
    and dK/dV kernels skip EMPTY tiles. Classes claiming every tile FULL give attention without the program: none
    of them evaluates the program in a FULL tile."""
    monkeypatch.setattr(
        launch,
        "cached_tile_classes",
        lambda bound, b, h, lq, lk, bq, bk, like: torch.full((1, 1, -(-lq // bq), -(-lk // bk)), tile_class,
                                                            dtype=torch.uint8),
    )  # fmt: skip
    backend = _backend()[0]
    generator = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, 2, 40, 16, generator=generator).to(dtype) for _ in range(4))
    bound = bind(_doc_causal(DOCUMENTS), ops_for(q, "q"), q, 2, 2, 40, 40)
    inputs = AttentionInputs(q, k, v, mask_program=bound)
    out, lse = backend.forward(AttentionSpec(), inputs, True)
    grads = backend.backward(AttentionSpec(), inputs, out, lse, dout, None, need_dbias=False)
    if tile_class == contract.EMPTY:
        assert torch.equal(lse, torch.full_like(lse, -torch.inf))
        for x in (out, grads.dq, grads.dk, grads.dv):
            assert torch.equal(x, torch.zeros_like(x))
    else:
        plain = AttentionInputs(q, k, v)
        want_out, want_lse = backend.forward(AttentionSpec(), plain, True)
        want = backend.backward(AttentionSpec(), plain, want_out, want_lse, dout, None, need_dbias=False)
        for got, expected in zip(
            (out, lse, grads.dq, grads.dk, grads.dv), (want_out, want_lse, want.dq, want.dk, want.dv)
        ):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_every_operation_of_the_generated_code() -> None:
    """programs.every_operation (the static check's program: Python's and C's division and remainder on negative
    operands, clamped reads of one and two dimensions, a bool read, casts, xor, where, INT32_MIN) in the forward,
    against the oracle given the same program evaluated by attnkit.contract.programs."""
    program = programs.every_operation()
    generator = torch.Generator().manual_seed(2)
    batch, heads, length = 2, 3, 40
    documents = torch.randint(0, 2, (2, 256), generator=generator).cumsum(1) // 8
    captured = (documents, torch.tensor([3, 20], dtype=torch.int32), torch.rand(256, generator=generator) < 0.5)
    bound = contract.BoundProgram(program, captured)
    q, k, v = (torch.randn(batch, heads, length, 16, generator=generator) for _ in range(3))
    out, lse = _backend()[0].forward(AttentionSpec(), AttentionInputs(q, k, v, mask_program=bound), True)
    mask = contract.dense(bound, batch, heads, length, length, q)
    assert mask.any() and not mask.all()
    leaves = [x.double() for x in (q, k, v)]
    want_out, want_lse = attnkit.attend(AttentionSpec(), *leaves, mask=mask, return_lse=True, backend="torch-naive")
    assert torch.equal(lse == -torch.inf, want_lse == -torch.inf)
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=2e-5)


def test_program_code_depends_on_the_expression_alone() -> None:
    """The generated code (the compiled module's key) is the same for captured tensors of other shapes and dtypes:
    a new sequence length never compiles again."""
    program = programs.every_operation()
    other = contract.MaskProgram(
        program.expr,
        tuple(contract.CapturedSpec(tuple(2 * n for n in spec.shape), "int16") for spec in program.captured),
    )
    assert programs.program_code(program) == programs.program_code(other)
