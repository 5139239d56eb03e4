"""The tiles of every tiled backend as it runs here, and where a band edge lies on them.

``TILED_BACKENDS`` says, for each tiled backend, which kernels it runs for a spec and each kernel's tile: how many
query rows and keys, and which way its loop runs (over the key tiles a query tile sees, as a forward or dQ kernel
does, or over the query tiles that see a key tile, as a dK/dV kernel does). Each entry reads the backend's own
tile settings, so the cases built from it follow a changed tile. A new tiled backend is one line there.

:func:`placements` finds the offsets from the diagonal (``j − i``) that put a band edge on a kernel's tile boundary
("flush": the band ends on the boundary, so the next tile is never needed) or one row or key past it ("overhang":
the band reaches exactly one row or key into the next tile, so a bound that is one short misses it), on either side
of the diagonal. A loop bound that is off by one is wrong only there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import attnkit
from attnkit import AttentionSpec

Loop = Literal["keys", "queries"]
Edge = Literal["upper", "lower"]
Fit = Literal["overhang", "flush", "full", "one hidden"]


@dataclass(frozen=True)
class KernelTile:
    """One kernel's tile: ``rows`` query rows by ``keys`` keys (None: one key tile per query tile, exactly as wide as
    the band it sees), looping over the key tiles of a query tile ("keys") or the query tiles of a key tile
    ("queries"). ``masks_crossed_only``: it decides per tile whether the band crosses it and masks only those."""

    kernel: str
    rows: int
    keys: int | None
    loop: Loop = "keys"
    masks_crossed_only: bool = False

    @property
    def key_step(self) -> int:
        # A band-wide key tile starts and ends on the band's edges: only the row tiles place them.
        return self.keys if self.keys is not None else self.rows

    def __str__(self) -> str:
        keys = "band-wide" if self.keys is None else str(self.keys)
        return f"{self.kernel} {self.rows}x{keys}"


def _triton(spec: AttentionSpec) -> tuple[KernelTile, ...] | None:
    from attnkit.backends.triton import launch

    if not launch.INTERPRETED:
        return None  # autotuned per call on a GPU
    tile = launch.INTERPRETER_CONFIG
    return (
        KernelTile("forward", tile.block_m, tile.block_n),
        KernelTile("dQ", tile.block_m, tile.block_n),
        KernelTile("dK/dV", tile.block_m, tile.block_n, "queries"),
    )


def _cupy_emulated(spec: AttentionSpec) -> tuple[KernelTile, ...] | None:
    launcher = attnkit.get_backend("cupy-emulated").launcher  # type: ignore[attr-defined]

    def tile(kernel: str, loop: Loop = "keys") -> KernelTile:
        config = launcher.tile(kernel, 16, "float32")
        return KernelTile(kernel, config.block_m, config.block_n, loop)

    return tile("forward"), tile("backward_dq"), tile("backward_dkdv", "queries")


def _pallas(spec: AttentionSpec) -> tuple[KernelTile, ...] | None:
    from attnkit.backends.pallas import backend

    long = 1 << 16  # tiles are clipped to short sequences only
    tiles = backend._blocks(attnkit.get_backend("pallas").interpret(), long, long, 16)  # type: ignore[attr-defined]
    forward, dkdv = tiles.forward, tiles.dkdv
    return (
        KernelTile("forward", *forward),
        KernelTile("dQ", *forward),
        KernelTile("dK/dV", *dkdv, "queries"),
    )


def _cpu_flash(spec: AttentionSpec) -> tuple[KernelTile, ...] | None:
    from attnkit.backends.cpu_flash import backend

    band = backend._Band.of(spec)
    forward = band.tile(backend.FORWARD_TILE)
    back = band.tile(backend.WINDOW_BACKWARD_TILE if band.low is not None else backend.BACKWARD_TILE)

    def tile(kernel: str, shape: tuple[int, int]) -> KernelTile:
        band_wide = band.low is not None and band.high is not None and shape[0] == backend.WINDOW_ROWS
        return KernelTile(kernel, shape[0], None if band_wide else shape[1], masks_crossed_only=not band_wide)

    # The backward loops over each query block's key tiles, as the forward does.
    return tile("forward", forward), tile("backward", back)


def _torch_chunked(spec: AttentionSpec) -> tuple[KernelTile, ...] | None:
    chunked = attnkit.get_backend("torch-chunked")
    rows, keys = chunked.block_q, chunked.block_k  # type: ignore[attr-defined]
    # The backward takes the forward's tiles (and its choice of which to mask) grouped by key tile.
    return KernelTile("forward", rows, keys, masks_crossed_only=True), KernelTile("backward", rows, keys, "queries")


#: backend -> the tiles of its kernels for a spec here (None: not fixed here, e.g. autotuned on a GPU).
TILED_BACKENDS: dict[str, Callable[[AttentionSpec], tuple[KernelTile, ...] | None]] = {
    "triton": _triton,
    "cupy-emulated": _cupy_emulated,
    "pallas": _pallas,
    "cpu-flash": _cpu_flash,
    "torch-chunked": _torch_chunked,
}


@dataclass(frozen=True)
class Placement:
    """A band edge at ``offset`` from the diagonal, on ``tile``: ``rows`` and ``keys`` hold the tile it falls on and
    the row or key on each side of the boundary."""

    tile: KernelTile
    edge: Edge
    fit: Fit
    offset: int
    rows: int
    keys: int

    def __str__(self) -> str:
        where = {
            "overhang": "one past a tile boundary",
            "flush": "on a tile boundary",
            "full": "through a tile's far corner",
            "one hidden": "one pair inside a tile's far corner",
        }[self.fit]
        return f"{self.edge} edge {self.offset:+d} {where} ({self.tile})"


def _anchors(tile: KernelTile, edge: Edge, offset: int, tiles: int) -> Iterator[tuple[Fit, int, int]]:
    """(fit, rows, keys) for each of the first ``tiles`` tiles on which the edge at ``offset`` has a fit; rows and
    keys reach the row or key past the boundary, and the tile that needs it.

    Loop bounds: a "keys" kernel bounds a query tile's keys by the upper edge at its last row and the lower edge at
    its first; a "queries" kernel bounds a key tile's rows by the upper edge at its first key and the lower edge at
    its last. Mask decisions (``masks_crossed_only``): a tile needs no mask when the upper edge at its first row and
    the lower edge at its last row leave it whole, and needs one when they hide a single pair in its corner.
    """
    rows, keys = tile.rows, tile.key_step
    for index in range(tiles):
        first_row, last_row = index * rows, (index + 1) * rows - 1
        candidates: list[tuple[dict[int, Fit], int, tuple[int, int]]] = []
        if tile.loop == "keys" and edge == "upper":
            last = last_row + offset  # the last key the tile's last row sees
            candidates.append(({0: "overhang", keys - 1: "flush"}, last, (last_row + 1, last + 2)))
            if tile.masks_crossed_only:
                corner = first_row + offset  # the last key the tile's first row sees
                candidates.append(({keys - 1: "full", keys - 2: "one hidden"}, corner, (last_row + 1, corner + 2)))
        elif tile.loop == "keys":
            first = first_row + offset  # the first key the tile's first row sees
            candidates.append(({keys - 1: "overhang", 0: "flush"}, first, (last_row + 1, first + 1)))
            if tile.masks_crossed_only:
                corner = last_row + offset  # the first key the tile's last row sees; the key tile there is whole
                candidates.append(({0: "full", 1: "one hidden"}, corner, (last_row + 1, corner + keys)))
        elif edge == "upper":
            first = index * keys - offset  # the first row that sees the key tile's first key
            candidates.append(({rows - 1: "overhang", 0: "flush"}, first, (first + 1, (index + 1) * keys)))
        else:
            last = (index + 1) * keys - 1 - offset  # the last row that sees the key tile's last key
            candidates.append(({0: "overhang", rows - 1: "flush"}, last, (last + 2, (index + 1) * keys)))
        for fits, position, extents in candidates:
            fit = fits.get(position % (keys if tile.loop == "keys" else rows))
            if fit is not None and position >= 1:  # an edge at row or key 0 is clipped there, not bounded
                yield fit, *extents


def placement(tile: KernelTile, edge: Edge, fit: Fit, offsets: Iterable[int]) -> Placement:
    """The first of ``offsets`` that puts ``edge`` on ``tile`` with ``fit``, on the first tile it can."""
    step = tile.key_step
    tiles = 2 * (tile.rows + step) // min(tile.rows, step) + 2
    for offset in offsets:
        match = next((anchor for anchor in _anchors(tile, edge, offset, tiles) if anchor[0] == fit), None)
        if match is not None:
            return Placement(tile, edge, fit, offset, match[1], match[2])
    raise AssertionError(f"no offset among those tried puts the {edge} edge {fit} on {tile}")


LOOP_FITS: tuple[Fit, ...] = ("overhang", "flush")
MASK_FITS: tuple[Fit, ...] = ("full", "one hidden")


def placements(tile: KernelTile, edge: Edge, fits: tuple[Fit, ...] | None = None) -> list[Placement]:
    """The offsets nearest the diagonal that put ``edge`` on ``tile`` with each fit (by default every fit the kernel
    has: the loop bounds' and, if it masks only crossed tiles, the mask decision's), on each side of the diagonal."""
    if fits is None:
        fits = LOOP_FITS + (MASK_FITS if tile.masks_crossed_only and tile.loop == "keys" else ())
    reach = 2 * (tile.rows + tile.key_step)
    return [placement(tile, edge, fit, range(sign, sign * reach, sign)) for fit in fits for sign in (1, -1)]
