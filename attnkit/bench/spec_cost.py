"""``attnkit bench --what spec``: what building an ``AttentionSpec`` costs when one with the same arguments was built
before (remembered: a look-up) against validating it (what a first construction pays)."""

from __future__ import annotations

import statistics
from typing import Any

from attnkit.bench.timing import device_banner, environment, interleaved, paired_ratio
from attnkit.spec import AttentionSpec
from attnkit.tables import format_table

SPEC_FIELDS: dict[str, Any] = {"causal": True, "window": (3, 0), "scale": 0.5}
REMEMBERED = "AttentionSpec(causal=True, window=(3, 0), scale=0.5)"
REORDERED = "AttentionSpec(scale=0.5, window=(3, 0), causal=True, softcap=None)"
VALIDATED = "the same, validated (type.__call__: not remembered)"


def bench_spec(rounds: int = 20, calls: int = 2000) -> dict[str, Any]:
    """Median per-call time of a remembered construction (the same keywords, and another order with a default given
    explicitly) and of a full validation of the same fields, interleaved; needs neither torch nor JAX."""
    functions = {
        REMEMBERED: lambda: AttentionSpec(causal=True, window=(3, 0), scale=0.5),
        REORDERED: lambda: AttentionSpec(scale=0.5, window=(3, 0), causal=True, softcap=None),
        VALIDATED: lambda: type.__call__(AttentionSpec, **SPEC_FIELDS),  # every construction before issue 16
    }
    samples = interleaved(functions, rounds, max(1, calls // 10), calls=calls)
    return {
        "what": "spec",
        "environment": environment("cpu"),
        "fields": {**SPEC_FIELDS, "window": list(SPEC_FIELDS["window"])},
        "rounds": rounds,
        "calls_per_round": calls,
        "median_us": {name: statistics.median(values) / 1000 for name, values in samples.items()},
        "validated_over_remembered": paired_ratio(samples, VALIDATED, REMEMBERED),
        "rounds_us": {name: [value / 1000 for value in values] for name, values in samples.items()},
    }


def format_spec(result: dict[str, Any]) -> str:
    medians = result["median_us"]
    rows = [[name, f"{medians[name]:.2f}"] for name in (REMEMBERED, REORDERED, VALIDATED)]
    return "\n".join(
        [
            device_banner(result),
            f"spec construction: median of {result['rounds']} interleaved rounds x {result['calls_per_round']} calls; "
            f"validating costs {result['validated_over_remembered']:.1f}x a remembered construction (paired)",
            format_table(["call", "median us/call"], rows),
        ]
    )
