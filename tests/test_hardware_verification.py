"""The "verified on hardware" table (attnkit.hardware): an entry for every backend and device, consistent with the
paths each backend refuses pending hardware, and shown by docs/backends.md and `attnkit info`."""

from __future__ import annotations

import pytest

import attnkit
from attnkit import registry
from attnkit.backend import ALLOW_UNVERIFIED_ENV, Capabilities, Framework, PendingHardware, Unverified, pending_hardware
from attnkit.capability_matrix import capability_markdown, info_report
from attnkit.hardware import HARDWARE_CHECKS, UNCOVERED_PATHS, verifications

#: What docs/gpu.md records, read by hand: (backend, device) -> the date of its last GPU run, None: never run.
RECORDED_GPU_RUNS = {
    ("cupy", "cuda"): "2026-11-27",
    ("jax-xla", "cuda"): "2026-11-27",
    ("pallas", "cuda"): "2026-11-27",
    ("torch-sdpa", "cuda"): "2026-11-27",
    ("triton", "cuda"): "2026-11-27",
    ("torch-chunked", "cuda"): "2026-11-22",
    ("torch-naive", "cuda"): "2026-11-22",
    ("flash-attn", "cuda"): None,
    ("jax-reference", "cuda"): None,
}


@pytest.fixture(scope="module")
def registered() -> dict[str, attnkit.Backend]:
    backends = registry.backends(load=True)
    missing = [name for name, b in backends.items() if isinstance(b, attnkit.MissingPackageBackend)]
    if missing:
        pytest.skip(f"capabilities of {missing} are unknown without their packages")
    return dict(backends)


def test_every_backend_and_declared_device_has_an_entry(registered: dict[str, attnkit.Backend]) -> None:
    rows = {(row.backend, row.device): row for row in verifications(registered)}
    for name, backend in registered.items():
        for device in backend.capabilities.devices:
            row = rows[(name, device)]
            if device == "cpu":
                assert row.by in ("CPU (CI)", "interpreted: not hardware"), row
                assert row.verified == (row.by == "CPU (CI)"), row
            else:
                date = RECORDED_GPU_RUNS[(name, device)]
                assert row.verified == (date is not None), row
                assert row.by.startswith(date) if date else row.by == "never run on hardware", row
    assert rows[("cupy-emulated", "cpu")].verified is False  # the CUDA C emulator is not hardware


def test_the_records_name_registered_backends_once_per_run(registered: dict[str, attnkit.Backend]) -> None:
    for check in HARDWARE_CHECKS:
        assert check.backend in registered, check
    keys = [(check.backend, check.device, check.run) for check in HARDWARE_CHECKS]
    assert len(keys) == len(set(keys))


def test_unverified_paths_are_refused_and_reported_as_such(
    registered: dict[str, attnkit.Backend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One source of truth: the table's refused paths are exactly each backend's Unverified entries, each refused
    on its device by pending_hardware, and no "not yet run" path repeats one."""
    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    rows = {(row.backend, row.device): row for row in verifications(registered)}
    declared_unverified = 0
    for name, backend in registered.items():
        for entry in backend.capabilities.unverified:
            declared_unverified += 1
            row = rows[(name, entry.device)]
            assert entry.path in row.refused and row.summary() != "yes", row
            (reason,) = pending_hardware(backend, entry.device, entry.path)
            assert isinstance(reason, PendingHardware) and entry.path in reason
        for (row_name, _), row in rows.items():
            if row_name == name:
                declared = {e.path for e in backend.capabilities.unverified if e.device == row.device}
                assert set(row.refused) == declared, row
    assert declared_unverified >= 6  # torch-sdpa 1, triton 3, cupy 2, pallas 2 as of 2026-12
    refused = {(row.backend, row.device, path) for row in rows.values() for path in row.refused}
    for uncovered in UNCOVERED_PATHS:
        assert (uncovered.backend, uncovered.device, uncovered.path) not in refused, uncovered
        assert uncovered.backend in registered, uncovered


class _Unrun(attnkit.BaseBackend):
    """A backend no hardware run has seen, with one path refused on CUDA."""

    name = "unrun"
    capabilities = Capabilities(
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float32"}),
        devices=frozenset({"cpu", "cuda"}),
        features=frozenset(),
        unverified=(Unverified("cuda", "the fused backward", "never run on a GPU"),),
    )


def test_the_markdown_and_info_show_the_column() -> None:
    markdown = capability_markdown({"unrun": _Unrun()})
    assert "## Verified on hardware" in markdown
    header = "| backend | device | verified on hardware | by | not verified on hardware | what ran |"
    assert header in markdown
    assert "| unrun | cpu | yes | CPU (CI) | - |" in markdown
    assert "| unrun | cuda | no | never run on hardware | refused: the fused backward |" in markdown
    assert "2026-11-27, NVIDIA H200: Python 3.12, torch 2.11.0+cu130" in markdown  # the runs, with versions


def test_info_shows_a_row_per_backend_and_device(registered: dict[str, attnkit.Backend]) -> None:
    report = info_report("0", width=None)
    section = report.split("verified on hardware (docs/gpu.md):", 1)[1].split("backends:", 1)[0]
    for row in verifications(registered):
        assert any(line.split()[:2] == [row.backend, row.device] for line in section.splitlines()), row
