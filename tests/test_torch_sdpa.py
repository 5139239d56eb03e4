"""torch-sdpa's own claims, beyond the conformance suite: which rows the CPU kernel would silently zero, and
that its query blocks cover exactly the band (so hidden key ranges are never read and masks stay small)."""

from __future__ import annotations

import random

import pytest
import torch
from attnkit.backends.reference.torch_naive import oracle_attention, oracle_visibility

import attnkit
from attnkit import AttentionInputs, AttentionSpec
from attnkit.contract.torch import Band
from attnkit.testing import Case, assert_agrees_without_lse, assert_backends_agree

sdpa = pytest.importorskip("attnkit.backends.native.torch_sdpa")
pytestmark = pytest.mark.skipif(bool(attnkit.get_backend("torch-sdpa").available()), reason="torch-sdpa unavailable")


@pytest.mark.parametrize("len_k", [1, 3, 15, 16, 17, 63, 64, 65, 127, 128, 129, 511, 512, 513, 1025])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("poisoned", ["q", "k"])
def test_nan_scores_give_nan_rows_at_every_key_count(len_k: int, causal: bool, poisoned: str) -> None:
    """The CPU kernel takes a short row of NaN scores for a fully masked one (out 0, lse 0); below NAN_SAFE_KEYS
    keys the backend routes through the op whose lse finds such rows, above it the public call propagates NaN."""
    generator = torch.Generator().manual_seed(len_k)
    q, k, v = (torch.randn(1, 2, shape, 16, generator=generator) for shape in (3, len_k, len_k))
    if poisoned == "q":
        q[0, 1, 1] = float("nan")
    else:
        k[0, 0, 0] = float("nan")  # key 0: seen by every row, alone by row 0 of a top-left causal call
    spec = AttentionSpec(causal=causal, causal_alignment="top_left")
    expected, _ = oracle_attention(spec, AttentionInputs(q.double(), k.double(), v.double()), torch.float64)
    for return_lse in (False, True):
        result = attnkit.attend(spec, q, k, v, backend="torch-sdpa", return_lse=return_lse)
        out = result[0] if return_lse else result
        assert torch.equal(out.isnan(), expected.isnan()), f"{return_lse=}"


MASKED_PATHS = {
    "public": AttentionSpec(),
    "causal-top-left": AttentionSpec(causal=True, causal_alignment="top_left"),  # the op from CAUSAL_OP_MIN_KEYS on
    "folded-band": AttentionSpec(causal=True),  # bottom-right with Lq = 3 != Lk
}


@pytest.mark.parametrize("path", MASKED_PATHS)
@pytest.mark.parametrize("len_k", [1, 3, 15, 16, 17, 31, 33, 63, 64, 65, sdpa.CAUSAL_OP_MIN_KEYS])
def test_nan_scores_give_nan_rows_on_the_masked_paths(len_k: int, path: str) -> None:
    """A masked call without lse takes no lse and scans no empty row, at every key count (no NAN_SAFE_KEYS floor):
    the public call with the mask, the op with its causal flag, or the band folded into the mask. A row whose visible
    keys hold a NaN score, the mask hiding the rest of the kernel's first vector, is NaN; a row seeing nothing is 0
    (tests/test_conformance.py draws such rows with grads). An empty row of head 0 has the NaN key hidden: §5 leaves
    that open (SDPA gives NaN), so it is left out."""
    generator = torch.Generator().manual_seed(len_k)
    q, k, v = (torch.randn(1, 2, shape, 16, generator=generator) for shape in (3, len_k, len_k))
    k[0, 0, 0] = float("nan")
    mask = torch.ones(1, 1, 3, len_k, dtype=torch.bool)
    mask[..., 0, 1:17] = False  # row 0 sees key 0 (NaN) and, past the first vector, keys from 17 on
    mask[..., 1, :] = False  # row 1 sees nothing
    spec = MASKED_PATHS[path]
    inputs = AttentionInputs(q.double(), k.double(), v.double(), mask=mask)
    expected, _ = oracle_attention(spec, inputs, torch.float64)
    out = attnkit.attend(spec, q, k, v, mask=mask, backend="torch-sdpa")
    empty = ~oracle_visibility(spec, inputs, 3, len_k).expand(1, 2, 3, len_k).any(dim=-1)
    specified = ~(empty & (torch.arange(2).view(1, 2, 1) == 0))
    assert torch.equal(out.isnan()[specified], expected.isnan()[specified])
    assert torch.equal(out[0, 1][empty[0, 1]], torch.zeros(int(empty[0, 1].sum()), 16))


def brute_force_rows(spec: AttentionSpec, inputs: AttentionInputs, len_q: int, len_k: int) -> list[list[int]]:
    visible = oracle_visibility(spec, inputs, len_q, len_k)  # the oracle's, not the one torch-sdpa reads
    seen = visible.expand(-1, -1, len_q, len_k).any(dim=1).any(dim=0)  # any batch element or head
    return [torch.nonzero(seen[i]).flatten().tolist() for i in range(len_q)]


def test_blocks_partition_the_queries_and_cover_exactly_the_band() -> None:
    """Every visible (query, key) pair lies in its query's block, and without lengths each block's key span is
    exactly the union of what its rows see: nothing outside the band is read, and each mask is (block × span)."""
    rng = random.Random(0)
    for _ in range(300):
        len_q, len_k, batch = rng.randint(1, 700), rng.randint(1, 700), rng.randint(1, 3)
        window = rng.choice([None, (rng.choice([None, 0, 5, 100]), rng.choice([None, 0, 7]))])
        spec = AttentionSpec(
            causal=rng.random() < 0.6, causal_alignment=rng.choice(["top_left", "bottom_right"]), window=window
        )
        q_lengths = torch.tensor([rng.randint(0, len_q) for _ in range(batch)]) if rng.random() < 0.3 else None
        kv_lengths = torch.tensor([rng.randint(0, len_k) for _ in range(batch)]) if rng.random() < 0.3 else None
        q = torch.empty(batch, 1, len_q, 1)
        inputs = AttentionInputs(q, q, q, q_lengths=q_lengths, kv_lengths=kv_lengths)
        rows = brute_force_rows(spec, inputs, len_q, len_k)
        covered: dict[int, tuple[int, int]] = {}
        for block in sdpa._blocks(spec, inputs, Band(spec, inputs, len_q, len_k)):
            if block.masked:  # the only masks built here are (block × span)
                assert block.rows.stop - block.rows.start <= sdpa.BLOCK_Q
            seen = [j for i in range(block.rows.start, block.rows.stop) for j in rows[i]]
            if not seen:  # possible only when planned from the extreme lengths over the batch
                assert q_lengths is not None or kv_lengths is not None, (spec, block)
                continue
            span = (block.cols.start, block.cols.stop)
            if block.causal:  # the op's own top-left causal flag: the kernel skips key blocks past the diagonal
                assert span == (0, len_k) and block.rows == slice(0, len_q)
            elif q_lengths is None and kv_lengths is None:
                assert span == (min(seen), max(seen) + 1), (spec, block)
            else:  # the span is planned from the extreme offsets over the batch: it may be wider, never narrower
                assert span[0] <= min(seen) and max(seen) < span[1] <= len_k, (spec, block)
            for i in range(block.rows.start, block.rows.stop):
                assert i not in covered
                covered[i] = (block.cols.start, block.cols.stop)
        for i, keys in enumerate(rows):
            if keys:
                assert i in covered and covered[i][0] <= min(keys) and max(keys) < covered[i][1], (spec, i)


@pytest.mark.parametrize(
    ("spec", "len_q", "len_k"),
    [
        (AttentionSpec(window=(3, 2)), 2 * sdpa.WINDOW_BLOCK_Q + 5, 2 * sdpa.WINDOW_BLOCK_Q + 5),
        (AttentionSpec(causal=True), sdpa.BLOCK_Q + 5, sdpa.BLOCK_Q + 8),
    ],
    ids=["window", "causal-offset"],
)
def test_broadcast_mask_and_bias_reach_every_query_block(spec: AttentionSpec, len_q: int, len_k: int) -> None:
    """A mask or bias broadcast along the query axis (or the key axis) holds one row (column) for all: each query
    block must take that whole row, not its own slice of it (which is empty past the first block)."""
    for mask_shape, bias_shape in (((1, 2, 1, len_k), (len_q, 1)), ((len_q, 1), (1, 2, 1, len_k))):
        case = Case(spec=spec, len_q=len_q, len_k=len_k, batch=1, mask_shape=mask_shape, bias_shape=bias_shape)
        assert_backends_agree(case, backends=["torch-sdpa"])


@pytest.mark.parametrize("spec", [AttentionSpec(causal=True), AttentionSpec(window=(2, 1))], ids=["causal", "window"])
def test_float64_through_the_flash_op_agrees_with_gradients(spec: AttentionSpec) -> None:
    """float64 is declared, and the conformance suite draws only float32 and the half types: the op's lse comes back
    in float64 here and its backward takes it only so (the backward raised a dtype error before)."""
    case = Case(spec=spec, batch=2, len_q=5, len_k=9, kv_lengths=(9, 3), dtype="float64")
    assert_backends_agree(case, backends=["torch-sdpa"])


def test_the_issues_float64_causal_backward_through_auto() -> None:
    """Issue 16's repro, exactly: a plain causal float64 call with autograd, routed by dispatch (on CPU to torch-sdpa's
    native call, not the lengths path above), and its gradients against the float64 oracle's."""
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    spec = attnkit.AttentionSpec(causal=True)
    attnkit.attend(spec, q, k, v).sum().backward()
    grads = [tensor.grad for tensor in (q, k, v)]
    expected = torch.autograd.grad(attnkit.attend(spec, q, k, v, backend="torch-naive").sum(), (q, k, v))
    for grad, oracle in zip(grads, expected, strict=True):
        assert grad is not None and grad.dtype == torch.float64
        torch.testing.assert_close(grad, oracle)


MASKED_CASES = {
    # the public call with a per-head mask with empty rows, GQA, bfloat16
    "public": Case(
        spec=AttentionSpec(), len_q=9, len_k=20, heads_q=4, heads_kv=2, mask_shape=(2, 4, 9, 20), masked_rows=(0, 5),
        dtype="bfloat16",
    ),
    # the band folded into a key-padding mask: bottom-right with Lq != Lk, bshd
    "folded-offset": Case(spec=AttentionSpec(causal=True, layout="bshd"), len_q=7, len_k=15, mask_shape=(2, 1, 1, 15)),
    # folded below CAUSAL_OP_MIN_KEYS: cosine, 3-D, float16
    "folded-short": Case(
        spec=AttentionSpec(causal=True, variant="cosine"), heads_q=1, heads_kv=1, len_q=12, len_k=12, three_d=True,
        mask_shape=(2, 12, 12), masked_rows=(4,), dtype="float16",
    ),
    # the op with its causal flag: a key-padding mask, GQA, bfloat16; top-left with Lq < Lk and a per-head mask
    "op-key-padding": Case(
        spec=AttentionSpec(causal=True), len_q=520, len_k=520, heads_q=4, heads_kv=2, mask_shape=(2, 1, 1, 520),
        dtype="bfloat16",
    ),
    "op-top-left": Case(
        spec=AttentionSpec(causal=True, causal_alignment="top_left"), len_q=300, len_k=520, mask_shape=(2, 2, 300, 520),
        masked_rows=(3, 299),
    ),
}  # fmt: skip


@pytest.mark.parametrize("path", MASKED_CASES)
def test_masked_calls_without_lse_agree_with_gradients(path: str) -> None:
    """A masked call that wants no lse takes the public call, the folded band or the op with its causal flag (the
    conformance suite always asks for lse, so it never reaches them): out and gradients against the oracle."""
    assert_agrees_without_lse(MASKED_CASES[path], "torch-sdpa")
