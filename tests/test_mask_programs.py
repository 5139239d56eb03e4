"""Mask programs (docs/semantics.md §17): tracing a torch mask_mod, the soundness of tile classes, and typed errors.

Each backend's outputs and gradients with programs are checked by the conformance harness, which draws programs for
every backend that declares Feature.MASK_PROGRAM (tests/test_conformance.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit.backend import Framework
from attnkit.contract.programs import EMPTY, FULL, BoundProgram, array_ops, band_of, evaluate, tile_classes
from attnkit.errors import MaskProgramError
from attnkit.frontends import ops_for
from attnkit.programs import bind, trace
from attnkit.testing.programs import dense_by_calling, program_function, table_values
from attnkit.testing.strategies import programs


@st.composite
def _drawn(draw: st.DrawFn) -> tuple[BoundProgram, np.ndarray, tuple[int, int, int, int]]:
    """A drawn program bound to tables of drawn values, and the visibility its function gives when called."""
    batch, heads, len_q, len_k = (
        draw(st.integers(1, 2)),
        draw(st.integers(1, 3)),
        draw(st.integers(1, 19)),
        draw(st.integers(1, 19)),
    )
    program = draw(programs(batch, heads, len_q, len_k))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    tables = [torch.as_tensor(table_values(table, rng)) for table in program.tables]
    function = program_function(program, tables)
    expected = dense_by_calling(function, batch, heads, len_q, len_k)
    traced, captured = trace(function, Framework.TORCH)
    return BoundProgram(traced, captured), expected, (batch, heads, len_q, len_k)


def _grid(batch: int, heads: int, len_q: int, len_k: int) -> dict[str, torch.Tensor]:
    sizes = {"b": batch, "h": heads, "q": len_q, "kv": len_k}
    return {name: torch.arange(size).reshape([size if i == axis else 1 for i in range(4)])
            for axis, (name, size) in enumerate(sizes.items())}  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(_drawn())
def test_a_traced_program_gives_what_its_function_gives(drawn: tuple) -> None:
    bound, expected, shape = drawn
    value = evaluate(bound.expr, array_ops(torch.zeros(())), _grid(*shape), bound.captured)
    traced = torch.broadcast_to(torch.as_tensor(value), shape).numpy()
    assert (traced == expected).all(), f"{bound.expr}"


@settings(max_examples=60, deadline=None)
@given(_drawn(), st.integers(1, 7), st.integers(1, 7), st.booleans())
def test_tile_classes_are_sound(drawn: tuple, block_q: int, block_k: int, refine: bool) -> None:
    """Never EMPTY where a pair of the tile is visible, never FULL where one is hidden (in-range pairs only), tile by
    tile against the function's own visibility, with the value ranges alone and refined by evaluation."""
    bound, expected, (batch, heads, len_q, len_k) = drawn
    classes = tile_classes(bound, batch, heads, len_q, len_k, block_q, block_k, torch.zeros(()), refine=refine)
    classes = torch.broadcast_to(classes, (batch, heads, *classes.shape[2:])).numpy()
    for tq in range(classes.shape[2]):
        for tk in range(classes.shape[3]):
            tile = expected[:, :, tq * block_q : (tq + 1) * block_q, tk * block_k : (tk + 1) * block_k]
            for b in range(batch):
                for h in range(heads):
                    if classes[b, h, tq, tk] == EMPTY:
                        assert not tile[b, h].any(), f"tile ({tq}, {tk}) of {bound.expr} is visible but EMPTY"
                    if classes[b, h, tq, tk] == FULL:
                        assert tile[b, h].all(), f"tile ({tq}, {tk}) of {bound.expr} is hidden in part but FULL"


@settings(max_examples=60, deadline=None)
@given(_drawn())
def test_a_band_moved_into_the_spec_keeps_the_visibility(drawn: tuple) -> None:
    """Where band_of splits a drawn program, lo <= kv_idx - q_idx <= hi AND the rest is the function's visibility."""
    bound, expected, shape = drawn
    found = band_of(bound.expr)
    if found is None:
        return
    (lo, hi), rest = found
    grid = _grid(*shape)
    band = (grid["kv"] - grid["q"] >= lo) & (grid["kv"] - grid["q"] <= hi)
    if rest is not None:
        band = band & torch.as_tensor(evaluate(rest, array_ops(torch.zeros(())), grid, bound.captured))
    assert (torch.broadcast_to(band, shape).numpy() == expected).all(), f"{bound.expr} -> {(lo, hi)}, {rest}"


def test_a_band_conjunct_reaches_the_spec_only_where_it_can() -> None:
    """A causal or windowed conjunct becomes the spec's top-left band (explain shows it; the program keeps the rest,
    or the call has none); a strict or shifted band, a band inside an OR, a spec with its own band or ALiBi, keep
    the program whole."""
    q = torch.randn(1, 2, 6, 8)
    documents = torch.tensor([[0, 0, 1, 1, 1, 2]])

    def explained(spec: attnkit.AttentionSpec, mask_mod, **options) -> str:  # type: ignore[no-untyped-def]
        return attnkit.explain(spec, q, q, q, mask_mod=mask_mod, **options).splitlines()[0]

    plain = attnkit.AttentionSpec()
    document_causal = lambda b, h, q_idx, kv_idx: (documents[b, q_idx] == documents[b, kv_idx]) & (kv_idx <= q_idx)  # noqa: E731
    assert '"causal":true' in explained(plain, document_causal) and "top_left" in explained(plain, document_causal)
    assert '"window":[2,2]' in explained(plain, lambda b, h, q_idx, kv_idx: abs(q_idx - kv_idx) <= 2)
    assert "mask_program=False" in attnkit.explain(plain, q, q, q, mask_mod=lambda b, h, i, j: j <= i)
    for spec, mask_mod, options in (
        (plain, lambda b, h, q_idx, kv_idx: q_idx > kv_idx, {}),
        (plain, lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < 2), {}),
        (attnkit.AttentionSpec(window=(3, 3)), document_causal, {}),
        (plain, document_causal, {"alibi_slopes": torch.tensor([0.5, 0.25])}),
    ):
        assert '"causal":true' not in explained(spec, mask_mod, **options), (spec, options)


def test_a_flex_attention_mask_mod_runs_unchanged() -> None:
    """FlexAttention's own combinators, and a mask_mod closing over a document table, trace as they are."""
    from torch.nn.attention.flex_attention import and_masks, or_masks

    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3]])

    def document(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return documents[b, q_idx] == documents[b, kv_idx]

    def causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return q_idx >= kv_idx

    def prefix(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return kv_idx < 2

    function = or_masks(and_masks(document, causal), prefix)
    program, captured = trace(function, Framework.TORCH)
    value = evaluate(program.expr, array_ops(documents), _grid(1, 1, 10, 10), captured)
    assert (torch.broadcast_to(value, (1, 1, 10, 10)).numpy() == dense_by_calling(function, 1, 1, 10, 10)).all()


def test_new_values_in_a_captured_tensor_never_retrace() -> None:
    documents = torch.zeros(1, 8, dtype=torch.int64)
    traces = {"count": 0}

    def document(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        traces["count"] += 1
        return documents[b, q_idx] == documents[b, kv_idx]

    first, _ = trace(document, Framework.TORCH)
    documents[0, 4:] = 1  # new values, the same tensor
    again, captured = trace(document, Framework.TORCH)
    assert traces["count"] == 1 and again is first and captured[0] is documents
    documents = torch.ones(1, 8, dtype=torch.int64)  # another tensor: traced again, reading the new one
    _, captured = trace(document, Framework.TORCH)
    assert traces["count"] == 2 and captured[0] is documents


def _bind(function, length: int = 8):  # type: ignore[no-untyped-def]
    q = torch.zeros(1, 1, length, 4)
    return bind(function, ops_for(q, "q"), q, 1, 1, length, length)


@pytest.mark.parametrize(
    ("function", "names"),
    [
        (lambda b, h, q_idx, kv_idx: torch.sin(q_idx) > 0, "torch.sin"),
        (lambda b, h, q_idx, kv_idx: torch.tensor([0.5, 1.0])[q_idx] > 0, "float32"),
        (lambda b, h, q_idx, kv_idx: q_idx if q_idx > kv_idx else kv_idx, "branched"),
        (lambda b, h, q_idx, kv_idx: q_idx / 2 > kv_idx, "/"),
        (lambda b, h, q_idx, kv_idx, score: score, "four positional arguments"),
        (lambda b, h, q_idx, kv_idx: q_idx + kv_idx, "must return a boolean"),
        (lambda b, h, q_idx, kv_idx: torch.zeros(3, 3, dtype=torch.int64, device="meta")[q_idx, kv_idx] == 0, "meta"),
        (lambda b, h, q_idx, kv_idx: q_idx * kv_idx * kv_idx * kv_idx * kv_idx * kv_idx > 1, "32-bit"),
    ],
    ids=[
        "unsupported-op",
        "float-tensor",
        "python-branch",
        "float-division",
        "arity",
        "not-boolean",
        "device",
        "int32",
    ],
)
def test_a_bad_program_gets_a_typed_error_naming_mask_mod(function, names: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MaskProgramError, match="mask_mod") as error:
        _bind(function, length=4096)
    assert names in str(error.value)


def test_a_captured_array_of_another_framework_is_refused() -> None:
    jnp = pytest.importorskip("jax.numpy")
    table = jnp.zeros(8, dtype=jnp.int32)
    with pytest.raises(MaskProgramError, match="mask_mod"):
        _bind(lambda b, h, q_idx, kv_idx: table[q_idx] == 0)
