"""``attnkit bench --what clauses``: what a sink (§15), ALiBi (§16) or dropout (§18, p = 0.1) costs over the same
call without it, as paired ratios on one backend (cpu-flash by default: the CPU kernel), and the peak memory of a
fine-tuning step with a sink (``sinks`` requiring grad) or dropout (forward+backward) against L, which is linear when
nothing of size (L, L) is made.

Issue 31's bar: at most 5% over the plain call. A sink is composed after the backend from its differentiable lse
(one elementwise pass over out and lse); ALiBi is computed in the kernel from positions; dropout's keep-mask is
generated in the kernel from its seed (Philox), in the forward and again in the backward.
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
DTYPES = ("float32",)
CLAUSES = ("sinks", "alibi", "dropout")
PASSES = ("fwd", "fwd+bwd")
MEMORY_SEQ_LENS = (1024, 2048, 4096)
MEMORY_CLAUSES = ("sinks", "dropout")
DROPOUT_P = 0.1
DROPOUT_SEED = 0x5EED
_MEMORY_CHILD = (
    "import sys; from attnkit.bench.clauses import _memory_child as m; m(sys.argv[1], int(sys.argv[2]), sys.argv[3])"
)


def _clause_arguments(clause: str, heads: int, requires_grad: bool) -> dict[str, Any]:
    """The attend keywords a clause adds: ALiBi's geometric slopes 2^(−8h/H), sinks (learnable in fwd+bwd), or
    dropout with p = DROPOUT_P and a fixed seed."""
    import torch

    if clause == "alibi":
        return {"alibi_slopes": torch.exp2(-8.0 * torch.arange(1, heads + 1) / heads)}
    if clause == "dropout":
        return {"dropout_p": DROPOUT_P, "dropout_seed": DROPOUT_SEED}
    return {"sinks": torch.zeros(heads).requires_grad_(requires_grad)}


def _learnable(extra: dict[str, Any]) -> list[Any]:
    """The clause's tensors that take a gradient (learnable sinks)."""
    return [value for value in extra.values() if getattr(value, "requires_grad", False)]


def _cell(
    backend: str, seq_len: int, dtype: str, causal: bool, pass_name: str, repeats: int, warmup: int
) -> dict[str, Any]:
    import torch

    import attnkit

    batch, heads, head_dim = SHAPE["batch"], SHAPE["heads"], SHAPE["head_dim"]
    shape = (batch, heads, seq_len, head_dim)
    q, k, v, dout = random_inputs("torch", shape, shape, dtype)
    spec = attnkit.AttentionSpec(causal=causal)
    grad = pass_name == "fwd+bwd"
    leaves = [t.requires_grad_(grad) for t in (q, k, v)]
    calls: dict[str, dict[str, Any]] = {"plain": {}}
    calls.update((clause, _clause_arguments(clause, heads, grad)) for clause in CLAUSES)

    def run(extra: dict[str, Any]) -> Callable[[], Any]:
        if not grad:
            return lambda: attnkit.attend(spec, *leaves, backend=backend, **extra)
        wrt = leaves + _learnable(extra)
        return lambda: torch.autograd.grad(attnkit.attend(spec, *leaves, backend=backend, **extra), wrt, dout)

    functions = {name: run(extra) for name, extra in calls.items()}
    contexts = {} if grad else dict.fromkeys(functions, torch.no_grad)
    samples = interleaved(functions, repeats, warmup, contexts=contexts)
    return {
        "len": seq_len,
        "dtype": dtype,
        "causal": causal,
        "pass": pass_name,
        "plain_ms": statistics.median(samples["plain"]) / 1e6,
        **{clause: paired_ratio(samples, clause, "plain") for clause in CLAUSES},
    }


def bench_clauses(
    backend: str = "cpu-flash",
    seq_lens: tuple[int, ...] = SEQ_LENS,
    dtypes: tuple[str, ...] = DTYPES,
    repeats: int = 7,
    warmup: int = 1,
    memory: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Paired (call with the clause) / (plain call) time ratios per (L, dtype, causal, pass) on the CPU; with
    ``memory``, the peak extra memory of a float32 fine-tuning step with each of MEMORY_CLAUSES per L (a fresh process
    each)."""
    cells = []
    for seq_len in seq_lens:
        for dtype in dtypes:
            for causal in (False, True):
                for pass_name in PASSES:
                    if progress:
                        progress(f"L={seq_len} {dtype} causal={causal} {pass_name}")
                    cells.append(_cell(backend, seq_len, dtype, causal, pass_name, repeats, warmup))
    result: dict[str, Any] = {
        "what": "clauses",
        "environment": environment("cpu"),
        "backend": backend,
        "shape": SHAPE,
        "repeats": repeats,
        "warmup": warmup,
        "cells": cells,
    }
    if memory:
        result["memory"] = [
            {
                "len": seq_len,
                "clause": clause,
                **run_child(_MEMORY_CHILD, [backend, str(seq_len), clause], f"{clause} L={seq_len}"),
            }
            for seq_len in MEMORY_SEQ_LENS
            for clause in MEMORY_CLAUSES
        ]
    return result


def _memory_child(backend: str, seq_len: int, clause: str) -> None:
    """In a fresh process: print the peak RSS growth of one causal forward+backward with the clause (learnable sinks,
    or dropout) through ``backend``."""
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
        f"attend on {result['backend']} with sinks=, alibi_slopes= or dropout_p={DROPOUT_P} / the same call without: "
        f"B={shape['batch']}, H={shape['heads']}, D={shape['head_dim']}; paired ratio = median over "
        f"{result['repeats']} interleaved repeats of the call's time / the plain call's in the same repeat",
    ]
    header = ["L", "dtype", "causal", "pass", "plain ms", *(f"{clause} / plain" for clause in CLAUSES)]
    rows = [
        [str(c["len"]), c["dtype"], "yes" if c["causal"] else "no", c["pass"], f"{c['plain_ms']:.3g}",
         *(f"{c[clause]:.3f}" for clause in CLAUSES)]
        for c in result["cells"]
    ]  # fmt: skip
    lines.append(format_table(header, rows))
    if "memory" in result:
        lines.append(
            f"\npeak extra memory of a fine-tuning step (causal forward+backward; sinks requiring grad, or dropout) on "
            f"{result['backend']}, B={shape['batch']}, H={shape['heads']}, D={shape['head_dim']}, float32 (fresh "
            "process each): linear in L when no (L, L) tensor is made"
        )
        peaks = {(m["len"], m["clause"]): m["peak_extra_bytes"] / 2**20 for m in result["memory"]}
        lengths = sorted({length for length, _ in peaks})
        memory_rows = [[str(n), *(f"{peaks[n, clause]:.1f}" for clause in MEMORY_CLAUSES)] for n in lengths]
        lines.append(format_table(["L", *(f"{clause} MiB" for clause in MEMORY_CLAUSES)], memory_rows))
    return "\n".join(lines)
