"""The conformance harness: strategies, cases, the float64 oracle and the tolerance rule (docs/testing.md).

Public: users run it on their machine (``attnkit check``) and backend authors run it on their backends::

    from attnkit.testing import Case, assert_backends_agree
    assert_backends_agree(Case(spec=attnkit.AttentionSpec(causal=True)), backends=["my-backend"])

Needs torch (the oracle is torch-naive in float64) and hypothesis for the strategies.
"""

from __future__ import annotations

from attnkit.environment import interpret_triton_without_gpu
from attnkit.testing.agreement import (
    FLOOR_ULPS,
    Comparison,
    DisagreementError,
    assert_agrees_without_lse,
    assert_backends_agree,
    backends_for,
    check_backend,
)
from attnkit.testing.cases import Case, make_arrays
from attnkit.testing.profiles import register_profiles

__all__ = [
    "FLOOR_ULPS",
    "Case",
    "Comparison",
    "DisagreementError",
    "assert_agrees_without_lse",
    "assert_backends_agree",
    "backends_for",
    "check_backend",
    "interpret_triton_without_gpu",
    "make_arrays",
    "register_profiles",
]
