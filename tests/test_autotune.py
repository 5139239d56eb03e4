"""auto's measuring (attnkit/autotune.py): where the cost table cannot decide, the first eager call of a bucket times
the contenders and keeps the winner in a record that later calls and processes use. Nothing here reads a real clock:
the contenders are tests/clocked_backends.py's, whose calls advance a fake clock by a known cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit import autotune, config, dispatch, validation
from attnkit.cost import CostEntry, CostTable, load_table, write_table
from attnkit.environment import cpu_fingerprint
from attnkit.errors import ConfigError
from attnkit.spec import AttentionSpec
from tests import clocked_backends
from tests.clocked_backends import CLOCK, COSTS, FAST, SLOW

REPO_ROOT = Path(__file__).resolve().parent.parent
SPEC = AttentionSpec(causal=True, causal_alignment="top_left")


@pytest.fixture
def records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The clocked backends registered, measuring on with their config, the fake clock in, records in a fresh
    directory; both backends count as warm (their first call in a process is otherwise an untimed warm-up)."""
    directory = tmp_path / "records"
    clocked_backends.register()
    monkeypatch.setattr(autotune, "clock", CLOCK)
    monkeypatch.setattr(autotune, "_warm", set(COSTS))
    CLOCK.reset()
    try:
        with autotune.STORE.use_directory(directory), attnkit.use_config(clocked_backends.CONFIG):
            yield directory
    finally:
        clocked_backends.unregister()
        dispatch.clear_cache()


def _inputs(len_q: int = 6, len_k: int = 6, grad: bool = False) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, len_q, 8, generator=generator)
    k, v = (torch.randn(1, 2, len_k, 8, generator=generator) for _ in range(2))
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def _decided_by(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    return attnkit.explain(SPEC, q, k, v).splitlines()[-1]


def test_the_faster_contender_wins_and_its_bucket_is_measured_once(records: Path) -> None:
    q, k, v = _inputs()
    before = _decided_by(q, k, v)
    assert before.startswith(f"decided by: {SLOW} is the first in the priority list")
    assert f"not measured yet: the first eager attend call of its bucket times {SLOW}, {FAST}" in before

    attnkit.attend(SPEC, q, k, v)
    # One timed call each (the slow one is beaten by more than CLOSE), then the call itself on the winner.
    assert CLOCK.calls == {SLOW: 1, FAST: 2}
    [record_file] = records.glob("*.json")
    stored = json.loads(record_file.read_text())
    assert stored["winner"] == FAST and dict(stored["times_us"]) == {SLOW: 3e6, FAST: 1e6}
    after = _decided_by(q, k, v)
    assert after.startswith(f"decided by: {FAST} was measured fastest: {SLOW} 3 s, {FAST} 1 s (record {record_file};")
    assert "->" in next(line for line in attnkit.explain(SPEC, q, k, v).splitlines() if FAST in line)

    # The same call, and another shape of its bucket (lengths up to 8): the record decides, nothing is timed again.
    attnkit.attend(SPEC, q, k, v)
    attnkit.attend(SPEC, *_inputs(len_q=7, len_k=7))
    assert CLOCK.calls == {SLOW: 1, FAST: 4}
    # Another bucket (lengths up to 16) is measured once.
    attnkit.attend(SPEC, *_inputs(len_q=12, len_k=12))
    assert CLOCK.calls == {SLOW: 2, FAST: 6} and len(list(records.glob("*.json"))) == 2


def test_measuring_costs_at_most_three_calls_of_the_slowest_contender(records: Path) -> None:
    """Two contenders as close as the fake clock allows are timed again while the budget lasts, never past it."""
    saved = dict(COSTS)
    try:
        COSTS[SLOW] = 1.05  # within CLOSE of the fast one: both are timed again
        attnkit.attend(SPEC, *_inputs())
        measuring = CLOCK.now - COSTS[SLOW]  # less the call itself, which ran on the winner
        assert measuring <= attnkit.current_config().autotune_budget_calls * COSTS[SLOW]
        assert CLOCK.calls[SLOW] == 2  # a second round (2.05 more) would pass the budget of 3.15
        # One sample each within CLOSE cannot tell them apart: the first in the priority list (the slow one) keeps it.
        [record_file] = records.glob("*.json")
        assert json.loads(record_file.read_text())["winner"] == SLOW
    finally:
        COSTS.update(saved)


@pytest.mark.parametrize("first_call_extra", [0.0, 1.0])
def test_the_first_calls_measuring_adds_at_most_three_calls_of_the_slowest_contender(
    records: Path, monkeypatch: pytest.MonkeyPatch, first_call_extra: float
) -> None:
    """What a user waits for: the first call of a bucket with measuring, less the same call once a record decides
    (the winner's own first call). Neither backend has run in the process: each one's first call is timed as a
    sample, loading included, and nothing is timed for warm-up alone (an untimed warm-up call of each, as before,
    made this 11 and 12 fake seconds, over the bound of 9)."""
    monkeypatch.setattr(autotune, "_warm", set())
    monkeypatch.setitem(COSTS, FAST, 2.5)  # clearly faster (by more than CLOSE), but not by enough to skip a re-time
    monkeypatch.setitem(clocked_backends.FIRST_CALL_EXTRA, SLOW, first_call_extra)
    monkeypatch.setitem(clocked_backends.FIRST_CALL_EXTRA, FAST, first_call_extra)
    attnkit.attend(SPEC, *_inputs())
    with_measuring = CLOCK.now
    winners_first_call = COSTS[FAST] + first_call_extra
    budget = attnkit.current_config().autotune_budget_calls
    assert with_measuring - winners_first_call <= budget * COSTS[SLOW]
    # The slow one timed once (its first call); the fast one twice (its first call may be loading), then the call.
    assert CLOCK.calls == {SLOW: 1, FAST: 3}
    [record_file] = records.glob("*.json")
    assert json.loads(record_file.read_text())["winner"] == FAST


def test_a_contender_whose_first_call_builds_is_not_timed_and_the_prediction_decides(
    records: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(autotune, "_warm", set())
    monkeypatch.setitem(clocked_backends.COLD_START, FAST, "its first call builds a kernel")
    q, k, v = _inputs()
    attnkit.attend(SPEC, q, k, v)
    assert CLOCK.calls == {SLOW: 2, FAST: 0}  # one timed call of the prediction's pick, then the call itself
    decided = _decided_by(q, k, v)
    assert f"{SLOW} was measured fastest: {SLOW} 3 s; not timed: {FAST} (its first call builds a kernel)" in decided
    # Kept in this process only: a later process, where the build is done, measures the bucket again.
    assert "record kept in this process only" in decided and not list(records.glob("*.json"))


def test_a_budget_in_seconds_leaves_the_rest_untimed_and_says_so(records: Path) -> None:
    q, k, v = _inputs()
    with attnkit.use_config({"autotune_budget_s": 3.5}):
        attnkit.attend(SPEC, q, k, v)
        assert CLOCK.calls == {SLOW: 2, FAST: 0}  # the slow pick took 3 s: another call would pass 3.5 s
        decided = _decided_by(q, k, v)
    assert f"not timed: {FAST} (the budget of 3.5 s (autotune_budget_s) was spent)" in decided


def test_a_call_that_records_gradients_is_measured_forward_and_backward_without_touching_its_grads(
    records: Path,
) -> None:
    q, k, v = _inputs(grad=True)
    out = attnkit.attend(SPEC, q, k, v)
    assert CLOCK.backward_calls == {SLOW: 1, FAST: 1}  # measuring ran each backward once, on detached views
    assert q.grad is None and k.grad is None and v.grad is None
    out.sum().backward()
    with attnkit.use_backend(FAST):
        q2, k2, v2 = _inputs(grad=True)
        attnkit.attend(SPEC, q2, k2, v2).sum().backward()
    for mine, theirs in zip((q, k, v), (q2, k2, v2)):
        torch.testing.assert_close(mine.grad, theirs.grad)  # one backward's gradients, nothing from measuring
    [record_file] = records.glob("*.json")
    assert "forward+backward" in json.loads(record_file.read_text())["bucket"]


def test_a_record_is_used_by_another_process(records: Path) -> None:
    q, k, v = _inputs()
    attnkit.attend(SPEC, q, k, v)
    [record_file] = records.glob("*.json")
    child = textwrap.dedent(
        f"""
        import torch
        torch.set_num_threads({torch.get_num_threads()})  # part of a record's key
        import attnkit
        from attnkit import autotune
        from tests import clocked_backends
        from tests.clocked_backends import CLOCK
        clocked_backends.register()
        autotune.clock = CLOCK
        q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
        with autotune.STORE.use_directory({str(records)!r}), attnkit.use_config(clocked_backends.CONFIG):
            spec = attnkit.AttentionSpec(causal=True, causal_alignment="top_left")
            print(attnkit.explain(spec, q, k, v).splitlines()[-1])
            attnkit.attend(spec, q, k, v)
        print(CLOCK.calls)
        """
    )
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, cwd=REPO_ROOT, env=environment, timeout=120
    )
    assert result.returncode == 0, result.stderr
    decided, calls = result.stdout.strip().splitlines()[-2:]
    assert decided.startswith(f"decided by: {FAST} was measured fastest") and str(record_file) in decided
    assert calls == str({SLOW: 0, FAST: 1})  # the call itself: no measuring in the second process


def test_concurrent_writers_leave_whole_records_and_the_store_bounded(tmp_path: Path) -> None:
    directory = tmp_path / "records"
    writer = textwrap.dedent(
        f"""
        import sys
        from attnkit import autotune
        with autotune.STORE.use_directory({str(directory)!r}):
            for index in range(60):
                key = "shared" if index % 2 else f"own-{{sys.argv[1]}}-{{index}}"
                record = autotune.Record(key, "a bucket", "a", (("a", 1.0), ("b", float(index))), "now")
                kept = autotune.STORE.save(record, limit=20)
                assert kept.path, kept.note
        """
    )
    writers = [
        subprocess.Popen([sys.executable, "-c", writer, str(number)], cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
        for number in range(4)
    ]
    for process in writers:
        _, errors = process.communicate(timeout=120)
        assert process.returncode == 0, errors
    files = list(directory.iterdir())
    assert not [path for path in files if path.suffix != ".json"]  # no scratch file left behind
    assert len(files) <= 20 + len(writers)  # each writer prunes to 20 after its own write
    for path in files:
        record = autotune.Record.from_json(json.loads(path.read_text()), str(path))
        assert record is not None and path.name == f"{record.key}.json"


def test_a_directory_or_record_others_can_write_is_refused(records: Path, caplog: pytest.LogCaptureFixture) -> None:
    q, k, v = _inputs()
    attnkit.attend(SPEC, q, k, v)
    [record_file] = records.glob("*.json")
    assert oct(records.stat().st_mode & 0o777) == oct(0o700) and oct(record_file.stat().st_mode & 0o777) == oct(0o600)

    written = record_file.read_text()

    record_file.chmod(0o666)  # a record anyone could have written is never read
    autotune.STORE.forget()
    dispatch.clear_cache()
    with caplog.at_level("WARNING", logger="attnkit"):
        assert "not measured yet" in _decided_by(q, k, v)
    assert "refusing the autotune record" in caplog.text and "is writable by group or others" in caplog.text
    record_file.chmod(0o600)

    records.chmod(0o777)  # nor is any record of a directory anyone could write into
    autotune.STORE.forget()
    dispatch.clear_cache()
    caplog.clear()
    try:
        with caplog.at_level("WARNING", logger="attnkit"):
            assert "not measured yet" in _decided_by(q, k, v)
            attnkit.attend(SPEC, q, k, v)  # measured again, kept in the process only
        assert "refusing the autotune records directory" in caplog.text
        decided = _decided_by(q, k, v)
        assert f"{FAST} was measured fastest" in decided and "record kept in this process only: refusing" in decided
        assert record_file.read_text() == written  # nothing is written into it either
    finally:
        records.chmod(0o700)


def test_nothing_is_measured_under_no_grad_decode_compile_or_meta(records: Path) -> None:
    with torch.no_grad():
        q, k, v = _inputs(len_q=1, len_k=32)
        attnkit.attend(SPEC, q, k, v)
        assert "not measured: a decode step under torch.no_grad()" in _decided_by(q, k, v)
    assert CLOCK.calls == {SLOW: 1, FAST: 0}  # the call itself, on the prediction's (the priority list's) pick

    meta = [x.to("meta") for x in _inputs()]
    assert attnkit.attend(SPEC, *meta).device.type == "meta"

    compiled = torch.compile(lambda q, k, v: attnkit.attend(SPEC, q, k, v), backend="eager", fullgraph=True)
    compiled(*_inputs(len_q=20, len_k=20))
    assert CLOCK.calls == {SLOW: 2, FAST: 0} and not list(records.glob("*.json"))

    with torch.no_grad():  # a prefill under no_grad is measured: its bucket's later calls pay for the choice
        attnkit.attend(SPEC, *_inputs(len_q=32, len_k=32))
    assert CLOCK.calls == {SLOW: 3, FAST: 2} and len(list(records.glob("*.json"))) == 1


def test_the_switch_turns_measuring_off(records: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _inputs()
    with attnkit.use_config({"autotune": False}):
        attnkit.attend(SPEC, q, k, v)
        off = f"predicted, not measured: measuring is off ({dispatch.MEASURING_SWITCHES})"
        assert _decided_by(q, k, v).endswith(off)
    assert CLOCK.calls == {SLOW: 1, FAST: 0} and not list(records.glob("*.json"))

    attnkit.attend(SPEC, q, k, v)  # on again: measured, and the record is written
    assert list(records.glob("*.json"))
    with attnkit.use_config({"autotune": False}):  # off, a record there is not read either
        assert "measured" not in _decided_by(q, k, v).split(";")[0]

    for value, expected in (("0", False), ("OFF", False), ("1", True), ("on", True)):
        monkeypatch.setenv("ATTNKIT_AUTOTUNE", value)
        assert config.configure().autotune is expected
    monkeypatch.setenv("ATTNKIT_AUTOTUNE", "maybe")
    with pytest.raises(ConfigError, match="ATTNKIT_AUTOTUNE='maybe': expected on or off"):
        config.configure()
    monkeypatch.setenv("ATTNKIT_AUTOTUNE", "0")
    config.configure()


def test_contenders_are_the_close_predictions_or_the_spread_of_a_foreign_table() -> None:
    current = config.current_config().model_copy(
        update={"cost_margin": 0.5, "autotune_spread": 4.0, "autotune_candidates": 3, "autotune_exclude": ("x",)}
    )
    servable = ["a", "b", "c", "d", "x"]
    predicted = {"a": 100.0, "b": 140.0, "c": 390.0, "d": None, "x": 90.0}
    # Fitted here: only the predictions within the margin (a, b), the prediction's pick first.
    assert autotune.contenders(servable, predicted, "a", True, current) == ("a", "b")
    # Fitted elsewhere: within 4x, then the unpredicted, capped at three; the excluded never.
    assert autotune.contenders(servable, predicted, "b", False, current) == ("b", "a", "c")
    assert autotune.contenders(["a", "c"], {"a": 100.0, "c": 390.0}, "a", True, current) == ("a",)
    assert autotune.contenders(servable, predicted, "x", False, current) == ("x",)  # an excluded pick stands


def test_a_table_fitted_on_this_machine_is_trusted() -> None:
    problem = validation.prepare(SPEC, *_inputs(), None, None, None, None, False)[1]

    def table(fitted_on: str) -> CostTable:
        return CostTable(
            CostEntry(name, "cpu", "float32", "forward", 1.0, 1.0, 1.0, fitted_on=fitted_on) for name in ("a", "b")
        )

    assert table(cpu_fingerprint()).fitted_here(problem, ["a", "b"])
    assert not table("another machine").fitted_here(problem, ["a", "b"])
    assert not table(cpu_fingerprint()).fitted_here(problem, ["a", "c"])  # c has no entry
    assert not config.shipped_cost_table().fitted_here(problem, ["torch-sdpa", "cpu-flash"])  # fitted elsewhere


def test_a_calibrated_table_records_the_machine_it_was_fitted_on(tmp_path: Path) -> None:
    entries = [CostEntry("a", "cpu", "float32", "forward", 1.0, 2.0, 3.0, fitted_on=cpu_fingerprint())]
    write_table(entries, tmp_path / "costs.toml", "a header")
    assert f'fitted_on = "{cpu_fingerprint()}"' in (tmp_path / "costs.toml").read_text()
    [entry] = load_table(tmp_path / "costs.toml").entries.values()
    assert entry.fitted_on == cpu_fingerprint()
