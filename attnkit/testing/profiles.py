"""Hypothesis profiles: ``ci`` (bounded, derandomised, fits the CI budget) and ``thorough`` (long local runs)."""

from __future__ import annotations

import os


def register_profiles() -> str:
    """Register ``ci``, ``dev`` and ``thorough``; load HYPOTHESIS_PROFILE, else ``ci`` under CI, else ``dev``."""
    # Imported here: attnkit.testing's runners serve the benches too, on installs without the test extra.
    from hypothesis import HealthCheck, settings

    # Backends compile (JAX) or interpret (Triton) on first use: a per-example deadline would measure that.
    common = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    settings.register_profile("ci", max_examples=25, derandomize=True, print_blob=True, parent=common)
    settings.register_profile("dev", max_examples=40, parent=common)
    settings.register_profile("thorough", max_examples=1000, parent=common)
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    settings.load_profile(name)
    return name
