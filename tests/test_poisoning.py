"""Poisoned allocations (attnkit.testing.poison) catch what the CPU's zeroed pages hide: kernel launches with one
deliberate defect that leaves part of a buffer unwritten (a launch grid one tile short, in the forward, Δ, dQ and
dK/dV kernels) disagree with the oracle under poisoning, on the triton (interpreted) and cupy-emulated kernels, while
the unmodified launches agree on the same calls. Also the poisoning itself: what it fills, with what, that it is
undone, and that Pallas' interpreter starts its outputs at NaN without it."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import attnkit
from attnkit import AttentionSpec, registry
from attnkit.contract.kernels import Grid, Kernel, KernelCall, KernelLauncher, KernelSwitches
from attnkit.testing import Case, DisagreementError, assert_backends_agree
from attnkit.testing.poison import POISON_VARIABLE, poisoned_allocations, poisoning

KERNEL_BACKENDS = ("triton", "cupy-emulated")

# Two batch elements, the second padded to half of 64 queries and keys: every kernel here has tiles of at most 32
# rows or keys, so its last query tile and last key tile lie wholly in that padding, whose results are exact: out, dq,
# dk and dv 0, lse −inf. A kernel that skips them is right wherever fresh memory is zero, as on the CPU it mostly is.
PADDED = Case(
    spec=AttentionSpec(causal=True),
    batch=2,
    heads_q=2,
    heads_kv=1,
    len_q=64,
    len_k=64,
    q_lengths=(64, 32),
    kv_lengths=(64, 32),
)
# Δ of a padding row is never read (its dS is 0 whatever Δ is), so its defect is shown on a call without padding.
UNPADDED = Case(spec=AttentionSpec(causal=True), batch=1, heads_q=2, heads_kv=1, len_q=64, len_k=64)

# The kernel launched one tile short along its sequence axis (queries; keys for dK/dV), and the call shown on.
DEFECTS = {
    "forward one query tile short": (Kernel.FORWARD, PADDED),
    "delta one query tile short": (Kernel.DELTA, UNPADDED),
    "dq one query tile short": (Kernel.DQ, PADDED),
    "dkdv one key tile short": (Kernel.DKDV, PADDED),
}


class _OneTileShort(Grid):
    """The launch grid without its last tile along the sequence: those rows (or keys) are never written."""

    def blocks(self, block_m: int, block_n: int) -> tuple[int, int, int]:
        tiles, heads, batch = super().blocks(block_m, block_n)
        return tiles - 1, heads, batch


class _OneKernelShort:
    """A backend's launcher that launches ``kernel`` one tile short and every other kernel as it is."""

    def __init__(self, launcher: KernelLauncher, kernel: Kernel) -> None:
        self.launcher, self.kernel = launcher, kernel
        self.types, self.bias_dtype = launcher.types, launcher.bias_dtype
        self.short_launches = 0

    def run(self, kernel: Kernel, call: KernelCall, grid: Grid, args: list[Any], switches: KernelSwitches) -> None:
        if kernel is self.kernel:
            grid = _OneTileShort(*grid)
            self.short_launches += 1
        self.launcher.run(kernel, call, grid, args, switches)

    def __getattr__(self, name: str) -> Any:  # one_pass_backward and whatever else the backend asks of its launcher
        return getattr(self.launcher, name)


def _with_defect(monkeypatch: pytest.MonkeyPatch, backend: str, kernel: Kernel) -> _OneKernelShort:
    """``backend`` launching ``kernel`` one tile short, its backward in two kernels (the one-pass backward, which the
    interpreter and emulator may pick, has no dQ kernel to break)."""
    attnkit.configure({"backend_options": {backend: {"deterministic": True}}})
    instance = registry.get_backend(backend)
    defective = _OneKernelShort(instance.kernel_launcher(), kernel)
    monkeypatch.setattr(instance, "kernel_launcher", lambda: defective)
    return defective


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", [PADDED, UNPADDED], ids=["padded", "unpadded"])
def test_the_unmodified_kernels_agree_under_poisoning(backend: str, case: Case) -> None:
    attnkit.configure({"backend_options": {backend: {"deterministic": True}}})  # as the defects run, dQ included
    with poisoned_allocations():
        assert_backends_agree(case, [backend])


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("defect", list(DEFECTS))
def test_a_kernel_that_leaves_a_tile_unwritten_fails_under_poisoning(
    backend: str, defect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel, case = DEFECTS[defect]
    defective = _with_defect(monkeypatch, backend, kernel)
    with poisoned_allocations(), pytest.raises(DisagreementError):
        assert_backends_agree(case, [backend])
    assert defective.short_launches > 0, f"{backend} never launched {kernel}: the defect was not exercised"


def test_every_uninitialised_allocation_is_poisoned_and_then_no_longer() -> None:
    originals = torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty
    with poisoned_allocations():
        assert poisoning() and os.environ[POISON_VARIABLE] == "1"
        floats = [
            torch.empty(3, 5),
            torch.empty_like(torch.zeros(4, dtype=torch.bfloat16)),
            torch.empty_strided((2, 3), (1, 4), dtype=torch.float16),
            torch.zeros(2).new_empty((2, 2), dtype=torch.float64),
            torch.empty(3, dtype=torch.complex64),
        ]
        for x in floats:
            assert x.isnan().all(), x
        # The whole allocation, the strided one's gaps included: seen through a contiguous view of its storage.
        strided = torch.empty_strided((2, 3), (1, 4), dtype=torch.float32)
        storage = torch.tensor([], dtype=torch.float32).set_(strided.untyped_storage())
        assert storage.numel() == 10 and storage.isnan().all()  # offsets 0 .. 1·1 + 2·4
        assert torch.empty(4, dtype=torch.int32).eq(-0x5A5A5A5B).all()  # 0xA5A5A5A5
        assert torch.empty(4, dtype=torch.int64).lt(-(2**62)).all()
        assert torch.empty(4, dtype=torch.uint8).eq(0xA5).all()
        assert torch.empty(4, dtype=torch.bool).all()
        with poisoned_allocations():  # nested: still on inside, and after the inner block ends
            assert torch.empty(2).isnan().all()
        assert torch.empty(2).isnan().all()
        assert torch.empty(2, device="meta").device.type == "meta"  # no data to fill, no error
    assert not poisoning() and POISON_VARIABLE not in os.environ
    assert (torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty) == originals
    assert "new_empty" not in torch.Tensor.__dict__


def test_pallas_interpreter_starts_outputs_at_nan() -> None:
    """pallas runs in JAX's interpreter on CPU, which starts each output not aliased to an input at NaN by itself
    (no uninitialized_memory setting exists for it; pltpu.InterpretParams' is for the TPU interpreter): a kernel
    that writes only the first of two blocks leaves NaN in the second, so the suite needs nothing more for pallas."""
    jnp = pytest.importorskip("jax.numpy")
    pl = pytest.importorskip("jax.experimental.pallas")

    def first_block_only(x_ref: Any, o_ref: Any) -> None:
        @pl.when(pl.program_id(0) == 0)
        def _() -> None:
            o_ref[...] = x_ref[...]

    x = jnp.ones((16, 8), jnp.float32)
    out = pl.pallas_call(
        first_block_only,
        out_shape=x,
        grid=(2,),
        in_specs=[pl.BlockSpec((8, 8), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 8), lambda i: (i, 0)),
        interpret=True,
    )(x)
    assert bool(jnp.all(out[:8] == 1.0)) and bool(jnp.all(jnp.isnan(out[8:])))
