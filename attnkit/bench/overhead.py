"""``attnkit bench --what dispatch``: what ``attend(..., backend="auto")`` costs on top of calling the chosen
backend's ``forward`` directly, on a decode-sized call where that overhead matters most."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from attnkit.bench.calls import random_inputs
from attnkit.bench.timing import device_banner, environment, interleaved, paired_difference, synchronizer, wall_clock
from attnkit.tables import format_table

DISPATCH_SHAPE = {"batch": 1, "heads": 8, "len_q": 1, "len_k": 128, "head_dim": 64}
ATTEND = "attend"
DIRECT = "direct"


def bench_dispatch(
    rounds: int = 20, calls: int = 2000, device: str = "cpu", progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Median per-call time of attend(backend="auto") and of the chosen backend's forward, interleaved.

    Rounds alternate which of the two goes first, so drift (clock boost, cache warmth) hits both alike;
    the overhead reported is the median of the per-round differences. On a busy machine that difference of two
    noisy forward times is itself noisy, so the same pair is measured again with the backend's ``forward``
    replaced by a stub that returns a precomputed result: what is left is attend()'s own work, alone.
    """
    from unittest import mock

    import torch

    import attnkit
    from attnkit import dispatch

    shape = DISPATCH_SHAPE
    spec = attnkit.AttentionSpec(causal=True)
    q_shape = (shape["batch"], shape["heads"], shape["len_q"], shape["head_dim"])
    kv_shape = (shape["batch"], shape["heads"], shape["len_k"], shape["head_dim"])
    q, k, v, _ = random_inputs("torch", q_shape, kv_shape, device=device)
    problem = attnkit.Problem(
        framework=attnkit.Framework.TORCH,
        device=device,
        dtype="float32",
        batch=shape["batch"],
        heads_q=shape["heads"],
        heads_kv=shape["heads"],
        len_q=shape["len_q"],
        len_k=shape["len_k"],
        head_dim=shape["head_dim"],
        head_dim_v=shape["head_dim"],
    )
    chosen = dispatch.select(spec, problem)  # also fills the decision cache that attend() will hit
    inputs = attnkit.AttentionInputs(q, k, v)
    functions = {
        ATTEND: lambda: attnkit.attend(spec, q, k, v, backend="auto"),
        DIRECT: lambda: chosen.forward(spec, inputs, need_lse=False),
    }

    def measure() -> dict[str, list[float]]:
        warmup = max(1, calls // 10)  # allocator, caches, lazy imports
        return interleaved(functions, rounds, warmup, calls=calls, clock=wall_clock(synchronizer(device)))

    say = progress or (lambda message: None)
    with torch.no_grad():
        say(f"attend against {chosen.name}'s forward: {rounds} rounds of {calls} calls each")
        samples = measure()
        result = functions[DIRECT]()
        # attend may make the backend's plain call (the library call alone) rather than its forward: stub both, and
        # forget the cached call so that the stubs are the ones attend finds.
        dispatch.clear_cache()
        with (
            mock.patch.object(chosen, "forward", lambda *args, **kwargs: result),
            mock.patch.object(chosen, "plain_call", lambda *args, **kwargs: lambda q, k, v: result[0], create=True),
        ):
            say("again with the forward stubbed: attend's own work")
            stubbed = measure()
        dispatch.clear_cache()

    return {
        "what": "dispatch",
        "environment": environment(device),
        "shape": {**shape, "dtype": "float32", "spec": spec.model_dump(mode="json", exclude_defaults=True)},
        "backend": chosen.name,
        "rounds": rounds,
        "calls_per_round": calls,
        "attend_auto_us": statistics.median(samples[ATTEND]) / 1000,
        "direct_forward_us": statistics.median(samples[DIRECT]) / 1000,
        "overhead_us": paired_difference(samples, ATTEND, DIRECT) / 1000,
        "stubbed_overhead_us": paired_difference(stubbed, ATTEND, DIRECT) / 1000,
        "attend_rounds_us": [value / 1000 for value in samples[ATTEND]],
        "direct_rounds_us": [value / 1000 for value in samples[DIRECT]],
        "stubbed_overhead_rounds_us": [(a - d) / 1000 for a, d in zip(stubbed[ATTEND], stubbed[DIRECT], strict=True)],
    }


def format_dispatch(result: dict[str, Any]) -> str:
    shape = result["shape"]
    direct = result["direct_forward_us"]
    rows = [
        ['attend(backend="auto")', f"{result['attend_auto_us']:.2f}"],
        [f"{result['backend']}.forward direct", f"{direct:.2f}"],
        ["dispatch overhead", f"{result['overhead_us']:.2f} ({100 * result['overhead_us'] / direct:.0f}% of forward)"],
        ["dispatch overhead, forward stubbed", f"{result['stubbed_overhead_us']:.2f}"],
    ]
    return "\n".join(
        [
            device_banner(result),
            f"dispatch overhead: B={shape['batch']} H={shape['heads']} Lq={shape['len_q']} Lk={shape['len_k']} "
            f"D={shape['head_dim']} float32 causal, no_grad, cached decision; "
            f"median of {result['rounds']} interleaved rounds x {result['calls_per_round']} calls",
            format_table(["call", "median us/call"], rows),
        ]
    )
