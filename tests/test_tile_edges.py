"""Band edges on tile boundaries, in every kernel of every tiled backend, forward and backward, in float32.

A tiled kernel finds from index arithmetic which tiles a band reaches: the forward and dQ kernels loop over the key
tiles a query tile sees, the dK/dV kernels over the query tiles that see a key tile. A bound that is one row or key
short is wrong only where the band reaches exactly one row or key into the next tile; one that is one too long, only
where the band ends on a boundary. So every case here is built from the backend's own tiles (tests/tiles.py) to put
an edge there, on the tiles of each kernel in its loop direction, above and below the diagonal, and is compared with
the float64 oracle on out, lse, dq, dk and dv. (A query-span bound one row short in a dK/dV kernel, the lower edge of
a causal window (1, 0) at Lq = Lk = 32, gave dk/dv errors of 0.1-0.2 and passed every other test for one kernel.)

Each test proves one kind of edge: the causal diagonal in both alignments, each window side alone and both, causal
with a window, the query and key lengths (whose padding holds NaN, which must never be read), and segment ids (whose
documents start on and next to tile boundaries, and whose padding holds NaN too).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from attnkit import AttentionSpec, Feature
from attnkit.testing import Case, make_arrays
from attnkit.testing.agreement import compare, compare_outputs, oracle_results, rounded
from attnkit.testing.runners import Results, harness_capabilities, run_backend
from tests.conftest import available_backends
from tests.tiles import LOOP_FITS, TILED_BACKENDS, Edge, KernelTile, Placement, placement, placements

BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(name not in available_backends(), reason=f"{name} not available here"))
    for name in TILED_BACKENDS
]
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # Triton's interpreter, on NaN rows

# One query head over one kv head and one batch element: the bounds do not depend on them, the interpreters' cost does.
SHAPE = {"batch": 1, "heads_q": 1, "heads_kv": 1}


def _tiles(backend: str, probe: AttentionSpec) -> tuple[KernelTile, ...]:
    tiles = TILED_BACKENDS[backend](probe)
    if tiles is None:
        pytest.skip(f"{backend} chooses its tiles at run time here; these cases need them fixed")
    return tiles


Groups = dict[tuple[AttentionSpec, int], list[Placement]]


def _quantum(tiles: tuple[KernelTile, ...]) -> tuple[int, int]:
    """(rows, keys): the least common multiple of every kernel's query tile and of every key tile."""
    return math.lcm(*(tile.rows for tile in tiles)), math.lcm(*(tile.key_step for tile in tiles))


def _cases(groups: Groups, tiles: tuple[KernelTile, ...]) -> list[Case]:
    """One case per (spec, alignment offset Lk − Lq), long enough to hold every placement of its group (kernels
    with equal tiles share a case), then lengthened to end Lq and Lk in the same block of the largest tile where the
    offset allows: a backend that compiles per padded shape (pallas) then compiles few."""
    block = max(_quantum(tiles))
    cases = []
    for (spec, offset), group in groups.items():
        len_q = max(max(item.rows for item in group), max(item.keys for item in group) - offset)
        if abs(offset) < block:
            while -(-len_q // block) != -(-(len_q + offset) // block):
                len_q += 1
        notes = tuple(dict.fromkeys(map(str, group)))
        cases.append(Case(spec=spec, len_q=len_q, len_k=len_q + offset, notes=notes, **SHAPE))
    return cases


def _edge_cases(
    backend: str, probe: AttentionSpec, edge: Edge, make: Callable[[int], tuple[AttentionSpec, int]]
) -> list[Case]:
    """``edge`` placed on each kernel's tiles; ``make(edge offset)`` gives the spec and the alignment offset that put
    it there."""
    groups: Groups = {}
    tiles = _tiles(backend, probe)
    for tile in tiles:
        for item in placements(tile, edge):
            groups.setdefault(make(item.offset), []).append(item)
    return _cases(groups, tiles)


@functools.lru_cache(maxsize=256)
def _inputs_and_oracle(case: Case) -> tuple[dict[str, np.ndarray], Results, Results]:
    arrays = rounded(case, make_arrays(case))
    return (arrays, *oracle_results(case, arrays))


def _with_nan_padding(case: Case, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rows of q beyond q_lengths or of a negative q segment id, and of k, v beyond kv_lengths or of a negative kv
    segment id, set to NaN: padding is never input (§5)."""
    poisoned = {name: value.copy() for name, value in arrays.items()}
    for names, lengths, segment_ids in (
        (("q",), case.q_lengths, case.q_segment_ids),
        (("k", "v"), case.kv_lengths, case.kv_segment_ids),
    ):
        for name in names:
            for batch, length in enumerate(lengths or ()):
                poisoned[name][batch, :, length:] = np.nan
            for batch, ids in enumerate(segment_ids or ()):
                poisoned[name][batch, :, np.asarray(ids) < 0] = np.nan
    return poisoned


def _assert_agree(backend: str, cases: list[Case], nan_padding: bool = False) -> None:
    """Every case agrees with the oracle (out, lse, dq, dk, dv); the failures of all cases are listed together."""
    failures = []
    for case in cases:
        arrays, exact, baseline = _inputs_and_oracle(case)
        results = run_backend(case, _with_nan_padding(case, arrays) if nan_padding else arrays, backend)
        wrong = [str(comparison) for comparison in compare(case, results, exact, baseline) if not comparison.ok]
        if wrong:
            failures.append(f"{case.describe()} [{'; '.join(case.notes)}]\n    " + "\n    ".join(wrong))
    assert not failures, f"{backend} disagrees with the oracle at tile edges:\n  " + "\n  ".join(failures)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_diagonal_off_by_the_bottom_right_offset(backend: str) -> None:
    """Causal, bottom-right with Lq ≠ Lk both ways: the diagonal shifted by Lk − Lq onto and one past each
    kernel's tile boundaries."""
    probe = AttentionSpec(causal=True)
    _assert_agree(backend, _edge_cases(backend, probe, "upper", lambda offset: (probe, offset)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_top_left_with_unequal_lengths(backend: str) -> None:
    """Causal, top-left: the diagonal stays at j = i whatever Lq and Lk, with a partial last tile each way."""
    spec = AttentionSpec(causal=True, causal_alignment="top_left")
    tiles = _tiles(backend, spec)
    rows, keys = _quantum(tiles)
    notes = tuple(map(str, tiles))
    cases = [
        Case(spec=spec, len_q=len_q, len_k=len_k, notes=notes, **SHAPE)
        for len_q, len_k in ((2 * rows + 1, 3 * keys), (3 * rows, 2 * keys + 1))
    ]
    _assert_agree(backend, cases)


def _right_window(edge_offset: int) -> tuple[AttentionSpec, int]:
    # Above the diagonal: a right side of that many keys; below it: one key right of a negative alignment offset.
    if edge_offset > 0:
        return AttentionSpec(window=(None, edge_offset)), 0
    return AttentionSpec(window=(None, 1)), edge_offset - 1


def _left_window(edge_offset: int) -> tuple[AttentionSpec, int]:
    # Below the diagonal: a left side of that many keys; above it: one key left of a positive alignment offset.
    if edge_offset < 0:
        return AttentionSpec(window=(-edge_offset, None)), 0
    return AttentionSpec(window=(1, None)), edge_offset + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_right_edge(backend: str) -> None:
    """A window's right side alone (not causal) as the upper edge, on and one past each kernel's boundaries."""
    _assert_agree(backend, _edge_cases(backend, AttentionSpec(window=(None, 1)), "upper", _right_window))


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_left_edge(backend: str) -> None:
    """A window's left side alone as the lower edge, on and one past each kernel's boundaries."""
    _assert_agree(backend, _edge_cases(backend, AttentionSpec(window=(1, None)), "lower", _left_window))


def _two_edge_cases(backend: str, probe: AttentionSpec, causal: bool) -> list[Case]:
    """Both edges placed on each kernel's tiles: for each placement of the upper edge, a lower edge below it with the
    other fit (causal: the same fit; and for the diagonal itself at Lq = Lk, both fits)."""
    groups: Groups = {}
    tiles = _tiles(backend, probe)
    for tile in tiles:
        reach = 2 * (tile.rows + tile.key_step)
        uppers = [(upper.offset, upper.fit, [upper]) for upper in placements(tile, "upper", LOOP_FITS)]
        if causal:
            uppers += [(0, "overhang", []), (0, "flush", [])]
        for edge_offset, fit, placed in uppers:
            # causal: the alignment offset is the upper edge; else a right side over a zero or negative offset
            offset = edge_offset if causal else min(edge_offset - 1, 0)
            wanted = fit if causal else ("flush" if fit == "overhang" else "overhang")
            lower = placement(tile, "lower", wanted, range(offset - 1, offset - reach, -1))
            # causal: a right side is clipped to the diagonal; the one of the motivating window (1, 0) is 0
            window = (offset - lower.offset, (0 if offset == 0 else 1) if causal else edge_offset - offset)
            groups.setdefault((AttentionSpec(causal=causal, window=window), offset), []).extend([*placed, lower])
    return _cases(groups, tiles)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_both_edges(backend: str) -> None:
    """A window bounded on both sides, one edge on a boundary and the other one past one, both ways round."""
    _assert_agree(backend, _two_edge_cases(backend, AttentionSpec(window=(1, 1)), causal=False))


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_window(backend: str) -> None:
    """Causal with a left side (a sliding window): the diagonal and the window's lower edge both placed, including
    Lq = Lk with the lower edge one row into the next tile (the causal window (1, 0) of the motivating bug)."""
    _assert_agree(backend, _two_edge_cases(backend, AttentionSpec(causal=True, window=(1, 0)), causal=True))


def _length_cases(backend: str) -> list[Case]:
    """Query and key lengths on a boundary of every kernel's tiles and one row or key either side of it (per batch
    element, so the bottom-right offset differs too), with and without a band; Lq ≠ Lk."""
    cases = []
    # (spec, q_lengths, kv_lengths) as offsets from the second boundary of the kernels' tiles, per batch element
    for spec, q_lengths, kv_lengths in (
        (AttentionSpec(causal=True), None, (1, 0)),
        (AttentionSpec(), (1, -1), (-1, 1)),
        (AttentionSpec(window=(1, 1)), (0, 1), None),
        (AttentionSpec(causal=True, window=(3, 0)), (-1, 0), (0, -1)),
    ):
        tiles = _tiles(backend, spec)
        rows, keys = _quantum(tiles)
        cases.append(
            Case(
                spec=spec,
                batch=2,
                heads_q=1,
                heads_kv=1,
                len_q=3 * rows,
                len_k=4 * keys,
                q_lengths=tuple(2 * rows + off for off in q_lengths) if q_lengths else None,
                kv_lengths=tuple(2 * keys + off for off in kv_lengths) if kv_lengths else None,
                notes=tuple(map(str, tiles)),
            )
        )
    return cases


@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_on_and_next_to_tile_boundaries(backend: str) -> None:
    """q_lengths and kv_lengths on a boundary and one off it (per batch element, so the bottom-right offset differs
    too); the padding beyond them is NaN and must change nothing."""
    _assert_agree(backend, _length_cases(backend), nan_padding=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alibi_across_tile_boundaries(backend: str) -> None:
    """§16: ALiBi's distance |i + off_b − j| uses each row's and key's position in the call, in every tile (a term
    read from a tile's own indices is right in its first tile only). Three tiles of keys, lengths on and one off a
    boundary per batch element (so the elements' offsets differ), causal bottom-right and a top-left window, per
    (batch, head) slopes; padding is NaN."""
    if Feature.ALIBI not in harness_capabilities(backend).features:
        pytest.skip(f"{backend} does not declare alibi")
    cases = []
    for spec in (AttentionSpec(causal=True), AttentionSpec(window=(None, 3), causal_alignment="top_left")):
        rows, keys = _quantum(_tiles(backend, spec))
        cases.append(
            Case(spec=spec, batch=2, heads_q=2, heads_kv=1, len_q=2 * rows + 1, len_k=3 * keys,
                 q_lengths=(2 * rows + 1, rows), kv_lengths=(3 * keys, 2 * keys - 1), alibi_shape=(2, 2))
        )  # fmt: skip
    _assert_agree(backend, cases, nan_padding=True)


def _needs_segment_ids(backend: str) -> None:
    if Feature.SEGMENT_IDS not in harness_capabilities(backend).features:
        pytest.skip(f"{backend} does not declare segment ids")


def _runs(*runs: tuple[int, int]) -> tuple[int, ...]:
    """A row of segment ids from (id, count) runs."""
    return tuple(id_ for id_, count in runs for _ in range(count))


def _segment_cases(backend: str) -> list[Case]:
    """Documents and padding (id −1) starting on a boundary of every kernel's tiles and one position either side
    of it, with a band and without, in self-attention (the same ids for queries and keys) and across (Lq ≠ Lk, the
    ids drawn apart): an all-padding tile, left padding, a one-token document, a document spanning three tiles."""
    cases = []
    for spec in (AttentionSpec(causal=True), AttentionSpec(causal=True, causal_alignment="top_left", window=(5, 0))):
        rows, keys = _quantum(_tiles(backend, spec))
        unit = math.lcm(rows, keys)  # a boundary of every kernel's query and key tiles
        packed = _runs((0, unit - 1), (1, unit + 2), (-1, 1), (2, 1), (3, unit - 3))
        left_padded = _runs((-1, unit), (0, 2 * unit))
        cases.append(
            Case(spec=spec, batch=2, heads_q=1, heads_kv=1, len_q=3 * unit, len_k=3 * unit,
                 q_segment_ids=(packed, left_padded), kv_segment_ids=(packed, left_padded))
        )  # fmt: skip
    rows, keys = _quantum(_tiles(backend, AttentionSpec()))
    q_ids = (_runs((0, rows + 1), (-1, rows - 1), (1, rows)), _runs((-1, 3 * rows)))
    kv_ids = (_runs((1, keys), (-1, 1), (0, keys - 1), (1, keys)), _runs((-1, keys), (0, 2 * keys)))
    cases.append(
        Case(spec=AttentionSpec(window=(None, 4)), batch=2, heads_q=2, heads_kv=1, len_q=3 * rows, len_k=3 * keys,
             q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    )  # fmt: skip
    return cases


@pytest.mark.parametrize("backend", BACKENDS)
def test_segment_ids_on_and_next_to_tile_boundaries(backend: str) -> None:
    """Segment ids whose documents and padding begin on a tile boundary and one off it (§4.5); the padding (a
    negative id) of q, k and v is NaN and must change nothing."""
    _needs_segment_ids(backend)
    _assert_agree(backend, _segment_cases(backend), nan_padding=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiles_of_other_documents_are_never_loaded(backend: str) -> None:
    """A packed row of three documents, each a whole number of every kernel's tiles, and NaN in every q, k, v and
    dout of the middle one: the first and last documents' out, lse, dq, dk and dv agree with the oracle on finite
    inputs. A kernel that loaded a tile of the middle document with one of theirs (a query tile with a key tile,
    either way round) would compute 0·NaN = NaN there (§5 leaves hidden NaN open; these backends promise to skip
    a tile pair whose segment ids cannot meet)."""
    _needs_segment_ids(backend)
    rows, keys = _quantum(_tiles(backend, AttentionSpec()))
    unit = math.lcm(rows, keys)
    ids = _runs((0, unit), (1, unit), (2, unit))
    case = Case(spec=AttentionSpec(), **SHAPE, len_q=3 * unit, len_k=3 * unit, q_segment_ids=(ids,),
                kv_segment_ids=(ids,))  # fmt: skip
    arrays, exact, baseline = _inputs_and_oracle(case)
    poisoned = {name: value.copy() for name, value in arrays.items()}
    for name in ("q", "k", "v", "dout"):
        poisoned[name][:, :, unit : 2 * unit] = np.nan
    results = run_backend(case, poisoned, backend)
    outer = np.r_[0:unit, 2 * unit : 3 * unit]  # the positions of the first and last documents

    def outer_documents(outputs: Results) -> Results:
        return {name: np.take(value, outer, axis=2) for name, value in outputs.items()}

    comparisons = compare_outputs(
        case.dtype, outer_documents(results), outer_documents(exact), outer_documents(baseline)
    )
    wrong = [str(comparison) for comparison in comparisons if not comparison.ok]
    assert not wrong, f"{backend} loaded tiles of another document ({case.describe()}):\n  " + "\n  ".join(wrong)


# --------------------------------------------------------------------------------- tiles outside the band


@dataclass(frozen=True)
class _Hidden:
    """A case with NaN in keys (k, v) or query rows (q, dout) that a kernel's loop must skip, and the outputs (by
    sequence index) that stay finite only if it does: a kernel that loaded the tile and masked it would compute
    0·NaN = NaN (docs/semantics.md §5 leaves hidden NaN open; these backends promise to skip the tiles)."""

    case: Case
    finite: tuple[tuple[str, int, int], ...]  # (output, start, end)
    keys: tuple[int, int] = (0, 0)  # [start, end)
    rows: tuple[int, int] = (0, 0)


def _hidden_cases(backend: str) -> dict[_Hidden, list[str]]:
    """For each kernel, the band's edge flush with a tile boundary on each side its loop bounds (the upper edge under
    causal, the lower edge of a window with and without causal), and NaN in the tile beyond it; and lengths on a
    boundary with NaN in every real key (or query row), which the tiles past them must not load."""
    found: dict[_Hidden, list[str]] = {}
    seen = set()
    for probe, edge in (
        (AttentionSpec(causal=True), "upper"),
        (AttentionSpec(causal=True, window=(1, 0)), "lower"),
        (AttentionSpec(window=(1, None)), "lower"),
    ):
        for tile in _tiles(backend, probe):
            if (tile.rows, tile.keys, tile.loop, edge) in seen:  # the same bound: its case is run already
                continue
            seen.add((tile.rows, tile.keys, tile.loop, edge))
            reach = 2 * (tile.rows + tile.key_step)
            if edge == "upper":
                item = placement(tile, "upper", "flush", range(0, reach))
                spec, offset = probe, item.offset
            else:
                item = placement(tile, "lower", "flush", range(-1, -reach, -1))
                spec, offset = probe.model_copy(update={"window": (-item.offset, probe.window[1])}), 0
            length = max(item.rows, item.keys - offset) + tile.rows
            case = Case(spec=spec, len_q=length, len_k=length + offset, **SHAPE)
            if tile.loop == "keys" and edge == "upper":  # the anchor tile's last row sees keys up to last
                rows, last = item.rows, item.keys - 2
                hidden = _Hidden(
                    case, (("out", 0, rows), ("lse", 0, rows), ("dq", 0, rows)), keys=(last + 1, case.len_k)
                )
            elif tile.loop == "keys":  # its first row sees keys from first
                start, first = item.rows - tile.rows, item.keys - 1
                hidden = _Hidden(case, (("out", start, length), ("dq", start, length)), keys=(0, first))
            elif edge == "upper":  # the first row to see the key tile starting at start
                first, start = item.rows - 1, item.keys - tile.key_step
                hidden = _Hidden(case, (("dk", start, case.len_k), ("dv", start, case.len_k)), rows=(0, first))
            else:  # the last row to see the key tile ending at end
                last, end = item.rows - 2, item.keys
                hidden = _Hidden(case, (("dk", 0, end), ("dv", 0, end), ("dq", 0, last + 1)), rows=(last + 1, length))
            found.setdefault(hidden, []).append(str(item))
    # A query tile wholly past q_lengths loads no key, a key tile wholly past kv_lengths no query row.
    rows, keys = _quantum(_tiles(backend, AttentionSpec()))
    lengths = {"len_q": 3 * rows, "len_k": 3 * keys, "q_lengths": (2 * rows,), "kv_lengths": (2 * keys,)}
    case = Case(spec=AttentionSpec(), **{**SHAPE, **lengths})
    padding_rows = _Hidden(case, (("out", 2 * rows, 3 * rows), ("dq", 2 * rows, 3 * rows)), keys=(0, 2 * keys))
    padding_keys = _Hidden(case, (("dk", 2 * keys, 3 * keys), ("dv", 2 * keys, 3 * keys)), rows=(0, 2 * rows))
    found[padding_rows] = [f"query tiles past q_lengths = {2 * rows}"]
    found[padding_keys] = [f"key tiles past kv_lengths = {2 * keys}"]
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiles_outside_the_band_are_never_loaded(backend: str) -> None:
    """NaN in the tile just past each edge of the band, flush with its boundary, for each kernel's loop: the
    outputs whose tiles end at the edge stay finite (a bound one too long would load the tile)."""
    failures = []
    for hidden, what in _hidden_cases(backend).items():
        arrays = {name: value.copy() for name, value in _inputs_and_oracle(hidden.case)[0].items()}
        keys, rows = slice(*hidden.keys), slice(*hidden.rows)
        arrays["k"][:, :, keys] = arrays["v"][:, :, keys] = np.nan
        arrays["q"][:, :, rows] = arrays["dout"][:, :, rows] = np.nan
        results = run_backend(hidden.case, arrays, backend)
        leaked = [name for name, start, end in hidden.finite if not np.isfinite(results[name][:, :, start:end]).all()]
        if leaked:
            failures.append(f"{'; '.join(what)}, {hidden.case.describe()}: NaN reached {', '.join(leaked)}")
    assert not failures, f"{backend} loaded tiles outside the band:\n  " + "\n  ".join(failures)


# --------------------------------------------------------------------------------- the generator itself

PROBES = (
    AttentionSpec(causal=True),
    AttentionSpec(window=(1, None)),
    AttentionSpec(window=(None, 1)),
    AttentionSpec(causal=True, window=(1, 0)),
)


def _shows(item: Placement) -> bool:
    """Whether some tile of the kernel, in a brute-force visibility matrix of the placement's extents with its edge
    alone, has the fit the placement claims. The corner pairs that tell the fits apart are the same for both loop
    directions; the tile beyond a flush edge is the next key tile for a "keys" loop, the previous or next query tile
    for a "queries" one, and it must exist."""
    tile, height, width = item.tile, item.tile.rows, item.tile.key_step
    # Whole tiles from row and key 0, one more each way; pairs outside the extents do not exist (False).
    i = np.arange(-height, (item.rows // height + 2) * height)[:, None]
    j = np.arange(-width, (item.keys // width + 2) * width)[None, :]
    inside = (i >= 0) & (i < item.rows) & (j >= 0) & (j < item.keys)
    visible = inside & ((j - i <= item.offset) if item.edge == "upper" else (j - i >= item.offset))
    keys_loop = tile.loop == "keys"
    for r0 in range(height, visible.shape[0] - height, height):
        for c0 in range(width, visible.shape[1] - width, width):
            block = visible[r0 : r0 + height, c0 : c0 + width]
            if item.edge == "upper":
                beyond = (r0, r0 + height, c0 + width, c0 + width + 1) if keys_loop else (r0 - 1, r0, c0, c0 + width)
                corner = block[-1, -1] if keys_loop else block[0, 0]
                fits = {
                    "overhang": block.sum() == 1 and block[-1, 0],
                    "full": block.all() and not visible[r0, c0 + width] and inside[r0, c0 + width],
                    "one hidden": block.sum() == block.size - 1 and not block[0, -1] and inside[r0, c0 + width - 1],
                }
            else:
                beyond = (r0, r0 + height, c0 - 1, c0) if keys_loop else (r0 + height, r0 + height + 1, c0, c0 + width)
                corner = block[0, 0] if keys_loop else block[-1, -1]
                fits = {
                    "overhang": block.sum() == 1 and block[0, -1],
                    "full": block.all() and not visible[r0 + height - 1, c0 - 1] and inside[r0 + height - 1, c0 - 1],
                    "one hidden": block.sum() == block.size - 1 and not block[-1, 0] and inside[r0 + height - 1, c0],
                }
            next_rows, next_keys = slice(*beyond[:2]), slice(*beyond[2:])
            fits["flush"] = corner and inside[next_rows, next_keys].any() and not visible[next_rows, next_keys].any()
            if fits[item.fit]:
                return True
    return False


@pytest.mark.parametrize("backend", BACKENDS)
def test_placements_put_each_edge_where_they_say(backend: str) -> None:
    """tests/tiles.py's placements, checked against a brute-force visibility matrix: the cases above really put
    each edge on or one past a boundary of the tiles they name."""
    wrong = [
        str(item)
        for probe in PROBES
        for tile in _tiles(backend, probe)
        for edge in ("upper", "lower")
        for item in placements(tile, edge)  # type: ignore[arg-type]
        if not _shows(item)
    ]
    assert not wrong, f"placements that do not show on {backend}'s tiles: {wrong}"
