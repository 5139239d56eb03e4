"""Slow one-time work is never silent: building a run-time extension and ``auto``'s measuring say so once per process
(attnkit/notices.py), as an INFO record on the ``attnkit`` logger and, where nobody configured logging for attnkit,
as one line on stderr. No real build runs here: the builder is a fake."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from attnkit import autotune, build, notices
from attnkit.build import TorchExtension


@pytest.fixture(autouse=True)
def fresh_notices() -> Iterator[None]:
    notices.forget()
    yield
    notices.forget()


def unconfigure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Logging as a script that never configured it has it: no handler on attnkit or the root, no ATTNKIT_LOG.
    Called in the test's body: pytest puts its capturing handlers on the root as each test phase begins."""
    monkeypatch.delenv("ATTNKIT_LOG", raising=False)
    monkeypatch.setattr(logging.getLogger("attnkit"), "handlers", [])
    monkeypatch.setattr(logging.root, "handlers", [])


def fake_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[TorchExtension, list[list[str]]]:
    """An extension whose builder only records its command line (build.run_bounded), and that list."""
    launched: list[list[str]] = []
    monkeypatch.setattr(build, "run_bounded", lambda command, *_: launched.append(list(command)))
    extension = TorchExtension("attnkit_fake", Path(__file__), ["-O1"], label="the fake kernel", expected_s=30)
    return extension, launched


def test_a_build_says_so_once_on_stderr_when_logging_is_not_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    unconfigure(monkeypatch)
    extension, launched = fake_build(tmp_path, monkeypatch)
    for attempt in range(2):
        extension._make(tmp_path / f"scratch{attempt}", tmp_path / "log")
    assert len(launched) == 2
    assert capsys.readouterr().err == "attnkit: building the fake kernel (once, ~30 s); later processes reuse it\n"


def test_a_build_is_an_info_record_and_nothing_on_stderr_where_logging_is_configured(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    extension, _ = fake_build(tmp_path, monkeypatch)
    with caplog.at_level(logging.INFO, logger="attnkit"):
        extension._make(tmp_path / "scratch", tmp_path / "log")
    [record] = [r for r in caplog.records if "building the fake kernel" in r.getMessage()]
    assert record.levelno == logging.INFO and record.name == "attnkit"
    assert capsys.readouterr().err == ""  # caplog's handler on the root is a configuration: it alone decides


def test_what_counts_as_configured_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATTNKIT_LOG", raising=False)
    parent = logging.Logger("standalone")  # outside the hierarchy: no root above it
    child = logging.Logger("standalone.child")
    child.parent = parent
    assert not notices.logging_configured(child)
    parent.addHandler(logging.NullHandler())  # silencing attnkit on purpose is a configuration
    assert notices.logging_configured(child)
    child.propagate = False
    assert not notices.logging_configured(child)
    monkeypatch.setenv("ATTNKIT_LOG", "warning")
    assert notices.logging_configured(child)


def test_measuring_over_a_second_says_so_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """auto's measuring, timed by a fake clock: 0.5 s passes in silence; 2 s is announced, once per process."""
    unconfigure(monkeypatch)
    now = [0.0]
    monkeypatch.setattr(autotune, "clock", lambda: now[0])
    taking: list[float] = []

    def fake_measure(*_: object) -> None:
        now[0] += taking.pop(0)

    monkeypatch.setattr(autotune, "_measure", fake_measure)
    contenders = [type("B", (), {"name": name})() for name in ("torch-sdpa", "cpu-flash")]
    for seconds in (0.5, 2.0, 3.0):
        taking.append(seconds)
        autotune.measure(contenders, None, [], 3.0)  # type: ignore[arg-type]
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("attnkit: auto timed torch-sdpa, cpu-flash on a new kind of call (2.0 s,"), line
