"""``attnkit bench --what context-parallel``: attnkit.distributed.attend (docs/semantics.md §14) on a gloo group of
``world`` CPU processes, against the single-process call (issue 18's bars).

One causal attention call, B=1, H=8 (Hkv=8, or 2 for the GQA row), L=16384, D=64, float32, bhsd, forward+backward,
and one pre-norm-free causal transformer layer around it (qkv projection, attention, output projection, 4× GELU MLP,
model width H·D, bshd), each run by a fresh group per strategy × sharding:

* memory: each rank's peak extra resident memory of its first full-length attention call and of its first
  full-length layer step (after a short warm-up), against the same in one fresh process (malloc returns large blocks
  to the OS, so one process can measure one call after another);
* balance: the visible (query, key) pairs each rank's queries have, counted, and each rank's thread CPU time of the
  attention call (ranks share the cores, so wall time would measure the neighbours);
* overlap: per ring transfer, the wall time from posting it to the end of the compute it overlaps and the time then
  left waiting, against the same transfer timed alone: hidden = 1 − waited / alone;
* volume: the bytes each rank handed to each kind of transfer, against the analytic count.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from attnkit.bench.calls import auto_choice
from attnkit.bench.peak_memory import peak_extra_bytes, run_child
from attnkit.bench.timing import device_banner, environment
from attnkit.tables import format_table

SHAPE = {"batch": 1, "heads": 8, "seq_len": 16384, "head_dim": 64}
#: (strategy, sharding, kv heads) of each group run by default.
RUNS = (
    ("ring", "zigzag", 8),
    ("ring", "contiguous", 8),
    ("allgather", "zigzag", 8),
    ("allgather", "zigzag", 2),
    ("ulysses", "zigzag", 8),
)
#: malloc serves and frees blocks above this many bytes with mmap, so freed memory leaves the resident set.
_MMAP_THRESHOLD = str(1 << 16)
_COLLECTIVE_TIMEOUT_S = 600
_SINGLE_CHILD = "import sys; from attnkit.bench.context_parallel import _single_main as m; m(sys.argv[1])"


def visible_pairs(spec: Any, positions: Any, len_q: int, len_k: int) -> int:
    """How many keys the queries at global ``positions`` see under ``spec``'s causal/window band (§4)."""
    import numpy as np

    from attnkit.contract import alignment_offset, diagonal_band

    lower, upper = diagonal_band(spec)
    start = np.asarray(positions) + alignment_offset(spec, len_q, len_k)
    first = np.maximum(0, start + lower) if lower is not None else np.zeros_like(start)
    last = np.minimum(len_k - 1, start + upper) if upper is not None else np.full_like(start, len_k - 1)
    return int(np.maximum(0, last - first + 1).sum())


def analytic_sent_bytes(strategy: str, world: int, config: dict[str, Any], hops: int | None = None) -> dict[str, float]:
    """Bytes one rank sends per attention call (forward+backward, gradient through out only), by kind of transfer:
    K and V (and their float32 gradients) sized by Hkv, q, out and their gradients by Hq. ``hops``: how far the
    ring carries K/V, P − 1 unless the call hides whole shards from the ranks behind them."""
    share = (world - 1) / world  # of a whole tensor, what a rank's sends add up to when every rank holds 1/P
    per_head = config["batch"] * config["seq_len"] * config["head_dim"] * 4  # a whole float32 (B, 1, L, D)
    kv = 2 * config["heads_kv"] * per_head
    if strategy == "ring":  # K/V pass `hops` shards each way; the dK/dV sums as many, and one more hop home
        hops = world - 1 if hops is None else hops
        carried = hops / world * kv
        return {
            "ring k/v (forward)": carried,
            "ring k/v (backward)": carried,
            "ring dk/dv": carried + kv / world * bool(hops),
        }
    if strategy == "allgather":
        return {"all-gather": share * kv, "reduce-scatter": share * kv}
    q = config["heads"] * per_head
    lse = config["batch"] * config["heads"] * config["seq_len"] * 4
    # Forward: q, k, v to head shards, out and lse back; backward: dout to head shards, dq, dk, dv back.
    return {"all-to-all": share / world * (q + kv + q + lse + q + q + kv)}


# ---------------------------------------------------------------------------------------------------------------------
# The measured calls (in the children)


def _inputs(config: dict[str, Any], heads: int, layout_bshd: bool = False) -> Any:
    import torch

    generator = torch.Generator().manual_seed(heads)
    shape = (config["batch"], config["seq_len"], heads, config["head_dim"])
    x = torch.randn(shape, generator=generator)
    return x if layout_bshd else x.transpose(1, 2).contiguous()


def _attention_step(attend: Callable[..., Any], q: Any, k: Any, v: Any, dout: Any) -> Callable[[], Any]:
    """One forward+backward of ``attend(q, k, v)``: dq, dk, dv."""
    import torch

    def step() -> Any:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        return torch.autograd.grad(attend(*leaves), leaves, dout)

    return step


def _layer_step(config: dict[str, Any], attend: Callable[..., Any], x: Any) -> Callable[[], Any]:
    """One forward+backward of a causal transformer layer on ``x`` (B, L or L/P, H·D), ``attend(q, k, v)`` on bshd
    q, k, v: the parameters' gradients."""
    import torch

    heads, head_dim = config["heads"], config["head_dim"]
    width = heads * head_dim
    torch.manual_seed(0)
    qkv, project = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
    mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
    parameters = [*qkv.parameters(), *project.parameters(), *mlp.parameters()]

    def step() -> Any:
        q, k, v = qkv(x).unflatten(-1, (3, heads, head_dim)).unbind(2)
        hidden = x + project(attend(q, k, v).flatten(2))
        loss = (hidden + mlp(hidden)).square().mean()
        return torch.autograd.grad(loss, parameters)

    return step


def _memory(config: dict[str, Any], steps: dict[str, Callable[[], Any]]) -> dict[str, int]:
    """Each step's peak extra memory, first full-length call, one after the other."""
    return {name: peak_extra_bytes(step) for name, step in steps.items()}


def _single_main(config_json: str) -> None:
    """A fresh process: the whole call's memory and thread CPU time, printed as JSON."""
    import torch

    import attnkit

    config = json.loads(config_json)
    torch.set_num_threads(config["threads"])
    spec, layer_spec = attnkit.AttentionSpec(causal=True), attnkit.AttentionSpec(causal=True, layout="bshd")
    backend = config["backend"]
    q, dout = _inputs(config, config["heads"]), _inputs(config, config["heads"])
    k, v = _inputs(config, config["heads_kv"]), _inputs(config, config["heads_kv"])
    attention = _attention_step(lambda *t: attnkit.attend(spec, *t, backend=backend), q, k, v, dout)
    x = torch.randn(config["batch"], config["seq_len"], config["heads"] * config["head_dim"])
    layer = _layer_step(config, lambda *t: attnkit.attend(layer_spec, *t, backend=backend), x)
    _warm_up(config, lambda *t: attnkit.attend(spec, *t, backend=backend))
    result: dict[str, Any] = {"memory": _memory(config, {"attention": attention, "layer": layer})}
    start = time.thread_time()
    attention()
    result["cpu_s"] = time.thread_time() - start
    result["backend"] = auto_choice(spec, q.requires_grad_(True), k, v) if backend == "auto" else backend
    print(json.dumps(result))


def _warm_up(config: dict[str, Any], attend: Callable[..., Any]) -> None:
    """A short call of the same form: kernels built, dispatch cached, connections made."""
    short = {**config, "seq_len": 64 * config["world"]}
    q = _inputs(short, config["heads"])
    k, v = _inputs(short, config["heads_kv"]), _inputs(short, config["heads_kv"])
    _attention_step(attend, q, k, v, q)()


def _transfer_alone_s(tensors: list[Any], world: int, rank: int) -> float:
    """One ring shift of ``tensors`` with nothing to hide it: the median of three."""
    import torch
    import torch.distributed as dist

    times = []
    for _ in range(3):
        buffers = [torch.empty_like(t) for t in tensors]
        operations = [dist.P2POp(dist.isend, t, (rank + 1) % world) for t in tensors]
        operations += [dist.P2POp(dist.irecv, b, (rank - 1) % world) for b in buffers]
        dist.barrier()
        start = time.perf_counter()
        for request in dist.batch_isend_irecv(operations):
            request.wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank_main(rank: int, world: int, directory: str, config: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(config["threads"])
    dist.init_process_group("gloo", init_method=f"file://{directory}/init", rank=rank, world_size=world,
                            timeout=timedelta(seconds=_COLLECTIVE_TIMEOUT_S))  # fmt: skip
    try:
        result = _measure_rank(rank, world, config)
        Path(directory, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _measure_rank(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import attnkit
    import attnkit.distributed as cp
    from attnkit.distributed import torch_cp

    strategy, sharding, backend = config["strategy"], config["sharding"], config["backend"]
    spec, layer_spec = attnkit.AttentionSpec(causal=True), attnkit.AttentionSpec(causal=True, layout="bshd")
    options = {"strategy": strategy, "sharding": sharding, "backend": backend}

    def local(x: Any, seq_axis: int = 2) -> Any:
        return cp.shard(x, sharding=sharding, seq_axis=seq_axis).contiguous()

    q, dout = local(_inputs(config, config["heads"])), local(_inputs(config, config["heads"]))
    k, v = local(_inputs(config, config["heads_kv"])), local(_inputs(config, config["heads_kv"]))
    x = local(torch.randn(config["batch"], config["seq_len"], config["heads"] * config["head_dim"]), seq_axis=1)
    attention = _attention_step(lambda *t: cp.attend(spec, *t, **options), q, k, v, dout)
    layer = _layer_step(config, lambda *t: cp.attend(layer_spec, *t, **options), x)
    _warm_up(config, lambda *t: cp.attend(spec, *t, **options))
    dist.barrier()
    result: dict[str, Any] = {"memory": _memory(config, {"attention": attention, "layer": layer})}
    cpu, records = [], []
    for _ in range(config["repeats"]):
        dist.barrier()
        with torch_cp.recording() as traffic:
            start = time.thread_time()
            attention()
            cpu.append(time.thread_time() - start)
        records.append(traffic)
    result["cpu_s"] = statistics.median(cpu)
    result["sent_bytes"] = records[-1].sent_bytes
    result["blocks"] = records[-1].blocks
    result["ring_transfers"] = [transfer for traffic in records for transfer in traffic.ring_transfers]
    if strategy == "ring" and world > 1:
        result["transfer_alone_s"] = _transfer_alone_s([k, v], world, rank)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# The parent


def _group_run(config: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    import torch.multiprocessing

    world = config["world"]
    with tempfile.TemporaryDirectory() as directory:
        context = torch.multiprocessing.start_processes(
            _rank_main, args=(world, directory, config), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise RuntimeError(f"the {world}-rank group did not finish within {timeout_s:.0f} s")
        return [json.loads(Path(directory, f"rank{rank}.json").read_text()) for rank in range(world)]


def bench_context_parallel(
    world: int = 4,
    seq_len: int = SHAPE["seq_len"],
    runs: tuple[tuple[str, str, int], ...] = RUNS,
    repeats: int = 2,
    threads: int = 1,
    backend: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from attnkit.distributed.sharding import Sharding, rank_spans
    from attnkit.spec import AttentionSpec

    say = progress or (lambda message: None)
    base = {**SHAPE, "seq_len": seq_len, "world": world, "threads": threads, "backend": backend, "repeats": repeats}
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", _MMAP_THRESHOLD)  # the children inherit it
    environment_now = environment("cpu")
    single: dict[str, dict[str, Any]] = {}  # by Hkv
    results = []
    for strategy, sharding, heads_kv in runs:
        config = {**base, "strategy": strategy, "sharding": sharding, "heads_kv": heads_kv}
        if str(heads_kv) not in single:
            say(f"single process, Hkv={heads_kv}")
            single[str(heads_kv)] = run_child(_SINGLE_CHILD, [json.dumps(config)], "the single-process call")
        say(f"{world} ranks: {strategy} {sharding} Hkv={heads_kv}")
        ranks = _group_run(config, timeout_s=3600)
        spans = [rank_spans(seq_len, world, rank, Sharding(sharding)) for rank in range(world)]
        positions = [[p for span in rank_spans_ for p in span] for rank_spans_ in spans]
        pairs = [visible_pairs(AttentionSpec(causal=True), p, seq_len, seq_len) for p in positions]
        expected = analytic_sent_bytes(strategy, world, config)
        results.append({"strategy": strategy, "sharding": sharding, "heads_kv": heads_kv, "ranks": ranks,
                        "visible_pairs": pairs, "analytic_sent_bytes": expected})  # fmt: skip
    return {"environment": environment_now, "shape": base, "single": single, "runs": results}


# ---------------------------------------------------------------------------------------------------------------------
# Report


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def _spread(values: list[float]) -> str:
    return f"{max(values) / min(values):.3f}" if min(values) > 0 else "inf"


def format_context_parallel(result: dict[str, Any]) -> str:
    shape = result["shape"]
    world = shape["world"]
    lines = [
        device_banner(result),
        f"context parallelism on a gloo group of {world} processes: causal, B={shape['batch']}, H={shape['heads']}, "
        f"L={shape['seq_len']}, D={shape['head_dim']}, float32, forward+backward, local blocks on "
        f"{shape['backend']!r}; the single-process call runs on "
        + ", ".join(f"{alone['backend']} (Hkv={heads_kv})" for heads_kv, alone in result["single"].items()),
        "",
        "memory: peak extra MiB per rank (the largest rank) against one process; layer = projections, attention, MLP",
    ]
    rows = []
    for run in result["runs"]:
        alone = result["single"][str(run["heads_kv"])]["memory"]
        row = [run["strategy"], run["sharding"], str(run["heads_kv"])]
        for part in ("attention", "layer"):
            most = max(rank["memory"][part] for rank in run["ranks"])
            row += [_mib(most), _mib(alone[part]), f"{most / alone[part]:.3f}"]
        rows.append(row)
    header = ["strategy", "sharding", "Hkv", "attention", "alone", "ratio", "layer", "alone", "ratio"]
    lines.append(format_table(header, rows))
    lines += ["", "balance: visible pairs per rank (counted) and thread CPU seconds per rank (median), max/min"]
    rows = []
    for run in result["runs"]:
        cpu = [rank["cpu_s"] for rank in run["ranks"]]
        rows.append([run["strategy"], run["sharding"], str(run["heads_kv"]), _spread(run["visible_pairs"]),
                     " ".join(f"{s:.2f}" for s in cpu), _spread(cpu),
                     " ".join(str(rank["blocks"]) for rank in run["ranks"])])  # fmt: skip
    lines.append(format_table(["strategy", "sharding", "Hkv", "pairs max/min", "CPU s per rank", "max/min",
                               "local calls per rank"], rows))  # fmt: skip
    lines.append("one process: " + ", ".join(f"{alone['cpu_s']:.2f} CPU s (Hkv={heads_kv})"
                                             for heads_kv, alone in result["single"].items()))  # fmt: skip
    lines += ["", "overlap (ring): per transfer, busy = compute since it was posted, waited = left after; "
              "hidden = 1 − waited / alone (the same shift timed with nothing to hide it)"]  # fmt: skip
    rows = []
    for run in result["runs"]:
        if run["strategy"] != "ring":
            continue
        transfers = [t for rank in run["ranks"] for t in rank["ring_transfers"]]
        alone = statistics.median(rank["transfer_alone_s"] for rank in run["ranks"])
        for what in sorted({t[0] for t in transfers}):
            busy = [t[1] for t in transfers if t[0] == what]
            waited = [t[2] for t in transfers if t[0] == what]
            hidden = 1 - min(1.0, statistics.median(waited) / alone)
            rows.append([run["sharding"], what, str(len(busy)), f"{statistics.median(busy) * 1e3:.1f}",
                         f"{statistics.median(waited) * 1e3:.2f}", f"{alone * 1e3:.2f}", f"{hidden:.3f}"])  # fmt: skip
    lines.append(format_table(["sharding", "transfer", "count", "busy ms", "waited ms", "alone ms", "hidden"], rows))
    lines += ["", "volume: MiB sent per rank per call (every rank alike) against the analytic count"]
    rows = []
    for run in result["runs"]:
        sent = run["ranks"][0]["sent_bytes"]
        for what, expected in run["analytic_sent_bytes"].items():
            measured = [rank["sent_bytes"].get(what, 0) for rank in run["ranks"]]
            rows.append([run["strategy"], run["sharding"], str(run["heads_kv"]), what, _mib(max(measured)),
                         _mib(expected), f"{max(measured) / expected:.3f}"])  # fmt: skip
        rows += [[run["strategy"], run["sharding"], str(run["heads_kv"]), what, _mib(n), "-", "-"]
                 for what, n in sent.items() if what not in run["analytic_sent_bytes"]]  # fmt: skip
    lines.append(format_table(["strategy", "sharding", "Hkv", "transfer", "measured", "analytic", "ratio"], rows))
    return "\n".join(lines)
