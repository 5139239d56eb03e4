"""Reference backends: torch-naive (the oracle), torch-chunked (FlashAttention-2 in torch ops), jax-reference."""

from __future__ import annotations

import importlib.util

from attnkit import register_backend

if importlib.util.find_spec("torch") is not None:
    from .torch_naive import TorchNaiveBackend

    register_backend(TorchNaiveBackend())
