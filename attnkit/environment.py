"""Process set-up: every backend this machine can run (GPU or not), how many threads torch and XLA use, and which
GPU model it has (the key of a cost table measured on one)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Iterator


def interpret_triton_without_gpu() -> bool:
    """Set TRITON_INTERPRET=1 when no CUDA device is visible, so the ``triton`` backend runs its kernels in the
    Triton interpreter on CPU tensors. Returns whether the interpreter is on.

    Triton reads the switch when a kernel is decorated, so call this before the triton backend's module is imported:
    the registry imports it at the backend's first use (a call that may run on it, ``attnkit explain``, ``attnkit
    info``), never for a torch call on the CPU, whose priority list leaves it out. An explicit TRITON_INTERPRET in
    the environment is left as it is.
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


@functools.cache
def accelerator_name(framework: str, device: str) -> str:
    """The model of the ``device`` ("cuda") GPUs ``framework`` ("torch", "jax") sees here, e.g. "NVIDIA H100 80GB
    HBM3"; "" for the CPU, without such a device, or when the GPUs are of more than one model (a cost table measured
    on one model must not speak for a call that may run on another). Read once per process."""
    if device != "cuda":
        return ""
    if framework == "torch":
        import torch

        if not torch.cuda.is_available():
            return ""
        names = {torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())}
    else:
        import jax

        names = {d.device_kind for d in jax.devices() if d.platform == "gpu"}
    return names.pop() if len(names) == 1 else ""


@functools.cache
def cpu_fingerprint() -> str:
    """This CPU's model and instruction-set flags (/proc/cpuinfo, what a ``-march=native`` build is keyed on),
    hashed: what a CPU cost table records as the machine it was fitted on, and part of the key of every record
    ``auto`` measures (attnkit/autotune.py). Read once per process."""
    from attnkit.build import cpu_description, digest

    return digest(cpu_description())
