"""Packaging, README and CI stay true: the quick start is what CI runs, the wheel maps backends/ to
attnkit.backends (nothing called `backends` at the top level), ruff and mypy are clean."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    assert block, "README's Quick start has no code block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_quick_start_is_two_commands_and_ci_runs_the_test_one() -> None:
    commands = quick_start_commands()
    assert len(commands) == 2, commands
    assert "attnkit check" in commands[0]
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_wheel_installs_backends_under_attnkit(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("attnkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "attnkit/backends/reference/torch_naive.py" in names
    assert "attnkit/configs/default.toml" in names
    assert "attnkit/py.typed" in names
    assert "attnkit/backends/cupy/kernels/attention.cu" in names  # the CUDA C source NVRTC compiles at run time
    assert not [name for name in names if name.startswith("backends/")], "a top-level `backends` package leaked"


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_static_checks_are_clean(tool: str) -> None:
    if shutil.which(tool) is None and not (Path(sys.executable).parent / tool).exists():
        pytest.skip(f"{tool} is not installed (pip install -e '.[test]')")
    command = {
        "ruff": [sys.executable, "-m", "ruff", "check", "attnkit", "backends", "tests"],
        "mypy": [sys.executable, "-m", "mypy"],
    }[tool]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_triton_extra_is_the_range_the_backend_accepts() -> None:
    """pyproject's `triton` extra and the backend's gate (backends/triton/__init__.py) name one range: a wider extra
    would install a Triton the backend refuses, a narrower one would replace the Triton a CUDA torch wheel pins."""
    import tomllib

    from attnkit.backends.triton import SUPPORTED_TRITON_TEXT

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["triton"] == [f"triton{SUPPORTED_TRITON_TEXT}"], extras["triton"]


def test_ci_runs_the_triton_kernels_on_the_oldest_supported_triton() -> None:
    """.ci/run's second Triton is the range's floor, and its step runs the kernels' tests with the triton backend
    required (a refused Triton would otherwise skip them all and pass)."""
    from attnkit.backends.triton import SUPPORTED_TRITON, minor_version

    ci = (ROOT / ".ci" / "run").read_text()
    oldest = re.search(r"^OLDEST_TRITON=(\S+)$", ci, re.M)
    assert oldest, ".ci/run sets no OLDEST_TRITON"
    assert minor_version(oldest.group(1)) == SUPPORTED_TRITON[0], (oldest.group(1), SUPPORTED_TRITON)
    step = ci[oldest.start() :]
    assert re.search(r"^PYTHONPATH=\S+ ATTNKIT_EXPECT_BACKENDS=triton python -m pytest ", step, re.M), step
    for tests in ("test_expected_backends.py", "test_kernel_backends.py", "test_conformance.py"):
        assert f"tests/{tests}" in step, f".ci/run's oldest-Triton step runs no tests/{tests}"
