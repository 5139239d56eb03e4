"""docs/performance.md's summary tables say what the bench JSON kept in docs/figures/bench/ says, and
scripts/plot_performance.py draws its figures from that JSON.

The expected figures are computed here from the JSON's raw rows (medians and ranges of the bench's paired ratios,
ratios of the recorded GPU times), not by the script that wrote the tables, so a table edited by hand, or JSON
replaced without the tables, fails."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "performance.md"
BENCH = ROOT / "docs" / "figures" / "bench"
SCRIPT = ROOT / "scripts" / "plot_performance.py"
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _json(name: str) -> dict[str, Any]:
    return json.loads((BENCH / name).read_text())


def _table_after(heading: str) -> list[list[str]]:
    """The rows (cells) of the first markdown table after the line starting with ``heading``, header left out."""
    lines = PAGE.read_text().splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(heading))
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not set(cells[0]) <= set("-: "):  # not the delimiter row
                rows.append(cells)
        elif rows:
            break
    return rows[1:]


def _numbers(cell: str) -> list[float]:
    return [float(text) for text in NUMBER.findall(cell.replace("–", " ").replace("−", "-"))]


def _spread(values: list[float]) -> list[float]:
    return [statistics.median(values), min(values), max(values)]


def _same(cell: str, expected: list[float], label: str) -> None:
    """The numbers of ``cell`` are ``expected`` to the decimals shown (ratios two, microseconds one)."""
    shown = _numbers(cell)
    tolerance = 0.051 if "µs" in cell else 0.0051
    assert len(shown) == len(expected), f"{label}: {cell!r} against {expected}"
    for figure, value in zip(shown, expected):
        assert figure == pytest.approx(value, abs=tolerance), f"{label}: {cell!r} against {expected}"


def _by_shape(rows: list[dict[str, Any]], name: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    keys = ("batch", "heads", "seq_len", "len_k", "head_dim", "causal")
    return {tuple(row[key] for key in keys): row for row in rows if row["implementation"] == name}


def _time_ratios(rows: list[dict[str, Any]], ours: str, pass_name: str) -> list[float]:
    mine, peer = _by_shape(rows, ours), _by_shape(rows, "torch sdpa")
    return [peer[key][f"{pass_name}_ms"] / mine[key][f"{pass_name}_ms"] for key in mine]


def test_cpu_table_is_the_json() -> None:
    targets, decode, flash = _json("cpu-targets.json"), _json("cpu-decode.json"), _json("cpu-flash.json")
    table = {row[0]: row[1:] for row in _table_after("## CPU")}
    expected: dict[str, tuple[int, list[float]]] = {}
    plain = [row["ratio"] for row in targets["targets"]["torch"]["rows"]]
    expected["`auto`, plain calls (full and causal)"] = (len(plain), _spread(plain))
    cases = {
        "causal+softcap(30)": "softcap",
        "causal+window(256,0)": "window",
        "causal+kv_lengths": "kv_lengths",
        "cosine causal": "cosine",
        "bottom-right causal Lq=L/2": "bottom-right",
    }
    for case, word in cases.items():
        ratios = [row["auto_ratio"] for row in targets["targets"]["non-native"]["rows"] if row["spec"] == case]
        label = next(label for label in table if label.startswith("`auto`") and word in label)
        expected[label] = (len(ratios), _spread(ratios))
    for pass_name in ("fwd", "fwd+bwd"):
        ratios = _time_ratios(flash["results"], "cpu-flash", pass_name)
        expected[f"cpu-flash, the same call as SDPA, {pass_name}"] = (len(ratios), _spread(ratios))
    decode_call = _json("cpu-decode-call.json")["targets"]["decode"]["rows"]
    overheads = [value for row in decode_call for value in row["overhead_us"].values()]
    expected[next(label for label in table if label.startswith("decode step"))] = (len(overheads), _spread(overheads))
    growing = [row["difference_us"] for row in decode["parts"]["torch"]["rows"] if "after_signatures" not in row]
    expected[next(label for label in table if label.startswith("decode, a cache growing"))] = (
        len(growing),
        _spread(growing),
    )
    assert set(table) == set(expected), "every row of the CPU table is checked against the JSON"
    for label, (cells, values) in expected.items():
        assert table[label][0] == str(cells), label
        _same(table[label][1], values, label)


def test_gpu_tables_are_the_recorded_json() -> None:
    h200 = _json("gpu-h200-2026-11-27.json")
    rows = h200["benches"][0]["results"]

    def recorded(name: str, pass_name: str, decode: bool) -> list[float]:
        ranges = [
            row["vs_peer"]
            for row in rows
            if row["implementation"] == name and row["pass"] == pass_name and (row["seq_len"] == 1) == decode
        ]
        low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
        return [low] if low == high else [low, high]

    checked = {
        ("triton", "fwd"): recorded("triton", "fwd", False),
        ("triton", "fwd+bwd"): recorded("triton", "fwd+bwd", False),
        ("triton", "decode"): recorded("triton", "fwd", True),
        ("cupy", "fwd"): recorded("cupy", "fwd", False),
        ("cupy", "fwd+bwd"): recorded("cupy", "fwd+bwd", False),
        ("cupy", "decode"): recorded("cupy", "fwd", True),
        ("SDPA's FlashAttention-2 kernel", "fwd"): recorded("torch sdpa (flash)", "fwd", False),
    }
    shown = {(row[0], row[1]): row[2] for row in _table_after("### NVIDIA H200")}
    for backend_and_pass, values in checked.items():
        _same(shown[backend_and_pass], values, f"H200 {backend_and_pass}")

    h100 = _json("gpu-h100-2026-11-22.json")
    shown = {(row[0], row[1]): row[2] for row in _table_after("### NVIDIA H100")}
    for bench in h100["benches"]:
        for pass_name in ("fwd", "fwd+bwd"):
            values = _spread(_time_ratios(bench["results"], bench["backend"], pass_name))
            _same(shown[(bench["backend"], pass_name)], values, f"H100 {bench['backend']} {pass_name}")
    assert len(shown) == 4


def test_plot_script_draws_the_committed_json(tmp_path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed")
    spec = importlib.util.spec_from_file_location("plot_performance", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    paths = script.draw(BENCH, tmp_path, dpi=20)
    assert [path.name for path in paths] == [
        "performance-cpu-auto.png",
        "performance-cpu-decode.png",
        "performance-gpu.png",
    ]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (ROOT / "docs" / "figures" / path.name).is_file(), f"docs/figures/{path.name} is committed"
