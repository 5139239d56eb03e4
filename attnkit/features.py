"""The names of what a spec or a call can use (the ground floor: imports nothing of attnkit).

Backends declare the features they serve (``Capabilities.features``), specs and calls report the ones they use, and
config ``[[refine]]`` entries match them; every one of those names a :class:`Feature`. A ``Feature`` is a ``str``
(``Feature.CAUSAL == "causal"``), so config files and JSON keep writing the plain names.
"""

from __future__ import annotations

import enum


class Feature(enum.StrEnum):
    """What a spec or a call uses, by name: a backend's ``Capabilities.features`` lists those it serves."""

    # Of the spec (AttentionSpec.features()).
    CAUSAL = "causal"
    TOP_LEFT = "top_left"
    WINDOW = "window"
    COSINE = "cosine"
    SOFTCAP = "softcap"
    BSHD = "bshd"
    # Of the call (Problem.features()).
    MASK = "mask"
    BIAS = "bias"
    Q_LENGTHS = "q_lengths"
    KV_LENGTHS = "kv_lengths"
    LSE = "lse"
    GRAD = "grad"
    DBIAS = "dbias"
    SEGMENT_IDS = "segment_ids"
    # A mask program (mask_mod, docs/semantics.md §17).
    MASK_PROGRAM = "mask_program"
    # ALiBi's per-head slopes (docs/semantics.md §16), a bias the backend computes from positions.
    ALIBI = "alibi"
    # Of attend_paged (docs/semantics.md §13): the backend reads a paged KV cache where its blocks lie.
    PAGED = "paged"
    # Attention dropout with the contract's counter-based keep-mask (docs/semantics.md §18).
    DROPOUT = "dropout"
    # Of the call's geometry, read by routing only (config ``[[refine]]``), never a capability: causal aligned
    # bottom-right with 1 < Lq != Lk, a diagonal SDPA's ``is_causal`` (top-left) cannot place.
    BOTTOM_RIGHT_OFFSET = "bottom_right_offset"


SPEC_FEATURES = frozenset(
    {Feature.CAUSAL, Feature.TOP_LEFT, Feature.WINDOW, Feature.COSINE, Feature.SOFTCAP, Feature.BSHD}
)
CALL_FEATURES = frozenset(
    {
        Feature.MASK,
        Feature.BIAS,
        Feature.Q_LENGTHS,
        Feature.KV_LENGTHS,
        Feature.LSE,
        Feature.GRAD,
        Feature.DBIAS,
        Feature.SEGMENT_IDS,
        Feature.MASK_PROGRAM,
        Feature.PAGED,
        Feature.ALIBI,
        Feature.DROPOUT,
    }
)
#: What a backend can declare: every feature but the routing ones.
ALL_FEATURES = SPEC_FEATURES | CALL_FEATURES
ROUTING_FEATURES = frozenset({Feature.BOTTOM_RIGHT_OFFSET})
