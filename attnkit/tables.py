"""Plain-text and Markdown tables: the ground floor of attnkit's tools (it imports nothing else from attnkit)."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterable, Sequence
from typing import TextIO


def format_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A left-aligned plain-text table; columns two spaces apart."""
    body = [list(header), *(list(row) for row in rows)]
    widths = [max(len(row[column]) for row in body) for column in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in body]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def fitted_table(header: Sequence[str], rows: Iterable[Sequence[str]], width: int | None) -> str:
    """:func:`format_table` within ``width`` columns (None: as wide as it is): the columns after the first split into
    tables that fit, one under the other, each repeating the first column; a column too wide alone is wrapped."""
    body = [list(row) for row in rows]
    table = format_table(header, body)
    if width is None or max(map(len, table.splitlines())) <= width:
        return table
    first = max(len(row[0]) for row in [list(header), *body]) + 2
    groups: list[list[int]] = [[]]
    used = first
    for column in range(1, len(header)):
        column_width = max(len(row[column]) for row in [list(header), *body]) + 2
        if groups[-1] and used + column_width > width:
            groups.append([])
            used = first
        groups[-1].append(column)
        used += column_width
    tables = []
    for group in groups:
        columns = [0, *group]
        part = [[row[c] for c in columns] for row in body]
        if len(group) == 1:  # one column that does not fit: its cells wrapped, continuation rows under it
            room = max(20, width - first)
            part = [
                [cells[0] if index == 0 else "", piece]
                for cells in part
                for index, piece in enumerate(textwrap.wrap(cells[1], room, break_on_hyphens=False) or [""])
            ]
        tables.append(format_table([header[c] for c in columns], part))
    return "\n\n".join(tables)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def terminal_width(out: TextIO) -> int | None:
    """The width to fit: COLUMNS where set, else the terminal's; None (no limit) when ``out`` is no terminal, so that
    a pipe (grep, a file) gets whole lines."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit():
        return int(columns)
    try:
        return os.get_terminal_size(out.fileno()).columns if out.isatty() else None
    except (AttributeError, OSError, ValueError):  # a StringIO, or a stream without a descriptor
        return None
