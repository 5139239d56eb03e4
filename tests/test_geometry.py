"""The band's two readings that tiled code plans from, against the oracle pair by pair: the framework-free
``attnkit.contract.tile_visibility`` and the torch one, ``attnkit.contract.torch.Band``.

The brute force is the float64 oracle's own visibility (``oracle_visibility``, written apart from both): a tile is
hidden when none of its pairs is visible, full when every one is, partial otherwise. Specs are drawn over causal in
both alignments, windows with either side open, lengths down to 0 and Lq ≠ Lk; tiles are drawn at random and placed
with a corner on each band edge and one pair either side of it, where a bound that is one off shows.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from attnkit.backends.reference.torch_naive import oracle_visibility

from attnkit import AttentionInputs, AttentionSpec
from attnkit.contract import TileVisibility, alignment_offset, diagonal_band, tile_visibility
from attnkit.contract.torch import Band, SegmentTiles

DRAWS = 300


def draw_call(rng: random.Random) -> tuple[AttentionSpec, AttentionInputs]:
    len_q, len_k, batch = rng.randint(1, 12), rng.randint(1, 12), rng.randint(1, 3)
    window = rng.choice([None, (rng.choice([None, 0, 1, 3]), rng.choice([None, 0, 2, 5]))])
    spec = AttentionSpec(
        causal=rng.random() < 0.6, causal_alignment=rng.choice(["top_left", "bottom_right"]), window=window
    )

    def lengths(full: int) -> torch.Tensor | None:
        return (
            torch.tensor([rng.choice([0, full, rng.randint(0, full)]) for _ in range(batch)])
            if rng.random() < 0.5
            else None
        )

    q, k = torch.empty(batch, 1, len_q, 1), torch.empty(batch, 1, len_k, 1)
    return spec, AttentionInputs(q, k, k, q_lengths=lengths(len_q), kv_lengths=lengths(len_k))


def brute_force(visible: np.ndarray, rows: range, cols: range) -> TileVisibility:
    """The tile's class from one element's (Lq, Lk) visibility; pairs past its extent are padding, never visible."""
    tile = np.zeros((len(rows), len(cols)), dtype=bool)
    inside = visible[rows.start : rows.stop, cols.start : cols.stop]
    tile[: inside.shape[0], : inside.shape[1]] = inside
    return TileVisibility.HIDDEN if not tile.any() else TileVisibility.FULL if tile.all() else TileVisibility.PARTIAL


def tiles(
    rng: random.Random, spec: AttentionSpec, offset: int, len_q: int, len_k: int
) -> Iterator[tuple[range, range]]:
    """Random tiles, and tiles with a corner on each band edge or one pair either side of it (rel = j − i − off)."""
    for _ in range(16):
        r0, c0 = rng.randint(0, len_q), rng.randint(0, len_k)
        extent = rng.choice([2, 5])  # small tiles are often full in every batch element
        yield range(r0, r0 + rng.randint(1, extent)), range(c0, c0 + rng.randint(1, extent))
    for edge in (bound for bound in diagonal_band(spec) if bound is not None):
        for rel in (edge - 1, edge, edge + 1):
            height, width = rng.randint(1, 4), rng.randint(1, 4)
            row = rng.randint(0, len_q)
            key = row + offset + rel  # the pair (row, key) lies on the edge, or one pair beside it
            # The far corners decide full and hidden: the pair as the tile's lower left corner, then its upper right.
            for rows, cols in (
                (range(row - height + 1, row + 1), range(key, key + width)),
                (range(row, row + height), range(key - width + 1, key + 1)),
            ):
                if rows.start >= 0 and cols.start >= 0:
                    yield rows, cols


def test_tile_visibility_and_the_torch_band_match_the_oracle_pair_by_pair() -> None:
    rng = random.Random(15)
    for _ in range(DRAWS):
        spec, inputs = draw_call(rng)
        batch, len_q, len_k = inputs.q.shape[0], inputs.q.shape[2], inputs.k.shape[2]
        oracle = oracle_visibility(spec, inputs, len_q, len_k)[:, 0].numpy()
        band = Band(spec, inputs, len_q, len_k)
        q_lens = inputs.q_lengths.tolist() if inputs.q_lengths is not None else [len_q] * batch
        kv_lens = inputs.kv_lengths.tolist() if inputs.kv_lengths is not None else [len_k] * batch
        context = f"{spec!r} Lq={len_q} Lk={len_k} q_lengths={q_lens} kv_lengths={kv_lens}"

        # The torch band's masks, whole and by tile.
        visible = band.visible()
        dense = np.broadcast_to(True if visible is None else visible[:, 0].numpy(), oracle.shape)
        np.testing.assert_array_equal(dense, oracle, err_msg=context)
        r0, c0 = rng.randrange(len_q), rng.randrange(len_k)
        rows, cols = slice(r0, rng.randint(r0 + 1, len_q)), slice(c0, rng.randint(c0 + 1, len_k))
        part = band.visible(rows, cols)
        part_dense = np.broadcast_to(True if part is None else part[:, 0].numpy(), oracle[:, rows, cols].shape)
        np.testing.assert_array_equal(part_dense, oracle[:, rows, cols], err_msg=f"{context} {rows} {cols}")

        # Per row, the key range: first ≤ j ≤ last exactly the visible keys.
        first, last = (x.numpy() for x in band.key_ranges())
        keys = np.arange(len_k)
        np.testing.assert_array_equal((keys >= first[..., None]) & (keys <= last[..., None]), oracle, err_msg=context)

        for b in range(batch):
            offset = alignment_offset(spec, q_lens[b], kv_lens[b])
            for rows_range, cols_range in tiles(rng, spec, offset, len_q, len_k):
                expected = brute_force(oracle[b], rows_range, cols_range)
                found = tile_visibility(diagonal_band(spec), offset, rows_range, cols_range, q_lens[b], kv_lens[b])
                assert found is expected, f"{context} element {b}: {rows_range} x {cols_range}"
                # Over the batch: wholly visible iff full in every element; the key span covers every seen key.
                full_everywhere = all(
                    brute_force(oracle[e], rows_range, cols_range) is TileVisibility.FULL for e in range(batch)
                )
                assert band.wholly_visible(rows_range, cols_range) == full_everywhere, context
                seen = np.flatnonzero(oracle[:, rows_range.start : rows_range.stop].any(axis=(0, 1)))
                span = band.key_span(rows_range)
                if inputs.q_lengths is None and inputs.kv_lengths is None:
                    assert list(span) == (list(range(seen[0], seen[-1] + 1)) if seen.size else []), context
                else:  # planned from the extremes over the batch: it may be wider, never narrower
                    assert all(j in span for j in seen), context


def _id_row(rng: random.Random, length: int, packed: bool) -> list[int]:
    """Packed: runs of increasing ids with padding (−1) runs between them; else any ids in −1..2."""
    if not packed:
        return [rng.randint(-1, 2) for _ in range(length)]
    row: list[int] = []
    document = 0
    while len(row) < length:
        padding = rng.random() < 0.3
        row += [-1 if padding else document] * rng.randint(1, 4)
        document += not padding
    return row[:length]


def test_segment_tiles_plan_by_the_ids() -> None:
    """:class:`SegmentTiles` and :meth:`Band.segment_pairs` against the segment clause pair by pair (§4.5): a tile
    pair planned as not meeting holds no pair of one id (never hides a visible pair), and for packed rows exactly
    those that hold none (an all-padding tile included); ``whole`` exactly where every pair shares one id."""
    rng = random.Random(17)
    for _ in range(DRAWS):
        batch, len_q, len_k = rng.randint(1, 3), rng.randint(1, 13), rng.randint(1, 13)
        packed = rng.random() < 0.6
        if packed and rng.random() < 0.5:
            len_k = len_q
        q_ids = torch.tensor([_id_row(rng, len_q, packed) for _ in range(batch)])
        kv_ids = q_ids if len_k == len_q and rng.random() < 0.5 else torch.tensor(
            [_id_row(rng, len_k, packed) for _ in range(batch)]
        )  # fmt: skip
        block_q, block_k = rng.randint(1, 5), rng.randint(1, 5)
        same = ((q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] >= 0)).numpy()
        meet, whole = SegmentTiles.of(q_ids, block_q).pairs(SegmentTiles.of(kv_ids, block_k))
        context = f"q_ids={q_ids.tolist()} kv_ids={kv_ids.tolist()} tiles {block_q}x{block_k}"
        for r in range(meet.shape[1]):
            for c in range(meet.shape[2]):
                tile = same[:, r * block_q : (r + 1) * block_q, c * block_k : (c + 1) * block_k]
                any_pair, all_pairs = tile.any(axis=(1, 2)), tile.all(axis=(1, 2))
                assert (meet[:, r, c].numpy() >= any_pair).all(), f"{context}: tile {r},{c} hides a visible pair"
                if packed:  # each tile holds every id between its least and greatest: the ranges are exact
                    assert (meet[:, r, c].numpy() == any_pair).all(), f"{context}: tile {r},{c} planned loosely"
                assert (whole[:, r, c].numpy() == all_pairs).all(), f"{context}: tile {r},{c} whole"
        q, k = torch.empty(batch, 1, len_q, 1), torch.empty(batch, 1, len_k, 1)
        band = Band(AttentionSpec(), AttentionInputs(q, k, k, q_segment_ids=q_ids, kv_segment_ids=kv_ids), len_q, len_k)
        pairs = band.segment_pairs(block_q, block_k)
        assert pairs is not None and pairs.meet == meet.any(dim=0).tolist() and pairs.whole == whole.all(0).tolist()


@pytest.mark.parametrize(
    ("spec", "offset", "rows", "cols", "expected"),
    [
        # Causal at offset 0: the diagonal through the tile's upper right corner leaves it whole; one key more hides
        # that corner; a tile wholly above the diagonal is hidden, one touching it at its lower left is not.
        (AttentionSpec(causal=True), 0, range(4, 8), range(0, 5), TileVisibility.FULL),
        (AttentionSpec(causal=True), 0, range(4, 8), range(0, 6), TileVisibility.PARTIAL),
        (AttentionSpec(causal=True), 0, range(0, 4), range(4, 8), TileVisibility.HIDDEN),
        (AttentionSpec(causal=True), 0, range(0, 4), range(3, 8), TileVisibility.PARTIAL),
        # A window's left side (lower = −2) at offset 3: key j ≥ i + 1.
        (AttentionSpec(window=(2, None)), 3, range(0, 4), range(4, 9), TileVisibility.FULL),
        (AttentionSpec(window=(2, None)), 3, range(0, 4), range(3, 9), TileVisibility.PARTIAL),
        (AttentionSpec(window=(2, None)), 3, range(4, 8), range(0, 5), TileVisibility.HIDDEN),
        (AttentionSpec(window=(2, None)), 3, range(4, 8), range(0, 6), TileVisibility.PARTIAL),
    ],
)
def test_tile_visibility_on_and_one_past_each_edge(
    spec: AttentionSpec, offset: int, rows: range, cols: range, expected: TileVisibility
) -> None:
    assert tile_visibility(diagonal_band(spec), offset, rows, cols, 100, 100) is expected


def test_the_band_finds_exactly_the_rows_that_see_nothing_with_segment_ids() -> None:
    """``Band.empty_rows`` (band, lengths and segment ids, in linear memory) against the oracle's visibility: ids
    drawn unsorted, repeated apart, negative now and then, so rows empty by their document alone show."""
    rng = random.Random(45)
    for _ in range(DRAWS):
        spec, inputs = draw_call(rng)
        batch, len_q, len_k = inputs.q.shape[0], inputs.q.shape[2], inputs.k.shape[2]
        ids = [-1, 0, 1, 2, 7]
        inputs = inputs._replace(
            q_segment_ids=torch.tensor([[rng.choice(ids) for _ in range(len_q)] for _ in range(batch)]),
            kv_segment_ids=torch.tensor([[rng.choice(ids) for _ in range(len_k)] for _ in range(batch)]),
        )
        expected = ~oracle_visibility(spec, inputs, len_q, len_k)[:, 0].any(dim=-1)
        found = Band(spec, inputs, len_q, len_k).empty_rows()
        assert torch.equal(found, expected), f"{spec!r} {inputs.q_segment_ids} {inputs.kv_segment_ids}"
