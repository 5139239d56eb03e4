"""Mask programs on the reference and native backends: out, lse and gradients against the float64 oracle given the
program as a dense mask, for programs that read b (documents), the positions alone (prefix-LM) and h (a query head
under GQA), with both causal alignments, lengths and a dense mask ANDed; tile edges and skipped tiles of
torch-chunked; what torch-flex hands FlexAttention; the paged path's logical key positions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from attnkit.backends.reference.torch_naive import TorchNaiveBackend, oracle_attention

from attnkit import AttentionSpec
from attnkit.backend import AttentionInputs
from attnkit.contract.programs import EMPTY, BoundProgram, cached_tile_classes, dense
from attnkit.frontends import ops_for
from attnkit.programs import bind
from attnkit.testing.agreement import compare_outputs

BATCH, HEADS_Q, HEADS_KV, DIM = 2, 4, 2, 8


class Program(NamedTuple):
    name: str
    # (Lq, Lk, generator) -> mask_mod
    make: Callable[[int, int, torch.Generator], Callable[..., Any]]


def _documents(len_q: int, len_k: int, generator: torch.Generator) -> Callable[..., Any]:
    """Document masking with causality inside documents, as FlexAttention's example writes it; ids per batch row."""
    q_doc = torch.sort(torch.randint(0, 3, (BATCH, len_q), generator=generator), dim=1).values
    kv_doc = torch.sort(torch.randint(0, 3, (BATCH, len_k), generator=generator), dim=1).values

    def document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_doc[b, q_idx] == kv_doc[b, kv_idx]) & (kv_idx <= q_idx + (len_k - len_q))

    return document_causal


def _prefix_lm(len_q: int, len_k: int, generator: torch.Generator) -> Callable[..., Any]:
    prefix = torch.randint(0, len_k, (BATCH,), generator=generator)

    def prefix_lm(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < prefix[b]) | (kv_idx <= q_idx)

    return prefix_lm


def _per_head(len_q: int, len_k: int, generator: torch.Generator) -> Callable[..., Any]:
    """A window per query head (h is the query head under GQA): heads sharing a kv head see different keys."""
    window = torch.tensor([2, 5, 9, 1], dtype=torch.int32)

    def head_window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return torch.abs(q_idx - kv_idx) <= window[h]

    return head_window


PROGRAMS = [Program("documents", _documents), Program("prefix_lm", _prefix_lm), Program("per_head", _per_head)]


class Setting(NamedTuple):
    spec: AttentionSpec
    len_q: int
    len_k: int
    q_lengths: tuple[int, ...] | None = None
    kv_lengths: tuple[int, ...] | None = None
    mask_shape: tuple[int, ...] | None = None


SETTINGS = [
    Setting(AttentionSpec(causal=True), 37, 45, kv_lengths=(45, 30)),
    Setting(
        AttentionSpec(causal=True, causal_alignment="top_left"), 40, 33, q_lengths=(40, 23), mask_shape=(2, 1, 40, 33)
    ),
    Setting(AttentionSpec(layout="bshd"), 20, 50, mask_shape=(1, HEADS_Q, 20, 50)),
]


def _inputs(program: Program, setting: Setting, seed: int = 0) -> AttentionInputs:
    generator = torch.Generator().manual_seed(seed)
    bshd = setting.spec.layout.value == "bshd"

    def tensor(length: int, heads: int) -> torch.Tensor:
        x = torch.randn(BATCH, heads, length, DIM, generator=generator)
        return x.transpose(1, 2).contiguous() if bshd else x

    q, k, v = tensor(setting.len_q, HEADS_Q), tensor(setting.len_k, HEADS_KV), tensor(setting.len_k, HEADS_KV)
    mask = None
    if setting.mask_shape is not None:
        mask = torch.rand(setting.mask_shape, generator=generator) < 0.8
    lengths = [None if x is None else torch.tensor(x) for x in (setting.q_lengths, setting.kv_lengths)]
    fn = program.make(setting.len_q, setting.len_k, generator)
    bound = bind(fn, ops_for(q, "q"), q, BATCH, HEADS_Q, setting.len_q, setting.len_k)
    return AttentionInputs(q, k, v, mask, q_lengths=lengths[0], kv_lengths=lengths[1], mask_program=bound)


def _cotangents(inputs: AttentionInputs, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    out_shape = (*inputs.q.shape[:-1], inputs.v.shape[-1])
    heads = inputs.q.shape[2 if spec.layout.value == "bshd" else 1]
    len_q = inputs.q.shape[1 if spec.layout.value == "bshd" else 2]
    return torch.randn(out_shape, generator=generator), torch.randn(BATCH, heads, len_q, generator=generator)


def _oracle(spec: AttentionSpec, inputs: AttentionInputs, dtype: torch.dtype) -> dict[str, np.ndarray]:
    """The oracle at ``dtype`` with the program materialised into the mask (and no program)."""
    bound = inputs.mask_program
    bshd = spec.layout.value == "bshd"
    len_q, len_k = inputs.q.shape[1 if bshd else 2], inputs.k.shape[1 if bshd else 2]
    visible = dense(bound, BATCH, HEADS_Q, len_q, len_k, inputs.q)
    mask = visible if inputs.mask is None else visible & inputs.mask
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (inputs.q, inputs.k, inputs.v)]
    plain = inputs._replace(q=leaves[0], k=leaves[1], v=leaves[2], mask=mask, mask_program=None)
    out, lse = oracle_attention(spec, plain, dtype)
    dout, dlse = _cotangents(inputs, spec)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    dq, dk, dv = torch.autograd.grad((out, finite), leaves, (dout.to(dtype), dlse.to(dtype)))
    results = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    return {name: value.detach().double().numpy() for name, value in results.items()}


def _torch_run(backend: Any, spec: AttentionSpec, inputs: AttentionInputs) -> dict[str, np.ndarray]:
    out, lse = backend.forward(spec, inputs, True)
    dout, dlse = _cotangents(inputs, spec)
    grads = backend.backward(spec, inputs, out, lse, dout, dlse, need_dbias=False)
    results = {"out": out, "lse": lse, "dq": grads.dq, "dk": grads.dk, "dv": grads.dv}
    return {name: value.detach().double().numpy() for name, value in results.items()}


def _as_jax(inputs: AttentionInputs, spec: AttentionSpec) -> AttentionInputs:
    """The same call in JAX: arrays converted, the bound program's captured tensors as jnp arrays."""
    import jax.numpy as jnp

    bound = inputs.mask_program
    program = BoundProgram(bound.program, tuple(jnp.asarray(t.numpy()) for t in bound.captured))
    arrays = [None if x is None else jnp.asarray(x.numpy()) for x in inputs[:9]]
    return AttentionInputs(*arrays)._replace(mask_program=program)


def _jax_run(backend: Any, spec: AttentionSpec, inputs: AttentionInputs) -> dict[str, np.ndarray]:
    import jax.numpy as jnp

    jax_inputs = _as_jax(inputs, spec)
    out, lse = backend.forward(spec, jax_inputs, True)
    dout, dlse = (jnp.asarray(x.numpy()) for x in _cotangents(inputs, spec))
    grads = backend.backward(spec, jax_inputs, out, lse, dout, dlse, need_dbias=False)
    results = {"out": out, "lse": lse, "dq": grads.dq, "dk": grads.dk, "dv": grads.dv}
    return {name: np.asarray(value, dtype=np.float64) for name, value in results.items()}


Entry = tuple[str, Callable[[], Any], Callable[..., dict[str, np.ndarray]]]


def _torch_backends() -> list[Entry]:
    from attnkit.backends.native.torch_flex import TorchFlexBackend
    from attnkit.backends.native.torch_sdpa import TorchSdpaBackend
    from attnkit.backends.reference.torch_chunked import TorchChunkedBackend

    return [
        ("torch-naive", TorchNaiveBackend, _torch_run),
        ("torch-chunked-16x8", lambda: TorchChunkedBackend(block_q=16, block_k=8), _torch_run),
        ("torch-sdpa", TorchSdpaBackend, _torch_run),
        ("torch-flex", TorchFlexBackend, _torch_run),
    ]


def _jax_cases() -> list[Any]:
    """JAX compiles each program anew (seconds): jax-reference takes each program once, in its own setting, and
    jax-xla (which materialises the program as the others' masks) one."""
    try:
        from attnkit.backends.native.jax_xla import JaxXlaBackend
        from attnkit.backends.reference.jax_reference import JaxReferenceBackend
    except ImportError:
        return []
    cases = [
        pytest.param(
            PROGRAMS[n],
            SETTINGS[n],
            "jax-reference",
            lambda: JaxReferenceBackend(block_k=16),
            _jax_run,
            id=f"{PROGRAMS[n].name}-{SETTING_IDS[n]}-jax-reference-16",
        )  # fmt: skip
        for n in range(3)
    ]
    cases.append(pytest.param(PROGRAMS[2], SETTINGS[0], "jax-xla", JaxXlaBackend, _jax_run, id="per_head-jax-xla"))
    return cases


SETTING_IDS = ["causal-bottom-right", "causal-top-left", "bshd-no-causal"]
CASES = [
    pytest.param(program, setting, name, make, run, id=f"{program.name}-{setting_id}-{name}")
    for name, make, run in _torch_backends()
    for setting, setting_id in zip(SETTINGS, SETTING_IDS)
    for program in PROGRAMS
] + _jax_cases()


@pytest.mark.parametrize(("program", "setting", "name", "make", "run"), CASES)
def test_program_agrees_with_oracle(program: Program, setting: Setting, name: str, make: Any, run: Any) -> None:
    backend = make()
    reasons = backend.available()
    if reasons:
        pytest.skip("; ".join(reasons))
    inputs = _inputs(program, setting)
    exact = _oracle(setting.spec, inputs, torch.float64)
    baseline = _oracle(setting.spec, inputs, torch.float32)
    results = run(backend, setting.spec, inputs)
    failed = [c for c in compare_outputs("float32", results, exact, baseline) if not c.error <= c.allowed]
    assert not failed, failed


def test_program_rows_hidden_entirely_give_zero_and_minus_inf() -> None:
    """A program that hides whole rows (and whole tiles): out 0, lse −inf, on every torch backend."""
    from attnkit.backends.native.torch_flex import TorchFlexBackend
    from attnkit.backends.native.torch_sdpa import TorchSdpaBackend
    from attnkit.backends.reference.torch_chunked import TorchChunkedBackend

    q = torch.randn(1, 2, 40, DIM)
    k, v = torch.randn(1, 2, 40, DIM), torch.randn(1, 2, 40, DIM)

    def late_queries_only(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= 24) & (kv_idx < 9)

    bound = bind(late_queries_only, ops_for(q, "q"), q, 1, 2, 40, 40)
    inputs = AttentionInputs(q, k, v, mask_program=bound)
    spec = AttentionSpec()
    for backend in (TorchChunkedBackend(block_q=8, block_k=8), TorchSdpaBackend(), TorchFlexBackend()):
        if backend.available():
            continue
        out, lse = backend.forward(spec, inputs, True)
        assert torch.equal(out[:, :, :24], torch.zeros_like(out[:, :, :24])), backend.name
        assert torch.isneginf(lse[:, :, :24]).all(), backend.name
        assert torch.isfinite(lse[:, :, 24:]).all(), backend.name


def test_chunked_skips_tiles_the_program_hides_and_masks_none_it_shows() -> None:
    """Document masking: tiles across documents are never planned; tiles inside one document need no mask."""
    from attnkit.backends.reference.torch_chunked import _Geometry, _plan

    length, block = 64, 8
    q = torch.empty(1, 1, length, 4)
    documents = torch.arange(length) // 16  # four documents of 16 keys: two tiles each

    def same_document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return documents[q_idx] == documents[kv_idx]

    bound = bind(same_document, ops_for(q, "q"), q, 1, 1, length, length)
    geometry = _Geometry(AttentionSpec(), AttentionInputs(q, q, q, mask_program=bound), 1, length, length)
    plan = _plan(geometry, length, length, block, block)
    planned = {(r0 // block, c0 // block): needs_mask for r0, _, tiles in plan for c0, _, needs_mask in tiles}
    assert planned == {(r, c): False for r in range(8) for c in range(8) if r // 2 == c // 2}


def test_chunked_program_tile_edges_against_the_oracle() -> None:
    """Tiles that do not divide the lengths and straddle the program's edges and the lengths, bottom-right causal
    with Lq < Lk: each odd tile size agrees with the oracle."""
    from attnkit.backends.reference.torch_chunked import TorchChunkedBackend

    setting = Setting(AttentionSpec(causal=True), 23, 31, q_lengths=(23, 17), kv_lengths=(29, 31))
    inputs = _inputs(PROGRAMS[0], setting, seed=3)
    exact = _oracle(setting.spec, inputs, torch.float64)
    baseline = _oracle(setting.spec, inputs, torch.float32)
    for block_q, block_k in ((5, 7), (1, 3), (64, 64)):
        results = _torch_run(TorchChunkedBackend(block_q=block_q, block_k=block_k), setting.spec, inputs)
        failed = [c for c in compare_outputs("float32", results, exact, baseline) if not c.error <= c.allowed]
        assert not failed, (block_q, block_k, failed)


def test_flash_attn_refuses_programs() -> None:
    from attnkit.backends.native.flash_attn import FlashAttnBackend

    from attnkit.backend import Framework, Problem

    problem = Problem(framework=Framework.TORCH, device="cuda", dtype="float16", batch=1, heads_q=1, heads_kv=1,
                      len_q=8, len_k=8, head_dim=8, head_dim_v=8, has_mask_program=True)  # fmt: skip
    assert "mask_program is not supported" in FlashAttnBackend().supports(AttentionSpec(), problem)


def test_flex_block_mask_follows_the_program_tile_classes() -> None:
    """torch-flex builds its BlockMask from the program's tile classes: blocks the program hides are not in it."""
    from attnkit.backends.native import torch_flex

    if torch_flex.TorchFlexBackend().available():
        pytest.skip("flex_attention unavailable")
    length = 512
    q = torch.randn(1, 1, length, 16)
    documents = torch.arange(length) // 128  # block-diagonal, in flex's 128-blocks

    def same_document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return documents[q_idx] == documents[kv_idx]

    bound = bind(same_document, ops_for(q, "q"), q, 1, 1, length, length)
    classes = cached_tile_classes(bound, 1, 1, length, length, 128, 128, q)
    partial, full = torch_flex._program_blocks(bound, 1, 1, length, length, length, length, q)
    assert torch.equal(full[0, 0], torch.eye(4, dtype=torch.bool))
    assert not partial.any()
    assert torch.equal(classes[0, 0] == EMPTY, ~torch.eye(4, dtype=torch.bool))
