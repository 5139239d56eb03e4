"""``attnkit bench --backend NAME``: one backend's forward, backward and forward+backward in TFLOP/s at the
FlashAttention-2 paper's shapes, against its framework's own attention (torch SDPA, jax.nn.dot_product_attention)
in the same run."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from attnkit.bench.calls import attention_flops, random_inputs
from attnkit.bench.timing import (
    blocked,
    cuda_event_clock,
    device_banner,
    environment,
    interleaved,
    wall_clock,
)
from attnkit.tables import format_table

# FlashAttention-2 paper, section 4.1: 16k tokens per batch (B = 16384 / L), hidden size 2048 (H = 2048 / D).
PAPER_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
PAPER_TOKENS = 16384
PAPER_HIDDEN = 2048
# The Triton and Pallas interpreters run one program at a time in NumPy: a CPU run only shows the benchmark works.
CPU_SEQ_LENS = (128,)
CPU_TOKENS = 256
CPU_HIDDEN = 128
_PEERS = {"torch": "torch sdpa", "jax": "jax.nn.dot_product_attention"}


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


def _peer(framework: Any, causal: bool) -> Callable[..., Any]:
    """The framework's own attention on bhsd inputs: torch SDPA, or jax.nn.dot_product_attention (bshd)."""
    if framework == "torch":
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
    return {"fwd": lambda: blocked(forward, q, k, v), "fwd+bwd": lambda: blocked(gradients, q, k, v)}


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
    # CUDA events time torch's queued GPU work; JAX calls block on their results, so the wall clock serves them.
    clock = cuda_event_clock() if on_gpu and framework is Framework.TORCH else wall_clock()

    def milliseconds(function: Callable[[], Any]) -> float:
        return statistics.median(interleaved({name: function}, repeats, warmup, calls=1, clock=clock)[name]) / 1e6

    rows = []
    for head_dim in head_dims:
        for seq_len in seq_lens:
            batch, heads = max(1, tokens // seq_len), max(1, hidden // head_dim)
            shape = (batch, heads, seq_len, head_dim)
            q, k, v, dout = random_inputs(framework, shape, shape, dtype, device)
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
                            elapsed: float | None = milliseconds(passes[pass_name])
                        else:  # JAX: the backward is what fwd+bwd adds to fwd (None when noise hides it)
                            difference = row["fwd+bwd_ms"] - row["fwd_ms"]
                            elapsed = difference if difference > 0 else None
                        flops = attention_flops(batch, heads, seq_len, head_dim, causal, pass_name)
                        row[f"{pass_name}_ms"] = elapsed
                        row[f"{pass_name}_tflops"] = flops / (elapsed * 1e9) if elapsed else None
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
    lines = [device_banner(result)]
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
