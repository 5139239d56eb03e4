"""The ``cupy`` backend: FlashAttention-2 forward and backward kernels in CUDA C, compiled at run time by NVRTC.

``kernels/attention.cu`` holds the math, ``launch.py`` the -D options, tiles, shared memory, grids and the launcher
interface, ``backend.py`` the attnkit protocol, ``inspect.py`` the nvcc static check. Registers ``cupy`` (unavailable
without CuPy and a CUDA device, with the reason) and ``cupy-emulated``, a test-only path that stays unavailable until
the test suite attaches the CPU emulation harness of tests/cupy_emulator. Without torch, a stand-in says what to
install.
"""

from __future__ import annotations

import importlib.util

from attnkit import MissingPackageBackend, register_backend

if importlib.util.find_spec("torch") is not None:
    from .backend import CupyBackend, attend_cupy

    __all__ = ["attend_cupy"]

    register_backend(CupyBackend.on_cuda())
    register_backend(CupyBackend.emulated())
else:
    register_backend(MissingPackageBackend("cupy", "torch", "torch"))
    register_backend(MissingPackageBackend("cupy-emulated", "torch", "torch"))
