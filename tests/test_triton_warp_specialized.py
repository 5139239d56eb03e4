"""The warp-specialised key loop of the forward and dQ (the kernels' WARP_SPECIALIZE, launch.WARP_SPECIALIZED): taken
exactly where every tile is interior, and there the results agree with the oracle. Interpreted, the same kernel code
runs (the query side through the descriptors the kernel makes, no edge loop; the interpreter ignores the loop's
warp_specialize); compiled on Hopper the autotuner times it beside the 8-warp tiles when the backend's
warp_specialize option is on, and the GPU test below turns it on and forces it. That Triton's pass fires (3
warpgroups, setmaxnreg, no copy in the consumers' loop) is tests/test_triton_static.py's. dQ runs as a kernel of its
own in the two-kernel backward: deterministic here."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import attnkit
from attnkit import AttentionSpec
from attnkit.testing import Case, assert_backends_agree
from tests.conftest import available_backends

pytestmark = pytest.mark.skipif("triton" not in available_backends(), reason="triton not available here")

# Whole interpreter tiles (32 query rows, 16 keys): GQA in bfloat16; a head dim the tile pads (the descriptors'
# zero fill past D); bshd views, whose rows are several heads apart.
SERVED = [
    Case(spec=AttentionSpec(), len_q=64, len_k=48, heads_q=4, heads_kv=2, dtype="bfloat16"),
    Case(spec=AttentionSpec(), len_q=32, len_k=80, head_dim=24, head_dim_v=24, dtype="float16"),
    Case(spec=AttentionSpec(layout="bshd"), len_q=32, len_k=32, heads_q=2, heads_kv=2),
]
# Some tile is an edge tile: a band's diagonal, a partial tile, per-batch lengths.
NOT_SERVED = [
    Case(spec=AttentionSpec(causal=True), len_q=64, len_k=48),
    Case(spec=AttentionSpec(), len_q=40, len_k=48),
    Case(spec=AttentionSpec(), len_q=64, len_k=48, kv_lengths=(48, 17)),
]


@pytest.fixture
def launched_tiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[Any]]]:
    """The tiles the forward and dQ launch with, recorded, under the two-kernel (deterministic) backward."""
    import torch
    from attnkit.backends.triton import launch

    from attnkit.contract.kernels import Kernel

    seen: dict[str, list[Any]] = {"forward": [], "dq": []}
    tile_constants = launch.tile_constants

    def recording(kernel: Kernel, config: launch.TileConfig) -> dict[str, Any]:
        if kernel in (Kernel.FORWARD, Kernel.DQ):
            seen["forward" if kernel is Kernel.FORWARD else "dq"].append(config)
        return tile_constants(kernel, config)

    monkeypatch.setattr(launch, "tile_constants", recording)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield seen
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("case", SERVED, ids=range(len(SERVED)))
def test_warp_specialized_kernels_agree_with_the_oracle(case: Case, launched_tiles: dict[str, list[Any]]) -> None:
    assert "triton" in assert_backends_agree(case, backends=["triton"])
    for kernel, tiles in launched_tiles.items():
        assert tiles and all(tile.warp_specialize for tile in tiles), kernel


@pytest.mark.parametrize("case", NOT_SERVED, ids=range(len(NOT_SERVED)))
def test_edge_tiles_keep_the_edge_loops(case: Case, launched_tiles: dict[str, list[Any]]) -> None:
    assert "triton" in assert_backends_agree(case, backends=["triton"])
    for kernel, tiles in launched_tiles.items():
        assert tiles and not any(tile.warp_specialize for tile in tiles), kernel


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a CUDA GPU")
def test_compiled_warp_specialized_kernels_agree_with_the_oracle(
    launched_tiles: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the autotuner picks them only where they are fastest: forced here, at the FlashAttention-2 paper's
    head dim, against the float64 oracle. Offered only on the Triton versions where the candidate was checked to
    compile as intended (launch.WARP_SPECIALIZATION_CHECKED; tests/test_triton_planning.py tests the offer)."""
    import torch
    import triton
    from attnkit.backends.triton import launch

    if launch.INTERPRETED or launch.arch_of(torch.device("cuda")) != "sm_90":
        pytest.skip("the warp-specialised kernels are Hopper's")
    if not launch.warp_specialization_checked(triton.__version__):
        pytest.skip(f"the warp-specialised candidate is not offered on Triton {triton.__version__}")
    monkeypatch.setattr(launch._autotuner, "choose", lambda key, configs, run, restore=(): configs[-1])
    case = Case(spec=AttentionSpec(), len_q=256, len_k=384, heads_q=4, heads_kv=2, head_dim=128, head_dim_v=128,
                dtype="bfloat16")  # fmt: skip
    # Process-wide, not a use_config scope: on CUDA the autograd engine runs the backward (and so dQ's launch) on its
    # device thread, where a scope's ContextVar is not set, and dQ would get the plain launcher.
    attnkit.configure({"backend_options": {"triton": {"warp_specialize": True}}})
    assert "triton" in assert_backends_agree(case, backends=["triton"])
    for kernel, tiles in launched_tiles.items():
        assert tiles and all(tile.warp_specialize for tile in tiles), kernel
