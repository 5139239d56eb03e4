"""``attnkit check``: the conformance run on this machine's backends, recorded rather than raised.

Each backend runs the named edge cases it declares it serves, then cases drawn by hypothesis from its declared
capabilities (attend calls, and attend_varlen and attend_paged calls where the backend serves them); every case is
compared with the float64 oracle. The run ends in a backend x feature table of the worst error/allowed ratio among
the cases that used each feature, then every failure in full. A backend that runs
another backend's code for part of its work (its ``Capabilities.delegations``) has the rows whose cases ran it marked,
with what ran and how often.
"""

from __future__ import annotations

import collections
import itertools
import math
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import hypothesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import InvalidArgument

from attnkit import registry
from attnkit.backend import SPEC_FEATURES, Backend, Delegation, Feature, PendingHardware, recording_delegations
from attnkit.capability_matrix import FEATURE_MEANINGS, FEATURE_ORDER
from attnkit.contract.programs import Expr, const, index
from attnkit.environment import torch_threads
from attnkit.spec import AttentionSpec, CausalAlignment, Layout, Variant
from attnkit.tables import format_table
from attnkit.testing import strategies
from attnkit.testing.agreement import Comparison, backends_for, check_backend
from attnkit.testing.cases import SINKS, VARLEN, Case, make_arrays, paged_case, shuffled_table, varlen_case
from attnkit.testing.profiles import register_profiles
from attnkit.testing.programs import ProgramCase, Table
from attnkit.testing.runners import drawable_dtypes, dtype_scope, harness_capabilities

CHECK_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64")
#: The dtypes of the named edge cases; float64 gets one more (backend_edge_cases) where a backend declares it.
EDGE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
# A case using none of the spec features: plain dot-product attention, bottom-right, bhsd.
PLAIN = "plain"
#: After a cell whose row's cases ran another backend's code (delegation_lines says which).
DELEGATED_MARK = "~"
DEFAULT_EXAMPLES = 30
#: The columns that are ways of calling rather than spec features, under the table: varlen is no backend feature
#: (attend_varlen runs as an attend call with segment ids or lengths), paged is one (the backend reads the cache).
CALL_FORM_MEANINGS = {
    Feature.PAGED.value: FEATURE_MEANINGS[Feature.PAGED],
    VARLEN: "`attend_varlen`: packed sequences (§12), run as one attend call with segment ids or lengths",
    SINKS: "`sinks=`: one logit per query head in every row's softmax (§15), composed with the backend's lse",
}


@dataclass
class Outcome:
    """One case run on one backend: its comparisons with the oracle, or why it could not be compared."""

    label: str
    case: Case | None  # None when no case could be drawn at all
    comparisons: list[Comparison] = field(default_factory=list)
    error: str | None = None
    delegations: frozenset[Delegation] = frozenset()  # another backend's code that ran for this case
    #: Refused only because the path it takes is unverified on this device's hardware (PendingHardware): not run,
    #: not a failure, listed under the table.
    pending: tuple[str, ...] = ()

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
    pending: list[Outcome] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if not outcome.ok]

    def worst(self, column: str) -> float | None:
        ratios = [outcome.worst_ratio for outcome in self.outcomes if column in outcome.columns()]
        return max(ratios) if ratios else None

    def delegated(self, column: str) -> bool:
        """Whether a case counted in ``column`` ran another backend's code."""
        return any(outcome.delegations for outcome in self.outcomes if column in outcome.columns())


def edge_cases() -> list[tuple[str, Case]]:
    """Named cases every backend runs, in float32 and bfloat16: the corners random draws reach rarely."""
    return [
        (f"{label} [{dtype}]", case.with_(dtype=dtype, seed=index))
        for index, (label, case) in enumerate(_edge_shapes())
        for dtype in EDGE_DTYPES
    ]


def backend_edge_cases(backend: Backend) -> list[tuple[str, Case]]:
    """The edge cases, and the first of them in float64 where ``backend`` declares it (a JAX backend's then runs under
    jax_enable_x64, see run_case): a declared dtype is checked even when no drawn case happens to use it."""
    cases = edge_cases()
    if "float64" in backend.capabilities.dtypes:
        label, case = _edge_shapes()[0]
        cases.append((f"{label} [float64]", case.with_(dtype="float64")))
    return cases


def _program(name: str, length: int = 0) -> ProgramCase:
    q, kv = index("q"), index("kv")
    if name == "nothing":
        return ProgramCase(Expr("lt", (kv, const(0)), kind="bool"), ())
    ids = (Expr("read", (index("b"), q), 0), Expr("read", (index("b"), kv), 0))
    causal = Expr("ge", (q, kv), kind="bool")
    return ProgramCase(Expr("and", (Expr("eq", ids, kind="bool"), causal), kind="bool"),
                       (Table((2, length), "documents"),))  # fmt: skip


def _edge_shapes() -> list[tuple[str, Case]]:
    spec = AttentionSpec
    return [
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
        # §17: a program that hides every pair (every tile empty: out 0, lse −∞), and documents across tile edges.
        ("mask program hiding all", Case(spec(), len_q=9, len_k=13, program=_program("nothing"))),
        (
            "mask program: document causal",
            Case(spec(), batch=2, heads_q=4, heads_kv=2, len_q=70, len_k=70, program=_program("documents", 70)),
        ),
        ("head dim 256", Case(spec(), len_q=5, len_k=9, head_dim=256, head_dim_v=256)),
        # §4.5: three documents packed in one row, one of a single token, and a pad position; then left padding.
        (
            "packed documents (segment ids)",
            Case(
                spec(causal=True),
                batch=1,
                len_q=7,
                len_k=7,
                q_segment_ids=((0, 0, 0, 1, 1, 2, -1),),
                kv_segment_ids=((0, 0, 0, 1, 1, 2, -1),),
            ),  # fmt: skip
        ),
        (
            "left padding by segment ids",
            Case(
                spec(causal=True),
                len_q=6,
                len_k=6,
                q_segment_ids=((-1, -1, 0, 0, 0, 0), (0,) * 6),
                kv_segment_ids=((-1, -1, 0, 0, 0, 0), (0,) * 6),
            ),  # fmt: skip
        ),
        # §15: a row that sees no key keeps its sink (lse = s), padding rows get none, each query head its own.
        (
            "sinks, rows with no key, padding rows, GQA",
            Case(
                spec(causal=True),
                heads_q=4,
                heads_kv=2,
                len_q=6,
                len_k=5,
                q_lengths=(6, 4),
                kv_lengths=(5, 0),
                sinks=True,
            ),
        ),  # fmt: skip
        # §18: dropout at a high p, each query head its own mask (GQA), a row with no key and one off a key tile edge,
        # the seed's top bit set (read unsigned).
        (
            "dropout p=0.9, GQA, sinks, an empty row",
            Case(
                spec(causal=True),
                heads_q=4,
                heads_kv=2,
                len_q=9,
                len_k=65,
                kv_lengths=(65, 0),
                sinks=True,
                dropout=(0.9, 2**64 - 2026),
            ),
        ),  # fmt: skip
        *ragged_edge_shapes(),
    ]


def ragged_edge_shapes() -> list[tuple[str, Case]]:
    """The named attend_varlen and attend_paged cases (also run over the registry by tests/test_ragged.py)."""
    spec = AttentionSpec
    shared_table, blocks = shuffled_table((7, 5, 0, 9), block_size=1, seed=0, shared=3)
    decode_table, decode_blocks = shuffled_table((21, 5, 13), block_size=5, seed=1, shared=0)
    alibi_table, alibi_blocks = shuffled_table((11, 5, 13), block_size=3, seed=2, shared=1)
    return [
        # §12: empty sequences of each kind (no query; no key: out 0, lse −inf) beside full and one-token ones.
        (
            "varlen with empty sequences",
            varlen_case(spec(causal=True), (1, 6, 0, 3), (9, 4, 2, 0), heads_q=4, heads_kv=1),
        ),
        (
            "varlen self-packed, one-token and empty documents",
            varlen_case(spec(causal=True, window=(4, 0)), (7, 1, 0, 4), (7, 1, 0, 4), heads_q=4, heads_kv=2),
        ),
        # §18: the keep-mask indexed by (sequence, position within it), not by the packed row (as the padded batch).
        (
            "varlen self-packed with dropout",
            varlen_case(spec(causal=True), (5, 0, 7), (5, 0, 7), heads_q=4, heads_kv=2, dropout=(0.3, 2**63 + 5)),
        ),
        # §16 per sequence: each its own slopes and its own bottom-right offset kv_len − q_len.
        (
            "varlen cross, per-sequence ALiBi slopes",
            varlen_case(spec(causal=True), (3, 1, 4), (9, 5, 4), heads_q=2, heads_kv=1, alibi_shape=(3, 2)),
        ),
        # §13: a 3-block prefix shared by the sequences, blocks out of order, an empty sequence, NaN in unread blocks.
        (
            "paged, shared and out-of-order blocks, block size 1",
            paged_case(spec(causal=True), 1, shared_table, (7, 5, 0, 9), blocks, len_q=2, heads_q=4, heads_kv=2),
        ),
        (
            "paged decode, block size 5, partial last blocks, window, bshd",
            paged_case(
                spec(causal=True, window=(9, 0), layout=Layout.BSHD),
                5,
                decode_table,
                (21, 5, 13),
                decode_blocks,
                len_q=1,
                heads_q=4,
                heads_kv=2,
            ),
        ),
        (
            "paged with ALiBi, block size 3, top-left",
            paged_case(
                spec(causal_alignment=CausalAlignment.TOP_LEFT),
                3,
                alibi_table,
                (11, 5, 13),
                alibi_blocks,
                len_q=3,
                heads_q=2,
                heads_kv=1,
                alibi_shape=(3, 2),
            ),  # fmt: skip
        ),
    ]


def run_case(backend: str, label: str, case: Case, expect_support: bool) -> Outcome:
    """Compare one case with the oracle, turning every way of going wrong into a recorded failure. A JAX backend's
    float64 case runs under jax_enable_x64, turned on for it alone (dtype_scope)."""
    with dtype_scope(backend, case.dtype):
        return _run_case(backend, label, case, expect_support)


def _run_case(backend: str, label: str, case: Case, expect_support: bool) -> Outcome:
    try:
        make_arrays(case)  # cheap; a case the harness cannot build must not be blamed on the backend
    except Exception as error:
        return Outcome(label, case, error=f"the harness cannot build this case (not the backend's fault): {error!r}")
    if expect_support:
        reasons = backends_for(case, [backend])[backend]
        if reasons and all(isinstance(reason, PendingHardware) for reason in reasons):
            return Outcome(label, case, pending=tuple(reasons))
        if reasons:
            message = "refused a case within its declared capabilities: " + "; ".join(reasons)
            return Outcome(label, case, error=message)
    try:
        with recording_delegations() as ran:
            comparisons = check_backend(case, backend)
        return Outcome(label, case, comparisons, delegations=frozenset(d for name, d in ran if name == backend))
    except Exception as error:  # a crashing backend is a failed check, not a crashed command
        last = traceback.format_exception_only(type(error), error)[-1].strip()
        return Outcome(label, case, error=last)


def profile_settings(profile: str) -> Any:
    """attnkit's hypothesis profile ``profile`` (ci, dev or thorough), registering the profiles if needed."""
    try:
        return settings.get_profile(profile)
    except InvalidArgument:  # not registered yet in this process
        register_profiles()
        return settings.get_profile(profile)


def hypothesis_settings(profile: str, examples: int) -> Any:
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
    counter = itertools.count(1)
    dtypes = drawable_dtypes(backend.name, x64_per_case=True)

    @hypothesis.seed(seed)
    @hypothesis_settings(profile, examples)
    @hypothesis.given(strategies.calls(capabilities=harness_capabilities(backend.name), dtypes=dtypes))
    def draw_and_check(case: Case) -> None:
        on_outcome(run_case(backend.name, f"drawn #{next(counter)}", case, expect_support=True))

    draw_and_check()


def applicable_edge_cases(backend: Backend, report: BackendReport) -> list[tuple[str, Case]]:
    """Edge cases this backend declares it serves; the rest go to ``report.skipped`` with the reasons."""
    runnable = []
    for label, case in backend_edge_cases(backend):
        if Feature.GRAD not in backend.capabilities.features:
            case = case.with_(grad=False)  # as the strategy does: a forward-only backend is checked forward
        with dtype_scope(backend.name, case.dtype):  # supports() reads jax_enable_x64 for a JAX float64 case
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
        pending = f", {len(report.pending)} pending hardware" if report.pending else ""
        summary = f"{len(report.failures)} failed, {len(report.skipped)} skipped{pending}, {report.seconds:.1f}s"
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
        (report.pending if outcome.pending else report.outcomes).append(outcome)
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


def ratio_text(ratio: float | None, delegated: bool = False) -> str:
    if ratio is None:
        return "-"
    if math.isinf(ratio):
        text = "err"
    else:
        text = f"{ratio:.2f}" if ratio < 100 else f"{ratio:.0f}"
    return text + ("!" if ratio > 1 else "") + (DELEGATED_MARK if delegated else "")


def results_table(reports: Sequence[BackendReport]) -> str:
    """Worst error/allowed ratio per backend and feature (rows) among the cases that used it."""
    columns = [PLAIN, *FEATURE_ORDER, VARLEN, SINKS, *CHECK_DTYPES]
    checked = [report for report in reports if not report.unavailable]
    rows = [
        [column, *(ratio_text(report.worst(column), report.delegated(column)) for report in checked)]
        for column in columns
    ]
    return format_table(["worst ratio", *(report.name for report in checked)], rows)


def delegation_lines(reports: Sequence[BackendReport]) -> list[str]:
    """For each backend whose cases ran another backend's code: what ran, in how many of its cases."""
    lines = []
    for report in reports:
        counts: dict[Delegation, int] = {}
        for outcome in report.outcomes:
            for delegation in outcome.delegations:
                counts[delegation] = counts.get(delegation, 0) + 1
        for delegation, count in sorted(counts.items(), key=lambda item: item[0].part):
            lines.append(f"{DELEGATED_MARK} {report.name}: {count} of {len(report.outcomes)} cases: {delegation}")
    return lines


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


def backends_to_check(requested: list[str] | None, out: TextIO) -> list[Backend] | None:
    """The named backends (each once, in order), or every available one; None after printing why not."""
    registered = registry.backends(load=True)
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


def examples_per_backend(examples: int | None, profile: str | None) -> int:
    if examples is not None:
        return int(examples)
    return int(profile_settings(profile).max_examples) if profile else DEFAULT_EXAMPLES


def print_summary(reports: Sequence[BackendReport], out: TextIO) -> int:
    """The ratio table, skips and failures; returns the exit status (1 on any failure)."""
    print("\n" + results_table(reports), file=out)
    print("(ratio = error / allowed by the tolerance rule; <= 1 passes, ! fails, err = raised or refused)", file=out)
    for column, meaning in CALL_FORM_MEANINGS.items():
        print(f"{column}: {meaning}", file=out)
    for line in delegation_lines(reports):
        print(line, file=out)
    for report in reports:
        for label, reasons in report.skipped:
            print(f"skipped {report.name} {label}: {'; '.join(reasons)}", file=out)
        for reason, count in collections.Counter(r for outcome in report.pending for r in outcome.pending).items():
            print(f"pending {report.name}: {count} drawn case(s) not run: {reason}", file=out)
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


def run_check(requested: list[str] | None, examples: int | None, profile: str | None, seed: int, out: TextIO) -> int:
    """Check the ``requested`` backends (any registered name, plugins included), or every one available here.

    Returns the exit status: 0 when every case agrees with the oracle, 1 on a failure or when nothing can run,
    2 for an unknown backend name.
    """
    selected = backends_to_check(requested, out)
    if selected is None:
        return 2 if requested else 1
    count = examples_per_backend(examples, profile)
    plan = f"{count} drawn cases each (seed {seed}) + {len(edge_cases())} edge cases (+1 in float64 where declared)"
    print(f"checking {', '.join(backend.name for backend in selected)}: {plan}", file=out)
    width = max(len(backend.name) for backend in selected) + 1
    # Conformance cases are tiny: intra-op threads only add synchronisation, and on a busy machine oversubscribed
    # spinning threads made the suite ten times slower. Restored afterwards, since tests call the CLI in-process.
    with torch_threads(1):
        reports = [check_one_backend(backend, count, profile or "ci", seed, out, width) for backend in selected]
    return print_summary(reports, out)
