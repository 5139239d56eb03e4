"""A griffe extension for the reference pages, reading the docstrings' conventions as a reader of the site wants them:

* Sphinx roles (``:class:`Capabilities```) become Markdown code spans (`Capabilities`), so the pages show the name
  rather than the role's markup;
* a section of the contract (``§4.3``) links to that section of semantics.md (its anchor computed from the heading
  as the toc computes it), and a page named by its path (``docs/dispatch.md``) to that page, where the site has it;
* an attribute's ``#:`` comment lines above it are its docstring (Sphinx autodoc's convention, used for dataclass
  fields and module constants here)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import griffe
from pymdownx.slugs import slugify

DOCS = Path(__file__).resolve().parent.parent
CONTRACT = DOCS / "semantics.md"
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const):`~?([^`]+)`")
_CODE_SPAN = re.compile(r"(``.*?``|`[^`]*`)", re.S)
_SECTION = re.compile(r"§(\d+(?:\.\d+)?)")
_PAGE = re.compile(r"\bdocs/([\w/-]+\.md)\b")
_CONTRACT_HEADING = re.compile(r"^#{2,3} (?:§)?(\d+(?:\.\d+)?) (.*)$", re.M)
_slug = slugify(case="lower")  # the toc's slugs (mkdocs.yml)


@functools.cache
def _contract_anchors() -> dict[str, str]:
    """Section number ("4.3") -> the anchor of its heading in the contract."""
    return {
        match.group(1): _slug(match.group(0).lstrip("#").strip().replace("`", ""), "-")
        for match in _CONTRACT_HEADING.finditer(CONTRACT.read_text())
    }


def _page_link(match: re.Match[str]) -> str:
    """A link to the page a path names (the reference pages lie in docs/reference/), where the site has it."""
    return f"[{match.group(0)}](../{match.group(1)})" if (DOCS / match.group(1)).is_file() else match.group(0)


def _section_link(match: re.Match[str]) -> str:
    anchor = _contract_anchors().get(match.group(1))
    return f"[{match.group(0)}](../semantics.md#{anchor})" if anchor else match.group(0)


def _link_sections(text: str) -> str:
    def link_prose(prose: str) -> str:
        return _SECTION.sub(_section_link, _PAGE.sub(_page_link, prose))

    # Outside code spans only: a path or section number inside a literal stays literal.
    parts = _CODE_SPAN.split(text)
    return "".join(part if index % 2 else link_prose(part) for index, part in enumerate(parts))


def _comment_docstring(attribute: griffe.Object) -> str | None:
    """The ``#:`` lines right above the attribute's first line, without their markers."""
    if attribute.lineno is None or attribute.filepath is None:
        return None
    lines = attribute.lines_collection[attribute.filepath]
    comment: list[str] = []
    index = attribute.lineno - 2
    while index >= 0 and lines[index].lstrip().startswith("#:"):
        comment.insert(0, lines[index].lstrip()[2:].strip())
        index -= 1
    return " ".join(comment) or None


class SourceConventions(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None and obj.is_attribute:
            text = _comment_docstring(obj)
            if text is not None:
                obj.docstring = griffe.Docstring(text, lineno=obj.lineno, parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = _link_sections(_ROLE.sub(r"`\1`", obj.docstring.value))
