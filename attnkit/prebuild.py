"""``attnkit build``: build now, once, what attnkit would otherwise compile at a first call (attnkit/build.py): the
torch frontend's C++ call signature and every backend's run-time builds (cpu-flash's kernel). Each is reported as
built (with its time), already built, or not buildable here with the reason (no compiler or ninja, a torch without
the BLAS it calls, an unusable cache directory); only a build that was tried and failed makes the command fail."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

from attnkit import notices, registry
from attnkit.backend import run_time_builds
from attnkit.build import TorchExtension
from attnkit.errors import BuildError

BUILT, ALREADY, CANNOT, FAILED = "built", "already built", "cannot be built here", "failed"


@dataclass(frozen=True)
class Outcome:
    label: str
    state: str  # BUILT, ALREADY, CANNOT or FAILED
    detail: str  # the library's path, or why not

    def __str__(self) -> str:
        return f"{self.label}: {self.state} ({self.detail})"


def planned() -> Iterator[tuple[TorchExtension, list[str]]]:
    """Every run-time build attnkit knows, with why it cannot be built here (empty: it can): the signature's, then
    each registered backend's (a backend unavailable here for another reason, e.g. a torch without sgemm, gives
    that reason)."""
    from attnkit.frontends import torch_compiled

    yield torch_compiled.EXTENSION, []
    for name in sorted(registry.backends()):
        backend = registry.get_backend(name)
        for extension in run_time_builds(backend):
            yield extension, backend.available()


def build(extension: TorchExtension, reasons: list[str]) -> Outcome:
    """Build ``extension`` unless it is built or ``reasons`` say it cannot be here."""
    if extension.built() and not reasons:
        return Outcome(extension.label, ALREADY, str(extension.library()))
    if reasons:
        return Outcome(extension.label, CANNOT, "; ".join(reasons))
    started = time.perf_counter()
    try:
        with notices.said_by_caller():  # prebuild prints "building ..." itself
            extension.load(build=True)
    except BuildError as error:
        return Outcome(extension.label, FAILED, str(error))
    return Outcome(extension.label, BUILT, f"{time.perf_counter() - started:.1f} s, {extension.library()}")


def prebuild(out: TextIO, errors: TextIO) -> int:
    """Build everything buildable here, saying what it starts and how each ends (a failure on ``errors``); 1 if a
    build failed, else 0."""
    failed = False
    for extension, reasons in planned():
        reasons = reasons or extension.problems()  # no compiler, no ninja, an unusable directory
        if not reasons and not extension.built():
            print(f"{extension.label}: building ...", file=out, flush=True)
        outcome = build(extension, reasons)
        failed = failed or outcome.state == FAILED
        print(outcome, file=errors if outcome.state == FAILED else out, flush=True)
    return 1 if failed else 0
