"""attnkit.dropout_keep_mask: §18's keep-mask as a NumPy array, for debugging and tests."""

from __future__ import annotations

import numpy as np

from attnkit.contract.philox import keep_mask
from attnkit.errors import InvalidInputError
from attnkit.frontends.seeds import unsigned_seed
from attnkit.validation import checked_probability


def dropout_keep_mask(seed: int, p: float, batch: int, heads: int, len_q: int, len_k: int) -> np.ndarray:
    """The boolean (batch, heads, len_q, len_k) keep-mask of docs/semantics.md §18 from the reference implementation:
    True where attend with ``dropout_p=p, dropout_seed=seed`` keeps the probability of query i for key j in query
    head h of batch row b (indices from 0 in the unsharded sequence).

    :param seed: the dropout seed, an int in [0, 2**64), as ``attend`` takes it.
    :param p: the dropout probability, 0 ≤ p < 1.
    :param batch: batch rows B.
    :param heads: query heads Hq.
    :param len_q: queries Lq.
    :param len_k: keys Lk.
    :returns: a NumPy bool array (batch, heads, len_q, len_k).
    :raises attnkit.InvalidInputError: p outside [0, 1) or a size that is not an integer ≥ 0.
    """
    p = checked_probability(p)
    sizes = {"batch": batch, "heads": heads, "len_q": len_q, "len_k": len_k}
    wrong = {name: size for name, size in sizes.items() if not isinstance(size, int) or size < 0}
    if wrong:
        raise InvalidInputError(f"sizes must be integers >= 0, got {wrong}")
    return keep_mask(unsigned_seed(seed), p, batch, heads, len_q, len_k)
