"""``attnkit bench --what targets``: attnkit's CPU performance targets, each against its peer in the same run.

Four targets, at B=1, H=8, D=64 (docs/performance.md, "Targets"):

* ``torch``: ``attend(AttentionSpec(causal=c, causal_alignment="top_left"), q, k, v)`` (``auto``) against
  ``F.scaled_dot_product_attention(q, k, v, is_causal=c)`` called directly: throughput ratio >= 0.95.
* ``jax``: ``jax.jit(lambda q, k, v: attend(spec, q, k, v))`` against
  ``jax.jit(partial(jax.nn.dot_product_attention, is_causal=c))`` on bshd arrays: ratio >= 0.95.
* ``non-native``: specs SDPA cannot compute natively (softcap, window, kv lengths, cosine, bottom-right with
  Lq != Lk). ``auto`` and every attnkit torch backend that can serve the call (interpreters and emulators excluded)
  are timed; the best of them must reach >= 0.7x the throughput (calls per second) of SDPA's plain causal call at
  the same (Lq, Lk), with peak extra memory linear in L (measured in a fresh process per point).
* ``decode``: ``attend`` on a decode-size call (Lq=1, Lk=128) costs <= 3 us over the direct SDPA call, under
  ``torch.no_grad()`` and with autograd recording; what recording itself costs is reported beside it.

Peers are timed in the same run, interleaved: each repeat runs every implementation of a cell once (the order
rotating per repeat), so drift on a shared machine hits them alike; figures are medians over repeats. Which backend
``auto`` runs is asked of :func:`attnkit.dispatch.select`, never assumed.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from attnkit.bench.calls import (
    PASS_WORK,
    attention_flops,
    auto_choice,
    call_problem,
    interpreted,
    random_inputs,
)
from attnkit.bench.decode import block_runner, length_blocks
from attnkit.bench.peak_memory import peak_extra_bytes, run_child
from attnkit.bench.timing import (
    blocked,
    device_banner,
    environment,
    in_ms,
    interleaved,
    paired_difference,
    paired_ratio,
)
from attnkit.spec import AttentionSpec
from attnkit.tables import format_table

TARGET_SEQ_LENS = (512, 2048, 4096)
TARGET_DTYPES = ("float32", "bfloat16")
TARGET_PASSES = ("fwd", "fwd+bwd")
TARGETS = ("torch", "jax", "non-native", "decode")
SHAPE = {"batch": 1, "heads": 8, "head_dim": 64}
DECODE_SHAPE = {"batch": 1, "heads": 8, "len_q": 1, "len_k": 128, "head_dim": 64}
PEER_RATIO = 0.95  # auto against the framework's own attention
AUTO_VS_SDPA_RATIO = 0.97  # issue 32: auto against SDPA after the first call of each bucket, which measures
NON_NATIVE_RATIO = 0.7  # best attnkit path against SDPA's plain causal call at the same shape, in FLOP/s
DECODE_BUDGET_US = 3.0
LINEAR_EXPONENT = 1.2  # memory ~ L**e between the two largest L: e <= this counts as linear
#: torch-naive materialises (B, H, Lq, Lk) float32 scores several times over: timed only up to this size.
NAIVE_MAX_SCORE_BYTES = 32 * 2**20
SDPA_PEER = "torch sdpa"
JAX_PEER = "jax.nn.dot_product_attention"
SDPA_CAUSAL = "sdpa plain causal"
SDPA_CAUSAL_SPEC = AttentionSpec(causal=True, causal_alignment="top_left")  # what is_causal=True computes


# ---------------------------------------------------------------------------------------------- helpers


def visible_flops(spec: Any, len_q: int, len_k: int, kv_lengths: Any, pass_name: str) -> float:
    """attention_flops' count for the (query, key) pairs this call's spec and lengths leave visible (cost.py): a
    batch element with kv_lengths[b] keys computes what a call of shape (Lq, kv_lengths[b]) does."""
    from attnkit.cost import visible_pairs

    key_counts = [len_k] if kv_lengths is None else [int(n) for n in kv_lengths]
    pairs = sum(visible_pairs(spec, len_q, count) for count in key_counts) / len(key_counts)
    per_pair = 4.0 * SHAPE["batch"] * SHAPE["heads"] * SHAPE["head_dim"]
    return per_pair * pairs * PASS_WORK[pass_name]


def flops(len_q: int, len_k: int, causal: bool, pass_name: str) -> float:
    """attnkit.bench.calls.attention_flops at B=1, H=8, D=64, for Lq != Lk too (scaled by Lq / Lk)."""
    square = attention_flops(SHAPE["batch"], SHAPE["heads"], len_k, SHAPE["head_dim"], causal, pass_name)
    return square * len_q / len_k


def _torch_inputs(len_q: int, len_k: int, dtype: str) -> tuple[Any, Any, Any, Any]:
    batch, heads, dim = SHAPE["batch"], SHAPE["heads"], SHAPE["head_dim"]
    return random_inputs("torch", (batch, heads, len_q, dim), (batch, heads, len_k, dim), dtype)


def torch_pass(attention: Callable[..., Any], q: Any, k: Any, v: Any, dout: Any, pass_name: str) -> Callable[[], Any]:
    """One call of ``attention(q, k, v)``: the forward on plain tensors, or forward+backward (``out.backward``)
    on leaves requiring grad, their .grad cleared first."""
    if pass_name == "fwd":
        return lambda: attention(q, k, v)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

    def forward_backward() -> None:
        for leaf in leaves:
            leaf.grad = None
        attention(*leaves).backward(dout)

    return forward_backward


def _leaves_like(q: Any, k: Any, v: Any, pass_name: str) -> tuple[Any, Any, Any]:
    """Tensors with the grad flags the pass gives the call (what dispatch sees)."""
    if pass_name == "fwd":
        return q, k, v
    return tuple(t.detach().requires_grad_(True) for t in (q, k, v))  # type: ignore[return-value]


def _row(**values: Any) -> dict[str, Any]:
    return values


def interleaved_ms(functions: Mapping[str, Callable[[], Any]], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Milliseconds per call of each function, one sample per repeat (:func:`attnkit.bench.timing.interleaved`,
    each sample lasting about ``MIN_SAMPLE_S``)."""
    return in_ms(interleaved(functions, repeats, warmup))


# ---------------------------------------------------------------------------------------------- torch, jax


def bench_torch_target(seq_lens: Sequence[int], dtypes: Sequence[str], repeats: int, warmup: int) -> dict[str, Any]:
    """auto against SDPA per cell. Measuring records go to a fresh directory for the run, so each cell's first auto
    call measures (where the config lets auto measure: attnkit/autotune.py) as a user's first call of the bucket
    would; that call is timed alone, before the warm-up and the interleaved repeats, and reported as what measuring
    cost in calls of the slowest contender."""
    import tempfile

    import torch.nn.functional as F

    import attnkit
    from attnkit import autotune

    rows = []
    with tempfile.TemporaryDirectory(prefix="attnkit-bench-records-") as fresh, autotune.STORE.use_directory(fresh):
        _dispatch_warmed()
        for dtype in dtypes:
            for seq_len in seq_lens:
                q, k, v, dout = _torch_inputs(seq_len, seq_len, dtype)
                for causal in (False, True):
                    spec = attnkit.AttentionSpec(causal=causal, causal_alignment="top_left")
                    for pass_name in TARGET_PASSES:

                        def sdpa(q: Any, k: Any, v: Any, causal: bool = causal) -> Any:
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                        def auto(q: Any, k: Any, v: Any, spec: Any = spec) -> Any:
                            return attnkit.attend(spec, q, k, v)

                        auto_call = torch_pass(auto, q, k, v, dout, pass_name)
                        started = time.perf_counter()
                        auto_call()
                        first_ms = (time.perf_counter() - started) * 1e3
                        samples = interleaved_ms(
                            {SDPA_PEER: torch_pass(sdpa, q, k, v, dout, pass_name), "auto": auto_call}, repeats, warmup
                        )
                        row = _peer_row(spec_name(causal), seq_len, dtype, pass_name, "", causal, samples, SDPA_PEER)
                        row.update(_auto_decision(spec, *_leaves_like(q, k, v, pass_name), first_ms, row["attnkit_ms"]))
                        row["target"] = AUTO_VS_SDPA_RATIO
                        row["met"] = row["ratio"] >= AUTO_VS_SDPA_RATIO
                        rows.append(row)
    return {"target": AUTO_VS_SDPA_RATIO, "peer": SDPA_PEER, "rows": rows}


def _dispatch_warmed() -> None:
    """Pay attend's own one-time costs (the registry, backends' availability, the torch frontend's import: seconds in
    a fresh process, with or without measuring) before the first cell, running no backend, so that the first cell's
    first call shows what measuring costs, as the later cells' do."""
    import torch

    from attnkit import dispatch
    from attnkit.frontends import ops_for

    x = torch.zeros(1, 1, 1, 8)
    ops_for(x)
    dispatch.select(AttentionSpec(), call_problem(AttentionSpec(), x, x, x))


def _auto_decision(spec: Any, q: Any, k: Any, v: Any, first_ms: float, auto_ms: float) -> dict[str, Any]:
    """Which backend auto ran and what decided it: a measurement (its times, and what the first call's measuring
    cost in calls of the slowest contender) or the prediction."""
    from attnkit import dispatch

    choice = dispatch.auto_choice(spec, call_problem(spec, q, k, v))
    if choice is None:
        return {"path": "none", "decided": "none"}
    found: dict[str, Any] = {"path": choice.backend, "decided": "predicted", "first_call_ms": first_ms}
    if choice.record is not None:
        times = dict(choice.record.times_us)
        slowest_ms = max(times.values()) / 1e3
        found |= {
            "decided": "measured",
            "contenders_us": times,
            "measuring_in_slowest_calls": (first_ms - auto_ms) / slowest_ms,
        }
    return found


def spec_name(causal: bool) -> str:
    return "causal" if causal else "full"


def _peer_row(
    spec: str,
    seq_len: int,
    dtype: str,
    pass_name: str,
    path: str,
    causal: bool,
    samples: dict[str, list[float]],
    peer: str,
) -> dict[str, Any]:
    peer_ms, auto_ms = statistics.median(samples[peer]), statistics.median(samples["auto"])
    ratio = paired_ratio(samples, peer, "auto")
    work = flops(seq_len, seq_len, causal, pass_name)
    return _row(
        spec=spec,
        causal=causal,
        len_q=seq_len,
        len_k=seq_len,
        dtype=dtype,
        pass_name=pass_name,
        path=path,
        peer_ms=peer_ms,
        attnkit_ms=auto_ms,
        ratio=ratio,
        target=PEER_RATIO,
        met=ratio >= PEER_RATIO,
        peer_gflops=work / peer_ms / 1e6,
        attnkit_gflops=work / auto_ms / 1e6,
        peer_samples_ms=samples[peer],
        attnkit_samples_ms=samples["auto"],
    )


def bench_jax_target(seq_lens: Sequence[int], dtypes: Sequence[str], repeats: int, warmup: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import attnkit

    rows = []
    batch, heads, dim = SHAPE["batch"], SHAPE["heads"], SHAPE["head_dim"]
    for dtype in dtypes:
        for seq_len in seq_lens:
            shape = (batch, seq_len, heads, dim)
            q, k, v, dout = random_inputs("jax", shape, shape, dtype)
            for causal in (False, True):
                spec = attnkit.AttentionSpec(causal=causal, causal_alignment="top_left", layout="bshd")
                path = auto_choice(spec, q, k, v)
                peer = partial(jax.nn.dot_product_attention, is_causal=causal)

                def ours(q: Any, k: Any, v: Any, spec: Any = spec) -> Any:
                    return attnkit.attend(spec, q, k, v)

                for pass_name in TARGET_PASSES:
                    functions = {}
                    for label, attention in ((JAX_PEER, peer), ("auto", ours)):
                        if pass_name == "fwd":
                            compiled = jax.jit(attention)
                        else:

                            def loss(q: Any, k: Any, v: Any, attention: Any = attention, dout: Any = dout) -> Any:
                                return jnp.sum(attention(q, k, v) * dout)

                            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                        functions[label] = partial(blocked, compiled, q, k, v)
                    samples = interleaved_ms(functions, repeats, warmup)
                    rows.append(
                        _peer_row(spec_name(causal), seq_len, dtype, pass_name, path, causal, samples, JAX_PEER)
                    )
    return {"target": PEER_RATIO, "peer": JAX_PEER, "rows": rows}


# ---------------------------------------------------------------------------------------------- non-native


@dataclass(frozen=True)
class NonNativeCase:
    name: str
    spec_json: dict[str, Any]
    half_queries: bool = False  # Lq = L // 2, Lk = L
    kv_lengths: bool = False  # kv_lengths = [L - L // 8]

    def spec(self) -> Any:
        import attnkit

        return attnkit.AttentionSpec(**self.spec_json)

    def lengths(self, seq_len: int) -> tuple[int, int]:
        return (seq_len // 2 if self.half_queries else seq_len), seq_len

    def inputs(self, seq_len: int, dtype: str) -> tuple[Any, Any, Any, Any, Any]:
        import torch

        q, k, v, dout = _torch_inputs(*self.lengths(seq_len), dtype)
        lengths = torch.tensor([seq_len - seq_len // 8]) if self.kv_lengths else None
        return q, k, v, dout, lengths

    def attention(self, backend: str, lengths: Any) -> Callable[..., Any]:
        import attnkit

        spec = self.spec()
        return lambda q, k, v: attnkit.attend(spec, q, k, v, kv_lengths=lengths, backend=backend)


NON_NATIVE_CASES = (
    NonNativeCase("causal+softcap(30)", {"causal": True, "softcap": 30.0}),
    NonNativeCase("causal+window(256,0)", {"causal": True, "window": (256, 0)}),
    NonNativeCase("causal+kv_lengths", {"causal": True}, kv_lengths=True),
    NonNativeCase("cosine causal", {"causal": True, "variant": "cosine"}),
    NonNativeCase(
        "bottom-right causal Lq=L/2", {"causal": True, "causal_alignment": "bottom_right"}, half_queries=True
    ),
)


def servable_torch_backends(
    spec: Any, problem: Any, only: Sequence[str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Registered backends that take torch tensors and can serve (spec, problem) here without an interpreter (of
    ``only`` where given), and why the others that could are left out."""
    from attnkit import registry
    from attnkit.backend import Framework

    chosen, skipped = [], {}
    for name, backend in sorted(registry.backends(load=True).items()):
        if Framework.TORCH not in backend.capabilities.frameworks or backend.available():
            continue
        if backend.supports(spec, problem):
            continue
        if interpreted(name, problem.device):
            skipped[name] = "interpreter/emulator on this device"
            continue
        score_bytes = problem.batch * problem.heads_q * problem.len_q * problem.len_k * 4
        if name == "torch-naive" and score_bytes > NAIVE_MAX_SCORE_BYTES:
            skipped[name] = f"materialises {score_bytes / 2**20:.0f} MiB of float32 scores (several copies)"
            continue
        if only is not None and name not in only:
            skipped[name] = "not in --backends"
            continue
        chosen.append(name)
    return chosen, skipped


def bench_non_native_target(
    seq_lens: Sequence[int],
    dtypes: Sequence[str],
    repeats: int,
    warmup: int,
    cases: Sequence[NonNativeCase],
    only_backends: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Per case, dtype, length and pass: auto, and each torch backend that serves the call (of ``only_backends``
    where given), against SDPA's plain causal call at the same shape."""
    import torch.nn.functional as F

    rows = []
    for case in cases:
        spec = case.spec()
        for dtype in dtypes:
            for seq_len in seq_lens:
                q, k, v, dout, lengths = case.inputs(seq_len, dtype)
                for pass_name in TARGET_PASSES:
                    call = _leaves_like(q, k, v, pass_name)
                    # One call first: where auto measures (attnkit/autotune.py), the record then names the path.
                    torch_pass(case.attention("auto", lengths), q, k, v, dout, pass_name)()
                    path = auto_choice(spec, *call, kv_lengths=lengths)
                    problem = call_problem(spec, *call, kv_lengths=lengths)
                    backends, skipped = servable_torch_backends(spec, problem, only_backends)

                    def sdpa(q: Any, k: Any, v: Any) -> Any:
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                    functions = {SDPA_CAUSAL: torch_pass(sdpa, q, k, v, dout, pass_name)}
                    functions["auto"] = torch_pass(case.attention("auto", lengths), q, k, v, dout, pass_name)
                    for name in backends:
                        if name != path:  # auto's own timing stands for the backend it runs
                            functions[name] = torch_pass(case.attention(name, lengths), q, k, v, dout, pass_name)
                    samples = interleaved_ms(functions, repeats, warmup)
                    medians = {name: statistics.median(values) for name, values in samples.items()}
                    reference = medians.pop(SDPA_CAUSAL)
                    paths = {(path if name == "auto" else name): ms for name, ms in medians.items()}
                    best = min(paths, key=paths.__getitem__)
                    best_samples = "auto" if best == path else best
                    len_q, len_k = case.lengths(seq_len)
                    # Throughput = FLOP/s of the pairs each call computes: a window or a bottom-right call with
                    # Lq < Lk does less or more work than SDPA's top-left causal call at the same shape.
                    work = visible_flops(spec, len_q, len_k, lengths, pass_name)
                    peer_work = visible_flops(SDPA_CAUSAL_SPEC, len_q, len_k, None, pass_name)
                    time_ratio = paired_ratio(samples, SDPA_CAUSAL, best_samples)
                    ratio = work / peer_work * time_ratio
                    rows.append(
                        _row(
                            spec=case.name,
                            len_q=len_q,
                            len_k=len_k,
                            dtype=dtype,
                            pass_name=pass_name,
                            path=path,
                            auto_ms=paths[path],
                            auto_ratio=work / peer_work * paired_ratio(samples, SDPA_CAUSAL, "auto"),
                            best=best,
                            peer_ms=reference,
                            attnkit_ms=paths[best],
                            time_ratio=time_ratio,
                            ratio=ratio,
                            target=NON_NATIVE_RATIO,
                            met=ratio >= NON_NATIVE_RATIO,
                            paths_ms=paths,
                            skipped=skipped,
                            peer_gflops=peer_work / reference / 1e6,
                            attnkit_gflops=work / paths[best] / 1e6,
                            samples_ms=samples,
                        )
                    )
    return {
        "target": NON_NATIVE_RATIO,
        "peer": SDPA_CAUSAL,
        "paths": None if only_backends is None else list(only_backends),
        "cases": {
            case.name: case.spec_json | {"half_queries": case.half_queries, "kv_lengths": case.kv_lengths}
            for case in cases
        },
        "rows": rows,
    }


_MEMORY_CHILD = (
    "import sys; from attnkit.bench.targets import _memory_child as m; "
    "m(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))"
)


def _memory_child(case_name: str, backend: str, seq_len: int, dtype: str, threads: int) -> None:
    """In a fresh process: print the peak RSS growth of one forward+backward of a case on a backend, as JSON."""
    import torch

    torch.set_num_threads(threads)
    case = {case.name: case for case in NON_NATIVE_CASES}[case_name]

    def once(length: int) -> tuple[Callable[[], Any], tuple[Any, ...]]:
        inputs = case.inputs(length, dtype)
        q, k, v, dout, lengths = inputs
        return torch_pass(case.attention(backend, lengths), q, k, v, dout, "fwd+bwd"), inputs

    once(64)[0]()  # load modules and kernels before measuring
    # Inputs, output cotangent and leaves allocated before the mark, and kept: freed, their memory would serve the
    # call's own buffers below the mark.
    run, _inputs = once(seq_len)
    print(json.dumps({"peak_extra_bytes": peak_extra_bytes(run)}))


def measure_memory(case: str, backend: str, seq_len: int, dtype: str, threads: int) -> int:
    # A fixed mmap threshold: glibc otherwise raises it as large blocks are freed and keeps later ones in its heap,
    # where a block freed before the mark serves the call unseen by VmHWM (L=2048 read 16.1 or 19.7 MiB by run).
    fixed_threshold = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    arguments = [case, backend, str(seq_len), dtype, str(threads)]
    return int(run_child(_MEMORY_CHILD, arguments, f"{case} on {backend}", fixed_threshold)["peak_extra_bytes"])


def non_native_memory(
    result: dict[str, Any], seq_lens: Sequence[int], dtype: str, threads: int
) -> list[dict[str, Any]]:
    """Peak extra memory of one forward+backward, per case, of the path that was fastest at the largest L (and of
    auto's path where that differs), at every L: each point in a fresh process (VmHWM after minus VmRSS before)."""
    largest = max(seq_lens)
    rows = []
    for case in result["cases"]:
        at_largest = [
            row
            for row in result["rows"]
            if row["spec"] == case
            and row["len_k"] == largest
            and row["pass_name"] == "fwd+bwd"
            and row["dtype"] == dtype
        ]
        if not at_largest:
            continue
        paths = dict.fromkeys([at_largest[0]["best"], at_largest[0]["path"]])
        for path in paths:
            points = {seq_len: measure_memory(case, path, seq_len, dtype, threads) for seq_len in sorted(seq_lens)}
            # Between the two largest L, the asymptotic growth: the smallest L's peak is a few MiB, where fixed
            # costs weigh; a materialised (Lq, Lk) matrix still shows e near 2 there.
            exponent = None
            if len(points) > 1:
                low, high = sorted(points)[-2:]
                exponent = math.log(max(points[high], 1) / max(points[low], 1)) / math.log(high / low)
            rows.append(
                _row(
                    spec=case,
                    path=path,
                    dtype=dtype,
                    peak_extra_bytes={str(length): value for length, value in points.items()},
                    growth_exponent=exponent,
                    linear=exponent is not None and exponent <= LINEAR_EXPONENT,
                )
            )
    return rows


# ---------------------------------------------------------------------------------------------- decode


def bench_decode_target(rounds: int, calls: int) -> dict[str, Any]:
    """attend against SDPA called directly, Lq=1 Lk=128, interleaved: no_grad, and recording autograd (q requires
    grad, no backward); plus what recording costs SDPA itself. Overheads are medians of per-round differences."""
    import torch
    import torch.nn.functional as F

    import attnkit

    shape = DECODE_SHAPE
    q, k, v, _ = _torch_inputs(shape["len_q"], shape["len_k"], "float32")
    q_grad = q.detach().clone().requires_grad_(True)
    specs = {
        "full": attnkit.AttentionSpec(),
        "causal (bottom-right: sees every key)": attnkit.AttentionSpec(causal=True),
    }
    rows = []
    for label, spec in specs.items():
        functions = {
            "attend no_grad": partial(attnkit.attend, spec, q, k, v),
            "sdpa no_grad": partial(F.scaled_dot_product_attention, q, k, v),
            "attend recording": partial(attnkit.attend, spec, q_grad, k, v),
            "sdpa recording": partial(F.scaled_dot_product_attention, q_grad, k, v),
        }
        no_grad = {name: torch.no_grad for name in functions if name.endswith("no_grad")}
        samples = interleaved(functions, rounds, max(1, calls // 10), calls=calls, contexts=no_grad)
        paths = {  # asked after the calls: a bucket the first call measured (attnkit/autotune.py) has its record now
            "no_grad": auto_choice(spec, q, k, v),
            "recording": auto_choice(spec, q_grad, k, v),
        }

        def difference(first: str, second: str, samples: dict[str, list[float]] = samples) -> float:
            return paired_difference(samples, first, second) / 1000

        medians = {name: statistics.median(values) / 1000 for name, values in samples.items()}
        overheads = {
            "no_grad": difference("attend no_grad", "sdpa no_grad"),
            "recording": difference("attend recording", "sdpa recording"),
        }
        rows.append(
            _row(
                spec=label,
                paths=paths,
                median_us=medians,
                overhead_us=overheads,
                autograd_recording_us=difference("sdpa recording", "sdpa no_grad"),
                target_us=DECODE_BUDGET_US,
                met={mode: value <= DECODE_BUDGET_US for mode, value in overheads.items()},
                rounds_ns=samples,
            )
        )
    growing = _growing_cache_overhead(
        specs["causal (bottom-right: sees every key)"], q, max(2, rounds // 4), calls // 20
    )
    from attnkit.frontends import torch_frontend

    return {
        "target_us": DECODE_BUDGET_US,
        "shape": shape,
        "signature": torch_frontend.signature_in_use,
        "rounds": rounds,
        "calls_per_round": calls,
        "rows": rows,
        "growing_kv": growing,
    }


def _growing_cache_overhead(spec: Any, q: Any, rounds: int, steps: int) -> dict[str, Any]:
    """Not a target: attend's cost over SDPA per decode step when the KV cache grows by one key a step, so that every
    step's shape is new to attnkit's caches (validation and a dispatch decision each step), under no_grad. Each round
    takes ``steps`` key counts no earlier round used, as views of one preallocated cache; the median over rounds.
    (``attnkit bench --what decode`` times this at length, with grad recording, GQA and JAX too.)"""
    import torch
    import torch.nn.functional as F

    import attnkit

    steps = max(steps, 10)
    first = DECODE_SHAPE["len_k"] + 1
    blocks = length_blocks(first, (rounds + 1) * steps, steps)  # the first, of lengths no round meets, warms up
    cache_shape = (1, DECODE_SHAPE["heads"], blocks[-1].stop, DECODE_SHAPE["head_dim"])
    cache_k, cache_v = torch.randn(cache_shape), torch.randn(cache_shape)

    def step(attention: Callable[..., Any]) -> Callable[[int], Any]:
        return lambda length: attention(q, cache_k[:, :, :length], cache_v[:, :, :length])

    functions = {
        "attend": block_runner(step(partial(attnkit.attend, spec)), blocks),
        "sdpa": block_runner(step(F.scaled_dot_product_attention), blocks),
    }
    with torch.no_grad():
        samples = interleaved(functions, rounds, warmup=1, calls=1)
    return {
        "spec": "causal",
        "len_k": [blocks[1].start, blocks[-1].stop - 1],
        "steps_per_round": steps,
        "rounds": rounds,
        "overhead_us": paired_difference(samples, "attend", "sdpa") / steps / 1000,
    }


# ---------------------------------------------------------------------------------------------- all


def bench_targets(
    seq_lens: Sequence[int] = TARGET_SEQ_LENS,
    dtypes: Sequence[str] = TARGET_DTYPES,
    repeats: int = 3,
    warmup: int = 1,
    targets: Sequence[str] = TARGETS,
    memory: bool = True,
    decode_rounds: int = 20,
    decode_calls: int = 2000,
    progress: Callable[[str], None] | None = None,
    non_native_paths: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Every CPU performance target in one run (see the module docstring); a JSON-ready dict. ``non_native_paths``: the
    backends the non-native target times besides auto (default: every torch backend that serves the call)."""
    import torch

    say = progress or (lambda message: None)
    started = time.time()
    result: dict[str, Any] = {
        "what": "targets",
        "environment": environment("cpu"),
        "shape": SHAPE,
        "seq_lens": list(seq_lens),
        "dtypes": list(dtypes),
        "repeats": repeats,
        "warmup": warmup,
        "targets": {},
    }
    if "torch" in targets:
        say("torch: auto against torch SDPA")
        result["targets"]["torch"] = bench_torch_target(seq_lens, dtypes, repeats, warmup)
    if "jax" in targets:
        say("jax: auto against jax.nn.dot_product_attention")
        result["targets"]["jax"] = bench_jax_target(seq_lens, dtypes, repeats, warmup)
    if "non-native" in targets:
        say("non-native: best attnkit path against SDPA plain causal")
        non_native = bench_non_native_target(seq_lens, dtypes, repeats, warmup, NON_NATIVE_CASES, non_native_paths)
        if memory:
            say("non-native: peak memory, one process per point")
            non_native["memory"] = non_native_memory(non_native, seq_lens, dtypes[0], torch.get_num_threads())
        result["targets"]["non-native"] = non_native
    if "decode" in targets:
        say("decode: dispatch overhead over the direct SDPA call")
        result["targets"]["decode"] = bench_decode_target(decode_rounds, decode_calls)
    result["summary"] = summary(result)
    result["environment"]["load_average_end"] = [round(load, 2) for load in os.getloadavg()]
    result["seconds"] = time.time() - started
    return result


def _paths_timed(paths: Sequence[str] | None) -> str:
    if paths is not None:
        return f"{', '.join(paths)} where they serve the spec (--backends)"
    return (
        f"every torch backend that serves the spec (no interpreters; torch-naive only while its scores stay under "
        f"{NAIVE_MAX_SCORE_BYTES // 2**20} MiB)"
    )


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per target: how many rows met it, of how many."""
    out: dict[str, Any] = {}
    for name, target in result["targets"].items():
        if name == "decode":
            checks = [met for row in target["rows"] for met in row["met"].values()]
        else:
            checks = [row["met"] for row in target["rows"]]
            checks += [row["linear"] for row in target.get("memory", [])]
        out[name] = {"met": sum(checks), "checked": len(checks), "all_met": all(checks)}
    return out


# ---------------------------------------------------------------------------------------------- output


def _ms(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def format_targets(result: dict[str, Any]) -> str:
    lines = [device_banner(result)]
    targets = result["targets"]
    settings = (
        f"B={SHAPE['batch']} H={SHAPE['heads']} D={SHAPE['head_dim']}; median of {result['repeats']} interleaved "
        f"repeats after {result['warmup']} warm-up; ratio = median over repeats of peer time / attnkit time in the "
        "same repeat (throughput ratio)"
    )
    header = ["spec", "L", "dtype", "pass", "auto runs", "peer ms", "attnkit ms", "ratio", "target", "verdict"]
    for name, title in (
        ("torch", "auto vs torch SDPA called directly"),
        ("jax", "auto vs jax.nn.dot_product_attention"),
    ):
        if name not in targets:
            continue
        target = targets[name]
        rows = [
            [
                row["spec"],
                str(row["len_k"]),
                row["dtype"],
                row["pass_name"],
                _path_cell(row),
                *_ratio_cells(row),
            ]
            for row in target["rows"]
        ]
        lines += [
            "",
            f"target [{name}]: {title} ({target['peer']} is the peer); {settings}",
            format_table(header, rows),
        ]
        if name == "torch":
            lines.append(
                "auto runs: the backend, and `measured` where the cell's first call timed the contenders (records in a "
                "fresh directory for the run), with what that first call cost over a steady one in calls of the "
                "slowest contender (target: <= 3); `predicted` where the cost table decided"
            )
    if "non-native" in targets:
        target = targets["non-native"]
        rows = [
            [
                row["spec"],
                f"{row['len_q']}x{row['len_k']}" if row["len_q"] != row["len_k"] else str(row["len_k"]),
                row["dtype"],
                row["pass_name"],
                f"{row['path']} ({row['auto_ratio']:.2f}x)",
                row["best"],
                *_ratio_cells(row),
            ]
            for row in target["rows"]
        ]
        lines += [
            "",
            f"target [non-native]: best attnkit path vs SDPA's plain causal call at the same (Lq, Lk), ratio of FLOP/s "
            f"of the pairs each computes (time ratio in the JSON); {settings}. "
            f"Paths timed: auto and {_paths_timed(target.get('paths'))}",
            format_table(
                [
                    "spec",
                    "L",
                    "dtype",
                    "pass",
                    "auto runs (ratio)",
                    "best path",
                    "sdpa causal ms",
                    "best ms",
                    "ratio",
                    "target",
                    "verdict",
                ],
                rows,
            ),
        ]
        if target.get("memory"):
            lengths = sorted({int(length) for row in target["memory"] for length in row["peak_extra_bytes"]})
            memory_rows = [
                [
                    row["spec"],
                    row["path"],
                    row["dtype"],
                    *(f"{row['peak_extra_bytes'][str(length)] / 2**20:.1f}" for length in lengths),
                    "n/a" if row["growth_exponent"] is None else f"L^{row['growth_exponent']:.2f}",
                    _verdict(row["linear"], "linear", "NOT LINEAR"),
                ]
                for row in target["memory"]
            ]
            lines += [
                "",
                "peak extra memory (MiB) of one forward+backward, each point in a fresh process: VmHWM after minus "
                f"VmRSS before, inputs already allocated; growth exponent between the two largest L "
                f"(linear: <= {LINEAR_EXPONENT})",
                format_table(
                    ["spec", "path", "dtype", *(f"L={length}" for length in lengths), "growth", "verdict"], memory_rows
                ),
            ]
    if "decode" in targets:
        target = targets["decode"]
        shape = target["shape"]
        rows = []
        for row in target["rows"]:
            for mode in ("no_grad", "recording"):
                medians = row["median_us"]
                rows.append(
                    [
                        row["spec"],
                        mode,
                        row["paths"][mode],
                        f"{medians['sdpa ' + mode]:.2f}",
                        f"{medians['attend ' + mode]:.2f}",
                        f"{row['overhead_us'][mode]:.2f}",
                        f"<= {target['target_us']}",
                        _verdict(row["met"][mode]),
                    ]
                )
        lines += [
            "",
            f"target [decode]: attend over F.scaled_dot_product_attention, B={shape['batch']} H={shape['heads']} "
            f"Lq={shape['len_q']} Lk={shape['len_k']} D={shape['head_dim']} float32; median of per-round differences, "
            f"{target['rounds']} interleaved rounds x {target['calls_per_round']} calls; recording = q requires grad, "
            f"no backward; call signature: {target['signature']} (`attnkit build` compiles it)",
            format_table(
                ["spec", "mode", "auto runs", "sdpa us", "attend us", "overhead us", "target", "verdict"], rows
            ),
        ]
        recording = ", ".join(f"{row['spec']}: {row['autograd_recording_us']:.2f} us" for row in target["rows"])
        lines.append(f"autograd recording itself (sdpa recording minus sdpa no_grad): {recording}")
        growing = target["growing_kv"]
        lines.append(
            f"not a target: a KV cache growing one key a step (Lk {growing['len_k'][0]}..{growing['len_k'][1]}, every "
            f"shape new: validation and a dispatch decision each step), no_grad: {growing['overhead_us']:.1f} us per "
            f"step over SDPA (median of {growing['rounds']} rounds x {growing['steps_per_round']} steps)"
        )
    lines += [
        "",
        "summary: "
        + "; ".join(f"{name} {value['met']}/{value['checked']} met" for name, value in result["summary"].items())
        + f" ({result['seconds']:.0f} s)",
    ]
    return "\n".join(lines)


def _path_cell(row: dict[str, Any]) -> str:
    decided = row.get("decided")
    if decided == "measured":
        return f"{row['path']} (measured, +{row['measuring_in_slowest_calls']:.1f})"
    return f"{row['path']} ({decided})" if decided else row["path"]


def _verdict(met: bool, yes: str = "met", no: str = "NOT MET") -> str:
    return yes if met else no


def _ratio_cells(row: dict[str, Any]) -> list[str]:
    """The last columns of a ratio table: the peer's and attnkit's times, their ratio, the target, the verdict."""
    return [
        _ms(row["peer_ms"]),
        _ms(row["attnkit_ms"]),
        f"{row['ratio']:.2f}x",
        f">= {row['target']}x",
        _verdict(row["met"]),
    ]


def plot_targets(result: dict[str, Any], path: str) -> None:
    """Throughput (GFLOP/s) against L, one line per implementation, one panel per dtype x pass."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "attnkit bench --plot needs matplotlib: pip install 'attnkit[bench]' (or pip install matplotlib)"
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = _plot_lines(result)
    panels = [(dtype, pass_name) for dtype in result["dtypes"] for pass_name in TARGET_PASSES]
    figure, axes = plt.subplots(
        len(result["dtypes"]), len(TARGET_PASSES), figsize=(13, 4.5 * len(result["dtypes"])), squeeze=False
    )
    labels = sorted({label for label, _, _ in lines})
    colors = plt.get_cmap("tab20")
    for axis, (dtype, pass_name) in zip(axes.flat, panels):
        for (label, line_dtype, line_pass), points in sorted(lines.items()):
            if (line_dtype, line_pass) != (dtype, pass_name):
                continue
            xs = sorted(points)
            peer = label.startswith(("torch sdpa", "jax.nn"))
            axis.plot(
                xs,
                [points[x] for x in xs],
                color=colors(labels.index(label) % 20),
                marker="o" if peer else "s",
                linestyle="-" if peer else "--",
                label=label,
            )
        axis.set_title(f"{dtype}, {pass_name}")
        axis.set_xlabel("sequence length L (Lk)")
        axis.set_ylabel("GFLOP/s (FlashAttention-2 count; causal halved)")
        axis.set_xscale("log", base=2)
        axis.grid(True, alpha=0.3)
    handles, names = axes.flat[0].get_legend_handles_labels()
    figure.legend(handles, names, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    env = result["environment"]
    figure.suptitle(
        f"attnkit bench --what targets: B={SHAPE['batch']} H={SHAPE['heads']} D={SHAPE['head_dim']}, "
        f"{env['cpu_model']}, {env['cpu_threads']} thread(s), torch {env['torch']}"
    )
    figure.tight_layout()
    figure.savefig(path, bbox_inches="tight", dpi=110)
    plt.close(figure)


def _plot_lines(result: dict[str, Any]) -> dict[tuple[str, str, str], dict[int, float]]:
    lines: dict[tuple[str, str, str], dict[int, float]] = {}

    def add(label: str, row: dict[str, Any], gflops: float) -> None:
        lines.setdefault((label, row["dtype"], row["pass_name"]), {})[row["len_k"]] = gflops

    targets = result["targets"]
    for name, ours in (("torch", "attnkit auto (torch)"), ("jax", "attnkit auto (jax)")):
        for row in targets.get(name, {}).get("rows", []):
            add(f"{targets[name]['peer']} {row['spec']}", row, row["peer_gflops"])
            add(f"{ours} {row['spec']}", row, row["attnkit_gflops"])
    for row in targets.get("non-native", {}).get("rows", []):
        add(f"attnkit best: {row['spec']}", row, row["attnkit_gflops"])
    return lines
