"""Segment ids (docs/semantics.md §4.5) in every JAX backend that declares them, where the conformance harness does
not go: under jax.jit, with the ids as tracers, forward and backward, and with NaN in q, k and v at every position
whose id is negative (padding is not input, §5). Against the float64 oracle run on the same inputs with that
padding 0."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import attnkit
from attnkit import AttentionSpec
from attnkit.backend import Feature, Framework
from attnkit.testing import Case, make_arrays
from attnkit.testing.agreement import compare, oracle_results, rounded
from attnkit.testing.runners import Results
from tests.conftest import available_backends

BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(name not in available_backends(), reason=f"{name} not available here"))
    for name in ("jax-reference", "jax-xla", "pallas")
]
PAD = -1
# Left padding, then two documents; the second row packs three documents and ends in padding. GQA 2:1, causal
# (bottom-right, Lq = Lk), so the diagonal stays where it is and each document is causal in itself.
CASE = Case(
    spec=AttentionSpec(causal=True),
    batch=2,
    heads_q=2,
    heads_kv=1,
    len_q=20,
    len_k=20,
    q_segment_ids=((PAD,) * 3 + (4,) * 9 + (7,) * 8, (0,) * 6 + (1,) * 1 + (2,) * 10 + (PAD,) * 3),
    kv_segment_ids=((PAD,) * 3 + (4,) * 9 + (7,) * 8, (0,) * 6 + (1,) * 1 + (2,) * 10 + (PAD,) * 3),
)


def _with_nan_padding(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    poisoned = {name: value.copy() for name, value in arrays.items()}
    for name, ids in (("q", "q_segment_ids"), ("k", "kv_segment_ids"), ("v", "kv_segment_ids")):
        batch, position = np.nonzero(arrays[ids] < 0)
        poisoned[name][batch, :, position] = np.nan
    return poisoned


def _run_jitted(case: Case, arrays: dict[str, np.ndarray], backend: str) -> Results:
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(q: Any, k: Any, v: Any, q_ids: Any, kv_ids: Any, dout: Any, dlse: Any) -> tuple[Any, ...]:
        def call(q: Any, k: Any, v: Any) -> Any:
            return attnkit.attend(
                case.spec, q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, return_lse=True, backend=backend
            )

        (out, lse), pullback = jax.vjp(call, q, k, v)
        return out, lse, *pullback((dout, dlse))

    floats = (jnp.asarray(arrays[name], jnp.float32) for name in ("q", "k", "v"))
    ids = (jnp.asarray(arrays[name], jnp.int32) for name in ("q_segment_ids", "kv_segment_ids"))
    cotangents = (jnp.asarray(arrays[name], jnp.float32) for name in ("dout", "dlse"))
    values = run(*floats, *ids, *cotangents)
    return {name: np.asarray(value, np.float64) for name, value in zip(("out", "lse", "dq", "dk", "dv"), values)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_segment_ids_under_jit_with_nan_padding(backend: str) -> None:
    capabilities = attnkit.get_backend(backend).capabilities
    assert Framework.JAX in capabilities.frameworks and Feature.SEGMENT_IDS in capabilities.features
    arrays = rounded(CASE, make_arrays(CASE))
    exact, baseline = oracle_results(CASE, arrays)
    results = _run_jitted(CASE, _with_nan_padding(arrays), backend)
    failures = [str(comparison) for comparison in compare(CASE, results, exact, baseline) if not comparison.ok]
    assert not failures, "\n".join(failures)
