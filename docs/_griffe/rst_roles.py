"""A griffe extension for the reference pages, reading the source's conventions as Sphinx would:

* Sphinx roles (``:class:`Capabilities```) become Markdown code spans (`Capabilities`), so the pages show the name
  rather than the role's markup;
* an attribute's ``#:`` comment lines above it are its docstring (Sphinx autodoc's convention, used for dataclass
  fields and module constants here)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const):`~?([^`]+)`")


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


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None and obj.is_attribute:
            text = _comment_docstring(obj)
            if text is not None:
                obj.docstring = griffe.Docstring(text, lineno=obj.lineno, parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
