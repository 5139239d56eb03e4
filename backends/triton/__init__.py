"""The ``triton`` backend: FlashAttention-2 forward and backward kernels written in Triton.

``kernels.py`` holds the math, ``launch.py`` the grids, strides, tile configurations and the interpreter,
``backend.py`` the attnkit protocol. Registers on import; without torch or triton a stand-in says what to install.
"""

from __future__ import annotations

import importlib.util

from attnkit import MissingPackageBackend, register_backend

if importlib.util.find_spec("triton") is not None and importlib.util.find_spec("torch") is not None:
    from .backend import TritonBackend

    register_backend(TritonBackend())
else:
    register_backend(MissingPackageBackend("triton", "triton", "triton"))
