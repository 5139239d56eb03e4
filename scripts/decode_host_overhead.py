"""A decode call's launches and host time on the GPU kernel backends, measured on CPU.

The call: B = 1, Hq = Hkv = 32, Lq = 1, Lk = 8192, D = 128, bfloat16, with contiguous keys and with a paged cache of
16-token blocks. Each backend's launcher plans it for a GPU (triton: compiled for sm_90; cupy: its GPU tiles) with
132 SMs (an H100's), and a recording launcher stands for the GPU: nothing runs, so the time is the host's alone
(Python, torch's CPU-side ops, allocations). What is counted:

* ``launches``: the backend's own kernels (the launcher's run calls), by kernel;
* ``torch kernels``: the torch calls around them that would launch a CUDA kernel (all but metadata, views and
  allocations: NO_KERNEL), by name;
* ``us/call``: median over repeats of the mean host time of a block of calls (one torch thread), after warm-up
  (the autotuner's first call times nothing here: its timer is a constant).

    env -u TRITON_INTERPRET python scripts/decode_host_overhead.py [--repeats 7] [--calls 200]

The interpreter must be off (TRITON_INTERPRET unset) so that the compiled plan is what is timed.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

BATCH, HEADS, LEN_Q, LEN_K, HEAD_DIM, BLOCK_SIZE = 1, 32, 1, 8192, 128, 16
PROCESSORS = 132


#: Torch calls that launch no kernel (named without the underscores around them): metadata, views, allocations. A
#: dispatch mode would see aten ops directly, but entering one imports torch._dynamo: 10-20 s here, too much for a test.
NO_KERNEL = frozenset(
    {"get", "getitem", "len", "data_ptr", "detach", "dim", "element_size", "empty", "expand", "is_contiguous",
     "numel", "permute", "select", "set_grad_enabled", "size", "squeeze", "storage_offset", "stride", "transpose",
     "unsqueeze", "view"}
)  # fmt: skip


class _DeviceOps(TorchFunctionMode):
    """Counts the torch calls that would launch a kernel on a GPU: all but NO_KERNEL, and a ``to`` or ``contiguous``
    that returns its tensor unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func)).strip("_")  # _set_grad_enabled, __eq__: their op's name
        unchanged = name in ("to", "contiguous") and args and result is args[0]
        if name not in NO_KERNEL and not name.startswith("empty") and not unchanged:
            self.ops[name] += 1
        return result


def recording_triton() -> tuple[Any, list[str]]:
    """The triton backend's launcher for sm_90 with a recording executor: (launcher, the kernels launched)."""
    from attnkit.backends.triton import launch

    launched: list[str] = []

    class Recording(launch.KernelExecutor):
        interpreted = False

        def launch(self, kernel: Any, grid: Any, args: Any, constants: Any, options: Any) -> None:
            launched.append(str(kernel))

    autotuner = launch.Autotuner(timer=lambda run: 1.0, records=launch.TileRecords(enabled=lambda: False))
    target = launch.Target(compiled=True, arch="sm_90")
    return launch.TritonLauncher(target=target, executor=Recording(), autotuner=autotuner), launched


def recording_cupy() -> tuple[Any, list[str]]:
    """The cupy backend's launcher (its GPU tiles, -D options and shared memory) with a recording launch."""
    from attnkit.backends.cupy import launch

    launched: list[str] = []

    class Recording:
        name, device = "recording", "cuda"

        def unavailable(self) -> list[str]:
            return []

        def tile(self, kernel: str, head_dim: int, dtype: str) -> Any:
            return launch.gpu_tile(kernel, head_dim, dtype)

        def launch(
            self, kernel: Any, options: Any, grid: Any, block: Any, shared: int, args: Any, program: str = ""
        ) -> None:
            launched.append(str(kernel))

    return launch.CudaKernels(Recording()), launched


def decode_inputs(paged: bool) -> Any:
    """The decode call's inputs (uninitialised: nothing reads them)."""
    from attnkit.backend import AttentionInputs, PagedInputs

    q = torch.empty(BATCH, HEADS, LEN_Q, HEAD_DIM, dtype=torch.bfloat16)  # bhsd, the default layout
    if not paged:
        k, v = (torch.empty(BATCH, HEADS, LEN_K, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
        return AttentionInputs(q, k, v)
    blocks = BATCH * LEN_K // BLOCK_SIZE
    k_cache, v_cache = (torch.empty(blocks, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
    table = torch.arange(blocks, dtype=torch.int32).view(BATCH, -1)
    lengths = torch.full((BATCH,), LEN_K, dtype=torch.int32)
    return PagedInputs(q, k_cache, v_cache, table, lengths)


@contextmanager
def fake_gpu() -> Iterator[None]:
    """PROCESSORS SMs for split-K's rule (contract.kernels.decode_splits), as on a GPU."""
    import attnkit.contract.kernels as contract

    saved = contract._processors
    contract._processors = lambda device: PROCESSORS  # type: ignore[assignment]
    try:
        yield
    finally:
        contract._processors = saved


def decode_call(backend: str, paged: bool) -> tuple[Callable[[], Any], list[str]]:
    """(one decode forward as the backend's ``forward`` runs it, the list its launches are recorded in)."""
    from attnkit import AttentionSpec
    from attnkit.contract.kernels import attention_forward

    launcher, launched = recording_triton() if backend == "triton" else recording_cupy()
    spec, inputs = AttentionSpec(), decode_inputs(paged)

    def call() -> Any:
        with torch.no_grad():  # as KernelBackend.forward
            return attention_forward(launcher, spec, inputs)

    return call, launched


def count(backend: str, paged: bool) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """(the backend's launches by kernel, torch's kernel-launching ops by name) of one warm decode call."""
    call, launched = decode_call(backend, paged)
    call()
    launched.clear()
    with _DeviceOps() as ops:
        call()
    return collections.Counter(launched), ops.ops


def host_us(backend: str, paged: bool, repeats: int, calls: int) -> float:
    call, launched = decode_call(backend, paged)
    for _ in range(20):
        call()
    samples = []
    for _ in range(repeats):
        launched.clear()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    options = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the compiled plan is the one timed")
    torch.set_num_threads(1)
    with fake_gpu():
        print("| backend | cache | launches | torch kernels | host us/call |")
        print("|---|---|---|---|---|")
        for backend in ("triton", "cupy"):
            for paged in (False, True):
                launches, ops = count(backend, paged)
                us = host_us(backend, paged, options.repeats, options.calls)
                own = ", ".join(f"{name} ×{n}" for name, n in launches.items())
                around = ", ".join(f"{name} ×{n}" for name, n in sorted(ops.items())) or "none"
                print(f"| {backend} | {'paged 16' if paged else 'contiguous'} | {sum(launches.values())} ({own}) "
                      f"| {sum(ops.values())} ({around}) | {us:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
