"""Reference backends: torch-naive (the oracle), torch-chunked (FlashAttention-2 in torch ops), jax-reference.

Where a backend's package is missing, a stand-in takes its name and reports what to install, so configs that
name it stay valid.
"""

from __future__ import annotations

import importlib.util

from attnkit.backend import Backend, Framework, LazyBackend, MissingPackageBackend

TORCH, JAX = frozenset({Framework.TORCH}), frozenset({Framework.JAX})


def backends() -> list[Backend | LazyBackend]:
    """Each backend's module is imported at its first use (attnkit.backend.LazyBackend)."""
    found: list[Backend | LazyBackend] = []
    if importlib.util.find_spec("torch") is not None:
        found += [
            LazyBackend("torch-naive", TORCH, f"{__name__}.torch_naive:TorchNaiveBackend"),
            LazyBackend("torch-chunked", TORCH, f"{__name__}.torch_chunked:TorchChunkedBackend"),
        ]
    else:
        found += [MissingPackageBackend(name, "torch", "torch") for name in ("torch-naive", "torch-chunked")]
    if importlib.util.find_spec("jax") is not None:
        found.append(LazyBackend("jax-reference", JAX, f"{__name__}.jax_reference:JaxReferenceBackend"))
    else:
        found.append(MissingPackageBackend("jax-reference", "jax", "jax"))
    return found
