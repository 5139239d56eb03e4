"""``attnkit bench --what masks``: ``attend`` with a boolean mask against ``F.scaled_dot_product_attention`` with the
same mask, at Hugging Face-like shapes, as paired ratios (issue 16); and the peak memory of softcap with a mask,
served by cpu-flash's fused kernel, against torch-naive's (B, H, L, L) scores.

The masks: ``hf-4d``, causal attention over a left-padded batch as the (B, 1, L, L) boolean mask Hugging Face
passes to SDPA; ``hf-keypad``, the same visibility as ``causal=True`` with the (B, 1, 1, L) key-padding mask (SDPA
takes no ``is_causal`` beside a mask, so its side gets the (B, 1, L, L) mask, built before timing); ``random``, a
(B, 1, L, L) mask with every pair visible at probability 1/2.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from attnkit.bench.calls import random_inputs
from attnkit.bench.peak_memory import print_peak, run_child
from attnkit.bench.timing import device_banner, environment, interleaved, paired_ratio
from attnkit.tables import format_table

MASK_SHAPE = {"batch": 4, "heads": 8, "head_dim": 64}
MASK_SEQ_LENS = (64, 512, 2048)
MASK_HEADS_KV = (8, 2)
MASK_KINDS = ("hf-4d", "hf-keypad", "random")
PASSES = ("fwd", "fwd+bwd")
MEMORY_SHAPE = {"batch": 1, "heads": 8, "head_dim": 64}
MEMORY_SOFTCAP = 30.0
MEMORY_SEQ_LENS = (1024, 2048)
MEMORY_BACKENDS = ("cpu-flash", "torch-naive")
_MEMORY_CHILD = "import sys; from attnkit.bench.masks import _memory_child as m; m(sys.argv[1], int(sys.argv[2]))"


def left_padding(batch: int, seq_len: int) -> Any:
    """(B, L) bool: element b's first b·L/(2B) positions are padding (element 0 has none)."""
    import torch

    pads = torch.tensor([b * seq_len // (2 * batch) for b in range(batch)])
    return torch.arange(seq_len).view(1, -1) >= pads.view(-1, 1)


def masked_call(kind: str, seq_len: int) -> tuple[Any, Any, Any]:
    """(spec, the mask attend takes, the mask SDPA takes) for one kind of mask."""
    import torch

    import attnkit

    batch = MASK_SHAPE["batch"]
    if kind == "random":
        generator = torch.Generator().manual_seed(1)
        mask = torch.rand(batch, 1, seq_len, seq_len, generator=generator) < 0.5
        return attnkit.AttentionSpec(), mask, mask
    keys = left_padding(batch, seq_len)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    full = (causal & keys.view(batch, 1, seq_len)).unsqueeze(1)  # (B, 1, L, L), as Hugging Face builds it
    if kind == "hf-4d":
        return attnkit.AttentionSpec(), full, full
    return attnkit.AttentionSpec(causal=True), keys.view(batch, 1, 1, seq_len), full


def _cell(kind: str, seq_len: int, heads_kv: int, pass_name: str, repeats: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import attnkit

    batch, heads, head_dim = MASK_SHAPE["batch"], MASK_SHAPE["heads"], MASK_SHAPE["head_dim"]
    q, k, v, dout = random_inputs("torch", (batch, heads, seq_len, head_dim), (batch, heads_kv, seq_len, head_dim))
    spec, mask, sdpa_mask = masked_call(kind, seq_len)
    grouped = heads_kv != heads
    implementations: dict[str, Callable[..., Any]] = {
        "attend": lambda q, k, v: attnkit.attend(spec, q, k, v, mask=mask),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, enable_gqa=grouped),
    }
    if pass_name == "fwd":
        functions = {name: (lambda f=f: f(q, k, v)) for name, f in implementations.items()}
        contexts = dict.fromkeys(implementations, torch.no_grad)
    else:
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        functions = {
            name: (lambda f=f: torch.autograd.grad(f(*leaves), leaves, dout)) for name, f in implementations.items()
        }
        contexts = {}
    samples = interleaved(functions, repeats, warmup, contexts=contexts)
    chosen = attnkit.explain(spec, q, k, v, mask=mask)  # q requires grad in the fwd+bwd cells only
    return {
        "mask": kind,
        "len": seq_len,
        "heads_kv": heads_kv,
        "pass": pass_name,
        "backend": next(line.split()[1] for line in chosen.splitlines() if line.startswith("->")),
        "sdpa_ms": statistics.median(samples["sdpa"]) / 1e6,
        "ratio": paired_ratio(samples, "attend", "sdpa"),
    }


def bench_masks(
    seq_lens: tuple[int, ...] = MASK_SEQ_LENS,
    repeats: int = 5,
    warmup: int = 1,
    memory: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Paired attend/SDPA time ratios per (mask, L, Hkv, pass), float32 on the CPU; with ``memory``, the peak extra
    memory of softcap + mask forward+backward through cpu-flash and torch-naive (each in a fresh process)."""
    cells = []
    for seq_len in seq_lens:
        for heads_kv in MASK_HEADS_KV:
            for kind in MASK_KINDS:
                for pass_name in PASSES:
                    if progress:
                        progress(f"{kind} L={seq_len} Hkv={heads_kv} {pass_name}")
                    cells.append(_cell(kind, seq_len, heads_kv, pass_name, repeats, warmup))
    result: dict[str, Any] = {
        "what": "masks",
        "environment": environment("cpu"),
        "shape": {**MASK_SHAPE, "dtype": "float32"},
        "repeats": repeats,
        "warmup": warmup,
        "cells": cells,
    }
    if memory:
        result["memory"] = bench_softcap_mask_memory()
    return result


def _memory_child(name: str, seq_len: int) -> None:
    """In a fresh process: print the peak RSS growth of one softcap + mask forward+backward through ``name``."""
    import torch

    import attnkit

    torch.set_num_threads(1)
    batch, heads, head_dim = MEMORY_SHAPE["batch"], MEMORY_SHAPE["heads"], MEMORY_SHAPE["head_dim"]
    spec = attnkit.AttentionSpec(softcap=MEMORY_SOFTCAP)

    def run(length: int) -> Callable[[], None]:
        shape = (batch, heads, length, head_dim)
        q, k, v, dout = random_inputs("torch", shape, shape)
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        mask = torch.ones(length, length, dtype=torch.bool).tril() & left_padding(batch, length).unsqueeze(1)
        return lambda: attnkit.attend(spec, *leaves, mask=mask.unsqueeze(1), backend=name).backward(dout)

    run(64)()  # load modules and kernels before measuring
    call = run(seq_len)
    print_peak(call)


def bench_softcap_mask_memory(seq_lens: tuple[int, ...] = MEMORY_SEQ_LENS) -> list[dict[str, Any]]:
    """Peak extra host memory of softcap + (B, 1, L, L) mask, forward+backward, per backend and L."""
    rows = []
    for seq_len in seq_lens:
        for name in MEMORY_BACKENDS:
            measured = run_child(_MEMORY_CHILD, [name, str(seq_len)], f"{name} L={seq_len}")
            rows.append({"backend": name, "len": seq_len, **measured})
    return rows


def format_masks(result: dict[str, Any]) -> str:
    shape = result["shape"]
    lines = [
        device_banner(result),
        f"attend(mask=...) / F.scaled_dot_product_attention(attn_mask=...): B={shape['batch']}, H={shape['heads']}, "
        f"D={shape['head_dim']}, {shape['dtype']}; paired ratio = median over {result['repeats']} interleaved "
        "repeats of attend's time / SDPA's in the same repeat",
    ]
    header = ["mask", "L", "Hkv", "pass", "auto runs", "sdpa ms", "attend / sdpa"]
    rows = [
        [
            c["mask"],
            str(c["len"]),
            str(c["heads_kv"]),
            c["pass"],
            c["backend"],
            f"{c['sdpa_ms']:.3g}",
            f"{c['ratio']:.3f}",
        ]
        for c in result["cells"]
    ]
    lines.append(format_table(header, rows))
    if "memory" in result:
        memory = MEMORY_SHAPE
        lines.append(
            f"\npeak extra memory, softcap={MEMORY_SOFTCAP} + (B, 1, L, L) bool mask, forward+backward, "
            f"B={memory['batch']}, H={memory['heads']}, D={memory['head_dim']}, float32 (fresh process each)"
        )
        memory_rows = [[m["backend"], str(m["len"]), f"{m['peak_extra_bytes'] / 2**20:.1f}"] for m in result["memory"]]
        lines.append(format_table(["backend", "L", "peak extra MiB"], memory_rows))
    return "\n".join(lines)
