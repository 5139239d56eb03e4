"""Saying, once per process, that attnkit is doing slow one-time work (building cpu-flash's kernel, ``auto`` measuring
the backends for a new kind of call), so that a first call of tens of seconds is never silent.

Each notice is an INFO record on the ``attnkit`` logger. Where nobody configured logging for attnkit (no handler on
it or its ancestors, ``ATTNKIT_LOG`` unset), where such a record would be dropped, it is also written to stderr as
one line: ``attnkit: building cpu-flash (once, ~16 s); later processes reuse it``. A configured logger (a handler,
a ``logging.NullHandler`` included, or ``ATTNKIT_LOG``) decides alone what is shown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextvars import ContextVar

_log = logging.getLogger("attnkit")
_said: set[str] = set()
_lock = threading.Lock()
#: Work expected to take longer than this many seconds is announced.
SLOW_S = 1.0
_printing: ContextVar[bool] = ContextVar("attnkit_notices_printing", default=True)


def logging_configured(logger: logging.Logger = _log) -> bool:
    """Whether the user configured logging for ``logger``: ATTNKIT_LOG is set, or it or an ancestor it propagates to
    has a handler (logging's lastResort, which stands in for none, does not count)."""
    if os.environ.get("ATTNKIT_LOG"):
        return True
    current: logging.Logger | None = logger
    while current is not None:
        if current.handlers:
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def once(key: str, message: str) -> bool:
    """Say ``message`` (without the "attnkit: " prefix) unless a notice of ``key`` was said in this process; True
    if it was said now."""
    with _lock:
        if key in _said:
            return False
        _said.add(key)
    _log.info("attnkit: %s", message)
    if _printing.get() and not logging_configured():
        print(f"attnkit: {message}", file=sys.stderr, flush=True)
    return True


@contextlib.contextmanager
def said_by_caller() -> Iterator[None]:
    """Inside the block notices are only logged, never printed: the caller (``attnkit build``) says what it does."""
    token = _printing.set(False)
    try:
        yield
    finally:
        _printing.reset(token)


def forget() -> None:
    """Say every notice again (for tests)."""
    with _lock:
        _said.clear()
