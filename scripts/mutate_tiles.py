"""Mutation testing of the tiled kernels' tile bounds and gradient formulas (local use; not run in CI).

For each tiled backend it lists the single-token mutants of the kernel code that decides which tiles and pairs are
computed and how gradients are formed (a comparison flipped (< and <=, == and !=), + and - swapped, an integer
constant moved by one, min and max swapped, a term or factor dropped, & and | or && and || swapped, the two tile
sizes or two lengths or two band sides swapped), runs the backend's tile-edge tests against each mutant and reports
the mutants no test kills. Mutants run in a worker process that swaps the mutated code in: Python modules are
re-executed in place, CUDA C and C++ sources are compiled from a mutated copy (the emulator's and the torch
extension's usual builds, cached by content). A mutant that crashes or hangs the worker counts as killed.

    python scripts/mutate_tiles.py triton                 # every mutant, the tile-edge tests (stage 1)
    python scripts/mutate_tiles.py cupy-emulated --stage2 # survivors of stage 1 also run the contract and conformance
    python scripts/mutate_tiles.py pallas --list          # only list the mutants
    python scripts/mutate_tiles.py cpu-flash --lines 60-80 --limit 20

Survivors are either gaps in the tests or equivalent mutants (no observable change: e.g. a bound that only makes a
loop visit a tile whose pairs are all hidden, or a guard that another guard makes redundant); docs/testing.md lists
the known equivalent ones. Run it from the repository root in the project's environment; it takes minutes to hours
(each C++ mutant of cpu-flash is a fresh extension build).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Source:
    """A file and the functions in it whose code is mutated (qualified names for Python methods)."""

    path: str
    functions: tuple[str, ...]
    module: str | None = None  # the module it is imported as, for Python files


@dataclasses.dataclass(frozen=True)
class Target:
    sources: tuple[Source, ...]
    stage1: tuple[str, ...]  # pytest arguments: the fast tile-edge tests
    stage2: tuple[str, ...]  # pytest arguments: the contract and conformance, for survivors of stage 1


def _tests(backend: str, *files: str) -> tuple[str, ...]:
    """The tests of ``files`` about ``backend``, and every test of the shared geometry's own files among them."""
    return (*files, "-k", f"{backend} or test_geometry")


# The contract's geometry in integers, read by every tiled backend.
BAND = Source(
    "attnkit/contract/__init__.py",
    ("alignment_offset", "diagonal_band", "within_band", "conjoin", "tile_visibility"),
    "attnkit.contract",
)
TORCH_BAND = Source(
    "attnkit/contract/torch.py",
    (
        "Band.extremes",
        "Band.key_span",
        "Band.wholly_visible",
        "Band.band_wholly_visible",
        "Band.visible",
        "Band.key_ranges",
        "Band.segment_pairs",
        "SegmentTiles.of",
        "SegmentTiles.pairs",
    ),
    "attnkit.contract.torch",
)

TARGETS = {
    "triton": Target(
        (
            Source(
                "backends/triton/kernels.py",
                (
                    "_batch_geometry",
                    "_key_span",
                    "_query_span",
                    "_score_tile",
                    "_fwd_kernel",
                    "_bwd_delta_kernel",
                    "_bwd_dq_kernel",
                    "_bwd_dkdv_kernel",
                    "_merge_splits_kernel",
                ),
                "attnkit.backends.triton.kernels",
            ),
            BAND,
            Source("attnkit/contract/kernels.py", ("prepare", "attention_backward"), "attnkit.contract.kernels"),
        ),
        _tests("triton", "tests/test_tile_edges.py", "tests/test_kernel_backends.py", "tests/test_geometry.py"),
        _tests("triton", "tests/test_contract.py", "tests/test_conformance.py"),
    ),
    "cupy-emulated": Target(
        (
            Source(
                "backends/cupy/kernels/attention.cu",
                (
                    "load_tile",
                    "batch_geometry",
                    "key_span",
                    "query_span",
                    "visible",
                    "score",
                    "attention_forward",
                    "attention_backward_delta",
                    "load_row_statistics",
                    "attention_backward_dq",
                    "attention_backward_dkdv",
                ),
            ),
            BAND,
            Source("attnkit/contract/kernels.py", ("prepare", "attention_backward"), "attnkit.contract.kernels"),
        ),
        _tests("cupy-emulated", "tests/test_tile_edges.py", "tests/test_kernel_backends.py", "tests/test_geometry.py"),
        _tests("cupy-emulated", "tests/test_contract.py", "tests/test_conformance.py"),
    ),
    "pallas": Target(
        (
            Source(
                "backends/pallas/kernels.py",
                (
                    "_kv_range",
                    "_q_range",
                    "_visible",
                    "_scores",
                    "_alibi_term",
                    "_fwd_tile",
                    "_paged_tile",
                    "_bwd_dkdv",
                    "_bwd_dq",
                ),
                "attnkit.backends.pallas.kernels",
            ),
            Source(
                "backends/pallas/backend.py",
                ("_band", "_geometry", "_backward_rows"),
                "attnkit.backends.pallas.backend",
            ),
            BAND,
            Source("attnkit/contract/jax.py", ("band_visibility", "length_visibility"), "attnkit.contract.jax"),
        ),
        _tests(
            "pallas",
            "tests/test_tile_edges.py",
            "tests/test_pallas.py",
            "tests/test_geometry.py",
            "tests/test_geometry_jax.py",
        ),
        _tests("pallas", "tests/test_contract.py", "tests/test_conformance.py"),
    ),
    "cpu-flash": Target(
        (
            Source(
                "backends/cpu_flash/kernel.cpp",
                (
                    "strided",
                    "next_key_tile",
                    "key_range",
                    "needs_mask",
                    "tile_ids",
                    "scores",
                    "fwd_block",
                    "accumulate_dbias",
                    "bwd_kv_head",
                ),
            ),
            Source(
                "backends/cpu_flash/backend.py",
                ("_Band.of", "_Band.tile", "_CpuFlash.backward", "_segments", "flash_attention"),
                "attnkit.backends.cpu_flash.backend",
            ),
            BAND,
            TORCH_BAND,
        ),
        _tests("cpu-flash", "tests/test_tile_edges.py", "tests/test_cpu_flash.py", "tests/test_geometry.py"),
        _tests("cpu-flash", "tests/test_contract.py", "tests/test_conformance.py"),
    ),
    "torch-chunked": Target(
        (
            Source(
                "backends/reference/torch_chunked.py",
                (
                    "_Geometry.__init__",
                    "_Geometry.is_full",
                    "_Geometry.visible",
                    "_plan",
                    "_by_key_tile",
                    "_score_tile",
                    "_forward_tiles",
                    "_backward_tiles",
                    "TorchChunkedBackend.backward",
                ),
                "attnkit.backends.reference.torch_chunked",
            ),
            BAND,
            TORCH_BAND,
        ),
        _tests("chunked", "tests/test_tile_edges.py", "tests/test_reference_backends.py", "tests/test_geometry.py"),
        _tests("torch-chunked", "tests/test_contract.py", "tests/test_conformance.py"),
    ),
}


# ---------------------------------------------------------------------------------------------- finding code


@dataclasses.dataclass(frozen=True)
class Token:
    kind: str  # "name", "number", "op"
    text: str
    start: int  # offsets into the file's text
    end: int


def _python_annotations(text: str) -> list[tuple[int, int]]:
    """[start, end) offsets of every annotation: never evaluated here (``from __future__ import annotations``)."""
    offsets = [0]
    for line in text.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    spans = []
    for node in ast.walk(ast.parse(text)):
        for annotation in (
            [node.annotation] if isinstance(node, (ast.AnnAssign, ast.arg)) and node.annotation else []
        ) + ([node.returns] if isinstance(node, ast.FunctionDef) and node.returns else []):
            start = offsets[annotation.lineno - 1] + annotation.col_offset
            end = offsets[annotation.end_lineno - 1] + annotation.end_col_offset  # type: ignore[operator]
            spans.append((start, end))
    return spans


def _python_regions(text: str, functions: tuple[str, ...]) -> list[tuple[int, int]]:
    """[start, end) offsets of the named functions' bodies, docstrings left out."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    regions = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if isinstance(child, ast.FunctionDef) and name in functions:
                    body = child.body
                    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                        body = body[1:]
                    if body:
                        start = offsets[body[0].lineno - 1]
                        end = offsets[body[-1].end_lineno]  # type: ignore[index]
                        regions.append((start, end))
                visit(child, name + ".")

    visit(tree, "")
    if len(regions) != len(functions):
        raise SystemExit(f"not every function of {functions} was found")
    return regions


def _python_tokens(text: str) -> Iterator[Token]:
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        kind = {tokenize.NAME: "name", tokenize.NUMBER: "number", tokenize.OP: "op"}.get(token.type)
        if kind is None:
            continue
        start = offsets[token.start[0] - 1] + token.start[1]
        end = offsets[token.end[0] - 1] + token.end[1]
        yield Token(kind, token.string, start, end)


C_TOKEN = re.compile(
    r"(?P<comment>//[^\n]*|/\*.*?\*/)|(?P<string>\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*')"
    r"|(?P<number>\d+\.\d*(?:[eE][+-]?\d+)?f?|\d+(?:[eE][+-]?\d+)?f?|\.\d+f?)|(?P<name>[A-Za-z_]\w*)"
    r"|(?P<op><<=|>>=|->|::|<=|>=|==|!=|&&|\|\||\+\+|--|\+=|-=|\*=|/=|<<|>>|[-+*/%<>=!&|^~?:;,.(){}\[\]#])"
    r"|(?P<space>\s+)",
    re.S,
)


def _c_tokens(text: str) -> Iterator[Token]:
    for match in C_TOKEN.finditer(text):
        kind = match.lastgroup
        if kind in ("name", "number", "op"):
            yield Token(kind, match.group(), match.start(), match.end())


def _c_regions(text: str, functions: tuple[str, ...]) -> list[tuple[int, int]]:
    """[start, end) of each named function's body: the definition is the occurrence whose parameter list is followed
    by a brace."""
    tokens = list(_c_tokens(text))
    regions = []
    for name in functions:
        found = None
        for index, token in enumerate(tokens):
            if token.text != name or index + 1 >= len(tokens) or tokens[index + 1].text != "(":
                continue
            depth, at = 0, index + 1
            while True:
                depth += {"(": 1, ")": -1}.get(tokens[at].text, 0)
                if depth == 0:
                    break
                at += 1
            if tokens[at + 1].text == "{":
                depth, body = 0, at + 1
                while True:
                    depth += {"{": 1, "}": -1}.get(tokens[body].text, 0)
                    if depth == 0:
                        break
                    body += 1
                found = (tokens[at + 1].end, tokens[body].start)
                break
        if found is None:
            raise SystemExit(f"no definition of {name} found")
        regions.append(found)
    return regions


# ---------------------------------------------------------------------------------------------- mutants


@dataclasses.dataclass(frozen=True)
class Mutant:
    path: str
    start: int
    end: int
    replacement: str
    operator: str

    def apply(self, text: str) -> str:
        return text[: self.start] + self.replacement + text[self.end :]

    def describe(self, text: str) -> str:
        line_start = text.rfind("\n", 0, self.start) + 1
        line_end = text.find("\n", self.end)
        line_no = text.count("\n", 0, self.start) + 1
        before = text[line_start:line_end].strip()
        after = self.apply(text)[line_start : line_end + len(self.replacement) - (self.end - self.start)].strip()
        return f"{self.path}:{line_no} [{self.operator}] {before}  ->  {after}"


SWAPS = {
    "<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==",
    "+": "-", "-": "+", "+=": "-=", "-=": "+=",
    "&": "|", "|": "&", "&&": "||", "||": "&&", "and": "or", "or": "and",
    "min": "max", "max": "min", "minimum": "maximum", "maximum": "minimum", "fminf": "fmaxf", "fmaxf": "fminf",
}  # fmt: skip
PAIRED_NAMES = {
    "BLOCK_M": "BLOCK_N", "BLOCK_N": "BLOCK_M", "block_q": "block_k", "block_k": "block_q",
    "q_len": "kv_len", "kv_len": "q_len", "len_q": "len_k", "len_k": "len_q",
    "lower": "upper", "upper": "lower", "low": "high", "high": "low", "lo": "hi", "hi": "lo",
    "HAS_LOWER": "HAS_UPPER", "HAS_UPPER": "HAS_LOWER", "has_low": "has_high", "has_high": "has_low",
}  # fmt: skip
OPERAND_END = {"name", "number"}


def _is_binary(tokens: list[Token], index: int) -> bool:
    """An operator between two operands (not unary, not a template bracket): it follows a name, number or closing
    bracket and, in C++, has space on both sides (templates glue '<' to their name)."""
    if index == 0:
        return False
    previous = tokens[index - 1]
    return previous.kind in OPERAND_END or previous.text in (")", "]")


def _spaced(text: str, token: Token) -> bool:
    return text[token.start - 1 : token.start].isspace() and text[token.end : token.end + 1].isspace()


def _operand_end(tokens: list[Token], index: int) -> int | None:
    """The index after the operand starting at ``index``: a name or number with its trailers (.x, [..], (..), ::x),
    or a parenthesised group; None if it is not one."""
    at = index
    if tokens[at].text == "-":
        at += 1
    if at >= len(tokens):
        return None
    if tokens[at].text == "(":
        at = _close(tokens, at)
    elif tokens[at].kind in OPERAND_END:
        at += 1
    else:
        return None
    while at < len(tokens):
        text = tokens[at].text
        if text in (".", "::") and at + 1 < len(tokens) and tokens[at + 1].kind == "name":
            at += 2
        elif text in ("[", "("):
            at = _close(tokens, at)
        else:
            break
    return at


def _close(tokens: list[Token], at: int) -> int:
    pairs = {"(": ")", "[": "]", "{": "}"}
    depth = 0
    opening = tokens[at].text
    while at < len(tokens):
        if tokens[at].text == opening:
            depth += 1
        elif tokens[at].text == pairs[opening]:
            depth -= 1
            if depth == 0:
                return at + 1
        at += 1
    return at


def mutants(path: str, text: str, regions: list[tuple[int, int]], python: bool) -> list[Mutant]:
    skipped = _python_annotations(text) if python else []
    tokens = [
        t
        for t in (_python_tokens(text) if python else _c_tokens(text))
        if any(a <= t.start < b for a, b in regions) and not any(a <= t.start < b for a, b in skipped)
    ]
    found: list[Mutant] = []

    def add(start: int, end: int, replacement: str, operator: str) -> None:
        found.append(Mutant(path, start, end, replacement, operator))

    for index, token in enumerate(tokens):
        text_ = token.text
        binary = _is_binary(tokens, index) and _spaced(text, token)
        if text_ in ("<", "<=", ">", ">=", "==", "!=") and binary:
            add(token.start, token.end, SWAPS[text_], "comparison")
        elif text_ in ("+", "-") and binary:
            add(token.start, token.end, SWAPS[text_], "sign")
        elif text_ in ("+=", "-="):
            add(token.start, token.end, SWAPS[text_], "sign")
        elif text_ in ("&", "|", "&&", "||") and binary:
            add(token.start, token.end, SWAPS[text_], "logic")
        elif text_ in ("and", "or"):
            add(token.start, token.end, SWAPS[text_], "logic")
        elif token.kind == "name" and text_ in ("min", "max", "minimum", "maximum", "fminf", "fmaxf"):
            add(token.start, token.end, SWAPS[text_], "min/max")
        elif token.kind == "name" and text_ in PAIRED_NAMES:
            add(token.start, token.end, PAIRED_NAMES[text_], "swapped name")
        elif token.kind == "number":
            value = text_.rstrip("f")
            suffix = text_[len(value) :]
            if re.fullmatch(r"\d+", value):
                add(token.start, token.end, str(int(value) + 1) + suffix, "constant")
                # "x + 1" -> "x + 0" is the dropped term again
                if int(value) > 1 or (int(value) == 1 and not (index and tokens[index - 1].text in ("+", "-"))):
                    add(token.start, token.end, str(int(value) - 1) + suffix, "constant")
            else:
                number = float(value)
                add(token.start, token.end, ("0.0" if number else "1.0") + suffix, "constant")
        # a dropped term or factor: "op operand" removed
        if text_ in ("+", "-", "*", "/") and binary and index + 1 < len(tokens):
            end = _operand_end(tokens, index + 1)
            if end is not None and end <= len(tokens):
                stop = tokens[end - 1].end
                add(tokens[index - 1].end, stop, "", "dropped term")
    return found


def collect(backend: str) -> tuple[dict[str, str], list[Mutant]]:
    texts, found = {}, []
    for source in TARGETS[backend].sources:
        text = (ROOT / source.path).read_text()
        texts[source.path] = text
        python = source.path.endswith(".py")
        regions = (_python_regions if python else _c_regions)(text, source.functions)
        found += mutants(source.path, text, regions, python)
    return texts, found


# ---------------------------------------------------------------------------------------------- the worker


class Swapper:
    """Puts a mutated source in place of the original inside this process, and back."""

    def __init__(self, backend: str, scratch: Path) -> None:
        self.backend = backend
        self.scratch = scratch

    def apply(self, source: Source, text: str) -> None:
        if source.module is not None:
            self._python(source, text)
        elif source.path.endswith(".cu"):
            import attnkit

            launcher = attnkit.get_backend("cupy-emulated").launcher  # type: ignore[attr-defined]
            launcher.source = self._write(source, text)
            launcher._libraries.clear()
        else:
            from attnkit.backends.cpu_flash import backend as cpu_flash

            from attnkit.backend import TorchExtension

            # A fresh extension of the mutated source (its own build key): the backend loads EXTENSION on use.
            built = cpu_flash.EXTENSION
            cpu_flash.EXTENSION = TorchExtension(built.name, self._write(source, text), built.cflags)

    def _write(self, source: Path | Source, text: str) -> Path:
        name = Path(source.path if isinstance(source, Source) else source).name
        path = self.scratch / f"{int(time.time() * 1e6)}-{name}"
        path.write_text(text)
        return path

    def _python(self, source: Source, text: str) -> None:
        import attnkit

        assert source.module is not None
        module = importlib.import_module(source.module)
        kept = {name: module.__dict__[name] for name in ("_module",) if name in module.__dict__}  # a built extension
        before = dict(module.__dict__)
        exec(compile(text, str(self._write(source, text)), "exec"), module.__dict__)
        module.__dict__.update(kept)
        # Names other modules (attnkit's and the tests') imported from this one (`from attnkit.contract import
        # diagonal_band`) follow the swap.
        swapped = {
            id(old): module.__dict__[name] for name, old in before.items() if module.__dict__.get(name) is not old
        }
        for other in list(sys.modules.values()):
            if other is not module and getattr(other, "__name__", "").startswith(("attnkit", "tests")):
                for name, value in list(vars(other).items()):
                    if callable(value) and id(value) in swapped:
                        setattr(other, name, swapped[id(value)])
                    elif isinstance(value, dict):  # a table of them (the triton launcher's FUNCTIONS): its values too
                        for key, entry in list(value.items()):
                            if callable(entry) and id(entry) in swapped:
                                value[key] = swapped[id(entry)]
        if source.module.endswith("pallas.kernels"):  # backend.py holds the kernels' functions: re-run it too
            backend = importlib.import_module("attnkit.backends.pallas.backend")
            original = (ROOT / "backends/pallas/backend.py").read_text()
            exec(compile(original, backend.__file__ or "backend.py", "exec"), backend.__dict__)
            module = backend
        for registered in attnkit.registered_backends().values():  # instances take the re-run classes' methods
            replacement = module.__dict__.get(type(registered).__name__)
            if isinstance(replacement, type) and type(registered).__module__ == module.__name__:
                registered.__class__ = replacement


class _Tests:
    """The stage's tests as node ids, run in the order of how many mutants each has killed so far (with -x, a
    mutant then usually fails on the first test run)."""

    def __init__(self, arguments: tuple[str, ...], flags: list[str]) -> None:
        import pytest

        self.flags = flags
        self.kills: dict[str, int] = {}
        self.failed: str | None = None
        pytest.main([*arguments, *flags, "--collect-only"], plugins=[self])
        if not self.kills:
            raise SystemExit(f"no tests collected by {' '.join(arguments)}")

    def pytest_collection_finish(self, session: object) -> None:
        self.kills = {item.nodeid: 0 for item in session.items}  # type: ignore[attr-defined]

    def pytest_runtest_logreport(self, report: object) -> None:
        if report.failed and self.failed is None:  # type: ignore[attr-defined]
            self.failed = report.nodeid  # type: ignore[attr-defined]

    def run(self) -> tuple[int, str | None]:
        """(pytest's exit code, the test that failed first)."""
        import pytest

        self.failed = None
        order = sorted(self.kills, key=lambda node: -self.kills[node])
        code = pytest.main([*order, *self.flags], plugins=[self])
        if self.failed is not None:
            self.kills[self.failed] += 1
        return int(code), self.failed


def worker(backend: str, mutant_file: str, results: str, stage2: bool) -> None:
    os.chdir(ROOT)
    os.environ.setdefault("CI", "true")  # the derandomised hypothesis profile: the same examples for every mutant
    sys.path.insert(0, str(ROOT))
    import tests.conftest  # noqa: F401 - the harness: interpreter, emulator, profiles

    target = TARGETS[backend]
    sources = {source.path: source for source in target.sources}
    originals = {path: (ROOT / path).read_text() for path in sources}
    flags = ["-q", "-x", "-n", "0", "-p", "no:cacheprovider", "--no-header", "-W", "ignore"]
    stages = [("stage 1", _Tests(target.stage1, flags))]
    if stage2:
        stages.append(("stage 2", _Tests(target.stage2, flags)))
    with tempfile.TemporaryDirectory(prefix="attnkit-mutants-") as scratch:
        swapper = Swapper(backend, Path(scratch))
        with open(results, "a") as out:
            for line in Path(mutant_file).read_text().splitlines():
                item = json.loads(line)
                mutant = Mutant(**item["mutant"])
                out.write(json.dumps({"start": item["id"]}) + "\n")
                out.flush()
                source = sources[mutant.path]
                verdict = "survived"
                try:
                    swapper.apply(source, mutant.apply(originals[mutant.path]))
                    for stage, tests in stages:
                        code, failed = tests.run()
                        if code == 1:
                            verdict = f"killed ({stage}: {failed})"
                            break
                        if code != 0:
                            verdict = f"error (pytest exit {code}, {stage})"
                            break
                except Exception as error:  # a mutant that does not even load or build
                    verdict = f"killed (does not load: {type(error).__name__})"
                finally:
                    swapper.apply(source, originals[mutant.path])
                out.write(json.dumps({"end": item["id"], "verdict": verdict}) + "\n")
                out.flush()


# ---------------------------------------------------------------------------------------------- the driver


def _key(mutant: Mutant | dict) -> tuple:
    fields = dataclasses.asdict(mutant) if isinstance(mutant, Mutant) else mutant
    return fields["path"], fields["start"], fields["end"], fields["replacement"]


def _read_report(path: Path) -> dict[tuple, str]:
    """The verdicts of a report (JSON lines) by mutant."""
    if not path.exists():
        return {}
    return {_key(entry): entry["verdict"] for entry in map(json.loads, path.read_text().splitlines()) if entry}


def run(
    backend: str, chosen: list[Mutant], texts: dict[str, str], timeout: float, stage2: bool, log: Path, report: Path
) -> dict:
    """Each mutant's verdict, also appended to ``report`` as it comes (so an interrupted run can be resumed)."""
    verdicts: dict[int, str] = {}

    def record(index: int, verdict: str) -> None:
        verdicts[index] = verdict
        mutant = chosen[index]
        entry = {"mutant": mutant.describe(texts[mutant.path]), "verdict": verdict, **dataclasses.asdict(mutant)}
        with open(report, "a") as out:
            out.write(json.dumps(entry) + "\n")
        print(f"[{len(verdicts)}/{len(chosen)}] {verdict}: {entry['mutant']}", flush=True)

    with tempfile.TemporaryDirectory(prefix="attnkit-mutate-") as scratch:
        results = Path(scratch) / "results.jsonl"
        results.touch()
        pending = list(range(len(chosen)))
        seen = 0  # lines of results read: the file outlives a worker that died, so a new one must not re-read them
        while pending:
            batch = Path(scratch) / "batch.jsonl"
            batch.write_text(
                "".join(json.dumps({"id": i, "mutant": dataclasses.asdict(chosen[i])}) + "\n" for i in pending)
            )
            command = [sys.executable, __file__, backend, "--worker", str(batch), str(results)]
            command += ["--stage2"] if stage2 else []
            with open(log, "a") as output:
                process = subprocess.Popen(command, stdout=output, stderr=output, start_new_session=True)
            current, started = None, time.time()
            while True:
                lines = results.read_text().splitlines()
                for line in lines[seen:]:
                    event = json.loads(line)
                    if "start" in event:
                        current, started = event["start"], time.time()
                    else:
                        record(event["end"], event["verdict"])
                        pending.remove(event["end"])
                        current = None
                seen = len(lines)
                finished = process.poll() is not None
                if current is not None and time.time() - started > timeout:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    finished, why = True, f"killed (timeout after {timeout:.0f} s)"
                else:
                    why = f"killed (worker died: exit {process.returncode})"
                if finished:
                    if current is not None and current in pending:
                        record(current, why)
                        pending.remove(current)
                    break
                time.sleep(0.5)
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("backend", choices=sorted(TARGETS))
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--lines", help="only mutants on these lines of the first source, e.g. 60-80")
    parser.add_argument("--file", help="only mutants in this source file (a path as listed)")
    parser.add_argument("--operator", help="only mutants of this operator (comparison, sign, constant, ...)")
    parser.add_argument("--limit", type=int, help="at most this many mutants (spread evenly over the list)")
    parser.add_argument("--stage2", action="store_true", help="survivors of the tile-edge tests run stage 2 too")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant before it counts as a hang")
    parser.add_argument(
        "--report",
        type=Path,
        help="the verdicts, one JSON line per mutant, appended as they come (default: a file "
        "in the temporary directory); mutants it already holds are not run again",
    )
    parser.add_argument("--rerun", type=Path, help="only the mutants this earlier report lists as survivors")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.backend, args.worker[0], args.worker[1], args.stage2)
        return
    texts, found = collect(args.backend)
    if args.file:
        found = [m for m in found if m.path == args.file]
    if args.operator:
        found = [m for m in found if m.operator == args.operator]
    if args.lines:
        first, last = (int(n) for n in args.lines.split("-"))
        found = [m for m in found if first <= texts[m.path].count("\n", 0, m.start) + 1 <= last]
    if args.rerun:
        earlier = _read_report(args.rerun)
        found = [m for m in found if earlier.get(_key(m)) == "survived"]
    if args.limit and len(found) > args.limit:
        found = [found[i * len(found) // args.limit] for i in range(args.limit)]
    if args.list:
        for mutant in found:
            print(mutant.describe(texts[mutant.path]))
        print(f"{len(found)} mutants")
        return
    log = Path(tempfile.gettempdir()) / f"mutate-{args.backend}.log"
    report = args.report or Path(tempfile.gettempdir()) / f"mutate-{args.backend}.jsonl"
    done = _read_report(report)
    todo = [m for m in found if _key(m) not in done]
    print(f"{len(found)} mutants of {args.backend}, {len(todo)} to run; test output in {log}, verdicts in {report}")
    sys.stdout.flush()
    run(args.backend, todo, texts, args.timeout, args.stage2, log, report)
    verdicts = _read_report(report)
    survivors = [m for m in found if verdicts[_key(m)] == "survived"]
    errors = [m for m in found if verdicts[_key(m)].startswith("error")]
    print(f"\n{len(found) - len(survivors) - len(errors)} killed, {len(survivors)} survived, {len(errors)} errors")
    for mutant in survivors:
        print("SURVIVED", mutant.describe(texts[mutant.path]))
    for mutant in errors:
        print("ERROR", mutant.describe(texts[mutant.path]))
    sys.exit(1 if survivors else 0)


if __name__ == "__main__":
    main()
