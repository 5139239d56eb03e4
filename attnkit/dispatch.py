"""Choosing a backend for a call: the configured priority list, each backend's reasons. What it remembers (decisions,
availability readings) lives in attnkit/call_cache.py."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from attnkit import autotune, config, cost, registry
from attnkit.backend import Backend, Delegation, LazyBackend, Problem, routing_features
from attnkit.call_cache import CACHE
from attnkit.errors import BackendUnavailableError, InvalidInputTypeError
from attnkit.spec import AttentionSpec

_log = logging.getLogger("attnkit")


@dataclass(frozen=True)
class Candidate:
    """One row of the dispatch table: a backend, whether it would run, and why not."""

    name: str
    reasons: tuple[str, ...]
    selected: bool = False
    in_priority: bool = True
    predicted_us: float | None = None  # from the cost table, for backends that can serve
    delegations: tuple[Delegation, ...] = ()  # what of its work runs another backend's code (its capabilities)
    program: str = ""  # for a call with a mask program: how the backend serves it ("evaluates" or "materialises")

    def __str__(self) -> str:
        marker = "->" if self.selected else "  "
        why = "ok" if not self.reasons else "; ".join(self.reasons)
        if self.predicted_us is not None:
            why += f" (predicted {self.predicted_us:.4g} us)"
        if not self.reasons and self.program:
            how = "in its tiles" if self.program == "evaluates" else "as a dense (Lq, Lk) mask"
            why += f"; {self.program} the mask program {how}"
        if not self.reasons:  # one line per backend: what of its work would run another backend's code, after it
            for other in dict.fromkeys(delegation.backend for delegation in self.delegations):
                parts = "; ".join(d.part for d in self.delegations if d.backend == other)
                why += f"; runs {other}'s code for: {parts}"
        return f"{marker} {self.name:<16} {why}"


def _unavailable(backend: Backend) -> tuple[str, ...]:
    """available() looks at the machine (imports, compilers, devices): read once per backend until the next clear
    (a registry change, configure(), clear_cache()), not on every new shape, whose decision would otherwise pay for it
    (a growing KV cache makes one per decode step)."""
    missing = CACHE.availability.get(backend.name)
    if missing is None:
        epoch = CACHE.epoch
        missing = tuple(f"unavailable: {reason}" for reason in backend.available())
        CACHE.remember(CACHE.availability, backend.name, missing, epoch)
    return missing


def _reasons(backend: Backend, spec: AttentionSpec, problem: Problem) -> tuple[str, ...]:
    return _unavailable(backend) or tuple(backend.supports(spec, problem))


def _order(spec: AttentionSpec, problem: Problem, forced: str | None) -> tuple[str, ...]:
    if forced is not None:
        return (forced,)
    return config.current_config().priority_for(problem.device, routing_features(spec, problem))


def _priority_rows(
    spec: AttentionSpec, problem: Problem, order: tuple[str, ...], all_backends: dict[str, Backend]
) -> list[Candidate]:
    rows = []
    for name in order:
        if name not in all_backends:
            registry.get_backend(name)  # raises UnknownBackendError naming the registered ones
        rows.append(Candidate(name, _reasons(all_backends[name], spec, problem)))
    return rows


def _servable(rows: list[Candidate], problem: Problem, all_backends: dict[str, Backend]) -> list[str]:
    """The rows' backends that can serve the call, in priority order; for a call with a mask program, only those that
    evaluate it in their tiles where any can (one that materialises it builds the (Lq, Lk) mask a program avoids)."""
    servable = [row.name for row in rows if not row.reasons]
    if problem.has_mask_program:
        evaluating = [name for name in servable if not _materialises(all_backends[name])]
        return evaluating or servable
    return servable


def _materialises(backend: Backend) -> bool:
    return backend.capabilities.materialises_mask_programs


@dataclass(frozen=True)
class Choice:
    """What ``auto`` picked among the servable backends, and what decided it."""

    backend: str
    predicted: dict[str, float | None]
    #: The measurement that decided (read from the records, or made by this call); None: the prediction decided.
    record: autotune.Record | None = None
    #: Why the prediction decided where measuring could have ("" where the prediction alone was asked for).
    not_measured: str = ""
    #: False when a later eager call of the same bucket would measure (the decision is then not cached).
    final: bool = True
    #: Whether every call of the problem's length class would be decided alike: a final decision, or one that
    #: measuring must not make for any of them (a decode step under no_grad, a JAX call).
    per_class: bool = True


def _choose(
    spec: AttentionSpec,
    problem: Problem,
    servable: list[str],
    forced: str | None,
    trial: autotune.Trial | None = None,
) -> Choice:
    """The backend to run among ``servable`` (non-empty, in priority order): the cost table's prediction, unless the
    table cannot decide and measuring can (attnkit/autotune.py). ``trial`` times backends on the call's inputs; without
    one (explain, a graph operator) a bucket's record is used where there is one, else the prediction."""
    current = config.current_config()
    table = current.cost_table() if forced is None else None
    # Predicted for the bucket's largest call, the one its records speak for: one decision per bucket, which a new
    # length of the bucket (a decode step) can reuse (Capabilities.length_generic).
    predicted = table.predictions(spec, problem.at_bucket_lengths(), servable) if table else {}
    chosen = cost.choose(servable, predicted, current.cost_margin)
    if forced is not None or len(servable) < 2:
        return Choice(chosen, predicted)
    if not current.autotune:
        return Choice(chosen, predicted, not_measured=f"not measured: measuring is off ({MEASURING_SWITCHES})")
    fitted_here = table is not None and table.fitted_here(problem, servable)
    contenders = autotune.contenders(servable, predicted, chosen, fitted_here, current)
    if len(contenders) < 2:
        why = "the cost table, fitted on this machine, predicts no other backend within the cost margin"
        alone = "no other backend may be measured (autotune_exclude, autotune_spread)"
        return Choice(chosen, predicted, not_measured="not measured: " + (why if fitted_here else alone))
    key, bucket = autotune.bucket_key(spec, problem, contenders)
    record = autotune.STORE.load(key)
    if record is not None and record.winner in servable:
        return Choice(record.winner, predicted, record=record)
    skip = trial.skip_reason(current) if trial is not None else None
    if skip is not None:
        return Choice(chosen, predicted, not_measured=skip, final=False)
    if trial is None or trial.dry_run:
        later = f"not measured yet: the first eager attend call of its bucket times {', '.join(contenders)}"
        return Choice(chosen, predicted, not_measured=later, final=False, per_class=False)
    backends = registry.backends()
    measured = autotune.measure(
        [backends[name] for name in contenders],
        trial,
        servable,
        current.autotune_budget_calls,
        current.autotune_budget_s,
    )
    if measured is None:
        failed = f"not measured: timing {', '.join(contenders)} failed (logged at info level)"
        return Choice(chosen, predicted, not_measured=failed, final=False, per_class=False)
    winner = measured.winner
    record = autotune.Record(
        key, bucket, winner, tuple(measured.times_us.items()), autotune.now_utc(), unmeasured=measured.unmeasured
    )
    if measured.transient:  # a contender not ready in this process: a later process measures the bucket again
        record = autotune.STORE.keep(record, "a contender's first call builds or compiles in this process")
    else:
        record = autotune.STORE.save(record, current.autotune_records)
    _log.debug("attnkit: measured %s", record.describe())
    return Choice(winner, predicted, record=record)


#: How measuring is turned off, for explain's line.
MEASURING_SWITCHES = "autotune = false in the config, or ATTNKIT_AUTOTUNE=0"


def decision(spec: AttentionSpec, problem: Problem, trial: autotune.Trial | None = None) -> str:
    """Why ``auto`` picks what it picks for this call: the forced backend, a measurement (with its record), or the
    rule of :func:`cost.choose` with the predictions it weighed (``attnkit explain`` prints it under the table).
    ``trial`` (a dry run: nothing is timed) says why a call with values would not be measured."""
    forced = config.forced_backend()
    if forced is not None:
        return f"{forced} is forced (configuration or ATTNKIT_BACKEND)"
    all_backends = registry.backends()
    rows = _priority_rows(spec, problem, _order(spec, problem, None), all_backends)
    servable = _servable(rows, problem, all_backends)
    if not servable:
        return "no backend in the priority list can serve the call"
    choice = _choose(spec, problem, servable, None, trial)
    return _in_words(choice, servable)


def auto_choice(spec: AttentionSpec, problem: Problem) -> Choice | None:
    """What ``auto`` picks for this call with nothing forced, and what decided it, without measuring (a record
    decides where there is one); None when no backend in the priority list can serve it."""
    all_backends = registry.backends()
    rows = _priority_rows(spec, problem, _order(spec, problem, None), all_backends)
    servable = _servable(rows, problem, all_backends)
    return _choose(spec, problem, servable, None) if servable else None


def _in_words(choice: Choice, servable: list[str]) -> str:
    if choice.record is not None:
        return f"{choice.backend} was measured fastest: {choice.record.describe()}"
    rule = cost.decision(servable, choice.predicted, config.current_config().cost_margin, choice.backend)
    return f"{rule}; predicted, {choice.not_measured}" if choice.not_measured else rule


def candidates(spec: AttentionSpec, problem: Problem, trial: autotune.Trial | None = None) -> list[Candidate]:
    """Every registered backend with its reasons, in the order ``auto`` would try them (``trial``: as decision's)."""
    all_backends = registry.backends()
    forced = config.forced_backend()
    order = _order(spec, problem, forced)
    rows = _priority_rows(spec, problem, order, all_backends)
    servable = _servable(rows, problem, all_backends)
    if servable:
        choice = _choose(spec, problem, servable, forced, trial)
        chosen, predicted = choice.backend, choice.predicted
        rows = [
            Candidate(row.name, row.reasons, selected=row.name == chosen, predicted_us=predicted.get(row.name))
            for row in rows
        ]
    for name in sorted(set(all_backends) - set(order)):
        why = "forced backend is " + forced if forced else f"not in the priority list for device={problem.device}"
        rows.append(Candidate(name, _reasons(all_backends[name], spec, problem) + (why,), in_priority=False))
    return [
        dataclasses.replace(
            row,
            delegations=all_backends[row.name].capabilities.delegations,
            program=_program_service(all_backends[row.name], problem) if not row.reasons else "",
        )
        for row in rows
    ]


def _program_service(backend: Backend, problem: Problem) -> str:
    if not problem.has_mask_program:
        return ""
    return "materialises" if _materialises(backend) else "evaluates"


def select(
    spec: AttentionSpec, problem: Problem, backend: str = "auto", trial: autotune.Trial | None = None
) -> Backend:
    """The backend that runs this call. ``backend`` is ``"auto"`` or a registered name. ``trial`` (attend's eager
    calls) lets ``auto`` measure where the cost table cannot decide (attnkit/autotune.py)."""
    return select_call(spec, problem, backend, trial)[0]


def _length_generic(names: Iterable[str], all_backends: dict[str, Backend]) -> bool:
    """Whether every one of these backends answers alike across a length class. One still unloaded answered from
    its frameworks alone (LazyBackend), which no length changes: its capabilities are not read (they would load it)."""
    for name in names:
        backend = all_backends[name]
        if isinstance(backend, LazyBackend) and backend.loaded() is None:
            continue
        if not backend.capabilities.length_generic:
            return False
    return True


def select_call(
    spec: AttentionSpec, problem: Problem, backend: str = "auto", trial: autotune.Trial | None = None
) -> tuple[Backend, bool]:
    """:func:`select`, and whether its answer holds for every call of the problem's length class
    (:meth:`Problem.length_class`): every backend it consulted declares ``Capabilities.length_generic``, and the
    decision was not left to a later call's measuring."""
    if not isinstance(backend, str):  # None does not mean "auto": a forgotten value must not pass as a choice
        raise InvalidInputTypeError(
            f"backend={backend!r}: expected {config.AUTO!r} or a registered backend's name (a str), "
            f"got {type(backend).__name__}"
        )
    epoch = CACHE.epoch  # before the config and registry are read: a clear after it drops what is found here
    # Whether a trial came is in the key: a call that cannot measure (attend_paged, a graph operator, a bench asking
    # ahead) keeps the decision it got, the prediction's included, where attend's eager calls keep only a final one,
    # so that the first of a bucket measures whoever asked before it.
    key = (spec, problem, backend, CACHE.scope_serial(), trial is None)
    hit = CACHE.decisions.get(key)
    if hit is not None:
        return hit
    forced = backend if backend != config.AUTO else config.forced_backend()
    if forced is not None:
        chosen = registry.get_backend(forced)
        reasons = _reasons(chosen, spec, problem)
        if reasons:
            raise BackendUnavailableError(f"backend={forced!r} cannot serve this call:\n  - " + "\n  - ".join(reasons))
        per_class = chosen.capabilities.length_generic
    else:
        # Only the priority list's rows: the full table (candidates) is for explain() and the error below.
        all_backends = registry.backends()
        rows = _priority_rows(spec, problem, _order(spec, problem, None), all_backends)
        servable = _servable(rows, problem, all_backends)
        if not servable:
            table = "\n".join(str(row) for row in candidates(spec, problem))
            raise BackendUnavailableError(f"no backend can serve this call:\n{table}")
        choice = _choose(spec, problem, servable, None, trial)
        chosen = all_backends[choice.backend]
        per_class = choice.per_class and _length_generic((row.name for row in rows), all_backends)
        if not choice.final and trial is not None:  # a later eager call of the bucket measures: nothing cached
            return chosen, per_class
    if CACHE.remember(CACHE.decisions, key, (chosen, per_class), epoch):
        _log.debug("attnkit: %s on %s -> %s", spec, problem, chosen.name)
    return chosen, per_class


def became_unavailable(backend: Backend) -> bool:
    """After ``backend`` raised BackendUnavailableError while running: whether its ``available()`` now gives reasons
    (a build on first use that failed). If so they replace its cached reading and every decision is forgotten, so
    ``auto`` routes elsewhere and explain() says why."""
    missing = tuple(f"unavailable: {reason}" for reason in backend.available())
    if missing:
        CACHE.mark_unavailable(backend.name, missing)
    return bool(missing)


def clear_cache() -> None:
    """Forget every cached call, decision and availability reading (attnkit/call_cache.py), e.g. after installing a
    package or a compiler mid-process. Changes to the config or the registry clear them by themselves."""
    CACHE.clear()
    autotune.STORE.forget()
