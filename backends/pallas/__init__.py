"""The pallas backend: attention in jax.experimental.pallas kernels (issue 4).

Where jax is missing a stand-in takes its name and reports what to install, so configs that name it stay valid.
"""

from __future__ import annotations

import importlib.util

from attnkit.backend import Backend, MissingPackageBackend


def backends() -> list[Backend]:
    if importlib.util.find_spec("jax") is not None:
        from .backend import PallasBackend

        return [PallasBackend()]
    return [MissingPackageBackend("pallas", "jax", "jax")]
