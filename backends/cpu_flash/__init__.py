"""``cpu-flash``: attnkit's own FlashAttention-2 kernel for the CPU (C++, kernel.cpp), built on first use by
``torch.utils.cpp_extension``. Registers on import; without torch a stand-in says what to install."""

from __future__ import annotations

import importlib.util

from attnkit import MissingPackageBackend, register_backend

if importlib.util.find_spec("torch") is not None:
    from .backend import CpuFlashBackend

    register_backend(CpuFlashBackend())
else:
    register_backend(MissingPackageBackend("cpu-flash", "torch", "torch"))
