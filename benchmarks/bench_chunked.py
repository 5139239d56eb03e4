"""torch-chunked against torch SDPA and torch-naive: causal forward+backward time, and peak extra memory.

    python benchmarks/bench_chunked.py [--length 4096] [--memory-length 16384] [--repeats 5] [--threads N]

Time: median wall-clock of ``--repeats`` forward+backward runs after one warm-up, all backends in one process
on the same inputs (B=1, H=8, D=64, float32, causal). Memory: each backend runs once in a fresh subprocess;
the kernel's peak-RSS mark is reset (``echo 5 > /proc/self/clear_refs``) after the inputs exist, and the
result is VmHWM after forward+backward minus VmRSS before it (Linux only). That counts everything the call
touches: its outputs, the gradients and all temporaries, but not q, k, v themselves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit

BATCH, HEADS, HEAD_DIM = 1, 8, 64
SPEC = attnkit.AttentionSpec(causal=True)


def _inputs(length: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(BATCH, HEADS, length, HEAD_DIM, requires_grad=True) for _ in range(3))


def _step(backend: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """One forward+backward of ``backend`` ("sdpa" or an attnkit backend name)."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if backend == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = attnkit.attend(SPEC, q, k, v, backend=backend)
        out.backward(torch.ones_like(out))
        for tensor in (q, k, v):
            tensor.grad = None

    return run


def _time(backend: str, length: int, repeats: int) -> list[float]:
    q, k, v = _inputs(length)
    step = _step(backend)
    step(q, k, v)  # warm-up: first-call imports and allocator growth
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(q, k, v)
        times.append(time.perf_counter() - start)
    return times


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_child(backend: str, length: int) -> None:
    """Runs in a fresh process: prints the peak RSS growth (bytes) of one forward+backward as JSON."""
    step = _step(backend)
    step(*_inputs(64))  # load every module and kernel first, so their pages are not counted
    q, k, v = _inputs(length)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    step(q, k, v)
    seconds = time.perf_counter() - start
    print(json.dumps({"peak_extra_bytes": (_status_kib("VmHWM") - before) * 1024, "seconds": seconds}))


def _memory(backend: str, length: int, threads: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--memory-child", backend, "--memory-length", str(length)]
    command += ["--threads", str(threads)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096, help="sequence length for the timing table")
    parser.add_argument("--memory-length", type=int, default=16384, help="sequence length for the memory table")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--memory-child", metavar="BACKEND", help=argparse.SUPPRESS)
    parser.add_argument("--memory-sdpa", action="store_true", help="also measure SDPA's memory at --memory-length")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        _memory_child(args.memory_child, args.memory_length)
        return

    print(f"torch {torch.__version__}, {args.threads} threads; B={BATCH} H={HEADS} D={HEAD_DIM} float32 causal")
    print(f"\nforward+backward at L={args.length}: median of {args.repeats} after 1 warm-up (wall-clock seconds)")
    print(f"{'backend':<16}{'median':>9}{'min':>9}{'max':>9}{'vs sdpa':>9}")
    medians = {}
    for backend in ("sdpa", "torch-chunked", "torch-naive"):
        times = _time(backend, args.length, args.repeats)
        medians[backend] = statistics.median(times)
        ratio = medians[backend] / medians["sdpa"]
        print(f"{backend:<16}{medians[backend]:>9.3f}{min(times):>9.3f}{max(times):>9.3f}{ratio:>8.2f}x")

    print(f"\npeak extra memory, forward+backward at L={args.memory_length} (VmHWM − VmRSS, fresh process each)")
    print(f"{'backend':<16}{'MiB':>9}{'seconds':>9}")
    for backend in ("torch-chunked", "sdpa") if args.memory_sdpa else ("torch-chunked",):
        measured = _memory(backend, args.memory_length, args.threads)
        print(f"{backend:<16}{measured['peak_extra_bytes'] / 2**20:>9.0f}{measured['seconds']:>9.2f}")
    score_bytes = BATCH * HEADS * args.memory_length**2 * 4
    print(f"(for scale: one float32 (B, H, L, L) score matrix at this length is {score_bytes / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
