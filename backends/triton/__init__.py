"""The ``triton`` backend: FlashAttention-2 forward and backward kernels written in Triton.

``kernels.py`` holds the math, ``launch.py`` the grids, strides, tile configurations and the interpreter,
``backend.py`` the attnkit protocol. Without torch or triton a stand-in says what to install; with a Triton outside
:data:`SUPPORTED_TRITON` a stand-in says which version it found and which it needs.
"""

from __future__ import annotations

import importlib.util

from attnkit.backend import Backend, MissingPackageBackend

from .versions import SUPPORTED_TRITON, SUPPORTED_TRITON_TEXT, minor_version, unsupported_triton

__all__ = ["SUPPORTED_TRITON", "SUPPORTED_TRITON_TEXT", "backends", "minor_version", "unsupported_triton"]


class UnsupportedTritonBackend(MissingPackageBackend):
    """Stands in for the triton backend when the installed Triton is outside :data:`SUPPORTED_TRITON`: the
    kernels' module is never imported (an older Triton lacks names it imports), configs naming ``triton`` stay
    valid, and ``attnkit info`` gives the version found and the range."""

    def __init__(self, version: str) -> None:
        super().__init__("triton", "triton", "triton")
        self.version = version

    def available(self) -> list[str]:
        return unsupported_triton(self.version)


def backends() -> list[Backend]:
    if importlib.util.find_spec("triton") is not None and importlib.util.find_spec("torch") is not None:
        import triton

        if unsupported_triton(triton.__version__):
            return [UnsupportedTritonBackend(triton.__version__)]
        from .backend import TritonBackend

        return [TritonBackend()]
    return [MissingPackageBackend("triton", "triton", "triton")]
