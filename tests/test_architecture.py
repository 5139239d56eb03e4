"""The layers, read from the source (no importing): what a backend may import, and what the door and the contract
helpers stand on (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Everything of attnkit a backend may import: the door and the contract helpers.
BACKEND_MAY_IMPORT = frozenset(
    {
        "attnkit.backend",
        "attnkit.contract",
        "attnkit.contract.torch",
        "attnkit.contract.jax",
        "attnkit.contract.kernels",
    }
)
#: The core modules the door and the contract helpers stand on (none of them imports api, config, dispatch, registry).
GROUND = frozenset({"attnkit.build", "attnkit.errors", "attnkit.features", "attnkit.spec"})


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) of every import in ``path``, function-level ones included; level > 0 is relative."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "backends").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_backend_imports_only_the_door_the_contract_helpers_and_its_own_package(path: Path) -> None:
    own_package = path.parent != ROOT / "backends"
    for level, module in _imports(path):
        if level:
            assert own_package and level == 1, f"{path.name}: relative import beyond its own subpackage: {module}"
        elif module.split(".")[0] == "attnkit":
            assert module in BACKEND_MAY_IMPORT, f"{path.name} imports {module} (allowed: {sorted(BACKEND_MAY_IMPORT)})"


@pytest.mark.parametrize(
    "path",
    [ROOT / "attnkit" / "backend.py", *sorted((ROOT / "attnkit" / "contract").glob("*.py"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_the_door_and_the_contract_helpers_stand_on_the_ground_floor_only(path: Path) -> None:
    allowed = GROUND | BACKEND_MAY_IMPORT
    for _, module in _imports(path):
        if module.split(".")[0] == "attnkit":
            assert module in allowed, f"{path.name} imports {module} (allowed: {sorted(allowed)})"
