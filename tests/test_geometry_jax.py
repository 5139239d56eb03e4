"""attnkit.contract.jax against the float64 torch oracle: the band, lengths and padding, and the cosine backward.

Fast (no attention is run): each JAX backend builds its visibility from these, so a slip here shows as a wrong pair
before it shows as a wrong output.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from attnkit.backends.reference.torch_naive import oracle_visibility

from attnkit import AttentionSpec
from attnkit.backend import AttentionInputs
from attnkit.contract import COSINE_EPS, alignment_offset, conjoin, diagonal_band, within_band
from attnkit.contract.jax import (
    band_visibility,
    length_visibility,
    normalize,
    normalize_backward,
    segment_visibility,
    zero_padding,
)
from attnkit.contract.torch import zero_padding as torch_zero_padding

SPECS = [
    AttentionSpec(),
    AttentionSpec(causal=True),
    AttentionSpec(causal=True, causal_alignment="top_left"),
    AttentionSpec(window=(2, None)),
    AttentionSpec(window=(None, 1), causal_alignment="top_left"),
    AttentionSpec(window=(3, 2)),
    AttentionSpec(causal=True, window=(2, 5)),
    AttentionSpec(causal=True, window=(1, None), causal_alignment="top_left"),
]
#: (Lq, Lk, q_lengths, kv_lengths): Lq < Lk, Lq > Lk, and lengths with 0 among them.
SHAPES = [
    (5, 9, None, None),
    (9, 4, None, None),
    (6, 8, (6, 0, 3), (8, 5, 0)),
    (7, 7, None, (7, 2, 4)),
]


def _oracle(
    spec: AttentionSpec,
    len_q: int,
    len_k: int,
    q_lengths: tuple | None,
    kv_lengths: tuple | None,
    segment_ids: tuple[np.ndarray, np.ndarray] | None = None,
) -> Any:
    batch = len(q_lengths or kv_lengths or (0,)) if segment_ids is None else len(segment_ids[0])
    inputs = AttentionInputs(
        q=torch.zeros(batch, 1, len_q, 1, dtype=torch.float64),
        k=torch.zeros(batch, 1, len_k, 1, dtype=torch.float64),
        v=torch.zeros(batch, 1, len_k, 1, dtype=torch.float64),
        q_lengths=None if q_lengths is None else torch.tensor(q_lengths),
        kv_lengths=None if kv_lengths is None else torch.tensor(kv_lengths),
        q_segment_ids=None if segment_ids is None else torch.from_numpy(segment_ids[0]),
        kv_segment_ids=None if segment_ids is None else torch.from_numpy(segment_ids[1]),
    )
    return oracle_visibility(spec, inputs, len_q, len_k)[:, 0].numpy()


#: Query and key indices wider than every case, cut to each case's (Lq, Lk): a pair's visibility does not depend on
#: the extent around it, and shared shapes let JAX reuse its compiled ops across cases (the tests stay fast).
GRID = 10
ROWS, COLS = jnp.arange(GRID)[:, None], jnp.arange(GRID)[None, :]


def _lengths(values: tuple | None) -> Any:
    return None if values is None else jnp.asarray(values, jnp.int32).reshape(-1, 1, 1)


def _cut(visible: Any, expected: np.ndarray) -> np.ndarray:
    """The (B, Lq, Lk) corner of a visibility over the grid (None: all visible)."""
    grid = np.ones((GRID, GRID), bool) if visible is None else np.asarray(visible)
    return np.broadcast_to(grid[..., : expected.shape[1], : expected.shape[2]], expected.shape)


def _name(spec: AttentionSpec) -> str:
    parts = ["causal" if spec.causal else "", f"window{spec.window}" if spec.window else ""]
    return "+".join(part for part in parts if part) + f"-{spec.causal_alignment.value}" if spec.features() else "none"


CASES = list(itertools.product(SPECS, SHAPES))
IDS = [f"{_name(spec)}-{len_q}x{len_k}{'-lengths' if kv else ''}" for spec, (len_q, len_k, _, kv) in CASES]


@pytest.mark.parametrize(("spec", "shape"), CASES, ids=IDS)
def test_visibility_is_the_oracles(spec: AttentionSpec, shape: tuple) -> None:
    """band_visibility and length_visibility as jax-xla and jax-reference combine them (lengths or whole extents)."""
    len_q, len_k, q_lengths, kv_lengths = shape
    expected = _oracle(spec, len_q, len_k, q_lengths, kv_lengths)
    q_len, kv_len = _lengths(q_lengths), _lengths(kv_lengths)
    aligned_by = (len_q if q_len is None else q_len, len_k if kv_len is None else kv_len)
    band = band_visibility(spec, ROWS, COLS, *aligned_by)
    # Whole extents as limits too (jax-reference's form), so pairs past (Lq, Lk) in the grid are cut either way.
    limits = (len_q if q_len is None else q_len, len_k if kv_len is None else kv_len)
    np.testing.assert_array_equal(_cut(conjoin(band, length_visibility(ROWS, COLS, q_len, kv_len)), expected), expected)
    np.testing.assert_array_equal(_cut(conjoin(band, length_visibility(ROWS, COLS, *limits)), expected), expected)


@pytest.mark.parametrize(("spec", "shape"), CASES, ids=IDS)
def test_shifted_band_is_the_oracles(spec: AttentionSpec, shape: tuple) -> None:
    """The pallas kernels' form: each element's band shifted by its own offset, then lo ≤ j − i ≤ hi."""
    len_q, len_k, q_lengths, kv_lengths = shape
    expected = _oracle(spec, len_q, len_k, q_lengths, kv_lengths)
    lower, upper = diagonal_band(spec)
    for element, want in enumerate(expected):
        q_len = len_q if q_lengths is None else q_lengths[element]
        kv_len = len_k if kv_lengths is None else kv_lengths[element]
        offset = alignment_offset(spec, q_len, kv_len)
        band = (None if lower is None else offset + lower, None if upper is None else offset + upper)
        got = conjoin(length_visibility(ROWS, COLS, q_len, kv_len), within_band(COLS - ROWS, *band))
        np.testing.assert_array_equal(_cut(got, want[None])[0], want)


def _segment_ids(len_q: int, len_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Three batch elements: unsorted ids with padding among them, drawn apart for q and k; a whole row of padding;
    and (for Lq = Lk) the same packed row for both. int64 keys against int32 queries: any integer dtype."""
    rng = np.random.default_rng(len_q * 100 + len_k)
    q_ids = rng.integers(-1, 3, (3, len_q)).astype(np.int32)
    kv_ids = rng.integers(-1, 3, (3, len_k))
    q_ids[1], kv_ids[1] = -1, -1
    if len_q == len_k:
        q_ids[2] = kv_ids[2] = np.sort(kv_ids[2])
    return q_ids, kv_ids


@pytest.mark.parametrize(("spec", "shape"), CASES, ids=IDS)
def test_segment_visibility_is_the_oracles(spec: AttentionSpec, shape: tuple) -> None:
    """segment_visibility ANDed with the band and lengths as the JAX backends combine them (§4.5)."""
    len_q, len_k, q_lengths, kv_lengths = shape
    segment_ids = _segment_ids(len_q, len_k)
    expected = _oracle(spec, len_q, len_k, q_lengths, kv_lengths, segment_ids)
    q_len, kv_len = _lengths(q_lengths), _lengths(kv_lengths)
    band = band_visibility(spec, ROWS, COLS, len_q if q_len is None else q_len, len_k if kv_len is None else kv_len)
    q_ids = np.full((3, GRID), -1, np.int32)
    kv_ids = np.full((3, GRID), -1, np.int64)
    q_ids[:, :len_q], kv_ids[:, :len_k] = segment_ids
    segments = segment_visibility(jnp.asarray(q_ids)[:, :, None], jnp.asarray(kv_ids)[:, None, :])
    got = conjoin(band, length_visibility(ROWS, COLS, q_len, kv_len), segments)
    np.testing.assert_array_equal(_cut(got, expected), expected)
    assert segment_visibility(None, None) is None


@pytest.mark.parametrize("axis", [1, 2])
def test_zero_padding_zeroes_negative_segment_ids(axis: int) -> None:
    """Positions whose id is negative are 0 (NaN there included), the others untouched, in either layout."""
    rng = np.random.default_rng(3)
    ids = np.array([[0, -1, 0, 1, -3], [-1, -1, 2, 2, 2]])
    padding = (ids < 0)[:, None, :, None]  # (B, 1, L, 1) against bhsd
    x = np.where(padding, np.nan, rng.standard_normal((2, 3, 5, 4)))
    expected = np.where(padding, 0.0, x)
    layout = (lambda a: np.swapaxes(a, 1, 2)) if axis == 1 else (lambda a: a)
    got = zero_padding(jnp.asarray(layout(x), jnp.float32), None, axis=axis, segment_ids=jnp.asarray(ids, jnp.int32))
    np.testing.assert_array_equal(layout(np.asarray(got)), expected.astype(np.float32))
    assert zero_padding(x, None, axis=axis, segment_ids=None) is x


@pytest.mark.parametrize("axis", [1, 2])
def test_zero_padding_is_the_torch_contracts(axis: int) -> None:
    """Positions at or beyond each length are 0 (NaN there included), in either layout; None leaves x as it is."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 5, 4))  # bhsd
    x[0, :, 3:] = np.nan
    lengths = np.array([3, 0, 5])
    expected = torch_zero_padding(torch.from_numpy(x), torch.from_numpy(lengths)).numpy()
    layout = (lambda a: np.swapaxes(a, 1, 2)) if axis == 1 else (lambda a: a)
    got = zero_padding(jnp.asarray(layout(x), jnp.float32), jnp.asarray(lengths, jnp.int32), axis=axis)
    np.testing.assert_array_equal(layout(np.asarray(got)), expected.astype(np.float32))
    assert zero_padding(x, None, axis=axis) is x


@jax.jit
def _unit_and_gradient(x: Any, d_unit: Any) -> tuple[Any, Any]:
    # One program: op by op, each of the few ops would compile on its own.
    normalization = normalize(x)
    return normalization.unit, normalize_backward(normalization, d_unit)


def test_normalize_backward_is_torchs() -> None:
    """The chain rule through x / max(‖x‖, eps) against torch autograd in float64, zero and sub-eps rows included."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    x[1] = 0.0
    x[2] *= 1e-14  # below eps: the denominator is the constant eps
    d_unit = rng.standard_normal((4, 6)).astype(np.float32)
    x64 = torch.from_numpy(x).double().requires_grad_(True)
    unit64 = torch.nn.functional.normalize(x64, dim=-1, eps=COSINE_EPS)
    (expected,) = torch.autograd.grad(unit64, x64, torch.from_numpy(d_unit).double())
    unit, got = _unit_and_gradient(jnp.asarray(x), jnp.asarray(d_unit))
    np.testing.assert_allclose(np.asarray(unit), unit64.detach().numpy(), rtol=1e-6, atol=1e-7)
    got = np.asarray(got)
    scale = np.abs(expected.numpy()).max(axis=-1, keepdims=True)
    np.testing.assert_allclose(got / scale, expected.numpy() / scale, atol=1e-6)


def test_normalize_backward_is_jax_grad_of_the_plain_normalisation() -> None:
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)
    d_unit = jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)

    def plain(x: Any) -> Any:
        return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), COSINE_EPS)

    expected = jax.jit(lambda x, d_unit: jax.vjp(plain, x)[1](d_unit)[0])(x, d_unit)
    _, got = _unit_and_gradient(x, d_unit)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
