"""The decode call's kernels and the autotune records on a GPU, in one short run (docs/gpu.md, "Beyond
gpu_check.sh"). CUDA only.

    python scripts/gpu_decode_and_tiles.py decode     # triton's split-K + combine against SDPA, its kernels
    python scripts/gpu_decode_and_tiles.py tiles DIR  # run twice with the same DIR: the second must not autotune

``decode``: B = 1, Hq = 32, Lq = 1, Lk = 8192, D = 128, bf16, contiguous and paged (16-token blocks, shuffled table,
ragged lengths), on triton and cupy against torch-sdpa's result (max |error| each; bf16's tolerance is about 1e-2 at
these values), the CUDA kernels one call launches (torch.profiler: triton must show its forward and
_merge_splits_kernel, nothing else), and each backend's median time over 50 calls (CUDA events).
``tiles DIR``: the first call's seconds at a prefill shape with ATTNKIT_AUTOTUNE_DIR=DIR and measuring on; a first
process autotunes (seconds) and writes DIR/triton-tiles/*.json, a second one reads them (its first call within a few
times a warm call's time) and adds no file.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path


def decode() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import attnkit

    torch.manual_seed(0)
    spec, device, dtype = attnkit.AttentionSpec(), "cuda", torch.bfloat16
    q = torch.randn(1, 32, 1, 128, device=device, dtype=dtype)
    k, v = (torch.randn(1, 32, 8192, 128, device=device, dtype=dtype) for _ in range(2))
    blocks = 8192 // 16
    k_cache = k[0].permute(1, 0, 2).reshape(blocks, 16, 32, 128)
    v_cache = v[0].permute(1, 0, 2).reshape(blocks, 16, 32, 128)
    order = torch.randperm(blocks, device=device)
    k_shuffled, v_shuffled = torch.empty_like(k_cache), torch.empty_like(v_cache)
    k_shuffled[order], v_shuffled[order] = k_cache, v_cache
    table = order.view(1, blocks).to(torch.int32)
    lengths = torch.tensor([8000], device=device, dtype=torch.int32)
    calls = {
        "contiguous": lambda name: attnkit.attend(spec, q, k, v, backend=name),
        "paged": lambda name: attnkit.attend_paged(spec, q, k_shuffled, v_shuffled, table, lengths, backend=name),
    }
    references = {  # the same keys, contiguous, on SDPA
        "contiguous": attnkit.attend(spec, q, k, v, backend="torch-sdpa").float(),
        "paged": attnkit.attend(spec, q, k[:, :, :8000], v[:, :, :8000], backend="torch-sdpa").float(),
    }
    for cache, call in calls.items():
        reference = references[cache]
        for name in ("triton", "cupy", "torch-sdpa"):
            try:
                out = call(name)
            except Exception as error:  # noqa: BLE001  a refusal or failure is a result to report
                print(f"{cache:10} {name:10} failed: {type(error).__name__}: {error}")
                continue
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as traced:
                call(name)
                torch.cuda.synchronize()
            kernels = [event.name for event in traced.events() if event.device_type.name == "CUDA"]
            times = []
            for _ in range(50):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call(name)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1000.0)
            worst = (out.float() - reference).abs().max().item()
            print(f"{cache:10} {name:10} max|err| {worst:.3g}  {statistics.median(times):8.1f} us  "
                  f"{len(kernels)} kernels: {', '.join(sorted(set(kernels)))}")  # fmt: skip


def tiles(directory: str) -> None:
    os.environ["ATTNKIT_AUTOTUNE_DIR"] = directory
    os.environ["ATTNKIT_AUTOTUNE"] = "1"
    import torch

    import attnkit

    records = Path(directory) / "triton-tiles"
    before = sorted(records.glob("*.json")) if records.is_dir() else []
    q, k, v = (torch.randn(2, 16, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    spec = attnkit.AttentionSpec(causal=True)
    seconds = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        attnkit.attend(spec, q, k, v, backend="triton")
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    after = sorted(records.glob("*.json")) if records.is_dir() else []
    print(f"records before {len(before)}, after {len(after)}; first call {seconds[0]:.3f} s, then "
          f"{seconds[1] * 1e3:.2f} ms, {seconds[2] * 1e3:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["decode"]:
        decode()
    elif sys.argv[1:2] == ["tiles"] and len(sys.argv) == 3:
        tiles(sys.argv[2])
    else:
        raise SystemExit(__doc__)
