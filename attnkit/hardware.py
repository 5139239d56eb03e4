"""Which backend paths have passed on real hardware, when and where: the data behind the "verified on hardware"
table of ``attnkit info`` and docs/backends.md.

Three sources, one fact each:

* a CPU path that runs natively is checked by the CI suite on every commit;
* a path run in an interpreter or emulator (Triton's interpreter, the CUDA C emulator, Pallas' interpret mode) is
  conformance-tested but is not hardware, whatever its device;
* a GPU path counts as verified only through :data:`HARDWARE_CHECKS`, the record of hand-run GPU checks
  (docs/gpu.md), less the paths the backend itself declares :class:`attnkit.backend.Unverified` (refused on that
  device until a hardware run passes them: read from the backend, never repeated here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from attnkit.backend import Backend, runs_interpreted

CI_DEVICE = "cpu"


@dataclass(frozen=True)
class HardwareRun:
    """One session of checks on a real accelerator: when, on what, with which versions, at which commit."""

    date: str  # ISO date, UTC
    device_name: str  # as torch.cuda.get_device_name() gives it
    versions: str
    commit: str

    def label(self) -> str:
        return f"{self.date}, {self.device_name}"


@dataclass(frozen=True)
class HardwareCheck:
    """What one backend ran on one device during a :class:`HardwareRun`, and what it showed."""

    backend: str
    device: str  # "cuda"
    run: HardwareRun
    ran: str


@dataclass(frozen=True)
class UncoveredPath:
    """A path a backend serves on a device without refusing it, added after its last hardware run: conformance-tested
    on the CPU only (interpreted or emulated), so not verified on hardware although the code is not refused.
    (Paths the backend refuses are its :class:`attnkit.backend.Unverified` entries, not listed here.)"""

    backend: str
    device: str
    path: str


H100_RUN = HardwareRun(
    date="2026-11-22",
    device_name="NVIDIA H100 80GB HBM3",
    versions="Python 3.12, torch 2.11.0+cu130, Triton 3.6.0, JAX 0.11.2 (CUDA 13 plugin), CuPy 14.2 (CUDA 13)",
    commit="531af8d",
)
H200_RUN = HardwareRun(
    date="2026-11-27",
    device_name="NVIDIA H200",
    versions="Python 3.12, torch 2.11.0+cu130, Triton 3.6.0, JAX 0.11.2 (CUDA 13 plugin), cupy-cuda13x 14.2.0",
    commit="e782468",
)

#: Every backend check made on a GPU, oldest run first (docs/gpu.md, "Hardware results").
HARDWARE_CHECKS: tuple[HardwareCheck, ...] = (
    HardwareCheck("cupy", "cuda", H100_RUN, "attnkit check: 58 cases OK; tests/test_cupy_backend.py: 20 passed"),
    HardwareCheck("jax-xla", "cuda", H100_RUN, "attnkit check: 56 cases OK"),
    HardwareCheck("pallas", "cuda", H100_RUN, "attnkit check: 36 cases OK (Pallas' Triton path, compiled)"),
    HardwareCheck("torch-chunked", "cuda", H100_RUN, "attnkit check, with torch-naive: 116 cases OK on CUDA tensors"),
    HardwareCheck("torch-naive", "cuda", H100_RUN, "attnkit check, with torch-chunked: 116 cases OK on CUDA tensors"),
    HardwareCheck("triton", "cuda", H100_RUN, "attnkit check: 58 cases OK (compiled)"),
    HardwareCheck("cupy", "cuda", H200_RUN, "attnkit check: 52 of 52 cases OK; tests/test_cupy_backend.py: 18 passed"),
    HardwareCheck("jax-xla", "cuda", H200_RUN, "attnkit check: 38 of 42 cases ran, none failed"),
    HardwareCheck(
        "pallas", "cuda", H200_RUN, "attnkit check: 43 of 44 cases OK; paged block size 1 refused (no longer declared)"
    ),
    HardwareCheck(
        "torch-sdpa", "cuda", H200_RUN, "attnkit check: float32 OK; float16/bfloat16 backward through lse failed"
    ),
    HardwareCheck("triton", "cuda", H200_RUN, "attnkit check: forward OK; float16/bfloat16 backward failed"),
)

#: Served on CUDA, not refused, and added after the last GPU run (docs/gpu.md, "Not yet run on a GPU").
UNCOVERED_PATHS: tuple[UncoveredPath, ...] = (
    UncoveredPath("cupy", "cuda", "ALiBi (alibi_slopes)"),
    UncoveredPath("pallas", "cuda", "ALiBi (alibi_slopes)"),
    UncoveredPath("triton", "cuda", "ALiBi (alibi_slopes)"),
    UncoveredPath("triton", "cuda", "the split-K decode's combine kernel"),
)


@dataclass(frozen=True)
class Verification:
    """Where one backend stands on one device: whether it is verified on hardware, by what, and what is not."""

    backend: str
    device: str
    verified: bool
    by: str  # "CPU (CI)", the last hardware run's date and device, or why there is none
    ran: str  # what that verification ran
    refused: tuple[str, ...]  # its Unverified paths on this device: refused until a hardware run passes them
    uncovered: tuple[str, ...]  # served, but never run on hardware

    def summary(self) -> str:
        """One cell: "no", "yes", or "partly" with the number of paths refused and not yet run there."""
        if not self.verified:
            return "no"
        counts = ((len(self.refused), "refused"), (len(self.uncovered), "not yet run"))
        gaps = [f"{count} path{'s' * (count > 1)} {what}" for count, what in counts if count]
        return f"partly: {', '.join(gaps)}" if gaps else "yes"

    def gaps(self) -> str:
        """The paths not verified on hardware here, by name: "refused: a, b; not yet run: c" ("-": none)."""
        parts = [
            f"{what}: {', '.join(paths)}"
            for what, paths in (("refused", self.refused), ("not yet run", self.uncovered))
            if paths
        ]
        return "; ".join(parts) or "-"


def last_check(backend: str, device: str) -> HardwareCheck | None:
    checks = [check for check in HARDWARE_CHECKS if check.backend == backend and check.device == device]
    return max(checks, key=lambda check: check.run.date) if checks else None


def verification(name: str, backend: Backend, device: str) -> Verification:
    """Where ``backend`` (registered as ``name``) stands on ``device``, from its declarations and the records above."""
    refused = tuple(entry.path for entry in backend.capabilities.unverified if entry.device == device)
    uncovered = tuple(path.path for path in UNCOVERED_PATHS if path.backend == name and path.device == device)
    if device == CI_DEVICE and runs_interpreted(backend, device):
        return Verification(
            name, device, False, "interpreted: not hardware", "the CI suite, interpreted", refused, uncovered
        )
    if device == CI_DEVICE:
        return Verification(name, device, True, "CPU (CI)", "the CI suite, on every commit", refused, uncovered)
    check = last_check(name, device)
    if check is None:
        return Verification(name, device, False, "never run on hardware", "-", refused, uncovered)
    return Verification(name, device, True, check.run.label(), check.ran, refused, uncovered)


def verifications(registered: Mapping[str, Backend]) -> list[Verification]:
    """One per registered backend and device it declares or has a hardware check on (triton declares the CPU under
    TRITON_INTERPRET=1 and CUDA otherwise: both are shown), in name then device order."""
    rows = []
    for name in sorted(registered):
        devices = set(registered[name].capabilities.devices)
        devices |= {check.device for check in HARDWARE_CHECKS if check.backend == name}
        rows += [verification(name, registered[name], device) for device in sorted(devices)]
    return rows
