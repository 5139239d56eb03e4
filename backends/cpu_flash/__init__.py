"""``cpu-flash``: attnkit's own FlashAttention-2 kernel for the CPU (C++, kernel.cpp), built on first use by
``torch.utils.cpp_extension``. Without torch a stand-in says what to install."""

from __future__ import annotations

import importlib.util

from attnkit.backend import Backend, Framework, LazyBackend, MissingPackageBackend


def backends() -> list[Backend | LazyBackend]:
    """Its module is imported at its first use (attnkit.backend.LazyBackend)."""
    if importlib.util.find_spec("torch") is not None:
        return [LazyBackend("cpu-flash", frozenset({Framework.TORCH}), f"{__name__}.backend:CpuFlashBackend")]
    return [MissingPackageBackend("cpu-flash", "torch", "torch")]
