"""Plain-text and Markdown tables: the ground floor of attnkit's tools (it imports nothing else from attnkit)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def format_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A left-aligned plain-text table; columns two spaces apart."""
    body = [list(header), *(list(row) for row in rows)]
    widths = [max(len(row[column]) for row in body) for column in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in body]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
