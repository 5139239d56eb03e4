"""What a backend declares for a device, it accepts on that device: for every registered backend, every device it
declares and every dtype and feature declared there, a call the harness would draw for that device is served, or
refused only as pending hardware verification (:class:`attnkit.backend.PendingHardware`). ``attnkit check`` on a
GPU draws exactly these calls and counts a refusal of one as a failure; this finds such a refusal on a CPU machine
(on a 2026-11-27 H200 run, pallas refused a paged cache of block size 1 that it declared on CUDA).

``supports()`` is asked about devices this machine may not have: it answers from the call's signature, never from
the hardware (``available()`` says what the machine lacks)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import hypothesis
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

import attnkit
from attnkit.backend import (
    ALLOW_UNVERIFIED_ENV,
    Backend,
    Capabilities,
    Feature,
    Framework,
    PendingHardware,
    Problem,
    Unverified,
    capability_reasons,
)
from attnkit.testing import strategies
from attnkit.testing.cases import Case
from attnkit.testing.check import backend_edge_cases
from attnkit.testing.runners import dtype_scope, native_framework

#: Calls drawn once from every feature, dtype and call form; each backend is checked on those within what it declares
#: on a device, as the harness would draw them there (drawing is the cost here, ~20 ms a call; supports() is not).
POOL_SIZE = 200
#: attend_paged calls drawn per (backend, device) within its declared paged sizes, which few pool calls meet (pallas on
#: a GPU: block sizes a power of two >= 16).
PAGED_PER_DEVICE = 10
#: Calls drawn for a (dtype, feature) pair that no pool call inside a declaration has.
PER_MISSED_PAIR = 3


def _examples(strategy: st.SearchStrategy[Case], count: int) -> tuple[Case, ...]:
    drawn: list[Case] = []

    @settings(max_examples=count, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @hypothesis.given(strategy)
    def draw(case: Case) -> None:
        drawn.append(case)

    draw()
    return tuple(drawn)


@functools.cache
def _pool() -> tuple[Case, ...]:
    return _examples(strategies.calls(), POOL_SIZE)


def _declared_devices() -> list[tuple[Backend, str]]:
    return [
        (backend, device)
        for _, backend in sorted(attnkit.registered_backends().items())
        for device in sorted(backend.capabilities.devices)
    ]


@contextlib.contextmanager
def _as_on_a_machine_with(device: str) -> Iterator[None]:
    """supports() as a machine with ``device`` would answer: where a backend looks at the machine (JAX's default
    backend, torch.cuda) to decide how it runs a device's calls, it sees that device there. On a CPU machine pallas
    took every CUDA call for an interpreted one and never applied its GPU limits."""
    if device != "cuda":
        yield
        return
    import jax
    import torch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax, "default_backend", lambda: "gpu")
        patch.setattr(torch.cuda, "is_available", lambda: True)
        yield


def _served(
    backend: Backend, device: str, declared: Capabilities, labelled: list[tuple[str, Case]]
) -> tuple[set[tuple[str, str]], list[str]]:
    """(the (dtype, feature) pairs of the calls inside the declaration, the refusals of those calls)."""
    framework = native_framework(backend.name)
    covered: set[tuple[str, str]] = set()
    problems = []
    for label, case in labelled:
        if Feature.GRAD not in declared.features:
            case = case.with_(grad=False)  # as the harness does: a forward-only backend is checked forward
        if capability_reasons(declared, case.spec, case.problem(framework, device)):
            continue  # outside the declaration: the harness never draws it there
        covered.update((case.dtype, feature) for feature in case.features())
        # A JAX backend's float64 runs under jax_enable_x64.
        with dtype_scope(backend.name, case.dtype), _as_on_a_machine_with(device):
            refusals = backend.supports(case.spec, case.problem(framework, device))
        problems += [
            f"{backend.name} on {device} refuses {label} ({case.describe()}): {reason}"
            for reason in refusals
            if not isinstance(reason, PendingHardware)
        ]
    return covered, problems


def _drawn_with(declared: Capabilities, dtype: str, feature: str) -> list[tuple[str, Case]]:
    """A few calls inside the declaration with ``feature`` in ``dtype``, for a pair the pool missed."""
    strategy = strategies.calls(capabilities=declared, dtypes=[dtype]).filter(lambda case: feature in case.features())
    try:
        drawn = _examples(strategy, PER_MISSED_PAIR)
    except Unsatisfiable:
        return []
    return [(f"drawn with {feature} #{index}", case) for index, case in enumerate(drawn)]


def test_declared_calls_are_served_on_each_declared_device() -> None:
    """Every registered backend, on every device it declares: the edge cases and drawn calls inside its declaration
    there are served (or pending hardware), and those calls cover every declared (dtype, feature) pair."""
    problems = []
    for backend, device in _declared_devices():
        declared = backend.capabilities.on(device)
        if Feature.LSE not in declared.features:
            continue  # the harness asks every call for lse, so it checks no backend without it (flash-attn)
        drawn = [(f"drawn #{index}", case) for index, case in enumerate(_pool())]
        if strategies.serves_paged(declared):
            paged = _examples(strategies.paged_cases(capabilities=declared), PAGED_PER_DEVICE)
            drawn += [(f"paged #{index}", case) for index, case in enumerate(paged)]
        # Every drawn call in every dtype declared there (a case's dtype is a field), so each declared feature is
        # checked in each declared dtype whatever the pool's draws (supports() is cheap; drawing is not).
        retyped = [(label, case.with_(dtype=dtype)) for label, case in drawn for dtype in sorted(declared.dtypes)]
        covered, refused = _served(backend, device, declared, backend_edge_cases(backend) + retyped)
        problems += refused
        features = {str(feature) for feature in declared.features}
        # A pair the pool missed (which pairs it meets depends on the pool's draws): calls drawn to have it.
        for dtype, feature in sorted({(dtype, feature) for dtype in declared.dtypes for feature in features} - covered):
            more, refused = _served(backend, device, declared, _drawn_with(declared, dtype, feature))
            problems += refused
            if (dtype, feature) not in more:
                problems.append(f"{backend.name} on {device}: no call with ({dtype}, {feature}) could be drawn")
    assert not problems, "\n".join(problems[:20])


def test_a_refusal_pending_hardware_names_the_path_and_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A declared Unverified path is refused on its device with a PendingHardware reason naming it and the variable
    that runs it, and served once that variable is 1; other devices are untouched."""
    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    backend = attnkit.registered_backends()["torch-sdpa"]
    (entry,) = backend.capabilities.unverified
    assert isinstance(entry, Unverified) and entry.device == "cuda"
    problem = Problem(Framework.TORCH, "cuda", "bfloat16", 1, 2, 2, 5, 7, 16, 16, needs_grad=True,
                      return_lse=True)  # fmt: skip
    spec = attnkit.AttentionSpec(causal=True)
    reasons = backend.supports(spec, problem)
    assert len(reasons) == 1 and isinstance(reasons[0], PendingHardware), reasons
    assert entry.path in reasons[0] and ALLOW_UNVERIFIED_ENV in reasons[0]
    # The same call without gradients, in float32, or on the CPU is not that path.
    for other in ({"needs_grad": False}, {"dtype": "float32"}, {"device": "cpu"}):
        assert backend.supports(spec, _replace(problem, **other)) == [], other
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "1")
    assert backend.supports(spec, problem) == []


def test_the_plain_sdpa_call_is_not_held_back_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only torch-sdpa's op path waits for hardware: a plain half-precision training call is SDPA itself (verified
    on the H200), so auto keeps it on CUDA."""
    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    backend = attnkit.registered_backends()["torch-sdpa"]
    problem = Problem(Framework.TORCH, "cuda", "float16", 2, 8, 8, 128, 128, 64, 64, needs_grad=True)
    assert backend.supports(attnkit.AttentionSpec(causal=True), problem) == []


def _replace(problem: Problem, **changes: object) -> Problem:
    return dataclasses.replace(problem, **changes)  # type: ignore[arg-type]
