"""The CPU emulation harness catches real kernel bugs: copies of attention.cu with one deliberate defect must disagree
with the oracle, while the unmodified source agrees on the same call: in the forward (a missing barrier, an off-by-one
tile bound) on out, and in each backward kernel (an off-by-one query span, a wrong sign or a missing factor in dS, a
missing dlse term in Δ) on dq, dk and dv; in the register-resident float16 forward (a missing cp.async wait, P's
fragment registers out of the mma layout's order, V read without the swizzle, a tile the band cuts run unmasked),
which also shows that the emulated mma.sync, ldmatrix and cp.async keep the PTX layouts and timing the kernel relies
on; and in each register-resident float16 backward kernel (a missing cp.async wait, dS's fragment out of order, a tile
the band cuts run unmasked) on dq, dk and dv; and in the one-pass backward's dK/dV (dq stored instead of added, a
missing barrier before dU K, a dropped contribution) on dq, where the shared-memory dK/dV adds the same sum when
dout's rows are off 16 bytes; and at D = 128, where the register kernels' hoisted ldmatrix offsets step whole swizzle
periods, a copy without that step on out, dq, dk and dv; and at the GPU's tiles (four warps, 64- and 128-row tiles),
copies with a row offset that the emulator's own tiles never reach (a third warp's rows, a second 16-row block) in the
forward, dQ, dK/dV and the one-pass backward. Also the harness's own guard: a barrier in divergent code is reported,
not a hang."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from attnkit.backends.cupy import launch

import attnkit
from attnkit import AttentionInputs, AttentionSpec
from attnkit.contract.kernels import attention_backward, attention_forward
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
    "off-by-one row bound": ("if (first + r < limit && c < width &&", "if (first + r <= limit && c < width &&"),
}


def _call() -> tuple[AttentionSpec, AttentionInputs]:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 32, generator=generator) for _ in range(3))
    k[1, :, 21:] = v[1, :, 21:] = float("nan")  # padding beyond kv_lengths[1]: never to be read
    return AttentionSpec(causal=True, causal_alignment="top_left"), AttentionInputs(
        q, k, v, kv_lengths=torch.tensor([40, 21])
    )


def _copy(tmp_path: Path, defect: tuple[str, str] | None = None) -> Path:
    """attention.cu copied into tmp_path, with the defect's anchor (unique in the source) replaced."""
    text = SOURCE
    if defect is not None:
        old, new = defect
        assert SOURCE.count(old) == 1, f"the defect's anchor is not unique in attention.cu: {old!r}"
        text = SOURCE.replace(old, new)
    copy = tmp_path / "attention.cu"
    copy.write_text(text)
    return copy


def _error(source: Path) -> float:
    spec, inputs = _call()
    out, _ = attention_forward(launch.CudaKernels(EmulatorLauncher(source=source)), spec, inputs)
    expected = attnkit.attend(spec, inputs.q, inputs.k, inputs.v, kv_lengths=inputs.kv_lengths, backend="torch-naive")
    return (out - expected).abs().nan_to_num(float("inf")).max().item()


def test_the_unmodified_kernel_agrees(tmp_path: Path) -> None:
    assert _error(_copy(tmp_path)) < 1e-5


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_a_defective_copy_of_the_kernel_fails(defect: str, tmp_path: Path) -> None:
    assert _error(_copy(tmp_path, DEFECTS[defect])) > 1e-2, f"the emulator did not notice the {defect}"


# Each in one backward kernel; the other kernels run from the unmodified source, so a defect costs one build.
BACKWARD_DEFECTS = {
    # The dK/dV kernel's query span stops one row short on the lower band edge: the row that sees a key tile's last
    # key from the next query tile is skipped (found in a tiled backward kernel by one lucky hypothesis draw).
    "off-by-one query span in dK/dV": (
        "backward_dkdv",
        "if (HAS_LOWER) end = min(end, last_key - g.offset - lower + 1);",
        "if (HAS_LOWER) end = min(end, last_key - g.offset - lower);",
    ),
    # dS = P ⊙ (dP + Δ) in the dQ kernel.
    "wrong sign of Δ in dQ": (
        "backward_dq",
        "ds = expf(sc.s - lse_tile[r]) * (dp - delta_tile[r]);",
        "ds = expf(sc.s - lse_tile[r]) * (dp + delta_tile[r]);",
    ),
    # dK without the softcap's derivative 1 − tanh²(U/c).
    "missing softcap factor in dK/dV": (
        "backward_dkdv",
        "if (HAS_SOFTCAP) ds *= 1.0f - sc.tanh_u * sc.tanh_u;\n                    ds_q = COSINE",
        "ds_q = COSINE",
    ),
    # Δ = rowsum(dO ⊙ O) without − dlse: lse's cotangent is lost.
    "missing dlse term in Δ": (
        "backward_delta",
        "delta[index] = HAS_DLSE ? sum - dlse[index] : sum;",
        "delta[index] = sum;",
    ),
}


class _OneKernelFrom(EmulatorLauncher):
    """Launches ``kernel`` from the library of ``source``, every other kernel from the unmodified source."""

    def __init__(self, kernel: str, source: Path) -> None:
        super().__init__()
        self.kernel = kernel
        self.defective = EmulatorLauncher(source=source)

    def launch(self, kernel: str, *arguments: Any) -> None:
        if kernel == self.kernel:
            self.defective.launch(kernel, *arguments)
        else:
            super().launch(kernel, *arguments)


def _gradient_errors(launcher: EmulatorLauncher) -> dict[str, float]:
    """Max |error| of dq, dk, dv against the float64 oracle on a causal window (1, 0) with a softcap, two key tiles
    long (the lower band edge of each key tile reaches one row into the next query tile), with a cotangent on lse."""
    length = 2 * max(launch.EMULATOR_TILE.block_m, launch.EMULATOR_TILE.block_n)
    generator = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, length, 16, generator=generator) for _ in range(4))
    dlse = torch.randn(1, 2, length, generator=generator)
    spec = AttentionSpec(causal=True, window=(1, 0), softcap=5.0)
    inputs = AttentionInputs(q, k, v)
    kernels = launch.CudaKernels(launcher)
    out, lse = attention_forward(kernels, spec, inputs)
    dq, dk, dv, _ = attention_backward(kernels, spec, inputs, out, lse, dout, dlse, need_dbias=False)
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    out64, lse64 = attnkit.attend(spec, *leaves, return_lse=True, backend="torch-naive")
    expected = torch.autograd.grad((out64, lse64), leaves, (dout.double(), dlse.double()))
    return {
        name: (got.double() - want).abs().nan_to_num(float("inf")).max().item()
        for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected)
    }


def test_the_unmodified_backward_agrees() -> None:
    errors = _gradient_errors(EmulatorLauncher())
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize("defect", list(BACKWARD_DEFECTS))
def test_a_defective_backward_kernel_fails(defect: str, tmp_path: Path) -> None:
    kernel, old, new = BACKWARD_DEFECTS[defect]
    errors = _gradient_errors(_OneKernelFrom(kernel, _copy(tmp_path, (old, new))))
    assert max(errors.values()) > 1e-2, f"the emulator did not notice the {defect}: {errors}"


# The register-resident forward (float16 / bfloat16): each defect must show on a float16 window (20, 40) over five key
# tiles, whose cut tiles are masked and whose inner tiles are not.
REGISTER_FORWARD_DEFECTS = {
    # The key loop reads a stage before its cp.async copies have landed (the emulator lands them at the wait).
    "missing cp.async wait": (
        "cp_async_wait<0>();\n        __syncthreads();  // the tile has landed",
        "__syncthreads();  // the tile has landed",
    ),
    # P's A fragment with registers 1 and 2 swapped: rows g+8 and keys 8..15 trade places.
    "P fragment out of layout": (
        "pack_pair(p[0][2], p[0][3]), pack_pair(p[1][0], p[1][1])",
        "pack_pair(p[1][0], p[1][1]), pack_pair(p[0][2], p[0][3])",
    ),
    # V's rows read at their unswizzled chunks.
    "V read without the swizzle": (
        "v_tile + v_columns.at(2 * kk, jv / 2)",
        "v_tile + (16 * kk + lane % 16) * BLOCK_DV + (jv + lane / 16) * 8",
    ),
    # The first unmasked tile rounded down instead of up: a tile the window's left side cuts runs unmasked.
    "a cut tile run unmasked": ("lower, 0) + BLOCK_N - 1) / BLOCK_N *", "lower, 0)) / BLOCK_N *"),
}


def _register_forward_error(source: Path) -> float:
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 70, 32, generator=generator).half() for _ in range(3))
    spec = AttentionSpec(window=(20, 40))
    out, lse = attention_forward(launch.CudaKernels(EmulatorLauncher(source=source)), spec, AttentionInputs(q, k, v))
    expected, expected_lse = attnkit.attend(
        spec, q.double(), k.double(), v.double(), return_lse=True, backend="torch-naive"
    )
    errors = [(out.double() - expected).abs(), (lse.double() - expected_lse).abs()]
    return max(error.nan_to_num(float("inf")).max().item() for error in errors)


def test_the_unmodified_register_forward_agrees(tmp_path: Path) -> None:
    assert _register_forward_error(_copy(tmp_path)) < 5e-3


@pytest.mark.parametrize("defect", list(REGISTER_FORWARD_DEFECTS))
def test_a_defective_register_forward_fails(defect: str, tmp_path: Path) -> None:
    assert _register_forward_error(_copy(tmp_path, REGISTER_FORWARD_DEFECTS[defect])) > 5e-2, (
        f"the emulator did not notice the {defect}"
    )


# The register-resident backward kernels (float16 / bfloat16), each defect in one kernel, on a float16 window (20, 40)
# with two query heads per kv head (dK/dV's query loop runs on from one head to the next through the cp.async stages).
REGISTER_BACKWARD_DEFECTS = {
    "missing cp.async wait in dQ": (
        "backward_dq",
        "cp_async_wait<0>();\n        __syncthreads();  // the key tile has landed",
        "__syncthreads();  // the key tile has landed",
    ),
    # dS's A fragment with registers 1 and 2 swapped: rows g+8 and keys 8..15 trade places.
    "dS fragment out of layout in dQ": (
        "backward_dq",
        "a[4] = {pack_pair(dp[2 * kk][0], dp[2 * kk][1]), pack_pair(dp[2 * kk][2], dp[2 * kk][3]),\n"
        "                                   pack_pair(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),",
        "a[4] = {pack_pair(dp[2 * kk][0], dp[2 * kk][1]), pack_pair(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),\n"
        "                                   pack_pair(dp[2 * kk][2], dp[2 * kk][3]),",
    ),
    # The first unmasked key tile rounded down instead of up: a tile the window's left side cuts runs unmasked.
    "a cut tile run unmasked in dQ": ("backward_dq", "lower, 0) + BLOCK_N - 1) / BLOCK_N *", "lower, 0)) / BLOCK_N *"),
    "missing cp.async wait in dK/dV": (
        "backward_dkdv",
        "cp_async_wait<0>();\n        __syncthreads();  // the query tile has landed",
        "__syncthreads();  // the query tile has landed",
    ),
    # dSᵀ's A fragment with registers 0 and 1 swapped: keys g and g+8 trade places.
    "dS fragment out of layout in dK/dV": (
        "backward_dkdv",
        "ds_a[4] = {pack_pair(dp[2 * kk][0], dp[2 * kk][1]), pack_pair(dp[2 * kk][2], dp[2 * kk][3]),",
        "ds_a[4] = {pack_pair(dp[2 * kk][2], dp[2 * kk][3]), pack_pair(dp[2 * kk][0], dp[2 * kk][1]),",
    ),
    # The first unmasked query tile rounded down instead of up: a tile the window's right side cuts runs unmasked.
    "a cut tile run unmasked in dK/dV": (
        "backward_dkdv",
        "upper, 0) + BLOCK_M - 1) / BLOCK_M *",
        "upper, 0)) / BLOCK_M *",
    ),
}


def _register_backward_errors(
    launcher: EmulatorLauncher,
    deterministic: bool = True,
    head_dim: int = 32,
    length: int = 70,
    spec: AttentionSpec | None = None,
    kv_heads: int = 2,
) -> dict[str, float]:
    """Max |error| of out, dq, dk, dv against the float64 oracle (float16, by default window (20, 40), two query heads
    per kv head)."""
    generator = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(1, 2 * kv_heads, length, head_dim, generator=generator).half() for _ in range(2))
    k, v = (torch.randn(1, kv_heads, length, head_dim, generator=generator).half() for _ in range(2))
    spec, inputs = spec or AttentionSpec(window=(20, 40)), AttentionInputs(q, k, v)
    kernels = launch.CudaKernels(launcher)
    out, lse = attention_forward(kernels, spec, inputs)
    grads = attention_backward(
        kernels, spec, inputs, out, lse, dout, None, need_dbias=False, deterministic=deterministic
    )
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    out64 = attnkit.attend(spec, *leaves, backend="torch-naive")
    expected = (out64, *torch.autograd.grad(out64, leaves, dout.double()))
    return {
        name: (got.double() - want).abs().nan_to_num(float("inf")).max().item()
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads[:3]), expected)
    }


def test_the_unmodified_register_backward_agrees() -> None:
    errors = _register_backward_errors(EmulatorLauncher())
    assert max(errors.values()) < 5e-3, errors


@pytest.mark.parametrize("defect", list(REGISTER_BACKWARD_DEFECTS))
def test_a_defective_register_backward_fails(defect: str, tmp_path: Path) -> None:
    kernel, old, new = REGISTER_BACKWARD_DEFECTS[defect]
    errors = _register_backward_errors(_OneKernelFrom(kernel, _copy(tmp_path, (old, new))))
    assert max(errors.values()) > 5e-2, f"the emulator did not notice the {defect}: {errors}"


# At D = 128 the register kernels' hoisted ldmatrix addresses (SwizzledRows) reach chunk pairs a whole swizzle period
# (4 pairs) past the lane's own offsets, which no shape at D <= 64 does: the unmodified source agrees there, and a copy
# whose period step is dropped (SwizzledRows::at reading chunk pair c mod 4 for c) fails.
PERIOD_DEFECT = ("+ 16 * (chunk_pair - chunk_pair % PAIRS)", "")


@pytest.mark.parametrize("defective", [False, True], ids=["unmodified", "period step dropped"])
def test_the_register_kernels_at_head_dim_128(defective: bool, tmp_path: Path) -> None:
    source = _copy(tmp_path, PERIOD_DEFECT if defective else None)
    errors = _register_backward_errors(EmulatorLauncher(source=source), head_dim=128, length=40)
    if defective:
        assert min(errors.values()) > 5e-2, f"the emulator did not notice the dropped period step: {errors}"
    else:
        assert max(errors.values()) < 5e-3, errors


# The one-pass backward (not deterministic): the register dK/dV gathers its warps' dUᵀ in shared memory and adds dU K
# into the float32 dq sum, over three key tiles of two warps each and two query heads per kv head. (A plain `+=` in
# place of the atomic is not among them: the emulator's threads switch only at barriers, so a read-modify-write is
# never interrupted there.)
ONE_PASS_DEFECTS = {
    # Each block's part stored over the sum instead of added to it: the other key tiles' parts are lost.
    "dq stored, not added": (
        "atomic_add_pair(dq_rows + 8 * h * dq_m + 8 * half, dq[half][2 * h], dq[half][2 * h + 1]);",
        "dq_rows[8 * h * dq_m + 8 * half] = dq[half][2 * h], "
        "dq_rows[8 * h * dq_m + 8 * half + 1] = dq[half][2 * h + 1];",
    ),
    # dU K read before every warp has stored its rows of dUᵀ.
    "missing barrier before dU K": ("__syncthreads();  // the whole dUᵀ tile is stored", ""),
    # The second 8-column block of each ldmatrix pair never added: a dropped atomic contribution.
    "a dropped dq contribution": (
        "if ((HEAD_DIM % 16 == 0 || 8 * (jd + half) < HEAD_DIM) && (!masked || row + 8 * h < g.q_len))",
        "if ((HEAD_DIM % 16 == 0 || 8 * (jd + half) < HEAD_DIM) && (!masked || row + 8 * h < g.q_len) && half == 0)",
    ),
}


def test_the_unmodified_one_pass_backward_agrees() -> None:
    errors = _register_backward_errors(EmulatorLauncher(), deterministic=False)
    assert max(errors.values()) < 5e-3, errors


@pytest.mark.parametrize("defect", list(ONE_PASS_DEFECTS))
def test_a_defective_one_pass_backward_fails(defect: str, tmp_path: Path) -> None:
    copy = _copy(tmp_path, ONE_PASS_DEFECTS[defect])
    errors = _register_backward_errors(_OneKernelFrom("backward_dkdv", copy), deterministic=False)
    assert errors["dq"] > 5e-2, f"the emulator did not notice the {defect}: {errors}"


# The emulator's own tiles give the register kernels two warps and one 16-row block of the streamed operand per tile
# (launch.EMULATOR_TILE); the GPU's (launch.gpu_tile) give four warps and 64 or 128 rows of it. Run at those, on a
# causal band of 200 rows (full, ragged, interior and cut tiles in every kernel) with two query heads per kv head, the
# unmodified source agrees, and a copy with a row offset that only a third warp or a second 16-row block reaches fails.
GPU_TILE_DEFECTS = {
    # (kernel, defect, deterministic) each: the one-pass defect runs in the one-pass backward, the others in the
    # three-kernel one (one_pass_backward).
    # The forward's warps 2 and 3 store their rows over those of warps 0 and 1.
    "forward rows stored at warp mod 2": (
        "forward",
        (
            "row_start + 16 * warp + lane_row + 8 * h;\n        if (row >= len_q) continue;\n        out_t*",
            "row_start + 16 * (warp % 2) + lane_row + 8 * h;\n        if (row >= len_q) continue;\n        out_t*",
        ),
        True,
    ),
    # dQ's warps 2 and 3 read dO's fragments from the rows of warps 0 and 1.
    "dQ's dO rows at warp mod 2": (
        "backward_dq",
        (
            "do_tile + swizzled<BLOCK_DV>(16 * warp + lane % 16",
            "do_tile + swizzled<BLOCK_DV>(16 * (warp % 2) + lane % 16",
        ),
        True,
    ),
    # dK += dUᵀ Q with Q's transposed fragments of every 16-query block read from the first.
    "dK's Q rows from the first 16": (
        "backward_dkdv",
        ("q_tile + d_columns.at(2 * kk, jd / 2)", "q_tile + d_columns.at(0, jd / 2)"),
        True,
    ),
    # Every warp reads dU for dU K from the first strip of 16 queries instead of its own.
    "one-pass dU rows from the first strip": (
        "backward_dkdv",
        (
            "du_rows(lane % 8 + 8 * (lane / 16), lane / 8 % 2, first_strip)",
            "du_rows(lane % 8 + 8 * (lane / 16), lane / 8 % 2, 0)",
        ),
        False,
    ),
}


class _AtGpuTiles(_OneKernelFrom):
    """_OneKernelFrom at the GPU's tiles (launch.gpu_tile); no kernel from ``source`` by default."""

    def __init__(self, kernel: str = "", source: Path = launch.SOURCE) -> None:
        super().__init__(kernel, source)

    def tile(self, kernel: str, head_dim: int, dtype: str) -> launch.TileConfig:
        return launch.gpu_tile(kernel, head_dim, dtype)


def _gpu_tile_errors(launcher: EmulatorLauncher, deterministic: bool, head_dim: int = 64) -> dict[str, float]:
    spec = AttentionSpec(causal=True)
    return _register_backward_errors(launcher, deterministic, head_dim, length=200, spec=spec, kv_heads=1)


@pytest.mark.parametrize(
    ("head_dim", "deterministic"), [(64, True), (64, False), (128, True)], ids=["64", "64 one pass", "128"]
)
def test_the_register_kernels_agree_at_the_gpu_tiles(head_dim: int, deterministic: bool) -> None:
    errors = _gpu_tile_errors(_AtGpuTiles(), deterministic, head_dim)
    assert max(errors.values()) < 5e-3, errors


@pytest.mark.parametrize("defect", list(GPU_TILE_DEFECTS))
def test_a_defect_past_the_emulator_tiles_fails_at_the_gpu_tiles(defect: str, tmp_path: Path) -> None:
    kernel, (old, new), deterministic = GPU_TILE_DEFECTS[defect]
    errors = _gpu_tile_errors(_AtGpuTiles(kernel, _copy(tmp_path, (old, new))), deterministic)
    assert max(errors.values()) > 5e-2, f"the emulator did not notice the {defect}: {errors}"


class _Recording(EmulatorLauncher):
    """Records each launched kernel's -D options."""

    def __init__(self) -> None:
        super().__init__()
        self.options: dict[str, tuple[str, ...]] = {}

    def launch(self, kernel: str, options: tuple[str, ...], *arguments: Any) -> None:
        self.options[kernel] = options
        super().launch(kernel, options, *arguments)


def test_half_views_off_16_byte_rows_take_the_shared_memory_backward() -> None:
    """cp.async copies 16-byte chunks: float16 operands whose rows start 8 bytes into their allocation compile the
    shared-memory dQ and dK/dV, aligned ones the register-resident bodies, and both agree with the oracle."""
    generator = torch.Generator().manual_seed(4)
    base = torch.randn(4, 1, 2, 21, 44, generator=generator).half()
    spec = AttentionSpec(causal=True)
    for operands in (base[..., 4:36], base[..., :32].contiguous()):  # head dim 32 at an 8-byte offset, or aligned
        q, k, v, dout = operands
        launcher = _Recording()
        kernels = launch.CudaKernels(launcher)
        inputs = AttentionInputs(q, k, v)
        out, lse = attention_forward(kernels, spec, inputs)
        grads = attention_backward(kernels, spec, inputs, out, lse, dout, None, need_dbias=False)[:3]
        aligned = launch.aligned_for_async_copies(q, k, v, dout)
        for kernel in ("backward_dq", "backward_dkdv"):
            switch = f"-DREGISTER_{kernel.removeprefix('backward_').upper()}=1"
            assert (switch in launcher.options[kernel]) == aligned, (kernel, aligned)
        leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
        expected = torch.autograd.grad(attnkit.attend(spec, *leaves, backend="torch-naive"), leaves, dout.double())
        for got, want in zip(grads, expected):
            assert (got.double() - want).abs().max().item() < 5e-3


def test_dout_off_16_byte_rows_takes_the_shared_memory_one_pass_backward() -> None:
    """With q, k and v on 16-byte rows the backward runs in one pass; a dout whose rows start 8 bytes in compiles
    the shared-memory dK/dV, which adds dU K into the float32 dq sum element by element, and agrees with the
    oracle."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 37, 32, generator=generator).half() for _ in range(3))
    dout = torch.randn(1, 2, 37, 36, generator=generator).half()[..., 4:]
    spec, inputs = AttentionSpec(window=(5, 20)), AttentionInputs(q, k, v)
    launcher = _Recording()
    kernels = launch.CudaKernels(launcher)
    out, lse = attention_forward(kernels, spec, inputs)
    grads = attention_backward(kernels, spec, inputs, out, lse, dout, None, need_dbias=False, deterministic=False)
    assert "backward_dq" not in launcher.options
    assert "-DATOMIC_DQ=1" in launcher.options["backward_dkdv"]
    assert "-DREGISTER_DKDV=0" in launcher.options["backward_dkdv"]
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    expected = torch.autograd.grad(attnkit.attend(spec, *leaves, backend="torch-naive"), leaves, dout.double())
    for got, want in zip(grads[:3], expected):
        assert (got.double() - want).abs().max().item() < 5e-3


def test_a_barrier_in_divergent_code_is_reported(tmp_path: Path) -> None:
    anchor = "zero<BLOCK_M * BLOCK_DV>(o_acc);\n    __syncthreads();"
    copy = _copy(tmp_path, (anchor, "zero<BLOCK_M * BLOCK_DV>(o_acc);\n    if (threadIdx.x < 32) __syncthreads();"))
    with pytest.raises(RuntimeError, match="barrier divergence"):
        _error(copy)
