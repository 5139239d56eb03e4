"""The pallas backend: attention in jax.experimental.pallas kernels (issue 4).

Where jax is missing a stand-in takes its name and reports what to install, so configs that name it stay valid.
"""

from __future__ import annotations

import importlib.util

from attnkit.backend import Backend, Framework, LazyBackend, MissingPackageBackend


def backends() -> list[Backend | LazyBackend]:
    """Its module (which imports jax) is imported at its first use (attnkit.backend.LazyBackend)."""
    if importlib.util.find_spec("jax") is not None:
        return [LazyBackend("pallas", frozenset({Framework.JAX, Framework.TORCH}), f"{__name__}.backend:PallasBackend")]
    return [MissingPackageBackend("pallas", "jax", "jax")]
