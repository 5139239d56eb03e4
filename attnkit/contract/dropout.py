"""§18's keep-mask in torch: Philox4x32-10 in int64 tensor arithmetic, for the torch backends' tiles (and under
torch.compile, where the seed is a tensor of the graph). Products of 32-bit words are formed in 16-bit halves so
that nothing exceeds 2⁶³; :mod:`attnkit.contract.philox` is the reference it is held against."""

from __future__ import annotations

import torch

from attnkit.backend import Dropout
from attnkit.contract.philox import MULTIPLIERS, ROUNDS, WEYL

_WORD = 0xFFFFFFFF


def seed_words(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) 32-bit words of a 0-d int64 seed whose bits are read unsigned, as int64 tensors."""
    return seed & _WORD, (seed >> 32) & _WORD


def _mulhilo(multiplier: int, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) words of multiplier · word: word · (multiplier's 16-bit halves), each below 2⁴⁸."""
    upper = word * (multiplier >> 16)
    lower = word * (multiplier & 0xFFFF)
    return (upper + (lower >> 16)) >> 16, (((upper & 0xFFFF) << 16) + lower) & _WORD


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], key: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four output words (int64 tensors holding 32-bit values) for broadcastable counter words and key words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_ in range(ROUNDS):
        if round_:
            k0, k1 = (k0 + WEYL[0]) & _WORD, (k1 + WEYL[1]) & _WORD
        hi0, lo0 = _mulhilo(MULTIPLIERS[0], c0)
        hi1, lo1 = _mulhilo(MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def keep_tile(
    dropout: Dropout,
    batch: torch.Tensor,
    heads: torch.Tensor,
    rows: torch.Tensor,
    key_start: int,
    key_stop: int,
) -> torch.Tensor:
    """Bool keep-mask of keys ``key_start..key_stop`` for the given batch rows, query heads and query rows (int64
    tensors broadcastable to (B, H, Lq, 1)), shape (..., Lq, keys). The indices are §18's, into the unsharded call:
    the caller has added the :class:`Dropout`'s offsets."""
    first, last = key_start >> 2, (key_stop + 3) >> 2
    columns = torch.arange(first, last, dtype=torch.int64, device=rows.device)
    words = philox4x32((columns, rows, heads, batch), seed_words(dropout.seed.to(rows.device)))
    # Counter column c holds keys 4c .. 4c + 3, word by word.
    stacked = torch.stack(torch.broadcast_tensors(*words), dim=-1).flatten(-2)
    keys = stacked[..., key_start - 4 * first : key_stop - 4 * first]
    return keys >= dropout.threshold


def keep_mask(dropout: Dropout, batch: int, heads: int, len_q: int, len_k: int, device: torch.device) -> torch.Tensor:
    """The whole (batch, heads, len_q, len_k) keep-mask of a call (from its offsets, :class:`Dropout`)."""
    b = torch.arange(batch, dtype=torch.int64, device=device).view(-1, 1, 1, 1)
    h = (torch.arange(heads, dtype=torch.int64, device=device) + dropout.head_start).view(1, -1, 1, 1)
    i = (torch.arange(len_q, dtype=torch.int64, device=device) + dropout.query_start).view(1, 1, -1, 1)
    return keep_tile(dropout, b, h, i, int(dropout.key_start), int(dropout.key_start) + len_k)
