"""The figures and summary tables of docs/performance.md, from the bench JSON kept in docs/figures/bench/.

    python scripts/plot_performance.py              # docs/figures/performance-*.png
    python scripts/plot_performance.py --tables     # the summary tables' markdown, to paste into the page
    python scripts/plot_performance.py --out DIR    # the PNGs elsewhere

The CPU files are `attnkit bench ... --json` output with a "recorded" block added (date, commit, command); the GPU
files hold figures recorded on their date (device, versions, code) in the same shape, not re-measured. Drawing
needs matplotlib (`pip install 'attnkit[bench]'`); --tables needs only the standard library.
tests/test_performance_page.py checks the page's tables against the same JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "docs" / "figures" / "bench"
FIGURES_DIR = ROOT / "docs" / "figures"
CPU_TARGETS, CPU_DECODE_CALL = "cpu-targets.json", "cpu-decode-call.json"
CPU_DECODE, CPU_FLASH = "cpu-decode.json", "cpu-flash.json"
GPU_FILES = ("gpu-h200-2026-11-27.json", "gpu-h100-2026-11-22.json")  # newest first, as on the page
SDPA = "torch sdpa"


def load(name: str, bench_dir: Path = BENCH_DIR) -> dict[str, Any]:
    return json.loads((bench_dir / name).read_text())


# ---------------------------------------------------------------------------------------------- figures from JSON


def cpu_caption(result: dict[str, Any]) -> str:
    env, recorded = result["environment"], result["recorded"]
    load_range = f"load average {recorded['load_average'][0]}–{recorded['load_average'][1]}"
    return (
        f"{env['cpu_model']}, {env['cpu_count']} CPUs, torch {env['torch']}, {env['cpu_threads']} thread\n"
        f"{recorded['date']}, attnkit {recorded['commit']}, {load_range}"
    )


def gpu_caption(result: dict[str, Any]) -> str:
    recorded = result["recorded"]
    return f"{recorded['device']}, {recorded['date']} ({recorded['code']}; {recorded['versions']})"


def cpu_ratio_cells(targets: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(label, auto's throughput ÷ SDPA's, backend auto ran) per cell of the torch and non-native targets."""
    cells = []
    for row in targets["targets"]["torch"]["rows"]:
        cells.append((f"{row['spec']} L={row['len_q']} {row['pass_name']}", row["ratio"], row["path"]))
    for row in targets["targets"]["non-native"]["rows"]:
        shape = f"{row['len_q']}x{row['len_k']}" if row["len_q"] != row["len_k"] else f"L={row['len_q']}"
        cells.append((f"{row['spec']} {shape} {row['pass_name']}", row["auto_ratio"], row["path"]))
    return cells


def flash_ratios(flash: dict[str, Any], pass_name: str) -> list[float]:
    """cpu-flash's time ÷ SDPA's turned into a throughput ratio (SDPA ms / cpu-flash ms), per shape and mask."""
    ours = {_shape_key(row): row for row in flash["results"] if row["implementation"] == flash["backend"]}
    theirs = {_shape_key(row): row for row in flash["results"] if row["implementation"] == SDPA}
    return [theirs[key][f"{pass_name}_ms"] / ours[key][f"{pass_name}_ms"] for key in ours if key in theirs]


def _shape_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["batch"], row["heads"], row["seq_len"], row["len_k"], row["head_dim"], row["causal"]


def decode_rows(decode: dict[str, Any]) -> list[dict[str, Any]]:
    """The growing-cache rows from L = 512 (the row after many signatures runs at other lengths)."""
    return [row for row in decode["parts"]["torch"]["rows"] if "after_signatures" not in row]


def h100_ratios(h100: dict[str, Any], backend: str, pass_name: str) -> list[float]:
    bench = next(bench for bench in h100["benches"] if bench["backend"] == backend)
    ours = {_shape_key(row): row for row in bench["results"] if row["implementation"] == backend}
    theirs = {_shape_key(row): row for row in bench["results"] if row["implementation"] == SDPA}
    return [theirs[key][f"{pass_name}_ms"] / ours[key][f"{pass_name}_ms"] for key in ours]


def h200_ranges(h200: dict[str, Any], implementation: str, pass_name: str, decode: bool) -> list[list[float]]:
    """The recorded [low, high] ratios to SDPA-cuDNN of one implementation and pass, prefill or decode shapes."""
    return [
        row["vs_peer"]
        for row in h200["benches"][0]["results"]
        if row["implementation"] == implementation and row["pass"] == pass_name and (row["seq_len"] == 1) == decode
    ]


# ---------------------------------------------------------------------------------------------- tables


def _x(value: float) -> str:
    return f"{value:.2f}×"


def _spread(values: Sequence[float]) -> str:
    """median (low–high), two decimals."""
    return f"{_x(statistics.median(values))} ({min(values):.2f}–{max(values):.2f}×)"


def _paths(paths: Iterable[str]) -> str:
    counted: dict[str, int] = {}
    for path in paths:
        counted[path] = counted.get(path, 0) + 1
    return ", ".join(f"{path} ({count})" for path, count in sorted(counted.items(), key=lambda item: -item[1]))


NON_NATIVE_LABELS = {
    "causal+softcap(30)": "`auto`, causal + softcap 30 *",
    "causal+window(256,0)": "`auto`, causal + window (256, 0) *",
    "causal+kv_lengths": "`auto`, causal + `kv_lengths` = L − L/8 *",
    "cosine causal": "`auto`, cosine causal *",
    "bottom-right causal Lq=L/2": "`auto`, bottom-right causal, Lq = L/2 *",
}


def cpu_table(
    targets: dict[str, Any], decode_call: dict[str, Any], decode: dict[str, Any], flash: dict[str, Any]
) -> list[list[str]]:
    torch_rows = targets["targets"]["torch"]["rows"]
    rows = [
        [
            "`auto`, plain calls (full and causal)",
            str(len(torch_rows)),
            _spread([row["ratio"] for row in torch_rows]),
            _paths(row["path"] for row in torch_rows),
        ]
    ]
    non_native = targets["targets"]["non-native"]["rows"]
    for case, label in NON_NATIVE_LABELS.items():
        cells = [row for row in non_native if row["spec"] == case]
        rows.append(
            [label, str(len(cells)), _spread([row["auto_ratio"] for row in cells]), _paths(r["path"] for r in cells)]
        )
    for pass_name in ("fwd", "fwd+bwd"):
        ratios = flash_ratios(flash, pass_name)
        rows.append([f"cpu-flash, the same call as SDPA, {pass_name}", str(len(ratios)), _spread(ratios), "–"])
    decode_target = decode_call["targets"]["decode"]["rows"]
    overheads = [value for row in decode_target for value in row["overhead_us"].values()]
    sdpa_us = [row["median_us"][f"sdpa {mode}"] for row in decode_target for mode in ("no_grad", "recording")]
    rows.append(
        [
            f"decode step, Lq = 1, Lk = 128: attend − SDPA (SDPA {min(sdpa_us):.0f}–{max(sdpa_us):.0f} µs)",
            str(len(overheads)),
            _microseconds(overheads),
            _paths(path for row in decode_target for path in row["paths"].values()),
        ]
    )
    growing = decode_rows(decode)
    first, last = growing[0]["len_k"]
    sdpa_step = [row["sdpa_us"] for row in growing]
    rows.append(
        [
            f"decode, a cache growing 1 key a step, L {first}–{last}: attend − SDPA per step "
            f"(SDPA {min(sdpa_step):.0f}–{max(sdpa_step):.0f} µs)",
            str(len(growing)),
            _microseconds([row["difference_us"] for row in growing]),
            _paths(row["path"] for row in growing),
        ]
    )
    return rows


def _microseconds(values: Sequence[float]) -> str:
    return f"{statistics.median(values):+.1f} µs ({min(values):+.1f} to {max(values):+.1f})"


def h200_table(h200: dict[str, Any]) -> list[list[str]]:
    def span(ranges: list[list[float]]) -> str:
        low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
        return _x(low) if low == high else f"{low:.2f}–{high:.2f}×"

    indicative = "indicative only: backward patched by hand, dq wrong; refused on CUDA until a GPU passes it"
    return [
        ["triton", "fwd", span(h200_ranges(h200, "triton", "fwd", False)), ""],
        ["triton", "fwd+bwd", span(h200_ranges(h200, "triton", "fwd+bwd", False)), indicative],
        ["triton", "decode", span(h200_ranges(h200, "triton", "fwd", True)), "Lq = 1, Lk = 8192"],
        ["cupy", "fwd", span(h200_ranges(h200, "cupy", "fwd", False)), ""],
        ["cupy", "fwd+bwd", span(h200_ranges(h200, "cupy", "fwd+bwd", False)), ""],
        ["cupy", "decode", span(h200_ranges(h200, "cupy", "fwd", True)), "Lq = 1, Lk = 8192"],
        ["SDPA's FlashAttention-2 kernel", "fwd", span(h200_ranges(h200, "torch sdpa (flash)", "fwd", False)), ""],
        ["pallas", "–", "not measured", "checked for correctness only: 43 of 44 cases, one refusal"],
    ]


def h100_table(h100: dict[str, Any]) -> list[list[str]]:
    older = "older code: the shared-memory wmma kernels, replaced on 2026-11-24"
    return [
        ["triton", "fwd", _spread(h100_ratios(h100, "triton", "fwd")), ""],
        ["triton", "fwd+bwd", _spread(h100_ratios(h100, "triton", "fwd+bwd")), ""],
        ["cupy", "fwd", _spread(h100_ratios(h100, "cupy", "fwd")), older],
        ["cupy", "fwd+bwd", _spread(h100_ratios(h100, "cupy", "fwd+bwd")), older],
    ]


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


CPU_HEADER = ("comparison", "cells", "attnkit ÷ SDPA: median (range)", "backend `auto` ran (cells)")
GPU_HEADER = ("backend", "pass", "throughput ÷ SDPA", "note")


def tables(bench_dir: Path = BENCH_DIR) -> str:
    targets, decode_call, decode, flash = (
        load(name, bench_dir) for name in (CPU_TARGETS, CPU_DECODE_CALL, CPU_DECODE, CPU_FLASH)
    )
    h200, h100 = (load(name, bench_dir) for name in GPU_FILES)
    return "\n\n".join(
        [
            markdown(CPU_HEADER, cpu_table(targets, decode_call, decode, flash)),
            markdown(GPU_HEADER, h200_table(h200)),
            markdown(GPU_HEADER, h100_table(h100)),
        ]
    )


# ---------------------------------------------------------------------------------------------- plots


def plot_cpu_ratios(targets: dict[str, Any], path: Path, dpi: int = 110) -> None:
    import matplotlib.pyplot as plt

    cells = cpu_ratio_cells(targets)
    colours = {"torch-sdpa": "tab:blue", "cpu-flash": "tab:orange"}
    figure, axis = plt.subplots(figsize=(9, 0.17 * len(cells) + 1.8))
    positions = range(len(cells))
    axis.barh(
        list(positions),
        [ratio for _, ratio, _ in cells],
        color=[colours.get(path, "tab:gray") for _, _, path in cells],
    )
    axis.set_yticks(list(positions), [label for label, _, _ in cells], fontsize=7)
    axis.invert_yaxis()
    axis.axvline(1.0, color="black", linewidth=0.8)
    plain = len(targets["targets"]["torch"]["rows"])  # then the calls SDPA cannot make, against its causal call
    axis.axhline(plain - 0.5, color="gray", linewidth=0.8, linestyle=":")
    axis.set_xlabel("attend(backend='auto') throughput ÷ torch SDPA's (paired, same run); >1: attnkit faster")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour) for colour in colours.values()]
    axis.legend(handles, [f"auto ran {name}" for name in colours], loc="lower right", fontsize=8)
    title = "auto against SDPA per cell, float32, B=1 H=8 D=64 (below the dotted line: against SDPA's causal call)"
    axis.set_title(f"{title}\n{cpu_caption(targets)}", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)


def plot_cpu_decode(decode: dict[str, Any], path: Path, dpi: int = 110) -> None:
    import matplotlib.pyplot as plt

    block = decode["parts"]["torch"]["block"]
    figure, (times, ratios) = plt.subplots(1, 2, figsize=(10, 3.8))
    for row in decode_rows(decode):
        first = row["len_k"][0]
        middles = [first + block * index + block / 2 for index in range(len(row["blocks_us"]["attend"]))]
        label = f"Hkv={row['heads_kv']} {row['grad']}"
        if row["heads_kv"] == 8 and row["grad"] == "no_grad":
            times.plot(middles, row["blocks_us"]["sdpa"], label="SDPA", color="tab:blue")
            times.plot(middles, row["blocks_us"]["attend"], label="attend (auto)", color="tab:orange", linestyle="--")
        paired = [ours / theirs for ours, theirs in zip(row["blocks_us"]["attend"], row["blocks_us"]["sdpa"])]
        ratios.plot(middles, paired, label=label, linewidth=1)
    times.set_xlabel("cache length L (keys)")
    times.set_ylabel("µs per step")
    times.set_title("Hkv=8, no_grad: per step", fontsize=9)
    times.legend(fontsize=8)
    ratios.axhline(1.0, color="black", linewidth=0.8)
    ratios.set_xlabel("cache length L (keys)")
    ratios.set_ylabel("attend's time ÷ SDPA's, per block of steps")
    ratios.set_title("every step a length new to the process", fontsize=9)
    ratios.legend(fontsize=8)
    figure.suptitle(f"Decode, Hq=8 D=64 float32, a cache growing 1 key a step\n{cpu_caption(decode)}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)


LEGEND = {"torch sdpa (flash)": "SDPA's FlashAttention-2 kernel"}


def plot_gpu(h200: dict[str, Any], h100: dict[str, Any], path: Path, dpi: int = 110) -> None:
    import matplotlib.pyplot as plt

    figure, (newer, older) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = [row for row in h200["benches"][0]["results"] if row["pass"] == "fwd"]
    shapes = list(dict.fromkeys(_shape_key(row) for row in rows))
    names = ["triton", "cupy", "torch sdpa (flash)"]
    width = 0.8 / len(names)
    for offset, name in enumerate(names):
        ranges = {_shape_key(row): row["vs_peer"] for row in rows if row["implementation"] == name}
        middles = [(ranges[shape][0] + ranges[shape][1]) / 2 for shape in shapes]
        halves = [(ranges[shape][1] - ranges[shape][0]) / 2 for shape in shapes]
        positions = [index + offset * width for index in range(len(shapes))]
        newer.bar(positions, middles, width, yerr=halves, color=f"C{offset}", label=LEGEND.get(name, name), capsize=2)
    newer.set_xticks([i + width for i in range(len(shapes))], [_shape_label(s) for s in shapes], fontsize=7)
    newer.axhline(1.0, color="black", linewidth=0.8)
    newer.set_ylabel("forward throughput ÷ SDPA-cuDNN (bar: range of runs)")
    newer.set_title(f"{h200['recorded']['device']}, {h200['recorded']['date']}, bf16\n{h200['recorded']['versions']}",
                    fontsize=8)  # fmt: skip
    newer.legend(fontsize=8)
    for colour, backend in enumerate(("triton", "cupy")):
        bench = next(b for b in h100["benches"] if b["backend"] == backend)
        theirs = {_shape_key(r): r for r in bench["results"] if r["implementation"] == SDPA}
        for head_dim, marker in ((64, "o"), (128, "s")):
            ours = [r for r in bench["results"] if r["implementation"] == backend and r["head_dim"] == head_dim]
            points = sorted((r["seq_len"], theirs[_shape_key(r)]["fwd+bwd_ms"] / r["fwd+bwd_ms"]) for r in ours)
            older.plot(
                *zip(*points), marker=marker, linestyle="none", color=f"C{colour}", label=f"{backend} D={head_dim}"
            )
    older.set_xscale("log", base=2)
    older.axhline(1.0, color="black", linewidth=0.8)
    older.set_xlabel("L (16k tokens a batch, causal and not)")
    older.set_ylabel("fwd+bwd throughput ÷ SDPA (cuDNN)")
    older.set_title(f"{h100['recorded']['device']}, {h100['recorded']['date']}: older code, bf16\n"
                    f"{h100['recorded']['versions']}", fontsize=8)  # fmt: skip
    older.legend(fontsize=8)
    figure.suptitle(
        "attnkit's GPU kernels against torch SDPA, recorded on the date shown (not re-measured)", fontsize=9
    )
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)


def _shape_label(shape: tuple[Any, ...]) -> str:
    batch, heads, len_q, len_k, head_dim, causal = shape
    length = f"Lq={len_q} Lk={len_k}" if len_q != len_k else f"L={len_q}"
    return f"{batch}x{heads} {length}\nD={head_dim}{' causal' if causal else ''}"


def draw(bench_dir: Path = BENCH_DIR, out_dir: Path = FIGURES_DIR, dpi: int = 110) -> list[Path]:
    """The three figures, drawn with matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        out_dir / "performance-cpu-auto.png",
        out_dir / "performance-cpu-decode.png",
        out_dir / "performance-gpu.png",
    ]
    plot_cpu_ratios(load(CPU_TARGETS, bench_dir), paths[0], dpi)
    plot_cpu_decode(load(CPU_DECODE, bench_dir), paths[1], dpi)
    plot_gpu(load(GPU_FILES[0], bench_dir), load(GPU_FILES[1], bench_dir), paths[2], dpi)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", action="store_true", help="print the summary tables' markdown instead")
    parser.add_argument("--bench-dir", type=Path, default=BENCH_DIR)
    parser.add_argument("--out", type=Path, default=FIGURES_DIR)
    args = parser.parse_args(argv)
    if args.tables:
        print(tables(args.bench_dir))
        return 0
    for path in draw(args.bench_dir, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
