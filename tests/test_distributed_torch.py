"""attnkit.distributed.attend on torch (docs/semantics.md §14): the sharded call equals the single-device one.

One spawn of a gloo group per world size runs every case under every strategy × sharding, and the bad inputs, in the
children; the parent holds each result (out, lse, dq, dk, dv unsharded) against the float64 oracle under the
tolerance rule, and checks that a bad input on any rank raised a typed error on every rank (nothing hung: the spawn
has a deadline)."""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import attnkit  # noqa: E402
from attnkit import distributed  # noqa: E402
from attnkit.errors import AttnkitError  # noqa: E402
from attnkit.spec import AttentionSpec  # noqa: E402
from attnkit.testing.agreement import compare_outputs, oracle_results, rounded  # noqa: E402
from attnkit.testing.cases import Case, make_arrays  # noqa: E402

STRATEGIES = ("ring", "allgather", "ulysses")
SHARDINGS = ("contiguous", "zigzag")
DEADLINE_S = 120


def _packed(lengths: tuple[int, ...], total: int) -> tuple[int, ...]:
    ids = [doc for doc, n in enumerate(lengths) for _ in range(n)]
    return tuple(ids + [-1] * (total - len(ids)))


# Global lengths divisible by 2P for P = 2 and 4 (zigzag); each case names the contract clause it reaches across shards.
CASES = {
    "causal bottom-right GQA": Case(AttentionSpec(causal=True), batch=1, heads_q=4, heads_kv=2, len_q=16, len_k=16),
    "causal top-left Lq<Lk bshd": Case(
        AttentionSpec(causal=True, causal_alignment="top_left", layout="bshd"), heads_q=4, heads_kv=4, len_q=8,
        len_k=16, head_dim=8, head_dim_v=8, seed=1,
    ),
    "causal bottom-right Lq<Lk": Case(AttentionSpec(causal=True), heads_q=4, heads_kv=4, len_q=8, len_k=16, seed=2),
    "window softcap": Case(AttentionSpec(window=(3, 1), softcap=5.0), batch=1, heads_q=4, heads_kv=4, len_q=16,
                           len_k=16, seed=3),
    "cosine sliding window": Case(AttentionSpec(causal=True, window=(4, 0), variant="cosine", layout="bshd"),
                                  heads_q=4, heads_kv=4, len_q=16, len_k=16, head_dim=8, head_dim_v=8, seed=4),
    "lengths bottom-right": Case(AttentionSpec(causal=True), heads_q=4, heads_kv=4, len_q=16, len_k=16,
                                 q_lengths=(16, 5), kv_lengths=(13, 9), seed=5),
    "lengths top-left MQA": Case(AttentionSpec(causal=True, causal_alignment="top_left"), heads_q=4, heads_kv=1,
                                 len_q=16, len_k=16, kv_lengths=(16, 7), seed=6),
    "segment ids causal": Case(AttentionSpec(causal=True), batch=1, heads_q=4, heads_kv=4, len_q=16, len_k=16,
                               q_segment_ids=(_packed((5, 6, 3), 16),), kv_segment_ids=(_packed((5, 6, 3), 16),),
                               seed=7),
    "mask and bias": Case(AttentionSpec(causal=True), heads_q=4, heads_kv=2, len_q=16, len_k=16,
                          mask_shape=(2, 1, 16, 16), masked_rows=(3,), bias_shape=(1, 4, 16, 16), bias_grad=True,
                          seed=8),
}  # fmt: skip


# CI's budget: the four-rank group (where the ring makes more than one hop) runs the cases that reach furthest across
# shards; the two-rank group runs them all.
FOUR_RANK_CASES = ("causal bottom-right Lq<Lk", "window softcap", "lengths bottom-right", "segment ids causal",
                   "mask and bias")  # fmt: skip


def _cases_for(world: int) -> list[str]:
    return list(CASES) if world == 2 else list(FOUR_RANK_CASES)


def _runs(case: Case, world: int) -> list[tuple[str, str]]:
    """Every strategy × sharding that serves the case; Ulysses needs heads divisible by P and takes no mask/bias."""
    ulysses = case.heads_q % world == 0 and case.heads_kv % world == 0 and case.mask_shape is None
    return [(strategy, sharding) for strategy in STRATEGIES for sharding in SHARDINGS
            if strategy != "ulysses" or (ulysses and case.bias_shape is None)]  # fmt: skip


def _seq_axis(case: Case) -> int:
    return 1 if case.spec.layout.value == "bshd" else 2


def _run_case(case: Case, arrays: dict[str, np.ndarray], strategy: str, sharding: str) -> dict[str, np.ndarray]:
    """One sharded call with its backward, unsharded: the results as the harness names them."""
    axis = _seq_axis(case)

    def local(name: str, seq_axis: int, grad: bool = False) -> Any:
        if name not in arrays:
            return None
        value = torch.tensor(arrays[name], dtype=torch.float32 if arrays[name].dtype.kind == "f" else None)
        if name in ("mask", "bias") and value.shape[seq_axis] == 1:
            shard = value
        else:
            shard = distributed.shard(value, sharding=sharding, seq_axis=seq_axis)
        return shard.clone().requires_grad_(True) if grad else shard

    q, k, v = (local(name, axis, grad=True) for name in ("q", "k", "v"))
    bias = local("bias", 2, grad=case.bias_grad)
    lengths = {name: torch.tensor(arrays[name]) for name in ("q_lengths", "kv_lengths") if name in arrays}
    out, lse = distributed.attend(
        case.spec, q, k, v, strategy=strategy, sharding=sharding, mask=local("mask", 2), bias=bias,
        q_segment_ids=local("q_segment_ids", 1), kv_segment_ids=local("kv_segment_ids", 1), return_lse=True,
        **lengths,
    )  # fmt: skip
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    leaves = [q, k, v] + ([bias] if case.bias_grad else [])
    grads = torch.autograd.grad((out, finite_lse), leaves, (local("dout", axis), local("dlse", 2)))
    results = {"out": (out, axis), "lse": (lse, 2), "dq": (grads[0], axis), "dk": (grads[1], axis),
               "dv": (grads[2], axis)}  # fmt: skip
    whole = {name: distributed.unshard(x.detach(), sharding=sharding, seq_axis=a) for name, (x, a) in results.items()}
    if case.bias_grad:
        whole["dbias"] = distributed.unshard(grads[3], sharding=sharding, seq_axis=2)
    return {name: x.double().numpy() for name, x in whole.items()}


def _bad_inputs(world: int, rank: int) -> dict[str, str]:
    """Each bad call, made on every rank: the typed error each rank raised (or 'no error')."""
    spec = AttentionSpec(causal=True)

    def tensors(length: int, heads: int = 4, dtype: Any = torch.float32) -> list[Any]:
        return [torch.randn(1, heads, length, 8, dtype=dtype) for _ in range(3)]

    calls = {
        "unequal shards": lambda: distributed.attend(spec, *tensors(4 if rank == world - 1 else 6)),
        "length not divisible": lambda: distributed.attend(spec, *tensors(3)),
        "ulysses heads": lambda: distributed.attend(spec, *tensors(4, heads=world + 1), strategy="ulysses"),
        "dtype on one rank": lambda: distributed.attend(
            spec, *tensors(4, dtype=torch.float64 if rank == 1 else torch.float32)
        ),
        "strategy on one rank": lambda: distributed.attend(spec, *tensors(4), strategy="ring" if rank else "rings"),
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


def _child(rank: int, world: int, directory: str, cases: dict[str, tuple[Case, dict[str, np.ndarray]]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/init", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        results = {}
        for name, (case, arrays) in cases.items():
            for strategy, sharding in _runs(case, world):
                results[(name, strategy, sharding)] = _run_case(case, arrays, strategy, sharding)
        report = {"results": results if rank == 0 else {}, "bad": _bad_inputs(world, rank)}
        Path(directory, f"rank{rank}.pkl").write_bytes(pickle.dumps(report))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp_path: Path, cases: dict[str, tuple[Case, dict[str, np.ndarray]]]) -> list[dict[str, Any]]:
    context = torch.multiprocessing.start_processes(
        _child, args=(world, str(tmp_path), cases), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world}-rank group did not finish within {DEADLINE_S} s: a rank hung in a collective")
    return [pickle.loads(Path(tmp_path, f"rank{rank}.pkl").read_bytes()) for rank in range(world)]


@pytest.fixture(scope="module")
def oracle() -> dict[str, tuple[Case, dict[str, np.ndarray], Any]]:
    table = {}
    for name, case in CASES.items():
        arrays = rounded(case, make_arrays(case))
        table[name] = (case, arrays, oracle_results(case, arrays))
    return table


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_call_equals_the_single_device_call(world: int, tmp_path: Path, oracle: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = _cases_for(world)
    reports = _spawn(world, tmp_path, {name: oracle[name][:2] for name in names})
    results = reports[0]["results"]
    failures = []
    for name in names:
        case, _, (exact, baseline) = oracle[name]
        for strategy, sharding in _runs(case, world):
            got = results[(name, strategy, sharding)]
            failures += [f"{name} {strategy} {sharding}: {c}" for c in compare_outputs("float32", got, exact, baseline)
                         if not c.ok]  # fmt: skip
    assert not failures, "\n".join(failures)
    expected = {
        "unequal shards": "InvalidInputError: q shape differs across ranks",
        "length not divisible": "InvalidInputError: q is",
        "ulysses heads": "InvalidInputError: strategy 'ulysses' splits the heads",
        "dtype on one rank": "InvalidInputTypeError: q dtype differs across ranks",
        "strategy on one rank": "InvalidInputError: ",
    }
    for rank, report in enumerate(reports):
        for name, start in expected.items():
            assert report["bad"][name].startswith(start), (rank, name, report["bad"][name])
    assert all("rank 0" in report["bad"]["strategy on one rank"] for report in reports[1:])


def test_refuses_other_arrays_and_a_missing_group() -> None:
    spec = AttentionSpec()
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(attnkit.InvalidInputError, match="not initialised"):
        distributed.attend(spec, q, q, q)
    with pytest.raises(attnkit.InvalidInputTypeError, match="torch.Tensor or a jax.Array, got numpy.ndarray"):
        distributed.attend(spec, q.numpy(), q, q)
