"""The ``triton`` backend: FlashAttention-2 forward and backward kernels written in Triton.

``kernels.py`` holds the math, ``launch.py`` the grids, strides, tile configurations and the interpreter,
``backend.py`` the attnkit protocol. Without torch or triton a stand-in says what to install; with a Triton outside
:data:`SUPPORTED_TRITON` a stand-in says which version it found and which it needs.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

from attnkit.backend import Backend, Framework, LazyBackend, MissingPackageBackend

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


def installed_version() -> str:
    """The Triton version: the module's where it is imported already, else its distribution's metadata (importing
    triton takes a fifth of a second), else the module's (a source tree on the path has no metadata)."""
    if "triton" in sys.modules:
        return str(sys.modules["triton"].__version__)
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        import triton

        return str(triton.__version__)


def backends() -> list[Backend | LazyBackend]:
    """The kernels' module (which imports triton) is imported at the backend's first use (attnkit.backend.LazyBackend):
    a torch call on the CPU never imports triton, and TRITON_INTERPRET may be set up to then."""
    if importlib.util.find_spec("triton") is not None and importlib.util.find_spec("torch") is not None:
        version = installed_version()
        if unsupported_triton(version):
            return [UnsupportedTritonBackend(version)]
        return [LazyBackend("triton", frozenset({Framework.TORCH}), f"{__name__}.backend:TritonBackend")]
    return [MissingPackageBackend("triton", "triton", "triton")]
