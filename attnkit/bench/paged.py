"""``attnkit bench --what paged``: decode over a paged KV cache (docs/semantics.md §13) against the same backend's
contiguous-cache call, as paired ratios (issue 17: within 1.25×).

B=8 sequences, one new query each (Lq=1, causal), Hq = Hkv = 8, D=128, float32, every sequence Lk keys long. The
paged side reads a cache of B·Lk/block_size blocks through a table that is a random permutation of them (no two
neighbours in a sequence are neighbours in memory); the contiguous side is ``attend(spec, q, k, v,
kv_lengths=...)`` on bhsd k, v (B, Hkv, Lk, D), the layout cpu-flash reads without a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnkit.bench.timing import device_banner, environment, in_ms, interleaved, paired_ratio
from attnkit.tables import format_table

PAGED_SHAPE = {"batch": 8, "heads_q": 8, "heads_kv": 8, "head_dim": 128, "len_q": 1}
PAGED_SEQ_LENS = (1024, 8192, 32768)
PAGED_BLOCK_SIZES = (16, 256)
PAGED_BACKENDS = ("cpu-flash", "torch-chunked")


def _calls(backend: str, seq_len: int, block_size: int) -> dict[str, Callable[[], Any]]:
    import torch

    import attnkit

    batch, heads_q, heads_kv, head_dim, len_q = (PAGED_SHAPE[key] for key in PAGED_SHAPE)
    generator = torch.Generator().manual_seed(0)
    spec = attnkit.AttentionSpec(causal=True)
    q = torch.randn(batch, heads_q, len_q, head_dim, generator=generator)
    k, v = (torch.randn(batch, heads_kv, seq_len, head_dim, generator=generator) for _ in range(2))
    lengths = torch.full((batch,), seq_len)
    num_blocks = batch * seq_len // block_size
    k_cache, v_cache = (torch.randn(num_blocks, block_size, heads_kv, head_dim, generator=generator) for _ in range(2))
    table = torch.randperm(num_blocks, generator=generator).to(torch.int32).view(batch, -1)
    return {
        "paged": lambda: attnkit.attend_paged(spec, q, k_cache, v_cache, table, lengths, backend=backend),
        "contiguous": lambda: attnkit.attend(spec, q, k, v, kv_lengths=lengths, backend=backend),
    }


def bench_paged(
    backends: tuple[str, ...] = PAGED_BACKENDS,
    seq_lens: tuple[int, ...] = PAGED_SEQ_LENS,
    block_sizes: tuple[int, ...] = PAGED_BLOCK_SIZES,
    repeats: int = 5,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Per (backend, Lk, block size): median ms of the paged and contiguous calls and their paired ratio."""
    cells = []
    for backend in backends:
        for seq_len in seq_lens:
            for block_size in block_sizes:
                if progress:
                    progress(f"{backend} Lk={seq_len} block_size={block_size}")
                samples = interleaved(_calls(backend, seq_len, block_size), repeats=repeats, warmup=warmup, calls=1)
                ms = in_ms(samples)
                cells.append(
                    {
                        "backend": backend,
                        "seq_len": seq_len,
                        "block_size": block_size,
                        "paged_ms": sorted(ms["paged"])[len(ms["paged"]) // 2],
                        "contiguous_ms": sorted(ms["contiguous"])[len(ms["contiguous"]) // 2],
                        "ratio": paired_ratio(samples, "paged", "contiguous"),
                    }
                )
    return {
        "what": "paged",
        "environment": environment("cpu"),
        "shape": {**PAGED_SHAPE, "dtype": "float32"},
        "repeats": repeats,
        "cells": cells,
    }


def format_paged(result: dict[str, Any]) -> str:
    rows = [
        [
            cell["backend"],
            str(cell["seq_len"]),
            str(cell["block_size"]),
            f"{cell['paged_ms']:.2f}",
            f"{cell['contiguous_ms']:.2f}",
            f"{cell['ratio']:.2f}x",
        ]
        for cell in result["cells"]
    ]
    headers = ["backend", "Lk", "block", "paged ms", "contiguous ms", "paged/contiguous"]
    shape = result["shape"]
    title = (
        f"paged decode vs the contiguous cache: B={shape['batch']} Lq=1 Hq={shape['heads_q']} "
        f"Hkv={shape['heads_kv']} D={shape['head_dim']} {shape['dtype']}, causal; median of {result['repeats']} "
        "interleaved repeats, paired ratios"
    )
    return "\n".join([device_banner(result), title, format_table(headers, rows)])
