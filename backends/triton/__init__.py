"""The ``triton`` backend: FlashAttention-2 forward and backward kernels written in Triton.

``kernels.py`` holds the math, ``launch.py`` the grids, strides, tile configurations and the interpreter,
``backend.py`` the attnkit protocol. Without torch or triton a stand-in says what to install.
"""

from __future__ import annotations

import importlib.util

from attnkit.backend import Backend, MissingPackageBackend


def backends() -> list[Backend]:
    if importlib.util.find_spec("triton") is not None and importlib.util.find_spec("torch") is not None:
        from .backend import TritonBackend

        return [TritonBackend()]
    return [MissingPackageBackend("triton", "triton", "triton")]
