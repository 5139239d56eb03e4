"""Process set-up: every backend this machine can run (GPU or not), and how many threads torch and XLA use."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator


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


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` intra-op threads (None: leave torch's choice), restoring the previous count."""
    import torch

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def limit_jax_threads(threads: int | None) -> None:
    """With one thread, ask XLA's CPU client for one too; only works before JAX is imported (a no-op after)."""
    if threads == 1 and "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        if "intra_op_parallelism_threads" not in flags:
            extra = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
            os.environ["XLA_FLAGS"] = f"{flags} {extra}".strip()
