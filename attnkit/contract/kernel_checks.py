"""The command line and report shared by the kernel backends' static checks: ``python -m
attnkit.backends.triton.inspect`` and ``... .cupy.inspect`` compile their kernels for sm_80 and sm_90 without a GPU and
read registers, spills and tensor-core use."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnkit.tables import format_table, markdown_table


def static_check_arguments(prog: str, description: str | None, jobs_help: str, argv: list[str] | None) -> Any:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--json", type=Path, help="write every result to this file")
    parser.add_argument("--markdown", action="store_true", help="print the table of docs/performance.md")
    parser.add_argument("--scope", choices=("full", "required"), default="full")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help=jobs_help)
    parser.add_argument("--check", action="store_true", help="exit 1 when a requirement fails")
    return parser.parse_args(argv)


def results_table(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    """The results as a markdown table (docs/performance.md) or aligned text."""
    return markdown_table(header, rows) if markdown else format_table(header, rows)


def report_check(args: Any, table: str, records: list[dict[str, Any]], broken: list[str]) -> int:
    """Print the table, write the records where ``--json`` asks, name each broken requirement; the exit status."""
    print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    for line in broken:
        print(f"REQUIREMENT FAILED: {line}", file=sys.stderr)
    return 1 if broken and args.check else 0
