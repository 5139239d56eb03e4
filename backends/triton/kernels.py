"""FlashAttention-2 forward and backward as Triton kernels: the math only.

The launch code is in ``launch.py`` (tile configurations, the interpreter) and, shared with the CUDA C kernels,
``attnkit.contract.kernels`` (arguments, strides, grids, the band). Every kernel works
on one (batch, head) and one tile of rows or keys; tensors arrive as bhsd strides, so bshd and non-contiguous
inputs need no copy. Feature switches are ``tl.constexpr``: a call without a feature compiles without its code.

Visibility (docs/semantics.md §4) is one band on ``rel = j − i − off_b``: ``LOWER ≤ rel ≤ UPPER``, where the
window's left side gives ``LOWER = −left`` and causal and the window's right side give ``UPPER = min(0, right)``;
``off_b`` is the per-batch bottom-right offset ``kv_len_b − q_len_b`` (0 for top-left). Rows ``i ≥ q_len_b`` and
keys ``j ≥ kv_len_b`` are padding: never loaded, never visible. The band also gives the loop bounds, so tiles it
hides entirely are never loaded or multiplied.

ALiBi (``HAS_ALIBI``, §16) adds ``−slope[b, h] · |i + off_b − j|`` to every score, after the softcap, beside the
bias: computed in ``_score_tile`` from the positions of the tile in the call and the same ``off_b``, one float32
slope per (batch, query head); the backward recomputes the same scores, and the slopes take no gradient.

Segment ids (``HAS_SEGMENT_IDS``, §4.5) add ``q_id[i] == kv_id[j] ≥ 0``. A position with a negative id is padding,
never loaded (its row is read as 0). A tile's ids lie in [low, high], read from the granule ranges of
``attnkit.contract.kernels.segment_ranges``; a (query tile, key tile) pair whose ranges do not overlap shares no id
and is skipped inside the band's loop, before any of its operands is loaded.

A paged KV cache (``PAGED``, §13) changes only where the forward finds a key: key j of batch row b is slot
``j % block_size`` of block ``block_table[b, j // block_size]`` (``_key_places``), the cache's block stride in the
batch stride's place; any block size works, smaller or larger than BLOCK_N, and table entries past kv_len_b are never
read. Split-K (``SPLIT_K``, flash-decoding) runs one of ``splits`` ranges of a query tile's key tiles per program
and writes that range's out and lse to float32 partials, which ``attnkit.contract.kernels.merge_splits`` combines.

Dropout (``HAS_DROPOUT``, §18) drops entries of P where it meets V, and the gradient reaching P through them: the
forward and both backward passes regenerate a tile's keep-mask from the seed (``_dropout_keep``), nothing is saved.
l sums P undropped, so lse is the softmax's; 1 / (1 − p) scales out and dV once, dP per tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnkit.contract.programs import EMPTY, FULL, PARTIAL


@triton.jit
def _dot(a, b, INTERPRETER_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b with float32 accumulation.

    INTERPRETER_BF16 is set only by launch.py when the Triton *interpreter* runs bfloat16 operands: its CPU dot returns
    garbage for them (Triton 3.9). The values are already bfloat16-rounded, so the float32 dot computes the same
    products; compiled GPU kernels never set it and keep bfloat16 tensor-core dots.
    """
    if INTERPRETER_BF16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _rounded(x, DTYPE: tl.constexpr, INTERPRETER_BF16: tl.constexpr):
    """A float32 tile in DTYPE, rounded to nearest even as the GPU's conversion does. Triton 3.9's interpreter
    truncates to bfloat16 (whatever fp_downcast_rounding says): under it, round the bits (add half an ulp of the
    16 bits dropped, ties to even; NaN keeps its truncation, which stays NaN)."""
    if INTERPRETER_BF16 and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = tl.where(x != x, bits, bits + 0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _epilogue_rows(row_start, BLOCK_M: tl.constexpr, COMPILED: tl.constexpr):
    """row_start + 0..BLOCK_M for the stores after the key loop, computed there. Compiled, row_start passes through
    an opaque move first: otherwise the rows are the q load's, held across the loop, and at 128 × 128 tiles on sm_90
    ptxas spills them (48 B) rather than recompute them. The interpreter has no inline assembly and no registers."""
    if COMPILED:
        row_start = tl.inline_asm_elementwise("mov.u32 $0, $1;", "=r,r", [row_start], tl.int32, is_pure=False, pack=1)
    return row_start + tl.arange(0, BLOCK_M)


@triton.jit
def _tanh(x):
    # 1 − 2/(exp(2x) + 1): exact limits ±1 for large |x| (exp overflows to inf, or underflows to 0). Near 0 it cancels
    # (an absolute error of an ulp of 1, so c · tanh(U/c) of a large softcap c is off by c · 6e-8): there, its Taylor
    # series to x¹¹, whose first omitted term is below 1e-9 relative for |x| < 1/4.
    x2 = x * x
    series = x * (
        1.0 + x2 * (-1.0 / 3 + x2 * (2.0 / 15 + x2 * (-17.0 / 315 + x2 * (62.0 / 2835 + x2 * (-1382.0 / 155925)))))
    )
    return tl.where(x2 < 0.0625, series, 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def _inverse_norms(x, COSINE: tl.constexpr):
    """1 / max(‖x‖₂, 1e-12) per row in float32, as torch.nn.functional.normalize; 1.0 without the cosine variant.

    The cosine variant never rounds q̂ = q/‖q‖ to the input dtype: the dot takes the raw q and k (tensor cores,
    exact products) and the score tile is scaled by both inverse norms in float32.
    """
    if COSINE:
        squares = x.to(tl.float32) * x.to(tl.float32)
        return 1.0 / tl.maximum(tl.sqrt(tl.sum(squares, 1)), 1e-12)
    else:
        return 1.0


@triton.jit
def _batch_geometry(
    QLengths,
    KvLengths,
    batch,
    len_q,
    len_k,
    HAS_Q_LENGTHS: tl.constexpr,
    HAS_KV_LENGTHS: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
):
    """(q_len_b, kv_len_b, off_b) for one batch element."""
    q_len = len_q
    kv_len = len_k
    if HAS_Q_LENGTHS:
        q_len = tl.load(QLengths + batch)
    if HAS_KV_LENGTHS:
        kv_len = tl.load(KvLengths + batch)
    offset = 0
    if BOTTOM_RIGHT:
        offset = kv_len - q_len
    return q_len, kv_len, offset


@triton.jit
def _alibi_slope(AlibiSlopes, batch64, head, stride_alibi_b, HAS_ALIBI: tl.constexpr):
    """ALiBi's slope of one (batch, query head), from the float32 (B|1, Hq) slopes (batch stride 0 for one row);
    0.0, unread, without ALiBi."""
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(AlibiSlopes + batch64 * stride_alibi_b + head)
    return slope


@triton.jit
def _positions_in_use(Ids, batch64, positions, limit, length, HAS_SEGMENT_IDS: tl.constexpr):
    """(live, ids) of one batch element's positions (query rows or keys): live where below ``limit`` (its length)
    and not padding; ids their segment ids, −1 past the sequence (without segment ids: the positions, unused)."""
    live = positions < limit
    ids = positions
    if HAS_SEGMENT_IDS:
        ids = tl.load(Ids + batch64 * length + positions, mask=positions < length, other=-1)
        live = live & (ids >= 0)
    return live, ids


@triton.jit
def _segment_range(Ranges, batch64, start, length, BLOCK: tl.constexpr, GRANULE: tl.constexpr):
    """(low, high): the least and greatest non-negative segment id of positions start..start+BLOCK of one batch
    element, from its granule ranges (B, ⌈length / GRANULE⌉, 2); low > high when all are padding."""
    tl.static_assert(BLOCK % GRANULE == 0, "a tile is a whole number of granules")
    granules = (length + GRANULE - 1) // GRANULE
    base = Ranges + batch64 * granules * 2
    first = start // GRANULE
    low = tl.load(base + 2 * first)
    high = tl.load(base + 2 * first + 1)
    for step in tl.static_range(1, BLOCK // GRANULE):
        granule = tl.minimum(first + step, granules - 1)  # past the sequence: its last granule, in this tile too
        low = tl.minimum(low, tl.load(base + 2 * granule))
        high = tl.maximum(high, tl.load(base + 2 * granule + 1))
    return low, high


#: The tile classes of a mask program (attnkit.contract.programs): nothing visible, some pairs, every pair.
_EMPTY_TILE = tl.constexpr(EMPTY)
_PARTIAL_TILE = tl.constexpr(PARTIAL)
_FULL_TILE = tl.constexpr(FULL)


@triton.jit
def _tile_class(
    TileClasses,
    batch,
    head,
    row_start,
    key_start,
    class_strides,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_PROGRAM: tl.constexpr,
):
    """The mask program's class of the (query tile, key tile) pair at row_start, key_start of one (batch, query
    head), from the uint8 (B|1, Hq|1, query tiles, key tiles) classes and their strides (0 on an axis of size 1);
    full without a program."""
    tile_class = _FULL_TILE
    if HAS_PROGRAM:
        place = batch * class_strides[0] + head * class_strides[1]
        place += (row_start // BLOCK_M) * class_strides[2] + (key_start // BLOCK_N) * class_strides[3]
        tile_class = tl.load(TileClasses + place).to(tl.int32)
    return tile_class


@triton.jit
def _key_span(
    row_start,
    q_len,
    kv_len,
    offset,
    lower,
    upper,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
):
    """[first, end) of the key tiles rows row_start..row_start+BLOCK_M may see; first is tile-aligned."""
    last_row = tl.minimum(row_start + BLOCK_M, q_len) - 1
    first = 0
    end = tl.where(row_start < q_len, kv_len, 0)
    if HAS_LOWER:
        first = tl.maximum(row_start + offset + lower, 0)
    if HAS_UPPER:
        end = tl.minimum(end, last_row + offset + upper + 1)
    return first // BLOCK_N * BLOCK_N, end


@triton.jit
def _query_span(
    key_start,
    q_len,
    kv_len,
    offset,
    lower,
    upper,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
):
    """[first, end) of the query tiles that may see keys key_start..key_start+BLOCK_N; first is tile-aligned."""
    last_key = tl.minimum(key_start + BLOCK_N, kv_len) - 1
    first = 0
    end = tl.where(key_start < kv_len, q_len, 0)
    if HAS_UPPER:
        first = tl.maximum(key_start - offset - upper, 0)
    if HAS_LOWER:
        end = tl.minimum(end, last_key - offset - lower + 1)
    return first // BLOCK_M * BLOCK_M, end


@triton.jit
def _key_places(BlockTable, batch64, cols, live_cols, block_size, max_blocks, PAGED: tl.constexpr):
    """(outer, inner) of keys ``cols`` of one batch element: key j lies at outer · stride_b + inner · stride_n
    from its head's base. Contiguous: (b, j). Paged: (block_table[b, j // block_size], j % block_size), stride_b
    being the cache's block stride; the table is read only for live keys."""
    if PAGED:
        blocks = tl.load(BlockTable + batch64 * max_blocks + cols // block_size, mask=live_cols, other=0)
        return blocks.to(tl.int64), cols % block_size
    else:
        return batch64, cols


@triton.jit
def _descriptor_tile(Tiles, batch64, head, start, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """The (ROWS, COLUMNS) tile at sequence position ``start`` of one (batch, head) of a (B, H, L, D) tensor
    descriptor (TMA on Hopper): zeros past L and past D, never the next head's rows."""
    return tl.reshape(Tiles.load([batch64.to(tl.int32), head, start, 0]), [ROWS, COLUMNS])


@triton.jit
def _longest_first(program, tiles, REVERSED: tl.constexpr):
    """The tile a program takes: GPUs start programs in launch order, so the tiles with the most work go first and
    the last wave holds the shortest ones. Under a causal upper bound the last query tiles see the most keys (the
    forward and dQ reverse), under a lower bound alone the last key tiles are seen by the most queries (dK/dV)."""
    if REVERSED:
        return tiles - 1 - program
    else:
        return program


@triton.jit
def _split_range(first, end, split, splits, BLOCK_N: tl.constexpr):
    """Split-K: the ``split``-th of ``splits`` runs of whole key tiles covering [first, end), first tile-aligned;
    empty (first ≥ end) for the ranges past a short span."""
    tiles_per_split = tl.cdiv(tl.cdiv(end - first, BLOCK_N), splits)
    start = first + split * tiles_per_split * BLOCK_N
    return start, tl.minimum(end, start + tiles_per_split * BLOCK_N)


@triton.jit
def _dropout_state(Seed, threshold, offsets, HAS_DROPOUT: tl.constexpr):
    """What _dropout_keep reads of a call's dropout: (seed, threshold, head_start, query_start, key_start), the int64
    seed loaded from its tensor, the threshold's 32 bits (passed as an int32) as uint32, the offsets of §18's indices;
    without dropout, ``offsets`` (None), never read."""
    if HAS_DROPOUT:
        head_start, query_start, key_start = offsets
        return tl.load(Seed), tl.cast(threshold, tl.uint32, bitcast=True), head_start, query_start, key_start
    else:
        return offsets


@triton.jit
def _philox(seed, c0, c1, c2, c3):
    """Philox4x32-10 (Random123's philox4x32) of uint32 counter words with key (seed mod 2³², seed >> 32): Triton's
    tl.philox is exactly it for 32-bit counters (its key grows after the tenth round as well, which changes no output
    word), held to Random123's known answers by tests/test_dropout.py."""
    return tl.philox(seed, c0, c1, c2, c3)


@triton.jit
def _dropout_keep(dropout, batch, head, rows, cols):
    """§18's keep-mask of one tile, bool (rows, cols): (b, h, i, j) is kept where word j & 3 of Philox4x32-10 at
    counter (j >> 2, i, h, b) is at least the threshold, compared unsigned. ``dropout``: _dropout_state's; ``head``,
    ``rows``, ``cols``: the call's query head, query rows and keys, whose offsets in the unsharded call are added here
    (batch row b is the call's own). Each key computes its counter's four words and keeps one."""
    seed, threshold, head_start, query_start, key_start = dropout
    i = (rows + query_start).to(tl.uint32)[:, None]  # counter words wrap at 2³², as uint32 (and int64 offsets) do
    j = (cols + key_start).to(tl.uint32)[None, :]
    zero = i * 0 + j * 0  # every counter word as a whole tile
    h = tl.cast(head + head_start, tl.uint32)  # a cast, not .to: a scalar here may be a constexpr (an int of 1)
    words = _philox(seed, (j >> 2) + zero, i + zero, h + zero, tl.cast(batch, tl.uint32) + zero)
    lane = j & 3
    word = tl.where(lane == 0, words[0], tl.where(lane == 1, words[1], tl.where(lane == 2, words[2], words[3])))
    return word >= threshold  # both uint32: an unsigned compare


@triton.jit
def _score_tile(
    q,
    k,
    q_inv_norm,
    k_inv_norm,
    rows,
    cols,
    q_ids,
    kv_ids,
    q_len,
    kv_len,
    offset,
    lower,
    upper,
    BiasTile,
    stride_bias_m,
    stride_bias_n,
    MaskTile,
    stride_mask_m,
    stride_mask_n,
    qk_scale,
    softcap,
    alibi_slope,
    batch,
    head,
    tile_class,
    Captured,
    captured_layout,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COSINE: tl.constexpr,
    HAS_SEGMENT_IDS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_PROGRAM: tl.constexpr,
    MASK_PROGRAM: tl.constexpr,
    INTERPRETER_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EDGE: tl.constexpr = True,
    FOLD_SCALE: tl.constexpr = False,
):
    """S for one (BLOCK_M, BLOCK_N) tile, −inf where hidden, and tanh(U / c) for the softcap derivative.

    U = scale · q̂ k̂ᵀ (q̂ = q, or q/‖q‖ for the cosine variant);  S = c · tanh(U / c) if softcapped, else U;
    S += bias;  S −= slope · |i + off_b − j| (ALiBi, from the tile's positions in the call).  ``qk_scale`` is
    scale / c when softcapped, so the product is already the tanh argument.
    EDGE: the tile may hold hidden pairs (bounds, band, mask, ids); an interior tile (EDGE false) is all visible and
    pays for no mask. FOLD_SCALE: without softcap and bias, leave U unscaled (q̂ k̂ᵀ, ALiBi's term divided by the
    scale) for the caller to fold the scale into the exponent's FMA.
    """
    scores = _dot(q, tl.trans(k), INTERPRETER_BF16, DOT_PRECISION)
    if COSINE:
        scores = scores * q_inv_norm[:, None] * k_inv_norm[None, :]
    folded = FOLD_SCALE and not HAS_SOFTCAP and not HAS_BIAS
    if not folded:
        scores = scores * qk_scale
    tanh_u = scores
    if HAS_SOFTCAP:
        tanh_u = _tanh(scores)
        scores = softcap * tanh_u
    if EDGE:
        inside = (rows[:, None] < q_len) & (cols[None, :] < kv_len)
        if HAS_BIAS:
            bias = tl.load(
                BiasTile + rows[:, None] * stride_bias_m + cols[None, :] * stride_bias_n, mask=inside, other=0.0
            )
            scores += bias.to(tl.float32)
        visible = inside
        if HAS_LOWER:
            visible = visible & (cols[None, :] - rows[:, None] - offset >= lower)
        if HAS_UPPER:
            visible = visible & (cols[None, :] - rows[:, None] - offset <= upper)
        if HAS_MASK:
            allowed = tl.load(
                MaskTile + rows[:, None] * stride_mask_m + cols[None, :] * stride_mask_n, mask=inside, other=0
            )
            visible = visible & (allowed != 0)
        if HAS_SEGMENT_IDS:
            visible = visible & (q_ids[:, None] == kv_ids[None, :]) & (q_ids[:, None] >= 0)
        if HAS_PROGRAM:  # evaluated on a partial tile only: on a full one it shows every pair
            if tile_class == _PARTIAL_TILE:
                visible = visible & MASK_PROGRAM(batch, head, rows, cols, Captured, captured_layout)
        scores = tl.where(visible, scores, float("-inf"))
    elif HAS_BIAS:
        scores += tl.load(BiasTile + rows[:, None] * stride_bias_m + cols[None, :] * stride_bias_n).to(tl.float32)
    if HAS_ALIBI:  # hidden pairs stay −inf; positions below 2^24 and their differences are exact in float32
        distance = tl.abs((rows + offset).to(tl.float32)[:, None] - cols.to(tl.float32)[None, :])
        if folded:  # U unscaled: the term in its units, −(slope / scale) · distance, scaled with U by the caller
            alibi_slope = alibi_slope / qk_scale
        scores -= alibi_slope * distance
    return scores, tanh_u


@triton.jit
def _tile_run(first, end, least_start, last_start, BLOCK: tl.constexpr):
    """[low, high) of the tiles first, first + BLOCK, … below end whose start lies in [least_start, last_start]."""
    low = tl.minimum(first + tl.cdiv(tl.maximum(least_start - first, 0), BLOCK) * BLOCK, end)
    reach = last_start - first  # ≥ 0 before any division: // of a negative int truncates
    high = tl.where(reach >= 0, first + (tl.maximum(reach, 0) // BLOCK + 1) * BLOCK, first)
    return low, tl.minimum(tl.maximum(high, low), end)


@triton.jit
def _interior_keys(
    first,
    end,
    row_start,
    q_len,
    kv_len,
    offset,
    lower,
    upper,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
):
    """[low, high) of the key tiles in [first, end) (first tile-aligned) whose every pair with rows row_start..
    row_start+BLOCK_M is visible: whole rows and keys inside the lengths, and the whole tile inside the band
    (rel = j − i − offset: its least is key_start − last row, its greatest last key − row_start). Empty (low = high
    = end) when the query tile has padding rows."""
    last_start = kv_len - BLOCK_N  # the greatest key_start whose tile lies inside kv_len
    least_start = first
    if HAS_UPPER:
        last_start = tl.minimum(last_start, row_start + offset + upper - BLOCK_N + 1)
    if HAS_LOWER:
        least_start = tl.maximum(least_start, row_start + BLOCK_M - 1 + offset + lower)
    low, high = _tile_run(first, end, least_start, last_start, BLOCK_N)
    full_rows = row_start + BLOCK_M <= q_len
    return tl.where(full_rows, low, end), tl.where(full_rows, high, end)


@triton.jit
def _interior_queries(
    first,
    end,
    key_start,
    q_len,
    kv_len,
    offset,
    lower,
    upper,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
):
    """_interior_keys seen from a key tile: [low, high) of the query tiles in [first, end) whose every pair with keys
    key_start..key_start+BLOCK_N is visible. Empty (low = high = end) when the key tile has padding keys."""
    last_start = q_len - BLOCK_M
    least_start = first
    if HAS_UPPER:
        least_start = tl.maximum(least_start, key_start + BLOCK_N - 1 - offset - upper)
    if HAS_LOWER:
        last_start = tl.minimum(last_start, key_start - BLOCK_M + 1 - offset - lower)
    low, high = _tile_run(first, end, least_start, last_start, BLOCK_M)
    full_keys = key_start + BLOCK_N <= kv_len
    return tl.where(full_keys, low, end), tl.where(full_keys, high, end)


@triton.jit
def _score_fold(qk_scale, HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr):
    """What turns _score_tile(FOLD_SCALE=True)'s tile into log₂ units: the scale with log₂e, or log₂e alone when
    softcap or bias made the tile natural units already (the scale is > 0, so max(S)·fold = max(S·fold))."""
    fold = 1.4426950408889634  # log₂e
    if not HAS_SOFTCAP and not HAS_BIAS:
        fold = qk_scale * 1.4426950408889634
    return fold


@triton.jit
def _load_tile(places, live, dims, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EDGE: tl.constexpr):
    """A (positions, BLOCK_D) tile of q, k, v or dO: masked to the live positions and the head dim on an edge tile;
    on an interior one every position is live, and a head dim as wide as its padding needs no mask at all."""
    if EDGE:
        return tl.load(places, mask=live[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    elif BLOCK_D == HEAD_DIM:
        return tl.load(places)
    else:
        return tl.load(places, mask=dims[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _fwd_tile(
    acc,
    row_max,
    row_sum,
    q,
    q_inv_norm,
    rows,
    q_ids,
    key_start,
    KHead,
    VHead,
    KTiles,
    VTiles,
    head_kv,
    KvSegmentIds,
    BlockTable,
    batch64,
    stride_kb,
    stride_kn,
    stride_vb,
    stride_vn,
    len_k,
    q_len,
    kv_len,
    offset,
    lower,
    upper,
    block_size,
    max_blocks,
    BiasTile,
    stride_bias_m,
    stride_bias_n,
    MaskTile,
    stride_mask_m,
    stride_mask_n,
    qk_scale,
    softcap,
    alibi_slope,
    fold,
    batch,
    head,
    tile_class,
    Captured,
    captured_layout,
    dropout,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COSINE: tl.constexpr,
    HAS_SEGMENT_IDS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_PROGRAM: tl.constexpr,
    MASK_PROGRAM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    PAGED: tl.constexpr,
    INTERPRETER_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EDGE: tl.constexpr,
    TMA: tl.constexpr,
):
    """One key tile of the online softmax, in base 2 (``fold`` turns the score tile into log₂-units, row_max is in
    them):  m' = max(m, rowmax S₂);  α = 2^(m − m');  P = 2^(S₂ − m');  l' = α·l + rowsum P;  acc' = α·acc + (P ⊙ M) V,
    M dropout's keep-mask (_dropout_keep; all ones without): l sums P undropped, so lse stays the softmax's.
    An edge tile may leave a row with no visible key yet (m' = −inf): its shift is taken as 0 so that P and α are
    2^−inf = 0, never NaN; an interior tile makes every m' finite and needs no such select. TMA: K and V come
    through the descriptors KTiles, VTiles (kv head ``head_kv``), not the pointers."""
    cols = key_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    live_cols, kv_ids = _positions_in_use(KvSegmentIds, batch64, cols, kv_len, len_k, HAS_SEGMENT_IDS)
    if TMA:  # tensor descriptors (TMA on Hopper): keys past Lk and the head dim's tail come in as zeros
        k = _descriptor_tile(KTiles, batch64, head_kv, key_start, BLOCK_N, BLOCK_D)
        v = _descriptor_tile(VTiles, batch64, head_kv, key_start, BLOCK_N, BLOCK_DV)
    else:
        outer, inner = _key_places(BlockTable, batch64, cols, live_cols, block_size, max_blocks, PAGED)
        k = _load_tile(KHead + (outer * stride_kb + inner * stride_kn)[:, None] + dims[None, :], live_cols, dims,
                       HEAD_DIM, BLOCK_D, EDGE)  # fmt: skip
        v = _load_tile(VHead + (outer * stride_vb + inner * stride_vn)[:, None] + dims_v[None, :], live_cols,
                       dims_v, HEAD_DIM_V, BLOCK_DV, EDGE)  # fmt: skip
    k_inv_norm = _inverse_norms(k, COSINE)
    scores, _ = _score_tile(
        q,
        k,
        q_inv_norm,
        k_inv_norm,
        rows,
        cols,
        q_ids,
        kv_ids,
        q_len,
        kv_len,
        offset,
        lower,
        upper,
        BiasTile,
        stride_bias_m,
        stride_bias_n,
        MaskTile,
        stride_mask_m,
        stride_mask_n,
        qk_scale,
        softcap,
        alibi_slope,
        batch,
        head,
        tile_class,
        Captured,
        captured_layout,
        HAS_LOWER,
        HAS_UPPER,
        HAS_MASK,
        HAS_BIAS,
        HAS_SOFTCAP,
        COSINE,
        HAS_SEGMENT_IDS,
        HAS_ALIBI,
        HAS_PROGRAM,
        MASK_PROGRAM,
        INTERPRETER_BF16,
        DOT_PRECISION,
        EDGE,
        True,
    )
    new_max = tl.maximum(row_max, tl.max(scores, 1) * fold)  # fold > 0: the max of the folded scores
    shift = new_max
    if EDGE:
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    p = tl.math.exp2(tl.fma(scores, fold, -shift[:, None]))
    alpha = tl.math.exp2(row_max - shift)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        p = tl.where(_dropout_keep(dropout, batch, head, rows, cols), p, 0.0)
    acc = acc * alpha[:, None] + _dot(_rounded(p, v.dtype, INTERPRETER_BF16), v, INTERPRETER_BF16, DOT_PRECISION)
    return acc, new_max, row_sum


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    Bias,
    Mask,
    QLengths,
    KvLengths,
    QSegmentIds,
    KvSegmentIds,
    QSegmentRanges,
    KvSegmentRanges,
    AlibiSlopes,
    BlockTable,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    stride_os,
    stride_ls,
    stride_bias_b,
    stride_bias_h,
    stride_bias_m,
    stride_bias_n,
    stride_mask_b,
    stride_mask_h,
    stride_mask_m,
    stride_mask_n,
    stride_alibi_b,
    heads_q,
    group,
    len_q,
    len_k,
    qk_scale,
    softcap,
    lower,
    upper,
    block_size,
    max_blocks,
    splits,
    KTiles,
    VTiles,
    TileClasses,
    class_strides,
    Captured,
    captured_layout,
    Seed,
    dropout_threshold,
    dropout_scale,
    dropout_offsets,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COSINE: tl.constexpr,
    HAS_Q_LENGTHS: tl.constexpr,
    HAS_KV_LENGTHS: tl.constexpr,
    HAS_SEGMENT_IDS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    PAGED: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SEGMENT_GRANULE: tl.constexpr,
    INTERPRETER_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    COMPILED: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    HAS_PROGRAM: tl.constexpr,
    MASK_PROGRAM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
):
    """One query tile of one (batch, query head): out and lse, or with SPLIT_K one key range's partial out and lse
    (Out and Lse offset by split · stride_os, stride_ls). Grid (query tiles × splits, Hq, B), split-major. With TMA
    the key tiles come through the descriptors KTiles, VTiles (B, Hkv, Lk, D), whose zero fill past Lk stands for
    the load masks; K, V and their strides are used otherwise.

    WARP_SPECIALIZE (``launch.warp_specialization_serves``: every tile interior) hands the key loop to Triton's
    Hopper warp specialisation: a producer warpgroup issues the K/V copies, two consumer warpgroups of BLOCK_M / 2
    rows each run the products and the softmax. Its pass splits every tile the loop's state depends on between the
    consumers, which it can do for q only when q comes through a descriptor made here (not a pointer load, not a
    host descriptor of BLOCK_M rows), and it handles one loop only: the edge loops are compiled out."""
    tl.static_assert(not (TMA and (PAGED or HAS_KV_LENGTHS or HAS_SEGMENT_IDS)), "descriptors mask only past Lk")
    tl.static_assert(
        not WARP_SPECIALIZE
        or (TMA and not (HAS_LOWER or HAS_UPPER or HAS_MASK or HAS_Q_LENGTHS or SPLIT_K or HAS_PROGRAM)),
        "warp specialisation runs only where every tile is interior",
    )
    tile = tl.program_id(0)
    split = 0
    query_tiles = tl.cdiv(len_q, BLOCK_M)
    if SPLIT_K:
        split = tile // query_tiles
        tile = tile % query_tiles
    row_start = _longest_first(tile, query_tiles, HAS_UPPER) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    head_kv = head // group
    q_len, kv_len, offset = _batch_geometry(
        QLengths, KvLengths, batch, len_q, len_k, HAS_Q_LENGTHS, HAS_KV_LENGTHS, BOTTOM_RIGHT
    )
    rows = row_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    batch64 = batch.to(tl.int64)
    live_rows, q_ids = _positions_in_use(QSegmentIds, batch64, rows, q_len, len_q, HAS_SEGMENT_IDS)
    if WARP_SPECIALIZE:  # rows past Lq and the head dim's tail come in as zeros, as the mask's
        QTiles = tl.make_tensor_descriptor(
            Q + batch64 * stride_qb + head * stride_qh, [len_q, HEAD_DIM], [stride_qm, 1], [BLOCK_M, BLOCK_D]
        )
        q = QTiles.load([row_start, 0])
    else:
        q = tl.load(
            Q + batch64 * stride_qb + head * stride_qh + rows[:, None] * stride_qm + dims[None, :],
            mask=live_rows[:, None] & (dims[None, :] < HEAD_DIM),
            other=0.0,
        )
    q_inv_norm = _inverse_norms(q, COSINE)
    KHead = K + head_kv * stride_kh
    VHead = V + head_kv * stride_vh
    BiasTile = Bias + batch64 * stride_bias_b + head * stride_bias_h
    MaskTile = Mask + batch64 * stride_mask_b + head * stride_mask_h
    alibi_slope = _alibi_slope(AlibiSlopes, batch64, head, stride_alibi_b, HAS_ALIBI)

    first, end = _key_span(row_start, q_len, kv_len, offset, lower, upper, BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER)
    if SPLIT_K:
        first, end = _split_range(first, end, split, splits, BLOCK_N)
    if HAS_SEGMENT_IDS:
        q_low, q_high = _segment_range(QSegmentRanges, batch64, row_start, len_q, BLOCK_M, SEGMENT_GRANULE)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Online softmax over the key tiles (FlashAttention-2) in base 2, the scale folded into the exponent's FMA (S₂ =
    # log₂e · S; _fwd_tile); once at the end: out = acc / l (times 1 / (1 − p) with dropout), lse = ln 2 · (m + log₂ l).
    # The interior tiles, every pair visible, run first and without masks; then the edge tiles (bounds, the band's
    # diagonal), masked. With a mask or segment ids any tile may hide pairs: all are edge tiles.
    fold = _score_fold(qk_scale, HAS_SOFTCAP, HAS_BIAS)
    dropout = _dropout_state(Seed, dropout_threshold, dropout_offsets, HAS_DROPOUT)
    interior_low = end
    interior_high = end
    if not (HAS_MASK or HAS_SEGMENT_IDS or HAS_PROGRAM):
        interior_low, interior_high = _interior_keys(
            first, end, row_start, q_len, kv_len, offset, lower, upper, BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER
        )
        for key_start in tl.range(interior_low, interior_high, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            acc, row_max, row_sum = _fwd_tile(
                acc, row_max, row_sum, q, q_inv_norm, rows, q_ids, key_start, KHead, VHead, KTiles, VTiles, head_kv,
                KvSegmentIds, BlockTable, batch64, stride_kb, stride_kn, stride_vb, stride_vn, len_k, q_len, kv_len,
                offset, lower, upper, block_size, max_blocks, BiasTile, stride_bias_m, stride_bias_n, MaskTile,
                stride_mask_m, stride_mask_n, qk_scale, softcap, alibi_slope, fold, batch, head, _FULL_TILE, Captured,
                captured_layout, dropout, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LOWER,
                HAS_UPPER, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, COSINE, HAS_SEGMENT_IDS, HAS_ALIBI, HAS_PROGRAM,
                MASK_PROGRAM, HAS_DROPOUT, PAGED, INTERPRETER_BF16, DOT_PRECISION, False, TMA,
            )  # fmt: skip
    # The edge tiles: [first, interior_low), then [interior_high, end) where interior tiles split them: two affine
    # loops (one loop over a remapped index left ptxas at 128 registers and spilling kilobytes with every feature on).
    # WARP_SPECIALIZE: no edge tile, and Triton's pass takes one loop only: these ranges are empty and fold away.
    for key_start in range(first, first if WARP_SPECIALIZE else interior_low, BLOCK_N):
        meets = True
        if HAS_SEGMENT_IDS:  # a key tile sharing no segment id with the query tile is skipped
            k_low, k_high = _segment_range(KvSegmentRanges, batch64, key_start, len_k, BLOCK_N, SEGMENT_GRANULE)
            meets = (q_low <= k_high) & (k_low <= q_high)
        tile_class = _tile_class(
            TileClasses, batch, head, row_start, key_start, class_strides, BLOCK_M, BLOCK_N, HAS_PROGRAM
        )
        if HAS_PROGRAM:  # a key tile the program hides from every row is skipped
            meets = meets & (tile_class != _EMPTY_TILE)
        if meets:
            acc, row_max, row_sum = _fwd_tile(
                acc, row_max, row_sum, q, q_inv_norm, rows, q_ids, key_start, KHead, VHead, KTiles, VTiles, head_kv,
                KvSegmentIds, BlockTable, batch64, stride_kb, stride_kn, stride_vb, stride_vn, len_k, q_len, kv_len,
                offset, lower, upper, block_size, max_blocks, BiasTile, stride_bias_m, stride_bias_n, MaskTile,
                stride_mask_m, stride_mask_n, qk_scale, softcap, alibi_slope, fold, batch, head, tile_class, Captured,
                captured_layout, dropout, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LOWER,
                HAS_UPPER, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, COSINE, HAS_SEGMENT_IDS, HAS_ALIBI, HAS_PROGRAM,
                MASK_PROGRAM, HAS_DROPOUT, PAGED, INTERPRETER_BF16, DOT_PRECISION, True, TMA,
            )  # fmt: skip
    if not (HAS_MASK or HAS_SEGMENT_IDS or HAS_PROGRAM) and not WARP_SPECIALIZE:
        for key_start in range(interior_high, end, BLOCK_N):
            acc, row_max, row_sum = _fwd_tile(
                acc, row_max, row_sum, q, q_inv_norm, rows, q_ids, key_start, KHead, VHead, KTiles, VTiles, head_kv,
                KvSegmentIds, BlockTable, batch64, stride_kb, stride_kn, stride_vb, stride_vn, len_k, q_len, kv_len,
                offset, lower, upper, block_size, max_blocks, BiasTile, stride_bias_m, stride_bias_n, MaskTile,
                stride_mask_m, stride_mask_n, qk_scale, softcap, alibi_slope, fold, batch, head, _FULL_TILE, Captured,
                captured_layout, dropout, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LOWER,
                HAS_UPPER, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, COSINE, HAS_SEGMENT_IDS, HAS_ALIBI, HAS_PROGRAM,
                MASK_PROGRAM, HAS_DROPOUT, PAGED, INTERPRETER_BF16, DOT_PRECISION, True, TMA,
            )  # fmt: skip

    # Empty means no weight at all: a NaN score is skipped by the max (fmax) yet makes the sum NaN, and must
    # give NaN out and lse, never the empty row's 0 and −inf.
    empty = row_sum == 0.0
    safe_sum = tl.where(empty, 1.0, row_sum)
    out = tl.where(empty[:, None], 0.0, acc / safe_sum[:, None])
    if HAS_DROPOUT:
        out = out * dropout_scale
    lse = tl.where(empty, float("-inf"), (row_max + tl.math.log2(safe_sum)) * 0.6931471805599453)  # ln 2
    rows = _epilogue_rows(row_start, BLOCK_M, COMPILED)
    tl.store(
        Out + split * stride_os + batch64 * stride_ob + head * stride_oh + rows[:, None] * stride_om + dims_v[None, :],
        _rounded(out, Out.dtype.element_ty, INTERPRETER_BF16),
        mask=(rows[:, None] < len_q) & (dims_v[None, :] < HEAD_DIM_V),
    )
    tl.store(Lse + split * stride_ls + (batch64 * heads_q + head) * len_q + rows, lse, mask=rows < len_q)


@triton.jit
def _merge_splits_kernel(
    PartialOut,
    PartialLse,
    Out,
    Lse,
    stride_split_out,
    stride_split_lse,
    stride_ob,
    stride_oh,
    stride_om,
    heads_q,
    len_q,
    splits,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    INTERPRETER_BF16: tl.constexpr,
):
    """Split-K's combine in one launch, one program per (batch, query head, query row): of the float32 partials
    out_s (S, B, Hq, Lq, Dv) and lse_s (S, B, Hq, Lq), contiguous,

        lse = m + log Σ_s 2^… = m + log Σ_s exp(lse_s − m);  out = Σ_s exp(lse_s − m) · out_s / Σ_s exp(lse_s − m)

    with m the largest lse_s. A range with no visible key (lse_s = −inf, out_s = 0) weighs exactly 0, so a row empty
    in every range gets out 0 and lse −inf; a NaN in any range stays NaN (as contract.kernels.merge_splits)."""
    row = tl.program_id(0).to(tl.int64)
    ranges = tl.arange(0, BLOCK_S)
    dims_v = tl.arange(0, BLOCK_DV)
    lse_s = tl.load(PartialLse + ranges * stride_split_lse + row, mask=ranges < splits, other=float("-inf"))
    shift = tl.max(lse_s, 0)
    shift = tl.where(shift == float("-inf"), 0.0, shift)
    weights = tl.where(lse_s == float("-inf"), 0.0, tl.exp(lse_s - shift))
    total = tl.sum(weights, 0)
    inside = (ranges[:, None] < splits) & (dims_v[None, :] < HEAD_DIM_V)
    partial = tl.load(
        PartialOut + ranges[:, None] * stride_split_out + row * HEAD_DIM_V + dims_v[None, :], mask=inside, other=0.0
    )
    out = tl.sum(weights[:, None] * partial, 0) / tl.where(total == 0.0, 1.0, total)
    query = row % len_q
    head = (row // len_q) % heads_q
    batch = row // (len_q * heads_q)
    tl.store(
        Out + batch * stride_ob + head * stride_oh + query * stride_om + dims_v,
        _rounded(out, Out.dtype.element_ty, INTERPRETER_BF16),
        mask=dims_v < HEAD_DIM_V,
    )
    tl.store(Lse + row, tl.where(total == 0.0, float("-inf"), shift + tl.log(total)))


@triton.jit
def _bwd_delta_kernel(
    Out,
    DOut,
    DLse,
    Delta,
    stride_ob,
    stride_oh,
    stride_om,
    stride_dob,
    stride_doh,
    stride_dom,
    heads_q,
    len_q,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    """Δ = rowsum(dO ⊙ O) − dlse for one row tile of one (batch, query head). Grid (row tiles, Hq, B)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    batch64 = tl.program_id(2).to(tl.int64)
    dims_v = tl.arange(0, BLOCK_DV)
    inside = (rows[:, None] < len_q) & (dims_v[None, :] < HEAD_DIM_V)
    out = tl.load(
        Out + batch64 * stride_ob + head * stride_oh + rows[:, None] * stride_om + dims_v[None, :],
        mask=inside,
        other=0.0,
    )
    dout = tl.load(
        DOut + batch64 * stride_dob + head * stride_doh + rows[:, None] * stride_dom + dims_v[None, :],
        mask=inside,
        other=0.0,
    )
    delta = tl.sum(out.to(tl.float32) * dout.to(tl.float32), 1)
    row_index = (batch64 * heads_q + head) * len_q + rows
    if HAS_DLSE:
        delta -= tl.load(DLse + row_index, mask=rows < len_q, other=0.0)
    tl.store(Delta + row_index, delta, mask=rows < len_q)


@triton.jit
def _dq_tile(
    dq,
    q,
    q_inv_norm,
    dout,
    lse2,
    delta,
    rows,
    q_ids,
    key_start,
    KTile,
    VTile,
    KTiles,
    VTiles,
    head_kv,
    KvSegmentIds,
    batch64,
    stride_kn,
    stride_vn,
    len_k,
    q_len,
    kv_len,
    offset,
    lower,
    upper,
    BiasTile,
    stride_bias_m,
    stride_bias_n,
    MaskTile,
    stride_mask_m,
    stride_mask_n,
    qk_scale,
    softcap,
    alibi_slope,
    fold,
    batch,
    head,
    tile_class,
    Captured,
    captured_layout,
    dropout,
    dropout_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COSINE: tl.constexpr,
    HAS_SEGMENT_IDS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_PROGRAM: tl.constexpr,
    MASK_PROGRAM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    INTERPRETER_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EDGE: tl.constexpr,
    TMA: tl.constexpr,
):
    """One key tile of dq, in base 2 (lse2 = log₂e · lse):
    P = 2^(S₂ − lse2);  dP = dO Vᵀ (⊙ M / (1 − p) with dropout's keep-mask M);  dS = P ⊙ (dP − Δ);
    dU = dS ⊙ (1 − tanh²(U/c)) if softcapped;  dq += dU K."""
    cols = key_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    live_cols, kv_ids = _positions_in_use(KvSegmentIds, batch64, cols, kv_len, len_k, HAS_SEGMENT_IDS)
    if TMA:  # as the forward's
        k = _descriptor_tile(KTiles, batch64, head_kv, key_start, BLOCK_N, BLOCK_D)
        v = _descriptor_tile(VTiles, batch64, head_kv, key_start, BLOCK_N, BLOCK_DV)
    else:
        k = _load_tile(KTile + cols[:, None] * stride_kn + dims[None, :], live_cols, dims, HEAD_DIM, BLOCK_D, EDGE)
        v = _load_tile(VTile + cols[:, None] * stride_vn + dims_v[None, :], live_cols, dims_v, HEAD_DIM_V, BLOCK_DV,
                       EDGE)  # fmt: skip
    k_inv_norm = _inverse_norms(k, COSINE)
    scores, tanh_u = _score_tile(
        q, k, q_inv_norm, k_inv_norm, rows, cols, q_ids, kv_ids, q_len, kv_len, offset, lower, upper, BiasTile,
        stride_bias_m, stride_bias_n, MaskTile, stride_mask_m, stride_mask_n, qk_scale, softcap, alibi_slope, batch,
        head, tile_class, Captured, captured_layout, HAS_LOWER, HAS_UPPER, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, COSINE,
        HAS_SEGMENT_IDS, HAS_ALIBI, HAS_PROGRAM, MASK_PROGRAM, INTERPRETER_BF16, DOT_PRECISION, EDGE, True,
    )  # fmt: skip
    p = tl.math.exp2(tl.fma(scores, fold, -lse2[:, None]))
    dp = _dot(dout, tl.trans(v), INTERPRETER_BF16, DOT_PRECISION)
    if HAS_DROPOUT:
        dp = tl.where(_dropout_keep(dropout, batch, head, rows, cols), dp * dropout_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - tanh_u * tanh_u)
    if COSINE:  # dq̂ = scale · dU k̂ = scale · (dU / ‖k‖) k
        ds = ds * k_inv_norm[None, :]
    return dq + _dot(_rounded(ds, k.dtype, INTERPRETER_BF16), k, INTERPRETER_BF16, DOT_PRECISION)


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DQ,
    Bias,
    Mask,
    QLengths,
    KvLengths,
    QSegmentIds,
    KvSegmentIds,
    QSegmentRanges,
    KvSegmentRanges,
    AlibiSlopes,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_bias_b,
    stride_bias_h,
    stride_bias_m,
    stride_bias_n,
    stride_mask_b,
    stride_mask_h,
    stride_mask_m,
    stride_mask_n,
    stride_alibi_b,
    heads_q,
    group,
    len_q,
    len_k,
    qk_scale,
    softcap,
    grad_scale,
    lower,
    upper,
    KTiles,
    VTiles,
    TileClasses,
    class_strides,
    Captured,
    captured_layout,
    Seed,
    dropout_threshold,
    dropout_scale,
    dropout_offsets,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COSINE: tl.constexpr,
    HAS_Q_LENGTHS: tl.constexpr,
    HAS_KV_LENGTHS: tl.constexpr,
    HAS_SEGMENT_IDS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    SEGMENT_GRANULE: tl.constexpr,
    INTERPRETER_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    HAS_PROGRAM: tl.constexpr,
    MASK_PROGRAM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
):
    """dq for one query tile of one (batch, query head), over the key tiles it sees. Grid (query tiles, Hq, B).
    With TMA the key tiles come through the descriptors KTiles, VTiles, as in the forward. WARP_SPECIALIZE as the
    forward's: q, dO, lse and Δ, which the pass splits between the consumers, through descriptors made here."""
    tl.static_assert(not (TMA and (HAS_KV_LENGTHS or HAS_SEGMENT_IDS)), "descriptors mask only past Lk")
    tl.static_assert(
        not WARP_SPECIALIZE or (TMA and not (HAS_LOWER or HAS_UPPER or HAS_MASK or HAS_Q_LENGTHS or HAS_PROGRAM)),
        "warp specialisation runs only where every tile is interior",
    )
    row_start = _longest_first(tl.program_id(0), tl.cdiv(len_q, BLOCK_M), HAS_UPPER) * BLOCK_M
    head = tl.program_id(1)
    batch = tl.program_id(2)
    head_kv = head // group
    q_len, kv_len, offset = _batch_geometry(
        QLengths, KvLengths, batch, len_q, len_k, HAS_Q_LENGTHS, HAS_KV_LENGTHS, BOTTOM_RIGHT
    )
    rows = row_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    batch64 = batch.to(tl.int64)
    live_rows, q_ids = _positions_in_use(QSegmentIds, batch64, rows, q_len, len_q, HAS_SEGMENT_IDS)
    row_base = (batch64 * heads_q + head) * len_q
    if WARP_SPECIALIZE:  # every row and key in play: the descriptors' zero fill past D is the masks' only work
        q = tl.make_tensor_descriptor(
            Q + batch64 * stride_qb + head * stride_qh, [len_q, HEAD_DIM], [stride_qm, 1], [BLOCK_M, BLOCK_D]
        ).load([row_start, 0])
        dout = tl.make_tensor_descriptor(
            DOut + batch64 * stride_dob + head * stride_doh, [len_q, HEAD_DIM_V], [stride_dom, 1], [BLOCK_M, BLOCK_DV]
        ).load([row_start, 0])
        lse = tl.make_tensor_descriptor(Lse + row_base, [len_q], [1], [BLOCK_M]).load([row_start])
        delta = tl.make_tensor_descriptor(Delta + row_base, [len_q], [1], [BLOCK_M]).load([row_start])
    else:
        q = tl.load(
            Q + batch64 * stride_qb + head * stride_qh + rows[:, None] * stride_qm + dims[None, :],
            mask=live_rows[:, None] & (dims[None, :] < HEAD_DIM),
            other=0.0,
        )
        dout = tl.load(
            DOut + batch64 * stride_dob + head * stride_doh + rows[:, None] * stride_dom + dims_v[None, :],
            mask=live_rows[:, None] & (dims_v[None, :] < HEAD_DIM_V),
            other=0.0,
        )
        lse = tl.load(Lse + row_base + rows, mask=live_rows, other=float("-inf"))
        delta = tl.load(Delta + row_base + rows, mask=live_rows, other=0.0)
    q_inv_norm = _inverse_norms(q, COSINE)
    # An empty row (lse = −inf) is shifted by +inf, so every P of it is exactly 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    KTile = K + batch64 * stride_kb + head_kv * stride_kh
    VTile = V + batch64 * stride_vb + head_kv * stride_vh
    BiasTile = Bias + batch64 * stride_bias_b + head * stride_bias_h
    MaskTile = Mask + batch64 * stride_mask_b + head * stride_mask_h
    alibi_slope = _alibi_slope(AlibiSlopes, batch64, head, stride_alibi_b, HAS_ALIBI)

    first, end = _key_span(row_start, q_len, kv_len, offset, lower, upper, BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER)
    if HAS_SEGMENT_IDS:
        q_low, q_high = _segment_range(QSegmentRanges, batch64, row_start, len_q, BLOCK_M, SEGMENT_GRANULE)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    fold = _score_fold(qk_scale, HAS_SOFTCAP, HAS_BIAS)
    dropout = _dropout_state(Seed, dropout_threshold, dropout_offsets, HAS_DROPOUT)
    # As the forward: the interior key tiles unmasked, then the edge tiles (_dq_tile).
    interior_low = end
    interior_high = end
    if not (HAS_MASK or HAS_SEGMENT_IDS or HAS_PROGRAM):
        interior_low, interior_high = _interior_keys(
            first, end, row_start, q_len, kv_len, offset, lower, upper, BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER
        )
        for key_start in tl.range(interior_low, interior_high, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            dq = _dq_tile(
                dq, q, q_inv_norm, dout, lse2, delta, rows, q_ids, key_start, KTile, VTile, KTiles, VTiles, head_kv,
                KvSegmentIds, batch64, stride_kn, stride_vn, len_k, q_len, kv_len, offset, lower, upper, BiasTile,
                stride_bias_m, stride_bias_n, MaskTile, stride_mask_m, stride_mask_n, qk_scale, softcap, alibi_slope,
                fold, batch, head, _FULL_TILE, Captured, captured_layout, dropout, dropout_scale, HEAD_DIM, HEAD_DIM_V,
                BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LOWER, HAS_UPPER, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, COSINE,
                HAS_SEGMENT_IDS, HAS_ALIBI, HAS_PROGRAM, MASK_PROGRAM, HAS_DROPOUT, INTERPRETER_BF16, DOT_PRECISION,
                False, TMA,
            )  # fmt: skip
    for key_start in range(first, first if WARP_SPECIALIZE else interior_low, BLOCK_N):  # as the forward's
        meets = True
        if HAS_SEGMENT_IDS:  # a key tile sharing no segment id with the query tile is skipped
            k_low, k_high = _segment_range(KvSegmentRanges, batch64, key_start, len_k, BLOCK_N, SEGMENT_GRANULE)
            meets = (q_low <= k_high) & (k_low <= q_high)
        tile_class = _tile_class(
            TileClasses, batch, head, row_start, key_start, class_strides, BLOCK_M, BLOCK_N, HAS_PROGRAM
        )
        if HAS_PROGRAM:  # a key tile the program hides from every row is skipped
            meets = meets & (tile_class != _EMPTY_TILE)
        if meets:
            dq = _dq_tile(
                dq, q, q_inv_norm, dout, lse2, delta, rows, q_ids, key_start, KTile, VTile, KTiles, VTiles, head_kv,
                KvSegmentIds, batch64, stride_kn, stride_vn, len_k, q_len, kv_len, offset, lower, upper, BiasTile,
                stride_bias_m, stride_bias_n, MaskTile, stride_mask_m, stride_mask_n, qk_scale, softcap, alibi_slope,
                fold, batch, head, tile_class, Captured, captured_layout, dropout, dropout_scale, HEAD_DIM, HEAD_DIM_V,
                BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LOWER, HAS_UPPER, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, COSINE,
                HAS_SEGMENT_IDS, HAS_ALIBI, HAS_PROGRAM, MASK_PROGRAM, HAS_DROPOUT, INTERPRETER_BF16, DOT_PRECISION,
                True, TMA,
            )  # fmt: skip
    if not (HAS_MASK or HAS_SEGMENT_IDS or HAS_PROGRAM) and not WARP_SPECIALIZE:
        for key_start in range(interior_high, end, BLOCK_N):
            dq = _dq_tile(
                dq, q, q_inv_norm, dout, lse2, delta, rows, q_ids, key_start, KTile, VTile, KTiles, VTiles, head_kv,
                KvSegmentIds, batch64, stride_kn, stride_vn, len_k, q_len, kv_len, offset, lower, upper, BiasTile,
                stride_bias_m, stride_bias_n, MaskTile, stride_mask_m, stride_mask_n, qk_scale, softcap, alibi_slope,
                fold, batch, head, _FULL_TILE, Captured, captured_layout, dropout, dropout_scale, HEAD_DIM, HEAD_DIM_V,
                BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LOWER, HAS_UPPER, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, COSINE,
                HAS_SEGMENT_IDS, HAS_ALIBI, HAS_PROGRAM, MASK_PROGRAM, HAS_DROPOUT, INTERPRETER_BF16, DOT_PRECISION,
                True, TMA,
            )  # fmt: skip
    dq = dq * grad_scale
    tl.store(
        DQ + batch64 * stride_dqb + head * stride_dqh + rows[:, None] * stride_dqm + dims[None, :],
        _rounded(dq, DQ.dtype.element_ty, INTERPRETER_BF16),
        mask=(rows[:, None] < len_q) & (dims[None, :] < HEAD_DIM),
    )


@triton.jit
def _dkdv_tile(
    dk,
    dv,
    k,
    v,
    k_inv_norm,
    cols,
    kv_ids,
    row_start,
    QHead,
    DOutHead,
    QTiles,
    DOutTiles,
    head,
    Lse,
    Delta,
    DBias,
    row_base,
    DQHead,
    QSegmentIds,
    batch64,
    stride_qm,
    stride_dom,
    stride_dqm,
    len_q,
    len_k,
    q_len,
    kv_len,
    offset,
    lower,
    upper,
    BiasTile,
    stride_bias_m,
    stride_bias_n,
    MaskTile,
    stride_mask_m,
    stride_mask_n,
    qk_scale,
    softcap,
    alibi_slope,
    fold,
    batch,
    tile_class,
    Captured,
    captured_layout,
    dropout,
    dropout_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COSINE: tl.constexpr,
    HAS_DBIAS: tl.constexpr,
    HAS_SEGMENT_IDS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_PROGRAM: tl.constexpr,
    MASK_PROGRAM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    INTERPRETER_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    EDGE: tl.constexpr,
    TMA: tl.constexpr,
):
    """One query tile of dk and dv, in base 2 (lse2 = log₂e · lse), M dropout's keep-mask (all ones without):
    P = 2^(S₂ − lse2);  dV += (P ⊙ M)ᵀ dO (times 1 / (1 − p) once, at the end);  dP = dO Vᵀ ⊙ M / (1 − p);
    dS = P ⊙ (dP − Δ);  dbias = dS;
    dU = dS ⊙ (1 − tanh²(U/c)) if softcapped;  dK += dUᵀ q;  with ATOMIC_DQ, dq_sum += dU K (atomically)."""
    rows = row_start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    live_rows, q_ids = _positions_in_use(QSegmentIds, batch64, rows, q_len, len_q, HAS_SEGMENT_IDS)
    if TMA:  # rows past Lq and the head dim's tail come in as zeros
        q = _descriptor_tile(QTiles, batch64, head, row_start, BLOCK_M, BLOCK_D)
        dout = _descriptor_tile(DOutTiles, batch64, head, row_start, BLOCK_M, BLOCK_DV)
    else:
        q = _load_tile(QHead + rows[:, None] * stride_qm + dims[None, :], live_rows, dims, HEAD_DIM, BLOCK_D, EDGE)
        dout = _load_tile(DOutHead + rows[:, None] * stride_dom + dims_v[None, :], live_rows, dims_v, HEAD_DIM_V,
                          BLOCK_DV, EDGE)  # fmt: skip
    q_inv_norm = _inverse_norms(q, COSINE)
    if EDGE:
        lse = tl.load(Lse + row_base + rows, mask=live_rows, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # an empty row: P = 0
        delta = tl.load(Delta + row_base + rows, mask=live_rows, other=0.0)
    else:  # every row sees every key here: none is empty
        lse2 = tl.load(Lse + row_base + rows) * 1.4426950408889634
        delta = tl.load(Delta + row_base + rows)
    scores, tanh_u = _score_tile(
        q, k, q_inv_norm, k_inv_norm, rows, cols, q_ids, kv_ids, q_len, kv_len, offset, lower, upper, BiasTile,
        stride_bias_m, stride_bias_n, MaskTile, stride_mask_m, stride_mask_n, qk_scale, softcap, alibi_slope, batch,
        head, tile_class, Captured, captured_layout, HAS_LOWER, HAS_UPPER, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, COSINE,
        HAS_SEGMENT_IDS, HAS_ALIBI, HAS_PROGRAM, MASK_PROGRAM, INTERPRETER_BF16, DOT_PRECISION, EDGE, True,
    )  # fmt: skip
    p = tl.math.exp2(tl.fma(scores, fold, -lse2[:, None]))
    kept = p
    if HAS_DROPOUT:
        keep = _dropout_keep(dropout, batch, head, rows, cols)
        kept = tl.where(keep, p, 0.0)
    dv += _dot(tl.trans(_rounded(kept, dout.dtype, INTERPRETER_BF16)), dout, INTERPRETER_BF16, DOT_PRECISION)
    dp = _dot(dout, tl.trans(v), INTERPRETER_BF16, DOT_PRECISION)
    if HAS_DROPOUT:
        dp = tl.where(keep, dp * dropout_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if HAS_DBIAS:
        dbias_places = DBias + row_base * len_k + rows[:, None] * len_k + cols[None, :]
        if EDGE:
            tl.store(dbias_places, ds, mask=live_rows[:, None] & (cols[None, :] < kv_len))
        else:
            tl.store(dbias_places, ds)
    if HAS_SOFTCAP:
        ds = ds * (1.0 - tanh_u * tanh_u)
    if ATOMIC_DQ:
        ds_q = ds
        if COSINE:  # dq̂ = scale · dU k̂ = scale · (dU / ‖k‖) k
            ds_q = ds * k_inv_norm[None, :]
        dq = _dot(_rounded(ds_q, k.dtype, INTERPRETER_BF16), k, INTERPRETER_BF16, DOT_PRECISION)
        dq_places = DQHead + rows[:, None] * stride_dqm + dims[None, :]
        if EDGE:
            tl.atomic_add(dq_places, dq, mask=live_rows[:, None] & (dims[None, :] < HEAD_DIM), sem="relaxed")
        elif BLOCK_D == HEAD_DIM:
            tl.atomic_add(dq_places, dq, sem="relaxed")
        else:
            tl.atomic_add(dq_places, dq, mask=dims[None, :] < HEAD_DIM, sem="relaxed")
    if COSINE:  # dk̂ = scale · dUᵀ q̂ = scale · (dU / ‖q‖)ᵀ q
        ds = ds * q_inv_norm[:, None]
    dk += _dot(tl.trans(_rounded(ds, q.dtype, INTERPRETER_BF16)), q, INTERPRETER_BF16, DOT_PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DK,
    DV,
    DBias,
    Bias,
    Mask,
    QLengths,
    KvLengths,
    QSegmentIds,
    KvSegmentIds,
    QSegmentRanges,
    KvSegmentRanges,
    AlibiSlopes,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_bias_b,
    stride_bias_h,
    stride_bias_m,
    stride_bias_n,
    stride_mask_b,
    stride_mask_h,
    stride_mask_m,
    stride_mask_n,
    stride_alibi_b,
    heads_q,
    group,
    len_q,
    len_k,
    qk_scale,
    softcap,
    grad_scale,
    lower,
    upper,
    DQSum,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    QTiles,
    DOutTiles,
    TileClasses,
    class_strides,
    Captured,
    captured_layout,
    Seed,
    dropout_threshold,
    dropout_scale,
    dropout_offsets,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    HAS_UPPER: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COSINE: tl.constexpr,
    HAS_DBIAS: tl.constexpr,
    HAS_Q_LENGTHS: tl.constexpr,
    HAS_KV_LENGTHS: tl.constexpr,
    HAS_SEGMENT_IDS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    SEGMENT_GRANULE: tl.constexpr,
    INTERPRETER_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    TMA: tl.constexpr,
    HAS_PROGRAM: tl.constexpr,
    MASK_PROGRAM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
):
    """dk, dv (and dS into the full-shape dbias) for one key tile of one (batch, kv head); with ATOMIC_DQ also each
    tile's dS K, added into the float32 dq sum DQSum (the one-pass backward: no dQ kernel recomputing S and dP).

    Grid (key tiles, Hkv, B). The G query heads sharing the kv head are summed here, so dk and dv need no atomics;
    the dq sum's order of additions varies between runs (launch.one_pass_backward says when it is used). With TMA
    the query tiles of q and dO come through the descriptors QTiles, DOutTiles (B, Hq, Lq, D).
    """
    tl.static_assert(not (TMA and (HAS_Q_LENGTHS or HAS_SEGMENT_IDS)), "descriptors mask only past Lq")
    key_start = _longest_first(tl.program_id(0), tl.cdiv(len_k, BLOCK_N), HAS_LOWER and not HAS_UPPER) * BLOCK_N
    head_kv = tl.program_id(1)
    batch = tl.program_id(2)
    q_len, kv_len, offset = _batch_geometry(
        QLengths, KvLengths, batch, len_q, len_k, HAS_Q_LENGTHS, HAS_KV_LENGTHS, BOTTOM_RIGHT
    )
    cols = key_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    batch64 = batch.to(tl.int64)
    live_cols, kv_ids = _positions_in_use(KvSegmentIds, batch64, cols, kv_len, len_k, HAS_SEGMENT_IDS)
    k = tl.load(
        K + batch64 * stride_kb + head_kv * stride_kh + cols[:, None] * stride_kn + dims[None, :],
        mask=live_cols[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    k_inv_norm = _inverse_norms(k, COSINE)
    v = tl.load(
        V + batch64 * stride_vb + head_kv * stride_vh + cols[:, None] * stride_vn + dims_v[None, :],
        mask=live_cols[:, None] & (dims_v[None, :] < HEAD_DIM_V),
        other=0.0,
    )

    first, end = _query_span(key_start, q_len, kv_len, offset, lower, upper, BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER)
    if HAS_SEGMENT_IDS:
        k_low, k_high = _segment_range(KvSegmentRanges, batch64, key_start, len_k, BLOCK_N, SEGMENT_GRANULE)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    fold = _score_fold(qk_scale, HAS_SOFTCAP, HAS_BIAS)
    dropout = _dropout_state(Seed, dropout_threshold, dropout_offsets, HAS_DROPOUT)
    interior_low = end
    interior_high = end
    if not (HAS_MASK or HAS_SEGMENT_IDS or HAS_PROGRAM):
        interior_low, interior_high = _interior_queries(
            first, end, key_start, q_len, kv_len, offset, lower, upper, BLOCK_M, BLOCK_N, HAS_LOWER, HAS_UPPER
        )
    # Over the G query heads of this kv head and the query tiles that see this key tile (_dkdv_tile): the edge
    # tiles before the interior ones, the interior ones unmasked, the edge tiles after.
    for head in range(head_kv * group, head_kv * group + group):
        BiasTile = Bias + batch64 * stride_bias_b + head * stride_bias_h
        MaskTile = Mask + batch64 * stride_mask_b + head * stride_mask_h
        alibi_slope = _alibi_slope(AlibiSlopes, batch64, head, stride_alibi_b, HAS_ALIBI)
        QHead = Q + batch64 * stride_qb + head * stride_qh
        DOutHead = DOut + batch64 * stride_dob + head * stride_doh
        DQHead = DQSum + batch64 * stride_dqb + head * stride_dqh
        row_base = (batch64 * heads_q + head) * len_q
        for row_start in range(first, interior_low, BLOCK_M):
            meets = True
            if HAS_SEGMENT_IDS:  # a query tile sharing no segment id with the key tile is skipped
                q_low, q_high = _segment_range(QSegmentRanges, batch64, row_start, len_q, BLOCK_M, SEGMENT_GRANULE)
                meets = (q_low <= k_high) & (k_low <= q_high)
            tile_class = _tile_class(
                TileClasses, batch, head, row_start, key_start, class_strides, BLOCK_M, BLOCK_N, HAS_PROGRAM
            )
            if HAS_PROGRAM:  # a query tile the program hides from every key is skipped
                meets = meets & (tile_class != _EMPTY_TILE)
            if meets:
                dk, dv = _dkdv_tile(
                    dk, dv, k, v, k_inv_norm, cols, kv_ids, row_start, QHead, DOutHead, QTiles, DOutTiles, head, Lse,
                    Delta, DBias, row_base, DQHead, QSegmentIds, batch64, stride_qm, stride_dom, stride_dqm, len_q,
                    len_k, q_len, kv_len, offset, lower, upper, BiasTile, stride_bias_m, stride_bias_n, MaskTile,
                    stride_mask_m, stride_mask_n, qk_scale, softcap, alibi_slope, fold, batch, tile_class, Captured,
                    captured_layout, dropout, dropout_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                    HAS_LOWER, HAS_UPPER, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, COSINE, HAS_DBIAS, HAS_SEGMENT_IDS,
                    HAS_ALIBI, HAS_PROGRAM, MASK_PROGRAM, HAS_DROPOUT, INTERPRETER_BF16, DOT_PRECISION, ATOMIC_DQ, True,
                    TMA,
                )  # fmt: skip
        if not (HAS_MASK or HAS_SEGMENT_IDS or HAS_PROGRAM):
            for row_start in range(interior_low, interior_high, BLOCK_M):
                dk, dv = _dkdv_tile(
                    dk, dv, k, v, k_inv_norm, cols, kv_ids, row_start, QHead, DOutHead, QTiles, DOutTiles, head, Lse,
                    Delta, DBias, row_base, DQHead, QSegmentIds, batch64, stride_qm, stride_dom, stride_dqm, len_q,
                    len_k, q_len, kv_len, offset, lower, upper, BiasTile, stride_bias_m, stride_bias_n, MaskTile,
                    stride_mask_m, stride_mask_n, qk_scale, softcap, alibi_slope, fold, batch, _FULL_TILE, Captured,
                    captured_layout, dropout, dropout_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                    HAS_LOWER, HAS_UPPER, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, COSINE, HAS_DBIAS, HAS_SEGMENT_IDS,
                    HAS_ALIBI, HAS_PROGRAM, MASK_PROGRAM, HAS_DROPOUT, INTERPRETER_BF16, DOT_PRECISION, ATOMIC_DQ,
                    False, TMA,
                )  # fmt: skip
        if not (HAS_MASK or HAS_SEGMENT_IDS or HAS_PROGRAM):
            for row_start in range(interior_high, end, BLOCK_M):
                dk, dv = _dkdv_tile(
                    dk, dv, k, v, k_inv_norm, cols, kv_ids, row_start, QHead, DOutHead, QTiles, DOutTiles, head, Lse,
                    Delta, DBias, row_base, DQHead, QSegmentIds, batch64, stride_qm, stride_dom, stride_dqm, len_q,
                    len_k, q_len, kv_len, offset, lower, upper, BiasTile, stride_bias_m, stride_bias_n, MaskTile,
                    stride_mask_m, stride_mask_n, qk_scale, softcap, alibi_slope, fold, batch, _FULL_TILE, Captured,
                    captured_layout, dropout, dropout_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                    HAS_LOWER, HAS_UPPER, HAS_MASK, HAS_BIAS, HAS_SOFTCAP, COSINE, HAS_DBIAS, HAS_SEGMENT_IDS,
                    HAS_ALIBI, HAS_PROGRAM, MASK_PROGRAM, HAS_DROPOUT, INTERPRETER_BF16, DOT_PRECISION, ATOMIC_DQ, True,
                    TMA,
                )  # fmt: skip
    dk = dk * grad_scale
    if HAS_DROPOUT:
        dv = dv * dropout_scale
    in_keys = cols[:, None] < len_k
    tl.store(
        DK + batch64 * stride_dkb + head_kv * stride_dkh + cols[:, None] * stride_dkn + dims[None, :],
        _rounded(dk, DK.dtype.element_ty, INTERPRETER_BF16),
        mask=in_keys & (dims[None, :] < HEAD_DIM),
    )
    tl.store(
        DV + batch64 * stride_dvb + head_kv * stride_dvh + cols[:, None] * stride_dvn + dims_v[None, :],
        _rounded(dv, DV.dtype.element_ty, INTERPRETER_BF16),
        mask=in_keys & (dims_v[None, :] < HEAD_DIM_V),
    )
