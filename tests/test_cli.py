"""The attnkit command, run in-process: info, explain, check (passing and failing) and the generated docs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import torch

import attnkit
from attnkit import registry
from attnkit.backend import ALL_FEATURES, Feature
from attnkit.capability_matrix import FEATURE_MEANINGS, STALE_MARKDOWN_MESSAGE, capability_markdown
from attnkit.cli import main
from attnkit.testing import strategies
from attnkit.testing.check import BackendReport, applicable_edge_cases, results_table, run_case
from attnkit.testing.runners import drawable_dtypes
from tests.conftest import PLUGIN_DISTRIBUTION, backend_params

REPO_ROOT = Path(__file__).resolve().parent.parent
WRONG_BACKEND = "test-cli-wrong"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_info_lists_every_backend(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "info")
    assert code == 0
    for name in registry.backends():
        assert name in out
    for feature in ALL_FEATURES:
        assert feature in out


def test_info_says_where_each_backend_came_from_and_which_plugins_were_refused(
    capsys: pytest.CaptureFixture[str], plugin_distribution: None
) -> None:
    code, out = run(capsys, "info", "--wide")
    assert code == 0
    lines = out.splitlines()
    origins = {
        line.split(":")[0].strip(): lines[index + 1].strip()
        for index, line in enumerate(lines[:-1])
        if lines[index + 1].startswith("    from: ")
    }
    assert set(origins) == set(registry.backends())
    source = f"from {PLUGIN_DISTRIBUTION}"
    assert origins["torch-naive"] == "from: built-in"
    assert origins["test-plugin-fresh"] == f"from: entry point fresh = attnkit_test_plugin:fresh {source}"
    assert (
        origins["torch-chunked"]
        == f"from: entry point replace = attnkit_test_plugin:replace {source}, replacing built-in"
    )
    refused = out[out.index("plugins refused") :]
    for entry in ("clash", "broken", "missing"):
        assert f"  entry point {entry} = " in refused
    assert f"clash = attnkit_test_plugin:clash {source}: InvalidInputError: backend name 'torch-sdpa'" in refused


def test_info_fits_the_terminal_unless_wide(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32: `attnkit info` was ~400 columns wide; it fits COLUMNS (the terminal's width), with every backend,
    feature and word of the reasons still there, and --wide keeps whole lines."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out = run(capsys, "info")
    wide_code, wide = run(capsys, "info", "--wide")
    assert code == wide_code == 0
    assert max(map(len, out.splitlines())) <= 100 < max(map(len, wide.splitlines()))
    assert set(out.split()) - {"-" * n for n in range(200)} == set(wide.split()) - {"-" * n for n in range(500)}


def test_info_markdown_writes_capability_markdown(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "backends.md"
    assert run(capsys, "info", "--markdown", "--output", str(target))[0] == 0
    assert target.read_text() == capability_markdown()
    assert run(capsys, "info", "--markdown", "--output", "-") == (0, capability_markdown())


def test_committed_backends_md_is_current() -> None:
    missing = [name for name, b in registry.backends().items() if isinstance(b, attnkit.MissingPackageBackend)]
    if missing:
        pytest.skip(f"capabilities of {missing} are unknown without their packages")
    committed = (REPO_ROOT / "docs" / "backends.md").read_text()
    assert committed == capability_markdown(), STALE_MARKDOWN_MESSAGE


def test_every_feature_has_a_meaning() -> None:
    assert set(FEATURE_MEANINGS) == ALL_FEATURES


def test_explain_marks_selected_backend_and_gives_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "explain", "--causal", "--len-q", "1", "--len-k", "37", "--grad")
    assert code == 0
    *table, decided = out.splitlines()[2:]
    rows = {line.split()[1] if line.startswith("->") else line.split()[0]: line for line in table}
    assert set(rows) == set(registry.backends())
    assert decided.startswith("decided by: ")
    assert sum(line.startswith("->") for line in rows.values()) == 1
    # jax-reference cannot take torch tensors (or is not installed): its row says why.
    assert not rows["jax-reference"].rstrip().endswith(" ok")
    assert "framework=torch" in rows["jax-reference"] or "unavailable" in rows["jax-reference"]


def test_explain_accepts_spec_json_and_open_window_sides(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "explain", "--spec", '{"causal": true, "window": [4, 0]}', "--framework", "jax")
    assert code == 0 and '"window":[4,0]' in out
    code, out = run(capsys, "explain", "--window", "none", "0", "--heads-q", "8", "--heads-kv", "2", "--bias-grad")
    assert code == 0 and '"window":[null,0]' in out and "needs_bias_grad=True" in out


def test_explain_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--window", "-1", "0"], ["--heads-q", "3", "--heads-kv", "2"], ["--spec", "{}", "--causal"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["explain", *argv])
        assert exit_info.value.code == 2


def test_the_commands_work_without_the_test_extra() -> None:
    """After `pip install attnkit[torch]` (no hypothesis, no pytest): check and bench are imported only by their
    subcommands, bench runs (the spec bench; --backend and --calibrate import the harness runners, which must not
    need hypothesis), and check says which extra to install instead of failing with a traceback."""
    script = (
        "import sys; sys.modules['hypothesis'] = sys.modules['pytest'] = None\n"  # importing them raises ImportError
        "from attnkit.cli import main\n"
        "assert main(['info']) == 0 and main(['explain', '--causal', '--len-q', '1']) == 0\n"
        "assert main(['check']) == 2\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('attnkit.testing', 'attnkit.bench')))\n"
        "assert not loaded, loaded\n"
        "assert main(['bench', '--what', 'spec', '--rounds', '1', '--calls', '2']) == 0\n"
        "from attnkit.testing.runners import native_framework\n"  # what bench --backend and --calibrate import
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT)
    assert child.returncode == 0, child.stderr[-2000:]
    assert 'attnkit check needs hypothesis, not installed here: pip install "attnkit[test]"' in child.stderr
    assert "spec construction" in child.stdout


def test_check_passes_on_the_oracle(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "check", "--backend", "torch-naive", "--examples", "3")
    assert code == 0, out
    assert "worst ratio" in out and "bfloat16" in out
    assert "torch-naive" in out and "0 failed" in out
    cells = dict(line.split() for line in out.splitlines() if len(line.split()) == 2 and line.split()[0].isidentifier())
    assert float(cells["paged"]) <= 1 and float(cells["varlen"]) <= 1  # the named ragged cases ran, and agree
    assert "varlen: `attend_varlen`" in out  # the call-form columns are explained under the table


def test_check_draws_varlen_and_paged_calls_where_a_backend_serves_them() -> None:
    """attnkit check draws the three call forms for a backend serving them all, and knows a backend whose declared
    features serve neither ragged form (calls() then draws attend alone)."""
    naive = registry.get_backend("torch-naive").capabilities
    for wanted in (lambda case: case.varlen is not None, lambda case: case.paged is not None):
        assert wanted(hypothesis.find(strategies.calls(naive), wanted))
    unragged = dataclasses.replace(
        naive, features=naive.features - {Feature.PAGED, Feature.SEGMENT_IDS, Feature.Q_LENGTHS}
    )
    assert not strategies.varlen_forms(unragged) and not strategies.serves_paged(unragged)


def test_check_runs_a_backend_registered_through_an_entry_point(
    capsys: pytest.CaptureFixture[str], plugin_distribution: None
) -> None:
    code, out = run(capsys, "check", "--backend", "test-plugin-fresh", "--examples", "2")
    assert code == 0, out
    assert "checking test-plugin-fresh" in out and "0 failed" in out


class OffByATenth:
    """torch-naive with 0.1 added to out: a backend that check must catch."""

    def __init__(self) -> None:
        self.inner = registry.get_backend("torch-naive")
        self.name = WRONG_BACKEND
        self.capabilities = self.inner.capabilities

    def available(self) -> list[str]:
        return self.inner.available()

    def supports(self, spec: Any, problem: Any) -> list[str]:
        return self.inner.supports(spec, problem)

    def forward(self, spec: Any, inputs: Any, need_lse: bool) -> tuple[Any, Any]:
        out, lse = self.inner.forward(spec, inputs, need_lse)
        return out + 0.1, lse

    def backward(self, spec: Any, inputs: Any, out: Any, lse: Any, dout: Any, dlse: Any, *, need_dbias: bool) -> Any:
        return self.inner.backward(spec, inputs, out, lse, dout, dlse, need_dbias=need_dbias)


def test_check_fails_on_a_wrong_backend(capsys: pytest.CaptureFixture[str]) -> None:
    attnkit.register_backend(OffByATenth())
    try:
        code, out = run(capsys, "check", "--backend", WRONG_BACKEND, "--examples", "2")
    finally:
        attnkit.unregister_backend(WRONG_BACKEND)
    assert code == 1
    assert f"FAIL {WRONG_BACKEND}" in out and "! out: error" in out
    assert "FAILED" in out


BORROWER = "test-cli-borrower"
MASKED_CALLS = attnkit.Delegation("torch-naive", "calls with a mask")


class BorrowsForMasks(attnkit.BaseBackend):
    """torch-chunked's code, except that calls with a mask run torch-naive's, declared and reported as such."""

    name = BORROWER

    def __init__(self) -> None:
        chunked = registry.get_backend("torch-chunked").capabilities
        self.capabilities = attnkit.Capabilities(
            frameworks=chunked.frameworks,
            dtypes=chunked.dtypes,
            devices=chunked.devices,
            features=chunked.features - {attnkit.Feature.PAGED},  # it writes no forward_paged
            delegations=(MASKED_CALLS,),
        )

    def _code(self, inputs: Any) -> attnkit.Backend:
        if inputs.mask is None:
            return registry.get_backend("torch-chunked")
        attnkit.backend.delegated(self, MASKED_CALLS)
        return registry.get_backend("torch-naive")

    def forward(self, spec: Any, inputs: Any, need_lse: bool) -> tuple[Any, Any]:
        return self._code(inputs).forward(spec, inputs, need_lse)

    def backward(self, spec: Any, inputs: Any, out: Any, lse: Any, dout: Any, dlse: Any, *, need_dbias: bool) -> Any:
        return self._code(inputs).backward(spec, inputs, out, lse, dout, dlse, need_dbias=need_dbias)


def test_check_marks_the_rows_whose_cases_ran_another_backends_code(capsys: pytest.CaptureFixture[str]) -> None:
    attnkit.register_backend(BorrowsForMasks())
    try:
        code, out = run(capsys, "check", "--backend", BORROWER, "--examples", "0")
        served = len(applicable_edge_cases(BorrowsForMasks(), BackendReport(BORROWER)))
    finally:
        attnkit.unregister_backend(BORROWER)
    assert code == 0, out
    cells = dict(line.split() for line in out.splitlines() if len(line.split()) == 2 and line.split()[0].isidentifier())
    assert cells["mask"].endswith("~") and cells["plain"].endswith("~")  # the edge cases with a mask are plain
    assert not cells["softcap"].endswith("~") and not cells["kv_lengths"].endswith("~")
    # Of the edge cases, only "mask with fully masked rows" has a mask, in float32 and in bfloat16.
    assert f"~ {BORROWER}: 2 of {served} cases: {MASKED_CALLS}" in out, out


def test_explain_says_what_of_a_backends_work_runs_another_backends_code() -> None:
    attnkit.register_backend(BorrowsForMasks())
    try:
        q = k = v = torch.zeros(1, 2, 4, 8)
        with attnkit.use_backend(BORROWER):
            table = attnkit.explain(attnkit.AttentionSpec(), q, k, v)
        with attnkit.use_backend("torch-naive"):
            elsewhere = attnkit.explain(attnkit.AttentionSpec(), q, k, v)
    finally:
        attnkit.unregister_backend(BORROWER)
    row = next(line for line in table.splitlines() if line.startswith(f"-> {BORROWER}"))
    assert row.endswith(f"ok; runs {MASKED_CALLS.backend}'s code for: {MASKED_CALLS.part}")
    assert MASKED_CALLS.part not in elsewhere  # a backend that will not run this call does not say what it would run


@pytest.mark.parametrize(
    "backend", [p for p in backend_params() if "float64" in registry.get_backend(p.values[0]).capabilities.dtypes]
)
def test_check_runs_float64_on_every_backend_declaring_it(backend: str) -> None:
    """check draws float64 for every backend declaring it and runs a named float64 case on each, a JAX backend's under
    jax_enable_x64 turned on for that case alone (without it JAX has no float64, and the case was skipped)."""
    checked = registry.get_backend(backend)
    assert "float64" in drawable_dtypes(backend, x64_per_case=True)
    report = BackendReport(backend)
    float64 = [(label, case) for label, case in applicable_edge_cases(checked, report) if case.dtype == "float64"]
    assert float64, report.skipped
    outcome = run_case(backend, *float64[0], expect_support=True)
    assert outcome.ok, outcome.error or [str(comparison) for comparison in outcome.comparisons]
    report.outcomes.append(outcome)
    row = next(line.split() for line in results_table([report]).splitlines() if line.startswith("float64"))
    assert row[1] != "-" and float(row[1]) <= 1, row
    if "jax" in sys.modules:  # the x64 scope ended with the case: later cases and backends run as configured
        assert not sys.modules["jax"].config.read("jax_enable_x64")


def test_check_rejects_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "check", "--backend", "no-such-backend")
    assert code == 2 and "no-such-backend" in out


def test_bench_runs_and_writes_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "dispatch.json"
    code, out = run(capsys, "bench", "--what", "dispatch", "--rounds", "2", "--calls", "5", "--json", str(target))
    assert code == 0 and "CPU figures" in out and "dispatch overhead" in out
    keys = {"attend_auto_us", "direct_forward_us", "overhead_us", "stubbed_overhead_us", "environment"}
    assert keys <= set(json.loads(target.read_text()))
    code, out = run(capsys, "bench", "--what", "chunked", "--seq-len", "32", "--repeats", "1", "--warmup", "0")
    assert code == 0 and "torch sdpa" in out and "torch-naive" in out


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak-RSS reset needs Linux /proc")
def test_bench_memory_measures_in_a_child(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnkit.bench import chunked

    monkeypatch.setattr(chunked, "MEMORY_MEASURED", ("torch-chunked",))  # one child process (a torch import) only
    target = tmp_path / "memory.json"
    code, out = run(capsys, "bench", "--what", "memory", "--seq-len", "256", "--threads", "1", "--json", str(target))
    assert code == 0 and "torch-chunked" in out and "torch-naive not run: its float32 (B, H, L, L) score" in out
    assert "score matrix alone is 2 MiB" in out
    assert json.loads(target.read_text())["results"]["torch-chunked"]["peak_extra_bytes"] > 0
    assert run(capsys, "bench", "--what", "memory", "--device", "cuda")[0] == 2


def test_bench_backend_times_every_pass_against_sdpa(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "backend.json"
    args = ("bench", "--backend", "torch-chunked", "--seq-len", "32", "--repeats", "1", "--warmup", "0")
    code, out = run(capsys, *args, "--json", str(target))
    # torch-chunked runs on CPUs as on GPUs: CPU figures of it, not an interpreter's, and where its others come from
    assert code == 0 and "NOT A PERFORMANCE FIGURE" not in out and "also runs on a CUDA GPU (--device cuda)" in out
    rows = json.loads(target.read_text())["results"]
    assert {(row["implementation"], row["causal"], row["head_dim"]) for row in rows} == {
        (name, causal, dim) for name in ("torch-chunked", "torch sdpa") for causal in (False, True) for dim in (64, 128)
    }
    assert all(row[f"{name}_tflops"] > 0 for row in rows for name in ("fwd", "bwd", "fwd+bwd"))


def test_info_says_of_triton_what_a_python_process_finds() -> None:
    """Without a GPU and without TRITON_INTERPRET, `attnkit info` and `import attnkit` agree that triton cannot run,
    and both say how to run it interpreted. (The test process runs with TRITON_INTERPRET=1: both run in a fresh one,
    `import attnkit` first; with the variable set both find it available, as the rest of the suite shows.)"""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: triton is compiled here, interpreter or not")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    both = (
        "import attnkit, attnkit.cli; print(attnkit.get_backend('triton').available()); "
        "attnkit.cli.main(['info', '--wide'])"
    )
    result = subprocess.run([sys.executable, "-c", both], env=env, capture_output=True, text=True)
    in_python, *info = result.stdout.splitlines()
    (line,) = [row for row in info if row.split()[:1] == ["triton"]][:1]
    assert "TRITON_INTERPRET=1" in in_python, result.stdout + result.stderr
    assert "unavailable" in line and "TRITON_INTERPRET=1" in line, line
