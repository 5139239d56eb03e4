"""The torch frontend's signature in C++ (torch_signature.cpp): built on request, used wherever it is built.

``attnkit build`` compiles it with ``torch.utils.cpp_extension`` (about 20 s, once per torch version and Python: the
build directory's name carries a hash of the source and both versions, so a stale build is never loaded). Every
later process finds the built module and loads it at import, with no compiler involved; without it, the Python
signature serves, so nothing but the cost of a cached call differs. ``ATTNKIT_COMPILED_SIGNATURE=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("torch_signature.cpp")
DISABLE_VARIABLE = "ATTNKIT_COMPILED_SIGNATURE"


def build_directory() -> Path:
    """Where the build for this source, torch and Python lives (under ``TORCH_EXTENSIONS_DIR`` if set)."""
    identity = b"\0".join(
        [SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode(), platform.machine().encode()]
    )
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / f"attnkit_signature_{hashlib.sha256(identity).hexdigest()[:12]}"


def load(fallback: Callable[..., Any], build: bool = False) -> tuple[Callable[..., Any] | None, str]:
    """(the compiled signature, "") or (None, why not). Builds it first with ``build=True``; the compiled function
    hands every call it does not key itself to ``fallback`` (the Python signature)."""
    if os.environ.get(DISABLE_VARIABLE) == "0":
        return None, f"{DISABLE_VARIABLE}=0"
    directory = build_directory()
    library = directory / f"{directory.name}.so"
    if build:
        from torch.utils.cpp_extension import load as build_extension

        directory.mkdir(parents=True, exist_ok=True)
        module: Any = build_extension(
            name=directory.name, sources=[str(SOURCE)], build_directory=str(directory), extra_cflags=["-O2"]
        )
    elif library.exists():
        spec = importlib.util.spec_from_file_location(directory.name, library)
        if spec is None or spec.loader is None:
            return None, f"cannot load {library}"
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        return None, f"not built (run `attnkit build`; it would live in {directory})"
    module.set_fallback(fallback)
    return module.signature, ""
