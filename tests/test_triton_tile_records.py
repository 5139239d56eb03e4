"""The triton backend's autotuned tiles kept across processes (launch.TileRecords, docs/triton.md "Autotune records"),
planned on CPU: a recording executor stands for the GPU (tests/test_triton_planning.py) and the autotuner's timer
needs none, so what a compiled call launches shows whether it timed its candidates or took a recorded tile. A fresh
Autotuner reading the store is what a second process does: its in-process choices are empty."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import attnkit
from attnkit import AttentionSpec
from attnkit.backend import AttentionInputs
from tests.conftest import available_backends
from tests.test_triton_planning import decreasing_timer, executor, fake_gpu  # noqa: F401  (fake_gpu: a fixture)

pytestmark = pytest.mark.skipif("triton" not in available_backends(), reason="triton not available here")

H200 = "NVIDIA H200 sm_90"


def _refusing_timer(run: Callable[[], None]) -> float:
    raise AssertionError("timed a candidate where a record should have decided")


def _forward(records: Any, timer: Any, identity: str = H200, **launcher_options: Any) -> list[Any]:
    """One compiled sm_90 forward with a fresh autotuner on ``records``: the tiles launched, timed ones included."""
    from attnkit.backends.triton import launch

    from attnkit.contract.kernels import attention_forward

    recording = executor(compiled=True)
    launcher = launch.TritonLauncher(target=launch.Target(compiled=True, arch="sm_90"), executor=recording,
                                     autotuner=launch.Autotuner(timer=timer, records=records),
                                     device_identity=lambda device: identity, **launcher_options)  # fmt: skip
    q, k, v = (torch.randn(1, 2, 100, 64, dtype=torch.bfloat16) for _ in range(3))
    attention_forward(launcher, AttentionSpec(), AttentionInputs(q, k, v))
    return [launched.tile for launched in recording.launches]


def _records(directory: Path) -> Any:
    from attnkit.backends.triton import launch

    return launch.TileRecords(directory=lambda: directory, enabled=lambda: True)


@pytest.fixture
def tuned(tmp_path: Path, fake_gpu: None) -> tuple[Path, Any]:  # noqa: F811
    """A store in which one process has tuned the forward: (its record file, the tile it chose)."""
    directory = tmp_path / "tiles"
    first = _forward(_records(directory), decreasing_timer())
    [record] = directory.glob("*.json")
    assert len(first) > 2 and first[-1] != first[0]  # timed every candidate; the fake timer's pick is not the default
    return record, first[-1]


def test_a_fresh_autotuner_launches_the_recorded_tile_without_timing(tuned: tuple[Path, Any]) -> None:
    record, chosen = tuned
    assert oct(record.stat().st_mode & 0o777) == oct(0o600)
    assert oct(record.parent.stat().st_mode & 0o777) == oct(0o700)
    assert _forward(_records(record.parent), _refusing_timer) == [chosen]


@pytest.mark.parametrize("changed", ["gpu", "triton", "kernel source"])
def test_a_record_of_another_gpu_version_or_kernel_is_not_used(
    changed: str, tuned: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnkit.backends.triton import launch

    record, chosen = tuned
    options: dict[str, Any] = {}
    if changed == "gpu":
        options["identity"] = "NVIDIA H100 80GB HBM3 sm_90"
    elif changed == "triton":
        options["triton_version"] = "3.9.0" if launch.triton.__version__ != "3.9.0" else "3.6.0"
    else:
        monkeypatch.setattr(launch, "kernel_digest", lambda: "0" * 16)
    launched = _forward(_records(record.parent), decreasing_timer(), **options)
    assert len(launched) > 1  # timed anew
    assert len(list(record.parent.glob("*.json"))) == 2  # under its own key, beside the first


def test_a_corrupt_or_foreign_record_is_ignored_and_a_corrupt_one_replaced(
    tuned: tuple[Path, Any], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnkit.backends.triton import launch

    record, chosen = tuned
    whole = json.loads(record.read_text())

    record.write_text(record.read_text()[:40])  # cut short: not JSON
    assert len(_forward(_records(record.parent), decreasing_timer())) > 1
    assert json.loads(record.read_text())["config"] == whole["config"]  # replaced by a whole record

    outside = {**whole, "config": {"block_m": 256, "block_n": 256, "num_warps": 16, "num_stages": 9}}
    record.write_text(json.dumps(outside))  # names a tile that is not a candidate: never launched
    assert launch.TileConfig(256, 256, 16, 9) not in _forward(_records(record.parent), decreasing_timer())

    record.chmod(0o666)  # a file others could have written is never read
    with caplog.at_level("WARNING", logger="attnkit"):
        assert len(_forward(_records(record.parent), decreasing_timer())) > 1
    assert "refusing the triton tile record" in caplog.text and "writable by group or others" in caplog.text
    record.chmod(0o600)

    caplog.clear()
    owner = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)  # the directory and file now belong to someone else
    with caplog.at_level("WARNING", logger="attnkit"):
        assert len(_forward(_records(record.parent), decreasing_timer())) > 1
    assert f"owned by uid {owner}, not by the current user" in caplog.text


def test_the_records_follow_the_autotune_switch(tmp_path: Path, fake_gpu: None) -> None:  # noqa: F811
    """Off under ATTNKIT_AUTOTUNE=0 (the suite's, tests/conftest.py): nothing read or written; on with autotune."""
    from attnkit.backends.triton import launch

    directory = tmp_path / "tiles"
    records = launch.TileRecords(directory=lambda: directory)
    assert os.environ["ATTNKIT_AUTOTUNE"] == "0" and not records.enabled()
    _forward(records, decreasing_timer())
    assert not directory.exists()
    with attnkit.use_config({"autotune": True}):
        assert records.enabled()
        _forward(records, decreasing_timer())
        assert len(_forward(records, _refusing_timer)) == 1  # the recorded tile, untimed
    assert len(list(directory.glob("*.json"))) == 1


def test_the_records_are_bounded(tmp_path: Path) -> None:
    from attnkit.backends.triton import launch

    directory = tmp_path / "tiles"
    records = launch.TileRecords(directory=lambda: directory, limit=3, enabled=lambda: True)
    tile = launch.TileConfig(64, 64, 4, 3)
    for index in range(5):
        records.save(f"key{index}", "a key", tile, [(1.0, tile)])
        os.utime(directory / f"key{index}.json", (index, index))  # the written order, whatever the clock's grain
    assert sorted(path.name for path in directory.glob("*.json")) == ["key2.json", "key3.json", "key4.json"]
    assert records.load("key4", (tile,)) == tile and records.load("key4", ()) is None
