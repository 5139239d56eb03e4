"""Reference backends: torch-naive (the oracle), torch-chunked (FlashAttention-2 in torch ops), jax-reference.

Each registers on import; where its package is missing a stand-in registers under the same name and
reports what to install, so configs that name it stay valid.
"""

from __future__ import annotations

import importlib.util

from attnkit import MissingPackageBackend, register_backend

if importlib.util.find_spec("torch") is not None:
    from .torch_chunked import TorchChunkedBackend
    from .torch_naive import TorchNaiveBackend

    register_backend(TorchNaiveBackend())
    register_backend(TorchChunkedBackend())
else:
    register_backend(MissingPackageBackend("torch-naive", "torch", "torch"))
    register_backend(MissingPackageBackend("torch-chunked", "torch", "torch"))

if importlib.util.find_spec("jax") is not None:
    from .jax_reference import JaxReferenceBackend

    register_backend(JaxReferenceBackend())
else:
    register_backend(MissingPackageBackend("jax-reference", "jax", "jax"))
