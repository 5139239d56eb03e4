"""attnkit.distributed.attend on torch (docs/semantics.md §14): the sharded call equals the single-device one.

One spawn of a gloo group per world size (2, 3 and 4 ranks) runs every case under every strategy × sharding that
serves it, and the bad inputs, in the children. The cases are fixed ones naming the clause each reaches across shards
and, per world size, cases drawn in the parent by attnkit.testing.strategies (every spec feature, GQA/MQA, masks, bias,
lengths, segment ids, sinks, ALiBi slopes; float32, float16 and bfloat16) with their sequences stretched to a multiple
of 2P; how many follows the hypothesis profile (derandomised under ``ci``). The parent holds each result (out, lse,
dq, dk, dv, dbias unsharded) against the float64 oracle under the tolerance rule at the case's dtype, and checks that a
bad input on any rank raised a typed error on every rank (nothing hung: the spawn has a deadline)."""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import attnkit  # noqa: E402
from attnkit import distributed  # noqa: E402
from attnkit.bench.context_parallel import analytic_sent_bytes  # noqa: E402
from attnkit.distributed import torch_cp  # noqa: E402
from attnkit.errors import AttnkitError  # noqa: E402
from attnkit.features import Feature  # noqa: E402
from attnkit.spec import AttentionSpec  # noqa: E402
from attnkit.testing.agreement import compare, oracle_results, rounded  # noqa: E402
from attnkit.testing.cases import Case, make_arrays, program_table  # noqa: E402
from attnkit.testing.programs import program_function  # noqa: E402
from attnkit.testing.runners import FLOATING_INPUTS, dropout_of  # noqa: E402
from tests.sharded_cases import SHARDED_DTYPES, chunked_per_head, document_causal, examples, shardable_cases  # noqa: E402

# One worker runs every test here (--dist loadgroup, pyproject.toml): each world's group is spawned once per run, not
# once per pytest-xdist worker that is dealt one of its tests.
pytestmark = pytest.mark.xdist_group("distributed_torch")

STRATEGIES = ("ring", "allgather", "ulysses")
SHARDINGS = ("contiguous", "zigzag")
WORLDS = (2, 3, 4)
# A rank hung in a collective fails the test, not CI: gloo ends a collective that waits COLLECTIVE_TIMEOUT_S, and the
# parent kills a group in which no rank has finished a step (a run, or the bad inputs) for STALL_S. A step, not the
# whole group: the group's time grows with the drawn cases and the machine's load (248 s at 2 ranks under load in
# stop 38, 2 s inside the whole-group deadline it had then; 5.5 s on a quiet machine now), a step's hardly.
COLLECTIVE_TIMEOUT_S = 60
STALL_S = 150


def _packed(lengths: tuple[int, ...], total: int) -> tuple[int, ...]:
    ids = [doc for doc, n in enumerate(lengths) for _ in range(n)]
    return tuple(ids + [-1] * (total - len(ids)))


# Global lengths divisible by 2P for P = 2 and 4 (zigzag); each case names the contract clause it reaches across shards.
CASES = {
    # ALiBi (§16) in several: a block takes the slopes natively on the diagonal, else as a key bias and a row constant.
    "causal bottom-right GQA": Case(AttentionSpec(causal=True), batch=1, heads_q=4, heads_kv=2, len_q=16, len_k=16,
                                    alibi_shape=(4,)),
    "causal top-left Lq<Lk bshd": Case(
        AttentionSpec(causal=True, causal_alignment="top_left", layout="bshd"), heads_q=4, heads_kv=4, len_q=8,
        len_k=16, head_dim=8, head_dim_v=8, seed=1, alibi_shape=(2, 4),
    ),
    # Cross-attention, no causal: blocks whose keys straddle the diagonal (c = 1, 2 in chunks of 2 × 5) at no native
    # offset, split in two by a mask; others wholly behind or ahead of it.
    "cross Lq<Lk ALiBi straddling": Case(AttentionSpec(), heads_q=4, heads_kv=2, len_q=8, len_k=20,
                                         alibi_shape=(2, 4), seed=11),
    "causal bottom-right Lq<Lk": Case(AttentionSpec(causal=True), heads_q=4, heads_kv=4, len_q=8, len_k=16, seed=2),
    # Contiguous: rank 0's queries precede every key, so none of its blocks is visible, yet its call is differentiable.
    "causal bottom-right Lq>Lk": Case(AttentionSpec(causal=True), batch=1, heads_q=2, heads_kv=2, len_q=16, len_k=8,
                                      seed=10, alibi_shape=(2,)),
    "window softcap bfloat16": Case(AttentionSpec(window=(3, 1), softcap=5.0), batch=1, heads_q=4, heads_kv=4,
                                    len_q=16, len_k=16, dtype="bfloat16", seed=3),
    "cosine sliding window": Case(AttentionSpec(causal=True, window=(4, 0), variant="cosine", layout="bshd"),
                                  heads_q=4, heads_kv=4, len_q=16, len_k=16, head_dim=8, head_dim_v=8, seed=4),
    # Sinks: once per row after the merge; q_lengths counted on the local rows' global positions (§15). ALiBi's
    # offset per element (kv_len − q_len): every block split by a mask.
    "lengths bottom-right sinks": Case(AttentionSpec(causal=True), heads_q=4, heads_kv=4, len_q=16, len_k=16,
                                       q_lengths=(16, 5), kv_lengths=(13, 9), sinks=True, seed=5, alibi_shape=(2, 4)),
    "lengths top-left MQA": Case(AttentionSpec(causal=True, causal_alignment="top_left"), heads_q=4, heads_kv=1,
                                 len_q=16, len_k=16, kv_lengths=(16, 7), seed=6, alibi_shape=(4,)),
    "segment ids causal": Case(AttentionSpec(causal=True), batch=1, heads_q=4, heads_kv=4, len_q=16, len_k=16,
                               q_segment_ids=(_packed((5, 6, 3), 16),), kv_segment_ids=(_packed((5, 6, 3), 16),),
                               seed=7),
    # The user's bias block plus the key bias of ALiBi's linear sides; dbias through both.
    "mask and bias float16": Case(AttentionSpec(causal=True), heads_q=4, heads_kv=2, len_q=16, len_k=16,
                                  mask_shape=(2, 1, 16, 16), masked_rows=(3,), bias_shape=(1, 4, 16, 16),
                                  bias_grad=True, dtype="float16", seed=8, alibi_shape=(2, 4)),
    # Mask programs (§17) on global positions: document-causal with the spec's causal off; chunked under causal.
    "mask program documents GQA": Case(AttentionSpec(), heads_q=4, heads_kv=2, len_q=16, len_k=16, seed=12,
                                       program=document_causal(2, 16)),
    "mask program chunked per head causal bshd": Case(
        AttentionSpec(causal=True, layout="bshd"), batch=1, heads_q=4, heads_kv=4, len_q=16, len_k=16, seed=13,
        program=chunked_per_head(),
    ),
    # Dropout (§18): each block's keep-mask at its global query, key (and under Ulysses head) offsets; the ring's
    # backward regenerates it piece by piece. float32: a wrong kept element moves out far beyond its tolerance.
    "dropout causal GQA": Case(AttentionSpec(causal=True), heads_q=4, heads_kv=2, len_q=16, len_k=16, seed=14,
                               dropout=(0.3, 2**64 - 3)),
    # Every block split in two calls by ALiBi's sides (offsets per element), both with the block's keep-mask; sinks.
    "dropout lengths ALiBi sinks bshd": Case(AttentionSpec(causal=True, layout="bshd"), heads_q=4, heads_kv=4,
                                             len_q=8, len_k=16, head_dim=8, head_dim_v=8, q_lengths=(8, 3),
                                             kv_lengths=(13, 16), sinks=True, alibi_shape=(2, 4), seed=15,
                                             dropout=(0.1, 12345)),
    # Three ranks: lengths multiples of 2P = 6, heads of P = 3 (Ulysses serves it).
    "three ranks causal GQA Lq<Lk lengths": Case(AttentionSpec(causal=True), heads_q=6, heads_kv=3, len_q=6,
                                                 len_k=12, kv_lengths=(12, 7), seed=9, alibi_shape=(6,)),
}  # fmt: skip


# CI's budget: the four-rank group (where the ring makes more than one hop) runs the cases that reach furthest across
# shards; the two-rank group runs the rest whose lengths it divides; the three-rank group its own case and its draws.
FIXED_CASES = {
    2: [name for name in CASES if not name.startswith("three ranks")],
    3: ["three ranks causal GQA Lq<Lk lengths"],
    4: ["causal bottom-right Lq<Lk", "window softcap bfloat16", "lengths bottom-right sinks", "segment ids causal",
        "mask and bias float16", "cosine sliding window",  # contiguous: the ring stops after one hop
        "dropout causal GQA"],
}  # fmt: skip


def _drawn_cases() -> dict[int, dict[str, Case]]:
    """The drawn cases of each world size, drawn together (so that the worlds get different ones)."""
    shardable = (shardable_cases(world, SHARDED_DTYPES, mask_and_bias=True, three_d=False) for world in WORLDS)
    rows = examples(st.tuples(*shardable))
    return {world: {f"drawn {index}": row[position] for index, row in enumerate(rows)}
            for position, world in enumerate(WORLDS)}  # fmt: skip


def _runs(case: Case, world: int) -> list[tuple[str, str]]:
    """Every strategy × sharding that serves the case; Ulysses needs heads divisible by P and takes no mask/bias."""
    ulysses = case.heads_q % world == 0 and case.heads_kv % world == 0 and case.mask_shape is None
    return [(strategy, sharding) for strategy in STRATEGIES for sharding in SHARDINGS
            if strategy != "ulysses" or (ulysses and case.bias_shape is None)]  # fmt: skip


def _program_backend() -> str:
    """A CPU backend that evaluates mask programs (triton runs interpreted without a GPU, tests/conftest.py)."""
    backends = attnkit.registered_backends()
    for name in ("torch-chunked", "triton"):
        if Feature.MASK_PROGRAM in backends[name].capabilities.features:
            return name
    raise AssertionError("no CPU backend evaluates mask programs")


def _seq_axis(case: Case) -> int:
    return 1 if case.spec.layout.value == "bshd" else 2


def _run_case(case: Case, arrays: dict[str, np.ndarray], strategy: str, sharding: str) -> dict[str, np.ndarray]:
    """One sharded call with its backward, unsharded: the results as the harness names them."""
    axis = _seq_axis(case)

    def local(name: str, seq_axis: int | None = None, grad: bool = False) -> Any:
        """This rank's shard; mask and bias (any rank of §4.4) are sharded on their query axis unless broadcast."""
        if name not in arrays:
            return None
        dtype = getattr(torch, case.dtype) if name in FLOATING_INPUTS else torch.float32 if name == "dlse" else None
        value = torch.tensor(arrays[name], dtype=dtype)
        seq_axis = value.ndim - 2 if seq_axis is None else seq_axis
        if name in ("mask", "bias") and value.shape[seq_axis] == 1:
            shard = value
        else:
            shard = distributed.shard(value, sharding=sharding, seq_axis=seq_axis)
        return shard.clone().requires_grad_(True) if grad else shard

    q, k, v = (local(name, axis, grad=True) for name in ("q", "k", "v"))
    bias = local("bias", grad=case.bias_grad)
    lengths = {name: torch.tensor(arrays[name]) for name in ("q_lengths", "kv_lengths") if name in arrays}
    sinks = torch.tensor(arrays["sinks"], dtype=getattr(torch, case.dtype), requires_grad=True) if case.sinks else None
    slopes = torch.tensor(arrays["alibi_slopes"]) if "alibi_slopes" in arrays else None  # float32, no gradient
    program: dict[str, Any] = {}
    if case.program is not None:  # the same global tables on every rank
        tables = [torch.tensor(arrays[program_table(slot)]) for slot in range(len(case.program.tables))]
        program = {"mask_mod": program_function(case.program, tables), "backend": _program_backend()}
    out, lse = distributed.attend(
        case.spec, q, k, v, strategy=strategy, sharding=sharding, mask=local("mask"), bias=bias,
        q_segment_ids=local("q_segment_ids", 1), kv_segment_ids=local("kv_segment_ids", 1), return_lse=True,
        sinks=sinks, alibi_slopes=slopes, **lengths, **program, **dropout_of(case),
    )  # fmt: skip
    assert out.dtype == q.dtype and lse.dtype == torch.float32, (out.dtype, lse.dtype)  # §14: as attend's
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    leaves = [q, k, v] + ([bias] if case.bias_grad else []) + ([sinks] if sinks is not None else [])
    grads = list(torch.autograd.grad((out, finite_lse), leaves, (local("dout", axis), local("dlse", 2))))
    dsinks = grads.pop() if sinks is not None else None
    results = {"out": (out, axis), "lse": (lse, 2), "dq": (grads[0], axis), "dk": (grads[1], axis),
               "dv": (grads[2], axis)}  # fmt: skip
    whole = {name: distributed.unshard(x.detach(), sharding=sharding, seq_axis=a) for name, (x, a) in results.items()}
    if case.bias_grad:
        dbias, bias_rows = grads[3].contiguous(), grads[3].ndim - 2  # a gradient may be an expanded view
        if dbias.shape[bias_rows] == 1:  # every rank holds the whole bias: its gradient is the sum of theirs
            dist.all_reduce(dbias)
            whole["dbias"] = dbias
        else:
            whole["dbias"] = distributed.unshard(dbias, sharding=sharding, seq_axis=bias_rows)
    if dsinks is not None:  # each rank's rows' share, summed in float32 (docs/distributed.md)
        dsinks = dsinks.float()
        dist.all_reduce(dsinks)
        whole["dsinks"] = dsinks
    return {name: x.double().numpy() for name, x in whole.items()}


def _bad_inputs(world: int, rank: int) -> dict[str, str]:
    """Each bad call, made on every rank: the typed error each rank raised (or 'no error')."""
    spec = AttentionSpec(causal=True)
    q = torch.randn(1, 4, 4, 8)

    def tensors(length: int, heads: int = 4, dtype: Any = torch.float32) -> list[Any]:
        return [torch.randn(1, heads, length, 8, dtype=dtype) for _ in range(3)]

    calls = {
        "unequal shards": lambda: distributed.attend(spec, *tensors(4 if rank == world - 1 else 6)),
        "length not divisible": lambda: distributed.attend(spec, *tensors(3)),
        "ulysses heads": lambda: distributed.attend(spec, *tensors(4, heads=world + 1), strategy="ulysses"),
        "dtype on one rank": lambda: distributed.attend(
            spec, *tensors(4, dtype=torch.float64 if rank == 1 else torch.float32)
        ),
        "k dtype on one rank": lambda: distributed.attend(
            spec, q, torch.randn(1, 4, 4, 8, dtype=torch.float16 if rank == world - 1 else torch.float32), q
        ),
        "strategy on one rank": lambda: distributed.attend(spec, *tensors(4), strategy="ring" if rank else "rings"),
        "negative slope on one rank": lambda: distributed.attend(
            spec, *tensors(4), alibi_slopes=torch.tensor([0.5, 0.25, -1.0 if rank == world - 1 else 0.0, 0.125])
        ),
        "mask program on one rank": lambda: distributed.attend(
            spec, *tensors(4), mask_mod=(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx) if rank == 0 else None
        ),
        "dropout seed on one rank": lambda: distributed.attend(spec, *tensors(4), dropout_p=0.1, dropout_seed=rank),
        "dropout_p on one rank": lambda: distributed.attend(spec, *tensors(4), dropout_p=0.1 * (rank == 0)),
    }
    raised = {}
    for name, call in calls.items():
        try:
            call()
            raised[name] = "no error"
        except AttnkitError as error:
            raised[name] = f"{type(error).__name__}: {error}"
    distributed.attend(spec, *tensors(4))  # the group still works: no rank was left inside a collective
    return raised


def _drawn_seed_difference(world: int) -> float:
    """A sharded call with dropout and no seed, each rank's generator in a state of its own: its greatest difference
    from the single-device call drawing its seed from rank 0's state (every rank uses the seed rank 0 drew)."""
    spec = AttentionSpec(causal=True)
    whole = [torch.randn(1, 4, 4 * world, 8, generator=torch.Generator().manual_seed(index)) for index in range(3)]
    torch.manual_seed(100 + dist.get_rank())
    out = distributed.unshard(distributed.attend(spec, *(distributed.shard(x) for x in whole), dropout_p=0.5))
    torch.manual_seed(100)
    return float((out - attnkit.attend(spec, *whole, dropout_p=0.5)).abs().max())


# What the traffic check runs: a causal GQA call (K/V volume ∝ Hkv), the same under a sliding window of one
# contiguous shard, and a packed row of three documents and padding.
TRAFFIC = {"batch": 1, "heads": 4, "heads_kv": 2, "head_dim": 8, "chunk": 4, "documents": (5, 6, 3)}

TRAFFIC_WINDOW = (2 * TRAFFIC["chunk"], 0)  # a query sees back to the first position of the preceding contiguous shard


def _traffic(world: int) -> dict[str, Any]:
    """What this rank sent per strategy in a forward+backward (torch_cp.recording), and the blocks it computed in a
    forward of the packed row under the ring."""
    length = TRAFFIC["chunk"] * 2 * world
    spec = AttentionSpec(causal=True)
    shape = (TRAFFIC["batch"], TRAFFIC["heads"], length, TRAFFIC["head_dim"])
    q, k, v = (
        torch.randn(shape[0], heads, *shape[2:]) for heads in (shape[1], TRAFFIC["heads_kv"], TRAFFIC["heads_kv"])
    )
    local = [distributed.shard(x, sharding="zigzag") for x in (q, k, v)]
    sent = {}
    window = AttentionSpec(causal=True, window=TRAFFIC_WINDOW)
    runs = {
        "ring": (spec, local, "zigzag"),
        "allgather": (spec, local, "zigzag"),
        "ring window": (window, [distributed.shard(x, sharding="contiguous") for x in (q, k, v)], "contiguous"),
    }
    for name, (run_spec, shards, sharding) in runs.items():
        leaves = [x.clone().requires_grad_(True) for x in shards]
        with torch_cp.recording() as traffic:
            out = distributed.attend(run_spec, *leaves, strategy=name.split()[0], sharding=sharding)
            torch.autograd.grad(out, leaves, torch.ones_like(out))
        sent[name] = traffic.sent_bytes
    ids = distributed.shard(torch.tensor([_packed(TRAFFIC["documents"], length)]), sharding="zigzag", seq_axis=1)
    with torch.no_grad(), torch_cp.recording() as traffic:
        distributed.attend(spec, *local, q_segment_ids=ids, kv_segment_ids=ids)
    # The same documents as a mask program over global positions: the blocks it hides are skipped alike.
    documents = torch.tensor([_packed(TRAFFIC["documents"], length)])

    def same_document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (documents[b, q_idx] == documents[b, kv_idx]) & (documents[b, q_idx] >= 0)

    with torch.no_grad(), torch_cp.recording() as program_traffic:
        distributed.attend(spec, *local, mask_mod=same_document, backend=_program_backend())
    return {"sent": sent, "blocks": traffic.blocks, "program blocks": program_traffic.blocks}


def _child(rank: int, world: int, directory: str, cases: dict[str, tuple[Case, dict[str, np.ndarray]]]) -> None:
    torch.set_num_threads(1)
    torch_cp._BACKWARD_PIECE = 3  # the ring's backward pieces: smaller than most chunks here, and uneven
    dist.init_process_group("gloo", init_method=f"file://{directory}/init", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))  # fmt: skip
    progress = Path(directory, f"rank{rank}.steps")
    steps = 0

    def step_done() -> None:
        nonlocal steps
        steps += 1
        progress.write_text(str(steps))

    try:
        results = {}
        for name, (case, arrays) in cases.items():
            for strategy, sharding in _runs(case, world):
                results[(name, strategy, sharding)] = _run_case(case, arrays, strategy, sharding)
                step_done()
        bad = _bad_inputs(world, rank)
        step_done()
        report = {"results": results if rank == 0 else {}, "bad": bad, "traffic": _traffic(world),
                  "drawn seed difference": _drawn_seed_difference(world)}  # fmt: skip
        Path(directory, f"rank{rank}.pkl").write_bytes(pickle.dumps(report))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp_path: Path, cases: dict[str, tuple[Case, dict[str, np.ndarray]]]) -> list[dict[str, Any]]:
    context = torch.multiprocessing.start_processes(
        _child, args=(world, str(tmp_path), cases), nprocs=world, join=False, start_method="spawn"
    )
    seen, since = "", time.monotonic()
    while not context.join(timeout=1):
        steps = " ".join(path.read_text() for path in sorted(tmp_path.glob("rank*.steps")))
        if steps != seen:
            seen, since = steps, time.monotonic()
        elif time.monotonic() - since > STALL_S:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world}-rank group finished no step for {STALL_S} s (steps per rank: {seen or 'none'}): "
                        "a rank hung")  # fmt: skip
    return [pickle.loads(Path(tmp_path, f"rank{rank}.pkl").read_bytes()) for rank in range(world)]


def _with_oracle(case: Case) -> tuple[Case, dict[str, np.ndarray], Any]:
    arrays = rounded(case, make_arrays(case))
    return case, arrays, oracle_results(case, arrays)


@pytest.fixture(scope="module")
def oracle() -> dict[str, tuple[Case, dict[str, np.ndarray], Any]]:
    return {name: _with_oracle(case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def drawn() -> dict[int, dict[str, Case]]:
    return _drawn_cases()


@pytest.fixture(scope="module", params=WORLDS, ids=lambda world: f"{world} ranks")
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, oracle: dict, drawn: dict) -> Any:
    """One spawn of a ``world``-rank group for every test of this module: (world, the cases it ran, each rank's
    report)."""
    world = request.param
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    table = {name: oracle[name] for name in FIXED_CASES[world]}
    table.update({name: _with_oracle(case) for name, case in drawn[world].items()})
    directory = tmp_path_factory.mktemp(f"group{world}")
    return world, table, _spawn(world, directory, {name: (case, arrays) for name, (case, arrays, _) in table.items()})


def test_sharded_call_equals_the_single_device_call(group: Any) -> None:
    world, table, reports = group
    results = reports[0]["results"]
    failures = []
    for name, (case, _, (exact, baseline)) in table.items():
        for strategy, sharding in _runs(case, world):
            got = results[(name, strategy, sharding)]
            failures += [f"{name} {strategy} {sharding} {case!r}: {c}"
                         for c in compare(case, got, exact, baseline) if not c.ok]  # fmt: skip
    assert not failures, "\n".join(failures)


def test_a_bad_input_on_one_rank_raises_on_every_rank(group: Any) -> None:
    """Each bad call was made on every rank; each raised a typed error there, and the group still worked after."""
    world, _, reports = group
    expected = {
        "unequal shards": "InvalidInputError: q shape differs across ranks",
        "length not divisible": "InvalidInputError: q is",
        "ulysses heads": "InvalidInputError: strategy 'ulysses' splits the heads",
        "dtype on one rank": "InvalidInputTypeError: q dtype differs across ranks",
        "k dtype on one rank": "InvalidInputTypeError: k dtype differs across ranks",
        "strategy on one rank": "InvalidInputError: ",
        "negative slope on one rank": "InvalidInputError: ",
        "mask program on one rank": "InvalidInputError: mask_mod differs across ranks",
        "dropout seed on one rank": "InvalidInputError: dropout_seed differs across ranks",
        "dropout_p on one rank": "InvalidInputError: dropout_p differs across ranks",
    }
    for rank, report in enumerate(reports):
        for name, start in expected.items():
            assert report["bad"][name].startswith(start), (rank, name, report["bad"][name])
    assert all("rank 0" in report["bad"]["strategy on one rank"] for report in reports[1:])
    slope = [report["bad"]["negative slope on one rank"] for report in reports]
    assert all("alibi_slopes must be finite and >= 0" in message for message in slope), slope
    assert all(f"rank {world - 1}" in message for message in slope[:-1]), slope


def test_a_dropout_seed_not_given_is_rank_0s_draw_on_every_rank(group: Any) -> None:
    """§18 sharded: with no dropout_seed, every rank draws one and all use rank 0's, so that the sharded call equals
    the single-device call drawing from rank 0's generator, whatever the other ranks' generators hold."""
    _, _, reports = group
    differences = [report["drawn seed difference"] for report in reports]
    assert max(differences) < 1e-5, differences


def test_each_rank_sends_the_analytic_volume_and_skips_blocks_of_other_documents(group: Any) -> None:
    """Bytes sent per rank equal the analytic count of each strategy (K/V sized by Hkv; a windowed ring carries K/V
    only as far as some rank still sees them); the ring computes exactly the blocks with a visible pair, causal and
    the same document (given as segment ids, or as a mask program), counted here by brute force on global
    positions."""
    world, _, reports = group
    length = TRAFFIC["chunk"] * 2 * world
    position = np.arange(length)
    causal = position[:, None] >= position[None, :]
    # The windowed ring carries each contiguous shard only as far as the furthest rank whose queries see into it.
    left, _ = TRAFFIC_WINDOW
    shard = length // world
    windowed = causal & (position[:, None] - position[None, :] <= left)
    hops = max((r - s) % world for r in range(world) for s in range(world)
               if windowed[r * shard : (r + 1) * shard, s * shard : (s + 1) * shard].any())  # fmt: skip
    config = {**TRAFFIC, "seq_len": length}
    expected = {"ring": analytic_sent_bytes("ring", world, config), "allgather": analytic_sent_bytes("allgather", world,
                config), "ring window": analytic_sent_bytes("ring", world, config, hops=hops)}  # fmt: skip
    for name, sent in expected.items():
        for report in reports:
            assert report["traffic"]["sent"][name] == pytest.approx(sent), name
    ids = np.array(_packed(TRAFFIC["documents"], length))
    visible = causal & (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    chunk = TRAFFIC["chunk"]
    for rank, report in enumerate(reports):
        query_chunks = (rank, 2 * world - 1 - rank)  # zigzag
        seen = sum(bool(visible[i * chunk : (i + 1) * chunk, j * chunk : (j + 1) * chunk].any())
                   for i in query_chunks for j in range(2 * world))  # fmt: skip
        assert report["traffic"]["blocks"] == seen, rank
        assert report["traffic"]["program blocks"] == seen, rank


def test_refuses_other_arrays_and_a_missing_group() -> None:
    spec = AttentionSpec()
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(attnkit.InvalidInputError, match="not initialised"):
        distributed.attend(spec, q, q, q)
    with pytest.raises(attnkit.InvalidInputTypeError, match="torch.Tensor or a jax.Array, got numpy.ndarray"):
        distributed.attend(spec, q.numpy(), q, q)
