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
