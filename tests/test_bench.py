"""`attnkit bench --what targets` and `attnkit bench --calibrate`, on tiny settings. Never asserts on speed."""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

import attnkit
from attnkit import cost
from attnkit.bench import calibrate, targets
from attnkit.bench.calls import interpreted
from attnkit.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


#: The tests reading targets_run share one xdist worker (--dist loadgroup): the run is made once, not once per worker.
SHARES_TARGETS_RUN = pytest.mark.xdist_group("bench_targets_run")


@pytest.fixture(scope="module")
def targets_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, Any]]:
    """One tiny run of every target (L=32, float32, one repeat, no memory children), shared by the tests below."""
    target = tmp_path_factory.mktemp("targets") / "targets.json"
    argv = ["bench", "--what", "targets", "--quick", "--seq-lens", "32", "--dtypes", "float32", "--repeats", "1"]
    argv += ["--warmup", "1", "--no-memory", "--threads", "1", "--json", str(target)]
    out = io.StringIO()  # a module-scoped fixture cannot take capsys
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue(), json.loads(target.read_text())


@SHARES_TARGETS_RUN
def test_targets_quick_writes_every_target(targets_run: tuple[int, str, dict[str, Any]]) -> None:
    code, out, result = targets_run
    assert code == 0
    assert {"what", "environment", "shape", "seq_lens", "dtypes", "targets", "summary"} <= set(result)
    assert result["what"] == "targets" and result["seq_lens"] == [32] and result["dtypes"] == ["float32"]
    assert set(result["targets"]) == {"torch", "jax", "non-native", "decode"}
    for name in ("torch", "jax"):
        rows = result["targets"][name]["rows"]
        assert {(row["spec"], row["pass_name"]) for row in rows} == {
            (spec, pass_name) for spec in ("full", "causal") for pass_name in ("fwd", "fwd+bwd")
        }
        for row in rows:
            assert {"path", "peer_ms", "attnkit_ms", "ratio", "target", "met"} <= set(row)
            assert row["path"] in attnkit.registered_backends()  # named by dispatch, whichever it is
            pairs = zip(row["peer_samples_ms"], row["attnkit_samples_ms"], strict=True)
            assert row["ratio"] == pytest.approx(statistics.median(peer / ours for peer, ours in pairs))
    # What decided each auto cell: measuring is off in the suite (tests/conftest.py), so the prediction did.
    assert {row["decided"] for row in result["targets"]["torch"]["rows"]} == {"predicted"}
    assert "(predicted)" in out
    non_native = result["targets"]["non-native"]
    assert {row["spec"] for row in non_native["rows"]} == {case.name for case in targets.NON_NATIVE_CASES}
    for row in non_native["rows"]:
        assert row["best"] in row["paths_ms"] and row["path"] in row["paths_ms"]
        assert not any(interpreted(name, "cpu") for name in row["paths_ms"])
        assert row["attnkit_ms"] == min(row["paths_ms"].values())
        # --quick times auto and cpu-flash alone (no per-shape torch-flex compiles): the others that serve are named
        assert set(row["paths_ms"]) <= {row["path"], "cpu-flash"}
        assert row["skipped"]["torch-chunked"] == "not in --backends"
    assert non_native["paths"] == ["cpu-flash"] and "Paths timed: auto and cpu-flash where they serve" in out
    bottom_right = [row for row in non_native["rows"] if row["len_q"] != row["len_k"]]
    assert bottom_right and all(row["len_q"] == 16 and row["len_k"] == 32 for row in bottom_right)
    decode = result["targets"]["decode"]
    for row in decode["rows"]:
        assert set(row["overhead_us"]) == {"no_grad", "recording"} and "autograd_recording_us" in row
    assert decode["growing_kv"]["len_k"][0] > decode["shape"]["len_k"]  # shapes the fixed-shape rows never cached
    for heading in ("target [torch]", "target [jax]", "target [non-native]", "target [decode]", "summary:"):
        assert heading in out
    assert "autograd recording itself" in out and "a KV cache growing one key a step" in out


@SHARES_TARGETS_RUN
def test_targets_plot(targets_run: tuple[int, str, dict[str, Any]], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "targets.png"
    targets.plot_targets(targets_run[2], str(target))
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_fails_before_running(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    code = main(["bench", "--what", "targets", "--plot", str(tmp_path / "x.png")])
    assert code == 2 and "pip install 'attnkit[bench]'" in capsys.readouterr().err
    with pytest.raises(ImportError, match=r"attnkit\[bench\]"):
        targets.plot_targets({"dtypes": []}, str(tmp_path / "x.png"))


def test_unknown_target_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--what", "targets", "--targets", "torch,nope"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak-RSS reset needs Linux /proc")
def test_memory_child_reports_peak_growth() -> None:
    # In a fresh process, as the bench measures: in a test worker, memory its earlier tests freed but kept would serve
    # the call without raising the peak, and read 0.
    assert targets.measure_memory("causal+window(256,0)", "torch-chunked", 256, "float32", 1) > 0


def test_memory_growth_exponent(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = {
        "linear-path": lambda length: 1000 * length if length > 512 else 300 * length,  # the allocator reused memory
        "quadratic-path": lambda length: length * length,
    }
    monkeypatch.setattr(targets, "measure_memory", lambda case, path, length, dtype, threads: sizes[path](length))
    rows = [
        {
            "spec": "s",
            "len_k": 4096,
            "pass_name": "fwd+bwd",
            "dtype": "float32",
            "best": "linear-path",
            "path": "quadratic-path",
        },
    ]
    memory = targets.non_native_memory({"cases": {"s": {}}, "rows": rows}, (512, 2048, 4096), "float32", 1)
    by_path = {row["path"]: row for row in memory}
    assert by_path["linear-path"]["growth_exponent"] == pytest.approx(1.0) and by_path["linear-path"]["linear"]
    assert by_path["quadratic-path"]["growth_exponent"] == pytest.approx(2.0)
    assert not by_path["quadratic-path"]["linear"]


def test_calibrate_writes_a_table_that_reproduces_the_measurements(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    table_path, json_path = tmp_path / "costs.toml", tmp_path / "calibration.json"
    argv = ["bench", "--calibrate", "--quick", "--backends", "torch-sdpa,torch-chunked,triton,cupy-emulated"]
    argv += ["--dtypes", "float32", "--repeats", "1", "--threads", "1", "--output", str(table_path)]
    code, out = run(capsys, *argv, "--json", str(json_path))
    assert code == 0 and f"wrote {table_path}" in out
    result = json.loads(json_path.read_text())
    assert set(result["backends"]) == {"torch-sdpa", "torch-chunked"}  # no interpreter, no emulator
    assert set(result["skipped_backends"]) == {"triton", "cupy-emulated"}
    text = table_path.read_text()
    assert text.startswith("# attnkit cost table") and "versions: " in text and "machine: " in text
    table = cost.load_table(table_path)
    assert {(key[0], key[3]) for key in table.entries} == {
        (name, pass_name) for name in result["backends"] for pass_name in cost.PASSES
    }
    ratios = []
    shapes = {shape["name"]: calibrate.Shape(**shape) for shape in result["shapes"]}
    for group in result["groups"]:
        for point in group["points"]:
            shape = shapes[point["shape"]]
            problem = attnkit.Problem(
                framework=attnkit.Framework.TORCH,
                device="cpu",
                dtype="float32",
                batch=shape.batch,
                heads_q=shape.heads_q,
                heads_kv=shape.heads_kv,
                len_q=shape.len_q,
                len_k=shape.len_k,
                head_dim=64,
                head_dim_v=64,
                needs_grad=group["pass"] == cost.FORWARD_BACKWARD,
            )
            spec = attnkit.AttentionSpec(causal=shape.causal)
            # at a measured call the table predicts the measurement; the file holds the fit beside it
            predicted = table.predict_us(group["backend"], spec, problem)
            assert predicted == pytest.approx(point["time_us"], rel=1e-3)
            entry = table.entries[(group["backend"], "cpu", "float32", group["pass"], "")]
            fitted = entry.fitted_us(*cost.work_units(spec, problem))
            assert fitted == pytest.approx(point["predicted_us"], rel=1e-3)
            ratios.append(abs(math.log(fitted / point["time_us"])))
    assert statistics.median(ratios) < math.log(4)  # a loose fit, robust to a noisy point on a shared machine


def test_calibrate_times_jax_backends_jitted() -> None:
    result = calibrate.calibrate(dtypes=("float32",), shapes=calibrate.QUICK_SHAPES[:3], repeats=1, only=("jax-xla",))
    assert [(group["backend"], group["pass"], len(group["points"])) for group in result["groups"]] == [
        ("jax-xla", pass_name, 3) for pass_name in cost.PASSES
    ]
    assert {entry["pass"] for entry in result["entries"]} == set(cost.PASSES)


def test_calibrate_prints_valid_toml_without_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tomllib

    monkeypatch.setattr(calibrate, "QUICK_SHAPES", calibrate.QUICK_SHAPES[:3])
    code, out = run(
        capsys, "bench", "--calibrate", "--quick", "--backends", "torch-sdpa", "--dtypes", "float32", "--repeats", "1"
    )
    assert code == 0
    rows = tomllib.loads(out)["entry"]
    assert {row["pass"] for row in rows} == set(cost.PASSES) and all(row["backend"] == "torch-sdpa" for row in rows)


def test_relative_fit_weights_small_times() -> None:
    # 10 us + 1 ns per visible unit, the largest call 5% slow (noise): plain least squares moves the overhead by
    # tens of us to absorb it; relative least squares keeps it near the 10 us the small calls show.
    points = [(0.0, 0.0, 10.0), (1e3, 2e3, 11.0), (1e4, 2e4, 20.0), (1e5, 2e5, 110.0), (1e6, 2e6, 1010.0 * 1.05)]
    absolute, relative = cost.fit(points), cost.fit(points, relative=True)
    assert relative[0] == pytest.approx(10.0, rel=0.2)
    assert abs(absolute[0] - 10.0) > abs(relative[0] - 10.0)


def test_masks_bench_pairs_attend_with_sdpa_in_every_cell(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--what masks` on one tiny length: a ratio per (mask, Hkv, pass), and the backend auto ran, which for a plain
    masked forward is SDPA's own call; the masks it builds are the visibility each kind names."""
    from attnkit.bench import masks, timing

    monkeypatch.setattr(timing, "MIN_SAMPLE_S", 0.001)  # one call per sample: this checks the plumbing, not speed
    target = tmp_path / "masks.json"
    argv = ["bench", "--what", "masks", "--seq-lens", "16", "--repeats", "1", "--warmup", "0", "--no-memory"]
    code, out = run(capsys, *argv, "--threads", "1", "--json", str(target))
    assert code == 0 and "attend / sdpa" in out
    cells = json.loads(target.read_text())["cells"]
    assert {(c["mask"], c["heads_kv"], c["pass"]) for c in cells} == {
        (kind, heads_kv, pass_name)
        for kind in masks.MASK_KINDS
        for heads_kv in masks.MASK_HEADS_KV
        for pass_name in masks.PASSES
    }
    assert all(c["ratio"] > 0 and math.isfinite(c["ratio"]) for c in cells)
    assert {c["backend"] for c in cells if c["mask"] == "hf-4d" and c["pass"] == "fwd"} == {"torch-sdpa"}
    spec, keypad, full = masks.masked_call("hf-keypad", 6)
    padded = ~masks.left_padding(masks.MASK_SHAPE["batch"], 6)
    assert spec.causal and keypad.shape == (4, 1, 1, 6) and full.shape == (4, 1, 6, 6)
    for b in range(4):  # element b sees key j from query i iff j <= i and j is not padding
        for i in range(6):
            assert full[b, 0, i].tolist() == [j <= i and not bool(padded[b, j]) for j in range(6)]


def test_programs_bench_pairs_cpu_flash_with_sdpa_and_its_native_clauses(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--what masks --programs` on one tiny length: a cell per (program, pass) with its ratios (against the native
    clause where one exists), a sweep row per fraction, a classification row per program; the programs' visible
    fractions are the masks they name."""
    from attnkit.bench import programs, timing

    monkeypatch.setattr(timing, "MIN_SAMPLE_S", 0.001)  # one call per sample: this checks the plumbing, not speed
    target = tmp_path / "programs.json"
    argv = ["bench", "--what", "masks", "--programs", "--seq-lens", "64", "--dtypes", "float32", "--repeats", "1",
            "--no-memory"]  # fmt: skip
    code, out = run(capsys, *argv, "--warmup", "0", "--threads", "1", "--json", str(target))
    assert code == 0 and "program / sdpa" in out
    result = json.loads(target.read_text())
    cells = result["cells"]
    expected = {(kind, pass_name) for kind in programs.PROGRAM_KINDS for pass_name in programs.PASSES}
    assert {(c["program"], c["pass"]) for c in cells} == expected
    assert all(math.isfinite(c["program_over_sdpa"]) and c["program_over_sdpa"] > 0 for c in cells)
    assert {c["program"] for c in cells if "program_over_native" in c} == {
        "document-causal", "chunked-causal", "local+global"
    }  # fmt: skip
    visible = {c["program"]: c["visible"] for c in cells}
    # 8 causal documents of 8: 8 · 36 pairs; prefix 16 seen by all, causal after: 64·16 + Σ_{i≥16} (i − 15)
    assert visible["document-causal"] == pytest.approx(8 * 36 / 64**2)
    assert visible["prefix-lm"] == pytest.approx((64 * 16 + sum(i - 15 for i in range(16, 64))) / 64**2)
    assert len(result["sweep"]["rows"]) == len(programs.FRACTIONS) and len(result["classification"]) == 4


def test_clauses_bench_pairs_each_clause_with_the_plain_call(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--what clauses` on one tiny length: a finite sinks/plain, alibi/plain and dropout/plain ratio per (causal,
    pass)."""
    from attnkit.bench import clauses, timing

    monkeypatch.setattr(timing, "MIN_SAMPLE_S", 0.001)  # one call per sample: this checks the plumbing, not speed
    target = tmp_path / "clauses.json"
    argv = ["bench", "--what", "clauses", "--seq-lens", "16", "--repeats", "1", "--warmup", "0", "--no-memory"]
    code, out = run(capsys, *argv, "--threads", "1", "--json", str(target))
    assert code == 0 and "alibi / plain" in out
    result = json.loads(target.read_text())
    assert result["backend"] == "cpu-flash" and "memory" not in result
    cells = result["cells"]
    expected = {(causal, pass_name) for causal in (False, True) for pass_name in clauses.PASSES}
    assert {(c["causal"], c["pass"]) for c in cells} == expected
    assert all(c[clause] > 0 and math.isfinite(c[clause]) for c in cells for clause in clauses.CLAUSES)


def test_every_bench_has_a_quick_form() -> None:
    """Issue 32: --quick makes a smoke run of every bench, not of some."""
    from attnkit.bench.command import QUICK
    from attnkit.cli import build_parser

    bench = build_parser()[0]._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    whats = next(action.choices for action in bench._actions if action.dest == "what")
    assert set(whats) | {"backend", "calibrate"} == set(QUICK)


#: Each --what's bench function and formatter (module, function, formatter), and the flags it needs besides --what.
BENCH_FUNCTIONS = {
    "dispatch": ("overhead", "bench_dispatch", "format_dispatch", ()),
    "spec": ("spec_cost", "bench_spec", "format_spec", ()),
    "chunked": ("chunked", "bench_chunked", "format_chunked", ()),
    "memory": ("chunked", "bench_memory", "format_memory", ()),
    "targets": ("targets", "bench_targets", "format_targets", ()),
    "compiled": ("compiled", "bench_compiled", "format_compiled", ()),
    "masks": ("masks", "bench_masks", "format_masks", ()),
    "packed": ("packed", "bench_packed", "format_packed", ()),
    "paged": ("paged", "bench_paged", "format_paged", ()),
    "context-parallel": ("context_parallel", "bench_context_parallel", "format_context_parallel", ()),
    "clauses": ("clauses", "bench_clauses", "format_clauses", ()),
    "decode": ("decode", "bench_decode", "format_decode", ()),
    "backend": ("tflops", "bench_backend", "format_backend", ("--backend", "torch-chunked")),
}


def _work(value: Any) -> float | None:
    """How much a bench argument asks for (a count, a length, how many cases, whether memory is measured), or None
    for one that sets no amount (a device, a callback, a name)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, tuple | list):
        return float(len(value))
    return None


@pytest.mark.parametrize("what", sorted(BENCH_FUNCTIONS))
def test_quick_asks_each_bench_for_less_work(
    what: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32: `--quick` runs fewer cases, repeats, lengths or memory children than the full bench of each --what
    (the bench functions are stubbed: this reads what each would be asked to run, not how long it takes)."""
    import importlib

    module_name, function, formatter, flags = BENCH_FUNCTIONS[what]
    module = importlib.import_module(f"attnkit.bench.{module_name}")
    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(module, function, lambda *args, **kwargs: asked.append(kwargs) or {})
    monkeypatch.setattr(module, formatter, lambda result: "table")
    selector = list(flags) or ["--what", what]
    assert run(capsys, "bench", *selector)[0] == 0
    assert run(capsys, "bench", *selector, "--quick")[0] == 0
    full, quick = ({name: _work(value) for name, value in kwargs.items()} for kwargs in asked)
    amounts = [name for name, amount in full.items() if amount is not None and quick[name] is not None]
    assert all(quick[name] <= full[name] for name in amounts), (full, quick)
    assert any(quick[name] < full[name] for name in amounts), (full, quick)
    if "memory" in quick:  # measuring memory runs a child process per cell: never in a smoke run
        assert quick["memory"] == 0.0


def test_compiled_times_the_pass_asked_for_and_names_the_ones_it_takes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--what compiled`: a training step by default, the forward alone with `--passes fwd` (what `--quick` asks:
    half the graphs for inductor to compile); a pass it has no meaning for is refused, naming the ones it takes."""
    from attnkit.bench import compiled

    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(compiled, "bench_compiled", lambda **kwargs: asked.append(kwargs) or {})
    monkeypatch.setattr(compiled, "format_compiled", lambda result: "table")
    assert run(capsys, "bench", "--what", "compiled")[0] == 0
    assert run(capsys, "bench", "--what", "compiled", "--passes", "fwd")[0] == 0
    assert [kwargs["backward"] for kwargs in asked] == [True, False]
    assert main(["bench", "--what", "compiled", "--passes", "bwd"]) == 2
    assert "--passes bwd: one of fwd, fwd+bwd" in capsys.readouterr().err and len(asked) == 2


def test_quick_dispatch_runs_few_calls_and_given_flags_win(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--what dispatch --quick` ran its 20 rounds of 2000 calls (95 s) before issue 32; a flag given still wins."""
    from attnkit.bench import overhead

    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(overhead, "bench_dispatch", lambda **kwargs: asked.append(kwargs) or {})
    monkeypatch.setattr(overhead, "format_dispatch", lambda result: "table")
    assert run(capsys, "bench", "--what", "dispatch", "--quick")[0] == 0
    assert asked[-1]["rounds"] * asked[-1]["calls"] <= 1000
    assert run(capsys, "bench", "--what", "dispatch", "--quick", "--rounds", "7")[0] == 0
    assert asked[-1]["rounds"] == 7 and asked[-1]["calls"] <= 500
    assert run(capsys, "bench", "--what", "dispatch")[0] == 0
    assert (asked[-1]["rounds"], asked[-1]["calls"]) == (20, 2000)


def test_packed_bench_times_segment_ids_against_a_batch_sdpa_and_the_unpadded_call(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--what packed` at tiny shapes: every ratio present and finite, auto naming a backend that skips by segment
    ids; the dense mask SDPA gets is causal within each document, and the padded rows are the odd ones."""
    from attnkit.bench import packed, timing

    monkeypatch.setattr(timing, "MIN_SAMPLE_S", 0.001)  # one call per sample: this checks the plumbing, not speed
    monkeypatch.setattr(packed, "DOCUMENTS", 3)
    monkeypatch.setattr(packed, "DOCUMENT_LEN", 8)
    monkeypatch.setattr(packed, "LEFT_PADDED_BATCH", 2)  # rows of 2 · 8 positions, the odd ones padded by 4
    target = tmp_path / "packed.json"
    argv = ["bench", "--what", "packed", "--repeats", "1", "--warmup", "0", "--no-memory", "--threads", "1"]
    code, out = run(capsys, *argv, "--json", str(target))
    assert code == 0 and "packed / batch" in out
    cells = json.loads(target.read_text())["cells"]
    ratios = {name: value for cell in cells for name, value in cell["ratios"].items()}
    assert set(ratios) == {
        "packed / batch",
        "packed / batch-same",
        "sdpa-mask / packed",
        "varlen / batch",
        "left-padded / unpadded",
        "left-padded / unpadded-same",
    }
    assert all(value > 0 and math.isfinite(value) for value in ratios.values())
    skipping = {"cpu-flash", "torch-chunked"}
    assert {cell["backend"] for cell in cells} <= skipping
    # --backends: the packed row on each named backend instead of auto's.
    code, out = run(capsys, *argv, "--backends", "torch-sdpa", "--json", str(target))
    assert code == 0 and json.loads(target.read_text())["cells"][0]["backend"] == "torch-sdpa"
    ids = packed.packed_ids(3, 2)
    assert ids.tolist() == [[0, 0, 1, 1, 2, 2]]
    mask = packed.causal_document_mask(ids)[0, 0]
    assert mask.tolist() == [[j <= i and j // 2 == i // 2 for j in range(6)] for i in range(6)]
    assert (packed.left_padded_ids(4, 5, 2) < 0).sum(dim=1).tolist() == [0, 2, 0, 2]


def test_decode_bench_pairs_each_part_with_its_peer(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--what decode` in blocks of 5 steps: every torch row meets key counts new to attnkit (the last one after the
    signatures it drove, on lengths no other row used); its figures are the per-block pairs; the jitted JAX step
    compiles once however the length grows and agrees with jax.nn; generate() makes the same tokens as sdpa, every
    turn on lengths no earlier turn met."""
    from attnkit.bench import decode

    monkeypatch.setattr(decode, "BLOCK", 5)
    target = tmp_path / "decode.json"
    argv = ["bench", "--what", "decode", "--steps", "10", "--seen-signatures", "40", "--new-tokens", "3"]
    code, out = run(capsys, *argv, "--repeats", "2", "--json", str(target))
    assert code == 0
    result = json.loads(target.read_text())
    assert result["what"] == "decode" and result["environment"]["cpu_threads"] == 1
    rows = result["parts"]["torch"]["rows"]
    assert [(row["heads_kv"], row["grad"]) for row in rows] == [
        (8, "no_grad"), (8, "recording"), (2, "no_grad"), (2, "recording"), (8, "no_grad")
    ]  # fmt: skip
    for row in rows:
        assert row["steps"] == 10 and row["len_k"][1] - row["len_k"][0] == 9
        assert row["path"] in attnkit.registered_backends() and row["max_abs_difference"] < 1e-5
        # 507..521: only 512 and 513 open a length class the row's earlier calls had not (attnkit/call_cache.py)
        assert row["full_paths"] <= 2 and row["attend_calls"] == 15
        blocks = row["blocks_us"]
        assert len(blocks["attend"]) == len(blocks["sdpa"]) == 2
        assert row["difference_us"] == pytest.approx(statistics.median(a - s for a, s in zip(*blocks.values())))
        assert row["attend_us"] == pytest.approx(statistics.fmean(blocks["attend"]))
        assert set(row["first_call_us"]) == {"attend", "sdpa"}
    assert all(row["len_k"][0] == decode.FIRST_LEN for row in rows[:-1])
    assert rows[-1]["after_signatures"] == 40 and rows[-1]["len_k"][0] > rows[0]["len_k"][1]
    assert decode.drive_signatures(40)["signatures"] == 40
    jax_part = result["parts"]["jax"]
    assert jax_part["compiled_programs_before"] == jax_part["compiled_programs_after"] == {"attend": 1, "jax.nn": 1}
    assert not jax_part["recompiled"] and jax_part["max_abs_difference"] < 1e-5
    assert "no recompile as the length grew" in out
    hf = result["parts"]["transformers"]
    assert hf["identical_tokens"] == [True, True] and set(hf["tokens_per_s"]) == {"attend", "sdpa"}
    assert hf["prompts"][1] > hf["prompts"][0] + hf["new_tokens"]  # the second turn's lengths are all new
    assert hf["ratio"] == pytest.approx(statistics.median(a / s for a, s in zip(*hf["turns_tokens_per_s"].values())))
    for heading in ("torch: a KV cache growing one key a step", "jax: jax.jit decode step", "transformers: generate()"):
        assert heading in out


def test_every_timing_warms_up_and_can_report_the_cold_call() -> None:
    """A bench asking for no warm-up (as `--backend --quick` did) still times warm calls; the cold one is kept apart."""
    from attnkit.bench.timing import interleaved

    calls = {"a": 0, "b": 0}

    def counter(name: str) -> Any:
        return lambda: calls.__setitem__(name, calls[name] + 1)

    first: dict[str, float] = {}
    samples = interleaved({name: counter(name) for name in calls}, repeats=2, warmup=0, calls=1, first_calls=first)
    assert calls == {"a": 3, "b": 3} and set(first) == {"a", "b"} and len(samples["a"]) == 2


def test_bench_warmup_flag_is_at_least_one(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from attnkit.bench import tflops

    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(tflops, "bench_backend", lambda name, **kwargs: asked.append(kwargs) or {})
    monkeypatch.setattr(tflops, "format_backend", lambda result: "table")
    assert run(capsys, "bench", "--backend", "cpu-flash", "--quick")[0] == 0
    assert run(capsys, "bench", "--backend", "cpu-flash", "--warmup", "0")[0] == 0
    assert [kwargs["warmup"] for kwargs in asked] == [1, 1]


def _tiny_backend_run(name: str) -> dict[str, Any]:
    from attnkit.bench import tflops

    reasons = attnkit.get_backend(name).available()
    if reasons:
        pytest.skip(f"{name} unavailable: {reasons}")
    return tflops.bench_backend(name, shapes=[(1, 1, 16, 16, 8)], dtype="float32", repeats=1, passes=("fwd",))


def test_backend_advice_of_a_cpu_backend_names_no_gpu() -> None:
    """cpu-flash runs on CPUs alone: its CPU figures are its figures, with no advice to rerun on CUDA (it said so);
    the cold first call is reported apart from the medians."""
    from attnkit.bench import tflops

    result = _tiny_backend_run("cpu-flash")
    assert result["backend_devices"] == ["cpu"] and not result["interpreted"]
    text = tflops.format_backend(result)
    assert tflops.device_advice(result) is None
    assert "NOT A PERFORMANCE FIGURE" not in text and "cuda" not in text.lower()
    assert "first call ms" in text
    assert all(math.isfinite(row["first_call_ms"]) and row["first_call_ms"] > 0 for row in result["results"])


def test_backend_advice_names_the_devices_the_backend_runs_on() -> None:
    """A backend of CPU and CUDA: CPU figures, and --device cuda for its others; an interpreted or emulated run is
    not a performance figure, and names the device its kernels are for, even where the interpreter declares only
    the CPU (triton under TRITON_INTERPRET=1)."""
    from attnkit.bench import tflops

    result = _tiny_backend_run("torch-chunked")
    assert "cpu figures of torch-chunked; it also runs on a CUDA GPU (--device cuda)" in tflops.format_backend(result)
    for devices in (["cpu", "cuda"], ["cpu"], ["cuda"]):
        interpreted = {**result, "backend": "k", "backend_devices": devices, "interpreted": devices != ["cuda"]}
        advice = tflops.device_advice(interpreted)
        assert advice is not None and advice.startswith("NOT A PERFORMANCE FIGURE: on cpu, k runs as")
        assert advice.endswith("Its kernels run on a CUDA GPU (--device cuda): rerun it there.")
    on_gpu = {**result, "environment": {**result["environment"], "device": "cuda"}, "interpreted": False}
    assert tflops.device_advice(on_gpu) == (
        "cuda figures of torch-chunked; it also runs on a CPU (--device cpu): rerun there for those figures."
    )
