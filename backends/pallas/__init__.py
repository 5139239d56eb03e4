"""The pallas backend: attention in jax.experimental.pallas kernels (issue 4).

Registers ``pallas`` on import; where jax is missing a stand-in registers under the same name and reports what
to install, so configs that name it stay valid.
"""

from __future__ import annotations

import importlib.util

from attnkit import MissingPackageBackend, register_backend

if importlib.util.find_spec("jax") is not None:
    from .backend import PallasBackend

    register_backend(PallasBackend())
else:
    register_backend(MissingPackageBackend("pallas", "jax", "jax"))
