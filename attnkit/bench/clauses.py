"""``attnkit bench --what clauses``: what a sink (§15) or ALiBi (§16) costs over the same call without it, as paired
ratios on one backend (cpu-flash by default: the CPU kernel), and the peak memory of a sink fine-tuning step
(forward+backward with ``sinks`` requiring grad) against L, which is linear when nothing of size (L, L) is made.

Issue 31's bar: at most 5% over the plain call. A sink is composed after the backend from its differentiable lse
(one elementwise pass over out and lse); ALiBi is computed in the kernel from positions.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from attnkit.bench.calls import random_inputs
from attnkit.bench.peak_memory import print_peak, run_child
from attnkit.bench.timing import device_banner, environment, interleaved, paired_ratio
from attnkit.tables import format_table

SHAPE = {"batch": 1, "heads": 8, "head_dim": 64}
SEQ_LENS = (512, 2048)
CLAUSES = ("sinks", "alibi")
PASSES = ("fwd", "fwd+bwd")
MEMORY_SEQ_LENS = (1024, 2048, 4096)
_MEMORY_CHILD = (
    "import sys; from attnkit.bench.clauses import _memory_child as m; m(sys.argv[1], int(sys.argv[2]), sys.argv[3])"
)


def _clause_arguments(clause: str, heads: int, requires_grad: bool) -> dict[str, Any]:
    """The attend keyword a clause adds: ALiBi's geometric slopes 2^(−8h/H), or sinks (learnable in fwd+bwd)."""
    import torch

    if clause == "alibi":
        return {"alibi_slopes": torch.exp2(-8.0 * torch.arange(1, heads + 1) / heads)}
    return {"sinks": torch.zeros(heads).requires_grad_(requires_grad)}


def _cell(backend: str, seq_len: int, causal: bool, pass_name: str, repeats: int, warmup: int) -> dict[str, Any]:
    import torch

    import attnkit

    batch, heads, head_dim = SHAPE["batch"], SHAPE["heads"], SHAPE["head_dim"]
    shape = (batch, heads, seq_len, head_dim)
    q, k, v, dout = random_inputs("torch", shape, shape)
    spec = attnkit.AttentionSpec(causal=causal)
    grad = pass_name == "fwd+bwd"
    leaves = [t.requires_grad_(grad) for t in (q, k, v)]
    calls: dict[str, dict[str, Any]] = {"plain": {}}
    calls.update((clause, _clause_arguments(clause, heads, grad)) for clause in CLAUSES)

    def run(extra: dict[str, Any]) -> Callable[[], Any]:
        if not grad:
            return lambda: attnkit.attend(spec, *leaves, backend=backend, **extra)
        wrt = leaves + [value for value in extra.values() if value.requires_grad]
        return lambda: torch.autograd.grad(attnkit.attend(spec, *leaves, backend=backend, **extra), wrt, dout)

    functions = {name: run(extra) for name, extra in calls.items()}
    contexts = {} if grad else dict.fromkeys(functions, torch.no_grad)
    samples = interleaved(functions, repeats, warmup, contexts=contexts)
    return {
        "len": seq_len,
        "causal": causal,
        "pass": pass_name,
        "plain_ms": statistics.median(samples["plain"]) / 1e6,
        **{clause: paired_ratio(samples, clause, "plain") for clause in CLAUSES},
    }


def bench_clauses(
    backend: str = "cpu-flash",
    seq_lens: tuple[int, ...] = SEQ_LENS,
    repeats: int = 7,
    warmup: int = 1,
    memory: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Paired (call with the clause) / (plain call) time ratios per (L, causal, pass), float32 on the CPU; with
    ``memory``, the peak extra memory of a sink fine-tuning step per L (a fresh process each)."""
    cells = []
    for seq_len in seq_lens:
        for causal in (False, True):
            for pass_name in PASSES:
                if progress:
                    progress(f"L={seq_len} causal={causal} {pass_name}")
                cells.append(_cell(backend, seq_len, causal, pass_name, repeats, warmup))
    result: dict[str, Any] = {
        "what": "clauses",
        "environment": environment("cpu"),
        "backend": backend,
        "shape": {**SHAPE, "dtype": "float32"},
        "repeats": repeats,
        "warmup": warmup,
        "cells": cells,
    }
    if memory:
        result["memory"] = [
            {"len": seq_len, **run_child(_MEMORY_CHILD, [backend, str(seq_len), "sinks"], f"sinks L={seq_len}")}
            for seq_len in MEMORY_SEQ_LENS
        ]
    return result


def _memory_child(backend: str, seq_len: int, clause: str) -> None:
    """In a fresh process: print the peak RSS growth of one causal forward+backward with the clause (learnable sinks)
    through ``backend``."""
    import torch

    import attnkit

    torch.set_num_threads(1)
    spec = attnkit.AttentionSpec(causal=True)

    def run(length: int) -> Callable[[], None]:
        shape = (SHAPE["batch"], SHAPE["heads"], length, SHAPE["head_dim"])
        q, k, v, dout = random_inputs("torch", shape, shape)
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        extra = _clause_arguments(clause, SHAPE["heads"], requires_grad=True)
        return lambda: attnkit.attend(spec, *leaves, backend=backend, **extra).backward(dout)

    run(64)()  # load modules and kernels before measuring
    print_peak(run(seq_len))


def format_clauses(result: dict[str, Any]) -> str:
    shape = result["shape"]
    lines = [
        device_banner(result),
        f"attend on {result['backend']} with sinks= or alibi_slopes= / the same call without: B={shape['batch']}, "
        f"H={shape['heads']}, D={shape['head_dim']}, {shape['dtype']}; paired ratio = median over "
        f"{result['repeats']} interleaved repeats of the call's time / the plain call's in the same repeat",
    ]
    header = ["L", "causal", "pass", "plain ms", *(f"{clause} / plain" for clause in CLAUSES)]
    rows = [
        [str(c["len"]), "yes" if c["causal"] else "no", c["pass"], f"{c['plain_ms']:.3g}",
         *(f"{c[clause]:.3f}" for clause in CLAUSES)]
        for c in result["cells"]
    ]  # fmt: skip
    lines.append(format_table(header, rows))
    if "memory" in result:
        lines.append(
            f"\npeak extra memory of a sink fine-tuning step (causal forward+backward, sinks requiring grad) on "
            f"{result['backend']}, B={shape['batch']}, H={shape['heads']}, D={shape['head_dim']}, float32 (fresh "
            "process each): linear in L when no (L, L) tensor is made"
        )
        memory_rows = [[str(m["len"]), f"{m['peak_extra_bytes'] / 2**20:.1f}"] for m in result["memory"]]
        lines.append(format_table(["L", "peak extra MiB"], memory_rows))
    return "\n".join(lines)
