"""Code compiled at run time (cpu-flash's kernel, the torch call signature, the test suite's CUDA emulator): where a
build lives, its key, its lock, its time bound, and which built objects may be loaded. Independent of any backend.

* Each object lives in a directory of its own whose name carries a key: a hash of everything the object depends on
  (sources, flags, torch and Python versions; for a ``-march=native`` build the CPU's model and flags too, so a cache
  shared between machines never hands code built for one CPU to another).
* Builders of one object take an exclusive ``flock`` on ``<object>.lock`` beside it, waiting at most
  ``ATTNKIT_BUILD_TIMEOUT`` seconds. The kernel releases a flock when its holder dies; the holder writes its pid and
  host into the file and clears them on release, so a record found by the next holder names a builder that died:
  it is logged, and the dead builder's scratch directories are removed.
* Each attempt builds in a fresh private scratch directory (torch's own ``lock`` baton lives there, so a leftover one
  never blocks anyone) in a subprocess that ``ATTNKIT_BUILD_TIMEOUT`` bounds, output captured into ``<object>.log``;
  the result is moved into place with ``os.replace`` (atomic).
* An object is loaded only from a directory the current user owns and group and others cannot write, and only if
  the file is likewise; otherwise it is refused with the reason (never loaded).

Every failure is a :class:`~attnkit.errors.BuildError` whose message says what failed and, for a compile, the
compiler's first error lines.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

from attnkit import notices
from attnkit.errors import BuildError, ConfigError

_log = logging.getLogger("attnkit")

TIMEOUT_VARIABLE = "ATTNKIT_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0  # a cold kernel.cpp build takes ~16 s on 2 idle cores; several builders at once, more
CPUINFO = Path("/proc/cpuinfo")
# Fields of /proc/cpuinfo that say which instructions the CPU runs (x86, ARM, RISC-V), not its clock or core id.
CPU_FIELDS = frozenset(
    {"vendor_id", "cpu family", "model", "model name", "flags", "Features", "CPU implementer", "CPU architecture"}
    | {"CPU variant", "CPU part", "isa", "uarch"}
)
FIRST_ERROR_LINES = 5  # in one line (" | " between them): reasons are table cells in explain and `attnkit info`
_COMPILER_ERROR = re.compile(r"\berror\b:", re.IGNORECASE)  # gcc/clang: "file:line:col: error: ..."


def build_timeout() -> float:
    """Seconds one build, and one wait for another process's build of the same object, may take."""
    value = os.environ.get(TIMEOUT_VARIABLE)
    if value is None or value == "":
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"{TIMEOUT_VARIABLE}={value!r}: expected a positive number of seconds")
    return seconds


def cpu_description() -> str:
    """What a ``-march=native`` build was built for: the first CPU's model and feature flags from /proc/cpuinfo;
    elsewhere the machine, processor and host name (one build per host: safe, if less shared)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()} host {platform.node()}"
    first = text.strip().split("\n\n")[0]
    fields = (line.partition(":") for line in first.splitlines())
    return "\n".join(f"{name.strip()}: {value.strip()}" for name, _, value in fields if name.strip() in CPU_FIELDS)


def digest(*parts: str | bytes) -> str:
    hashed = hashlib.sha256()
    for part in parts:
        hashed.update(part if isinstance(part, bytes) else part.encode())
        hashed.update(b"\0")
    return hashed.hexdigest()[:16]


def ownership_problem(path: Path) -> str | None:
    """Why ``path`` may not be loaded from (someone other than the current user could have written it), or None."""
    info = path.stat()
    if info.st_uid != os.getuid():
        return f"{path} is owned by uid {info.st_uid}, not by the current user (uid {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.filemode(info.st_mode)})"
    return None


def _refused(path: Path) -> BuildError:
    return BuildError(f"refusing to load from {path}: {ownership_problem(path)}; remove it and it is rebuilt privately")


def directory_problem(directory: Path, variable: str) -> str | None:
    """Why a build directory could not be made at ``directory`` (its nearest existing ancestor is no writable
    directory), or why an existing one may not be loaded from; None when it is usable. Cheap: no file is written."""
    if directory.is_dir():
        refused = ownership_problem(directory)
        return f"{directory} may not be used: {refused}" if refused else None
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot create the build directory {directory} ({variable}): {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot create the build directory {directory} ({variable}): {existing} is not writable"
    return None


def private_directory(directory: Path) -> Path:
    """``directory``, created owner-only if missing; BuildError if it exists and someone else could write it."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        raise BuildError(f"cannot create the build directory {directory}: {error}") from None
    if ownership_problem(directory):
        raise _refused(directory)
    return directory


def first_error_lines(output: str) -> list[str]:
    """The compiler's first error lines in a build's output, else its last line (a Python builder's exception)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if _COMPILER_ERROR.search(line)]
    return (errors or lines[-1:])[:FIRST_ERROR_LINES]


@contextlib.contextmanager
def exclusive(lock_path: Path, what: str, timeout: float) -> Iterator[None]:
    """Hold the build lock of one object across processes and threads (each holder opens the file itself, so
    threads of one process exclude each other too), waiting at most ``timeout`` seconds."""
    import fcntl  # POSIX only: imported here, so that importing attnkit (which reads the signature) needs none

    descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + timeout
        pause = 0.02
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(descriptor, 200, 0).decode(errors="replace").strip() or "another process"
                    raise BuildError(
                        f"waited {timeout:g} s ({TIMEOUT_VARIABLE}) for the build lock of {what} ({lock_path}), "
                        f"held by {holder}"
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
        dead = os.pread(descriptor, 200, 0).decode(errors="replace").strip()
        if dead:
            _log.warning("attnkit: %s died while building %s; taking over its build lock %s", dead, what, lock_path)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(descriptor, 0)  # a clean release leaves no record: a record means its writer died
            fcntl.flock(descriptor, fcntl.LOCK_UN)
    finally:
        os.close(descriptor)


def run_bounded(command: Sequence[str], what: str, log: Path, timeout: float) -> None:
    """Run a build command in a session of its own, output into ``log``; past ``timeout`` seconds the whole session
    (compilers included) is killed. BuildError with the compiler's first error lines if it fails."""
    try:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    except OSError as error:
        raise BuildError(f"cannot build {what}: {command[0]}: {error}") from None
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(process.pid)
        try:
            output, _ = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process outside the session (a compiler server) holds the pipe open
            output = ""
        log.write_text(output)
        raise BuildError(
            f"building {what} took longer than {TIMEOUT_VARIABLE}={timeout:g} s (stopped; output: {log})"
        ) from None
    finally:
        if process.poll() is None:  # interrupted (KeyboardInterrupt): no compiler outlives its caller
            _kill_session(process.pid)
    log.write_text(output)
    if process.returncode != 0:
        lines = " | ".join(first_error_lines(output))
        raise BuildError(f"building {what} failed (exit status {process.returncode}; output: {log}): {lines}")


def _kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # every process of the session has ended already
        os.killpg(pid, signal.SIGKILL)


def cached(target: Path, what: str, make: Callable[[Path, Path], Path]) -> Path:
    """``target``, built first unless it is there: ``make(scratch, log)`` builds it in the fresh private directory
    ``scratch`` (its output into ``log``, beside the target) and returns the file, which then replaces ``target``
    atomically. One builder of ``target`` at a time (the lock); returned only if it may be loaded (module doc)."""
    directory = private_directory(target.parent)
    if not target.exists():
        try:
            with exclusive(target.with_name(target.name + ".lock"), what, build_timeout()):
                if not target.exists():
                    _build(target, directory, make)
        except OSError as error:
            raise BuildError(f"building {what} in {directory} failed: {error}") from None
    if ownership_problem(target):
        raise _refused(target)
    return target


def _build(target: Path, directory: Path, make: Callable[[Path, Path], Path]) -> None:
    prefix = f".{target.name}."
    for leftover in directory.glob(prefix + "*"):  # under the lock, so these are builders that died
        shutil.rmtree(leftover, ignore_errors=True)
    scratch = Path(tempfile.mkdtemp(prefix=prefix, dir=directory))
    try:
        os.replace(make(scratch, target.with_name(target.name + ".log")), target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# One script for every torch extension build: torch's own builder (ninja), in a subprocess that run_bounded can
# kill, whose process group dies with it if its parent is killed (kill -9 leaves no compiler running).
_TORCH_BUILDER = """
import json, os, sys, threading, time
job = json.loads(sys.argv[1])
def watch():
    while os.getppid() == job["parent"]:
        time.sleep(0.5)
    os.killpg(0, 9)
threading.Thread(target=watch, daemon=True).start()
from torch.utils.cpp_extension import load
load(job["name"], job["sources"], extra_cflags=job["cflags"], build_directory=job["directory"], verbose=True)
"""


def extensions_root() -> Path:
    """Where torch extensions are built: ``TORCH_EXTENSIONS_DIR``, else torch's per-user cache."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"


class TorchExtension:
    """A C++ source built into a torch extension module on demand: once per key on a machine, loaded once per
    process. A failed build or load is remembered for the process (:meth:`problems` then names it)."""

    def __init__(
        self, name: str, source: Path, cflags: Sequence[str], label: str = "", expected_s: float | None = None
    ) -> None:
        self.name = name
        self.source = source
        self.cflags = tuple(cflags)
        #: What the build notice calls it ("cpu-flash"), and about how long a build takes on a small machine.
        self.label = label or source.name
        self.expected_s = expected_s
        self.native = any(flag.endswith("=native") for flag in self.cflags)  # -march=native, -mcpu=native
        self._module: ModuleType | None = None
        self._failure: str | None = None
        self._building = threading.Lock()  # one builder per process; waited on with a bound, never forever

    def directory(self) -> Path:
        import torch

        identity: list[str | bytes] = [self.source.read_bytes(), *self.cflags, torch.__version__, sys.version]
        identity.append(platform.machine())
        if self.native:
            identity.append(cpu_description())
        return extensions_root() / f"{self.name}_{digest(*identity)}"

    def library(self) -> Path:
        directory = self.directory()
        return directory / f"{directory.name}.so"

    def problems(self) -> list[str]:
        """Why it cannot be loaded or built here (cheap checks, no build), or the failure of this process's build."""
        if self._module is not None:
            return []
        if self._failure is not None:
            return [self._failure]
        library = self.library()
        try:
            problem = directory_problem(library.parent, "TORCH_EXTENSIONS_DIR")
            if problem:
                return [problem]
            if library.exists():
                refused = ownership_problem(library)
                return [f"{library} may not be loaded: {refused}"] if refused else []
        except OSError as error:  # e.g. a parent directory this user may not enter
            return [f"cannot use the build directory {library.parent}: {error}"]
        compiler = os.environ.get("CXX", "c++")  # the compiler torch.utils.cpp_extension runs
        missing = [] if shutil.which(compiler) else [f"no C++ compiler to build {self.source.name} (CXX={compiler!r})"]
        if shutil.which("ninja") is None:
            missing.append(f"ninja, which torch.utils.cpp_extension builds {self.source.name} with, is not on PATH")
        return missing

    def built(self) -> bool:
        """Loaded in this process, or built on this machine (loading it then costs a file read, not a build)."""
        return self._module is not None or self.library().exists()

    def load(self, build: bool = True) -> ModuleType:
        """The module: loaded if built (and owner-only), else built first when ``build``; BuildError otherwise."""
        if self._module is not None:
            return self._module
        if self._failure is not None:
            raise BuildError(self._failure)
        library = self.library()
        if not build and not library.exists():
            raise BuildError(f"{self.source.name} is not built (it would live in {library.parent})")
        bound = 2 * build_timeout() + 60  # the holder's wait for another process's build, then its own build
        if not self._building.acquire(timeout=bound):
            raise BuildError(f"another thread has been building {self.source.name} for over {bound:g} s")
        try:
            if self._module is None and self._failure is None:
                problems = self.problems()  # a missing compiler or ninja, an unusable directory: no doomed build
                try:
                    if problems:
                        raise BuildError("; ".join(problems))
                    self._module = self._load(library)
                except BuildError as error:
                    self._failure = str(error)
            if self._module is None:
                raise BuildError(self._failure)
            return self._module
        finally:
            self._building.release()

    def _load(self, library: Path) -> ModuleType:
        cached(library, self.source.name, self._make)
        spec = importlib.util.spec_from_file_location(library.parent.name, library)
        if spec is None or spec.loader is None:
            raise BuildError(f"cannot load {library}")
        try:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except (ImportError, OSError) as error:
            raise BuildError(f"loading {library} failed: {error}") from None
        return module

    def announce(self) -> None:
        """Say, once per process, that it is being built (attnkit/notices.py): a build takes seconds to a minute."""
        expected = f", ~{self.expected_s:.0f} s" if self.expected_s else ""
        notices.once(f"build {self.name}", f"building {self.label} (once{expected}); later processes reuse it")

    def _make(self, scratch: Path, log: Path) -> Path:
        self.announce()
        name = scratch.parent.name
        job: dict[str, object] = {"name": name, "sources": [str(self.source)], "cflags": list(self.cflags)}
        # "parent": not the builder's own first getppid(), as its parent may be dead before it asks
        job |= {"directory": str(scratch), "parent": os.getpid()}
        run_bounded([sys.executable, "-c", _TORCH_BUILDER, json.dumps(job)], self.source.name, log, build_timeout())
        return scratch / f"{name}.so"
