"""A call imports only what its framework needs: the registry lists every backend, but a backend's module (and the
framework it is built on) is imported at its first real use (attnkit.backend.LazyBackend). A torch call on the CPU
imports neither JAX nor Triton, a JAX call not torch; what a backend not yet imported answers is what it answers
once imported."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnkit import registry
from attnkit.backend import Framework, LazyBackend, Problem
from attnkit.spec import AttentionSpec

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("reference", "native", "pallas", "triton", "cupy", "cpu_flash")

TORCH_CALL = """
    import torch
    q = torch.randn(1, 2, 16, 8)
    out = attnkit.attend(attnkit.AttentionSpec(causal=True), q, q, q)
    assert out.shape == q.shape
"""
JAX_CALL = """
    import jax.numpy as jnp
    q = jnp.ones((1, 2, 16, 8))
    out = attnkit.attend(attnkit.AttentionSpec(causal=True), q, q, q)
    assert out.shape == q.shape
"""


@pytest.mark.parametrize(
    ("call", "framework", "absent"),
    [(TORCH_CALL, "torch", ("jax", "triton")), (JAX_CALL, "jax", ("torch",))],
    ids=["torch", "jax"],
)
def test_a_call_imports_no_other_framework(call: str, framework: str, absent: tuple[str, ...]) -> None:
    """In a fresh process: the first auto call of one framework leaves the others unimported."""
    pytest.importorskip(framework)
    script = "import sys\nimport attnkit\n" + textwrap.dedent(call)
    script += f"print(sorted(m for m in {absent!r} if m in sys.modules))\n"
    environment = {**os.environ, "ATTNKIT_AUTOTUNE": "0", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def built_in() -> list[LazyBackend]:
    found = []
    for family in FAMILIES:
        found += importlib.import_module(f"attnkit.backends.{family}").backends()
    return [backend for backend in found if isinstance(backend, LazyBackend)]


@pytest.mark.parametrize("lazy", built_in(), ids=lambda b: b.name)
def test_a_backend_not_imported_answers_as_it_will_once_imported(lazy: LazyBackend) -> None:
    """Its declared frameworks are its capabilities'; a call of another framework gets the same one reason before
    and after the import, whatever else the call asks."""
    assert lazy.loaded() is None
    loaded = lazy.load()
    assert loaded.name == lazy.name
    assert loaded.capabilities.frameworks == lazy.frameworks
    spec = AttentionSpec(causal=True, softcap=30.0, window=(4, 0))
    for framework in set(Framework) - lazy.frameworks:
        problem = Problem(framework, "cpu", "float64", 1, 2, 1, 5, 7, 512, 24, has_mask=True, return_lse=True)
        fresh = LazyBackend(lazy.name, lazy.frameworks, lambda: loaded)
        assert (
            fresh.supports(spec, problem)
            == loaded.supports(spec, problem)
            == [f"framework={framework.value} (supported: {', '.join(sorted(f.value for f in lazy.frameworks))})"]
        )
        assert fresh.loaded() is None  # answered without importing


def test_reports_see_every_backend_itself() -> None:
    """What attnkit info, attnkit check and the benches list: every backend loaded (its own availability, never the
    stand-in's guess), and the registry's from then on."""
    loaded = registry.backends(load=True)
    assert not [name for name, backend in loaded.items() if isinstance(backend, LazyBackend)]
    assert all(registry.backends()[name] is backend for name, backend in loaded.items())
