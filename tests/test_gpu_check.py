"""scripts/gpu_check.py without a GPU: its summary, JSON and Markdown from a small recorded sample shaped as a GPU run
writes them (one backend passing, one failing, one killed at its time limit, a bench with a failing backward), the
pytest and progress parsers, the dry-run plan, and the bench's new flags. No child process runs: well under 5 s."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from attnkit.bench import tflops
from attnkit.bench.calls import attention_flops

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _bench_row(implementation: str, len_q: int, causal: bool, fwd: float, total: float | None) -> dict[str, Any]:
    return {
        "implementation": implementation,
        "framework": "torch",
        "seq_len": len_q,
        "len_k": 8192,
        "head_dim": 128,
        "batch": 2 if len_q > 1 else 1,
        "heads": 16 if len_q > 1 else 32,
        "causal": causal,
        "error": None,
        "fwd_ms": 1.0,
        "fwd_tflops": fwd,
        "fwd+bwd_ms": 3.0 if total else None,
        "fwd+bwd_tflops": total,
    }


def sample() -> dict[str, Any]:
    """What run() records, cut down: versions, three checks, the tests, one bench."""
    triton_rows = [
        _bench_row("triton", 8192, False, 300.0, None) | {"fwd+bwd_error": "KeyError: Kernel.DELTA"},
        _bench_row("sdpa cudnn", 8192, False, 500.0, 400.0),
        _bench_row("sdpa flash", 8192, False, 400.0, 320.0),
        _bench_row("triton", 8192, True, 250.0, 180.0),
        _bench_row("sdpa cudnn", 8192, True, 400.0, 300.0),
        _bench_row("sdpa flash", 8192, True, 350.0, 240.0),
        _bench_row("triton", 1, False, 1.3, None),
        _bench_row("sdpa cudnn", 1, False, 10.0, None),
        _bench_row("sdpa flash", 1, False, 8.0, None),
    ]
    return {
        "schema": 1,
        "date": "2026-11-27 12:00 UTC",
        "commit": "e782468",
        "branch": "main",
        "dirty": False,
        "device": "cuda",
        "budget_s": 360.0,
        "versions": {
            "python": "3.12.3",
            "torch": "2.11.0+cu130",
            "torch_cuda": "13.0",
            "cudnn": 91300,
            "torch_capability": "sm_90",
            "triton": "3.6.0",
            "jax": "0.11.2",
            "jaxlib": "0.11.2",
            "jax-cuda13-plugin": "0.11.2",
            "cupy-cuda13x": "14.2.0",
        },
        "nvidia_smi": {"gpu": "NVIDIA H200", "driver": "580.159.04", "memory": "143771 MiB"},
        "not_checked": {"flash-attn": ["flash_attn is not installed"]},
        "checks": {
            "cupy": {
                "rc": 0,
                "timed_out": False,
                "seconds": 80.0,
                "device": "cuda",
                "cases": 52,
                "failed": 0,
                "pending": 0,
                "worst_ratio": 0.28,
                "failures": [],
            },  # fmt: skip
            "torch-sdpa": {
                "rc": 1,
                "timed_out": False,
                "seconds": 60.0,
                "device": "cuda",
                "cases": 44,
                "failed": 15,
                "pending": 0,
                "worst_ratio": "inf",
                "failures": ["FAIL torch-sdpa drawn 3: bfloat16 grad lse", "    ! dq: ratio 1e37"],
            },
            "jax-xla": {
                "rc": -9,
                "timed_out": True,
                "seconds": 150.0,
                "partial": {"done": 38, "total": 42, "failing": 0},
            },  # fmt: skip
        },
        "test_paths": ["tests/test_cupy_backend.py"],
        "tests": {"rc": 0, "timed_out": False, "passed": 18, "failed": 0, "errors": 0, "skipped": 2},
        "bench": {
            "triton": {
                "rc": 0,
                "timed_out": False,
                "result": {"backend": "triton", "peers": ["sdpa cudnn", "sdpa flash"], "results": triton_rows},
            }
        },
        "bench_not_run": ["pallas"],
        "steps": [{"name": "versions", "rc": 0, "timed_out": False, "seconds": 9.0}],
        "elapsed_s": 341.0,
    }


def test_summary_verdicts_ratios_and_problems(gpu_check: Any) -> None:
    summary = gpu_check.summarise(sample())
    checks = summary["checks"]
    assert checks["cupy"]["verdict"] == "OK"
    assert (checks["cupy"]["passed"], checks["cupy"]["cases"]) == (52, 52)
    assert checks["torch-sdpa"]["verdict"] == "FAIL" and checks["torch-sdpa"]["passed"] == 29
    assert checks["jax-xla"]["verdict"] == "TIMEOUT (38/42 cases, 0 failing)"
    rows = summary["bench"]["triton"]["rows"]
    assert [row["shape"] for row in rows][0] == "B=2 H=16 Lq=8192 Lk=8192 D=128"
    assert rows[0]["fwd vs sdpa cudnn"] == pytest.approx(0.6) and rows[0]["fwd+bwd vs sdpa cudnn"] is None
    assert rows[2]["fwd vs sdpa cudnn"] == pytest.approx(0.13)  # decode: forward only
    assert summary["bench"]["triton"]["ratios"]["fwd vs sdpa cudnn"] == pytest.approx([0.13, 0.625])
    problems = summary["problems"]
    assert not summary["ok"]
    assert "check torch-sdpa: FAIL, 15 of 44 cases failed" in problems
    assert any(p.startswith("check jax-xla: TIMEOUT") for p in problems)
    # pallas and triton are expected on a GPU machine of the image (EXPECTED_CUDA): not checked is a failure
    assert {"check pallas: not run (not selected)", "check triton: not run (not selected)"} <= set(problems)
    assert "bench triton: B=2 H=16 Lq=8192 Lk=8192 D=128 causal=False: KeyError: Kernel.DELTA" in problems
    assert "bench pallas: not run (unavailable)" in problems
    assert not any("cupy" in problem for problem in problems)


def test_outputs_json_and_markdown(gpu_check: Any, tmp_path: Path) -> None:
    record = sample() | {"logs": {"check cupy": "cupy [52/52]  0 failed"}}
    json_path, md_path, summary = gpu_check.write_outputs(record, tmp_path)
    written = json.loads(json_path.read_text())
    assert written["summary"] == json.loads(json.dumps(summary)) and written["versions"]["triton"] == "3.6.0"
    assert "logs" not in written and "cupy [52/52]" in (tmp_path / "gpu_check.log").read_text()
    text = md_path.read_text()
    assert text.startswith("## gpu_check 2026-11-27 12:00 UTC: FAILED")
    assert "| GPU | NVIDIA H200, driver 580.159.04 sm_90 |" in text
    assert "| jax / jaxlib | 0.11.2 / 0.11.2 (plugin 0.11.2) |" in text and "| cupy | 14.2.0 |" in text
    assert "| cupy | cuda | OK | 52/52 | 0.28 | - | - |" in text
    assert "| torch-sdpa | cuda | FAIL | 29/44 | err |" in text
    assert "| triton | cuda | - | - | - | 1.3–300 | 180 | 0.13–0.62x | 0.60x |" in text
    assert "| triton | B=1 H=32 Lq=1 Lk=8192 D=128 | no | 1.3 | - | 0.13x | - | 0.16x | - |" in text
    assert "| flash-attn | - | not run: flash_attn is not installed |" in text
    assert "GPU tests (`tests/test_cupy_backend.py`): 18 passed, 0 failed, 0 errors, 2 skipped" in text
    assert "- check torch-sdpa: FAIL, 15 of 44 cases failed" in text
    # --summarise rewrites the Markdown of a recorded JSON, and its status is the run's
    assert gpu_check.main(["--summarise", str(json_path), "--out", str(tmp_path / "again")]) == 1
    assert (tmp_path / "again" / "gpu_check.md").read_text() == text


def test_passing_run_exits_zero(gpu_check: Any) -> None:
    record = sample()
    record["checks"] = {name: record["checks"]["cupy"] for name in gpu_check.EXPECTED_CUDA}
    record["bench"]["triton"]["result"]["results"][0].pop("fwd+bwd_error")
    record["bench_not_run"] = []
    summary = gpu_check.summarise(record)
    assert summary["ok"] and not summary["problems"]


def test_parsers(gpu_check: Any, tmp_path: Path) -> None:
    log = "triton [10/52]\ntriton [30/52]  (4 failing)\nnoise\n"
    assert gpu_check.partial_check(log) == {"done": 30, "total": 52, "failing": 4}
    assert gpu_check.partial_check("no progress") == {}
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.a" name="ok"/>'
        '<testcase classname="tests.a" name="bad"><failure message="assert 1 == 2"/></testcase>'
        '<testcase classname="tests.a" name="gpu"><skipped message="needs a CUDA GPU"/></testcase>'
        "</testsuite></testsuites>"
    )
    result = gpu_check.junit_results(junit)
    assert (result["passed"], result["failed"], result["skipped"]) == (1, 1, 1)
    assert result["failures"] == [{"test": "tests.a::bad", "message": "assert 1 == 2"}]
    assert "error" in gpu_check.junit_results(tmp_path / "missing.xml")
    assert gpu_check.marked_json('x\nVERSIONS {"a": 1}\n', "VERSIONS") == {"a": 1}
    backends = [
        {"name": "triton", "devices": ["cpu", "cuda"], "unavailable": [], "harness_device": "cuda"},
        {"name": "flash-attn", "devices": ["cuda"], "unavailable": ["not installed"]},
        {"name": "cpu-flash", "devices": ["cpu"], "unavailable": [], "harness_device": "cpu"},
    ]
    assert gpu_check.select_backends(backends, "cuda", None) == (["triton"], {"flash-attn": ["not installed"]})
    assert gpu_check.select_backends(backends, "cpu", None)[0] == ["cpu-flash"]


def test_dry_run_plan(gpu_check: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["env"]["ATTNKIT_ALLOW_UNVERIFIED"] == "1"
    assert plan["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # checks share the GPU
    bench = plan["steps"][-1]["commands"]
    assert len(bench) == 4 and all("--peer sdpa-cudnn,sdpa-flash" in command for command in bench)
    assert "--shape 1x32x1x8192x128" in bench[0] and "--device cuda" in bench[0]
    assert "--examples 12" in plan["steps"][2]["command"]


def test_bench_shapes_peers_and_flops() -> None:
    assert tflops.parse_shape("1x32x1x8192x128") == (1, 32, 1, 8192, 128)
    assert tflops.parse_shape("2x16x8192x128") == (2, 16, 8192, 8192, 128)
    with pytest.raises(ValueError):
        tflops.parse_shape("2x16x0x128")
    assert tflops.paper_shapes((8192,), (128,), 16384, 2048) == [(2, 16, 8192, 8192, 128)]
    assert {"sdpa-cudnn", "sdpa-flash", "jax-xla"} <= set(tflops.PEER_NAMES)
    assert tflops.PEERS["sdpa-cudnn"].label == "sdpa cudnn" and tflops.PEERS["jax-xla"].framework == "jax"
    assert tflops.default_peers("torch", True) == ("sdpa-cudnn", "sdpa-flash", "flash-attn")
    assert attention_flops(1, 32, 1, 128, False, "fwd", len_k=8192) == 4.0 * 32 * 8192 * 128
    assert attention_flops(2, 16, 8192, 128, True, "fwd+bwd") == 3.5 * 4.0 * 2 * 16 * 8192 * 8192 * 128 / 2
    result = {
        "backend": "triton",
        "peers": ["sdpa cudnn"],
        "results": [_bench_row("triton", 8192, True, 200.0, 100.0), _bench_row("sdpa cudnn", 8192, True, 400.0, 400.0)],
    }
    assert tflops.ratios(result, "fwd")[0]["ratio"] == pytest.approx(0.5)
    assert tflops.ratios(result)[0]["ratio"] == pytest.approx(0.25)
