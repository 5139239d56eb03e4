"""The CPU emulation harness catches real kernel bugs: copies of attention.cu with one deliberate defect (a missing
barrier, an off-by-one tile bound) must disagree with the oracle, while the unmodified source agrees on the same
call. Also the harness's own guard: a barrier in divergent code is reported, not a hang."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attnkit.backends.cupy import launch

import attnkit
from attnkit import AttentionInputs, AttentionSpec
from tests.cupy_emulator import EmulatorLauncher, compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler for the emulator")

SOURCE = launch.SOURCE.read_text()
SCORES = "k_tile, BLOCK_D);\n        __syncthreads();\n\n        float tile_max"
DEFECTS = {
    # The barrier between the score product and the softmax, in the forward: warps read scores not yet stored.
    "missing barrier": (SCORES, SCORES.replace("__syncthreads();", "")),
    # The last (partial) key tile of each query tile's span is skipped.
    "off-by-one key tile loop": (
        "= NaN.\n    for (int key_start = first; key_start < end; key_start += BLOCK_N) {",
        "= NaN.\n    for (int key_start = first; key_start + BLOCK_N < end; key_start += BLOCK_N) {",
    ),
    # A tile row bound that reads one row past the length: the padding beyond kv_lengths (NaN here) leaks in.
    "off-by-one row bound": ("if (first + r < limit && c < width)", "if (first + r <= limit && c < width)"),
}


def _call() -> tuple[AttentionSpec, AttentionInputs]:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 32, generator=generator) for _ in range(3))
    k[1, :, 21:] = v[1, :, 21:] = float("nan")  # padding beyond kv_lengths[1]: never to be read
    return AttentionSpec(causal=True, causal_alignment="top_left"), AttentionInputs(
        q, k, v, kv_lengths=torch.tensor([40, 21])
    )


def _error(source: Path) -> float:
    spec, inputs = _call()
    out, _ = launch.attention_forward(EmulatorLauncher(source=source), spec, inputs)
    expected = attnkit.attend(spec, inputs.q, inputs.k, inputs.v, kv_lengths=inputs.kv_lengths, backend="torch-naive")
    return (out - expected).abs().nan_to_num(float("inf")).max().item()


def test_the_unmodified_kernel_agrees(tmp_path: Path) -> None:
    copy = tmp_path / "attention.cu"
    copy.write_text(SOURCE)
    assert _error(copy) < 1e-5


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_a_defective_copy_of_the_kernel_fails(defect: str, tmp_path: Path) -> None:
    old, new = DEFECTS[defect]
    assert SOURCE.count(old) == 1, f"the defect's anchor is not unique in attention.cu: {old!r}"
    copy = tmp_path / "attention.cu"
    copy.write_text(SOURCE.replace(old, new))
    assert _error(copy) > 1e-2, f"the emulator did not notice the {defect}"


def test_a_barrier_in_divergent_code_is_reported(tmp_path: Path) -> None:
    anchor = "zero<BLOCK_M * BLOCK_DV>(o_acc);\n    __syncthreads();"
    assert SOURCE.count(anchor) == 1
    copy = tmp_path / "attention.cu"
    copy.write_text(
        SOURCE.replace(anchor, "zero<BLOCK_M * BLOCK_DV>(o_acc);\n    if (threadIdx.x < 32) __syncthreads();")
    )
    with pytest.raises(RuntimeError, match="barrier divergence"):
        _error(copy)
