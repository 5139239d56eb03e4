"""``attnkit bench --backend NAME``: one backend's forward, backward and forward+backward in TFLOP/s at the
FlashAttention-2 paper's shapes, against its framework's own attention in the same run: on a GPU each of its
kernels pinned (torch SDPA's cuDNN and FlashAttention-2 backends, flash-attn when installed;
jax.nn.dot_product_attention's cuDNN and XLA implementations), the L2 cache flushed between samples.

``peers`` picks the peers by name (:data:`PEER_NAMES`), from either framework: ``pallas`` (a JAX backend) against
``sdpa-cudnn,sdpa-flash`` times each implementation on inputs of its own framework, torch work with CUDA events and
JAX work with the wall clock around a blocked call. ``shapes`` replaces the paper's grid with explicit
(B, H, Lq, Lk, D) shapes, decode (Lq = 1) included."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from attnkit.bench.calls import attention_flops, random_inputs
from attnkit.bench.timing import (
    MIN_WARMUP,
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


def _sdpa(causal: bool, kernel: str | None) -> Callable[..., Any]:
    """torch SDPA on bhsd inputs, as it picks (``kernel`` None) or pinned to one SDPBackend member."""
    import torch.nn.functional as F

    if kernel is None:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pinned = getattr(SDPBackend, kernel)

    def attention(q: Any, k: Any, v: Any) -> Any:
        with sdpa_kernel(pinned):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return attention


def _flash_attn(causal: bool) -> Callable[..., Any]:
    """flash-attn 2's flash_attn_func (bshd) on bhsd inputs; ImportError where it is not installed."""
    from flash_attn import flash_attn_func

    def attention(q: Any, k: Any, v: Any) -> Any:
        return flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=causal).transpose(1, 2)

    return attention


def _jax_dpa(causal: bool, implementation: Literal["xla", "cudnn"] | None) -> Callable[..., Any]:
    """jax.nn.dot_product_attention on bhsd inputs (it takes bshd)."""
    import jax

    def attention(q: Any, k: Any, v: Any) -> Any:
        bshd = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
        out = jax.nn.dot_product_attention(*bshd, is_causal=causal, implementation=implementation)
        return out.transpose(0, 2, 1, 3)

    return attention


@dataclass(frozen=True)
class Peer:
    """A framework's own attention the bench can time a backend against: its row label, its framework, and a
    factory of the function for ``causal`` (top-left, as these libraries align it: only used where Lq == Lk)."""

    label: str
    framework: str
    make: Callable[[bool], Callable[..., Any]]


#: Every peer by its ``--peer`` name. The labels are the bench's row names (kept from before the names existed).
PEERS: dict[str, Peer] = {
    "sdpa": Peer("torch sdpa", "torch", lambda causal: _sdpa(causal, None)),
    "sdpa-cudnn": Peer("sdpa cudnn", "torch", lambda causal: _sdpa(causal, "CUDNN_ATTENTION")),
    "sdpa-flash": Peer("sdpa flash", "torch", lambda causal: _sdpa(causal, "FLASH_ATTENTION")),
    "sdpa-efficient": Peer("sdpa efficient", "torch", lambda causal: _sdpa(causal, "EFFICIENT_ATTENTION")),
    "sdpa-math": Peer("sdpa math", "torch", lambda causal: _sdpa(causal, "MATH")),
    "flash-attn": Peer("flash-attn", "torch", _flash_attn),
    "jax": Peer("jax.nn.dot_product_attention", "jax", lambda causal: _jax_dpa(causal, None)),
    "jax-cudnn": Peer("jax cudnn", "jax", lambda causal: _jax_dpa(causal, "cudnn")),
    "jax-xla": Peer("jax xla", "jax", lambda causal: _jax_dpa(causal, "xla")),
}
PEER_NAMES = tuple(PEERS)


def default_peers(framework: str, on_gpu: bool) -> tuple[str, ...]:
    """The peers without ``--peer``: the framework's attention as it picks on a CPU; on a GPU each of its kernels
    pinned, and flash-attn for torch (dropped, with the reason, where it is not installed)."""
    if not on_gpu:
        return ("sdpa",) if framework == "torch" else ("jax",)
    return ("sdpa-cudnn", "sdpa-flash", "flash-attn") if framework == "torch" else ("jax-cudnn", "jax-xla")


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """``BxHxLQxLKxD`` (or ``BxHxLxD`` for Lq == Lk) as (B, H, Lq, Lk, D)."""
    parts = [int(part) for part in text.lower().split("x")]
    if len(parts) == 4:
        parts.insert(3, parts[2])
    if len(parts) != 5 or min(parts) < 1:
        raise ValueError(f"shape {text!r}: expected BxHxLQxLKxD or BxHxLxD with positive integers")
    batch, heads, len_q, len_k, head_dim = parts
    return batch, heads, len_q, len_k, head_dim


def paper_shapes(seq_lens: tuple[int, ...], head_dims: tuple[int, ...], tokens: int, hidden: int) -> list[Any]:
    """The FlashAttention-2 paper's grid: ``tokens`` per batch (B = tokens / L), ``hidden`` = H * D."""
    return [
        (max(1, tokens // seq_len), max(1, hidden // head_dim), seq_len, seq_len, head_dim)
        for head_dim in head_dims
        for seq_len in seq_lens
    ]


def _first_call(attention: Callable[..., Any], q: Any, k: Any, v: Any, on_gpu: bool) -> tuple[str | None, float]:
    """The first call of ``attention`` on these inputs, timed (ms, the GPU's queue or JAX's dispatch waited for): the
    cold call a user's first step pays (a build, a compile, lazy imports), which the timed samples never include;
    and None if it ran, else why not (a pinned kernel the GPU or the shape lacks)."""
    start = time.perf_counter()
    try:
        out = attention(q, k, v)
        if hasattr(out, "block_until_ready"):
            out.block_until_ready()
        elif on_gpu:
            import torch

            torch.cuda.synchronize()
    except Exception as error:  # each library raises its own: RuntimeError, ValueError, NotImplementedError
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", math.nan
    return None, (time.perf_counter() - start) * 1e3


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


#: The passes timed by default; ``bwd`` alone runs on a graph built outside the timing (torch), or is fwd+bwd minus
#: fwd (JAX).
PASSES = ("fwd", "bwd", "fwd+bwd")


def _clock(framework: str, on_gpu: bool) -> Any:
    """CUDA events time torch's queued GPU work; JAX calls block on their results, so the wall clock serves them."""
    return cuda_event_clock() if on_gpu and framework == "torch" else wall_clock()


def bench_backend(
    name: str,
    device: str = "cpu",
    seq_lens: tuple[int, ...] | None = None,
    head_dims: tuple[int, ...] = (64, 128),
    dtype: str = "bfloat16",
    repeats: int = 10,
    warmup: int = 3,
    peers: tuple[str, ...] | None = None,
    shapes: list[tuple[int, int, int, int, int]] | None = None,
    passes: tuple[str, ...] = PASSES,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """fwd, bwd and fwd+bwd TFLOP/s of a backend and of its peers (by default its framework's own attention: torch
    SDPA for torch backends, jax.nn.dot_product_attention for JAX ones; ``peers`` names others, of either framework),
    causal and not, at the FlashAttention-2 paper's shapes on a GPU (tiny shapes on CPU, where the figures are not
    performance figures) or at ``shapes`` (B, H, Lq, Lk, D).

    Causal rows are timed only where Lq == Lk: the peers align causal masks top-left and attnkit bottom-right, which
    agree only there. Backward passes are not timed where Lq == 1 (a decode step is inference). A call that raises
    is recorded in its row (``error``, or ``<pass>_error``) and the run goes on: a first GPU run must report every
    backend, not stop at the first refusal."""
    import attnkit
    from attnkit.backend import runs_interpreted
    from attnkit.testing.runners import native_framework

    backend = attnkit.get_backend(name)
    reasons = backend.available()
    if reasons:
        raise attnkit.BackendUnavailableError(f"backend={name!r} cannot run here: {'; '.join(reasons)}")
    unknown = [peer for peer in peers or () if peer not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)} (known: {', '.join(PEER_NAMES)})")
    unknown = [name for name in passes if name not in PASSES]
    if unknown or not passes:
        raise ValueError(f"passes {list(passes)}: choose among {', '.join(PASSES)}")
    framework = native_framework(name).value
    on_gpu = device == "cuda"
    if shapes is None:
        tokens, hidden = (PAPER_TOKENS, PAPER_HIDDEN) if on_gpu else (CPU_TOKENS, CPU_HIDDEN)
        shapes = paper_shapes(seq_lens or (PAPER_SEQ_LENS if on_gpu else CPU_SEQ_LENS), head_dims, tokens, hidden)
    chosen = peers if peers is not None else default_peers(framework, on_gpu)
    flush = _l2_flush(device)
    clocks = {kind: _clock(kind, on_gpu) for kind in ("torch", "jax")}
    say = progress or (lambda message: None)

    def milliseconds(function: Callable[[], Any], kind: str) -> float:
        samples = interleaved({name: function}, repeats, warmup, calls=1, clock=clocks[kind], after_sample=flush)
        return statistics.median(samples[name]) / 1e6

    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}  # a peer that cannot run here (its first failure), and why
    for batch, heads, len_q, len_k, head_dim in shapes:
        inputs: dict[str, Any] = {}  # per framework, made once per shape
        for causal in (False, True) if len_q == len_k else (False,):
            spec = attnkit.AttentionSpec(causal=causal)  # Lq == Lk: bottom-right equals the peers' top-left
            implementations: dict[str, tuple[str, Callable[[bool], Callable[..., Any]]]] = {
                name: (framework, _backend_call(name, spec))
            }
            for peer in chosen:
                implementations[PEERS[peer].label] = (PEERS[peer].framework, PEERS[peer].make)
            for implementation, (kind, make) in implementations.items():
                say(f"{implementation} B={batch} H={heads} Lq={len_q} Lk={len_k} D={head_dim} causal={causal}")
                row: dict[str, Any] = {
                    "implementation": implementation,
                    "framework": kind,
                    "seq_len": len_q,
                    "len_k": len_k,
                    "head_dim": head_dim,
                    "batch": batch,
                    "heads": heads,
                    "causal": causal,
                }
                rows.append(row)
                try:
                    if kind not in inputs:
                        q_shape, kv_shape = (batch, heads, len_q, head_dim), (batch, heads, len_k, head_dim)
                        inputs[kind] = random_inputs(kind, q_shape, kv_shape, dtype, device)
                    q, k, v, dout = inputs[kind]
                    attention = make(causal)
                except Exception as error:  # a peer whose library is missing (flash-attn), or a framework
                    row["error"] = _reason(error)
                else:
                    row["error"], row["first_call_ms"] = _first_call(attention, q, k, v, on_gpu)
                if row["error"] is not None:
                    if implementation != name:
                        skipped.setdefault(implementation, row["error"])
                    continue
                timed = passes if len_q > 1 else tuple(p for p in passes if p == "fwd")
                if kind == "torch":
                    functions = _torch_passes(attention, q, k, v, dout)
                else:
                    functions = _jax_passes(attention, q, k, v, dout)
                for pass_name in PASSES:
                    row[f"{pass_name}_ms"] = row[f"{pass_name}_tflops"] = None
                for pass_name in sorted(timed, key=PASSES.index):
                    if pass_name == "bwd" and "bwd" not in functions:
                        # JAX: the backward is what fwd+bwd adds to fwd (None when noise hides it, or one is missing)
                        total, forward = (
                            _timed(row, "fwd+bwd", functions, milliseconds, kind),
                            _timed(row, "fwd", functions, milliseconds, kind),
                        )
                        difference = total - forward if total is not None and forward is not None else None
                        elapsed = difference if difference is not None and difference > 0 else None
                    else:
                        elapsed = _timed(row, pass_name, functions, milliseconds, kind)
                    flops = attention_flops(batch, heads, len_q, head_dim, causal, pass_name, len_k=len_k)
                    row[f"{pass_name}_ms"] = elapsed
                    row[f"{pass_name}_tflops"] = flops / (elapsed * 1e9) if elapsed else None
                for key in [key for key in row if key.startswith("_")]:
                    del row[key]  # _timed's memo
    return {
        "what": "backend",
        "backend": name,
        "framework": framework,
        "peers": list(dict.fromkeys(row["implementation"] for row in rows if row["implementation"] != name)),
        "skipped_peers": skipped,
        "l2_flush": flush is not None,
        "clocks": {"torch": "cuda events" if on_gpu else "wall clock", "jax": "wall clock, blocked on the result"},
        "backend_description": backend.capabilities.description,
        "backend_devices": sorted(backend.capabilities.devices),
        "interpreted": runs_interpreted(backend, device),
        "environment": environment(device),
        "dtype": dtype,
        "repeats": repeats,
        "warmup": max(warmup, MIN_WARMUP),
        "passes": list(passes),
        "results": rows,
    }


def _backend_call(name: str, spec: Any) -> Callable[[bool], Callable[..., Any]]:
    """A peer-like factory of ``attend(spec, ..., backend=name)`` (the spec already carries the causality)."""
    import attnkit

    def make(_causal: bool) -> Callable[..., Any]:
        return lambda q, k, v: attnkit.attend(spec, q, k, v, backend=name)

    return make


def _reason(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _timed(
    row: dict[str, Any],
    pass_name: str,
    functions: dict[str, Callable[[], Any]],
    milliseconds: Callable[[Callable[[], Any], str], float],
    kind: str,
) -> float | None:
    """The median ms of one pass, once per row (JAX's bwd reuses fwd and fwd+bwd); None, with ``<pass>_error`` in
    the row, where it raised."""
    key = f"_{pass_name}_measured"
    if key not in row:
        if pass_name == "bwd" and "build" in functions:
            functions["build"]()  # the graph the backward walks, outside the timing
        try:
            row[key] = milliseconds(functions[pass_name], kind)
        except Exception as error:  # a backward the backend refuses or a kernel that fails: recorded, not raised
            row[f"{pass_name}_error"] = _reason(error)
            row[key] = None
    return row[key]


def ratios(result: dict[str, Any], pass_name: str = "fwd+bwd") -> list[dict[str, Any]]:
    """The backend's TFLOP/s over each peer's at the same shape and causality, for one pass."""
    rows = result["results"]
    peers = {
        (
            row["implementation"],
            row["batch"],
            row["heads"],
            row["seq_len"],
            row["len_k"],
            row["head_dim"],
            row["causal"],
        ): row
        for row in rows
    }
    found = []
    for row in rows:
        if row["implementation"] != result["backend"]:
            continue
        shape = (row["batch"], row["heads"], row["seq_len"], row["len_k"], row["head_dim"], row["causal"])
        for peer in result["peers"]:
            other = peers.get((peer, *shape))
            mine, theirs = row.get(f"{pass_name}_tflops"), other and other.get(f"{pass_name}_tflops")
            if mine and theirs:
                found.append({"peer": peer, "shape": shape, "pass": pass_name, "ratio": mine / theirs})
    return found


#: How the advice names a device (``--device`` value -> words): every device the bench runs on.
DEVICE_WORDS = {"cpu": "a CPU", "cuda": "a CUDA GPU"}


def device_advice(result: dict[str, Any]) -> str | None:
    """What the figures of ``result`` are figures of, from the backend's own declared devices
    (``capabilities.devices``) and whether it ran interpreted: on a device it does not run its kernels on (an
    interpreter, an emulator), not a performance figure, and the device that gives one; on one of its devices, its
    figures there, and its other devices, if any, named with the ``--device`` that measures them; None for a
    backend's only device."""
    measured = result["environment"]["device"]
    devices = result.get("backend_devices", ["cuda"])  # results written before the field: GPU kernel backends
    others = [device for device in devices if device != measured]

    def where(names: list[str]) -> str:
        return " or ".join(f"{DEVICE_WORDS.get(name, name)} (--device {name})" for name in names)

    name = result["backend"]
    if result.get("interpreted", measured != "cuda") or measured not in devices:
        # An interpreter may declare only the device it emulates on (triton under TRITON_INTERPRET=1): its kernels
        # are then for the bench's other devices.
        others = others or [device for device in DEVICE_WORDS if device != measured]
        return (
            f"NOT A PERFORMANCE FIGURE: on {measured}, {name} runs as {result['backend_description']!r}, "
            f"interpreted or emulated; this run only shows the benchmark works. Its kernels run on {where(others)}: "
            "rerun it there."
        )
    if others:
        return f"{measured} figures of {name}; it also runs on {where(others)}: rerun there for those figures."
    return None


def format_backend(result: dict[str, Any]) -> str:
    by_shape: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in result["results"]:
        key = (row["batch"], row["heads"], row["seq_len"], row.get("len_k", row["seq_len"]), row["head_dim"])
        by_shape.setdefault((*key, row["causal"]), {})[row["implementation"]] = row
    passes = [name for name in PASSES if name in result.get("passes", PASSES)]
    compared = [name for name in ("fwd", "fwd+bwd") if name in passes]

    def ratio(row: dict[str, Any], peer: str, pass_name: str) -> str:
        key = (row["batch"], row["heads"], row["seq_len"], row.get("len_k", row["seq_len"]), row["head_dim"])
        other = by_shape[(*key, row["causal"])].get(peer)
        mine, theirs = row.get(f"{pass_name}_tflops"), other and other.get(f"{pass_name}_tflops")
        return f"{mine / theirs:.2f}x" if mine and theirs else "n/a"

    def cell(row: dict[str, Any], pass_name: str) -> str:
        if row.get("error"):
            return "error"
        if row.get(f"{pass_name}_error"):
            return "error"
        elapsed = row.get(f"{pass_name}_ms")
        return f"{row[f'{pass_name}_tflops']:.3g} ({elapsed:.3g} ms)" if elapsed else "n/a"

    def first_call(row: dict[str, Any]) -> str:
        elapsed = row.get("first_call_ms")
        return f"{elapsed:.3g}" if elapsed is not None and not math.isnan(elapsed) else "n/a"

    def length(row: dict[str, Any]) -> str:
        len_k = row.get("len_k", row["seq_len"])
        return str(row["seq_len"]) if len_k == row["seq_len"] else f"{row['seq_len']}/{len_k}"

    rows = [
        [
            row["implementation"],
            "yes" if row["causal"] else "no",
            str(row["head_dim"]),
            length(row),
            f"{row['batch']}x{row['heads']}",
            *(cell(row, name) for name in passes),
            *(ratio(row, peer, name) for peer in result["peers"] for name in compared),
            first_call(row),
        ]
        for row in result["results"]
    ]
    lines = [device_banner(result)]
    advice = device_advice(result)
    if advice:
        lines.append(advice)
    flushed = ", the L2 cache flushed between samples" if result["l2_flush"] else ""
    lines += [
        f"{result['backend']} against {', '.join(result['peers']) or 'no peer'}, {result['dtype']}, TFLOP/s (median "
        f"ms) of {result['repeats']} repeats after {result['warmup']} warm-up{flushed}; FLOPs as in the "
        "FlashAttention-2 paper; L is Lq/Lk where they differ; first call: the cold first forward at the shape "
        "(builds, compiles), apart from the medians",
        format_table(
            ["implementation", "causal", "D", "L", "BxH", *passes]
            + [f"{name} vs {peer}" for peer in result["peers"] for name in compared]
            + ["first call ms"],
            rows,
        ),
    ]
    lines += [f"not run: {peer} ({reason})" for peer, reason in result["skipped_peers"].items()]
    for row in result["results"]:
        if row["implementation"] != result["backend"]:
            continue
        errors = [f"{name}: {row[f'{name}_error']}" for name in PASSES if row.get(f"{name}_error")]
        if row.get("error"):
            errors.insert(0, row["error"])
        if errors:
            lines.append(f"{result['backend']} failed at {row['batch']}x{row['heads']} L={length(row)} "
                         f"D={row['head_dim']} causal={row['causal']}: {'; '.join(errors)}")  # fmt: skip
    return "\n".join(lines)
