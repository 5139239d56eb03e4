"""The first thing to run on a GPU machine: every CUDA backend's conformance check, the GPU-only tests and the
kernel benches, in one command that fits 6 minutes on one H100/H200, ending in one JSON and one Markdown table.

    scripts/gpu_check.sh                  # the usual way: installs .whl/ and attnkit, then runs this driver
    python scripts/gpu_check.py --dry-run # the plan, the commands and their time limits; runs nothing
    python scripts/gpu_check.py --device cpu --backends torch-sdpa --examples 1   # the whole pipeline on a CPU

Steps (docs/gpu.md): versions and ``attnkit info``; ``attnkit check`` of every backend that declares CUDA, each in
its own process, all at once, next to the GPU-only tests (pytest); then ``attnkit bench --backend NAME --device cuda``
of the kernel backends, one at a time (a bench must have the GPU to itself), against torch SDPA pinned to cuDNN and
to its flash kernel. A step that fails or times out never stops the others; the exit status is 1 if any did.
Every check runs with ``ATTNKIT_ALLOW_UNVERIFIED=1``: this run is what verifies the paths refused on CUDA until a
GPU run passes them.

The check runs in a worker of this script (``--check-worker NAME``) that does what ``attnkit check --backend NAME``
does, prints the same report, and also writes the report as JSON, so the summary needs no parsing of the text.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

REPO = Path(__file__).resolve().parent.parent
SCHEMA = 1
#: The whole run, from the .sh's start (GPU_CHECK_STARTED): a 6-minute budget on a bare machine.
BUDGET_S = 360.0
#: Kept back at the end for writing the summary, so a slow step never eats the report.
RESERVE_S = 10.0
ALLOW_UNVERIFIED_ENV = "ATTNKIT_ALLOW_UNVERIFIED"
#: Backends a CUDA machine of the project's image must run; one of them unavailable there is a failure. Others that
#: declare CUDA (flash-attn, the reference backends) are checked when available and listed otherwise. torch-flex
#: declares the CPU only ("cuda: not lowered yet"), so a GPU run has nothing of it to check.
EXPECTED_CUDA = ("cupy", "jax-xla", "pallas", "torch-sdpa", "triton")
#: Timed against SDPA pinned to cuDNN and to its flash kernel, in the same process.
BENCH_BACKENDS = ("triton", "cupy", "pallas", "torch-sdpa")
BENCH_PEERS = ("sdpa-cudnn", "sdpa-flash")
#: bf16: prefill B=2 H=16 L=8192 D=128 (causal and not; the FA2 paper's shape at that L) and decode B=1 H=32
#: Lq=1 Lk=8192 D=128 (forward only: the bench times no backward where Lq == 1).
BENCH_SHAPES = ("2x16x8192x8192x128", "1x32x1x8192x128")
CPU_BENCH_SHAPES = ("1x2x128x128x64", "1x2x1x128x64")
#: The tests that need a GPU to do more than skip (grep tests/ for cuda.is_available and available_backends).
GPU_TESTS = (
    # With cupy's mask-program and dropout cases, unverified on hardware until they pass.
    "tests/test_cupy_backend.py",
    # Each CUDA backend's dropout keep-mask bit for bit against the reference, on a key tile edge and off one
    # (unverified on hardware in triton, cupy and pallas until it passes there).
    "tests/test_dropout.py::test_backend_keep_mask_is_the_references",
    "tests/test_triton_warp_specialized.py",
    "tests/test_cuda_routing.py",
    # Mask programs in the compiled triton kernels (unverified on hardware until these pass): the document-causal
    # case forward and backward, and the generated helper for every operation.
    "tests/test_triton_programs.py::test_document_causal_agrees_with_the_oracle",
    "tests/test_triton_programs.py::test_the_generated_helper_agrees_with_the_contract",
    # Dropout in the compiled triton kernels (unverified on hardware until these pass): the generator's known answers
    # and the keep step.
    "tests/test_dropout.py::test_triton_generator_gives_known_answers",
    "tests/test_dropout.py::test_triton_keep_step_is_the_references",
    "tests/test_cupy_static.py",
    "tests/test_conformance.py::test_harness_runs_a_backend_on_the_gpu_where_it_declares_one",
    "tests/test_pallas.py::test_mask_programs_on_the_gpu",
    # Dropout in the pallas kernels (unverified on hardware until it passes): out, lse and the gradients.
    "tests/test_pallas.py::test_dropout_on_the_gpu",
)


@dataclass(frozen=True)
class Budget:
    """Seconds per step. The checks and the tests run side by side; the benches one after another, sharing what is
    left (each at most ``bench_each_s``)."""

    versions_s: float = 45.0
    info_s: float = 45.0
    checks_s: float = 150.0
    tests_s: float = 150.0
    bench_each_s: float = 45.0
    examples: int = 12
    repeats: int = 5
    warmup: int = 2


# ------------------------------------------------------------------------------------------------ running steps


@dataclass
class Step:
    """One child process: its command, time limit, log, and how it ended."""

    name: str
    command: list[str]
    timeout_s: float
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    rc: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    handle: IO[bytes] | None = None

    def start(self) -> None:
        self.handle = self.log.open("wb")
        self.started = time.monotonic()
        # A session of its own: a timeout ends the whole tree (pytest workers, compilers), and only it.
        self.process = subprocess.Popen(
            self.command,
            cwd=REPO,
            stdout=self.handle,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )

    def poll(self) -> bool:
        """True once finished (killed at its time limit)."""
        assert self.process is not None and self.handle is not None
        if self.rc is not None:
            return True
        rc = self.process.poll()
        if rc is None and time.monotonic() - self.started > self.timeout_s:
            self.timed_out = True
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(self.process.pid, signal.SIGKILL)
            rc = self.process.wait()
        if rc is None:
            return False
        self.rc, self.seconds = rc, time.monotonic() - self.started
        self.handle.close()
        return True

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "command": shlex.join(self.command),
            "rc": self.rc,
            "timed_out": self.timed_out,
            "seconds": round(self.seconds, 1),
            "timeout_s": round(self.timeout_s, 1),
        }


class Runner:
    """Starts steps, waits for them under the run's deadline, and prints each start and end with the elapsed time."""

    def __init__(self, started: float, budget_s: float, work: Path, out: TextIO) -> None:
        self.started, self.deadline, self.work, self.out = started, started + budget_s, work, out
        self.steps: list[Step] = []

    def elapsed(self) -> float:
        return time.time() - self.started

    def say(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {message}", file=self.out, flush=True)

    def left(self) -> float:
        return self.deadline - RESERVE_S - time.time()

    def step(self, name: str, command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> Step:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        step = Step(name, command, max(1.0, min(timeout_s, self.left())), self.work / f"{safe}.log", env or {})
        self.steps.append(step)
        return step

    def run(self, steps: Sequence[Step]) -> None:
        """Starts ``steps`` together and waits for all of them."""
        for step in steps:
            self.say(f"start {step.name} (limit {step.timeout_s:.0f}s): {shlex.join(step.command)}")
            step.start()
        waiting = list(steps)
        while waiting:
            for step in list(waiting):
                if step.poll():
                    waiting.remove(step)
                    how = "TIMED OUT" if step.timed_out else f"rc={step.rc}"
                    self.say(f"end   {step.name}: {how} after {step.seconds:.1f}s")
            if waiting:
                time.sleep(0.2)


# ------------------------------------------------------------------------------------------------ the child steps

VERSIONS_CODE = r"""
import importlib.metadata as metadata, json, platform, sys
found = {"python": platform.python_version(), "executable": sys.executable}
for name in ("torch", "triton", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
             "cupy-cuda13x", "cupy-cuda12x", "flash-attn", "numpy", "hypothesis", "pydantic", "pydantic-core",
             "typing-extensions", "tomli-w", "attnkit"):
    try:
        found[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
try:
    import torch
    found["torch_cuda"] = torch.version.cuda
    found["torch_cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        found["torch_gpu"] = torch.cuda.get_device_name()
        found["torch_capability"] = "sm_%d%d" % torch.cuda.get_device_capability()
        found["cudnn"] = torch.backends.cudnn.version()
except Exception as error:
    found["torch_error"] = repr(error)
try:
    import jax
    found["jax_devices"] = [str(device) for device in jax.devices()]
except Exception as error:
    found["jax_error"] = repr(error)
try:
    import cupy
    found["cupy_cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
except Exception as error:
    found["cupy_error"] = repr(error)
print("VERSIONS " + json.dumps(found))
"""

BACKENDS_CODE = r"""
import json
from attnkit import registry
from attnkit.environment import interpret_triton_without_gpu
from attnkit.testing.runners import harness_device
interpret_triton_without_gpu()
found = []
for name, backend in sorted(registry.backends().items()):
    reasons = list(backend.available())
    entry = {"name": name, "devices": sorted(backend.capabilities.devices), "unavailable": reasons}
    if not reasons:
        try:
            entry["harness_device"] = harness_device(name)
        except Exception as error:
            entry["harness_device"] = None
            entry["unavailable"] = ["harness_device: %r" % (error,)]
    found.append(entry)
print("BACKENDS " + json.dumps(found))
"""


def child_env(device: str) -> dict[str, str]:
    """What every child runs with: the unverified CUDA paths on; JAX not taking 75% of the GPU at its first array
    (checks run side by side); output unbuffered so a killed step still leaves its log; no GPU on a CPU run."""
    env = {
        ALLOW_UNVERIFIED_ENV: "1",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    if device == "cpu":
        env |= {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
    return env


def attnkit_command(*args: str) -> list[str]:
    """``attnkit ARGS`` through this interpreter (the console script may not be on PATH of a bare image)."""
    return [sys.executable, "-m", "attnkit.cli", *args]


def marked_json(text: str, marker: str) -> Any:
    """The JSON after the last ``marker`` line of a child's output, or None."""
    for line in reversed(text.splitlines()):
        if line.startswith(marker + " "):
            return json.loads(line[len(marker) + 1 :])
    return None


def nvidia_smi() -> dict[str, Any]:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": repr(error)}
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip()}
    name, driver, memory = ([part.strip() for part in done.stdout.splitlines()[0].split(",")] + ["", "", ""])[:3]
    return {"gpu": name, "driver": driver, "memory": memory}


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


# ------------------------------------------------------------------------------------------------ the check worker


def _number(value: float | None) -> float | str | None:
    """JSON has no infinity: a case that raised has ratio "inf"."""
    if value is None:
        return None
    return "inf" if math.isinf(value) else round(float(value), 4)


def check_worker(name: str, examples: int, profile: str, seed: int, report_path: Path) -> int:
    """``attnkit check --backend NAME``, its report also written as JSON to ``report_path``."""
    from attnkit.cli import CHECK_NEEDS
    from attnkit.environment import interpret_triton_without_gpu, torch_threads

    interpret_triton_without_gpu()
    for _, module in CHECK_NEEDS:
        __import__(module)
    from attnkit.testing import check
    from attnkit.testing.runners import harness_device

    selected = check.backends_to_check([name], sys.stdout)
    if selected is None:
        return 2
    count = check.examples_per_backend(examples, profile)
    print(f"checking {name}: {count} drawn cases (seed {seed}) + edge cases", flush=True)
    with torch_threads(1):  # as run_check: tiny cases, and other checks run beside this one
        report = check.check_one_backend(selected[0], count, profile, seed, sys.stdout, len(name) + 1)
    status = check.print_summary([report], sys.stdout)
    columns = [check.PLAIN, *check.FEATURE_ORDER, check.VARLEN, *check.CHECK_DTYPES]
    pending = getattr(report, "pending", [])  # the main branch's PendingHardware refusals, where present
    record = {
        "backend": name,
        "device": harness_device(name) if not report.unavailable else None,
        "status": status,
        "unavailable": list(report.unavailable),
        "cases": len(report.outcomes),
        "failed": len(report.failures),
        "pending": len(pending),
        "skipped": [[label, list(reasons)] for label, reasons in report.skipped],
        "check_seconds": round(report.seconds, 1),  # the cases alone; the step's "seconds" include the imports
        "worst_ratio": _number(max((o.worst_ratio for o in report.outcomes), default=None)),
        "worst_by_column": {
            str(getattr(column, "value", column)): _number(report.worst(column))
            for column in columns
            if report.worst(column) is not None
        },
        "failures": check.failure_details([report]),
        "failed_labels": [outcome.label for outcome in report.failures],
    }
    report_path.write_text(json.dumps(record, indent=1) + "\n")
    return status


#: The progress line `attnkit check` prints every 10 s off a terminal: ``name [done/total]  (k failing)``.
PROGRESS = re.compile(r"^(?P<name>\S+)\s+\[(?P<done>\d+)/(?P<total>\d+)\](?:\s+\((?P<failing>\d+) failing\))?")


def partial_check(text: str) -> dict[str, Any]:
    """What a check killed at its time limit had done: its last progress line."""
    for line in reversed(text.splitlines()):
        match = PROGRESS.match(line.strip())
        if match:
            return {
                "done": int(match["done"]),
                "total": int(match["total"]),
                "failing": int(match["failing"] or 0),
            }
    return {}


# ------------------------------------------------------------------------------------------------ pytest


def junit_results(path: Path) -> dict[str, Any]:
    """Counts and failures from pytest's --junitxml report."""
    if not path.exists():
        return {"error": "no junit report (pytest did not finish)"}
    root = ElementTree.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skips = [], {}
    for case in root.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        children = {child.tag: child for child in case}
        if "failure" in children or "error" in children:
            kind = "failed" if "failure" in children else "errors"
            counts[kind] += 1
            message = children.get("failure", children.get("error"))
            failures.append({"test": test, "message": (message.get("message") or "")[:500]})
        elif "skipped" in children:
            counts["skipped"] += 1
            reason = (children["skipped"].get("message") or "")[:200]
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures, "skip_reasons": skips}


# ------------------------------------------------------------------------------------------------ the run


def plan(args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    """The steps and their limits, as --dry-run prints them."""
    device = args.device
    examples = args.examples if args.examples is not None else (budget.examples if device == "cuda" else 1)
    shapes = BENCH_SHAPES if device == "cuda" else CPU_BENCH_SHAPES
    bench = [bench_command(name, device, shapes, budget) for name in args.bench or BENCH_BACKENDS]
    return {
        "device": device,
        "budget_s": args.budget_s,
        "env": child_env(device),
        "steps": [
            {"step": "versions", "limit_s": budget.versions_s, "command": "python -c <versions> ; nvidia-smi"},
            {"step": "info", "limit_s": budget.info_s, "command": shlex.join(attnkit_command("info"))},
            {
                "step": "checks (in parallel, with the tests)",
                "limit_s": budget.checks_s,
                "backends": list(args.backends or ("every available backend that declares " + device,)),
                "command": shlex.join(check_command("NAME", examples, args.seed, Path("REPORT.json"))),
                "equivalent": f"attnkit check --backend NAME --examples {examples} --seed {args.seed}",
            },
            {
                "step": "tests",
                "limit_s": budget.tests_s,
                "command": shlex.join(test_command(Path("junit.xml"), device, args.tests or GPU_TESTS)),
            },
            {
                "step": "bench (one at a time)",
                "limit_s": f"{budget.bench_each_s} each, within what is left",
                "commands": [shlex.join(command) for command in bench],
            },
        ],
    }


def check_command(name: str, examples: int, seed: int, report: Path) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--check-worker",
        name,
        "--examples",
        str(examples),
        "--seed",
        str(seed),
        "--report",
        str(report),
    ]


def test_command(junit: Path, device: str = "cuda", tests: Sequence[str] = GPU_TESTS) -> list[str]:
    """pytest on the GPU tests, with the repo's xdist workers on a GPU machine (16 cores), serially on a CPU run."""
    workers = ["-n", "0"] if device == "cpu" else []
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, f"--junitxml={junit}", *tests]


def bench_command(
    name: str, device: str, shapes: Sequence[str], budget: Budget, json_path: str = "BENCH.json"
) -> list[str]:
    shape_flags = [flag for shape in shapes for flag in ("--shape", shape)]
    return attnkit_command(
        "bench",
        "--backend",
        name,
        "--device",
        device,
        "--dtype",
        "bfloat16",
        "--peer",
        ",".join(BENCH_PEERS if device == "cuda" else ("sdpa",)),
        *shape_flags,
        "--passes",
        "fwd,fwd+bwd",
        "--repeats",
        str(budget.repeats),
        "--warmup",
        str(budget.warmup),
        "--json",
        json_path,
    )


def run(args: argparse.Namespace, budget: Budget, out: TextIO) -> dict[str, Any]:
    started = float(os.environ.get("GPU_CHECK_STARTED") or time.time())
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    runner = Runner(started, args.budget_s, work, out)
    env = child_env(args.device)
    runner.say(f"gpu_check: device {args.device}, budget {args.budget_s:.0f}s, work files in {work}")
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git("rev-parse", "--short=7", "HEAD"),
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "device": args.device,
        "budget_s": args.budget_s,
        "env": env,
    }

    # 1. versions, the GPU, attnkit info and the backends (side by side: each only reads)
    versions = runner.step("versions", [sys.executable, "-c", VERSIONS_CODE], budget.versions_s, env)
    info = runner.step("info", attnkit_command("info"), budget.info_s, env)
    listing = runner.step("backends", [sys.executable, "-c", BACKENDS_CODE], budget.info_s, env)
    runner.run([versions, info, listing])
    record["versions"] = marked_json(versions.text(), "VERSIONS") or {"error": versions.text()[-2000:]}
    record["nvidia_smi"] = nvidia_smi() if args.device == "cuda" else {}
    record["info"] = info.text()
    backends = marked_json(listing.text(), "BACKENDS") or []
    record["backends"] = backends
    for key, value in record["versions"].items():
        runner.say(f"  {key}: {value}")
    runner.say(f"  nvidia-smi: {record['nvidia_smi']}")
    print(record["info"], file=out)

    # 2. checks of every backend that runs on this device, each its own process, beside the GPU tests
    selected, not_run = select_backends(backends, args.device, args.backends)
    record["not_checked"] = not_run
    examples = args.examples if args.examples is not None else (budget.examples if args.device == "cuda" else 1)
    checks = {
        name: runner.step(
            f"check {name}", check_command(name, examples, args.seed, work / f"check_{name}.json"), budget.checks_s, env
        )
        for name in selected
    }
    junit = work / "junit.xml"
    command = test_command(junit, args.device, args.tests or GPU_TESTS)
    tests = runner.step("tests", command, budget.tests_s, env) if not args.no_tests else None
    runner.run([*checks.values(), *([tests] if tests else [])])
    record["checks"] = {name: check_result(step, work / f"check_{name}.json") for name, step in checks.items()}
    record["test_paths"] = list(args.tests or GPU_TESTS)
    if tests is not None:
        record["tests"] = {**tests.record(), **junit_results(junit), "tail": tests.text()[-3000:]}

    # 3. benches, one at a time: a timing needs the GPU to itself
    record["bench"] = {}
    available = {entry["name"] for entry in backends if not entry["unavailable"]}
    names = [name for name in (args.bench or BENCH_BACKENDS) if name in available or args.bench]
    shapes = BENCH_SHAPES if args.device == "cuda" else CPU_BENCH_SHAPES
    for index, name in enumerate(names):
        share = runner.left() / (len(names) - index)
        path = work / f"bench_{name}.json"
        step = runner.step(
            f"bench {name}",
            bench_command(name, args.device, shapes, budget, str(path)),
            min(budget.bench_each_s, share),
            env,
        )
        runner.run([step])
        record["bench"][name] = {
            **step.record(),
            "result": json.loads(path.read_text()) if path.exists() else None,
            "tail": step.text()[-3000:],
        }
    record["bench_not_run"] = [name for name in (args.bench or BENCH_BACKENDS) if name not in names]
    record["steps"] = [step.record() for step in runner.steps]
    record["elapsed_s"] = round(runner.elapsed(), 1)
    record["logs"] = {step.name: step.text() for step in runner.steps}
    return record


def select_backends(
    backends: list[dict[str, Any]], device: str, requested: Sequence[str] | None
) -> tuple[list[str], dict[str, list[str]]]:
    """The backends to check: the requested ones, else every available one whose harness runs it on ``device``;
    and every other backend that declares ``device``, with why it is not checked."""
    if requested:
        return list(requested), {}
    selected, not_run = [], {}
    for entry in backends:
        if device not in entry["devices"]:
            continue
        if entry["unavailable"]:
            not_run[entry["name"]] = entry["unavailable"]
        elif entry.get("harness_device") == device:
            selected.append(entry["name"])
        else:
            not_run[entry["name"]] = [f"the harness runs it on {entry.get('harness_device')}"]
    return selected, not_run


def check_result(step: Step, report: Path) -> dict[str, Any]:
    result = step.record()
    if report.exists():
        result.update(json.loads(report.read_text()))
    else:
        result["partial"] = partial_check(step.text())
    result["tail"] = step.text()[-3000:]
    return result


# ------------------------------------------------------------------------------------------------ the summary


def _ratio_value(value: Any) -> float:
    return math.inf if value == "inf" else float(value or 0.0)


def summarise(record: dict[str, Any]) -> dict[str, Any]:
    """Per backend: the check's verdict and worst ratio, the bench's TF/s and ratios to each peer; the tests'; and
    the list of what failed, which decides the exit status."""
    problems: list[str] = []
    checks: dict[str, Any] = {}
    for name, check in record.get("checks", {}).items():
        if check.get("timed_out"):
            partial = check.get("partial", {})
            done = (
                f"{partial.get('done', '?')}/{partial.get('total', '?')} cases, {partial.get('failing', '?')} failing"
            )
            verdict = f"TIMEOUT ({done})"
        elif check.get("unavailable"):
            verdict = "UNAVAILABLE"
        elif check.get("rc") == 0:
            verdict = "OK"
        else:
            verdict = "FAIL" if "cases" in check else f"CRASH (rc={check.get('rc')})"
        cases, failed = check.get("cases"), check.get("failed")
        checks[name] = {
            "verdict": verdict,
            "device": check.get("device"),
            "passed": None if cases is None else cases - failed,
            "cases": cases,
            "pending": check.get("pending", 0),
            "worst_ratio": check.get("worst_ratio"),
            "seconds": check.get("seconds"),
        }
        if verdict != "OK":
            problems.append(f"check {name}: {verdict}" + (f", {failed} of {cases} cases failed" if failed else ""))
    for name in EXPECTED_CUDA if record.get("device") == "cuda" else ():
        if name not in record.get("checks", {}):
            why = "; ".join(record.get("not_checked", {}).get(name, ["not selected"]))
            problems.append(f"check {name}: not run ({why})")
    tests = record.get("tests")
    if tests is not None and (tests.get("rc") != 0 or tests.get("timed_out")):
        problems.append(
            f"tests: rc={tests.get('rc')}{' TIMEOUT' if tests.get('timed_out') else ''}, "
            f"{tests.get('failed', '?')} failed, {tests.get('errors', '?')} errors"
        )
    bench: dict[str, Any] = {}
    for name, entry in record.get("bench", {}).items():
        rows, ratios, errors = bench_rows(name, entry.get("result"))
        bench[name] = {"rows": rows, "ratios": ratios}
        if entry.get("rc") != 0 or entry.get("timed_out") or entry.get("result") is None:
            problems.append(f"bench {name}: rc={entry.get('rc')}{' TIMEOUT' if entry.get('timed_out') else ''}")
        problems += [f"bench {name}: {error}" for error in errors]
    problems += [f"bench {name}: not run (unavailable)" for name in record.get("bench_not_run", [])]
    return {"checks": checks, "bench": bench, "problems": problems, "ok": not problems}


def bench_rows(name: str, result: dict[str, Any] | None) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """The backend's rows with its ratios to each peer (same shape, causality and pass), the worst and best ratio
    per peer and pass, and the backend's own errors."""
    if not result:
        return [], {}, []
    by_key = {
        (
            row["implementation"],
            row["batch"],
            row["heads"],
            row["seq_len"],
            row.get("len_k"),
            row["head_dim"],
            row["causal"],
        ): row
        for row in result["results"]
    }
    rows, errors, spread = [], [], {}
    for row in result["results"]:
        if row["implementation"] != name:
            continue
        key = (row["batch"], row["heads"], row["seq_len"], row.get("len_k"), row["head_dim"], row["causal"])
        shape = f"B={row['batch']} H={row['heads']} Lq={row['seq_len']} Lk={row.get('len_k')} D={row['head_dim']}"
        entry = {"shape": shape, "causal": row["causal"], "error": row.get("error")}
        for pass_name in ("fwd", "fwd+bwd"):
            entry[f"{pass_name}_tflops"] = row.get(f"{pass_name}_tflops")
            if row.get(f"{pass_name}_error"):
                entry[f"{pass_name}_error"] = row[f"{pass_name}_error"]
            for peer in result["peers"]:
                other = by_key.get((peer, *key), {})
                mine, theirs = row.get(f"{pass_name}_tflops"), other.get(f"{pass_name}_tflops")
                ratio = mine / theirs if mine and theirs else None
                entry[f"{pass_name} vs {peer}"] = ratio
                if ratio is not None:
                    low, high = spread.get(f"{pass_name} vs {peer}", (ratio, ratio))
                    spread[f"{pass_name} vs {peer}"] = (min(low, ratio), max(high, ratio))
        for problem in [row.get("error"), row.get("fwd_error"), row.get("fwd+bwd_error")]:
            if problem:
                errors.append(f"{shape} causal={row['causal']}: {problem}")
        rows.append(entry)
    return rows, {key: list(value) for key, value in spread.items()}, errors


def _tf(value: float | None) -> str:
    """TF/s to 3 significant digits: 412 on a GPU, 0.000331 on a CPU run."""
    return "-" if not value else f"{value:.3g}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x" if value >= 0.1 else f"{value:.3f}x"


def markdown(record: dict[str, Any], summary: dict[str, Any]) -> str:
    """The table docs/gpu.md keeps of each hardware run."""
    versions = record.get("versions", {})
    smi = record.get("nvidia_smi", {})
    gpu = smi.get("gpu") or versions.get("torch_gpu") or ("none (CPU run)" if record.get("device") == "cpu" else "?")
    jax_plugin = versions.get("jax-cuda13-plugin") or versions.get("jax-cuda12-plugin")
    cupy = versions.get("cupy-cuda13x") or versions.get("cupy-cuda12x")
    lines = [
        f"## gpu_check {record.get('date', '?')}: {'OK' if summary['ok'] else 'FAILED'}",
        "",
        "| | |",
        "|---|---|",
        f"| commit | {record.get('commit', '?')}{' (with uncommitted changes)' if record.get('dirty') else ''} "
        f"on {record.get('branch', '?')} |",
        f"| GPU | {gpu}{', driver ' + smi['driver'] if smi.get('driver') else ''} "
        f"{versions.get('torch_capability', '')} |",
        f"| python | {versions.get('python', '?')} |",
        f"| torch | {versions.get('torch', '-')} (CUDA {versions.get('torch_cuda', '-')}, cuDNN "
        f"{versions.get('cudnn', '-')}) |",
        f"| triton | {versions.get('triton', '-')} |",
        f"| jax / jaxlib | {versions.get('jax', '-')} / {versions.get('jaxlib', '-')} (plugin {jax_plugin or '-'}) |",
        f"| cupy | {cupy or '-'} |",
        f"| elapsed | {record.get('elapsed_s', '?')} s of {record.get('budget_s', '?')} s, {ALLOW_UNVERIFIED_ENV}=1 |",
        "",
        "| backend | device | check | passed | worst ratio | fwd TF/s | fwd+bwd TF/s | "
        + " | ".join(f"{p} vs {peer}" for peer in _peers(record) for p in ("fwd", "fwd+bwd"))
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * (2 * len(_peers(record))),
    ]
    names = list(dict.fromkeys([*summary["checks"], *summary["bench"]]))
    for name in names:
        check = summary["checks"].get(name, {})
        bench = summary["bench"].get(name, {"rows": [], "ratios": {}})
        passed = f"{check['passed']}/{check['cases']}" if check.get("cases") is not None else "-"
        if check.get("pending"):
            passed += f" (+{check['pending']} pending)"
        worst = check.get("worst_ratio")
        worst_text = "-" if worst is None else ("err" if worst == "inf" else f"{_ratio_value(worst):.2f}")
        tflops = {
            p: [row[f"{p}_tflops"] for row in bench["rows"] if row.get(f"{p}_tflops")] for p in ("fwd", "fwd+bwd")
        }
        spans = [_span(tflops[p]) for p in ("fwd", "fwd+bwd")]
        ratio_cells = [
            _span(bench["ratios"].get(f"{p} vs {peer}"), "x") for peer in _peers(record) for p in ("fwd", "fwd+bwd")
        ]
        lines.append(
            f"| {name} | {check.get('device') or record.get('device')} | {check.get('verdict', '-')} | {passed} | "
            f"{worst_text} | {' | '.join(spans)} | {' | '.join(ratio_cells)} |"
        )
    for name, reasons in record.get("not_checked", {}).items():
        lines.append(f"| {name} | - | not run: {'; '.join(reasons)[:120]} | | | | |" + " |" * (2 * len(_peers(record))))
    tests = record.get("tests")
    if tests is not None:
        lines += [
            "",
            f"GPU tests (`{' '.join(record.get('test_paths', GPU_TESTS))}`):"
            f" {tests.get('passed', '?')} passed, {tests.get('failed', '?')} "
            f"failed, {tests.get('errors', '?')} errors, {tests.get('skipped', '?')} skipped"
            + (" (TIMED OUT)" if tests.get("timed_out") else ""),
        ]
    bench_lines = []
    for name, bench in summary["bench"].items():
        for row in bench["rows"]:
            cells = [_tf(row.get("fwd_tflops")), _tf(row.get("fwd+bwd_tflops"))]
            cells += [_x(row.get(f"{p} vs {peer}")) for peer in _peers(record) for p in ("fwd", "fwd+bwd")]
            bench_lines.append(
                f"| {name} | {row['shape']} | {'yes' if row['causal'] else 'no'} | {' | '.join(cells)} |"
            )
    if bench_lines:
        lines += [
            "",
            "Bench (bf16, TF/s; ratio = backend TF/s / peer TF/s at the same shape, same process):",
            "",
            "| backend | shape | causal | fwd | fwd+bwd | "
            + " | ".join(f"{p} vs {peer}" for peer in _peers(record) for p in ("fwd", "fwd+bwd"))
            + " |",
            "|---|---|---|---|---|" + "---|" * (2 * len(_peers(record))),
            *bench_lines,
        ]
    if summary["problems"]:
        lines += ["", "Failed:", "", *(f"- {problem}" for problem in summary["problems"])]
    return "\n".join(lines) + "\n"


def _peers(record: dict[str, Any]) -> list[str]:
    found: list[str] = []
    for entry in record.get("bench", {}).values():
        for peer in (entry.get("result") or {}).get("peers", []):
            if peer not in found:
                found.append(peer)
    return found


def _span(values: Sequence[float] | None, unit: str = "") -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    if unit:
        low_text, high_text = _x(low)[:-1], _x(high)[:-1]
    else:
        low_text, high_text = _tf(low), _tf(high)
    return f"{low_text}{unit}" if low_text == high_text else f"{low_text}–{high_text}{unit}"


def console_summary(record: dict[str, Any], summary: dict[str, Any]) -> str:
    lines = ["", "=" * 100, f"gpu_check: {'OK' if summary['ok'] else 'FAILED'} in {record.get('elapsed_s')}s"]
    for step in record.get("steps", []):
        how = "TIMEOUT" if step["timed_out"] else f"rc={step['rc']}"
        lines.append(f"  {step['seconds']:7.1f}s  {how:8s} {step['name']}")
    for name, check in record.get("checks", {}).items():
        for failure in check.get("failures", [])[:40]:
            lines.append(f"  [{name}] {failure}")
    lines += [f"FAILED: {problem}" for problem in summary["problems"]]
    return "\n".join(lines)


def write_outputs(record: dict[str, Any], out_dir: Path) -> tuple[Path, Path, dict[str, Any]]:
    """gpu_check.json (the record, its summary inside), gpu_check.md (the table) and gpu_check.log (every step's
    whole output, which the JSON keeps only the tails of)."""
    summary = summarise(record)
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = record.pop("logs", {})
    json_path, md_path = out_dir / "gpu_check.json", out_dir / "gpu_check.md"
    json_path.write_text(json.dumps({**record, "summary": summary}, indent=1, default=str) + "\n")
    md_path.write_text(markdown(record, summary))
    if logs:
        (out_dir / "gpu_check.log").write_text("".join(f"\n{'=' * 30} {name}\n{text}" for name, text in logs.items()))
    return json_path, md_path, summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the whole pipeline, tiny")
    parser.add_argument("--examples", type=int, help="drawn cases per backend (default 12 on cuda, 1 on cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", type=lambda text: text.split(","), help="check only these (default: all)")
    parser.add_argument("--bench", type=lambda text: text.split(","), help=f"bench these (default {BENCH_BACKENDS})")
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest step")
    parser.add_argument("--tests", type=lambda text: text.split(","), help="pytest these (default: GPU_TESTS)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run (default %(default)s)")
    parser.add_argument("--out", help="where the JSON and Markdown go (default: $OUT, else ./gpu_check_out)")
    parser.add_argument("--summarise", metavar="JSON", help="rewrite the Markdown of a recorded gpu_check.json")
    parser.add_argument("--check-worker", metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.check_worker:
        return check_worker(args.check_worker, args.examples or 0, "ci", args.seed, Path(args.report))
    out_dir = Path(args.out or os.environ.get("OUT") or REPO / "gpu_check_out")
    budget = Budget()
    if args.dry_run:
        print(json.dumps(plan(args, budget), indent=1))
        return 0
    if args.summarise:
        record = json.loads(Path(args.summarise).read_text())
        record.pop("summary", None)
        _, md_path, summary = write_outputs(record, out_dir)
        print(md_path.read_text())
        return 0 if summary["ok"] else 1
    record = run(args, budget, sys.stdout)
    json_path, md_path, summary = write_outputs(record, out_dir)
    print(console_summary(record, summary))
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
