"""Reference backends: torch-naive (the oracle), torch-chunked (FlashAttention-2 in torch ops), jax-reference.

Where a backend's package is missing, a stand-in takes its name and reports what to install, so configs that
name it stay valid.
"""

from __future__ import annotations

import importlib.util

from attnkit.backend import Backend, MissingPackageBackend


def backends() -> list[Backend]:
    found: list[Backend] = []
    if importlib.util.find_spec("torch") is not None:
        from .torch_chunked import TorchChunkedBackend
        from .torch_naive import TorchNaiveBackend

        found += [TorchNaiveBackend(), TorchChunkedBackend()]
    else:
        found += [MissingPackageBackend(name, "torch", "torch") for name in ("torch-naive", "torch-chunked")]
    if importlib.util.find_spec("jax") is not None:
        from .jax_reference import JaxReferenceBackend

        found.append(JaxReferenceBackend())
    else:
        found.append(MissingPackageBackend("jax-reference", "jax", "jax"))
    return found
