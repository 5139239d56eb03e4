"""The ``cupy`` backend: FlashAttention-2 forward and backward kernels in CUDA C, compiled at run time by NVRTC.

``kernels/attention.cu`` holds the math, ``launch.py`` the -D options, tiles, shared memory, grids and the launcher
interface, ``backend.py`` the attnkit protocol, ``inspect.py`` the nvcc static check. Lists ``cupy`` (unavailable
without CuPy and a CUDA device, with the reason) and ``cupy-emulated``, a test-only path that stays unavailable until
the test suite attaches the CPU emulation harness of tests/cupy_emulator. Without torch, a stand-in says what to
install.
"""

from __future__ import annotations

import importlib.util

from attnkit.backend import Backend, Framework, LazyBackend, MissingPackageBackend


def backends() -> list[Backend | LazyBackend]:
    """Their module is imported at its first use (attnkit.backend.LazyBackend)."""
    if importlib.util.find_spec("torch") is not None:
        torch = frozenset({Framework.TORCH})
        made = f"{__name__}.backend:CupyBackend"
        return [LazyBackend("cupy", torch, f"{made}.on_cuda"), LazyBackend("cupy-emulated", torch, f"{made}.emulated")]
    return [MissingPackageBackend(name, "torch", "torch") for name in ("cupy", "cupy-emulated")]
