"""The environment has the backends it is declared to have: a backend lost from CI (a failed build, a package that
no longer installs, an availability check gone wrong) fails here with the reasons it gives, instead of quietly
leaving the matrices that parametrise over the available backends. CI declares its set in .ci/run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import attnkit
from tests.conftest import EXPECTED_BACKENDS_VARIABLE, backend_names, expected_backends

CI_SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "run"


def _expected_params() -> list[object]:
    expected = expected_backends()
    if not expected:
        reason = f"{EXPECTED_BACKENDS_VARIABLE} is {'empty' if expected == [] else 'not set'}: this environment"
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"{reason} declares no backends it must have"))]
    return expected


@pytest.mark.parametrize("backend", _expected_params())
def test_expected_backend_is_available(backend: str) -> None:
    registered = attnkit.registered_backends()
    assert backend in registered, (
        f"{EXPECTED_BACKENDS_VARIABLE} names {backend!r}, which is not registered (registered: {sorted(registered)})"
    )
    reasons = registered[backend].available()
    assert not reasons, f"{backend} is expected here ({EXPECTED_BACKENDS_VARIABLE}) but unavailable: {reasons}"


def test_ci_declares_registered_backends() -> None:
    """.ci/run's declaration names backends that exist (a renamed backend would otherwise fail only in CI)."""
    declared = re.search(rf'^export {EXPECTED_BACKENDS_VARIABLE}="([^"]*)"$', CI_SCRIPT.read_text(), re.M)
    assert declared, f".ci/run does not export {EXPECTED_BACKENDS_VARIABLE}"
    names = backend_names(declared.group(1))
    assert names and set(names) <= set(attnkit.registered_backends()), names
