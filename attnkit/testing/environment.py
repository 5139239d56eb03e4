"""Process set-up for running every backend this machine can run, GPU or not."""

from __future__ import annotations

import importlib.util
import os


def interpret_triton_without_gpu() -> bool:
    """Set TRITON_INTERPRET=1 when no CUDA device is visible, so the ``triton`` backend runs its kernels in the
    Triton interpreter on CPU tensors. Returns whether the interpreter is on.

    Triton reads the switch when a kernel is decorated, so call this before attnkit loads its backends (before
    the first attend/registry call). An explicit TRITON_INTERPRET in the environment is left as it is.
    """
    if "TRITON_INTERPRET" not in os.environ:
        has_gpu = False
        if importlib.util.find_spec("torch") is not None:
            import torch

            has_gpu = torch.cuda.is_available()
        if not has_gpu:
            os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
