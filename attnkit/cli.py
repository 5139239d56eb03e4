"""The ``attnkit`` command: ``info``, ``check``, ``explain`` and ``bench``.

``info`` and ``explain`` need neither torch nor JAX; ``check`` needs torch (the oracle) and hypothesis;
``bench`` needs torch. Those imports happen inside the subcommands so the others keep working without them.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import attnkit
from attnkit import registry
from attnkit.backend import ALL_FEATURES, CALL_FEATURES, SPEC_FEATURES, Backend, Framework, Problem
from attnkit.errors import AttnkitError
from attnkit.spec import AttentionSpec, CausalAlignment, Layout, Variant

if TYPE_CHECKING:
    from attnkit.testing import Case, Comparison

DEFAULT_MARKDOWN_PATH = Path("docs") / "backends.md"
STALE_MARKDOWN_MESSAGE = "docs/backends.md is stale: run `attnkit info --markdown`"

#: One line per feature name, for the legend of ``info``'s matrix and docs/backends.md.
FEATURE_MEANINGS: dict[str, str] = {
    "causal": "`causal=True`: each query sees keys at or before its aligned position",
    "top_left": "`causal_alignment=top_left` for causal/window when Lq != Lk (default is bottom-right)",
    "window": "sliding window `window=(left, right)`",
    "cosine": "`variant=cosine`: q and k L2-normalised along the head dim",
    "softcap": "`softcap=c`: scores mapped to c·tanh(S/c)",
    "bshd": "`layout=bshd` (batch, seq, heads, dim) inputs",
    "mask": "a boolean `mask` argument (True = may attend)",
    "bias": "an additive `bias` argument",
    "q_lengths": "per-batch valid query lengths `q_lengths`",
    "kv_lengths": "per-batch valid key lengths `kv_lengths`",
    "lse": "`return_lse=True`: the float32 log-sum-exp per query",
    "grad": "gradients with respect to q, k and v",
    "dbias": "the gradient with respect to `bias`",
}
# Spec features first (what is computed), then call features (what is passed), each alphabetical.
FEATURE_ORDER: tuple[str, ...] = (*sorted(SPEC_FEATURES), *sorted(CALL_FEATURES))
DTYPE_ORDER: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64")
CHECK_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
# A case using none of the spec features: plain dot-product attention, bottom-right, bhsd.
PLAIN = "plain"
DEFAULT_EXAMPLES = 30
UNBOUNDED_HEAD_DIMS = (1, 1 << 30)


# ---------------------------------------------------------------------------------------------- tables


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


# ---------------------------------------------------------------------------------------------- info


def _ordered(values: Iterable[str], order: Sequence[str]) -> list[str]:
    """Known values in ``order``, then any others alphabetically, so output never depends on set order."""
    values = set(values)
    return [value for value in order if value in values] + sorted(values - set(order))


def _head_dims_text(head_dims: tuple[int, int]) -> str:
    return "any" if tuple(head_dims) == UNBOUNDED_HEAD_DIMS else f"{head_dims[0]}..{head_dims[1]}"


def capability_matrix(registered: Mapping[str, Backend]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the capability matrix: one row per property or feature, one column per backend.

    Features are rows rather than columns so the table stays readable in a terminal: thirteen feature
    columns would be about 150 characters wide, while backends are few.
    """
    names = sorted(registered)
    caps = [registered[name].capabilities for name in names]
    rows = [
        ["frameworks", *(", ".join(sorted(f.value for f in c.frameworks)) or "-" for c in caps)],
        ["devices", *(", ".join(sorted(c.devices)) or "-" for c in caps)],
        ["dtypes", *(", ".join(_ordered(c.dtypes, DTYPE_ORDER)) or "-" for c in caps)],
        ["head dims", *(_head_dims_text(c.head_dims) for c in caps)],
    ]
    for feature in FEATURE_ORDER:
        rows.append([feature, *("yes" if feature in c.features else "no" for c in caps)])
    return ["capability", *names], rows


def capability_markdown(registered: Mapping[str, Backend] | None = None) -> str:
    """docs/backends.md: the registered backends' declared capabilities and descriptions, nothing else.

    Deliberately machine-independent: availability (installed packages, devices) is left out, so the
    committed file only goes stale when a backend's declaration changes.
    """
    registered = registry.backends() if registered is None else registered
    header, rows = capability_matrix(registered)
    parts = [
        "# Backends",
        "",
        "<!-- Generated by `attnkit info --markdown` from each backend's declared capabilities; do not edit. -->",
        "",
        'What each registered backend declares it can do. `attend(..., backend="auto")` picks the first backend',
        "in the configured priority list whose capabilities cover the call (`attnkit explain` shows why);",
        "whether a backend can run on a given machine is not recorded here: run `attnkit info`.",
        "",
        "## Capability matrix",
        "",
        markdown_table(header, ([f"`{row[0]}`" if row[0] in ALL_FEATURES else row[0], *row[1:]] for row in rows)),
        "",
        "## Features",
        "",
        *(f"- `{feature}`: {FEATURE_MEANINGS.get(feature, '')}" for feature in FEATURE_ORDER),
        "",
        "## Descriptions",
        "",
    ]
    for name in sorted(registered):
        capabilities = registered[name].capabilities
        parts += [f"### {name}", "", capabilities.description or "(no description)", ""]
        if capabilities.notes:
            parts += [*(f"- {note}" for note in capabilities.notes), ""]
    return "\n".join(parts)


def availability_lines(registered: Mapping[str, Backend]) -> list[str]:
    rows = []
    for name in sorted(registered):
        reasons = registered[name].available()
        rows.append([name, "available" if not reasons else "unavailable: " + "; ".join(reasons)])
    return format_table(["backend", "on this machine"], rows).splitlines()


def run_info(args: argparse.Namespace, out: TextIO) -> int:
    registered = registry.backends()
    if args.markdown:
        text = capability_markdown(registered)
        if args.output == "-":
            out.write(text)
        else:
            path = Path(args.output)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}", file=out)
        return 0
    print(f"attnkit {attnkit.__version__}: {len(registered)} backends registered", file=out)
    if "torch" in sys.modules:  # registering the torch backends imported it; without torch there is no signature
        from attnkit.frontends import torch_frontend

        print(f"torch call signature (attend's cache key): {torch_frontend.signature_in_use}", file=out)
    print(file=out)
    print("\n".join(availability_lines(registered)), file=out)
    refused = registry.refused_plugins()
    if refused:
        print(f"\nplugins refused ({registry.ENTRY_POINT_GROUP} entry points that registered nothing):", file=out)
        for plugin in refused:
            print(f"  {plugin.entry_point}: {plugin.reason}", file=out)
    header, rows = capability_matrix(registered)
    print("\n" + format_table(header, rows), file=out)
    print("\nbackends:", file=out)
    origins = registry.origins()
    for name in sorted(registered):
        capabilities = registered[name].capabilities
        print(f"  {name}: {capabilities.description or '(no description)'}", file=out)
        print(f"    from: {origins.get(name, 'unknown')}", file=out)
        for note in capabilities.notes:
            print(f"    note: {note}", file=out)
    return 0


# ---------------------------------------------------------------------------------------------- build


def run_build(args: argparse.Namespace, out: TextIO) -> int:
    """Compile the torch frontend's C++ signature (attnkit/frontends/torch_compiled.py) for this torch and Python."""
    try:
        from attnkit.frontends import torch_compiled, torch_frontend
    except ImportError as error:
        print(f"attnkit build: needs torch ({error})", file=sys.stderr)
        return 1
    print(f"building {torch_compiled.SOURCE.name} into {torch_compiled.build_directory()} ...", file=out, flush=True)
    in_use = torch_frontend.use_compiled_signature(build=True)
    if in_use != "compiled":
        print(f"attnkit build: failed, the signature stays {in_use}", file=sys.stderr)
        return 1
    print(f"signature: {in_use}", file=out)
    return 0


# ---------------------------------------------------------------------------------------------- check


@dataclass
class Outcome:
    """One case run on one backend: its comparisons with the oracle, or why it could not be compared."""

    label: str
    case: Case | None  # None when no case could be drawn at all
    comparisons: list[Comparison] = field(default_factory=list)
    error: str | None = None

    @property
    def worst_ratio(self) -> float:
        if self.error is not None:
            return math.inf
        return max((comparison.ratio for comparison in self.comparisons), default=0.0)

    @property
    def ok(self) -> bool:
        return self.error is None and all(comparison.ok for comparison in self.comparisons)

    def columns(self) -> set[str]:
        """The table columns this case counts towards: its features, its dtype, and ``plain``."""
        if self.case is None:
            return set()
        features = self.case.features()
        used = set(features) | {self.case.dtype}
        if not features & SPEC_FEATURES:
            used.add(PLAIN)
        return used


@dataclass
class BackendReport:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    skipped: list[tuple[str, list[str]]] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if not outcome.ok]

    def worst(self, column: str) -> float | None:
        ratios = [outcome.worst_ratio for outcome in self.outcomes if column in outcome.columns()]
        return max(ratios) if ratios else None


def edge_cases() -> list[tuple[str, Case]]:
    """Named cases every backend runs, in float32 and bfloat16: the corners random draws reach rarely."""
    from attnkit.testing import Case

    spec = AttentionSpec
    base = [
        ("decode Lq=1 Lk=37", Case(spec(causal=True), heads_q=4, heads_kv=2, len_q=1, len_k=37)),
        # Bottom-right alignment with Lq > Lk: the first Lq - Lk query rows see no key at all.
        ("causal bottom-right Lq>Lk", Case(spec(causal=True), len_q=12, len_k=5)),
        (
            "causal top-left Lq<Lk",
            Case(spec(causal=True, causal_alignment=CausalAlignment.TOP_LEFT), len_q=5, len_k=12),
        ),
        ("GQA 4:1", Case(spec(causal=True), heads_q=8, heads_kv=2, len_q=9, len_k=13)),
        ("MQA", Case(spec(), heads_q=4, heads_kv=1, len_q=7, len_k=11)),
        ("window (3,0) causal", Case(spec(causal=True, window=(3, 0)), len_q=10, len_k=16)),
        (
            "q_lengths + kv_lengths with a 0",
            Case(spec(causal=True), batch=3, len_q=9, len_k=11, q_lengths=(7, 3, 9), kv_lengths=(0, 5, 11)),
        ),
        (
            "mask with fully masked rows",
            Case(spec(), len_q=8, len_k=10, mask_shape=(2, 2, 8, 10), masked_rows=(0, 5)),
        ),
        ("bias with grad", Case(spec(), len_q=6, len_k=9, bias_shape=(2, 1, 6, 9), bias_grad=True)),
        ("cosine + softcap", Case(spec(variant=Variant.COSINE, softcap=5.0), len_q=7, len_k=10)),
        ("bshd", Case(spec(causal=True, layout=Layout.BSHD), heads_q=4, heads_kv=2, len_q=6, len_k=10)),
        ("3-D inputs", Case(spec(causal=True), heads_q=1, heads_kv=1, len_q=6, len_k=8, three_d=True)),
        ("head dim 80", Case(spec(causal=True), len_q=7, len_k=7, head_dim=80, head_dim_v=80)),
        ("head dim 256", Case(spec(), len_q=5, len_k=9, head_dim=256, head_dim_v=256)),
    ]
    return [
        (f"{label} [{dtype}]", case.with_(dtype=dtype, seed=index))
        for index, (label, case) in enumerate(base)
        for dtype in ("float32", "bfloat16")
    ]


def run_case(backend: str, label: str, case: Case, expect_support: bool) -> Outcome:
    """Compare one case with the oracle, turning every way of going wrong into a recorded failure."""
    from attnkit.testing import backends_for, check_backend, make_arrays

    try:
        make_arrays(case)  # cheap; a case the harness cannot build must not be blamed on the backend
    except Exception as error:
        return Outcome(label, case, error=f"the harness cannot build this case (not the backend's fault): {error!r}")
    if expect_support:
        reasons = backends_for(case, [backend])[backend]
        if reasons:
            message = "refused a case within its declared capabilities: " + "; ".join(reasons)
            return Outcome(label, case, error=message)
    try:
        return Outcome(label, case, comparisons=check_backend(case, backend))
    except Exception as error:  # a crashing backend is a failed check, not a crashed command
        last = traceback.format_exception_only(type(error), error)[-1].strip()
        return Outcome(label, case, error=last)


def profile_settings(profile: str) -> Any:
    """attnkit's hypothesis profile ``profile`` (ci, dev or thorough), registering the profiles if needed."""
    from hypothesis import settings
    from hypothesis.errors import InvalidArgument

    from attnkit.testing import register_profiles

    try:
        return settings.get_profile(profile)
    except InvalidArgument:  # not registered yet in this process
        register_profiles()
        return settings.get_profile(profile)


def hypothesis_settings(profile: str, examples: int) -> Any:
    from hypothesis import HealthCheck, Phase, settings

    parent = profile_settings(profile)
    # No database and only the generate phase: the run depends on the seed alone, not on earlier runs.
    # Health checks are about the strategy, which is not what `check` is checking.
    return settings(
        parent=parent,
        max_examples=examples,
        database=None,
        derandomize=False,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


def drawn_outcomes(
    backend: Backend, examples: int, profile: str, seed: int, on_outcome: Callable[[Outcome], None]
) -> None:
    """Run ``examples`` cases drawn from the backend's capabilities, recording rather than raising.

    Recording keeps hypothesis from stopping at the first failure (and from shrinking), so one run
    reports every disagreement and the worst ratios of all cases.
    """
    import hypothesis

    from attnkit.testing.runners import drawable_dtypes
    from attnkit.testing.strategies import cases

    counter = itertools.count(1)

    @hypothesis.seed(seed)
    @hypothesis_settings(profile, examples)
    @hypothesis.given(cases(capabilities=backend.capabilities, dtypes=drawable_dtypes(backend.name)))
    def draw_and_check(case: Case) -> None:
        on_outcome(run_case(backend.name, f"drawn #{next(counter)}", case, expect_support=True))

    draw_and_check()


def applicable_edge_cases(backend: Backend, report: BackendReport) -> list[tuple[str, Case]]:
    """Edge cases this backend declares it serves; the rest go to ``report.skipped`` with the reasons."""
    from attnkit.testing import backends_for

    runnable = []
    for label, case in edge_cases():
        if "grad" not in backend.capabilities.features:
            case = case.with_(grad=False)  # as the strategy does: a forward-only backend is checked forward
        reasons = backends_for(case, [backend.name])[backend.name]
        if reasons:
            report.skipped.append((label, reasons))
        else:
            runnable.append((label, case))
    return runnable


class Progress:
    """``name  [k/n]`` rewritten in place on a terminal. Elsewhere (CI logs, pipes) a plain line at most every
    ``PLAIN_INTERVAL_S`` seconds, so a slow backend still shows signs of life without flooding the log."""

    PLAIN_INTERVAL_S = 10.0

    def __init__(self, out: TextIO, name: str, total: int, width: int) -> None:
        self.out, self.name, self.total, self.width = out, name, total, width
        self.interactive = out.isatty()
        self.done = self.failed = 0
        self.last_plain_line = time.monotonic()

    def step(self, outcome: Outcome) -> None:
        self.done += 1
        self.failed += not outcome.ok
        if self.interactive:
            self._write("\r" + self._line())
        elif self.done < self.total and time.monotonic() - self.last_plain_line >= self.PLAIN_INTERVAL_S:
            self.last_plain_line = time.monotonic()
            self._write(self._line() + "\n")

    def finish(self, report: BackendReport) -> None:
        summary = f"{len(report.failures)} failed, {len(report.skipped)} skipped, {report.seconds:.1f}s"
        self._write(("\r" if self.interactive else "") + f"{self._line()}  {summary}\n")

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _line(self) -> str:
        failed = f"  ({self.failed} failing)" if self.failed and self.done < self.total else ""
        return f"{self.name:<{self.width}} [{self.done}/{self.total}]{failed}"


def check_one_backend(
    backend: Backend, examples: int, profile: str, seed: int, out: TextIO, width: int
) -> BackendReport:
    report = BackendReport(backend.name)
    report.unavailable = backend.available()
    if report.unavailable:
        print(f"{backend.name:<{width}} unavailable: {'; '.join(report.unavailable)}", file=out)
        return report
    started = time.perf_counter()
    edges = applicable_edge_cases(backend, report)
    progress = Progress(out, backend.name, examples + len(edges), width)

    def record(outcome: Outcome) -> None:
        report.outcomes.append(outcome)
        progress.step(outcome)

    for label, case in edges:
        record(run_case(backend.name, label, case, expect_support=False))
    if examples > 0:
        try:
            drawn_outcomes(backend, examples, profile, seed, record)
        except Exception as error:  # hypothesis itself gave up: report it as a failure of this backend
            record(Outcome("drawing cases", None, error=repr(error)))
    report.seconds = time.perf_counter() - started
    progress.finish(report)
    return report


def ratio_text(ratio: float | None) -> str:
    if ratio is None:
        return "-"
    if math.isinf(ratio):
        text = "err"
    else:
        text = f"{ratio:.2f}" if ratio < 100 else f"{ratio:.0f}"
    return text + ("!" if ratio > 1 else "")


def results_table(reports: Sequence[BackendReport]) -> str:
    """Worst error/allowed ratio per backend and feature (rows) among the cases that used it."""
    columns = [PLAIN, *FEATURE_ORDER, *CHECK_DTYPES]
    checked = [report for report in reports if not report.unavailable]
    rows = [[column, *(ratio_text(report.worst(column)) for report in checked)] for column in columns]
    return format_table(["worst ratio", *(report.name for report in checked)], rows)


def failure_details(reports: Sequence[BackendReport]) -> list[str]:
    lines = []
    for report in reports:
        for outcome in report.failures:
            described = outcome.case.describe() if outcome.case is not None else ""
            lines.append(f"FAIL {report.name} {outcome.label}: {described}")
            if outcome.error is not None:
                lines.append(f"    {outcome.error}")
            for comparison in outcome.comparisons:
                lines.append(f"    {'  ' if comparison.ok else '! '}{comparison}")
    return lines


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Conformance cases are tiny: intra-op threads only add synchronisation, and on a busy machine
    oversubscribed spinning threads made the suite ten times slower. Restored afterwards, since tests
    call main() in-process."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def backends_to_check(requested: list[str] | None, out: TextIO) -> list[Backend] | None:
    """The named backends (each once, in order), or every available one; None after printing why not."""
    registered = registry.backends()
    names = (
        list(dict.fromkeys(requested)) if requested else sorted(n for n, b in registered.items() if not b.available())
    )
    unknown = [name for name in names if name not in registered]
    if unknown:
        print(f"unknown backend(s) {', '.join(unknown)}; registered: {', '.join(sorted(registered))}", file=out)
        return None
    if not names:
        print("no backend can run here: see `attnkit info`", file=out)
        return None
    return [registered[name] for name in names]


def examples_per_backend(args: argparse.Namespace) -> int:
    if args.examples is not None:
        return int(args.examples)
    return int(profile_settings(args.profile).max_examples) if args.profile else DEFAULT_EXAMPLES


def print_summary(reports: Sequence[BackendReport], out: TextIO) -> int:
    """The ratio table, skips and failures; returns the exit status (1 on any failure)."""
    print("\n" + results_table(reports), file=out)
    print("(ratio = error / allowed by the tolerance rule; <= 1 passes, ! fails, err = raised or refused)", file=out)
    for report in reports:
        for label, reasons in report.skipped:
            print(f"skipped {report.name} {label}: {'; '.join(reasons)}", file=out)
    details = failure_details(reports)
    if details:
        print("\n" + "\n".join(details), file=out)
    failed = [report.name for report in reports if report.failures or report.unavailable]
    total = sum(len(report.outcomes) for report in reports)
    if failed:
        print(f"\nFAILED: {', '.join(failed)} ({total} cases run)", file=out)
        return 1
    print(f"\nOK: {total} cases agree with the float64 oracle", file=out)
    return 0


def run_check(args: argparse.Namespace, out: TextIO) -> int:
    try:
        import hypothesis  # noqa: F401
        import torch  # noqa: F401
    except ImportError as error:
        print(f"attnkit check needs torch and hypothesis ({error}); pip install 'attnkit[torch,test]'", file=out)
        return 2
    selected = backends_to_check(args.backend, out)
    if selected is None:
        return 2 if args.backend else 1
    examples = examples_per_backend(args)
    profile = args.profile or "ci"
    plan = f"{examples} drawn cases each (seed {args.seed}) + {len(edge_cases())} edge cases"
    print(f"checking {', '.join(backend.name for backend in selected)}: {plan}", file=out)
    width = max(len(backend.name) for backend in selected) + 1
    with single_threaded_torch():
        reports = [check_one_backend(backend, examples, profile, args.seed, out, width) for backend in selected]
    return print_summary(reports, out)


# ---------------------------------------------------------------------------------------------- explain


def window_side(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"window side {text!r} must be an integer >= 0 or 'none'") from None


def spec_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> AttentionSpec:
    spec_flags = (args.causal, args.causal_alignment, args.window, args.scale, args.variant, args.softcap, args.layout)
    flag_given = any(value is not None for value in spec_flags)
    try:
        if args.spec is not None:
            if flag_given:
                parser.error("--spec cannot be combined with --causal/--window/--scale/--variant/--softcap/--layout")
            return AttentionSpec.model_validate_json(args.spec)
        fields: dict[str, Any] = {
            "causal": bool(args.causal),
            "window": tuple(args.window) if args.window is not None else None,
            "scale": args.scale,
            "softcap": args.softcap,
        }
        for name, value in (
            ("causal_alignment", args.causal_alignment),
            ("variant", args.variant),
            ("layout", args.layout),
        ):
            if value is not None:
                fields[name] = value
        return AttentionSpec(**fields)
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        parser.error(f"invalid spec: {error}")
    raise AssertionError("unreachable")


def problem_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Problem:
    heads_kv = args.heads_kv if args.heads_kv is not None else args.heads_q
    # Empty sequences are valid calls (every row then sees no key); empty batches, heads or head dims are not.
    minimum = {"batch": 1, "heads_q": 1, "head_dim": 1, "len_q": 0, "len_k": 0, "head_dim_v": 1}
    for name, low in minimum.items():
        value = getattr(args, name)
        if value is not None and value < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}")
    if heads_kv < 1 or args.heads_q % heads_kv:
        parser.error(f"--heads-q={args.heads_q} must be a multiple of --heads-kv={heads_kv}")
    return Problem(
        framework=Framework(args.framework),
        device=args.device,
        dtype=args.dtype,
        batch=args.batch,
        heads_q=args.heads_q,
        heads_kv=heads_kv,
        len_q=args.len_q,
        len_k=args.len_k if args.len_k is not None else args.len_q,
        head_dim=args.head_dim,
        head_dim_v=args.head_dim_v if args.head_dim_v is not None else args.head_dim,
        has_mask=args.mask,
        has_bias=args.bias or args.bias_grad,
        has_q_lengths=args.q_lengths,
        has_kv_lengths=args.kv_lengths,
        needs_grad=args.grad or args.bias_grad,
        needs_bias_grad=args.bias_grad,
        return_lse=args.lse,
    )


def run_explain(args: argparse.Namespace, out: TextIO, parser: argparse.ArgumentParser) -> int:
    from attnkit.api import explain_problem

    spec = spec_from_args(args, parser)
    problem = problem_from_args(args, parser)
    print(explain_problem(spec, problem), file=out)
    return 0


# ---------------------------------------------------------------------------------------------- bench


def _csv(text: str | None, kind: Callable[[str], Any] = str) -> tuple[Any, ...] | None:
    return None if text is None else tuple(kind(part.strip()) for part in text.split(",") if part.strip())


def run_bench(args: argparse.Namespace, out: TextIO) -> int:
    if args.calibrate:
        return run_calibrate(args, out)
    if args.what == "targets":
        return run_targets(args, out)
    from attnkit import bench

    if args.what == "memory" and args.device != "cpu":
        print("attnkit bench: --what memory measures host memory (peak RSS), on --device cpu only", file=sys.stderr)
        return 2
    repeats = args.repeats if args.repeats is not None else 3
    with bench.torch_threads(args.threads):
        if args.backend is not None:
            result = bench.bench_backend(
                args.backend,
                device=args.device,
                seq_lens=(args.seq_len,) if args.seq_len else None,
                dtype=args.dtype,
                repeats=repeats,
                warmup=args.warmup,
            )
            text = bench.format_backend(result)
        elif args.what == "dispatch":
            result = bench.bench_dispatch(rounds=args.rounds, calls=args.calls, device=args.device)
            text = bench.format_dispatch(result)
        elif args.what == "chunked":
            result = bench.bench_chunked(
                seq_len=args.seq_len or 4096, repeats=repeats, warmup=args.warmup, device=args.device
            )
            text = bench.format_chunked(result)
        else:
            result = bench.bench_memory(seq_len=args.seq_len or 16384)
            text = bench.format_memory(result)
    print(text, file=out)
    _write_json(args, result, out)
    return 0


def _write_json(args: argparse.Namespace, result: Any, out: TextIO) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}", file=out)


def _progress(message: str) -> None:
    print(f"[attnkit bench] {message}", file=sys.stderr, flush=True)


def run_targets(args: argparse.Namespace, out: TextIO) -> int:
    from attnkit import bench, bench_targets

    if args.device != "cpu":
        print("attnkit bench: --what targets measures the CPU targets of issue 6 (--device cpu)", file=sys.stderr)
        return 2
    if args.plot:  # fail before a long run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("attnkit bench: --plot needs matplotlib: pip install 'attnkit[bench]'", file=sys.stderr)
            return 2
    bench_targets.limit_jax_threads(args.threads)
    seq_lens = _csv(args.seq_lens, int) or ((512,) if args.quick else bench_targets.TARGET_SEQ_LENS)
    dtypes = _csv(args.dtypes) or bench_targets.TARGET_DTYPES
    targets = _csv(args.targets) or bench_targets.TARGETS
    unknown = sorted(set(targets) - set(bench_targets.TARGETS))
    if unknown:
        known = ", ".join(bench_targets.TARGETS)
        print(f"attnkit bench: unknown --targets {unknown} (known: {known})", file=sys.stderr)
        return 2
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 7)
    with bench.torch_threads(args.threads):
        result = bench_targets.bench_targets(
            seq_lens=seq_lens,
            dtypes=dtypes,
            repeats=repeats,
            warmup=args.warmup,
            targets=targets,
            memory=not args.no_memory,
            decode_rounds=5 if args.quick else args.rounds,
            decode_calls=200 if args.quick else args.calls,
            progress=_progress,
        )
    print(bench_targets.format_targets(result), file=out)
    _write_json(args, result, out)
    if args.plot:
        bench_targets.plot_targets(result, args.plot)
        print(f"wrote {args.plot}", file=out)
    return 0


def run_calibrate(args: argparse.Namespace, out: TextIO) -> int:
    from attnkit import bench, bench_calibrate, bench_targets

    bench_targets.limit_jax_threads(args.threads)
    shapes = bench_calibrate.QUICK_SHAPES if args.quick else bench_calibrate.CALIBRATION_SHAPES
    dtypes = _csv(args.dtypes) or bench_calibrate.CALIBRATION_DTYPES
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    with bench.torch_threads(args.threads):
        result = bench_calibrate.calibrate(
            device=args.device,
            dtypes=dtypes,
            shapes=shapes,
            repeats=repeats,
            warmup=args.warmup,
            only=_csv(args.backends),
            progress=_progress,
        )
    command = "attnkit " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "attnkit bench --calibrate"
    table = bench_calibrate.render_table(result, command)
    print(bench_calibrate.format_calibration(result), file=out)
    if args.output:
        Path(args.output).write_text(table)
        print(f"# wrote {args.output} ({len(result['entries'])} entries)", file=out)
    else:
        print(table, file=out, end="")
    _write_json(args, result, out)
    return 0


# ---------------------------------------------------------------------------------------------- parser


def _add_info(commands: Any) -> None:
    info = commands.add_parser("info", help="registered backends, availability and capability matrix")
    info.add_argument("--markdown", action="store_true", help="write the capability matrix as Markdown")
    info.add_argument(
        "--output",
        default=str(DEFAULT_MARKDOWN_PATH),
        help="where --markdown writes ('-' for stdout; default: %(default)s)",
    )


def _add_check(commands: Any) -> None:
    check = commands.add_parser("check", help="run the conformance suite on the backends available here")
    check.add_argument("--backend", action="append", metavar="NAME", help="check only this backend (repeatable)")
    check.add_argument("--examples", type=int, help="drawn cases per backend (default 30, or the profile's count)")
    check.add_argument("--profile", choices=("ci", "dev", "thorough"), help="hypothesis profile (see testing)")
    check.add_argument("--seed", type=int, default=0, help="seed of the drawn cases (default %(default)s)")


def _add_explain(commands: Any) -> argparse.ArgumentParser:
    explain = commands.add_parser("explain", help="which backend a call would use, and why not the others")
    spec = explain.add_argument_group("spec (either --spec JSON or the flags)")
    spec.add_argument("--spec", help='AttentionSpec as JSON, e.g. \'{"causal": true, "window": [128, 0]}\'')
    spec.add_argument("--causal", action="store_const", const=True, default=None)
    spec.add_argument("--causal-alignment", choices=[a.value for a in CausalAlignment])
    spec.add_argument("--window", nargs=2, type=window_side, metavar=("LEFT", "RIGHT"), help="int or 'none'")
    spec.add_argument("--scale", type=float)
    spec.add_argument("--variant", choices=[v.value for v in Variant])
    spec.add_argument("--softcap", type=float)
    spec.add_argument("--layout", choices=[layout.value for layout in Layout])
    shapes = explain.add_argument_group("call")
    shapes.add_argument("--batch", type=int, default=1)
    shapes.add_argument("--heads-q", type=int, default=8)
    shapes.add_argument("--heads-kv", type=int, help="default: --heads-q")
    shapes.add_argument("--len-q", type=int, default=128)
    shapes.add_argument("--len-k", type=int, help="default: --len-q")
    shapes.add_argument("--head-dim", type=int, default=64)
    shapes.add_argument("--head-dim-v", type=int, help="default: --head-dim")
    shapes.add_argument("--dtype", choices=DTYPE_ORDER, default="float32")
    shapes.add_argument("--framework", choices=[f.value for f in Framework], default="torch")
    shapes.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    for flag, meaning in (
        ("--mask", "a boolean mask is passed"),
        ("--bias", "an additive bias is passed"),
        ("--q-lengths", "q_lengths is passed"),
        ("--kv-lengths", "kv_lengths is passed"),
        ("--grad", "gradients are needed"),
        ("--bias-grad", "the bias needs its gradient (implies --bias --grad)"),
        ("--lse", "return_lse=True"),
    ):
        shapes.add_argument(flag, action="store_true", help=meaning)
    return explain


def _add_bench(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="issue 6's targets against the frameworks' own attention; dispatch overhead; torch-chunked against SDPA "
        "and torch-naive in time or peak memory; --backend NAME in TFLOP/s; --calibrate the cost table",
    )
    bench.add_argument("--what", choices=("dispatch", "chunked", "memory", "targets"), default="dispatch")
    bench.add_argument(
        "--backend",
        metavar="NAME",
        help="time this backend's fwd, bwd, fwd+bwd in TFLOP/s against its framework's own attention (torch SDPA, "
        "jax.nn.dot_product_attention) at the FlashAttention-2 paper's shapes (replaces --what)",
    )
    bench.add_argument(
        "--calibrate",
        action="store_true",
        help="time every available compiled backend at a few shapes and fit the cost table (attnkit/cost.py); "
        "prints it, or writes it to --output (replaces --what)",
    )
    bench.add_argument("--output", metavar="PATH", help="--calibrate: write the table here (configs/costs.toml)")
    bench.add_argument("--backends", metavar="A,B", help="--calibrate: only these backends")
    bench.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="--backend")
    bench.add_argument("--dtypes", metavar="A,B", help="targets, --calibrate: dtypes (default float32,bfloat16)")
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    bench.add_argument("--rounds", type=int, default=20, help="dispatch: interleaved rounds (default %(default)s)")
    bench.add_argument("--calls", type=int, default=2000, help="dispatch: calls per round (default %(default)s)")
    bench.add_argument(
        "--seq-len", type=int, help="chunked, memory, --backend: sequence length (default 4096, 16384, paper's)"
    )
    bench.add_argument("--seq-lens", metavar="L1,L2", help="targets: sequence lengths (default 512,2048,4096)")
    bench.add_argument("--targets", metavar="A,B", help="targets: which ones (default torch,jax,non-native,decode)")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="targets: L=512 only, 2 repeats, short decode rounds; --calibrate: small shapes (smoke tests)",
    )
    bench.add_argument("--no-memory", action="store_true", help="targets: skip the non-native peak-memory runs")
    bench.add_argument("--plot", metavar="PATH", help="targets: also plot GFLOP/s against L to this PNG (matplotlib)")
    bench.add_argument(
        "--repeats",
        type=int,
        help="chunked, --backend, targets, --calibrate: timed repeats (default 3; targets 7; --calibrate 5; --quick 2)",
    )
    bench.add_argument(
        "--warmup", type=int, default=1, help="chunked, --backend, targets: untimed repeats (default %(default)s)"
    )
    bench.add_argument("--threads", type=int, help="torch intra-op threads, and XLA's with 1 (default: their choice)")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def _add_build(commands: Any) -> None:
    commands.add_parser(
        "build",
        help="compile the C++ signature that keys attend's cache for torch calls (~20 s, once per torch and "
        "Python; every later process loads it): a cached call then costs about 1 us less",
    )


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser, and the explain subparser (its errors name the explain usage)."""
    parser = argparse.ArgumentParser(prog="attnkit", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"attnkit {attnkit.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_info(commands)
    _add_check(commands)
    explain = _add_explain(commands)
    _add_bench(commands)
    _add_build(commands)
    return parser, explain


def main(argv: Sequence[str] | None = None) -> int:
    parser, explain_parser = build_parser()
    args = parser.parse_args(argv)
    out = sys.stdout
    # Every command sees the backends this machine can run: without a GPU, Triton's kernels run interpreted.
    from attnkit.testing.environment import interpret_triton_without_gpu

    interpret_triton_without_gpu()
    try:
        if args.command == "info":
            return run_info(args, out)
        if args.command == "check":
            return run_check(args, out)
        if args.command == "explain":
            return run_explain(args, out, explain_parser)
        if args.command == "build":
            return run_build(args, out)
        return run_bench(args, out)
    except AttnkitError as error:
        print(f"attnkit {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
