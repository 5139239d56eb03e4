"""Every available backend agrees with the float64 oracle on everything drawn (docs/testing.md).

Parametrised through the registry: a newly registered backend is covered with no new test code.
"""

from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import attnkit
from attnkit.testing import Case, backends_for, check_backend
from attnkit.testing.strategies import cases
from tests.conftest import backend_params


@pytest.mark.parametrize("backend", backend_params())
@given(data=st.data())
def test_backend_agrees_with_oracle(backend: str, data: st.DataObject) -> None:
    capabilities = attnkit.get_backend(backend).capabilities
    case: Case = data.draw(cases(capabilities=capabilities), label="case")
    note(case.describe())
    reasons = backends_for(case, [backend])[backend]
    assert not reasons, f"{backend} declares these features but refuses the case: {reasons}"
    failures = [str(c) for c in check_backend(case, backend) if not c.ok]
    assert not failures, f"{backend} disagrees with the oracle on {case.describe()}:\n" + "\n".join(failures)


def test_harness_runs_a_backend_on_the_gpu_where_it_declares_one() -> None:
    """`attnkit check` on a GPU machine checks the CUDA kernels users run there: torch tensors go to CUDA for a
    backend that declares it when a device is present, and stay on the CPU for one that declares only the CPU."""
    import torch

    from attnkit.testing.runners import harness_device

    assert harness_device("torch-naive") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert harness_device("torch-sdpa") == "cpu"
