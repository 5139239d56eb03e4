"""The forward's warp-specialised key loop (kernels._fwd_kernel's WARP_SPECIALIZE, launch.WARP_SPECIALIZED_FORWARD):
taken exactly where every tile is interior, and there it agrees with the oracle. Interpreted, the same kernel code
runs (q through the descriptor the kernel makes, no edge loop; the interpreter ignores the loop's warp_specialize);
compiled on Hopper the autotuner times it beside the 8-warp tile, and the GPU test below forces it. That the pass
fires (3 warpgroups, setmaxnreg, no copy in the consumers' loop) is tests/test_triton_static.py's."""

from __future__ import annotations

from typing import Any

import pytest

from attnkit import AttentionSpec
from attnkit.testing import Case, assert_backends_agree
from tests.conftest import available_backends

pytestmark = pytest.mark.skipif("triton" not in available_backends(), reason="triton not available here")

# Whole interpreter tiles (32 query rows, 16 keys): GQA in bfloat16; a head dim the tile pads (the descriptor's
# zero fill past D); bshd views with row strides of several heads; and the backward, unchanged, after it.
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


def _forward_tiles(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The tiles the forward launches with, recorded."""
    from attnkit.backends.triton import launch

    from attnkit.contract.kernels import Kernel

    seen: list[Any] = []
    tile_constants = launch.tile_constants

    def recording(kernel: Kernel, config: launch.TileConfig) -> dict[str, Any]:
        if kernel is Kernel.FORWARD:
            seen.append(config)
        return tile_constants(kernel, config)

    monkeypatch.setattr(launch, "tile_constants", recording)
    return seen


@pytest.mark.parametrize("case", SERVED, ids=range(len(SERVED)))
def test_warp_specialized_forward_agrees_with_the_oracle(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    tiles = _forward_tiles(monkeypatch)
    assert "triton" in assert_backends_agree(case, backends=["triton"])
    assert tiles and all(tile.warp_specialize for tile in tiles)


@pytest.mark.parametrize("case", NOT_SERVED, ids=range(len(NOT_SERVED)))
def test_edge_tiles_keep_the_edge_loops(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    tiles = _forward_tiles(monkeypatch)
    assert "triton" in assert_backends_agree(case, backends=["triton"])
    assert tiles and not any(tile.warp_specialize for tile in tiles)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a CUDA GPU")
def test_compiled_warp_specialized_forward_agrees_with_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the autotuner would pick it only where it is fastest: forced here, at the FlashAttention-2
    paper's head dim, against the float64 oracle."""
    import torch
    from attnkit.backends.triton import launch

    if launch.arch_of(torch.device("cuda")) != "sm_90" or launch.INTERPRETED:
        pytest.skip("the warp-specialised forward is Hopper's")
    monkeypatch.setattr(launch._autotuner, "choose", lambda key, configs, run: configs[-1])
    tiles = _forward_tiles(monkeypatch)
    case = Case(spec=AttentionSpec(), len_q=256, len_k=384, heads_q=4, heads_kv=2, head_dim=128, head_dim_v=128,
                dtype="bfloat16")  # fmt: skip
    assert "triton" in assert_backends_agree(case, backends=["triton"])
    assert tiles and all(tile.warp_specialize for tile in tiles)
