"""The documentation site (mkdocs.yml) stays complete: every public name has a reference entry generated from its
docstring, every parameter of a public function is described there, and every page the nav lists exists. The build
itself (`mkdocs build --strict`, which checks links and anchors) is a step of .ci/run, not a test."""

from __future__ import annotations

import ast
import functools
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import attnkit
import attnkit.distributed

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TRANSFORMERS_MODULE = ROOT / "attnkit" / "integrations" / "transformers.py"


@functools.cache
def reference_directives() -> frozenset[str]:
    """The objects the reference pages render: the targets of their `::: name` lines."""
    return frozenset(
        match.group(1)
        for page in (DOCS / "reference").glob("*.md")
        for match in re.finditer(r"^::: (\S+)$", page.read_text(), re.M)
    )


@functools.cache
def transformers_public_definitions() -> dict[str, ast.FunctionDef | ast.ClassDef]:
    """The integration's public functions and classes, read from its source (importing it needs transformers)."""
    tree = ast.parse(TRANSFORMERS_MODULE.read_text())
    return {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_")
    }


def public_entry_points() -> list[str]:
    names = [f"attnkit.{name}" for name in attnkit.__all__]
    names += [f"attnkit.distributed.{name}" for name in attnkit.distributed.__all__]
    names += [f"attnkit.integrations.transformers.{name}" for name in transformers_public_definitions()]
    return names


@pytest.mark.parametrize("name", public_entry_points())
def test_every_public_name_has_a_reference_entry(name: str) -> None:
    directives = reference_directives()
    short = name.rsplit(".", 1)[1]
    # attnkit's re-exports may be rendered where they are defined (attnkit.backend.Backend for attnkit.Backend).
    found = name in directives or (
        name.count(".") == 1 and any(d.startswith("attnkit.") and d.rsplit(".", 1)[1] == short for d in directives)
    )
    assert found, f"no `::: {name}` in docs/reference/*.md"


def described_parameters(docstring: str | None) -> set[str]:
    return set(re.findall(r"^\s*:param (\w+):", docstring or "", re.M))


def public_functions() -> list[tuple[str, Callable[..., Any]]]:
    modules = ((attnkit, attnkit.__all__), (attnkit.distributed, attnkit.distributed.__all__))
    return [
        (f"{module.__name__}.{name}", getattr(module, name))
        for module, names in modules
        for name in names
        if inspect.isfunction(inspect.unwrap(getattr(module, name)))
    ]


@pytest.mark.parametrize(("name", "function"), public_functions(), ids=[name for name, _ in public_functions()])
def test_every_parameter_of_a_public_function_is_described(name: str, function: Callable[..., Any]) -> None:
    parameters = {
        p.name
        for p in inspect.signature(function).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    missing = parameters - described_parameters(inspect.getdoc(function))
    assert not missing, f"{name}'s docstring has no `:param NAME:` for {sorted(missing)}"


@pytest.mark.parametrize("name", ["register", "attention", "make_mask"])
def test_every_parameter_of_the_transformers_hooks_is_described(name: str) -> None:
    function = transformers_public_definitions()[name]
    assert isinstance(function, ast.FunctionDef)
    arguments = function.args
    parameters = {a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs}
    if arguments.kwarg is not None:  # transformers passes further keywords: say what is read of them
        parameters.add(arguments.kwarg.arg)
    missing = parameters - described_parameters(ast.get_docstring(function))
    assert not missing, f"attnkit.integrations.transformers.{name} has no `:param NAME:` for {sorted(missing)}"


def nav_pages() -> list[str]:
    """The Markdown files mkdocs.yml's nav lists (read as text: its YAML holds a Python tag for the toc's slugs)."""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = config.split("\nnav:\n", 1)[1]
    return re.findall(r"^\s+- (?:[^:\n]+: )?(\S+\.md)$", nav, re.M)


def test_every_nav_page_exists_and_every_page_is_in_the_nav() -> None:
    listed = nav_pages()
    assert "semantics.md" in listed and "index.md" in listed, listed
    assert not [page for page in listed if not (DOCS / page).is_file()], "nav lists pages that do not exist"
    pages = {str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")}
    assert not pages - set(listed), f"pages outside the nav: {sorted(pages - set(listed))}"
