"""Rows that see no key because of the causal alignment: bottom-right (attnkit's default) with more queries than keys
leaves the first rows before key 0 (docs/semantics.md §4.1), which a user coming from torch SDPA's top-left
``is_causal`` may not expect. Said once per process, decided where a call's geometry is first validated (never on
the cached fast path, nor in a compiler's trace)."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from contextvars import ContextVar

from attnkit.contract import diagonal_band
from attnkit.errors import EmptyRowsWarning
from attnkit.spec import AttentionSpec, CausalAlignment
from attnkit.spellings import spec_text

_said = False
_lock = threading.Lock()
_intended: ContextVar[bool] = ContextVar("attnkit_empty_rows_intended", default=False)


@contextlib.contextmanager
def intended() -> Iterator[None]:
    """Inside, attend's calls leave rows with no key on purpose (a sharded call's blocks, the conformance suite's
    drawn cases): no warning of them."""
    token = _intended.set(True)
    try:
        yield
    finally:
        _intended.reset(token)


def count(spec: AttentionSpec, len_q: int, len_k: int) -> int:
    """How many query rows the spec's alignment leaves with no key when the call's lengths are Lq and Lk (no
    q_lengths or kv_lengths): bottom-right with Lq > Lk puts the first rows' band before key 0 (§4.1)."""
    if spec.causal_alignment is not CausalAlignment.BOTTOM_RIGHT or len_q <= len_k or len_k == 0:
        return 0
    # Row i sees keys j <= i + (Lk - Lq) + upper, the band's upper side (causal: 0; a window: its right side).
    _, upper = diagonal_band(spec)
    return 0 if upper is None else max(0, min(len_q, len_q - len_k - upper))


def say_once(spec: AttentionSpec, len_q: int, len_k: int) -> None:
    """Warn (EmptyRowsWarning), once per process, of the rows a call's alignment leaves with no key."""
    global _said
    if _said or _intended.get():  # first: JAX's eager calls validate every time
        return
    rows = count(spec, len_q, len_k)
    if not rows:
        return
    with _lock:
        if _said:
            return
        _said = True
    top_left = {**spec.model_dump(mode="json", exclude_defaults=True), "causal_alignment": "top_left"}
    warnings.warn(
        f"with causal_alignment='bottom_right' (attnkit's default) and Lq={len_q} > Lk={len_k}, the first {rows} "
        "query rows see no key and output 0, lse -inf (docs/semantics.md §4.1, §5): right for queries that follow "
        "the keys. If the queries start where the keys do, as torch SDPA's is_causal=True has them, write "
        f"causal_alignment='top_left': {spec_text(top_left)}. (Said once per process.)",
        EmptyRowsWarning,
        stacklevel=3,
    )


def forget() -> None:
    """Warn of empty rows again (for tests)."""
    global _said
    with _lock:
        _said = False
