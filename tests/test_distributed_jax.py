"""Context parallelism on a JAX mesh (docs/semantics.md §14): attnkit.distributed's JAX calls on 4 host devices equal
the single-device call on the whole arrays, out, lse and dq, dk, dv (through out and lse), against the float64
oracle (torch-naive) under the tolerance rule at the case's dtype (float32 and bfloat16), for every
strategy × sharding over causal (both alignments, Lq ≠ Lk), windows, GQA, softcap, cosine, lengths, segment ids,
sinks, ALiBi slopes, dropout (where a JAX backend declares it) and 3-D inputs, fixed runs and runs drawn by
attnkit.testing.strategies (as many as the hypothesis profile says, derandomised under ``ci``); under jax.jit, on
arrays laid out by shard_jax and inside the caller's own shard_map. Bad input raises a typed error naming the value.

JAX makes its host devices when it is first imported (XLA_FLAGS), and this process imported it long ago: the
sharded calls run in ONE child process (this file run as a script), which reads the drawn runs from its directory and
writes each run's results there for the tests here to compare. The oracle runs here, on the same inputs.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

import attnkit
from attnkit import AttentionSpec, Feature, Framework
from attnkit.testing import Case, make_arrays
from attnkit.testing.agreement import compare, oracle_results, rounded
from attnkit.testing.cases import program_table
from attnkit.testing.programs import program_function
from attnkit.testing.runners import dropout_of
from tests.sharded_cases import DRAWN, chunked_per_head, document_causal, examples, shardable_cases

# One worker runs every test here (--dist loadgroup, pyproject.toml): the child, about a minute and a half of CI's CPU,
# then runs once per run, not once per pytest-xdist worker that is dealt one of them.
pytestmark = pytest.mark.xdist_group("distributed_jax")

WORLD = 4
AXIS = "cp"
REPO_ROOT = Path(__file__).resolve().parent.parent
CHILD_TIMEOUT_S = 600  # and 10 s more for each drawn run
PAD = -1
# Three documents and one padding position, for 16 positions: documents cross shard boundaries either way.
OPTIONAL = ("q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids")
IDS = (0,) * 5 + (1,) * 7 + (2,) * 3 + (PAD,)


@dataclass(frozen=True)
class Run:
    """One sharded call of ``case``: how it is split and run. ``inside``: attend_jax(mesh=None) called inside a
    shard_map of the test's own; else attend_jax(mesh=...) on arrays laid out by shard_jax. Both under jax.jit."""

    name: str
    case: Case
    strategy: str
    sharding: str
    inside: bool = False


def _case(spec: AttentionSpec, **shape: Any) -> Case:
    return Case(spec, **{"batch": 1, "heads_q": 2, "heads_kv": 2, "len_q": 16, "len_k": 16, "head_dim": 8,
                         "head_dim_v": 8, **shape})  # fmt: skip


CAUSAL = AttentionSpec(causal=True)
TOP_LEFT = AttentionSpec(causal=True, causal_alignment="top_left")
# fmt: off
RUNS = [
    # ALiBi (§16) in several: native on the diagonal blocks, a key bias and a row constant (traced offsets) elsewhere.
    Run("ring-zigzag-causal-gqa", _case(CAUSAL, heads_q=4, heads_kv=2, alibi_shape=(4,)), "ring", "zigzag"),
    # bfloat16 (not float16: the runs are jitted, and JAX's CPU dot_general rejects the F16_F16_F32 product of the
    # jitted backward, backends/native/jax_xla.py).
    Run("ring-contiguous-window-gqa-bfloat16",
        _case(AttentionSpec(causal=True, window=(5, 0)), heads_q=4, heads_kv=2, dtype="bfloat16"), "ring",
        "contiguous"),
    Run("ring-zigzag-causal-lq<lk-3d", _case(CAUSAL, len_q=8, three_d=True), "ring", "zigzag"),
    Run("ring-contiguous-top-left-lq<lk-segments",
        _case(TOP_LEFT, len_q=8, q_segment_ids=(IDS[::2],), kv_segment_ids=(IDS,)), "ring", "contiguous"),
    Run("ring-zigzag-window-bshd", _case(AttentionSpec(window=(3, 2), layout="bshd")), "ring", "zigzag"),
    # Cross-attention, no causal: blocks straddling the diagonal at no native offset (c = 1, 2 in chunks of 2 × 5).
    Run("ring-contiguous-cross-lq<lk-alibi", _case(AttentionSpec(), len_q=8, len_k=20, alibi_shape=(2,)), "ring",
        "contiguous"),
    # Bottom-right with lengths: the band's offset per element, masked blocks; b=1's first rows see nothing.
    # Sinks once per row after the merge, q_lengths counted on each device's rows' global positions (§15). ALiBi's
    # offset per element: every block split by a mask.
    Run("ring-zigzag-lengths-sinks", _case(CAUSAL, batch=2, q_lengths=(16, 11), kv_lengths=(16, 6), sinks=True,
                                           alibi_shape=(2, 2)), "ring", "zigzag"),
    Run("allgather-zigzag-softcap", _case(AttentionSpec(causal=True, softcap=2.0)), "allgather", "zigzag"),
    Run("allgather-contiguous-cosine-window",
        _case(AttentionSpec(causal=True, window=(4, 0), variant="cosine")), "allgather", "contiguous"),
    Run("allgather-zigzag-top-left-lengths-segments",
        _case(TOP_LEFT, q_lengths=(13,), kv_lengths=(15,), q_segment_ids=(IDS,), kv_segment_ids=(IDS,),
              alibi_shape=(2,)), "allgather", "zigzag"),
    # Ulysses: each device's slice of the slopes, for the heads the all-to-all gave it.
    Run("ulysses-zigzag-causal-gqa", _case(CAUSAL, heads_q=8, heads_kv=4, alibi_shape=(8,)), "ulysses", "zigzag"),
    Run("ulysses-contiguous-window-lengths",
        _case(AttentionSpec(window=(2, 5)), heads_q=4, heads_kv=4, batch=2, q_lengths=(16, 7), kv_lengths=(9, 16),
              alibi_shape=(2, 4)), "ulysses", "contiguous"),
    Run("allgather-zigzag-gqa-lengths-sinks-inside-own-shard-map",
        _case(CAUSAL, heads_q=4, heads_kv=2, q_lengths=(13,), sinks=True, alibi_shape=(1, 4)), "allgather", "zigzag",
        inside=True),
    # Mask programs (§17) on global positions: documents read from a captured table across shards; per-head chunks
    # under Ulysses, where a device's heads are the r-th group of the global ones.
    Run("ring-zigzag-program-documents-gqa", _case(AttentionSpec(), heads_q=4, heads_kv=2, batch=2,
                                                   program=document_causal(2, 16)), "ring", "zigzag"),
    Run("ulysses-contiguous-program-chunked-per-head",
        _case(CAUSAL, heads_q=4, heads_kv=4, program=chunked_per_head()), "ulysses", "contiguous"),
    # Dropout (§18): each block's keep-mask at its traced global offsets (query and key chunks; Ulysses' first
    # head), the two calls of a block split by ALiBi's sides (offsets per element) with the same one.
    Run("ring-zigzag-dropout-gqa-lengths-alibi",
        _case(CAUSAL, batch=2, heads_q=4, heads_kv=2, q_lengths=(16, 11), kv_lengths=(16, 6), alibi_shape=(2, 4),
              dropout=(0.3, 2**64 - 3)), "ring", "zigzag"),
    Run("ulysses-contiguous-dropout-gqa-inside-own-shard-map",
        _case(CAUSAL, heads_q=8, heads_kv=4, dropout=(0.5, 12345)), "ulysses", "contiguous", inside=True),
]
# fmt: on
# Drawn runs: JAX takes no mask or bias; float16 is left out as above, float64 needs x64 (and a block's lse is float32).
DRAWN_DTYPES = ("float32", "bfloat16")
# Half as many as the torch tests draw: each run here compiles a program of its own.
DRAWN_RUNS = max(2, DRAWN // 2)


@st.composite
def _drawn_run(draw: st.DrawFn) -> Run:
    """A case drawn by attnkit.testing.strategies, made shardable, under a drawn strategy × sharding that serves it."""
    case = draw(shardable_cases(WORLD, DRAWN_DTYPES, mask_and_bias=False, three_d=True))
    strategies = ["ring", "allgather"] + (["ulysses"] if case.heads_q % WORLD == case.heads_kv % WORLD == 0 else [])
    return Run("drawn", case, draw(st.sampled_from(strategies)), draw(st.sampled_from(["contiguous", "zigzag"])))


# Bad input: (name, what is called, substrings the InvalidInputError's message must hold).
BAD = {
    "ulysses-query-heads": (dict(heads_q=2, heads_kv=2, strategy="ulysses"), ("q has 2 heads", "4 devices")),
    "ulysses-kv-heads": (dict(heads_q=4, heads_kv=2, strategy="ulysses"), ("k has 2 heads", "4 devices")),
    "length-not-divisible": (dict(len_q=12, len_k=12, strategy="ring"), ("q is 12 positions long", "8 equal chunks")),
    "mask": (dict(mask=True, strategy="ring"), ("mask is not taken",)),
    "negative-slope": (dict(alibi_slopes=(0.5, -1.0), strategy="ring"), ("alibi_slopes must be finite and >= 0",)),
    "unknown-strategy": (dict(strategy="tree"), ("strategy='tree'", "'ring'")),
    "dropout-without-seed": (dict(dropout_p=0.1, strategy="ring"), ("needs dropout_key", "or dropout_seed")),
}


def _seq_axis(case: Case) -> int:
    return 1 if case.three_d or case.spec.layout.value == "bshd" else 2


def _run_sharded(run: Run, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The case's call sharded over the mesh and differentiated with jax.vjp, one jitted program from the whole
    arrays (laid out by shard_jax) to the whole results (put back by unshard_jax)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as Spec

    from attnkit.distributed.jax_cp import attend_jax, shard_jax, unshard_jax

    case, mesh = run.case, Mesh(np.array(jax.devices()[:WORLD]), (AXIS,))
    seq_axis = _seq_axis(case)
    options = dict(axis_name=AXIS, strategy=run.strategy, sharding=run.sharding, return_lse=True, **dropout_of(case))

    def call(q: Any, k: Any, v: Any, optional: dict[str, Any]) -> Any:
        if not run.inside:
            return attend_jax(case.spec, q, k, v, mesh=mesh, **optional, **options)
        sequence = Spec(*(AXIS if axis == seq_axis else None for axis in range(q.ndim)))
        specs = {name: Spec() if name.endswith(("lengths", "sinks", "slopes")) else Spec(None, AXIS)
                 for name in optional}  # fmt: skip
        local = jax.shard_map(
            lambda q, k, v, optional: attend_jax(case.spec, q, k, v, **optional, **options),
            mesh=mesh,
            in_specs=(sequence, sequence, sequence, specs),
            out_specs=(sequence, Spec(*(AXIS if axis == q.ndim - 2 else None for axis in range(q.ndim - 1)))),
        )
        return local(q, k, v, optional)

    def forward_backward(floats: dict[str, Any], optional: dict[str, Any]) -> list[Any]:
        def shard(x: Any, axis: int) -> Any:
            return shard_jax(x, mesh, AXIS, run.sharding, axis)

        q, k, v, dout = (shard(floats[name], seq_axis) for name in ("q", "k", "v", "dout"))
        optional = {name: shard(x, 1) if name.endswith("ids") else x for name, x in optional.items()}
        sinks = {"sinks": floats["sinks"]} if "sinks" in floats else {}  # differentiated, replicated
        (out, lse), pullback = jax.vjp(lambda q, k, v, sinks: call(q, k, v, {**optional, **sinks}), q, k, v, sinks)
        *grads, dsinks = pullback((dout, shard(floats["dlse"], -1)))
        axes = (seq_axis, -1, seq_axis, seq_axis, seq_axis)
        whole = [unshard_jax(x, mesh, AXIS, run.sharding, axis) for x, axis in zip((out, lse, *grads), axes)]
        return whole + list(dsinks.values())

    floats = {name: jnp.asarray(arrays[name], case.dtype) for name in ("q", "k", "v", "dout", "sinks")
              if name in arrays}  # fmt: skip
    floats["dlse"] = jnp.asarray(arrays["dlse"], jnp.float32)  # lse is float32 whatever the inputs' dtype (§6)
    optional = {name: jnp.asarray(arrays[name], jnp.int32) for name in OPTIONAL if name in arrays}
    if "alibi_slopes" in arrays:  # replicated, float32, taking no gradient
        optional["alibi_slopes"] = jnp.asarray(arrays["alibi_slopes"], jnp.float32)
    if case.program is not None:  # global tables, closed over (replicated): not an operand of the jitted call
        tables = [jnp.asarray(arrays[program_table(slot)]) for slot in range(len(case.program.tables))]
        options["mask_mod"] = program_function(case.program, tables, "jax")
    results = jax.jit(forward_backward)(floats, optional)
    return {name: np.asarray(x, np.float64) for name, x in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), results)}


def _bad_call(name: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from attnkit.distributed.jax_cp import attend_jax

    changes, _ = BAD[name]
    shape = {key: value for key, value in changes.items() if key in ("heads_q", "heads_kv", "len_q", "len_k")}
    arrays = make_arrays(_case(CAUSAL, **shape))
    q, k, v = (jnp.asarray(arrays[key], jnp.float32) for key in ("q", "k", "v"))
    mask = jnp.ones((1, 1, q.shape[2], k.shape[2]), bool) if changes.get("mask") else None
    slopes = jnp.asarray(changes["alibi_slopes"], jnp.float32) if "alibi_slopes" in changes else None
    mesh = Mesh(np.array(jax.devices()[:WORLD]), (AXIS,))
    attend_jax(CAUSAL, q, k, v, mesh=mesh, axis_name=AXIS, strategy=changes["strategy"], mask=mask,
               alibi_slopes=slopes, dropout_p=changes.get("dropout_p", 0.0))  # fmt: skip


def _dropout_served() -> bool:
    """Whether a JAX backend here declares dropout (§18), for ``auto`` to run the dropout runs' blocks on."""
    return any(
        Framework.JAX in backend.capabilities.frameworks
        and Feature.DROPOUT in backend.capabilities.on("cpu").features
        and not backend.available()
        for backend in attnkit.registered_backends().values()
    )


def _child(directory: Path) -> None:
    """Every run (the drawn ones read from ``directory``; those with dropout where a backend serves them) and bad
    call, each result or error written there."""
    outcomes: dict[str, Any] = {}
    runs = RUNS + pickle.loads((directory / "drawn.pkl").read_bytes())
    for run in [run for run in runs if run.case.dropout is None or _dropout_served()]:
        try:
            np.savez(directory / f"{run.name}.npz", **_run_sharded(run, rounded(run.case, make_arrays(run.case))))
            outcomes[run.name] = None
        except Exception:  # reported by that case's test, the others still run
            outcomes[run.name] = traceback.format_exc()
    for name in BAD:
        try:
            _bad_call(name)
            outcomes[name] = None
        except Exception as error:
            outcomes[name] = [type(error).__name__, str(error)]
    (directory / "outcomes.json").write_text(json.dumps(outcomes))


@pytest.fixture(scope="module")
def drawn_runs() -> list[Run]:
    return [replace(run, name=f"drawn-{index}") for index, run in enumerate(examples(_drawn_run(), DRAWN_RUNS))]


@pytest.fixture(scope="module")
def child_results(tmp_path_factory: pytest.TempPathFactory, drawn_runs: list[Run]) -> tuple[Path, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("distributed_jax")
    (directory / "drawn.pkl").write_bytes(pickle.dumps(drawn_runs))
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={WORLD}", "JAX_PLATFORMS": "cpu"}
    child = subprocess.run(
        [sys.executable, "-m", "tests.test_distributed_jax", str(directory)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S + 10 * len(drawn_runs),
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    return directory, json.loads((directory / "outcomes.json").read_text())


def _disagreements(run: Run, directory: Path, outcomes: dict[str, Any]) -> list[str]:
    """The run's error in the child, or each output outside the tolerance rule; [] when it agrees."""
    if outcomes[run.name] is not None:
        return [f"{run.name} {run!r}: {outcomes[run.name]}"]
    with np.load(directory / f"{run.name}.npz") as loaded:
        results = dict(loaded)
    exact, baseline = oracle_results(run.case, rounded(run.case, make_arrays(run.case)))
    comparisons = compare(run.case, results, exact, baseline)
    return [f"{run.name} {run.strategy}/{run.sharding} {run.case!r}: {c}" for c in comparisons if not c.ok]


@pytest.mark.parametrize("run", RUNS, ids=[run.name for run in RUNS])
def test_sharded_call_equals_single_device(run: Run, child_results: tuple[Path, dict[str, Any]]) -> None:
    if run.case.dropout is not None and not _dropout_served():
        pytest.skip("no JAX backend here declares dropout")
    failures = _disagreements(run, *child_results)
    assert not failures, "\n".join(failures)


def test_drawn_sharded_calls_equal_single_device(
    drawn_runs: list[Run], child_results: tuple[Path, dict[str, Any]]
) -> None:
    failures = [failure for run in drawn_runs for failure in _disagreements(run, *child_results)]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_raises_typed_error(name: str, child_results: tuple[Path, dict[str, Any]]) -> None:
    _, outcomes = child_results
    assert outcomes[name] is not None, f"{name}: no error raised"
    kind, message = outcomes[name]
    assert kind == "InvalidInputError", (kind, message)
    for expected in BAD[name][1]:
        assert expected in message, (expected, message)


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
