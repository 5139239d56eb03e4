"""configs/costs_cuda.toml from the GPU figures: the H100's in docs/performance-history.md ("First run on a GPU") and
the H200's (docs/performance-history.md, "The static model against the H200").

    python scripts/cuda_costs_from_figures.py            # rewrites configs/costs_cuda.toml

That run timed `attnkit bench --backend triton|cupy --device cuda --dtype bfloat16`: each backend against torch SDPA
at the FlashAttention-2 paper's shapes (D = 64 and 128, L = 512..16384, B·H = 16k/L·32 or ·16 heads, causal or not),
forward and forward+backward. Each row becomes a calibration point (visible_units, full_units, time_us) as
`attnkit bench --calibrate` makes them (attnkit.cost.work_units), fitted by attnkit.cost.fit. torch SDPA's rows
stand for the torch-sdpa backend: on these plain calls it is SDPA itself. The points are long prefill calls only (no
decode step was timed), so the fits' overheads are extrapolated; a run of `attnkit bench --calibrate --device cuda`
on an H100 replaces this table.

The H200 rows (H200_FIGURES) are the H200 table of 2026-11-27: cuDNN's TF/s (SDPA pinned to it) and each attnkit
kernel's ratio to it in the same process, bf16, CUDA events, median of 10-20 runs after warm-up and autotuning.
torch-sdpa's rows are cuDNN's (the midpoint of its range); triton's and cupy's the upper end of their ratio ranges,
the most favourable to attnkit that was measured, so no entry makes them look faster than the H200 ran them.
Triton's fwd+bwd was timed with a hand-patched backward (indicative only; the compiled backward is refused on CUDA
until a GPU passes it).
"""

from __future__ import annotations

import re
from pathlib import Path

from attnkit import cost
from attnkit.backend import Framework, Problem
from attnkit.bench.calls import attention_flops
from attnkit.spec import AttentionSpec

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "performance-history.md"
OUTPUT = ROOT / "configs" / "costs_cuda.toml"
DEVICE_NAME = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
#: The H200 table of 2026-11-27: (batch, heads, len_q, len_k, head_dim, causal) -> {pass: (cuDNN TF/s, triton ratio, cupy
#: ratio)}; ratios to cuDNN, the upper end of each measured range, cuDNN the midpoint of its range.
H200_FIGURES: dict[tuple[int, int, int, int, int, bool], dict[str, tuple[float, float, float]]] = {
    (2, 16, 8192, 8192, 128, False): {cost.FORWARD: (644.5, 0.74, 0.39), cost.FORWARD_BACKWARD: (568.0, 0.54, 0.39)},
    (2, 16, 8192, 8192, 128, True): {cost.FORWARD: (562.5, 0.74, 0.40), cost.FORWARD_BACKWARD: (530.0, 0.55, 0.39)},
    (4, 32, 4096, 4096, 64, True): {cost.FORWARD: (393.5, 0.68, 0.45), cost.FORWARD_BACKWARD: (379.0, 0.64, 0.45)},
    (8, 16, 2048, 2048, 128, True): {cost.FORWARD: (449.5, 0.60, 0.29), cost.FORWARD_BACKWARD: (410.0, 0.43, 0.29)},
    (1, 32, 1, 8192, 128, False): {cost.FORWARD: (1.8, 0.15, 0.08)},  # decode: cuDNN 74 us
}
#: The bench's implementation names, and the backends they stand for.
BACKENDS = {"triton": "triton", "cupy": "cupy", "torch sdpa": "torch-sdpa"}
ROW = re.compile(
    r"^(?P<name>triton|cupy|torch sdpa)\s+(?P<causal>yes|no)\s+(?P<dim>\d+)\s+(?P<length>\d+)\s+"
    r"(?P<batch>\d+)x(?P<heads>\d+)"
    r"\s+\S+ \((?P<fwd>[\d.]+) ms\)\s+\S+ \([\d.]+ ms\)\s+\S+ \((?P<fwd_bwd>[\d.]+) ms\)"
)


def figure_blocks(text: str) -> list[str]:
    """The code blocks of the H100 section that hold bench tables."""
    section = text.split("## First run on a GPU (H100")[1].split("\n## ")[0]
    return [block for block in section.split("```")[1::2] if DEVICE_NAME in block]


def points(blocks: list[str]) -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    """(backend, pass) -> calibration points. torch SDPA, timed in both runs, keeps the first run's rows."""
    found: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for index, block in enumerate(blocks):
        for line in block.splitlines():
            match = ROW.match(line)
            if match is None or (match["name"] == "torch sdpa" and index > 0):
                continue
            length, dim = int(match["length"]), int(match["dim"])
            problem = Problem(
                Framework.TORCH, "cuda", "bfloat16", int(match["batch"]), int(match["heads"]), int(match["heads"]),
                length, length, dim, dim,
            )  # fmt: skip
            units = cost.work_units(AttentionSpec(causal=match["causal"] == "yes"), problem)
            for pass_name, column in ((cost.FORWARD, "fwd"), (cost.FORWARD_BACKWARD, "fwd_bwd")):
                key = (BACKENDS[match["name"]], pass_name)
                found.setdefault(key, []).append((*units, float(match[column]) * 1000.0))
    return found


def h200_points() -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    """(backend, pass) -> calibration points of the H200 table."""
    found: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for (batch, heads, len_q, len_k, head_dim, causal), passes in H200_FIGURES.items():
        problem = Problem(Framework.TORCH, "cuda", "bfloat16", batch, heads, heads, len_q, len_k, head_dim, head_dim)
        units = cost.work_units(AttentionSpec(causal=causal), problem)
        for pass_name, (cudnn_tflops, *ratios) in passes.items():
            work = "fwd" if pass_name == cost.FORWARD else "fwd+bwd"
            flops = attention_flops(batch, heads, len_q, head_dim, causal, work, len_k=len_k)
            cudnn_us = flops / (cudnn_tflops * 1e12) * 1e6
            for backend, ratio in zip(("torch-sdpa", "triton", "cupy"), (1.0, *ratios)):
                found.setdefault((backend, pass_name), []).append((*units, cudnn_us / ratio))
    return found


def main() -> None:
    entries = []
    for (backend, pass_name), measured in sorted(points(figure_blocks(FIGURES.read_text())).items()):
        overhead, per_visible, per_full = cost.fit(measured, relative=True)
        entries.append(
            cost.CostEntry(
                backend,
                "cuda",
                "bfloat16",
                pass_name,
                overhead,
                per_visible,
                per_full,
                tuple(measured),
                device_name=DEVICE_NAME,
            )  # fmt: skip
        )
    for (backend, pass_name), measured in sorted(h200_points().items()):
        overhead, per_visible, per_full = cost.fit(measured, relative=True)
        entries.append(
            cost.CostEntry(
                backend,
                "cuda",
                "bfloat16",
                pass_name,
                overhead,
                per_visible,
                per_full,
                tuple(measured),
                device_name=H200,
            )  # fmt: skip
        )
    header = "\n".join(
        [
            "attnkit cost table for CUDA (attnkit/cost.py), keyed to the GPU model it was measured on: it speaks for",
            f'calls on a "{DEVICE_NAME}" only (attnkit.environment.accelerator_name).',
            'source: the H100 figures of docs/performance-history.md ("First run on a GPU (H100, 2026-11-22)"), made by',
            "`attnkit bench --backend triton --device cuda --dtype bfloat16` and `... --backend cupy ...` on",
            "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0, CuPy 14.2; torch SDPA's rows stand for",
            "torch-sdpa. regenerate: python scripts/cuda_costs_from_figures.py (or measure on the GPU:",
            "attnkit bench --calibrate --device cuda)",
            "shapes: D=64 and 128, L=512..16384 (Lq = Lk), causal and not, bfloat16; no decode step (overheads are",
            "extrapolated).",
            f'The "{H200}" entries: the H200 table of 2026-11-27 (docs/performance-history.md, "The static model',
            'against the H200"), torch 2.11.0+cu130, Triton 3.6.0, cupy-cuda13x 14.2.0, main at e782468, bf16, SDPA pinned to',
            "cuDNN (torch-sdpa's rows), triton and cupy at the upper end of their measured ratios to it; five shapes,",
            "decode (B=1 H=32 Lq=1 Lk=8192 D=128) among them, forward, and fwd+bwd but for decode.",
        ]
    )
    cost.write_table(entries, OUTPUT, header)
    print(f"wrote {len(entries)} entries to {OUTPUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
