"""Shared fixtures: hypothesis profiles and the list of backends every agreement test runs on."""

from __future__ import annotations

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


def available_backends() -> list[str]:
    """Every registered backend that can run here: the parametrisation of the agreement tests."""
    return sorted(name for name, backend in attnkit.registered_backends().items() if not backend.available())


def pytest_report_header() -> list[str]:
    return [f"hypothesis profile: {PROFILE}", f"attnkit backends here: {', '.join(available_backends())}"]


@pytest.fixture(autouse=True)
def _fresh_config():
    """Each test starts from the shipped config and an empty decision cache."""
    attnkit.configure()
    yield
    attnkit.configure()
