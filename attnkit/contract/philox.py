"""The reference implementation of §18's keep-mask: Philox4x32-10 (Random123's ``philox4x32``) in NumPy, written as
Random123 writes it, with 64-bit products. The oracle, :func:`attnkit.dropout_keep_mask` and the tests read it; the
backends' own implementations (torch, JAX, C++, Triton, CUDA C) are held against it bit for bit.

One round: (hi0, lo0) = mulhilo(0xD2511F53, c0), (hi1, lo1) = mulhilo(0xCD9E8D57, c2),
c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0); between rounds the key grows by (0x9E3779B9, 0xBB67AE85).
"""

from __future__ import annotations

import numpy as np

MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
WEYL = (0x9E3779B9, 0xBB67AE85)
ROUNDS = 10
_WORD = np.uint64(0xFFFFFFFF)

#: Random123's known answers for philox4x32 with 10 rounds (kat_vectors): (counter, key) -> output, 32-bit words.
KNOWN_ANSWERS: tuple[tuple[tuple[int, int, int, int], tuple[int, int], tuple[int, int, int, int]], ...] = (
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
)


def philox4x32(counter: tuple[np.ndarray, ...], key: tuple[int, int], rounds: int = ROUNDS) -> tuple[np.ndarray, ...]:
    """The four output words for counters given as four arrays of 32-bit values (broadcast together), key (k0, k1)."""
    c0, c1, c2, c3 = (np.asarray(word, dtype=np.uint64) & _WORD for word in counter)
    k0, k1 = np.uint64(key[0] & 0xFFFFFFFF), np.uint64(key[1] & 0xFFFFFFFF)
    for round_ in range(rounds):
        if round_:
            k0, k1 = (k0 + np.uint64(WEYL[0])) & _WORD, (k1 + np.uint64(WEYL[1])) & _WORD
        product0 = np.uint64(MULTIPLIERS[0]) * c0
        product1 = np.uint64(MULTIPLIERS[1]) * c2
        c0, c1, c2, c3 = (
            (product1 >> np.uint64(32)) ^ c1 ^ k0,
            product1 & _WORD,
            (product0 >> np.uint64(32)) ^ c3 ^ k1,
            product0 & _WORD,
        )
    return c0, c1, c2, c3


def keep_mask(seed: int, p: float, batch: int, heads: int, len_q: int, len_k: int) -> np.ndarray:
    """§18's keep-mask, bool (batch, heads, len_q, len_k): element (b, h, i, j) is kept where word j & 3 of
    philox4x32((j >> 2, i, h, b), (seed mod 2³², seed >> 32)) is at least round(p · 2³²)."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed={seed} (expected an integer in [0, 2**64))")
    threshold = round(p * 4294967296.0)
    b = np.arange(batch).reshape(-1, 1, 1, 1)
    h = np.arange(heads).reshape(1, -1, 1, 1)
    i = np.arange(len_q).reshape(1, 1, -1, 1)
    column = np.arange((len_k + 3) // 4).reshape(1, 1, 1, -1)
    words = philox4x32((column, i, h, b), (seed & 0xFFFFFFFF, seed >> 32))
    # (B, H, Lq, ceil(Lk / 4), 4) -> (B, H, Lq, Lk): key j reads word j & 3 of counter j >> 2.
    stacked = np.stack(np.broadcast_arrays(*words), axis=-1).reshape(batch, heads, len_q, -1)[..., :len_k]
    return stacked >= np.uint64(threshold)
