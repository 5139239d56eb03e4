"""Benchmarks behind ``attnkit bench``. Importing this module does nothing; torch is imported by the functions.

* :func:`bench_dispatch`: what ``attend(..., backend="auto")`` costs on top of calling the chosen backend's
  ``forward`` directly, on a decode-sized call where that overhead matters most.
* :func:`bench_chunked`: torch-chunked forward and forward+backward against torch's
  ``scaled_dot_product_attention`` and torch-naive, in the same process and interleaved.
* :func:`bench_backend`: one backend's forward, backward and forward+backward in TFLOP/s at the FlashAttention-2
  paper's shapes, against its framework's own attention (torch SDPA, jax.nn.dot_product_attention) in the same run.
* :func:`bench_memory`: peak extra host memory of one forward+backward of torch-chunked and torch SDPA, each in a
  fresh process (Linux: the peak-RSS mark is reset through ``/proc/self/clear_refs``).

Results are plain dicts (JSON-ready); ``format_*`` turn them into tables.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
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
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),
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


def _interleaved(
    first: Callable[[], Any], second: Callable[[], Any], rounds: int, calls: int, synchronize: Callable[[], None]
) -> tuple[list[float], list[float]]:
    """Per-call ns of ``first`` and ``second`` in each of ``rounds`` rounds; the order alternates per round."""
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(max(1, calls // 10)):  # warm-up: allocator, caches, lazy imports
        first()
        second()
    for round_index in range(rounds):
        pair = [(samples[0], first), (samples[1], second)]
        for into, function in pair if round_index % 2 == 0 else pair[::-1]:
            into.append(_per_call_ns(function, calls, synchronize))
    return samples


def bench_dispatch(rounds: int = 20, calls: int = 2000, device: str = "cpu") -> dict[str, Any]:
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
    with torch.no_grad():
        attend_ns, direct_ns = _interleaved(through_attend, direct, rounds, calls, synchronize)
        result = direct()
        with mock.patch.object(chosen, "forward", lambda *args, **kwargs: result):
            stub_attend_ns, stub_direct_ns = _interleaved(through_attend, direct, rounds, calls, synchronize)

    def overhead_us(attend: list[float], direct: list[float]) -> float:
        return statistics.median(a - d for a, d in zip(attend, direct, strict=True)) / 1000

    return {
        "what": "dispatch",
        "environment": environment(device),
        "shape": {**shape, "dtype": "float32", "spec": spec.model_dump(mode="json", exclude_defaults=True)},
        "backend": chosen.name,
        "rounds": rounds,
        "calls_per_round": calls,
        "attend_auto_us": statistics.median(attend_ns) / 1000,
        "direct_forward_us": statistics.median(direct_ns) / 1000,
        "overhead_us": overhead_us(attend_ns, direct_ns),
        "stubbed_overhead_us": overhead_us(stub_attend_ns, stub_direct_ns),
        "attend_rounds_us": [value / 1000 for value in attend_ns],
        "direct_rounds_us": [value / 1000 for value in direct_ns],
        "stubbed_overhead_rounds_us": [(a - d) / 1000 for a, d in zip(stub_attend_ns, stub_direct_ns, strict=True)],
    }


def _chunked_inputs(seq_len: int, device: str) -> tuple[Any, ...]:
    """q, k, v and the output gradient of the chunked benchmarks, (B, H, L, D) float32."""
    import torch

    generator = torch.Generator().manual_seed(0)
    size = (CHUNKED_SHAPE["batch"], CHUNKED_SHAPE["heads"], seq_len, CHUNKED_SHAPE["head_dim"])
    return tuple(torch.randn(size, generator=generator).to(device) for _ in range(4))


def _implementations() -> dict[str, Callable[..., Any]]:
    """The causal attentions compared: name -> function(q, k, v) -> out."""
    import torch.nn.functional as F

    import attnkit

    spec = attnkit.AttentionSpec(causal=True)  # Lq == Lk, so bottom-right equals SDPA's top-left is_causal
    return {
        "torch-chunked": lambda q, k, v: attnkit.attend(spec, q, k, v, backend="torch-chunked"),
        "torch sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "torch-naive": lambda q, k, v: attnkit.attend(spec, q, k, v, backend="torch-naive"),
    }


def _forward_backward(function: Callable[..., Any], q: Any, k: Any, v: Any, dout: Any) -> None:
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    function(*leaves).backward(dout)


def bench_chunked(seq_len: int = 4096, repeats: int = 3, warmup: int = 1, device: str = "cpu") -> dict[str, Any]:
    """Forward and forward+backward of torch-chunked, torch SDPA and torch-naive on one causal problem.

    Each repeat runs every implementation once, so they share the machine's state; medians over repeats.
    """
    import torch

    q, k, v, dout = _chunked_inputs(seq_len, device)
    implementations = _implementations()
    synchronize = _synchronizer(device)

    def forward_ms(function: Callable[..., torch.Tensor]) -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            synchronize()
            start = time.perf_counter_ns()
            out = function(q, k, v)
            synchronize()
        return (time.perf_counter_ns() - start) / 1e6, out

    def forward_backward_ms(function: Callable[..., torch.Tensor]) -> float:
        synchronize()
        start = time.perf_counter_ns()
        _forward_backward(function, q, k, v, dout)
        synchronize()
        elapsed = (time.perf_counter_ns() - start) / 1e6
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
        "shape": {**CHUNKED_SHAPE, "len": seq_len, "dtype": "float32", "causal": True},
        "repeats": repeats,
        "warmup": warmup,
        "results": rows,
    }


# FlashAttention-2 paper, section 4.1: 16k tokens per batch (B = 16384 / L), hidden size 2048 (H = 2048 / D).
PAPER_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
PAPER_TOKENS = 16384
PAPER_HIDDEN = 2048
# The Triton and Pallas interpreters run one program at a time in NumPy: a CPU run only shows the benchmark works.
CPU_SEQ_LENS = (128,)
CPU_TOKENS = 256
CPU_HIDDEN = 128


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool, pass_name: str) -> float:
    """The paper's count: 4·B·H·L²·D for the forward (two matmuls), 2.5x that for the backward (five), halved
    when causal."""
    forward = 4.0 * batch * heads * seq_len * seq_len * head_dim / (2 if causal else 1)
    return forward * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[pass_name]


def _timer(device: str, warmup: int, repeats: int) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of a function: CUDA events on a GPU, perf_counter on CPU, after warm-up."""
    import torch

    def measure(function: Callable[[], Any]) -> float:
        for _ in range(warmup):
            function()
        samples = []
        for _ in range(repeats):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                function()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                began = time.perf_counter_ns()
                function()
                samples.append((time.perf_counter_ns() - began) / 1e6)
        return statistics.median(samples)

    return measure


def _torch_passes(attention: Callable[..., Any], q: Any, k: Any, v: Any, dout: Any) -> dict[str, Callable[[], Any]]:
    """fwd, bwd (backward only, on a graph built outside the timing) and fwd+bwd of one attention function."""
    import torch

    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    graph: dict[str, Any] = {}

    def forward() -> Any:
        with torch.no_grad():
            return attention(q, k, v)

    def build() -> None:
        graph["out"] = attention(*leaves)

    def backward() -> None:
        torch.autograd.grad(graph["out"], leaves, dout, retain_graph=True)

    def forward_backward() -> None:
        torch.autograd.grad(attention(*leaves), leaves, dout)

    return {"fwd": forward, "build": build, "bwd": backward, "fwd+bwd": forward_backward}


_PEERS = {"torch": "torch sdpa", "jax": "jax.nn.dot_product_attention"}


def _bench_inputs(framework: Any, shape: tuple[int, ...], dtype: str, device: str) -> tuple[Any, ...]:
    """q, k, v and the output cotangent, bhsd, in the backend's framework."""
    if framework.value == "torch":
        import torch

        generator = torch.Generator().manual_seed(0)
        return tuple(torch.randn(shape, generator=generator).to(device, getattr(torch, dtype)) for _ in range(4))
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    return tuple(jax.random.normal(key, shape, jnp.dtype(dtype)) for key in keys)


def _peer(framework: Any, causal: bool) -> Callable[..., Any]:
    """The framework's own attention on bhsd inputs: torch SDPA, or jax.nn.dot_product_attention (bshd)."""
    if framework.value == "torch":
        import torch.nn.functional as F

        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    import jax

    def jax_peer(q: Any, k: Any, v: Any) -> Any:
        bshd = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
        return jax.nn.dot_product_attention(*bshd, is_causal=causal).transpose(0, 2, 1, 3)

    return jax_peer


def _jax_passes(attention: Callable[..., Any], q: Any, k: Any, v: Any, dout: Any) -> dict[str, Callable[[], Any]]:
    """fwd and fwd+bwd of one attention function, each jitted and blocked on; bwd is their difference (JAX
    cannot run a backward on its own without the forward's residuals)."""
    import jax

    forward = jax.jit(attention)
    gradients = jax.jit(lambda q, k, v: jax.vjp(attention, q, k, v)[1](dout))
    return {
        "fwd": lambda: jax.block_until_ready(forward(q, k, v)),
        "fwd+bwd": lambda: jax.block_until_ready(gradients(q, k, v)),
    }


def bench_backend(
    name: str,
    device: str = "cpu",
    seq_lens: tuple[int, ...] | None = None,
    head_dims: tuple[int, ...] = (64, 128),
    dtype: str = "bfloat16",
    repeats: int = 10,
    warmup: int = 3,
) -> dict[str, Any]:
    """fwd, bwd and fwd+bwd TFLOP/s of a backend and of its framework's peer (torch SDPA for torch backends,
    jax.nn.dot_product_attention for JAX ones), causal and not, at the FlashAttention-2 paper's shapes on a GPU
    (tiny shapes on CPU, where the figures are not performance figures)."""
    import attnkit
    from attnkit.backend import Framework
    from attnkit.testing.runners import native_framework

    backend = attnkit.get_backend(name)
    reasons = backend.available()
    if reasons:
        raise attnkit.BackendUnavailableError(f"backend={name!r} cannot run here: {'; '.join(reasons)}")
    framework = native_framework(name)
    on_gpu = device == "cuda"
    seq_lens = seq_lens or (PAPER_SEQ_LENS if on_gpu else CPU_SEQ_LENS)
    tokens, hidden = (PAPER_TOKENS, PAPER_HIDDEN) if on_gpu else (CPU_TOKENS, CPU_HIDDEN)
    measure = _timer(device if framework is Framework.TORCH else "cpu", warmup, repeats)
    rows = []
    for head_dim in head_dims:
        for seq_len in seq_lens:
            batch, heads = max(1, tokens // seq_len), max(1, hidden // head_dim)
            q, k, v, dout = _bench_inputs(framework, (batch, heads, seq_len, head_dim), dtype, device)
            for causal in (False, True):
                spec = attnkit.AttentionSpec(causal=causal)  # Lq == Lk: bottom-right equals the peers' top-left
                implementations = {
                    name: lambda q, k, v, spec=spec: attnkit.attend(spec, q, k, v, backend=name),
                    _PEERS[framework]: _peer(framework, causal),
                }
                for implementation, attention in implementations.items():
                    if framework is Framework.TORCH:
                        passes = _torch_passes(attention, q, k, v, dout)
                        passes["build"]()
                    else:
                        passes = _jax_passes(attention, q, k, v, dout)
                    row: dict[str, Any] = {
                        "implementation": implementation,
                        "seq_len": seq_len,
                        "head_dim": head_dim,
                        "batch": batch,
                        "heads": heads,
                        "causal": causal,
                    }
                    for pass_name in ("fwd", "fwd+bwd", "bwd"):
                        if pass_name in passes:
                            milliseconds: float | None = measure(passes[pass_name])
                        else:  # JAX: the backward is what fwd+bwd adds to fwd (None when noise hides it)
                            difference = row["fwd+bwd_ms"] - row["fwd_ms"]
                            milliseconds = difference if difference > 0 else None
                        flops = attention_flops(batch, heads, seq_len, head_dim, causal, pass_name)
                        row[f"{pass_name}_ms"] = milliseconds
                        row[f"{pass_name}_tflops"] = flops / (milliseconds * 1e9) if milliseconds else None
                    rows.append(row)
    return {
        "what": "backend",
        "backend": name,
        "framework": framework.value,
        "peer": _PEERS[framework],
        "backend_description": backend.capabilities.description,
        "environment": environment(device),
        "dtype": dtype,
        "repeats": repeats,
        "warmup": warmup,
        "results": rows,
    }


def format_backend(result: dict[str, Any]) -> str:
    from attnkit.cli import format_table

    peer = {
        (row["head_dim"], row["seq_len"], row["causal"]): row
        for row in result["results"]
        if row["implementation"] == result["peer"]
    }
    rows = [
        [
            row["implementation"],
            "yes" if row["causal"] else "no",
            str(row["head_dim"]),
            str(row["seq_len"]),
            f"{row['batch']}x{row['heads']}",
            *(
                f"{row[f'{name}_tflops']:.3g} ({row[f'{name}_ms']:.3g} ms)" if row[f"{name}_ms"] else "n/a"
                for name in ("fwd", "bwd", "fwd+bwd")
            ),
            f"{row['fwd+bwd_tflops'] / peer[row['head_dim'], row['seq_len'], row['causal']]['fwd+bwd_tflops']:.2f}x",
        ]
        for row in result["results"]
    ]
    lines = [_device_banner(result)]
    if result["environment"]["device"] != "cuda":
        lines.append(
            f"NOT A PERFORMANCE FIGURE: on CPU, {result['backend']} runs as {result['backend_description']!r}; "
            "this run only shows the benchmark works. Run it on a CUDA machine with --device cuda."
        )
    lines += [
        f"{result['backend']} against {result['peer']}, {result['dtype']}, TFLOP/s (median ms) of "
        f"{result['repeats']} repeats after {result['warmup']} warm-up; FLOPs as in the FlashAttention-2 paper",
        format_table(["implementation", "causal", "D", "L", "BxH", "fwd", "bwd", "fwd+bwd", "fwd+bwd vs peer"], rows),
    ]
    return "\n".join(lines)


MEMORY_MEASURED = ("torch-chunked", "torch sdpa")  # torch-naive materialises (B, H, L, L): see bench_memory
_MEMORY_CHILD = "import sys; from attnkit.bench import _memory_child as m; m(sys.argv[1], *map(int, sys.argv[2:]))"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_child(name: str, seq_len: int, threads: int) -> None:
    """In a fresh process: print the peak RSS growth of one forward+backward of ``name``, as JSON."""
    import torch

    torch.set_num_threads(threads)
    function = _implementations()[name]
    _forward_backward(function, *_chunked_inputs(64, "cpu"))  # load modules and kernels before measuring
    inputs = _chunked_inputs(seq_len, "cpu")
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    _forward_backward(function, *inputs)
    seconds = time.perf_counter() - start
    print(json.dumps({"peak_extra_bytes": (_status_kib("VmHWM") - before) * 1024, "seconds": seconds}))


def bench_memory(seq_len: int = 16384) -> dict[str, Any]:
    """Peak extra host memory of one causal forward+backward on CPU, each implementation in a fresh process.

    Peak extra = VmHWM after the call minus VmRSS before it, with q, k, v and dout already allocated: it counts
    the output, the gradients and every temporary. Runs with the calling process's torch thread count. Linux only.
    torch-naive is not run: its float32 (B, H, L, L) score matrix alone is reported instead.
    """
    import torch

    threads = torch.get_num_threads()
    rows = {}
    for name in MEMORY_MEASURED:
        command = [sys.executable, "-c", _MEMORY_CHILD, name, str(seq_len), str(threads)]
        child = subprocess.run(command, capture_output=True, text=True)
        if child.returncode != 0:
            raise RuntimeError(f"memory run of {name} failed (exit {child.returncode}):\n{child.stderr[-2000:]}")
        rows[name] = json.loads(child.stdout.strip().splitlines()[-1])
    shape = CHUNKED_SHAPE
    return {
        "what": "memory",
        "environment": environment("cpu"),
        "shape": {**shape, "len": seq_len, "dtype": "float32", "causal": True},
        "results": rows,
        "naive_score_matrix_bytes": shape["batch"] * shape["heads"] * seq_len**2 * 4,
    }


def _device_banner(result: dict[str, Any]) -> str:
    env = result["environment"]
    host = (
        f"{env['cpu_model']}, {env['cpu_count']} CPUs, {env['machine']}, torch {env['torch']}, "
        f"threads={env['cpu_threads']}, load average {' '.join(f'{load:.2f}' for load in env['load_average'])}"
    )
    if env["device"] == "cuda":
        return f"GPU figures: {env.get('gpu', 'cuda')} (host: {host})"
    return f"CPU figures ({host}): they say nothing about GPU kernels"


def format_dispatch(result: dict[str, Any]) -> str:
    from attnkit.cli import format_table

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


def format_memory(result: dict[str, Any]) -> str:
    from attnkit.cli import format_table

    shape = result["shape"]
    rows = [
        [name, f"{row['peak_extra_bytes'] / 2**20:.0f}", f"{row['seconds']:.2f}"]
        for name, row in result["results"].items()
    ]
    score_bytes = result["naive_score_matrix_bytes"]
    return "\n".join(
        [
            _device_banner(result),
            f"peak extra memory of one causal forward+backward, B={shape['batch']} H={shape['heads']} "
            f"L={shape['len']} D={shape['head_dim']} float32: VmHWM after minus VmRSS before (q, k, v, dout "
            "already allocated), each in a fresh process",
            format_table(["implementation", "peak extra MiB", "fwd+bwd s"], rows),
            f"torch-naive not run: its float32 (B, H, L, L) score matrix alone is {score_bytes / 2**20:.0f} MiB "
            f"({score_bytes / 1e9:.1f} GB)",
        ]
    )
