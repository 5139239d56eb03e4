"""Every available backend agrees with the float64 oracle on everything drawn (docs/testing.md).

Parametrised through the registry: a newly registered backend is covered with no new test code.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import attnkit
from attnkit import AttentionSpec
from attnkit.backend import Framework
from attnkit.testing import Case, backends_for, check_backend
from attnkit.testing.runners import drawable_dtypes, harness_capabilities
from attnkit.testing.strategies import cases, paged_cases, serves_paged, varlen_cases, varlen_forms
from tests.conftest import backend_params

#: Drawn ragged calls per backend: a few, each form's corners being in tests/test_ragged.py's named cases.
RAGGED_EXAMPLES = max(2, settings.default.max_examples // 10)
#: Drawn attend calls per JAX backend: each call's new shape and dtype is a new compiled program there (and pallas
#: interprets its kernels besides), seconds a call in CI, so they draw two fifths of the profile's count (their named
#: edges are in test_tile_edges.py, test_kernel_backends.py and `attnkit check`).
JAX_EXAMPLES = max(3, settings.default.max_examples * 2 // 5)


def _assert_agrees(backend: str, case: Case) -> None:
    note(case.describe())
    reasons = backends_for(case, [backend])[backend]
    assert not reasons, f"{backend} declares these features but refuses the case: {reasons}"
    failures = [str(c) for c in check_backend(case, backend) if not c.ok]
    assert not failures, f"{backend} disagrees with the oracle on {case.describe()}:\n" + "\n".join(failures)


def _agrees_on_a_drawn_call(backend: str, data: st.DataObject) -> None:
    capabilities = harness_capabilities(backend)
    _assert_agrees(
        backend,
        data.draw(cases(capabilities=capabilities, dtypes=drawable_dtypes(backend), every_clause=True), label="case"),
    )


@pytest.mark.parametrize("backend", backend_params(Framework.TORCH))
@given(data=st.data())
def test_backend_agrees_with_oracle(backend: str, data: st.DataObject) -> None:
    _agrees_on_a_drawn_call(backend, data)


@pytest.mark.parametrize("backend", backend_params(Framework.JAX))
@settings(max_examples=JAX_EXAMPLES)
@given(data=st.data())
def test_jax_backend_agrees_with_oracle(backend: str, data: st.DataObject) -> None:
    _agrees_on_a_drawn_call(backend, data)


def _serving(form: str, serves: Any) -> list[object]:
    """The registry's backends, those whose declared features serve no ``form`` call skipped, saying so."""
    params = []
    for param in backend_params():
        name = param.values[0]  # type: ignore[attr-defined]
        marks = list(param.marks)  # type: ignore[attr-defined]
        if not serves(harness_capabilities(name)):
            marks.append(pytest.mark.skip(reason=f"{name} declares no feature set serving an {form} call"))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.mark.parametrize("backend", _serving("attend_varlen", varlen_forms))
@settings(max_examples=RAGGED_EXAMPLES)
@given(data=st.data())
def test_backend_agrees_with_oracle_on_varlen(backend: str, data: st.DataObject) -> None:
    """§12: attend_varlen, self-packed and cross, with empty and one-token sequences, outputs and gradients."""
    capabilities = harness_capabilities(backend)
    case = data.draw(varlen_cases(capabilities=capabilities, dtypes=drawable_dtypes(backend)), label="case")
    _assert_agrees(backend, case)


@pytest.mark.parametrize("backend", _serving("attend_paged", serves_paged))
@settings(max_examples=RAGGED_EXAMPLES)
@given(data=st.data())
def test_backend_agrees_with_oracle_on_paged(backend: str, data: st.DataObject) -> None:
    """§13: attend_paged over drawn block tables (shared, out-of-order blocks; garbage past each sequence's blocks;
    NaN in every slot no sequence reads), forward only."""
    capabilities = harness_capabilities(backend)
    case = data.draw(paged_cases(capabilities=capabilities, dtypes=drawable_dtypes(backend)), label="case")
    _assert_agrees(backend, case)


@pytest.mark.parametrize("backend", backend_params(Framework.JAX))
@settings(max_examples=max(2, settings.default.max_examples // 12))
@given(data=st.data())
def test_jax_backend_agrees_with_the_oracle_under_x64(backend: str, data: st.DataObject) -> None:
    """Scientific code runs JAX with jax_enable_x64, which makes Python integers int64 inside traced code: every
    JAX backend must keep its index arithmetic in explicit dtypes, for every dtype it declares (float64 included,
    which exists only under x64)."""
    import jax

    capabilities = attnkit.get_backend(backend).capabilities
    with jax.enable_x64(True):
        case: Case = data.draw(
            cases(capabilities=capabilities, dtypes=drawable_dtypes(backend), every_clause=True), label="case"
        )
        note(case.describe())
        failures = [str(c) for c in check_backend(case, backend) if not c.ok]
    assert not failures, f"{backend} under x64 disagrees on {case.describe()}:\n" + "\n".join(failures)


@pytest.mark.parametrize("backend", backend_params())
def test_the_smallest_call_agrees_in_every_declared_dtype(backend: str) -> None:
    """B = H = Lq = Lk = 1: each product is one dot of two vectors, a form compilers special-case (XLA's CPU compiler
    rejected the bfloat16 one inside jitted jax.nn.dot_product_attention), drawn rarely at random."""
    for dtype in drawable_dtypes(backend):
        case = Case(spec=AttentionSpec(causal=True), batch=1, heads_q=1, heads_kv=1, len_q=1, len_k=1, dtype=dtype)
        failures = [str(c) for c in check_backend(case, backend) if not c.ok]
        assert not failures, f"{backend} disagrees on {case.describe()}:\n" + "\n".join(failures)


def test_harness_runs_a_backend_on_the_gpu_where_it_declares_one() -> None:
    """`attnkit check` on a GPU machine checks the CUDA kernels users run there: torch tensors go to CUDA for a
    backend that declares it when a device is present, and stay on the CPU for one that declares only the CPU."""
    import torch

    from attnkit.testing.runners import harness_device

    assert harness_device("torch-naive") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert harness_device("torch-sdpa") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert harness_device("cpu-flash") == "cpu"
