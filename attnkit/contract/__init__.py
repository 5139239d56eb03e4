"""The contract's geometry in plain integers (docs/semantics.md §3–§5), for every framework and kernel launcher.

Visibility (§4): query i may see key j iff i < q_len, j < kv_len and ``lower ≤ j − i − off ≤ upper``, where
``off`` is the causal alignment offset (:func:`alignment_offset`) and ``(lower, upper)`` the diagonal band of the
spec's causal flag and window (:func:`diagonal_band`; None is an open side). Per batch element with lengths,
``q_len``/``kv_len`` are that element's lengths and ``off`` follows them. ``attnkit.contract.torch`` and
``attnkit.contract.jax`` write this in their framework's ops; ``attnkit.contract.kernels`` hands the same band to
the Triton and CUDA C kernels; :func:`tile_visibility` is the tile-level reading of it that tiled code skips by.
"""

from __future__ import annotations

import enum
from typing import Any

from attnkit.backend import AttentionSpec, CausalAlignment

#: The cosine variant's normalisation eps (§3), as torch.nn.functional.normalize: x / max(‖x‖, eps).
COSINE_EPS = 1e-12


def alignment_offset(spec: AttentionSpec, q_len: int, kv_len: int) -> int:
    """``off``: query i's aligned key is i + off. ``kv_len − q_len`` bottom-right (the last query faces the last key),
    0 top-left (query 0 faces key 0). With lengths, the element's own lengths."""
    return kv_len - q_len if spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT else 0


def diagonal_band(spec: AttentionSpec) -> tuple[int | None, int | None]:
    """``(lower, upper)`` on ``rel = j − i − off``: key j is visible to query i iff lower ≤ rel ≤ upper. The window's
    left side gives lower = −left; causal gives upper ≤ 0 and the window's right side upper ≤ right. None: open."""
    left, right = spec.window or (None, None)
    uppers = [bound for bound in (0 if spec.causal else None, right) if bound is not None]
    return (-left if left is not None else None), (min(uppers) if uppers else None)


def within_band(relative: Any, lower: Any, upper: Any) -> Any:
    """``lower ≤ relative ≤ upper`` (a None bound is an open side); None when both are. The band test on
    ``relative = j − i − off`` with the band's sides, or on ``j`` with the sides shifted by ``i + off``.

    Plain operators only: the same code serves ints, torch tensors, jax arrays, and the traced values of
    flex_attention's mask_mod and the pallas kernels."""
    return conjoin(None if lower is None else relative >= lower, None if upper is None else relative <= upper)


def conjoin(*conditions: Any) -> Any:
    """The AND of the conditions that are not None; None (every pair visible) when all are."""
    visible = None
    for condition in conditions:
        if condition is not None:
            visible = condition if visible is None else visible & condition
    return visible


class TileVisibility(enum.Enum):
    HIDDEN = "hidden"  # no pair visible: never loaded
    PARTIAL = "partial"  # some pairs visible: loaded and masked
    FULL = "full"  # every pair visible: loaded, no mask needed


def tile_visibility(
    band: tuple[int | None, int | None],
    offset: int,
    rows: range,
    cols: range,
    q_len: int,
    kv_len: int,
) -> TileVisibility:
    """Which of a tile's (query ``rows`` × key ``cols``) pairs are visible, for one batch element with ``q_len``
    queries, ``kv_len`` keys and alignment offset ``offset``, under ``band`` (:func:`diagonal_band`)."""
    last_row, last_col = min(rows.stop, q_len) - 1, min(cols.stop, kv_len) - 1
    if last_row < rows.start or last_col < cols.start:
        return TileVisibility.HIDDEN
    lower, upper = band
    # rel = j − i − off over the tile's real pairs spans [least, most].
    least, most = cols.start - last_row - offset, last_col - rows.start - offset
    if (lower is not None and most < lower) or (upper is not None and least > upper):
        return TileVisibility.HIDDEN
    clipped = rows.stop > q_len or cols.stop > kv_len
    inside = (lower is None or least >= lower) and (upper is None or most <= upper)
    return TileVisibility.FULL if inside and not clipped else TileVisibility.PARTIAL
