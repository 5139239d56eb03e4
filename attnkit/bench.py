"""Benchmarks behind ``attnkit bench``. Importing this module does nothing; torch is imported by the functions.

* :func:`bench_dispatch`: what ``attend(..., backend="auto")`` costs on top of calling the chosen backend's
  ``forward`` directly, on a decode-sized call where that overhead matters most.
* :func:`bench_chunked`: torch-chunked forward and forward+backward against torch's
  ``scaled_dot_product_attention`` and torch-naive, in the same process and interleaved.
* :func:`bench_backend`: any registered backend's forward, backward and forward+backward in TFLOP/s at the
  FlashAttention-2 paper's shapes, against its framework's peer (torch SDPA or ``jax.nn.dot_product_attention``)
  in the same run.
* :func:`bench_memory`: peak extra host memory of one forward+backward of torch-chunked and torch SDPA, each in a
  fresh process (Linux: the peak-RSS mark is reset through ``/proc/self/clear_refs``).

Results are plain dicts (JSON-ready); ``format_*`` turn them into tables.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
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


# ------------------------------------------------------------------------------------------- any backend

#: FlashAttention-2 paper (§4.1): 16k tokens per batch, hidden 2048 (heads = 2048 / D), bf16, causal and not.
PAPER_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
PAPER_HEAD_DIMS = (64, 128)
PAPER_TOKENS, PAPER_HIDDEN = 16384, 2048
#: On CPU a kernel backend may run interpreted (pallas): far smaller shapes, and the figures say so.
CPU_SEQ_LENS, CPU_TOKENS = (128, 256), 512


def _attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs as the FlashAttention-2 paper counts them: 4·B·H·L²·D, halved under causal."""
    return 4.0 * batch * heads * seq_len * seq_len * head_dim / (2 if causal else 1)


class _Timed:
    """Median wall time of a callable, with a device sync after each call; warm-up calls are not timed."""

    def __init__(self, block: Callable[[Any], Any], repeats: int, warmup: int) -> None:
        self.block, self.repeats, self.warmup = block, repeats, warmup

    def __call__(self, function: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            self.block(function())
        samples = []
        for _ in range(self.repeats):
            start = time.perf_counter_ns()
            self.block(function())
            samples.append((time.perf_counter_ns() - start) / 1e6)
        return statistics.median(samples)


def _jax_pair(name: str, spec: Any, q: Any, k: Any, v: Any) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """(forward, forward+backward) closures for the backend and for jax.nn.dot_product_attention (bshd both)."""
    import jax
    import jax.numpy as jnp

    import attnkit

    def ours(q: Any, k: Any, v: Any) -> Any:
        return attnkit.attend(spec, q, k, v, backend=name)

    def peer(q: Any, k: Any, v: Any) -> Any:
        return jax.nn.dot_product_attention(q, k, v, is_causal=spec.causal)

    pairs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {}
    for label, function in ((name, ours), ("jax.nn.dot_product_attention", peer)):
        forward = jax.jit(function)
        loss = jax.jit(jax.grad(lambda q, k, v, f=function: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
        pairs[label] = (functools.partial(forward, q, k, v), functools.partial(loss, q, k, v))
    return pairs


def _torch_pair(name: str, spec: Any, q: Any, k: Any, v: Any) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    import torch

    import attnkit

    def ours(q: Any, k: Any, v: Any) -> Any:
        return attnkit.attend(spec, q, k, v, backend=name)

    def peer(q: Any, k: Any, v: Any) -> Any:  # bshd -> SDPA's (B, H, L, D) and back
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=spec.causal
        )
        return out.transpose(1, 2)

    pairs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {}
    for label, function in ((name, ours), ("torch sdpa", peer)):

        def forward(function: Callable[..., Any] = function) -> Any:
            with torch.no_grad():
                return function(q, k, v)

        def forward_backward(function: Callable[..., Any] = function) -> Any:
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            function(*leaves).float().sum().backward()
            return leaves[0].grad

        pairs[label] = (forward, forward_backward)
    return pairs


def _torch_block(device: str) -> Callable[[Any], None]:
    synchronize = _synchronizer(device)
    return lambda _: synchronize()


def _backend_environment(framework: Any, device: str) -> dict[str, Any]:
    """environment(), with the GPU named by the framework that runs (torch may be a CPU build next to JAX)."""
    info = environment("cpu")
    info["device"] = device
    if framework.value == "jax":
        import jax

        info["jax"] = jax.__version__
        if device == "cuda":
            info["gpu"] = jax.devices()[0].device_kind
    elif device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name()
    return info


def bench_backend(
    name: str,
    device: str = "cpu",
    seq_lens: Sequence[int] | None = None,
    head_dims: Sequence[int] = PAPER_HEAD_DIMS,
    tokens: int | None = None,
    dtype: str = "bfloat16",
    repeats: int = 5,
    warmup: int = 2,
) -> dict[str, Any]:
    """Forward, backward and forward+backward TFLOP/s of backend ``name`` and of its framework's peer.

    Shapes follow the FlashAttention-2 paper: ``tokens`` per batch (16k) split into sequences of each length,
    hidden 2048 so H = 2048 / D, causal and not, bf16, layout bshd. Backward is (forward+backward) − forward,
    each the median of ``repeats`` after ``warmup`` calls (which also compile). JAX backends (those that take
    JAX arrays, or name JAX as their ``native_framework``) run on JAX arrays against
    ``jax.nn.dot_product_attention``; torch backends on torch tensors against SDPA. On CPU the defaults shrink to
    sequences of 128 and 256 in 512 tokens; a backend that runs interpreted there measures its interpreter.
    """
    from attnkit import AttentionSpec, registry
    from attnkit.backend import Framework

    backend = registry.get_backend(name)
    reasons = backend.available()
    if reasons:
        raise RuntimeError(f"backend={name!r} cannot run here: {'; '.join(reasons)}")
    frameworks = backend.capabilities.frameworks
    preferred = getattr(backend, "native_framework", None)
    framework = (
        preferred if preferred in frameworks else (Framework.TORCH if Framework.TORCH in frameworks else Framework.JAX)
    )
    seq_lens = tuple(seq_lens or (PAPER_SEQ_LENS if device == "cuda" else CPU_SEQ_LENS))
    tokens = tokens or (PAPER_TOKENS if device == "cuda" else CPU_TOKENS)
    rows = []
    for causal in (False, True):
        spec = AttentionSpec(causal=causal, layout="bshd")
        for head_dim in head_dims:
            heads = max(1, PAPER_HIDDEN // head_dim)
            for seq_len in seq_lens:
                batch = max(1, tokens // seq_len)
                shape = (batch, seq_len, heads, head_dim)
                if framework is Framework.JAX:
                    import jax
                    import jax.numpy as jnp

                    keys = jax.random.split(jax.random.PRNGKey(seq_len), 3)
                    q, k, v = (jax.random.normal(key, shape, jnp.dtype(dtype)) for key in keys)  # type: ignore[misc]
                    pairs, block = _jax_pair(name, spec, q, k, v), jax.block_until_ready
                else:
                    import torch

                    q, k, v = (torch.randn(shape, dtype=getattr(torch, dtype), device=device) for _ in range(3))  # type: ignore[assignment]
                    pairs, block = _torch_pair(name, spec, q, k, v), _torch_block(device)
                timed = _Timed(block, repeats, warmup)
                flops = _attention_flops(batch, heads, seq_len, head_dim, causal)
                for label, (forward, forward_backward) in pairs.items():
                    forward_ms, total_ms = timed(forward), timed(forward_backward)
                    backward_ms = max(total_ms - forward_ms, 1e-9)
                    rows.append(
                        {
                            "implementation": label,
                            "causal": causal,
                            "head_dim": head_dim,
                            "seq_len": seq_len,
                            "batch": batch,
                            "heads": heads,
                            "forward_ms": forward_ms,
                            "backward_ms": backward_ms,
                            "forward_backward_ms": total_ms,
                            "forward_tflops": flops / forward_ms / 1e9,
                            "backward_tflops": 2.5 * flops / backward_ms / 1e9,
                            "forward_backward_tflops": 3.5 * flops / total_ms / 1e9,
                        }
                    )
    interpreted = bool(getattr(backend, "interpret", lambda: False)()) if framework is Framework.JAX else False
    return {
        "environment": _backend_environment(framework, device),
        "backend": name,
        "framework": framework.value,
        "interpreted": interpreted,
        "dtype": dtype,
        "tokens": tokens,
        "repeats": repeats,
        "warmup": warmup,
        "results": rows,
    }


def format_backend(result: dict[str, Any]) -> str:
    from attnkit.cli import format_table

    rows = [
        [
            row["implementation"],
            "yes" if row["causal"] else "no",
            str(row["head_dim"]),
            str(row["seq_len"]),
            f"{row['batch']}x{row['heads']}",
            f"{row['forward_ms']:.2f}",
            f"{row['forward_tflops']:.3g}",
            f"{row['backward_tflops']:.3g}",
            f"{row['forward_backward_tflops']:.3g}",
        ]
        for row in result["results"]
    ]
    lines = [_device_banner(result)]
    if result["interpreted"]:
        lines.append(
            f"{result['backend']} runs INTERPRETED here (Pallas interpret=True): these figures measure the "
            "interpreter, not a kernel"
        )
    lines += [
        f"{result['backend']} ({result['framework']}) against its framework's peer, {result['dtype']}, bshd, "
        f"{result['tokens']} tokens per batch, hidden 2048; median of {result['repeats']} after "
        f"{result['warmup']} warm-up; FLOPs as FlashAttention-2 counts them (bwd = 2.5 x fwd, causal halves)",
        format_table(
            ["implementation", "causal", "D", "seq", "BxH", "fwd ms", "fwd TFLOP/s", "bwd TFLOP/s", "fwd+bwd TFLOP/s"],
            rows,
        ),
    ]
    return "\n".join(lines)
