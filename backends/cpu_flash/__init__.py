"""``cpu-flash``: attnkit's own FlashAttention-2 kernel for the CPU (C++, kernel.cpp), built on first use by
``torch.utils.cpp_extension``. Without torch a stand-in says what to install."""

from __future__ import annotations

import importlib.util

from attnkit.backend import Backend, MissingPackageBackend


def backends() -> list[Backend]:
    if importlib.util.find_spec("torch") is not None:
        from .backend import CpuFlashBackend

        return [CpuFlashBackend()]
    return [MissingPackageBackend("cpu-flash", "torch", "torch")]
