"""``attnkit bench --backend NAME``: one backend's forward, backward and forward+backward in TFLOP/s at the
FlashAttention-2 paper's shapes, against its framework's own attention in the same run: on a GPU each of its
kernels pinned (torch SDPA's cuDNN and FlashAttention-2 backends, flash-attn when installed;
jax.nn.dot_product_attention's cuDNN and XLA implementations), the L2 cache flushed between samples."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any, Literal

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
#: More than an H100's 50 MB of L2: writing it between samples leaves no operand of the last call cached.
L2_FLUSH_BYTES = 256 << 20


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


def _torch_peers(causal: bool, on_gpu: bool) -> dict[str, Callable[..., Any]]:
    """torch SDPA on bhsd inputs: as it picks on a CPU; on a GPU each kernel pinned, and flash-attn (bshd) if
    installed."""
    import torch.nn.functional as F

    if not on_gpu:
        return {_PEERS["torch"]: lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def pinned(kernel: Any) -> Callable[..., Any]:
        def attention(q: Any, k: Any, v: Any) -> Any:
            with sdpa_kernel(kernel):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return attention

    peers = {"sdpa cudnn": pinned(SDPBackend.CUDNN_ATTENTION), "sdpa flash": pinned(SDPBackend.FLASH_ATTENTION)}
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return peers

    def flash_attn(q: Any, k: Any, v: Any) -> Any:
        return flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=causal).transpose(1, 2)

    return {**peers, "flash-attn": flash_attn}


def _jax_peers(causal: bool, on_gpu: bool) -> dict[str, Callable[..., Any]]:
    """jax.nn.dot_product_attention on bhsd inputs (it takes bshd): as it picks on a CPU, pinned to cuDNN and to
    XLA on a GPU."""
    import jax

    def peer(implementation: Literal["xla", "cudnn"] | None) -> Callable[..., Any]:
        def attention(q: Any, k: Any, v: Any) -> Any:
            bshd = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
            out = jax.nn.dot_product_attention(*bshd, is_causal=causal, implementation=implementation)
            return out.transpose(0, 2, 1, 3)

        return attention

    if not on_gpu:
        return {_PEERS["jax"]: peer(None)}
    return {"jax cudnn": peer("cudnn"), "jax xla": peer("xla")}


def _runs(attention: Callable[..., Any], q: Any, k: Any, v: Any) -> str | None:
    """None if ``attention`` runs on these inputs, else why not (a pinned kernel the GPU or the shape lacks)."""
    try:
        attention(q, k, v)
    except Exception as error:  # each library raises its own: RuntimeError, ValueError, NotImplementedError
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


def _l2_flush(device: str) -> Callable[[], Any] | None:
    """Overwrites a buffer larger than the GPU's L2 cache; None off a GPU."""
    if device != "cuda":
        return None
    import torch

    scratch = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    return lambda: scratch.fill_(1)


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
    flush = _l2_flush(device)

    def milliseconds(function: Callable[[], Any]) -> float:
        samples = interleaved({name: function}, repeats, warmup, calls=1, clock=clock, after_sample=flush)
        return statistics.median(samples[name]) / 1e6

    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}  # a peer that cannot run here, and why
    peers_of = _torch_peers if framework is Framework.TORCH else _jax_peers
    for head_dim in head_dims:
        for seq_len in seq_lens:
            batch, heads = max(1, tokens // seq_len), max(1, hidden // head_dim)
            shape = (batch, heads, seq_len, head_dim)
            q, k, v, dout = random_inputs(framework, shape, shape, dtype, device)
            for causal in (False, True):
                spec = attnkit.AttentionSpec(causal=causal)  # Lq == Lk: bottom-right equals the peers' top-left
                implementations = {
                    name: lambda q, k, v, spec=spec: attnkit.attend(spec, q, k, v, backend=name),
                    **peers_of(causal, on_gpu),
                }
                for implementation, attention in implementations.items():
                    if implementation != name and implementation not in skipped:
                        reason = _runs(attention, q, k, v)
                        if reason is not None:
                            skipped[implementation] = reason
                    if implementation in skipped:
                        continue
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
        "peers": list(dict.fromkeys(row["implementation"] for row in rows if row["implementation"] != name)),
        "skipped_peers": skipped,
        "l2_flush": flush is not None,
        "backend_description": backend.capabilities.description,
        "environment": environment(device),
        "dtype": dtype,
        "repeats": repeats,
        "warmup": warmup,
        "results": rows,
    }


def format_backend(result: dict[str, Any]) -> str:
    by_shape: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in result["results"]:
        by_shape.setdefault((row["head_dim"], row["seq_len"], row["causal"]), {})[row["implementation"]] = row

    def ratio(row: dict[str, Any], peer: str) -> str:
        other = by_shape[row["head_dim"], row["seq_len"], row["causal"]].get(peer)
        if other is None or not other["fwd+bwd_tflops"] or not row["fwd+bwd_tflops"]:
            return "n/a"
        return f"{row['fwd+bwd_tflops'] / other['fwd+bwd_tflops']:.2f}x"

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
            *(ratio(row, peer) for peer in result["peers"]),
        ]
        for row in result["results"]
    ]
    lines = [device_banner(result)]
    if result["environment"]["device"] != "cuda":
        lines.append(
            f"NOT A PERFORMANCE FIGURE: on CPU, {result['backend']} runs as {result['backend_description']!r}; "
            "this run only shows the benchmark works. Run it on a CUDA machine with --device cuda."
        )
    flushed = ", the L2 cache flushed between samples" if result["l2_flush"] else ""
    lines += [
        f"{result['backend']} against {', '.join(result['peers'])}, {result['dtype']}, TFLOP/s (median ms) of "
        f"{result['repeats']} repeats after {result['warmup']} warm-up{flushed}; FLOPs as in the FlashAttention-2 "
        "paper",
        format_table(
            ["implementation", "causal", "D", "L", "BxH", "fwd", "bwd", "fwd+bwd"]
            + [f"fwd+bwd vs {peer}" for peer in result["peers"]],
            rows,
        ),
    ]
    lines += [f"not run: {peer} ({reason})" for peer, reason in result["skipped_peers"].items()]
    return "\n".join(lines)
