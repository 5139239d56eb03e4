"""The static GPU check of the Triton kernels (docs/performance.md, "Triton kernels on sm_80 / sm_90"): compiled
ahead of time for sm_80 and sm_90, no GPU needed, the default tiles at D = 64 and 128 have no register spills and
every float16 / bfloat16 dot-bearing kernel runs its dots on tensor cores (HMMA on sm_80, HGMMA on sm_90).

The compilation runs in a subprocess: conftest sets TRITON_INTERPRET=1, under which the kernels are interpreted
and cannot be compiled. ``--scope required`` compiles only what is asserted here (34 variants, about a minute on
two cores); ``python -m attnkit.backends.triton.inspect`` compiles the full matrix.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cuobjdump() -> Path | None:
    spec = importlib.util.find_spec("triton.backends.nvidia")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "bin" / "cuobjdump"
    return path if path.exists() else None


pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is not None and _cuobjdump() is None,
        reason="this triton wheel bundles no cuobjdump (triton/backends/nvidia/bin/cuobjdump)",
    ),
    # One xdist worker runs them all (--dist loadgroup): the compiling subprocess runs once per run, not per worker.
    pytest.mark.xdist_group("triton_static"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("inspect") / "required.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    command = [sys.executable, "-m", "attnkit.backends.triton.inspect", "--scope", "required", "--json", str(out)]
    done = subprocess.run([*command, "--jobs", "2"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return json.loads(out.read_text())


def _name(record: dict) -> str:
    variant = record["variant"]
    return f"{variant['kernel']} {variant['arch']} {variant['dtype']} D={variant['head_dim']} {variant['features']}"


def test_every_required_variant_compiles(results: list[dict]) -> None:
    from attnkit.backends.triton.inspect import variants

    expected = {(v.kernel, v.arch, v.dtype, v.head_dim, v.features) for v in variants("required")}
    got = {tuple(record["variant"].values()) for record in results}
    assert got == expected
    # The feature switches all at once, on both archs, for every dot kernel.
    assert {(r["variant"]["kernel"], r["variant"]["arch"]) for r in results if r["variant"]["features"] == "all"} == {
        (kernel, arch) for kernel in ("fwd", "dq", "dkdv") for arch in ("sm_80", "sm_90")
    }


def test_default_tiles_do_not_spill(results: list[dict]) -> None:
    """No feature, and the paged split-K decode forward, at D = 64 and 128."""
    from attnkit.backends.triton.inspect import NO_SPILL_FEATURES

    spilling = [
        f"{_name(r)} at {r['config']}: stack {r['stack_bytes']} B, local {r['local_bytes']} B, "
        f"STL {r['spill_store_bytes']} B, LDL {r['spill_load_bytes']} B"
        for r in results
        if r["variant"]["features"] in NO_SPILL_FEATURES and r["variant"]["head_dim"] in (64, 128) and r["spill_bytes"]
    ]
    assert not spilling, "register spills at a default tile (change GPU_CONFIGS in launch.py):\n" + "\n".join(spilling)


def test_dots_run_on_tensor_cores(results: list[dict]) -> None:
    required = {"sm_80": "hmma", "sm_90": "hgmma"}
    missing = [
        f"{_name(r)}: no {required[r['variant']['arch']].upper()} ({r['tensor_core']})"
        for r in results
        if not r[required[r["variant"]["arch"]]]
    ]
    assert not missing, "float16 / bfloat16 dots off the tensor cores:\n" + "\n".join(missing)


def test_interior_loops_are_lean(results: list[dict]) -> None:
    """Each dot kernel's main (interior) loop, from its SASS (attnkit.contract.sass), without features: at D = 128 on
    sm_90 at most INSTRUCTIONS_PER_SCORE threads' instructions per score (the tensor cores leave room for about 16
    in the forward, 24 in dQ, 32 in dK/dV; before the interior tiles went unmasked and exp2 took the scale, 20, 37
    and 44), no product computed twice, and on both archs no select in the loop: no mask on a tile that needs none."""
    from attnkit.backends.triton.inspect import INSTRUCTIONS_PER_SCORE

    plain = [r for r in results if r["features"] == "plain" and r["kernel"] in INSTRUCTIONS_PER_SCORE]
    assert {r["kernel"] for r in plain} == set(INSTRUCTIONS_PER_SCORE)
    broken = [f"{_name(r)}: {r['instructions_per_score']} per score" for r in plain
              if r["arch"] == "sm_90" and r["head_dim"] == 128
              and r["instructions_per_score"] > INSTRUCTIONS_PER_SCORE[r["kernel"]]]  # fmt: skip
    broken += [f"{_name(r)}: {r['selects_per_score']} selects per score" for r in plain if r["selects_per_score"]]
    broken += [f"{_name(r)}: tensor work {r['tensor_work']}" for r in plain if r["tensor_work"] > 1.0]
    assert not broken, "\n".join(broken)


def test_wgmma_tiles_are_wide(results: list[dict]) -> None:
    """On sm_90 every dot kernel's wgmma has N ≥ 64 without features (narrower ones leave the tensor cores waiting on
    shared memory: 64-row tiles on 8 warps split N to 32 across the warpgroups)."""
    plain = [r for r in results if r["arch"] == "sm_90" and r["features"] == "plain" and r["tensor_shapes"]]
    narrow = [f"{_name(r)}: {shape}" for r in plain for shape in r["tensor_shapes"]
              if shape.startswith("HGMMA") and int(shape.split("x")[1]) < 64]  # fmt: skip
    assert not narrow, "wgmma narrower than N = 64:\n" + "\n".join(narrow)


def test_hopper_loops_copy_tiles_by_tma(results: list[dict]) -> None:
    """On sm_90, without features, the forward's and dQ's interior loops take their K/V tiles, and dK/dV's at
    D = 128 its q/dO tiles, by tensor-descriptor copies (UTMALDG): the copy engine computes the addresses that
    cp.async made every thread compute. (dK/dV at D = 64 reads more instructions with them and keeps pointers.)"""
    expected = {("fwd", 64), ("fwd", 128), ("dq", 64), ("dq", 128), ("dkdv", 128)}
    plain = [r for r in results if r["arch"] == "sm_90" and r["features"] == "plain"]
    copying = {(r["kernel"], r["head_dim"]) for r in plain if r["tma_loads_per_iteration"]}
    assert {(r["kernel"], r["head_dim"]) for r in plain} >= expected
    assert copying >= expected, f"sm_90 loops without TMA copies: {sorted(expected - copying)}"


@pytest.mark.parametrize("kernel", ["fwd", "dq"])
def test_key_loop_is_warp_specialized(results: list[dict], kernel: str) -> None:
    """The forward's and dQ's warp-specialised candidate (launch.WARP_SPECIALIZED, every tile interior) compiles on
    sm_90 to what Triton's Hopper pass makes of a loop it takes: a producer warpgroup and two consumer warpgroups
    (3 × 4 warps) trading registers by setmaxnreg, the K/V copies in the producer (no UTMALDG in the consumers'
    loop), spill-free, and a consumer loop leaner than the default tile's. (With 8 warps, an edge loop beside the
    marked one, or the query side by pointer loads or host descriptors, the pass leaves the loop or fails:
    docs/triton.md.)"""
    [specialized] = [r for r in results if (r["kernel"], r["features"]) == (kernel, "warp-specialized")]
    [plain] = [r for r in results if (r["kernel"], r["arch"], r["dtype"], r["head_dim"], r["features"])
               == (kernel, "sm_90", "bf16", 128, "plain")]  # fmt: skip
    assert (specialized["arch"], specialized["head_dim"]) == ("sm_90", 128)
    assert specialized["warps"] == 12 and specialized["setmaxnreg"] > 0 and plain["setmaxnreg"] == 0
    assert specialized["tma_loads_per_iteration"] == 0 and plain["tma_loads_per_iteration"] > 0
    assert specialized["spill_bytes"] == 0 and specialized["selects_per_score"] == 0
    assert specialized["instructions_per_score"] < plain["instructions_per_score"]
