"""torch-flex against torch SDPA (plain top-left causal) and torch-chunked, at B=1 H=8 D=64 (docs/native.md).

    python scripts/bench_flex.py --threads 1 --dtype float32 --lengths 512 2048 4096

One process per thread count: inductor bakes the thread count into the kernels it compiles. Each timing is the
median of ``--repeats`` calls after one warm-up call (which compiles); fwd is the inference call (no lse, no
grad), fwd+bwd is ``attend`` with q, k, v requiring grad, then ``backward`` of ``out.sum()``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit
from attnkit import AttentionSpec

SOFTCAP = 30.0
WINDOW = 256


def timed(function: Callable[[], object], repeats: int) -> float:
    function()  # warm-up: compiles torch-flex for this shape
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scenarios(length: int) -> dict[str, tuple[AttentionSpec, int, int, dict[str, int]]]:
    """name -> (spec, Lq, Lk, extra): the specs SDPA cannot do natively, and plain causal."""
    return {
        "causal": (AttentionSpec(causal=True), length, length, {}),
        "causal+softcap": (AttentionSpec(causal=True, softcap=SOFTCAP), length, length, {}),
        f"causal window {WINDOW}": (AttentionSpec(causal=True, window=(WINDOW, 0)), length, length, {}),
        "kv_lengths 3L/4": (AttentionSpec(), length, length, {"kv_length": 3 * length // 4}),
        "bottom-right Lq=L/2": (AttentionSpec(causal=True), length // 2, length, {}),
    }


def run_attend(
    spec: AttentionSpec, len_q: int, len_k: int, extra: dict[str, int], dtype: torch.dtype, backend: str, grad: bool
) -> Callable[[], object]:
    q = torch.randn(1, 8, len_q, 64, dtype=dtype, requires_grad=grad)
    k = torch.randn(1, 8, len_k, 64, dtype=dtype, requires_grad=grad)
    v = torch.randn(1, 8, len_k, 64, dtype=dtype, requires_grad=grad)
    kv_lengths = torch.tensor([extra["kv_length"]]) if "kv_length" in extra else None

    def call() -> object:
        out = attnkit.attend(spec, q, k, v, kv_lengths=kv_lengths, backend=backend)
        if grad:
            out.sum().backward()
        return out

    return call


def run_sdpa(length: int, dtype: torch.dtype, grad: bool) -> Callable[[], object]:
    q, k, v = (torch.randn(1, 8, length, 64, dtype=dtype, requires_grad=grad) for _ in range(3))

    def call() -> object:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if grad:
            out.sum().backward()
        return out

    return call


def decode_overhead(dtype: torch.dtype, calls: int) -> None:
    """Per-call time at decode size (Lq=1, Lk=128, bottom-right causal: the query sees every key)."""
    q = torch.randn(1, 8, 1, 64, dtype=dtype)
    k, v = (torch.randn(1, 8, 128, 64, dtype=dtype) for _ in range(2))
    spec = AttentionSpec(causal=True)
    candidates: dict[str, Callable[[], object]] = {
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, k, v),
        "attend torch-sdpa": lambda: attnkit.attend(spec, q, k, v, backend="torch-sdpa"),
        "attend torch-flex": lambda: attnkit.attend(spec, q, k, v, backend="torch-flex"),
        "attend torch-flex, return_lse": lambda: attnkit.attend(spec, q, k, v, return_lse=True, backend="torch-flex"),
        "attend torch-chunked": lambda: attnkit.attend(spec, q, k, v, backend="torch-chunked"),
    }
    for name, call in candidates.items():
        print(f"decode Lq=1 Lk=128 {name:32s} {timed(call, calls) * 1e6:9.1f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--no-chunked", action="store_true", help="leave torch-chunked out")
    parser.add_argument("--decode", action="store_true", help="only the per-call time at decode size")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    print(
        f"# torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, threads={args.threads}, "
        f"dtype={args.dtype}, B=1 H=8 D=64; load average {os.getloadavg()[0]:.2f}"
    )
    if args.decode:
        decode_overhead(dtype, calls=200)
        return
    modes = [("fwd", False)] + ([] if args.no_backward else [("fwd+bwd", True)])
    backends = ["torch-flex"] + ([] if args.no_chunked else ["torch-chunked"])
    results = []
    for length in args.lengths:
        for mode, grad in modes:
            sdpa = timed(run_sdpa(length, dtype, grad), args.repeats)
            for name, (spec, len_q, len_k, extra) in scenarios(length).items():
                row = {"L": length, "mode": mode, "scenario": name, "sdpa_causal_s": sdpa}
                for backend in backends:
                    start = time.perf_counter()
                    seconds = timed(run_attend(spec, len_q, len_k, extra, dtype, backend, grad), args.repeats)
                    row[f"{backend}_s"] = seconds
                    row[f"{backend}_ratio"] = sdpa / seconds  # throughput relative to SDPA plain causal
                    row[f"{backend}_first_call_s"] = time.perf_counter() - start - seconds * args.repeats
                results.append(row)
                cells = "  ".join(f"{b} {row[f'{b}_s'] * 1e3:8.1f} ms (x{row[f'{b}_ratio']:.2f})" for b in backends)
                print(f"L={length:5d} {mode:8s} {name:22s} sdpa {sdpa * 1e3:8.1f} ms  {cells}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
