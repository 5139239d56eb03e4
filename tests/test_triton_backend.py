"""Extras of the triton backend: several tiles per sequence, tiles the geometry hides are never loaded, strided
inputs are read in place. Agreement on everything else comes from the conformance suite."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from attnkit import AttentionSpec
from attnkit.testing import Case, assert_backends_agree, make_arrays
from attnkit.testing.agreement import rounded
from attnkit.testing.runners import run_torch
from tests.conftest import available_backends

pytestmark = [
    pytest.mark.skipif("triton" not in available_backends(), reason="triton backend not available here"),
    # The interpreter reduces a row max with np.nanmax, which warns on the all-NaN rows these tests make.
    pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning"),
]

# Sequences of several 16-wide interpreter tiles (the conformance shapes stay within two), not multiples of it.
MULTI_TILE_CASES = [
    Case(spec=AttentionSpec(causal=True), len_q=50, len_k=70, heads_q=4, heads_kv=2),
    Case(spec=AttentionSpec(causal=True, causal_alignment="top_left"), len_q=70, len_k=41, kv_lengths=(41, 17)),
    Case(spec=AttentionSpec(window=(9, 3), softcap=8.0), len_q=49, len_k=49, bias_shape=(1, 2, 49, 49), bias_grad=True),
    Case(spec=AttentionSpec(causal=True), len_q=1, len_k=67, heads_q=8, heads_kv=1, dtype="bfloat16"),
    Case(spec=AttentionSpec(variant="cosine"), len_q=35, len_k=36, q_lengths=(35, 3), mask_shape=(2, 1, 35, 36)),
    Case(spec=AttentionSpec(causal=True), len_q=33, len_k=33, head_dim=80, head_dim_v=48, dtype="float16"),
]


@pytest.mark.parametrize("case", MULTI_TILE_CASES, ids=range(len(MULTI_TILE_CASES)))
def test_several_tiles_agree_with_the_oracle(case: Case) -> None:
    assert_backends_agree(case, backends=["triton"])


def _interpreter_tile() -> int:
    from attnkit.backends.triton import launch

    if not launch.INTERPRETED:
        pytest.skip("tile sizes are autotuned on a GPU; this test knows the interpreter's 16x16 tiles")
    assert launch.INTERPRETER_CONFIG.block_m == launch.INTERPRETER_CONFIG.block_n
    return launch.INTERPRETER_CONFIG.block_m


def _poisoned(case: Case, keys: slice = slice(0, 0), rows: slice = slice(0, 0)) -> dict[str, np.ndarray]:
    arrays = rounded(case, make_arrays(case))
    arrays["k"][:, :, keys] = arrays["v"][:, :, keys] = np.nan
    arrays["q"][:, :, rows] = arrays["dout"][:, :, rows] = np.nan
    return arrays


def test_forward_never_loads_key_tiles_outside_the_band() -> None:
    """NaN keys in a tile the causal band hides from a query tile must not reach it. A kernel that loaded the
    tile and only masked it would compute 0·NaN = NaN in P·V (docs/semantics.md §5)."""
    tile = _interpreter_tile()
    case = Case(spec=AttentionSpec(causal=True), len_q=4 * tile, len_k=4 * tile, grad=False)
    results = run_torch(case, _poisoned(case, keys=slice(3 * tile, 4 * tile)), "triton")
    assert np.isfinite(results["out"][:, :, : 3 * tile]).all()
    assert np.isnan(results["out"][:, :, 3 * tile :]).all(axis=-1).all()


def test_window_loads_only_the_band() -> None:
    """A sliding window (left 4, causal): query tiles from the third on never load the first key tile."""
    tile = _interpreter_tile()
    case = Case(spec=AttentionSpec(causal=True, window=(4, 0)), len_q=4 * tile, len_k=4 * tile, grad=False)
    results = run_torch(case, _poisoned(case, keys=slice(0, tile)), "triton")
    assert np.isfinite(results["out"][:, :, 2 * tile :]).all()


def test_backward_never_visits_query_tiles_outside_the_band() -> None:
    """NaN queries and output cotangents in the first row tile: causal, no later key tile sees those rows, so
    their dk and dv stay finite, which they would not if the dK/dV loop visited the row tile and masked it."""
    tile = _interpreter_tile()
    case = Case(spec=AttentionSpec(causal=True), len_q=3 * tile, len_k=3 * tile)
    results = run_torch(case, _poisoned(case, rows=slice(0, tile)), "triton")
    for name in ("dk", "dv"):
        assert np.isfinite(results[name][:, :, tile:]).all(), name
        assert np.isnan(results[name][:, :, :tile]).any(), name
    assert np.isfinite(results["dq"][:, :, tile:]).all()


@pytest.mark.skipif(not importlib.util.find_spec("torch"), reason="torch is not installed")
def test_strided_inputs_are_read_in_place() -> None:
    """bshd views, transposes and head-dim slices keep a unit last stride: the kernels take their strides."""
    import torch
    from attnkit.backends.triton import launch

    wide = torch.randn(2, 9, 3, 40)
    sliced = wide[..., :32]  # (B, L, H, 32) with a row stride of 40
    spec = AttentionSpec(layout="bshd")
    view = launch.bhsd(spec, sliced)
    assert view.data_ptr() == sliced.data_ptr() and view.stride() == (9 * 3 * 40, 40, 3 * 40, 1)
    transposed = torch.randn(2, 3, 32, 9).transpose(-1, -2)  # last stride 9: must be copied
    assert launch.bhsd(AttentionSpec(), transposed).stride(-1) == 1


def test_strided_inputs_give_the_contiguous_result() -> None:
    import torch

    import attnkit

    torch.manual_seed(0)
    spec = AttentionSpec(causal=True, layout="bshd")
    q, k, v = (torch.randn(2, 21, 4, 48)[..., :24] for _ in range(3))
    out = attnkit.attend(spec, q, k[:, :, :2], v[:, :, :2], backend="triton")
    expected = attnkit.attend(
        spec, q.contiguous(), k[:, :, :2].contiguous(), v[:, :, :2].contiguous(), backend="triton"
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
