"""Shared fixtures: hypothesis profiles and the list of backends every agreement test runs on."""

from __future__ import annotations

import os
import re

import pytest
import torch

import attnkit
from attnkit.testing import interpret_triton_without_gpu, register_profiles
from tests.cupy_emulator import attach_emulator

PROFILE = register_profiles()
# Before any backend loads: without a GPU the triton backend runs its kernels in the Triton interpreter.
interpret_triton_without_gpu()
# cupy-emulated, the cupy backend's CUDA C kernels on CPU tensors, is a test-only path: attach its launcher.
attach_emulator()

# The suite runs thousands of tiny calls: on a shared 2-core machine torch's intra-op threads cost more
# in synchronisation than they gain (about 10x on decode-size calls, measured by `attnkit bench`).
torch.set_num_threads(1)


#: Names the backends this environment must have (.ci/run sets it): tests/test_expected_backends.py fails for each one
#: that is unavailable, with its reasons. Unset (a developer's machine), that test is skipped, saying so.
EXPECTED_BACKENDS_VARIABLE = "ATTNKIT_EXPECT_BACKENDS"


def backend_names(value: str) -> list[str]:
    """Backend names listed with commas or spaces between them."""
    return [name for name in re.split(r"[,\s]+", value) if name]


def expected_backends() -> list[str] | None:
    """The backends :data:`EXPECTED_BACKENDS_VARIABLE` names, None when it is unset."""
    value = os.environ.get(EXPECTED_BACKENDS_VARIABLE)
    return None if value is None else backend_names(value)


def available_backends() -> list[str]:
    """Every registered backend that can run here."""
    return sorted(name for name, backend in attnkit.registered_backends().items() if not backend.available())


def backend_params() -> list[object]:
    """Every registered backend as a test parameter, the parametrisation of the agreement tests. One that cannot run
    here is a skip giving its reasons, so a backend lost from an environment shows in the report, not only by its
    absence."""
    params = []
    for name, backend in sorted(attnkit.registered_backends().items()):
        reasons = backend.available()
        marks = [pytest.mark.skip(reason=f"{name} is unavailable here: {'; '.join(reasons)}")] if reasons else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def pytest_report_header() -> list[str]:
    expected = expected_backends()
    return [
        f"hypothesis profile: {PROFILE}",
        f"attnkit backends here: {', '.join(available_backends())}",
        f"expected ({EXPECTED_BACKENDS_VARIABLE}): {', '.join(expected) if expected is not None else 'not set'}",
    ]


@pytest.fixture(autouse=True)
def _fresh_config():
    """Each test starts from the shipped config and an empty decision cache."""
    attnkit.configure()
    yield
    attnkit.configure()
