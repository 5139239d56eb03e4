"""``attnkit bench --what masks --programs``: cpu-flash serving a mask program (its interpreter on PARTIAL tiles,
EMPTY tiles skipped) against torch's SDPA given the same visibility as a dense (B, 1, L, L) bool mask, and against
cpu-flash's own clause where one expresses the same mask, as paired ratios; then a sweep of the visible fraction, and
the tile classification's share of a call.

The programs: ``document-causal`` (8 equal documents, causal within each; natively segment ids + causal),
``prefix-lm`` (keys before L/4 seen by every query, causal after), ``chunked-causal`` (chunks of 1024, causal within
each; natively segment ids = the chunk + causal), ``local+global`` (bidirectional window of 128 plus 4 global tokens
seen by and seeing everyone; natively only the window, without the global tokens: close, not the same mask).

Every timed call is a public call: ``attnkit.attend(spec, q, k, v, mask_mod=..., backend="cpu-flash")`` (tracing
cached, the classes cached: what a training loop's later calls pay), torch's SDPA with the mask built before timing,
and torch's FlexAttention, compiled, with its block mask built before timing (``--peer flex``; its compile is not
timed).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

from attnkit.bench.calls import random_inputs
from attnkit.bench.peak_memory import print_peak, run_child
from attnkit.bench.timing import device_banner, environment, interleaved, paired_ratio
from attnkit.tables import format_table

PROGRAM_SHAPE = {"batch": 1, "heads": 4, "head_dim": 64}
PROGRAM_SEQ_LENS = (4096, 16384)
PROGRAM_KINDS = ("document-causal", "prefix-lm", "chunked-causal", "local+global")
PROGRAM_DTYPES = ("float32", "bfloat16")
PASSES = ("fwd", "fwd+bwd")
DOCUMENTS, CHUNK, WINDOW, GLOBAL_TOKENS = 8, 1024, 128, 4
#: Visible fractions of the sweep (a bidirectional window of about fraction · L keys per row).
FRACTIONS = (0.05, 0.1, 0.25, 0.5, 1.0)


def program(kind: str, seq_len: int) -> tuple[Callable[..., Any], Any, dict[str, Any]]:
    """(mask_mod, the spec of cpu-flash's native clause or None, that clause's AttentionInputs fields)."""
    import torch

    import attnkit

    positions = torch.arange(seq_len)
    if kind == "document-causal":
        doc = (positions * DOCUMENTS // seq_len).view(1, -1)

        def document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

        return document_causal, attnkit.AttentionSpec(causal=True), {"q_segment_ids": doc, "kv_segment_ids": doc}
    if kind == "prefix-lm":
        prefix = seq_len // 4

        def prefix_lm(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (kv_idx < prefix) | (q_idx >= kv_idx)

        return prefix_lm, None, {}
    if kind == "chunked-causal":
        chunks = (positions // CHUNK).view(1, -1)

        def chunked_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (q_idx // CHUNK == kv_idx // CHUNK) & (q_idx >= kv_idx)

        return chunked_causal, attnkit.AttentionSpec(causal=True), {"q_segment_ids": chunks, "kv_segment_ids": chunks}
    if kind == "local+global":
        return local_window(WINDOW, GLOBAL_TOKENS), attnkit.AttentionSpec(window=(WINDOW, WINDOW)), {}
    raise ValueError(f"unknown program {kind!r}; known: {', '.join(PROGRAM_KINDS)}")


def local_window(width: int, global_tokens: int) -> Callable[..., Any]:
    def local_global(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return ((q_idx - kv_idx).abs() <= width) | (kv_idx < global_tokens) | (q_idx < global_tokens)

    return local_global


def _bound(mask_mod: Callable[..., Any], q: Any, len_k: int) -> Any:
    from attnkit.frontends import ops_for
    from attnkit.programs import bind

    return bind(mask_mod, ops_for(q, "q"), q, q.shape[0], q.shape[1], q.shape[2], len_k)


def _timed(
    implementations: dict[str, Callable[..., Any]], q: Any, k: Any, v: Any, dout: Any, pass_name: str,
    repeats: int, warmup: int,
) -> dict[str, list[float]]:  # fmt: skip
    import torch

    if pass_name == "fwd":
        functions = {name: (lambda f=f: f(q, k, v)) for name, f in implementations.items()}
        return interleaved(functions, repeats, warmup, contexts=dict.fromkeys(implementations, torch.no_grad))
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    functions = {
        name: (lambda f=f: torch.autograd.grad(f(*leaves), leaves, dout)) for name, f in implementations.items()
    }
    return interleaved(functions, repeats, warmup)


def _implementations(
    mask_mod: Callable[..., Any],
    native: Any,
    fields: dict[str, Any],
    q: Any,
    len_k: int,
    with_native: bool = True,
    flex: bool = False,
) -> tuple[dict[str, Callable[..., Any]], float]:
    """The timed calls (cpu-flash with the program, SDPA with its dense mask, cpu-flash's native clause, FlexAttention
    with its block mask) and the program's visible fraction."""
    import torch.nn.functional as F

    import attnkit
    from attnkit.contract.programs import dense

    dense_mask = dense(_bound(mask_mod, q, len_k), q.shape[0], q.shape[1], q.shape[2], len_k, q)  # before timing
    plain = attnkit.AttentionSpec()
    implementations = {
        "program": lambda q, k, v: attnkit.attend(plain, q, k, v, mask_mod=mask_mod, backend="cpu-flash"),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask),
    }
    if native is not None and with_native:
        implementations["native"] = lambda q, k, v: attnkit.attend(native, q, k, v, backend="cpu-flash", **fields)
    if flex:
        implementations["flex"] = _flex(mask_mod, q, len_k)
    return implementations, float(dense_mask.float().mean())


def _flex(mask_mod: Callable[..., Any], q: Any, len_k: int) -> Callable[..., Any]:
    """torch's FlexAttention with ``mask_mod``: the block mask built, and the kernel compiled, here."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(mask_mod, q.shape[0], q.shape[1], q.shape[2], len_k, device="cpu")
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def _cell(
    kind: str, seq_len: int, dtype: str, pass_name: str, repeats: int, warmup: int, flex: bool = False
) -> dict[str, Any]:
    batch, heads, head_dim = PROGRAM_SHAPE["batch"], PROGRAM_SHAPE["heads"], PROGRAM_SHAPE["head_dim"]
    shape = (batch, heads, seq_len, head_dim)
    q, k, v, dout = random_inputs("torch", shape, shape, dtype)
    mask_mod, native, fields = program(kind, seq_len)
    # FlexAttention has no backward on CPU ("does not support backward on CPU"): a forward peer only.
    implementations, fraction = _implementations(mask_mod, native, fields, q, seq_len, flex=flex and pass_name == "fwd")
    samples = _timed(implementations, q, k, v, dout, pass_name, repeats, warmup)
    cell = {
        "program": kind,
        "len": seq_len,
        "dtype": dtype,
        "pass": pass_name,
        "visible": fraction,
        "program_ms": statistics.median(samples["program"]) / 1e6,
        "sdpa_ms": statistics.median(samples["sdpa"]) / 1e6,
        "program_over_sdpa": paired_ratio(samples, "program", "sdpa"),
    }
    for peer in ("native", "flex"):
        if peer in samples:
            cell[f"program_over_{peer}"] = paired_ratio(samples, "program", peer)
    return cell


def bench_fraction_sweep(seq_len: int, repeats: int, warmup: int, fractions: tuple[float, ...] = FRACTIONS) -> list[
    dict[str, Any]
]:  # fmt: skip
    """Forward time of cpu-flash's program and SDPA's dense mask against the visible fraction (float32): a
    bidirectional window of about fraction · L / 2 keys on each side."""
    batch, heads, head_dim = PROGRAM_SHAPE["batch"], PROGRAM_SHAPE["heads"], PROGRAM_SHAPE["head_dim"]
    shape = (batch, heads, seq_len, head_dim)
    q, k, v, dout = random_inputs("torch", shape, shape)
    rows = []
    for fraction in fractions:
        width = max(1, int(fraction * seq_len / 2)) if fraction < 1 else seq_len
        implementations, visible = _implementations(local_window(width, 0), None, {}, q, seq_len)
        samples = _timed(implementations, q, k, v, dout, "fwd", repeats, warmup)
        rows.append(
            {
                "width": width,
                "visible": visible,
                "program_ms": statistics.median(samples["program"]) / 1e6,
                "sdpa_ms": statistics.median(samples["sdpa"]) / 1e6,
            }
        )
    return rows


def classification_share(seq_len: int) -> list[dict[str, Any]]:
    """At ``seq_len``, per program: the tile classification's time uncached (what a call's first use of new
    captured values pays) against a cached forward call's (which looks the classes up)."""
    import torch

    from attnkit.backend import AttentionInputs
    from attnkit.contract.programs import tile_classes
    from attnkit.registry import get_backend

    cpu_flash = get_backend("cpu-flash")
    batch, heads, head_dim = PROGRAM_SHAPE["batch"], PROGRAM_SHAPE["heads"], PROGRAM_SHAPE["head_dim"]
    shape = (batch, heads, seq_len, head_dim)
    q, k, v, _ = random_inputs("torch", shape, shape)
    rows = []
    for kind in PROGRAM_KINDS:
        bound = _bound(program(kind, seq_len)[0], q, seq_len)
        started = time.perf_counter()
        tile_classes(bound, batch, heads, seq_len, seq_len, 64, 256, q)
        classify_ms = (time.perf_counter() - started) * 1e3
        inputs = AttentionInputs(q, k, v, mask_program=bound)
        with torch.no_grad():
            cpu_flash.forward(cpu_flash_spec(), inputs, True)  # classes cached from here on
            started = time.perf_counter()
            cpu_flash.forward(cpu_flash_spec(), inputs, True)
        call_ms = (time.perf_counter() - started) * 1e3
        rows.append({"program": kind, "len": seq_len, "classify_ms": classify_ms, "cached_call_ms": call_ms})
    return rows


_MEMORY_CHILD = "import sys; from attnkit.bench.programs import _memory_child as m; m(sys.argv[1], int(sys.argv[2]))"
MEMORY_KINDS = ("document-causal", "local+global")


def _memory_child(kind: str, seq_len: int) -> None:
    """In a fresh process: print the peak RSS growth of one forward+backward of ``kind`` through cpu-flash."""
    import torch

    import attnkit

    torch.set_num_threads(1)
    shape = (PROGRAM_SHAPE["batch"], PROGRAM_SHAPE["heads"], seq_len, PROGRAM_SHAPE["head_dim"])

    def run(length: int) -> Callable[[], None]:
        q, k, v, dout = random_inputs("torch", shape[:2] + (length, shape[3]), shape[:2] + (length, shape[3]))
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        mask_mod = program(kind, length)[0]
        spec = attnkit.AttentionSpec()
        return lambda: attnkit.attend(spec, *leaves, mask_mod=mask_mod, backend="cpu-flash").backward(dout)

    run(64)()  # load modules and the kernel before measuring
    print_peak(run(seq_len))


def program_memory(seq_lens: tuple[int, ...]) -> list[dict[str, Any]]:
    """Peak extra host memory of a program's forward+backward on cpu-flash, per program and L (fresh processes)."""
    return [
        {"program": kind, "len": seq_len, **run_child(_MEMORY_CHILD, [kind, str(seq_len)], f"{kind} L={seq_len}")}
        for kind in MEMORY_KINDS
        for seq_len in seq_lens
    ]


def cpu_flash_spec() -> Any:
    import attnkit

    return attnkit.AttentionSpec()


def bench_programs(
    seq_lens: tuple[int, ...] = PROGRAM_SEQ_LENS,
    dtypes: tuple[str, ...] = PROGRAM_DTYPES,
    passes: tuple[str, ...] = PASSES,
    kinds: tuple[str, ...] = PROGRAM_KINDS,
    repeats: int = 3,
    warmup: int = 1,
    sweep_len: int | None = None,
    share_len: int | None = None,
    progress: Callable[[str], None] | None = None,
    flex: bool = False,
    memory: bool = True,
) -> dict[str, Any]:
    """Paired ratios per (program, L, dtype, pass); the fraction sweep at ``sweep_len`` and the classification's
    share at ``share_len`` where given."""
    cells = []
    for seq_len, kind, dtype, pass_name in itertools.product(seq_lens, kinds, dtypes, passes):
        if progress:
            progress(f"{kind} L={seq_len} {dtype} {pass_name}")
        cells.append(_cell(kind, seq_len, dtype, pass_name, repeats, warmup, flex))
    result: dict[str, Any] = {
        "what": "masks --programs",
        "environment": environment("cpu"),
        "shape": PROGRAM_SHAPE,
        "repeats": repeats,
        "warmup": warmup,
        "cells": cells,
    }
    if sweep_len:
        if progress:
            progress(f"visible-fraction sweep L={sweep_len}")
        result["sweep"] = {"len": sweep_len, "rows": bench_fraction_sweep(sweep_len, repeats, warmup)}
    if share_len:
        if progress:
            progress(f"classification share L={share_len}")
        result["classification"] = classification_share(share_len)
    if memory:
        if progress:
            progress("peak memory")
        result["memory"] = program_memory(seq_lens)
    return result


def format_programs(result: dict[str, Any]) -> str:
    shape = result["shape"]
    lines = [
        device_banner(result),
        "cpu-flash with mask_mod / SDPA with the dense bool mask, / cpu-flash's native clause, / FlexAttention: "
        f"B={shape['batch']}, H={shape['heads']}, D={shape['head_dim']}; paired ratio = median over "
        f"{result['repeats']} interleaved repeats (native: segment ids + causal for document-causal and "
        "chunked-causal, window(128, 128) without the global tokens for local+global)",
    ]
    header = ["program", "L", "dtype", "pass", "visible", "program ms", "sdpa ms", "program / sdpa", "program / native",
              "program / flex"]  # fmt: skip
    rows = [
        [
            c["program"], str(c["len"]), c["dtype"], c["pass"], f"{c['visible']:.3f}", f"{c['program_ms']:.4g}",
            f"{c['sdpa_ms']:.4g}", f"{c['program_over_sdpa']:.3f}",
            *(f"{c[f'program_over_{p}']:.3f}" if f"program_over_{p}" in c else "-" for p in ("native", "flex")),
        ]
        for c in result["cells"]
    ]  # fmt: skip
    lines.append(format_table(header, rows))
    if "sweep" in result:
        sweep = result["sweep"]
        lines.append(f"\nvisible-fraction sweep, L={sweep['len']}, float32, fwd (bidirectional window)")
        lines.append(
            format_table(
                ["window", "visible", "program ms", "sdpa ms"],
                [
                    [str(r["width"]), f"{r['visible']:.3f}", f"{r['program_ms']:.4g}", f"{r['sdpa_ms']:.4g}"]
                    for r in sweep["rows"]
                ],
            )
        )
    if "classification" in result:
        lines.append("\ntile classification (64 x 256 tiles, uncached) against a forward call served from the cache")
        lines.append(
            format_table(
                ["program", "L", "classify ms", "cached call ms", "share"],
                [
                    [
                        r["program"],
                        str(r["len"]),
                        f"{r['classify_ms']:.3g}",
                        f"{r['cached_call_ms']:.4g}",
                        f"{r['classify_ms'] / (r['classify_ms'] + r['cached_call_ms']):.3f}",
                    ]
                    for r in result["classification"]
                ],
            )  # fmt: skip
        )
    if "memory" in result:
        lines.append("\npeak extra memory of one forward+backward on cpu-flash, float32 (fresh process each)")
        lines.append(
            format_table(
                ["program", "L", "peak extra MiB", "MiB per 1k positions"],
                [
                    [
                        m["program"],
                        str(m["len"]),
                        f"{m['peak_extra_bytes'] / 2**20:.1f}",
                        f"{m['peak_extra_bytes'] / 2**20 / (m['len'] / 1024):.2f}",
                    ]
                    for m in result["memory"]
                ],
            )  # fmt: skip
        )
    return "\n".join(lines)


def plot_sweep(result: dict[str, Any], path: str) -> str:
    """The sweep's time against visible fraction as a PNG at ``path``; a message where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    sweep = result["sweep"]
    rows = sweep["rows"]
    figure, axes = plt.subplots(figsize=(6, 4))
    fractions = [r["visible"] for r in rows]
    axes.plot(fractions, [r["program_ms"] for r in rows], "o-", label="cpu-flash, mask_mod")
    axes.plot(fractions, [r["sdpa_ms"] for r in rows], "s-", label="SDPA, dense bool mask")
    axes.set_xlabel("visible fraction of the (L, L) pairs")
    axes.set_ylabel("forward ms")
    shape = result["shape"]
    axes.set_title(f"L={sweep['len']}, B={shape['batch']}, H={shape['heads']}, D={shape['head_dim']}, float32")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return f"wrote {path}"
