"""Run-time builds (attnkit/build.py) under hostile conditions: a builder killed with kill -9, an unusable cache
directory, no ninja, a compiler that fails, a build directory others can write. Each ends, within a bounded time,
in the oracle's answer from another backend under ``auto`` and a BackendUnavailableError with the reason for
``backend="cpu-flash"``. None runs a full build of kernel.cpp (a minute on 2 cores): every build here fails.

Each test gives cpu-flash (and the signature) a fresh TorchExtension of the same source and flags, which is the
state a new process starts in, and a private TORCH_EXTENSIONS_DIR."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import pytest
import torch
from attnkit.backends.cpu_flash import backend as cpu_flash

import attnkit
from attnkit import AttentionSpec, BackendUnavailableError, ConfigError, build, cli, dispatch, notices
from attnkit.build import TorchExtension
from attnkit.errors import BuildError
from attnkit.frontends import torch_compiled, torch_frontend

# Softcap and a window: the shipped config routes this to cpu-flash first (SDPA cannot softcap).
SPEC = AttentionSpec(causal=True, window=(6, 0), softcap=20.0)
BOUND_S = 120  # ATTNKIT_BUILD_TIMEOUT in these tests: nothing here may wait longer

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which(os.environ.get("CXX", "c++")) is None,
    reason="needs Linux (fcntl, /proc) and a C++ compiler",
)
needs_ninja = pytest.mark.skipif(shutil.which("ninja") is None, reason="a build needs ninja on PATH to begin")


def fresh(extension: TorchExtension) -> TorchExtension:
    return TorchExtension(extension.name, extension.source, extension.cflags, extension.label, extension.expected_s)


@pytest.fixture
def extensions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A private extensions directory and fresh build state for cpu-flash and the signature; their root."""
    root = tmp_path / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.setenv(build.TIMEOUT_VARIABLE, str(BOUND_S))
    monkeypatch.setattr(cpu_flash, "EXTENSION", fresh(cpu_flash.EXTENSION))
    monkeypatch.setattr(torch_compiled, "EXTENSION", fresh(torch_compiled.EXTENSION))
    monkeypatch.setattr(torch_frontend, "signature_in_use", torch_frontend.signature_in_use)
    dispatch.clear_cache()
    yield root
    monkeypatch.undo()
    dispatch.clear_cache()


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(14)
    return tuple(torch.randn(1, 2, 24, 16, generator=generator) for _ in range(3))  # type: ignore[return-value]


def assert_auto_falls_back(reason: str) -> None:
    """auto answers as the float64 oracle does, without cpu-flash; explain and `attnkit info` give ``reason``;
    a call naming cpu-flash raises it. Within BOUND_S: a hang fails the test instead of stalling the suite."""

    def check() -> None:
        q, k, v = inputs()
        out = attnkit.attend(SPEC, q, k, v)
        expected = attnkit.attend(SPEC, q.double(), k.double(), v.double(), backend="torch-naive")
        assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-6)
        row = next(line for line in attnkit.explain(SPEC, q, k, v).splitlines() if "cpu-flash" in line)
        assert not row.startswith("->") and reason in row, row
        with pytest.raises(BackendUnavailableError, match="cpu-flash") as raised:
            attnkit.attend(SPEC, q, k, v, backend="cpu-flash")
        assert reason in str(raised.value)
        info = run_cli("info", "--wide")
        assert reason in next(line for line in info.splitlines() if line.startswith("cpu-flash")), info

    failures: list[BaseException] = []

    def run() -> None:
        try:
            check()
        except BaseException as error:  # handed to the test's thread
            failures.append(error)

    checker = threading.Thread(target=run, daemon=True)
    checker.start()
    checker.join(BOUND_S)
    assert not checker.is_alive(), f"auto gave no answer within {BOUND_S} s"
    if failures:
        raise failures[0]


def run_cli(*argv: str) -> str:
    out = StringIO()
    assert cli.run_info(cli.build_parser()[0].parse_args(list(argv)), out) == 0
    return out.getvalue()


@pytest.fixture
def failing_compiler(tmp_path: Path) -> Path:
    """A CXX that prints a compiler's error line and exits 1 when asked to compile, and answers torch's version
    checks as the real compiler does."""
    real = shutil.which(os.environ.get("CXX", "c++"))
    failing = tmp_path / "failing-c++"
    failing.write_text(
        '#!/bin/sh\ncase " $* " in *" -c "*) echo "kernel.cpp:1:1: error: injected" >&2; exit 1;; esac\n'
        f'exec {real} "$@"\n'
    )
    failing.chmod(0o755)
    return failing


@needs_ninja
def test_a_killed_build_is_taken_over_and_a_failing_compiler_falls_back(
    extensions: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failing_compiler: Path
) -> None:
    """kill -9 a process while it builds kernel.cpp (torch's baton file in place). The next call takes the build
    lock over with a log line naming the dead process, removes its scratch directory and runs a build of its own
    up to the compiler, which fails (injected: a full build takes a minute): auto answers that call with another
    backend, a call naming cpu-flash gets the compiler's error line. No compiler outlives the killed builder."""
    builder = subprocess.Popen(
        [sys.executable, "-c", "from attnkit.backends.cpu_flash.backend import EXTENSION; EXTENSION.load()"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + BOUND_S
        while not list(extensions.glob("attnkit_cpu_flash_*/.*/lock")):  # torch's baton: its build has begun
            assert builder.poll() is None and time.monotonic() < deadline, "the build never started"
            time.sleep(0.1)
        os.kill(builder.pid, signal.SIGKILL)
    finally:
        builder.kill()
        builder.wait(timeout=30)

    monkeypatch.setenv("CXX", str(failing_compiler))
    assert_auto_falls_back("kernel.cpp:1:1: error: injected")
    assert f"pid {builder.pid} on " in caplog.text and "died while building kernel.cpp" in caplog.text
    assert not list(extensions.glob("attnkit_cpu_flash_*/.*/lock")), "the dead builder's scratch directory stays"
    deadline = time.monotonic() + 10
    while (survivors := _processes_mentioning(str(extensions))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not survivors, f"build processes outlived the killed builder: {survivors}"


def test_a_build_past_its_timeout_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    """The time bound: the builder and every process it started (a compiler, here a sleep) are killed."""
    started_pid = tmp_path / "started"
    command = ["sh", "-c", f"sleep 60 & echo $! > {started_pid}; wait"]
    started = time.monotonic()
    with pytest.raises(BuildError, match="building a stuck build took longer than ATTNKIT_BUILD_TIMEOUT=0.5 s"):
        build.run_bounded(command, "a stuck build", tmp_path / "build.log", 0.5)
    assert time.monotonic() - started < 10
    stat_file = Path(f"/proc/{started_pid.read_text().strip()}/stat")
    deadline = time.monotonic() + 10
    while stat_file.exists() and stat_file.read_text().split()[2] != "Z" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not stat_file.exists() or stat_file.read_text().split()[2] == "Z", "the started process still runs"


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command:
            found.append(command[:200])
    return found


def test_an_unusable_cache_directory_falls_back(extensions: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_EXTENSIONS_DIR under a regular file (unwritable even for root): cpu-flash is unavailable up front."""
    blocker = extensions.parent / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(blocker / "extensions"))
    assert_auto_falls_back(f"{blocker} is not a directory")


def test_no_ninja_falls_back_and_attnkit_build_says_why(
    extensions: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PATH with the compiler but without ninja: cpu-flash unavailable up front; `attnkit build` says why nothing
    can be built here, and exits 0 (nothing failed), with no traceback."""
    tools = tmp_path / "bin"
    tools.mkdir()
    compiler = os.environ.get("CXX", "c++")
    (tools / Path(compiler).name).symlink_to(shutil.which(compiler) or compiler)
    monkeypatch.setenv("PATH", str(tools))
    assert_auto_falls_back("ninja, which torch.utils.cpp_extension builds kernel.cpp with, is not on PATH")
    capsys.readouterr()
    assert cli.main(["build"]) == 0
    said = capsys.readouterr()
    lines = said.out.splitlines()
    for label, source in (("the compiled call signature", "torch_signature.cpp"), ("cpu-flash", "kernel.cpp")):
        line = next(line for line in lines if line.startswith(f"{label}: cannot be built here ("))
        assert f"ninja, which torch.utils.cpp_extension builds {source} with, is not on PATH" in line, said.out
    assert "Traceback" not in said.err and "building" not in said.out


def test_attnkit_build_builds_what_is_missing_once(
    extensions: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`attnkit build` builds the signature and cpu-flash's kernel, then finds both built; a build that fails makes
    it exit 1. The builder is a stand-in that compiles an empty Python module of the extension's name (a second,
    not the minute of kernel.cpp)."""
    launched = []

    def compile_empty_module(command: list[str], what: str, log: Path, timeout: float) -> None:
        job = json.loads(command[-1])
        launched.append(job["name"])
        source = tmp_path / f"{job['name']}.c"
        source.write_text(
            "#include <Python.h>\n"
            f'static struct PyModuleDef m = {{PyModuleDef_HEAD_INIT, "{job["name"]}", 0, -1, 0}};\n'
            f"PyMODINIT_FUNC PyInit_{job['name']}(void) {{ return PyModule_Create(&m); }}\n"
        )
        library = Path(job["directory"]) / f"{job['name']}.so"
        include = sysconfig.get_paths()["include"]
        subprocess.run(["cc", "-shared", "-fPIC", f"-I{include}", str(source), "-o", str(library)], check=True)

    monkeypatch.setattr(build, "run_bounded", compile_empty_module)
    monkeypatch.setattr(cpu_flash, "_blas_reason", lambda: None)
    notices.forget()
    monkeypatch.delenv("ATTNKIT_LOG", raising=False)  # logging unconfigured, where a first use's build prints
    monkeypatch.setattr(logging.getLogger("attnkit"), "handlers", [])
    monkeypatch.setattr(logging.root, "handlers", [])
    assert cli.main(["build"]) == 0
    first, said = capsys.readouterr()
    assert len(launched) == 2, first
    assert "attnkit: building" not in said  # the command's own lines say it, not the first-use notice
    for label in ("the compiled call signature", "cpu-flash"):
        assert f"{label}: building ..." in first and f"{label}: built (" in first, first
    assert cli.main(["build"]) == 0
    again = capsys.readouterr().out
    assert len(launched) == 2 and again.count(": already built (") == 2, again

    def fail(command: list[str], what: str, log: Path, timeout: float) -> None:
        raise BuildError(f"building {what} failed (exit status 1; output: {log}): kernel.cpp:1:1: error: injected")

    monkeypatch.setattr(build, "run_bounded", fail)
    monkeypatch.setattr(cpu_flash, "EXTENSION", fresh(cpu_flash.EXTENSION))
    shutil.rmtree(cpu_flash.EXTENSION.directory())
    assert cli.main(["build"]) == 1
    said = capsys.readouterr()
    assert "cpu-flash: failed (" in said.err and "error: injected" in said.err, said.err
    assert "the compiled call signature: already built (" in said.out, said.out


@pytest.fixture(scope="module")
def marking_library(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a shared library whose loading creates a marker file, the marker's path)."""
    directory = tmp_path_factory.mktemp("marking")
    marker = directory / "loaded"
    source = directory / "marking.cpp"
    source.write_text(
        textwrap.dedent(f"""
        #include <cstdio>
        __attribute__((constructor)) static void loaded() {{ std::fclose(std::fopen("{marker}", "w")); }}
        """)
    )
    library = directory / "marking.so"
    compiler = os.environ.get("CXX", "c++")
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)], check=True, timeout=BOUND_S)
    return library, marker


@pytest.mark.parametrize("writable", ["directory", "file"])
def test_an_object_others_can_write_is_never_loaded(
    extensions: Path, marking_library: tuple[Path, Path], writable: str
) -> None:
    """A built object planted where group or others can write (its directory, or the file): neither the signature
    (loaded at `import attnkit`) nor cpu-flash loads it; each says why. Once private, the same file is loaded."""
    library, marker = marking_library
    planted = []
    for extension in (torch_compiled.EXTENSION, cpu_flash.EXTENSION):
        target = extension.library()
        target.parent.mkdir(parents=True)
        shutil.copyfile(library, target)
        (target.parent if writable == "directory" else target).chmod(0o777)
        planted.append(target)
    marker.unlink(missing_ok=True)

    in_use = torch_frontend.use_compiled_signature()  # what `import attnkit` runs
    assert in_use.startswith("python (") and "writable by group or others" in in_use, in_use
    assert f"torch call signature (attend's cache key): {in_use}" in run_cli("info", "--wide")
    assert_auto_falls_back("writable by group or others")
    assert not marker.exists(), "a planted object was loaded"

    for target in planted:  # the same files, made private: now loaded (so the marker above could have appeared)
        target.parent.chmod(0o700)
        target.chmod(0o755)
    with pytest.raises(BuildError, match="loading .* failed"):
        fresh(torch_compiled.EXTENSION).load(build=False)
    assert marker.exists()


def test_the_key_of_a_native_build_follows_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu-flash (-march=native) gets another directory on another CPU model or instruction set, the same one when
    only clock, core or bogomips differ; the signature (no -march=native) keeps its directory."""
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(build, "CPUINFO", cpuinfo)

    def directories(model: str, flags: str, mhz: str) -> tuple[Path, Path]:
        blocks = [
            f"processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: {model}\ncpu MHz\t\t: {mhz}\n"
            f"flags\t\t: {flags}\nbogomips\t: {float(mhz) * 2}\n"
            for n in range(2)
        ]
        cpuinfo.write_text("\n".join(blocks))
        return cpu_flash.EXTENSION.directory(), torch_compiled.EXTENSION.directory()

    base = directories("Xeon A", "fpu sse2 avx2", "2000.0")
    assert directories("Xeon A", "fpu sse2 avx2", "3100.5") == base
    for other in (directories("Xeon B", "fpu sse2 avx2", "2000.0"), directories("Xeon A", "fpu sse2", "2000.0")):
        assert other[0] != base[0] and other[1] == base[1]
    monkeypatch.undo()
    assert "flags" in build.cpu_description() or "Features" in build.cpu_description()  # this machine's CPU is read


def test_a_held_build_lock_is_waited_for_with_a_bound(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another holder (a thread here; processes alike): the wait ends after the timeout with the holder named; a
    clean release leaves no record, so the next holder logs no takeover."""
    lock = tmp_path / "object.lock"
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with build.exclusive(lock, "an object", 5):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    started = time.monotonic()
    with pytest.raises(BuildError, match=f"held by pid {os.getpid()} on "):
        with build.exclusive(lock, "an object", 0.3):
            pass
    assert time.monotonic() - started < 5
    release.set()
    holder.join(30)
    with build.exclusive(lock, "an object", 5):
        pass
    assert "died while building" not in caplog.text


@pytest.mark.parametrize("value", ["soon", "0", "-5", "inf", "nan"])
def test_a_bad_build_timeout_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(build.TIMEOUT_VARIABLE, value)
    with pytest.raises(ConfigError, match=f"ATTNKIT_BUILD_TIMEOUT={value!r}: expected a positive number of seconds"):
        build.build_timeout()


def test_the_first_error_lines_of_a_build_are_the_compilers() -> None:
    """The compiler's error lines, not ninja's or torch's; without any, the builder's exception (its last line)."""
    output = "[1/2] c++ -c kernel.cpp\nFAILED: kernel.o\nkernel.cpp:3:5: error: 'x' was not declared\n" + (
        "RuntimeError: Error building extension 'attnkit_cpu_flash'\n"
    )
    assert build.first_error_lines(output) == ["kernel.cpp:3:5: error: 'x' was not declared"]
    assert build.first_error_lines("Traceback:\n  in load\nCalledProcessError: exit status 1\n") == [
        "CalledProcessError: exit status 1"
    ]
