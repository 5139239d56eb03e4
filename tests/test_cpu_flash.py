"""Extras of cpu-flash: shapes that span several of its tiles (64 query rows x 256 keys; a window: 32 query rows x
one key tile as wide as their band), which the conformance suite's small cases never reach, and key tiles outside
the band that it never reads. Agreement on everything else is the conformance suite's."""

from __future__ import annotations

import numpy as np
import pytest

from attnkit import AttentionSpec
from attnkit.testing import Case, assert_backends_agree, make_arrays
from attnkit.testing.agreement import rounded
from attnkit.testing.runners import run_torch
from tests.conftest import available_backends

BACKEND = "cpu-flash"
pytestmark = pytest.mark.skipif(BACKEND not in available_backends(), reason=f"{BACKEND} is not available here")

MULTI_TILE_CASES = [
    # bottom-right causal with Lq < Lk, softcap, GQA: every query block starts mid key tile
    Case(spec=AttentionSpec(causal=True, softcap=30.0), len_q=300, len_k=600, heads_q=4, heads_kv=2),
    # a window narrower than a key tile, a ragged cache: masked tiles on both sides of the band
    Case(spec=AttentionSpec(causal=True, window=(100, 0)), len_q=530, len_k=530, kv_lengths=(530, 290)),
    # two-sided window, top-left, query lengths, bfloat16
    Case(
        spec=AttentionSpec(window=(70, 40), causal_alignment="top_left"),
        len_q=400,
        len_k=333,
        q_lengths=(400, 130),
        dtype="bfloat16",
    ),
    # cosine, top-left with Lq > Lk, float16, Dv != D
    Case(
        spec=AttentionSpec(variant="cosine", causal=True, causal_alignment="top_left"),
        len_q=520,
        len_k=260,
        head_dim=24,
        head_dim_v=40,
        dtype="float16",
    ),
    # a band wider than one tile may be (1024 keys): the 64-row blocks over several masked key tiles
    Case(spec=AttentionSpec(causal=True, window=(1100, 0)), len_q=1300, len_k=1300),
    # a decode step over a long cache
    Case(spec=AttentionSpec(causal=True), len_q=1, len_k=700, heads_q=8, heads_kv=2),
]


@pytest.mark.parametrize("case", MULTI_TILE_CASES, ids=range(len(MULTI_TILE_CASES)))
def test_several_tiles_agree_with_the_oracle(case: Case) -> None:
    assert_backends_agree(case, [BACKEND])


def _with_nan_keys(case: Case, keys: slice) -> dict[str, np.ndarray]:
    arrays = rounded(case, make_arrays(case))
    arrays["k"][:, :, keys] = arrays["v"][:, :, keys] = np.nan
    return arrays


def test_causal_never_reads_key_tiles_after_the_query_block() -> None:
    """NaN keys in the second key tile: queries of the first stay finite (a kernel that read the tile and masked it
    would compute 0 * NaN = NaN in P V), and the queries that see them are NaN (NaN in, NaN out)."""
    case = Case(spec=AttentionSpec(causal=True), len_q=512, len_k=512, grad=False)
    out = run_torch(case, _with_nan_keys(case, slice(256, 512)), BACKEND)["out"]
    assert np.isfinite(out[:, :, :256]).all()
    assert np.isnan(out[:, :, 256:]).all()


def test_window_never_reads_key_tiles_behind_the_band() -> None:
    """A window of 4 keys behind each query: queries from 320 on never read the first key tile, forward and
    backward (their dq stays finite)."""
    case = Case(spec=AttentionSpec(causal=True, window=(4, 0)), len_q=640, len_k=640)
    results = run_torch(case, _with_nan_keys(case, slice(0, 256)), BACKEND)
    assert np.isfinite(results["out"][:, :, 320:]).all()
    assert np.isfinite(results["dq"][:, :, 320:]).all()
