"""The user-facing files speak to attnkit's users, not about how attnkit is developed: no issue numbers, no account
of which machine was lent when, no tools of one development environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: What is scanned: (folder, glob) pairs under the repository root.
SCANNED = (("docs", "**/*.md"), (".", "README.md"), (".", "CHANGELOG.md"), ("examples", "**/*"), ("scripts", "**/*"))

#: "issue 33", "Issue 17's", "issues 42 and 43", "issue #12", a heading's anchor "-issue-19-".
ISSUE_NUMBER = re.compile(r"\b(?P<hit>(?P<word>issues?)[\s-]+#?\d+)\b(?P<rest>(?:\s+\S+){0,2})", re.IGNORECASE)
#: The verb "issue" before a count is not an issue number: "can issue 4 loads", "the compiler issues 3 warnings",
#: "an SM issues 4 warp instructions", "issues 128 a cycle" (a plural noun within the two words after the number,
#: or a rate).
VERB_BEFORE = re.compile(r"\b(can|could|may|might|must|will|would|should|cannot|to)\s+$", re.IGNORECASE)
PLURAL_COUNT = re.compile(r"^\s+(?:(?:[a-z]+\s+)?[a-z]*[a-rt-z]s\b|(?:a|per)\s)")

#: The other phrases, case-insensitive; a line break may fall between their words.
PHRASES: dict[str, re.Pattern[str]] = {
    phrase: re.compile(pattern, re.IGNORECASE)
    for phrase, pattern in (
        ("lent", r"\blent\b"),
        ("borrowed", r"\bborrowed\b"),
        ("sandbox", r"\bsandbox\b"),
        (".library", r"\.library\b"),
        ("/work/", r"/work/"),
        ("device tool", r"\bdevice\s+tool\b"),
        ("give_back", r"\bgive_back\b"),
        ("this session", r"\bthis\s+session\b"),
        ("helper session", r"\bhelper\s+sessions?\b"),
    )
}


def _is_issue_number(text: str, match: re.Match[str]) -> bool:
    if VERB_BEFORE.search(text[max(0, match.start() - 16) : match.start()]):
        return False
    return not (match["word"].lower() == "issues" and PLURAL_COUNT.match(match["rest"]))


def forbidden_phrases(text: str) -> list[tuple[int, str]]:
    """(line number, what was found) for every forbidden phrase in ``text``, by line. The whole text is searched,
    not line by line, since a line break may fall inside a phrase or between "issues 128" and "threads"."""
    found = [(m.start(), m["hit"]) for m in ISSUE_NUMBER.finditer(text) if _is_issue_number(text, m)]
    found += [(m.start(), phrase) for phrase, pattern in PHRASES.items() for m in pattern.finditer(text)]
    return [(text.count("\n", 0, start) + 1, phrase) for start, phrase in sorted(found)]


def scanned_files(root: Path) -> list[Path]:
    files = {path for folder, pattern in SCANNED for path in (root / folder).glob(pattern) if path.is_file()}
    return sorted(path for path in files if "__pycache__" not in path.parts)


def report(path: Path, root: Path) -> list[str]:
    """ "file:line: phrase" for each forbidden phrase in ``path`` (a file that is not UTF-8 text has none)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    return [f"{path.relative_to(root)}:{line}: {phrase!r}" for line, phrase in forbidden_phrases(text)]


@pytest.mark.parametrize("path", scanned_files(ROOT), ids=lambda path: str(path.relative_to(ROOT)))
def test_the_file_speaks_to_users(path: Path) -> None:
    found = report(path, ROOT)
    assert not found, "development narrative in a user-facing file:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "## Issue 33: the static model",
        "issue 17's targets",
        "as issues 42 and 43 showed",
        "see issue #12",
        "[it](performance.md#pallas-kernels-issue-19-2026-11-24)",
        "Issue 33 retired the model",
        "issue 19 pins each backend",
        "checked by hand, on a borrowed machine",
        "A session was lent one H100",
        "No GPU was lent to this session.",
        "lent to this\nsession",
        "With this workplace's device tool: run(...)",
        "call give_back afterwards",
        "the helper session's notes",
        "in the sandbox",
        "under /work/main",
        "see .library/device/README.md",
    ],
)
def test_the_scanner_finds_each_phrase(line: str, tmp_path: Path) -> None:
    planted = tmp_path / "docs" / "page.md"
    planted.parent.mkdir()
    planted.write_text(f"# A page\n\nText for users.\n{line}\n")
    found = report(planted, tmp_path)
    assert found and all(hit.startswith("docs/page.md:4: ") for hit in found), found


@pytest.mark.parametrize(
    "line",
    [
        "the compiler issues 3 warnings",
        "an SM issues 4 warp instructions per cycle",
        "an SM issues 128\nthreads' instructions per cycle",
        "a warp can issue 2 loads per cycle",
        "an SM issues 128 a cycle",
        "open issues are tracked upstream (triton-lang/triton#9171)",
        "the issue-rate model, 16 a cycle",
        "a lending library of tensors",
    ],
)
def test_the_scanner_leaves_ordinary_text_alone(line: str) -> None:
    assert forbidden_phrases(line) == []


def test_only_the_user_facing_files_are_scanned(tmp_path: Path) -> None:
    for name in ("docs/guides/a.md", "README.md", "examples/run.py", "scripts/gpu.sh", "tests/test_x.py", "docs/x.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("issue 33\n")
    found = [str(path.relative_to(tmp_path)) for path in scanned_files(tmp_path)]
    assert found == ["README.md", "docs/guides/a.md", "examples/run.py", "scripts/gpu.sh"]
