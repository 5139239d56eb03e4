"""A decode call's launches on the GPU kernel backends, counted on CPU (issue 33; scripts/decode_host_overhead.py):
B = 1, Hq = 32, Lq = 1, Lk = 8192, D = 128, bfloat16, contiguous and paged in 16-token blocks, planned for a GPU of
132 SMs with recording launchers. The design: split-K's forward and one combine, nothing else on the device (no
allocation is a kernel; the torch calls around the launches are counted by a function mode). A count that grows fails
here; the host time is the script's to measure, never asserted."""

from __future__ import annotations

import collections
import importlib.util
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "decode_host_overhead.py"

#: The torch ops of the shared merge (contract.kernels.merge_splits) that a launcher without its own combine runs:
#: logsumexp, the weights (eq, where, sub, exp), the weighted sum (mul, sum) and the two copies out.
TORCH_MERGE = {"logsumexp": 1, "eq": 1, "where": 1, "sub": 1, "exp": 1, "mul": 1, "sum": 1, "copy": 2}
EXPECTED = {
    "triton": ({"forward": 1, "merge_splits": 1}, {}),  # the forward over 9 key ranges, then its combine kernel
    "cupy": ({"forward": 1}, TORCH_MERGE),  # attention.cu has no combine kernel yet: docs/gpu.md
}


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("decode_host_overhead", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("backend", sorted(EXPECTED))
def test_a_decode_call_launches_the_forward_and_one_combine(backend: str, paged: bool) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
    script = _script()
    with script.fake_gpu():
        launches, torch_kernels = script.count(backend, paged)
    kernels, around = EXPECTED[backend]
    assert launches == collections.Counter(kernels)
    assert torch_kernels == collections.Counter(around)
