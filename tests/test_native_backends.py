"""Extras of the native backends beyond the conformance suite.

torch-flex: sequences of several 128-key blocks (the conformance shapes fit in one) agree with the oracle; the
forward without lse (the fused kernel in the input's dtype, which the suite never reaches: it always asks for lse)
agrees on ``out``; the BlockMask skips exactly the blocks the contract hides and takes whole only blocks it shows
whole, segment ids' documents included; new values of scale, softcap and lengths reuse the compiled kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit
from attnkit import AttentionSpec
from attnkit.contract.torch import Band
from attnkit.testing import Case, assert_backends_agree, make_arrays
from attnkit.testing.agreement import compare, oracle_results, rounded
from tests.conftest import available_backends

FLEX = "torch-flex"
pytestmark = pytest.mark.skipif(FLEX not in available_backends(), reason=f"{FLEX} not available here")

PACKED_ACROSS_BLOCKS = (0,) * 200 + (-1,) * 30 + (1,) * 29 + (2,)
LEFT_PADDED = (-1,) * 20 + (0,) * 240
# Several 128-key blocks, lengths and windows that cut blocks in the middle, Lq != Lk both ways.
MULTI_BLOCK_CASES = [
    Case(spec=AttentionSpec(causal=True, softcap=20.0), len_q=150, len_k=300, heads_q=4, heads_kv=2),
    # With packed documents across blocks (§4.5; padding between them, and left padding): the compiled mask_mod
    # reads the ids beside the window and the lengths.
    Case(
        spec=AttentionSpec(causal=True, window=(100, 0)),
        len_q=260,
        len_k=260,
        kv_lengths=(260, 131),
        q_segment_ids=(PACKED_ACROSS_BLOCKS, LEFT_PADDED),
        kv_segment_ids=(PACKED_ACROSS_BLOCKS, LEFT_PADDED),
    ),
    Case(
        spec=AttentionSpec(causal=True, causal_alignment="top_left", window=(40, 70)),
        len_q=300,
        len_k=140,
        q_lengths=(290, 7),
        bias_shape=(2, 1, 300, 140),
        bias_grad=True,
        dtype="bfloat16",
    ),
    Case(spec=AttentionSpec(), len_q=140, len_k=257, mask_shape=(2, 2, 140, 257), masked_rows=(0, 139)),
]


@pytest.mark.parametrize("case", MULTI_BLOCK_CASES, ids=range(len(MULTI_BLOCK_CASES)))
def test_flex_several_blocks_agree_with_the_oracle(case: Case) -> None:
    assert_backends_agree(case, backends=[FLEX])


NO_LSE_CASES = [
    Case(spec=AttentionSpec(causal=True, softcap=10.0), len_q=1, len_k=37, heads_q=4, heads_kv=2, dtype="bfloat16"),
    Case(spec=AttentionSpec(causal=True), len_q=12, len_k=5, dtype="float16"),
    Case(spec=AttentionSpec(causal=True, window=(50, 0)), len_q=200, len_k=200, kv_lengths=(200, 0), q_lengths=(9, 0)),
    Case(spec=AttentionSpec(variant="cosine", layout="bshd"), len_q=7, len_k=9, bias_shape=(1, 2, 7, 9)),
    Case(spec=AttentionSpec(), len_q=8, len_k=10, mask_shape=(2, 2, 8, 10), masked_rows=(0, 5), dtype="bfloat16"),
]


@pytest.mark.parametrize("case", NO_LSE_CASES, ids=range(len(NO_LSE_CASES)))
def test_flex_forward_without_lse_agrees_with_the_oracle(case: Case) -> None:
    case = case.with_(grad=False)
    arrays = rounded(case, make_arrays(case))
    exact, baseline = oracle_results(case, arrays)
    dtype = getattr(torch, case.dtype)
    tensors = {
        name: torch.tensor(value, dtype=dtype) if name in ("q", "k", "v", "bias") else torch.tensor(value)
        for name, value in arrays.items()
        if name not in ("dout", "dlse")
    }
    out = attnkit.attend(case.spec, **tensors, backend=FLEX)
    comparisons = compare(case, {"out": out.double().numpy()}, {"out": exact["out"]}, {"out": baseline["out"]})
    assert all(c.ok for c in comparisons), [str(c) for c in comparisons]


# §4.5: a packed row (documents of 300, 1, 199, 400 and 90 tokens, then padding) and a left-padded one.
DOCUMENTS = (
    [d for d, n in enumerate((300, 1, 199, 400, 90)) for _ in range(n)] + [-1] * 10,
    [-1] * 130 + [0] * 870,
)


@pytest.mark.parametrize(
    ("spec", "len_q", "len_k", "lengths", "segment_ids"),
    [
        (AttentionSpec(causal=True), 1000, 1000, None, None),
        (AttentionSpec(causal=True, window=(256, 0)), 900, 1300, ((900, 5), (1300, 700)), None),
        (AttentionSpec(window=(None, 130), causal_alignment="top_left"), 700, 400, ((650, 700), None), None),
        (AttentionSpec(causal=True), 1000, 1000, None, DOCUMENTS),
    ],
)
def test_flex_block_mask_skips_exactly_the_hidden_blocks(
    spec: AttentionSpec, len_q: int, len_k: int, lengths: tuple | None, segment_ids: tuple | None
) -> None:
    """With segment ids, FlexAttention's document masking: a block is read only where a query and a key of it share a
    document, and taken whole only where one document covers it."""
    from attnkit.backends.native.torch_flex import BLOCK_SIZE, _row_blocks
    from attnkit.backends.reference.torch_naive import oracle_visibility

    q_lengths, kv_lengths = lengths or (None, None)
    ids = torch.tensor(segment_ids) if segment_ids else None
    batch = 2
    inputs = attnkit.AttentionInputs(
        torch.zeros(batch, 1, len_q, 1),
        torch.zeros(batch, 1, len_k, 1),
        torch.zeros(batch, 1, len_k, 1),
        q_lengths=torch.tensor(q_lengths) if q_lengths else None,
        kv_lengths=torch.tensor(kv_lengths) if kv_lengths else None,
        q_segment_ids=ids,
        kv_segment_ids=ids,
    )
    segments = None if ids is None else (ids, ids)
    partial, full = _row_blocks(Band(spec, inputs, len_q, len_k).key_ranges(), batch, len_k, segments)
    visible = oracle_visibility(spec, inputs, len_q, len_k)  # the oracle's: written apart from what flex reads
    n_q, n_k = partial.shape[-2:]
    for b in range(batch):
        for bq in range(n_q):
            for bk in range(n_k):
                tile = visible[b, 0, bq * BLOCK_SIZE : (bq + 1) * BLOCK_SIZE, bk * BLOCK_SIZE : (bk + 1) * BLOCK_SIZE]
                assert bool(full[b, 0, bq, bk]) == bool(tile.all()), (b, bq, bk)
                assert bool(partial[b, 0, bq, bk]) == bool(tile.any() and not tile.all()), (b, bq, bk)
    # What the kernel reads grows with the band, not with Lq·Lk, for a sliding window.
    if spec.window == (256, 0):
        per_query_block = (partial | full).sum(dim=-1)
        assert int(per_query_block.max()) <= -(-(256 + BLOCK_SIZE) // BLOCK_SIZE) + 1
    # The packed row reads the blocks its documents cover (22), not the causal triangle's 36.
    if segment_ids is not None:
        assert int((partial | full)[0].sum()) == 22


def test_flex_new_values_and_shapes_in_a_bucket_reuse_the_compiled_kernel() -> None:
    from attnkit.backends.native.torch_flex import COMPILED
    from torch._dynamo.utils import counters

    rng = np.random.default_rng(0)

    def tensors(batch: int, length: int, dim: int) -> list[torch.Tensor]:
        return [torch.tensor(rng.standard_normal((batch, 2, length, dim)), dtype=torch.float32) for _ in range(3)]

    first = AttentionSpec(causal=True, softcap=5.0, scale=0.3, window=(4, 0))
    attnkit.attend(first, *tensors(2, 20, 16), kv_lengths=torch.tensor([20, 3]), backend=FLEX)
    compiled, graphs = len(COMPILED), counters["stats"]["unique_graphs"]
    # New softcap, scale, window side and lengths; Lq = Lk = 29 and D = 12 pad to the same 32 and 16.
    again = AttentionSpec(causal=True, softcap=9.0, scale=0.7, window=(9, 0))
    attnkit.attend(again, *tensors(2, 29, 12), kv_lengths=torch.tensor([11, 17]), backend=FLEX)
    assert (len(COMPILED), counters["stats"]["unique_graphs"]) == (compiled, graphs)


def test_flex_reads_inductors_own_rule_for_its_cpu_template() -> None:
    """torch-flex's availability copies inductor's rule so that a first attend need not import inductor (seconds):
    the copy must say what inductor says."""
    from attnkit.backends.native.torch_flex import cpu_template_supported
    from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

    assert cpu_template_supported() == bool(check_cpu_supported())
