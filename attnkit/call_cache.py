"""Everything dispatch remembers between calls, in one object with one :meth:`CallCache.clear`.

:data:`CACHE` holds five tables, each bounded (emptied when full):

* ``length_classes``: attend()'s fast path for calls without a mask, bias or ALiBi slopes, per (spec, the frontend's
  signature of the tensors with each sequence length replaced by its class, return_lse, backend, scope): the
  chosen backend, the runner and the runner's plain call if it has one, kept only where the decision and the runner
  hold for every length of the class (``Capabilities.length_generic``, docs/dispatch.md). A KV cache growing one
  key a step meets a new class only at each power of two and the next length, so this table stays small;
* ``calls``: attend()'s fast path per exact call signature (spec, the frontend's signature of the tensors,
  return_lse, backend, scope): the validated Problem, the runner, and the runner's plain call if it has one;
* ``operator_calls``: the same for calls a graph operator runs (attnkit/op_calls.py), whose key also carries the
  caller's grad flags: the validated Problem and the chosen backend;
* ``decisions``: dispatch.select(), per (spec, Problem, backend, scope, whether the caller could measure): the
  chosen backend, and whether the decision holds for every length of the Problem's length class;
* ``availability``: each backend's ``available()`` reading, by name (it looks at the machine: imports, compilers).

What these depend on besides the call is the config in force and the registry. The process-wide config and the
registry are not in the keys: every change to them (configure(), register_backend(), unregister_backend()) calls
:meth:`CallCache.clear`, and so does :func:`attnkit.dispatch.clear_cache`. The only state in the keys is the scope:
each use_config/use_backend scope fixes its config on entry and gets a serial number that no other scope ever has
(:meth:`CallCache.scope`), read from a ContextVar because scopes are per thread and per task; outside any scope it
is None. attend() binds ``calls.get`` and that ContextVar's ``get`` once, so its fast path is two calls and a tuple.

A dispatch that read the state before a clear must not store what it found after it: every store passes the
:attr:`CallCache.epoch` read before the state was read, and is dropped if a clear came in between.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Hashable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from attnkit.backend import Backend, PlainCall, Problem, Runner

    CallEntry = tuple[Problem, Runner, PlainCall | None]
    ClassEntry = tuple[Backend, Runner, PlainCall | None]

Value = TypeVar("Value")

#: Entries kept per table; a workload rarely has more than a few dozen call signatures.
LIMIT = 4096


class CallCache:
    """The fast-path, decision and availability tables and the state they key on (module docstring). The tables are
    emptied in place, never replaced: attend() holds ``length_classes.get`` and ``calls.get``."""

    __slots__ = (
        "length_classes",
        "calls",
        "operator_calls",
        "decisions",
        "availability",
        "full_paths",
        "limit",
        "epoch",
        "scope_serial",
        "_scope",
        "_serials",
        "_lock",
    )

    def __init__(self, limit: int = LIMIT) -> None:
        self.length_classes: dict[Hashable, ClassEntry] = {}
        self.calls: dict[Hashable, CallEntry] = {}
        self.operator_calls: dict[Hashable, tuple[Problem, Backend]] = {}
        self.decisions: dict[Hashable, tuple[Backend, bool]] = {}
        self.availability: dict[str, tuple[str, ...]] = {}
        self.limit = limit
        #: attend() calls that took the full path (validation and dispatch) in this process: a statistic for benches
        #: and tests (how often a loop missed the fast path), never cleared.
        self.full_paths = 0
        #: Bumped by every clear: a store made with an older epoch is dropped.
        self.epoch = 0
        self._scope: ContextVar[int | None] = ContextVar("attnkit_scope", default=None)
        #: The innermost scope's serial in this thread or task, None outside any scope (a bound ContextVar.get).
        self.scope_serial = self._scope.get
        self._serials = itertools.count()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def scope(self) -> Iterator[int]:
        """A new scope serial in force for the block (this thread or task only): keys made inside never match
        outside it, nor inside any other scope."""
        serial = next(self._serials)
        token = self._scope.set(serial)
        try:
            yield serial
        finally:
            self._scope.reset(token)

    def remember(self, table: dict[Any, Value], key: Hashable, value: Value, epoch: int) -> bool:
        """Store ``value`` under ``key`` in one of the tables, unless a clear came after ``epoch`` was read. Whether
        the key was new (and stored)."""
        with self._lock:
            if epoch != self.epoch:
                return False
            new = key not in table
            if new and len(table) >= self.limit:
                table.clear()
            table[key] = value
            return new

    def mark_unavailable(self, name: str, reasons: tuple[str, ...]) -> None:
        """Backend ``name`` now gives ``reasons`` (a build on first use that failed): they replace its reading and
        every call and decision is forgotten, so the next dispatch routes elsewhere."""
        with self._lock:
            self.epoch += 1
            self.length_classes.clear()
            self.calls.clear()
            self.operator_calls.clear()
            self.decisions.clear()
            self.availability[name] = reasons

    def clear(self) -> None:
        """Forget every call, decision and availability reading."""
        with self._lock:
            self.epoch += 1
            self.length_classes.clear()
            self.calls.clear()
            self.operator_calls.clear()
            self.decisions.clear()
            self.availability.clear()


#: The one instance: attend(), dispatch, config and the registry all use it.
CACHE = CallCache()
