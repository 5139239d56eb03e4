"""The layers, read from the source (no importing): what a backend may import, what the door and the contract
helpers stand on, no import cycle anywhere, and a thin command line (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each installed package's source lives (pyproject.toml's package-dir puts backends/ at attnkit.backends).
PACKAGE_ROOTS = {"attnkit": ROOT / "attnkit", "attnkit.backends": ROOT / "backends"}
CLI_MAX_LINES = 300
#: Everything of attnkit a backend may import: the door and the contract helpers.
BACKEND_MAY_IMPORT = frozenset(
    {
        "attnkit.backend",
        "attnkit.contract",
        "attnkit.contract.torch",
        "attnkit.contract.dropout",
        "attnkit.contract.philox",
        "attnkit.contract.programs",
        "attnkit.contract.jax",
        "attnkit.contract.kernels",
        "attnkit.contract.kernel_checks",
        "attnkit.contract.sass",
    }
)
#: The core modules the door and the contract helpers stand on (none of them imports api, config, dispatch, registry).
GROUND = frozenset(
    {"attnkit.build", "attnkit.errors", "attnkit.features", "attnkit.records", "attnkit.spec", "attnkit.tables"}
)


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(level, module, names) of every import in ``path``, function-level ones included; level > 0 is relative, and
    names are what ``from module import ...`` takes (empty for ``import module``)."""
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(0, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or "", [alias.name for alias in node.names]))
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "backends").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_backend_imports_only_the_door_the_contract_helpers_and_its_own_package(path: Path) -> None:
    own_package = path.parent != ROOT / "backends"
    for level, module, _ in _imports(path):
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
    for _, module, _ in _imports(path):
        if module.split(".")[0] == "attnkit":
            assert module in allowed, f"{path.name} imports {module} (allowed: {sorted(allowed)})"


def source_modules() -> dict[str, Path]:
    """Every module of attnkit and attnkit.backends by its dotted name (a package by its __init__.py)."""
    modules = {}
    for package, root in PACKAGE_ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imported_modules(module: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules the imports of ``path`` name, function-level ones included.

    ``from a import b`` imports the module a.b when there is one, else the attribute b of a. Importing a.b also runs
    a/__init__.py, but that edge is left out: every module would then depend on attnkit/__init__.py, which imports
    the public API, and no layering could be read from the graph.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for level, base, names in _imports(path):
        if level:  # relative: level 1 is this package, each further level one package up
            anchor = package.rsplit(".", level - 1)[0]
            base = f"{anchor}.{base}" if base else anchor
        if not names and base in modules:
            found.add(base)
        for name in names:
            if f"{base}.{name}" in modules:
                found.add(f"{base}.{name}")
            elif base in modules:
                found.add(base)
    return found - {module}


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = source_modules()
    return {module: imported_modules(module, path, set(modules)) for module, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None; depth-first, iterative (no recursion limit)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            successor = next(stack[-1], None)
            if successor is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(successor) == 1:
                return path[path.index(successor) :] + [successor]
            elif successor not in state:
                state[successor] = 1
                path.append(successor)
                stack.append(iter(sorted(graph[successor])))
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checker_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_cli_is_parsing_and_calls() -> None:
    lines = len((ROOT / "attnkit" / "cli.py").read_text().splitlines())
    assert lines < CLI_MAX_LINES, f"attnkit/cli.py has {lines} lines: move the work into the modules it calls"
