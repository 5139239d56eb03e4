"""Kernels that run the Triton kernels' dropout helpers (attnkit.backends.triton.kernels) alone, for
tests/test_dropout.py: the generator at a given counter, and a tile's keep-mask as the attention kernels take it."""

from __future__ import annotations

import triton
import triton.language as tl
from attnkit.backends.triton import kernels


@triton.jit
def philox_words(Out, Counter, Seed):
    """Out (4,) int32: the words of kernels._philox at the counter Counter (4,) int32 (bits read unsigned) and the
    int64 seed Seed."""
    c0 = tl.load(Counter).to(tl.uint32, bitcast=True)
    c1 = tl.load(Counter + 1).to(tl.uint32, bitcast=True)
    c2 = tl.load(Counter + 2).to(tl.uint32, bitcast=True)
    c3 = tl.load(Counter + 3).to(tl.uint32, bitcast=True)
    w0, w1, w2, w3 = kernels._philox(tl.load(Seed), c0, c1, c2, c3)
    tl.store(Out, w0.to(tl.int32, bitcast=True))
    tl.store(Out + 1, w1.to(tl.int32, bitcast=True))
    tl.store(Out + 2, w2.to(tl.int32, bitcast=True))
    tl.store(Out + 3, w3.to(tl.int32, bitcast=True))


@triton.jit
def keep_tile(Out, batch, head, Seed, threshold, scale, offsets, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Out (BLOCK_M, BLOCK_N) int8, contiguous: kernels._dropout_keep of batch row ``batch``, query head ``head``,
    rows 0..BLOCK_M and keys 0..BLOCK_N, from the arguments launch.dropout_arguments gives (``scale`` unread)."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dropout = kernels._dropout_state(Seed, threshold, offsets, True)
    keep = kernels._dropout_keep(dropout, batch, head, rows, cols)
    tl.store(Out + rows[:, None] * BLOCK_N + cols[None, :], keep.to(tl.int8))
