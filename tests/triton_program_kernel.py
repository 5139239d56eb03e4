"""A kernel that runs a generated mask-program helper (attnkit.backends.triton.programs) over one tile and stores it,
for tests/test_triton_programs.py: the helper as the attention kernels call it, without their attention."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def program_tile(
    Out,
    b,
    h,
    len_q,
    len_k,
    Captured,
    layout,
    MASK_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Out (len_q, len_k) int8, contiguous: the program at (b, h) on rows 0..BLOCK_M and keys 0..BLOCK_N (lanes past
    the lengths are evaluated, as on an edge tile, and not stored)."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    visible = (rows[:, None] >= 0) & (cols[None, :] >= 0)
    visible = visible & MASK_PROGRAM(b, h, rows, cols, Captured, layout)
    inside = (rows[:, None] < len_q) & (cols[None, :] < len_k)
    tl.store(Out + rows[:, None] * len_k + cols[None, :], visible.to(tl.int8), mask=inside)
