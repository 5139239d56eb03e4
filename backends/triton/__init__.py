"""The ``triton`` backend: FlashAttention-2 forward and backward kernels written in Triton.

``kernels.py`` holds the math, ``launch.py`` the grids, strides, tile configurations and the interpreter,
``backend.py`` the attnkit protocol. Without torch or triton a stand-in says what to install; with a Triton outside
:data:`SUPPORTED_TRITON` a stand-in says which version it found and which it needs.
"""

from __future__ import annotations

import importlib.util
import re

from attnkit.backend import Backend, MissingPackageBackend

#: The Triton minor versions the kernels are written for, [low, high): the ones the CUDA torch wheels of
#: attnkit's torch range pin (3.6.0 for torch 2.10/2.11, 3.7.x for 2.12/2.13), up to the newest tested (3.9).
#: pyproject.toml's `triton` extra says the same (tests/test_packaging.py keeps them in step); docs/triton.md has
#: the table and why 3.5 and older are out (no GPU has run the kernels on them; 3.5.1's interpreter misreads
#: descriptor strides).
SUPPORTED_TRITON = ((3, 6), (3, 10))
SUPPORTED_TRITON_TEXT = ">={}.{},<{}.{}".format(*SUPPORTED_TRITON[0], *SUPPORTED_TRITON[1])


def minor_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as ``3.6.0``, ``3.7.1+git1a2b3c`` or ``3.10.0rc1``; None if it has
    none."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def unsupported_triton(version: str) -> list[str]:
    """Why this Triton cannot run the kernels (empty: it can). Outside the range a kernel may fail to compile,
    or compile to something never checked: refused, never run on the chance."""
    found = minor_version(version)
    if found is None or not SUPPORTED_TRITON[0] <= found < SUPPORTED_TRITON[1]:
        return [
            f"triton {version} (supported: {SUPPORTED_TRITON_TEXT}; "
            f"pip install 'triton{SUPPORTED_TRITON_TEXT}', or a torch whose CUDA wheel pins one, see docs/triton.md)"
        ]
    return []


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
