"""The torch frontend's signature in C++ (torch_signature.cpp): built on request, used wherever it is built.

``attnkit build`` compiles it with ``torch.utils.cpp_extension`` through attnkit/build.py (about 20 s, once per
torch version and Python: the build directory's name carries a hash of the source, flags and both versions, so a
stale build is never loaded). Every later process finds the built module and loads it at import, with no compiler
involved, if the current user owns it and its directory and no one else can write them (else it is refused, with the
reason in ``attnkit info``); without it, the Python signature serves, so nothing but the cost of a cached call
differs. ``ATTNKIT_COMPILED_SIGNATURE=0`` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnkit.build import TorchExtension
from attnkit.errors import BuildError

SOURCE = Path(__file__).with_name("torch_signature.cpp")
DISABLE_VARIABLE = "ATTNKIT_COMPILED_SIGNATURE"
EXTENSION = TorchExtension("attnkit_signature", SOURCE, ["-O2"], label="the compiled call signature", expected_s=15)


def build_directory() -> Path:
    """Where the build for this source, torch and Python lives (under ``TORCH_EXTENSIONS_DIR`` if set)."""
    return EXTENSION.directory()


def _module(build: bool) -> tuple[Any, str]:
    if os.environ.get(DISABLE_VARIABLE) == "0":
        return None, f"{DISABLE_VARIABLE}=0"
    if not build and not EXTENSION.library().exists():
        return None, f"not built (run `attnkit build`; it would live in {build_directory()})"
    try:
        return EXTENSION.load(build=build), ""
    except BuildError as error:
        return None, str(error)


def load(fallback: Callable[..., Any], build: bool = False) -> tuple[Callable[..., Any] | None, str]:
    """(the compiled signature, "") or (None, why not). Builds it first with ``build=True``; the compiled function
    hands every call it does not key itself to ``fallback`` (the Python signature)."""
    module, reason = _module(build)
    if module is None:
        return None, reason
    module.set_fallback(fallback)
    return module.signature, ""


def load_length_class(
    fallback: Callable[..., Any], bshd: Any, build: bool = False
) -> tuple[Callable[..., Any] | None, str]:
    """:func:`load` of the length-class signature (TorchOps.length_class_signature); ``bshd``: Layout.BSHD."""
    module, reason = _module(build)
    if module is None:
        return None, reason
    module.set_class_fallback(fallback, bshd)
    return module.length_class_signature, ""
