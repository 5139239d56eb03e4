"""A griffe extension for the reference pages: the docstrings' Sphinx roles (``:class:`Capabilities```) become Markdown
code spans (`Capabilities`), so the pages show the name rather than the role's markup."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const):`~?([^`]+)`")


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
