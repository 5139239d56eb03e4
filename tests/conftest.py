"""Shared fixtures: hypothesis profiles and the list of backends every agreement test runs on."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit import dispatch, registry
from attnkit.backend import Framework
from attnkit.testing import interpret_triton_without_gpu, register_profiles
from attnkit.testing.poison import poisoned_allocations
from attnkit.testing.runners import native_framework
from tests.cupy_emulator import attach_emulator

# Measuring (attnkit/autotune.py) makes auto's choice depend on timings: off for the suite, whose tests of it turn it
# on in a scope with a fake clock; records, if any test writes one, go to a directory of the run, never the user's.
os.environ["ATTNKIT_AUTOTUNE"] = "0"
os.environ["ATTNKIT_AUTOTUNE_DIR"] = os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"attnkit-test-autotune-{os.getuid()}-{os.getpid()}"
)

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


def backend_params(framework: Framework | None = None) -> list[object]:
    """Every registered backend (run by the harness in ``framework``, if given) as a test parameter, the
    parametrisation of the agreement tests. One that cannot run here is a skip giving its reasons, so a backend lost
    from an environment shows in the report, not only by its absence."""
    params = []
    for name, backend in sorted(attnkit.registered_backends().items()):
        if framework is not None and native_framework(name) is not framework:
            continue
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


#: The test modules that run every backend against the oracle (or against the contract's exact promises) whose tests
#: run with every uninitialised allocation poisoned (attnkit.testing.poison): a kernel that leaves part of a buffer
#: unwritten fails here as it would on a GPU, where torch.empty hands back old data, not the CPU's zeroed pages.
POISONED_MODULES = frozenset(
    {
        "test_conformance",
        "test_contract",
        "test_kernel_backends",
        "test_ragged",
        "test_tile_edges",
    }
)


#: Set to 0 to run those modules unpoisoned: to time the poisoning, or to see a defect that only poisoning exposes pass.
POISON_SWITCH_VARIABLE = "ATTNKIT_TEST_POISON"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """--dist loadgroup (pyproject.toml) deals the tests marked xdist_group("name") to one worker by the "@name"
    pytest-xdist appends to their node ids on each worker. Its rename sets ``item._nodeid``, which pytest 9 no longer
    reads (the id is ``item._id``): the marks were ignored, and each worker that was dealt one of a group's tests made
    the group's module-scoped fixture again (the distributed children, the static checks' compiles). The suffix is
    added here where it is missing."""
    if getattr(config.option, "loadgroup", False) is not True:  # set on xdist workers under --dist loadgroup
        return
    for item in items:
        names = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                 for mark in item.iter_markers("xdist_group")}  # fmt: skip
        suffix = "@" + "_".join(sorted(names))
        if names and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            item._id = type(item._id).parse(item.nodeid + suffix)


@pytest.fixture(autouse=True)
def _poisoned_allocations(request: pytest.FixtureRequest) -> Iterator[None]:
    module = request.module.__name__.rpartition(".")[2]
    if module not in POISONED_MODULES or os.environ.get(POISON_SWITCH_VARIABLE) == "0":
        yield
        return
    with poisoned_allocations():
        yield


@pytest.fixture(autouse=True)
def _fresh_config():
    """Each test starts from the shipped config and an empty decision cache."""
    attnkit.configure()
    yield
    attnkit.configure()


PLUGIN_DISTRIBUTION = "attnkit-test-plugin 1.2.3"
# Each entry point of the test plugin: one new backend, one name clash (refused as a whole, with its other backend),
# one declared replacement of a built-in, one that raises and one whose module is missing.
PLUGIN_ENTRY_POINTS = {
    "fresh": "attnkit_test_plugin:fresh",
    "clash": "attnkit_test_plugin:clash",
    "replace": "attnkit_test_plugin:replace",
    "broken": "attnkit_test_plugin:broken",
    "missing": "attnkit_test_plugin_missing:backend",
}
PLUGIN_MODULE = """
from attnkit.backends.reference.torch_naive import TorchNaiveBackend


class Renamed(TorchNaiveBackend):
    def __init__(self, name, replaces_builtin=False):
        self.name = name
        if replaces_builtin:
            self.replaces_builtin = True


def fresh():
    return Renamed("test-plugin-fresh")


def clash():
    return [Renamed("test-plugin-other"), Renamed("torch-sdpa")]


replace = Renamed("torch-chunked", replaces_builtin=True)


def broken():
    raise RuntimeError("the plugin failed to start")
"""


@contextmanager
def installed_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, distribution: str, entry_points: dict[str, str]
) -> Iterator[None]:
    """An installed ``distribution`` ("name version": a real dist-info on sys.path under ``tmp_path``) with these
    ``attnkit.backends`` entry points, loaded by the registry's own code on the next registry call; the registry is
    restored afterwards."""
    name, version = distribution.split()
    dist_info = tmp_path / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{entry} = {target}\n" for entry, target in entry_points.items())
    (dist_info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{lines}")
    with registry._lock:
        backends, origins, refused = dict(registry._backends), dict(registry._origins), list(registry._refused)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_loaded", False)
    try:
        yield
    finally:
        with registry._lock:
            registry._backends.clear()
            registry._backends.update(backends)
            registry._origins.clear()
            registry._origins.update(origins)
            registry._refused[:] = refused
            dispatch.clear_cache()  # what was dispatched to the plugin's backends is forgotten


@pytest.fixture
def plugin_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The test plugin (PLUGIN_MODULE) installed with PLUGIN_ENTRY_POINTS."""
    (tmp_path / "attnkit_test_plugin.py").write_text(PLUGIN_MODULE)
    try:
        with installed_plugin(tmp_path, monkeypatch, PLUGIN_DISTRIBUTION, PLUGIN_ENTRY_POINTS):
            yield
    finally:
        sys.modules.pop("attnkit_test_plugin", None)


# ---------------------------------------------------------------------------------------------------------------
# Worker memory (issue 32): XLA's CPU compiler crashed once in a worker that had compiled thousands of programs. JAX
# keeps every compiled executable for the life of the process; they are dropped after each module, so a worker holds
# one module's programs at a time, and each worker's peak RSS is reported at the end of the run.


@pytest.fixture(autouse=True, scope="module")
def _jax_caches_per_module() -> Iterator[None]:
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its peak goes to the controller
        workeroutput["peak_rss_mib"] = _peak_rss_mib()


_WORKER_PEAKS: dict[str, float] = {}


def pytest_testnodedown(node: object, error: object) -> None:
    output = getattr(node, "workeroutput", {})
    if "peak_rss_mib" in output:
        gateway = getattr(node, "gateway", None)
        _WORKER_PEAKS[getattr(gateway, "id", f"worker {len(_WORKER_PEAKS)}")] = output["peak_rss_mib"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    peaks = _WORKER_PEAKS or {"this process": _peak_rss_mib()}
    terminalreporter.write_line(
        "peak RSS: " + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in sorted(peaks.items()))
    )
