"""The examples' command lines (examples/): what a user types reaches the run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: the run is under __main__
    return module


def test_context_parallel_takes_the_shape_and_run_as_flags() -> None:
    """Issue 32: the example hard-coded L=2048; length, heads, head dim, batch, steps and sharding are flags."""
    example = _example("context_parallel")
    args = example.arguments(["jax", "--length", "64", "--heads", "8", "--head-dim", "32", "--batch", "1",
                              "--steps", "2", "--sharding", "contiguous", "--strategy", "ulysses"])  # fmt: skip
    assert (args.framework, args.length, args.heads, args.head_dim, args.batch, args.steps) == ("jax", 64, 8, 32, 1, 2)
    assert (args.sharding, args.strategy) == ("contiguous", "ulysses")
    defaults = example.arguments(["torch"])
    assert (defaults.length, defaults.heads, defaults.sharding, defaults.strategy) == (2048, 4, "zigzag", "ring")
    with pytest.raises(SystemExit):
        example.arguments(["torch", "--length", "0"])
