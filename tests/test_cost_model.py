"""The cost model auto uses among backends that can all serve a call (attnkit/cost.py, docs/dispatch.md)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit import AttentionSpec, ConfigError, cost
from attnkit.cost import CostEntry, visible_pairs


def brute_force_visible(spec: AttentionSpec, len_q: int, len_k: int) -> int:
    offset = len_k - len_q if spec.causal_alignment.value == "bottom_right" else 0
    left, right = spec.window if spec.window is not None else (None, None)
    count = 0
    for i, j in itertools.product(range(len_q), range(len_k)):
        aligned = i + offset
        seen = not (spec.causal and j > aligned)
        seen = seen and not (left is not None and j < aligned - left)
        seen = seen and not (right is not None and j > aligned + right)
        count += seen
    return count


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window", [None, (0, 0), (3, None), (None, 2), (2, 5), (7, 0)])
def test_visible_pairs_counts_what_the_contract_shows(causal: bool, alignment: str, window) -> None:
    spec = AttentionSpec(causal=causal, causal_alignment=alignment, window=window)
    for len_q, len_k in [(0, 5), (1, 1), (1, 9), (5, 2), (6, 6), (4, 13), (13, 4)]:
        assert visible_pairs(spec, len_q, len_k) == brute_force_visible(spec, len_q, len_k), (len_q, len_k)


def write(path: Path, entries: list[CostEntry]) -> Path:
    cost.write_table(entries, path, "test table")
    return path


def entry(backend: str, overhead_us: float, ns_per_visible_unit: float, ns_per_full_unit: float = 0.0) -> CostEntry:
    return CostEntry(backend, "cpu", "float32", cost.FORWARD, overhead_us, ns_per_visible_unit, ns_per_full_unit)


def chosen(spec: AttentionSpec, len_q: int, len_k: int) -> str:
    q, k = torch.randn(1, 2, len_q, 8), torch.randn(1, 2, len_k, 8)
    rows = attnkit.explain(spec, q, k, k).splitlines()
    return next(row.split()[1] for row in rows if row.startswith("->"))


def test_table_picks_the_predicted_fastest_and_explain_shows_predictions(tmp_path: Path) -> None:
    # torch-naive pays for every (query, key) pair; torch-chunked has more overhead but skips hidden pairs.
    entries = [entry("torch-chunked", 100.0, 0.0, 0.0), entry("torch-naive", 1.0, 0.0, 1.0)]
    table = write(tmp_path / "costs.toml", entries)
    priority = {"cpu": ["torch-chunked", "torch-naive"]}
    with attnkit.use_config({"priority": priority, "costs": str(table)}):
        assert chosen(AttentionSpec(), 1, 8) == "torch-naive"  # 1 + tiny << 100
        assert chosen(AttentionSpec(), 512, 512) == "torch-chunked"  # naive's full work dominates
        q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 8, 8)
        assert "predicted" in attnkit.explain(AttentionSpec(), q, k, k)
    with attnkit.use_config({"priority": priority, "costs": str(table), "use_costs": False}):
        assert chosen(AttentionSpec(), 1, 8) == "torch-chunked"  # priority order alone


def test_margin_and_missing_entries_keep_the_priority_order(tmp_path: Path) -> None:
    priority = {"cpu": ["torch-chunked", "torch-naive"]}
    close = write(tmp_path / "close.toml", [entry("torch-chunked", 10.0, 0.0), entry("torch-naive", 9.5, 0.0)])
    with attnkit.use_config({"priority": priority, "costs": str(close), "cost_margin": 0.1}):
        assert chosen(AttentionSpec(), 4, 4) == "torch-chunked"  # 5% faster is within the margin
    with attnkit.use_config({"priority": priority, "costs": str(close), "cost_margin": 0.0}):
        assert chosen(AttentionSpec(), 4, 4) == "torch-naive"
    first_unmeasured = write(tmp_path / "partial.toml", [entry("torch-naive", 0.0, 0.0)])
    with attnkit.use_config({"priority": priority, "costs": str(first_unmeasured)}):
        # a measured backend never overrides an unmeasured first one
        assert chosen(AttentionSpec(), 4, 4) == "torch-chunked"


def test_forced_backend_ignores_the_table(tmp_path: Path) -> None:
    table = write(tmp_path / "costs.toml", [entry("torch-chunked", 100.0, 0.0), entry("torch-naive", 0.0, 0.0)])
    with attnkit.use_config({"priority": {"cpu": ["torch-chunked", "torch-naive"]}, "costs": str(table)}):
        with attnkit.use_backend("torch-chunked"):
            assert chosen(AttentionSpec(), 4, 4) == "torch-chunked"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[entry]]\nbackend = "x"\n', "missing keys"),
        (
            '[[entry]]\nbackend="x"\ndevice="cpu"\ndtype="float32"\npass="sideways"\noverhead_us=1\n'
            "ns_per_visible_unit=1\nns_per_full_unit=0\n",
            "pass='sideways'",
        ),
        (
            '[[entry]]\nbackend="x"\ndevice="cpu"\ndtype="float32"\npass="forward"\noverhead_us=-1\n'
            "ns_per_visible_unit=1\nns_per_full_unit=0\n",
            "overhead_us=-1.0",
        ),
        ("entry = 3\n", "array of tables"),
    ],
)
def test_malformed_table_is_a_config_error_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        attnkit.configure({"costs": str(path)})


def test_relative_table_path_is_relative_to_the_config_file(tmp_path: Path) -> None:
    write(tmp_path / "mine.toml", [entry("torch-naive", 1.0, 0.0)])
    config_file = tmp_path / "attnkit.toml"
    config_file.write_text('costs = "mine.toml"\n')
    config = attnkit.configure(config_file)
    assert Path(config.costs or "") == tmp_path / "mine.toml"


def test_fit_recovers_the_coefficients_of_a_linear_model() -> None:
    points = [(v, f, 3.0 + 0.002 * v + 0.0005 * f) for v, f in [(1e3, 2e3), (1e5, 1e5), (5e5, 1e6), (2e6, 4e6)]]
    overhead, per_visible, per_full = cost.fit(points)
    assert overhead == pytest.approx(3.0, rel=1e-6)
    assert per_visible == pytest.approx(2.0, rel=1e-6)
    assert per_full == pytest.approx(0.5, rel=1e-6)


def test_shipped_table_loads() -> None:
    assert attnkit.current_config().cost_table() is not None


def test_a_measured_call_corrects_the_fit_nearby_and_fades_beyond_twice_its_work() -> None:
    """The linear fit can be off by 2x where caches change regime; at a measured call the prediction is the
    measurement, at half or twice its work the plain fit again, and in between a blend."""
    fit_only = CostEntry("b", "cpu", "float32", cost.FORWARD, 0.0, 1.0, 0.0)  # 1 ns per visible unit
    measured = CostEntry("b", "cpu", "float32", cost.FORWARD, 0.0, 1.0, 0.0, ((1000.0, 1000.0, 3.0),))
    assert fit_only.predict_us(1000.0, 1000.0) == pytest.approx(1.0)
    assert measured.predict_us(1000.0, 1000.0) == pytest.approx(3.0)
    assert measured.predict_us(2000.0, 2000.0) == pytest.approx(fit_only.predict_us(2000.0, 2000.0))
    assert measured.predict_us(400.0, 400.0) == pytest.approx(fit_only.predict_us(400.0, 400.0))
    halfway = measured.predict_us(1000.0 * 2**0.5, 1000.0 * 2**0.5)
    assert halfway == pytest.approx(2**0.5 * 3.0**0.5)


def test_measured_points_round_trip_and_bad_ones_are_refused(tmp_path: Path) -> None:
    measured = CostEntry("torch-naive", "cpu", "float32", cost.FORWARD, 1.0, 2.0, 3.0, ((10.0, 20.0, 5.0),))
    table = cost.load_table(write(tmp_path / "ok.toml", [measured]))
    assert table.entries[("torch-naive", "cpu", "float32", cost.FORWARD, "")] == measured
    bad = (tmp_path / "ok.toml").read_text().replace("[[10, 20, 5]]", "[[10, 20]]")
    (tmp_path / "bad.toml").write_text(bad)
    with pytest.raises(attnkit.ConfigError, match="measured"):
        cost.load_table(tmp_path / "bad.toml")
