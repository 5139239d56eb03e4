"""Choosing a backend for a call: the configured priority list, each backend's reasons, a cache."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace

from attnkit import config, registry
from attnkit.backend import Backend, Problem, routing_features
from attnkit.errors import BackendUnavailableError
from attnkit.spec import AttentionSpec

_log = logging.getLogger("attnkit")
_cache_lock = threading.Lock()
_decisions: dict[tuple[object, ...], Backend] = {}


@dataclass(frozen=True)
class Candidate:
    """One row of the dispatch table: a backend, whether it would run, and why not."""

    name: str
    reasons: tuple[str, ...]
    selected: bool = False
    in_priority: bool = True
    predicted_us: float | None = None  # from the cost table, for backends that can serve

    def __str__(self) -> str:
        marker = "->" if self.selected else "  "
        why = "ok" if not self.reasons else "; ".join(self.reasons)
        if self.predicted_us is not None:
            why += f" (predicted {self.predicted_us:.4g} us)"
        return f"{marker} {self.name:<16} {why}"


def _reasons(backend: Backend, spec: AttentionSpec, problem: Problem) -> tuple[str, ...]:
    missing = backend.available()
    if missing:
        return tuple(f"unavailable: {reason}" for reason in missing)
    return tuple(backend.supports(spec, problem))


def candidates(spec: AttentionSpec, problem: Problem) -> list[Candidate]:
    """Every registered backend with its reasons, in the order ``auto`` would try them."""
    all_backends = registry.backends()
    forced = config.forced_backend()
    if forced is not None:
        order: tuple[str, ...] = (forced,)
    else:
        order = config.current_config().priority_for(problem.device, routing_features(spec, problem))
    rows: list[Candidate] = []
    for name in order:
        if name not in all_backends:
            registry.get_backend(name)  # raises UnknownBackendError naming the registered ones
        rows.append(Candidate(name, _reasons(all_backends[name], spec, problem)))
    servable = [row.name for row in rows if not row.reasons]
    if servable:
        table = config.current_config().cost_table() if forced is None else None
        chosen = table.choose(spec, problem, servable, config.current_config().cost_margin) if table else servable[0]
        rows = [
            replace(
                row,
                selected=row.name == chosen,
                predicted_us=table.predict_us(row.name, spec, problem) if table and not row.reasons else None,
            )
            for row in rows
        ]
    for name in sorted(set(all_backends) - set(order)):
        why = "forced backend is " + forced if forced else f"not in the priority list for device={problem.device}"
        rows.append(Candidate(name, _reasons(all_backends[name], spec, problem) + (why,), in_priority=False))
    return rows


def select(spec: AttentionSpec, problem: Problem, backend: str = "auto") -> Backend:
    """The backend that runs this call. ``backend`` is ``"auto"`` or a registered name."""
    forced = backend if backend != "auto" else config.forced_backend()
    key = (spec, problem, backend, config.state_key(), registry.generation())
    hit = _decisions.get(key)
    if hit is not None:
        return hit
    if forced is not None:
        chosen = registry.get_backend(forced)
        reasons = _reasons(chosen, spec, problem)
        if reasons:
            raise BackendUnavailableError(f"backend={forced!r} cannot serve this call:\n  - " + "\n  - ".join(reasons))
    else:
        rows = candidates(spec, problem)
        selected = [row for row in rows if row.selected]
        if not selected:
            table = "\n".join(str(row) for row in rows)
            raise BackendUnavailableError(f"no backend can serve this call:\n{table}")
        chosen = registry.get_backend(selected[0].name)
    with _cache_lock:
        if key not in _decisions:
            _log.debug("attnkit: %s on %s -> %s", spec, problem, chosen.name)
        _decisions[key] = chosen
    return chosen


def clear_cache() -> None:
    with _cache_lock:
        _decisions.clear()
