"""The package's shape, read from the source without importing it: no import cycle, and a thin command line."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Where each installed package's source lives (pyproject.toml's package-dir puts backends/ at attnkit.backends).
PACKAGE_ROOTS = {"attnkit": REPO_ROOT / "attnkit", "attnkit.backends": REPO_ROOT / "backends"}
CLI_MAX_LINES = 300


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
    """The package modules an import statement anywhere in the file (functions included) names.

    ``from a import b`` imports the module a.b when there is one, else the attribute b of a. Importing a.b also runs
    a/__init__.py, but that edge is left out: every module would then depend on attnkit/__init__.py, which imports
    the public API, and no layering could be read from the graph.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: level 1 is this package, each further level one package up
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
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
    lines = len((REPO_ROOT / "attnkit" / "cli.py").read_text().splitlines())
    assert lines < CLI_MAX_LINES, f"attnkit/cli.py has {lines} lines: move the work into the modules it calls"
