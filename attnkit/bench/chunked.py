"""``attnkit bench --what chunked`` and ``--what memory``: torch-chunked against torch's
``scaled_dot_product_attention`` and torch-naive on one causal problem.

* :func:`bench_chunked`: forward and forward+backward times, in the same process and interleaved.
* :func:`bench_memory`: peak extra host memory of one forward+backward of torch-chunked and torch SDPA, each in a
  fresh process.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from typing import Any

from attnkit.bench.calls import random_inputs
from attnkit.bench.peak_memory import print_peak, run_child
from attnkit.bench.timing import device_banner, environment, in_ms, interleaved, synchronizer, wall_clock
from attnkit.tables import format_table

CHUNKED_SHAPE = {"batch": 1, "heads": 8, "head_dim": 64}
MEMORY_MEASURED = ("torch-chunked", "torch sdpa")  # torch-naive materialises (B, H, L, L): see bench_memory
_MEMORY_CHILD = (
    "import sys; from attnkit.bench.chunked import _memory_child as m; m(sys.argv[1], *map(int, sys.argv[2:]))"
)


def _chunked_inputs(seq_len: int, device: str) -> tuple[Any, ...]:
    """q, k, v and the output gradient of the chunked benchmarks, (B, H, L, D) float32."""
    shape = (CHUNKED_SHAPE["batch"], CHUNKED_SHAPE["heads"], seq_len, CHUNKED_SHAPE["head_dim"])
    return random_inputs("torch", shape, shape, device=device)


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
    from functools import partial

    import torch

    q, k, v, dout = _chunked_inputs(seq_len, device)
    implementations = _implementations()
    outputs: dict[str, torch.Tensor] = {}

    def forward(name: str) -> None:
        outputs[name] = implementations[name](q, k, v)

    functions: dict[str, Callable[[], Any]] = {}
    for name, function in implementations.items():
        functions[f"{name} fwd"] = partial(forward, name)
        functions[f"{name} fwd+bwd"] = partial(_forward_backward, function, q, k, v, dout)
    samples = in_ms(
        interleaved(
            functions,
            repeats,
            warmup,
            calls=1,
            clock=wall_clock(synchronizer(device)),
            contexts={f"{name} fwd": torch.no_grad for name in implementations},
            after_sample=gc.collect,  # the naive backend's (L, L) buffers must not linger into the next timing
        )
    )
    reference = outputs["torch sdpa"].double()
    rows = {
        name: {
            "forward_ms": statistics.median(samples[f"{name} fwd"]),
            "forward_backward_ms": statistics.median(samples[f"{name} fwd+bwd"]),
            "max_abs_diff_vs_sdpa": float((outputs[name].double() - reference).abs().max()),
            "forward_samples_ms": samples[f"{name} fwd"],
            "forward_backward_samples_ms": samples[f"{name} fwd+bwd"],
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


def _memory_child(name: str, seq_len: int, threads: int) -> None:
    """In a fresh process: print the peak RSS growth of one forward+backward of ``name``, as JSON."""
    import torch

    torch.set_num_threads(threads)
    function = _implementations()[name]
    _forward_backward(function, *_chunked_inputs(64, "cpu"))  # load modules and kernels before measuring
    inputs = _chunked_inputs(seq_len, "cpu")
    print_peak(lambda: _forward_backward(function, *inputs))


def bench_memory(seq_len: int = 16384) -> dict[str, Any]:
    """Peak extra host memory of one causal forward+backward on CPU, each implementation in a fresh process.

    Peak extra = VmHWM after the call minus VmRSS before it, with q, k, v and dout already allocated: it counts
    the output, the gradients and every temporary. Runs with the calling process's torch thread count. Linux only.
    torch-naive is not run: its float32 (B, H, L, L) score matrix alone is reported instead.
    """
    import torch

    threads = torch.get_num_threads()
    rows = {name: run_child(_MEMORY_CHILD, [name, str(seq_len), str(threads)], name) for name in MEMORY_MEASURED}
    shape = CHUNKED_SHAPE
    return {
        "what": "memory",
        "environment": environment("cpu"),
        "shape": {**shape, "len": seq_len, "dtype": "float32", "causal": True},
        "results": rows,
        "naive_score_matrix_bytes": shape["batch"] * shape["heads"] * seq_len**2 * 4,
    }


def format_chunked(result: dict[str, Any]) -> str:
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
            device_banner(result),
            f"causal attention B={shape['batch']} H={shape['heads']} L={shape['len']} D={shape['head_dim']} float32; "
            f"median of {result['repeats']} repeats after {result['warmup']} warm-up",
            format_table(["implementation", "fwd ms", "fwd+bwd ms", "fwd+bwd vs sdpa", "max|out-sdpa|"], rows),
        ]
    )


def format_memory(result: dict[str, Any]) -> str:
    shape = result["shape"]
    rows = [
        [name, f"{row['peak_extra_bytes'] / 2**20:.0f}", f"{row['seconds']:.2f}"]
        for name, row in result["results"].items()
    ]
    score_bytes = result["naive_score_matrix_bytes"]
    return "\n".join(
        [
            device_banner(result),
            f"peak extra memory of one causal forward+backward, B={shape['batch']} H={shape['heads']} "
            f"L={shape['len']} D={shape['head_dim']} float32: VmHWM after minus VmRSS before (q, k, v, dout "
            "already allocated), each in a fresh process",
            format_table(["implementation", "peak extra MiB", "fwd+bwd s"], rows),
            f"torch-naive not run: its float32 (B, H, L, L) score matrix alone is {score_bytes / 2**20:.0f} MiB "
            f"({score_bytes / 1e9:.1f} GB)",
        ]
    )
