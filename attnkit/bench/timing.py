"""The one timing loop of every bench, paired medians, and what the figures were measured on.

Every bench times through :func:`interleaved`: each function warmed up, then one sample of every function per
repeat, the order rotating, so drift of a shared machine (clock boost, cache warmth, neighbours) hits them alike and
two functions' samples from the same repeat can be compared pairwise.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

#: Nanoseconds per call of ``function`` over ``calls`` back-to-back calls.
Clock = Callable[[Callable[[], Any], int], float]
#: With ``calls=None``, a sample lasts about this long (at most ``MAX_CALLS`` calls).
MIN_SAMPLE_S = 0.05
MAX_CALLS = 200
#: Untimed calls of each function before its samples, whatever a bench or ``--warmup`` asks.
MIN_WARMUP = 1


def _no_sync() -> None:
    pass


def synchronizer(device: str) -> Callable[[], None]:
    """What waits for queued work on ``device``: torch.cuda.synchronize on a GPU, nothing on CPU."""
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return _no_sync


def wall_clock(synchronize: Callable[[], None] = _no_sync) -> Clock:
    """perf_counter around the calls, ``synchronize`` before and after (a GPU's queue)."""

    def clock(function: Callable[[], Any], calls: int) -> float:
        synchronize()
        start = time.perf_counter_ns()
        for _ in range(calls):
            function()
        synchronize()
        return (time.perf_counter_ns() - start) / calls

    return clock


def cuda_event_clock() -> Clock:
    """CUDA events recorded around the calls: the GPU's own time of torch work."""
    import torch

    def clock(function: Callable[[], Any], calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            function()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e6 / calls  # elapsed_time is in milliseconds

    return clock


def _calls_lasting(function: Callable[[], Any], seconds: float) -> int:
    start = time.perf_counter()
    function()
    estimate = max(time.perf_counter() - start, 1e-7)
    return max(1, min(MAX_CALLS, math.ceil(seconds / estimate)))


def interleaved(
    functions: Mapping[str, Callable[[], Any]],
    repeats: int,
    warmup: int,
    calls: int | None = None,
    clock: Clock | None = None,
    contexts: Mapping[str, Callable[[], AbstractContextManager[Any]]] | None = None,
    after_sample: Callable[[], Any] | None = None,
    first_calls: dict[str, float] | None = None,
) -> dict[str, list[float]]:
    """Nanoseconds per call of each function, one sample per repeat.

    Every function is first called ``warmup`` times, at least once (compiles, allocator, caches: no sample is ever a
    cold first call; a bench that reports the cold call times it apart). Each repeat then samples every
    function once, in an order rotated by one per repeat. A sample times ``calls`` back-to-back calls with ``clock``
    (default :func:`wall_clock`); ``calls=None`` takes enough to last ``MIN_SAMPLE_S``, estimated per function from
    one call after the warm-up. ``contexts`` wraps a function's warm-up and samples (say
    ``torch.no_grad``) outside the timed region; ``after_sample`` runs untimed after every sample. ``first_calls``,
    if given, receives each function's first warm-up call timed by ``clock`` (ns): its cold call, to report apart.
    """
    clock = clock or wall_clock()
    contexts = contexts or {}
    names = list(functions)
    counts: dict[str, int] = {}
    for name in names:
        with contexts.get(name, contextlib.nullcontext)():
            for index in range(max(warmup, MIN_WARMUP)):
                if index == 0 and first_calls is not None:
                    first_calls[name] = clock(functions[name], 1)
                else:
                    functions[name]()
            counts[name] = calls if calls is not None else _calls_lasting(functions[name], MIN_SAMPLE_S)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            with contexts.get(name, contextlib.nullcontext)():
                samples[name].append(clock(functions[name], counts[name]))
            if after_sample is not None:
                after_sample()
    return samples


def in_ms(samples: Mapping[str, list[float]]) -> dict[str, list[float]]:
    """:func:`interleaved`'s nanoseconds as milliseconds."""
    return {name: [value / 1e6 for value in values] for name, values in samples.items()}


def paired_ratio(samples: Mapping[str, list[float]], numerator: str, denominator: str) -> float:
    """The median over repeats of numerator's time / denominator's time in the same repeat: the two ran back to back,
    so a drift of the shared machine between repeats (10-20% here) cancels, where a ratio of medians keeps it."""
    return statistics.median(top / bottom for top, bottom in zip(samples[numerator], samples[denominator], strict=True))


def paired_difference(samples: Mapping[str, list[float]], first: str, second: str) -> float:
    """The median over repeats of first's time minus second's time in the same repeat (see :func:`paired_ratio`)."""
    return statistics.median(a - b for a, b in zip(samples[first], samples[second], strict=True))


def blocked(function: Callable[..., Any], *arrays: Any) -> Any:
    """``function(*arrays)`` waited for: JAX dispatches asynchronously, so a timing must block on the result."""
    import jax

    return jax.block_until_ready(function(*arrays))


def environment(device: str) -> dict[str, Any]:
    """What the figures were measured on, so a reader never mistakes CPU numbers for GPU ones. Without torch (the
    spec bench needs none) its version and thread count read "not installed" and 1."""
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]

    info: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__ if torch is not None else "not installed",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads() if torch is not None else 1,
        "load_average": [round(load, 2) for load in os.getloadavg()],
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def device_banner(result: Mapping[str, Any]) -> str:
    """The first line of every bench's output: the machine of ``result["environment"]``, and what it says."""
    env = result["environment"]
    host = (
        f"{env['cpu_model']}, {env['cpu_count']} CPUs, {env['machine']}, torch {env['torch']}, "
        f"threads={env['cpu_threads']}, load average {' '.join(f'{load:.2f}' for load in env['load_average'])}"
    )
    if env["device"] == "cuda":
        return f"GPU figures: {env.get('gpu', 'cuda')} (host: {host})"
    return f"CPU figures ({host}): they say nothing about GPU kernels"
