"""Checks of a dropout seed given as a Python integer (docs/semantics.md §18), shared by the frontends."""

from __future__ import annotations

import numbers
from typing import Any

from attnkit.errors import InvalidInputError, InvalidInputTypeError


def unsigned_seed(seed: Any) -> int:
    """``seed`` as a Python int in [0, 2⁶⁴): InvalidInputTypeError for what is not an integer (a bool is not),
    InvalidInputError for an integer outside the range."""
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise InvalidInputTypeError(
            f"dropout_seed must be an integer in [0, 2**64) or an array holding one, got {type(seed).__name__}"
        )
    if not 0 <= int(seed) < 1 << 64:
        raise InvalidInputError(f"dropout_seed={int(seed)} is outside [0, 2**64)")
    return int(seed)
