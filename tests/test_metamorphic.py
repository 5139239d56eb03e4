"""Metamorphic properties (docs/testing.md): relations between two calls that must hold on every backend,
whatever the oracle says. Each runs on every available backend through the registry."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from attnkit import AttentionSpec
from attnkit.features import Feature
from attnkit.testing import Case, backends_for, make_arrays
from attnkit.testing.runners import harness_capabilities, run_backend
from attnkit.testing.strategies import specs
from tests.conftest import backend_params

BACKENDS = backend_params()
TOLERANCE = {"rtol": 2e-5, "atol": 2e-5}  # float32 inputs: the two calls differ only in summation order
#: Draws per relation and backend: a third of the profile's. Each relation checks one piece of plumbing (the key axis,
#: the head mapping, the layout, padding keys) on fixed shapes, where test_conformance's drawn calls check every backend
#: against the oracle.
RELATION_EXAMPLES = max(4, settings.default.max_examples // 3)
#: Backends where every drawn spec is a new program to compile (JAX) or a kernel to interpret (Triton, Pallas, the CUDA
#: C emulator): seconds a call, so three in the ci profile (four were still 250 s of CPU, pallas's 100 of them).
SLOW_CALL_BACKENDS = frozenset({"triton", "pallas", "cupy-emulated", "jax-reference", "jax-xla"})


def relation_examples(backend: str) -> int:
    return max(3, RELATION_EXAMPLES // 3) if backend in SLOW_CALL_BACKENDS else RELATION_EXAMPLES


def _declared_specs(backend: str, *features: str) -> st.SearchStrategy[AttentionSpec]:
    """Specs drawing only the clauses of ``features`` that ``backend`` declares: a clause it refuses would skip the
    whole relation at the first draw that holds it (jax-xla's softcap did so for every layout draw)."""
    return specs(frozenset(Feature(name) for name in features) & harness_capabilities(backend).features)


def _run(backend: str, case: Case, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    reasons = backends_for(case, [backend])[backend]
    if reasons:
        pytest.skip(f"{backend}: {reasons}")
    return run_backend(case, arrays, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_permutation_invariance(backend: str) -> None:
    """Without causal/window/lengths, attention is a set operation over keys: permuting k, v, mask and
    bias columns together leaves out and lse unchanged, and permutes dk, dv, dbias the same way."""

    @settings(max_examples=relation_examples(backend))
    @given(spec=_declared_specs(backend, "softcap", "cosine"), seed=st.integers(0, 1000))
    def relation(spec: AttentionSpec, seed: int) -> None:
        case = Case(
            spec=spec, len_q=5, len_k=9, mask_shape=(2, 2, 5, 9), bias_shape=(2, 2, 5, 9), bias_grad=True, seed=seed
        )
        arrays = make_arrays(case)
        permutation = np.random.default_rng(seed).permutation(case.len_k)
        permuted = dict(arrays)
        permuted["k"] = arrays["k"][:, :, permutation]
        permuted["v"] = arrays["v"][:, :, permutation]
        permuted["mask"] = arrays["mask"][..., permutation]
        permuted["bias"] = arrays["bias"][..., permutation]
        first, second = _run(backend, case, arrays), _run(backend, case, permuted)
        for name in ("out", "lse", "dq"):
            np.testing.assert_allclose(first[name], second[name], **TOLERANCE)
        for name in ("dk", "dv"):
            np.testing.assert_allclose(first[name][:, :, permutation], second[name], **TOLERANCE)
        np.testing.assert_allclose(first["dbias"][..., permutation], second["dbias"], **TOLERANCE)

    relation()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_equals_repeated_kv(backend: str) -> None:
    """§2: Hq = G·Hkv with head h reading kv head h // G equals the same call with K/V repeated G times
    (repeat_interleave, the torch SDPA enable_gqa mapping); dk, dv are the sums over each group."""

    @settings(max_examples=relation_examples(backend))
    @given(spec=_declared_specs(backend, "causal", "top_left", "window", "softcap"), group=st.sampled_from([2, 4]))
    def relation(spec: AttentionSpec, group: int) -> None:
        grouped = Case(spec=spec, heads_q=2 * group, heads_kv=2, len_q=6, len_k=7)
        arrays = make_arrays(grouped)
        repeated = dict(arrays)
        repeated["k"] = np.repeat(arrays["k"], group, axis=1)
        repeated["v"] = np.repeat(arrays["v"], group, axis=1)
        first = _run(backend, grouped, arrays)
        second = _run(backend, grouped.with_(heads_kv=2 * group), repeated)
        for name in ("out", "lse", "dq"):
            np.testing.assert_allclose(first[name], second[name], **TOLERANCE)
        for name in ("dk", "dv"):
            summed = second[name].reshape(second[name].shape[0], 2, group, *second[name].shape[2:]).sum(axis=2)
            np.testing.assert_allclose(first[name], summed, **TOLERANCE)

    relation()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bshd_equals_bhsd(backend: str) -> None:
    """§1: the layout only moves axes."""

    @settings(max_examples=relation_examples(backend))
    @given(spec=_declared_specs(backend, "causal", "top_left", "window", "softcap", "cosine"))
    def relation(spec: AttentionSpec) -> None:
        case = Case(spec=spec.replace(layout="bhsd"), heads_q=4, heads_kv=2, len_q=5, len_k=6)
        arrays = make_arrays(case)
        transposed = {
            name: value.transpose(0, 2, 1, 3) if name in ("q", "k", "v", "dout") else value
            for name, value in arrays.items()
        }
        first = _run(backend, case, arrays)
        second = _run(backend, case.with_(spec=spec.replace(layout="bshd")), transposed)
        np.testing.assert_allclose(first["lse"], second["lse"], **TOLERANCE)
        for name in ("out", "dq", "dk", "dv"):
            np.testing.assert_allclose(first[name], second[name].transpose(0, 2, 1, 3), **TOLERANCE)

    relation()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cosine_equals_normalise_then_softmax(backend: str) -> None:
    """§3: variant="cosine" equals the dot variant on L2-normalised q, k with scale 16 (forward)."""

    @settings(max_examples=relation_examples(backend))
    @given(spec=_declared_specs(backend, "causal", "window", "softcap"))
    def relation(spec: AttentionSpec) -> None:
        cosine = Case(spec=spec.replace(variant="cosine", scale=None), grad=False)
        arrays = make_arrays(cosine)
        normalised = dict(arrays)
        for name in ("q", "k"):
            norm = np.maximum(np.linalg.norm(arrays[name], axis=-1, keepdims=True), 1e-12)
            normalised[name] = arrays[name] / norm
        dot = cosine.with_(spec=spec.replace(variant="dot", scale=16.0))
        first, second = _run(backend, cosine, arrays), _run(backend, dot, normalised)
        np.testing.assert_allclose(first["out"], second["out"], **TOLERANCE)

    relation()


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_row_bias_constant_leaves_out_unchanged(backend: str) -> None:
    """§3: softmax is shift-invariant per row: adding c_i to every bias[..., i, :] changes lse by c_i only."""

    @settings(max_examples=relation_examples(backend))
    @given(spec=_declared_specs(backend, "causal", "window", "softcap", "cosine"), shift=st.floats(-30, 30))
    def relation(spec: AttentionSpec, shift: float) -> None:
        case = Case(spec=spec, bias_shape=(2, 2, 8, 8), len_q=8, len_k=8, grad=False)
        arrays = make_arrays(case)
        row_shift = shift * np.linspace(-1, 1, case.len_q)[:, None]
        shifted = dict(arrays)
        shifted["bias"] = arrays["bias"] + row_shift
        first, second = _run(backend, case, arrays), _run(backend, case, shifted)
        np.testing.assert_allclose(first["out"], second["out"], **TOLERANCE)
        finite = np.isfinite(first["lse"])
        expected_lse = (first["lse"] + row_shift[:, 0])[finite]
        np.testing.assert_allclose(second["lse"][finite], expected_lse, rtol=1e-5, atol=1e-4)

    relation()


@pytest.mark.parametrize("backend", BACKENDS)
def test_appending_invisible_keys_changes_nothing(backend: str) -> None:
    """§4.3: keys beyond kv_lengths are padding: adding more of them (with garbage, even NaN) is a no-op."""

    @settings(max_examples=relation_examples(backend))
    @given(data=st.data())
    def relation(data: st.DataObject) -> None:
        spec = data.draw(_declared_specs(backend, "causal", "top_left", "window", "softcap", "cosine"))
        note(str(spec))
        case = Case(spec=spec, len_q=4, len_k=6, kv_lengths=(6, 3))
        arrays = make_arrays(case)
        padded = dict(arrays)
        for name in ("k", "v"):
            extra = np.full(arrays[name].shape[:2] + (5,) + arrays[name].shape[3:], np.nan)
            padded[name] = np.concatenate([arrays[name], extra], axis=2)
        first = _run(backend, case, arrays)
        second = _run(backend, case.with_(len_k=11), padded)
        for name in ("out", "lse", "dq"):
            np.testing.assert_allclose(first[name], second[name], **TOLERANCE)
        for name in ("dk", "dv"):
            np.testing.assert_allclose(first[name], second[name][:, :, :6], **TOLERANCE)
            assert np.all(second[name][:, :, 6:] == 0)

    relation()
