"""Benchmarks behind ``attnkit bench``. Importing this module does nothing; torch is imported by the functions.

* :func:`bench_dispatch`: what ``attend(..., backend="auto")`` costs on top of calling the chosen backend's
  ``forward`` directly, on a decode-sized call where that overhead matters most.
* :func:`bench_chunked`: torch-chunked forward and forward+backward against torch's
  ``scaled_dot_product_attention`` and torch-naive, in the same process and interleaved.

Results are plain dicts (JSON-ready); ``format_*`` turn them into tables.
"""

from __future__ import annotations

import contextlib
import gc
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

DISPATCH_SHAPE = {"batch": 1, "heads": 8, "len_q": 1, "len_k": 128, "head_dim": 64}
CHUNKED_SHAPE = {"batch": 1, "heads": 8, "head_dim": 64}


def environment(device: str) -> dict[str, Any]:
    """What the figures were measured on, so a reader never mistakes CPU numbers for GPU ones."""
    import torch

    info: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` intra-op threads (None: leave torch's choice), restoring the previous count."""
    import torch

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _synchronizer(device: str) -> Callable[[], None]:
    import torch

    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _per_call_ns(function: Callable[[], Any], calls: int, synchronize: Callable[[], None]) -> float:
    synchronize()
    start = time.perf_counter_ns()
    for _ in range(calls):
        function()
    synchronize()
    return (time.perf_counter_ns() - start) / calls


def bench_dispatch(rounds: int = 20, calls: int = 2000, device: str = "cpu") -> dict[str, Any]:
    """Median per-call time of attend(backend="auto") and of the chosen backend's forward, interleaved.

    Rounds alternate which of the two goes first, so drift (clock boost, cache warmth) hits both alike;
    the overhead reported is the median of the per-round differences.
    """
    import torch

    import attnkit
    from attnkit import dispatch

    shape = DISPATCH_SHAPE
    spec = attnkit.AttentionSpec(causal=True)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape["batch"], shape["heads"], length, shape["head_dim"], generator=generator).to(device)
        for length in (shape["len_q"], shape["len_k"], shape["len_k"])
    )
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

    def through_attend() -> Any:
        return attnkit.attend(spec, q, k, v, backend="auto")

    def direct() -> Any:
        return chosen.forward(spec, inputs, need_lse=False)

    synchronize = _synchronizer(device)
    attend_ns: list[float] = []
    direct_ns: list[float] = []
    with torch.no_grad():
        for _ in range(max(1, calls // 10)):  # warm-up: allocator, caches, lazy imports
            through_attend()
            direct()
        for round_index in range(rounds):
            pair = [(attend_ns, through_attend), (direct_ns, direct)]
            for samples, function in pair if round_index % 2 == 0 else pair[::-1]:
                samples.append(_per_call_ns(function, calls, synchronize))
    differences = [a - d for a, d in zip(attend_ns, direct_ns, strict=True)]
    return {
        "what": "dispatch",
        "environment": environment(device),
        "shape": {**shape, "dtype": "float32", "spec": spec.model_dump(mode="json", exclude_defaults=True)},
        "backend": chosen.name,
        "rounds": rounds,
        "calls_per_round": calls,
        "attend_auto_us": statistics.median(attend_ns) / 1000,
        "direct_forward_us": statistics.median(direct_ns) / 1000,
        "overhead_us": statistics.median(differences) / 1000,
        "attend_rounds_us": [value / 1000 for value in attend_ns],
        "direct_rounds_us": [value / 1000 for value in direct_ns],
    }


def bench_chunked(seq_len: int = 4096, repeats: int = 3, warmup: int = 1, device: str = "cpu") -> dict[str, Any]:
    """Forward and forward+backward of torch-chunked, torch SDPA and torch-naive on one causal problem.

    Each repeat runs every implementation once, so they share the machine's state; medians over repeats.
    """
    import torch
    import torch.nn.functional as F

    import attnkit

    shape = {**CHUNKED_SHAPE, "len": seq_len}
    spec = attnkit.AttentionSpec(causal=True)  # Lq == Lk, so bottom-right equals SDPA's top-left is_causal
    generator = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(shape["batch"], shape["heads"], seq_len, shape["head_dim"], generator=generator).to(device)
        for _ in range(4)
    )
    implementations: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "torch-chunked": lambda a, b, c: attnkit.attend(spec, a, b, c, backend="torch-chunked"),
        "torch sdpa": lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
        "torch-naive": lambda a, b, c: attnkit.attend(spec, a, b, c, backend="torch-naive"),
    }
    synchronize = _synchronizer(device)

    def forward_ms(function: Callable[..., torch.Tensor]) -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            synchronize()
            start = time.perf_counter_ns()
            out = function(q, k, v)
            synchronize()
        return (time.perf_counter_ns() - start) / 1e6, out

    def forward_backward_ms(function: Callable[..., torch.Tensor]) -> float:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        synchronize()
        start = time.perf_counter_ns()
        function(*leaves).backward(dout)
        synchronize()
        elapsed = (time.perf_counter_ns() - start) / 1e6
        del leaves
        gc.collect()  # the naive backend's (L, L) buffers must not linger into the next timing
        return elapsed

    forward: dict[str, list[float]] = {name: [] for name in implementations}
    both: dict[str, list[float]] = {name: [] for name in implementations}
    outputs: dict[str, torch.Tensor] = {}
    for repeat in range(warmup + repeats):
        for name, function in implementations.items():
            forward_time, outputs[name] = forward_ms(function)
            both_time = forward_backward_ms(function)
            if repeat >= warmup:
                forward[name].append(forward_time)
                both[name].append(both_time)
    reference = outputs["torch sdpa"].double()
    rows = {
        name: {
            "forward_ms": statistics.median(forward[name]),
            "forward_backward_ms": statistics.median(both[name]),
            "max_abs_diff_vs_sdpa": float((outputs[name].double() - reference).abs().max()),
            "forward_samples_ms": forward[name],
            "forward_backward_samples_ms": both[name],
        }
        for name in implementations
    }
    return {
        "what": "chunked",
        "environment": environment(device),
        "shape": {**shape, "dtype": "float32", "causal": True},
        "repeats": repeats,
        "warmup": warmup,
        "results": rows,
    }


def _device_banner(result: dict[str, Any]) -> str:
    env = result["environment"]
    if env["device"] == "cuda":
        return f"GPU figures: {env.get('gpu', 'cuda')}, torch {env['torch']}"
    return (
        f"CPU figures (torch {env['torch']}, threads={env['cpu_threads']}, {env['machine']}): "
        "they say nothing about GPU kernels"
    )


def format_dispatch(result: dict[str, Any]) -> str:
    from attnkit.cli import format_table

    shape = result["shape"]
    direct = result["direct_forward_us"]
    rows = [
        ['attend(backend="auto")', f"{result['attend_auto_us']:.2f}"],
        [f"{result['backend']}.forward direct", f"{direct:.2f}"],
        ["dispatch overhead", f"{result['overhead_us']:.2f} ({100 * result['overhead_us'] / direct:.0f}% of forward)"],
    ]
    return "\n".join(
        [
            _device_banner(result),
            f"dispatch overhead: B={shape['batch']} H={shape['heads']} Lq={shape['len_q']} Lk={shape['len_k']} "
            f"D={shape['head_dim']} float32 causal, no_grad, cached decision; "
            f"median of {result['rounds']} interleaved rounds x {result['calls_per_round']} calls",
            format_table(["call", "median us/call"], rows),
        ]
    )


def format_chunked(result: dict[str, Any]) -> str:
    from attnkit.cli import format_table

    shape = result["shape"]
    sdpa = result["results"]["torch sdpa"]
    rows = []
    for name, row in result["results"].items():
        rows.append(
            [
                name,
                f"{row['forward_ms']:.1f}",
                f"{row['forward_backward_ms']:.1f}",
                f"{row['forward_backward_ms'] / sdpa['forward_backward_ms']:.2f}x",
                f"{row['max_abs_diff_vs_sdpa']:.1e}",
            ]
        )
    return "\n".join(
        [
            _device_banner(result),
            f"causal attention B={shape['batch']} H={shape['heads']} L={shape['len']} D={shape['head_dim']} float32; "
            f"median of {result['repeats']} repeats after {result['warmup']} warm-up",
            format_table(["implementation", "fwd ms", "fwd+bwd ms", "fwd+bwd vs sdpa", "max|out-sdpa|"], rows),
        ]
    )
