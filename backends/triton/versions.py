"""Which Triton the kernels run on: the supported range and the check (imported by the package and its backend)."""

from __future__ import annotations

import re

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
