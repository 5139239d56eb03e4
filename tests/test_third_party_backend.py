"""A backend written against the door alone (tests/third_party_backend.py), installed through the ``attnkit.backends``
entry-point group, passes ``attnkit check --backend`` on it: the door is all a backend author needs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from attnkit import registry
from attnkit.cli import main
from tests import third_party_backend
from tests.conftest import installed_plugin

DOOR = "attnkit.backend"


def test_the_plugin_imports_nothing_of_attnkit_but_the_door() -> None:
    tree = ast.parse(Path(third_party_backend.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {name for name in imported if name.split(".")[0] == "attnkit"} == {DOOR}


def test_a_plugin_written_against_the_door_passes_attnkit_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = {"tiny": "tests.third_party_backend:TinyBackend"}
    with installed_plugin(tmp_path, monkeypatch, "attnkit-door-tiny 0.1", entry):
        assert registry.origins()[third_party_backend.NAME].startswith("entry point tiny = ")
        code = main(["check", "--backend", third_party_backend.NAME, "--examples", "12"])
        out = capsys.readouterr().out
    assert code == 0, out
    assert f"{third_party_backend.NAME}" in out and "OK" in out
