"""Extras of the tiled kernel backends (triton, interpreted; cupy, through the emulation harness): several tiles per
sequence agree with the oracle, strided inputs are read in place, paged caches with block sizes that cut across the
key tile are read where they lie, split-K's partials merge to the oracle's result, the backward runs in one pass
(atomic dq) unless deterministic results are asked for, and dropout's mask holds over several tiles. Agreement on
everything else comes from the conformance suite (paged caches: tests/test_paged.py); band edges on tile boundaries,
and tiles outside the band never loaded, from tests/test_tile_edges.py."""

from __future__ import annotations

from typing import Any

import pytest

import attnkit
from attnkit import AttentionSpec
from attnkit.backend import Feature
from attnkit.testing import Case, assert_backends_agree
from attnkit.testing.runners import harness_capabilities
from tests.conftest import available_backends
from tests.tiles import TILED_BACKENDS

BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(name not in available_backends(), reason=f"{name} not available here"))
    for name in ("triton", "cupy-emulated")
]
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # Triton's interpreter, on NaN rows
DROPOUT_SEED = 0xF00D_CAFE_1234_5678  # the high word's top bit set


def _declares_dropout(backend: str) -> bool:
    return Feature.DROPOUT in harness_capabilities(backend).features


PACKED_ROWS = ((0,) * 20 + (1,) * 17 + (-1,) * 3 + (2,) * 10, (-1,) * 7 + (0,) * 43)

# Sequences of several tiles (the conformance shapes stay within two), not multiples of them.
MULTI_TILE_CASES = [
    Case(spec=AttentionSpec(causal=True), len_q=50, len_k=70, heads_q=4, heads_kv=2),
    Case(spec=AttentionSpec(causal=True, causal_alignment="top_left"), len_q=70, len_k=41, kv_lengths=(41, 17)),
    Case(spec=AttentionSpec(window=(9, 3), softcap=8.0), len_q=49, len_k=49, bias_shape=(1, 2, 49, 49), bias_grad=True),
    Case(spec=AttentionSpec(causal=True), len_q=1, len_k=67, heads_q=8, heads_kv=1, dtype="bfloat16"),
    Case(spec=AttentionSpec(variant="cosine"), len_q=35, len_k=36, q_lengths=(35, 3), mask_shape=(2, 1, 35, 36)),
    Case(spec=AttentionSpec(causal=True), len_q=33, len_k=33, head_dim=80, head_dim_v=48, dtype="float16"),
    # Packed documents and padding over several tiles, with GQA, a softcap and dbias.
    Case(
        spec=AttentionSpec(causal=True, softcap=8.0),
        len_q=50,
        len_k=50,
        heads_q=4,
        heads_kv=2,
        bias_shape=(1, 1, 50, 50),
        bias_grad=True,
        q_segment_ids=PACKED_ROWS,
        kv_segment_ids=PACKED_ROWS,
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", MULTI_TILE_CASES, ids=range(len(MULTI_TILE_CASES)))
def test_several_tiles_agree_with_the_oracle(backend: str, case: Case) -> None:
    assert_backends_agree(case, backends=[backend])


def test_strided_views_are_not_copied() -> None:
    """bshd views and head-dim slices keep a unit last stride, and the kernels take the other strides as they
    are; only a last stride other than 1 is copied."""
    import torch

    from attnkit.contract.kernels import bhsd

    sliced = torch.randn(2, 9, 3, 40)[..., :32]  # (B, L, H, 32) with a row stride of 40
    view = bhsd(AttentionSpec(layout="bshd"), sliced)
    assert view.data_ptr() == sliced.data_ptr() and view.stride() == (9 * 3 * 40, 40, 3 * 40, 1)
    transposed = torch.randn(2, 3, 32, 9).transpose(-1, -2)  # last stride 9: must be copied
    assert bhsd(AttentionSpec(), transposed).stride(-1) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_give_the_contiguous_result(backend: str) -> None:
    import torch

    torch.manual_seed(0)
    spec = AttentionSpec(causal=True, layout="bshd")
    q, k, v = (torch.randn(2, 21, 4, 48)[..., :24] for _ in range(3))
    out = attnkit.attend(spec, q, k[:, :, :2], v[:, :, :2], backend=backend)
    expected = attnkit.attend(spec, q.contiguous(), k[:, :, :2].contiguous(), v[:, :, :2].contiguous(), backend=backend)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_cupy_half_views_off_16_byte_rows_take_the_shared_memory_forward() -> None:
    """cp.async copies 16-byte chunks: a float16 view whose rows start 8 bytes into the allocation (or whose row
    stride is no multiple of 16 bytes) compiles the shared-memory forward instead, and agrees with the oracle as the
    aligned call does."""
    if "cupy-emulated" not in available_backends():
        pytest.skip("cupy-emulated not available here")
    import torch
    from attnkit.backends.cupy import launch

    torch.manual_seed(0)
    base = torch.randn(2, 21, 4, 44).half()
    shifted = base[..., 4:36]  # head dim 32 at an 8-byte offset, rows 88 bytes apart
    assert not launch.aligned_for_async_copies(shifted) and launch.aligned_for_async_copies(shifted.contiguous())
    spec = AttentionSpec(causal=True, layout="bshd")
    for q in (shifted, shifted.contiguous()):
        out = attnkit.attend(spec, q, q, q, backend="cupy-emulated")
        expected = attnkit.attend(spec, q.double(), q.double(), q.double(), backend="torch-naive")
        assert (out.double() - expected).abs().max().item() < 5e-3


def test_triton_pads_both_head_dims_to_one_width() -> None:
    """On an H100 with Triton 3.6, a half-precision forward whose BLOCK_D and BLOCK_DV differed (head dims 40 and
    24: 64 and 32) made an out-of-range shared-memory access inside tl.dot with every tile config; one width for
    both passed the whole conformance run there (docs/triton.md). CPU CI cannot show the crash: this keeps the
    workaround from being undone unseen."""
    import torch
    from attnkit.backends.triton import launch

    from attnkit.contract.kernels import Kernel

    for head_dim, head_dim_v in ((40, 24), (24, 40), (80, 48), (64, 32), (128, 128)):
        constants = launch.kernel_constants(Kernel.FORWARD, head_dim, head_dim_v, torch.float16)
        assert constants["BLOCK_D"] == constants["BLOCK_DV"] >= max(head_dim, head_dim_v), (head_dim, head_dim_v)


# ---------------------------------------------------------------------------------------------- paged and split-K


def _paged_call(block_size: int, kv_lengths: tuple[int, ...], heads_q: int = 4, heads_kv: int = 2, len_q: int = 3):
    """q (B, Lq, Hq, 16) and a float32 cache whose sequences take blocks in reverse order from a shared pool (sequence
    b + 1 reuses sequence b's first block), every slot none of them reads NaN, table entries past a sequence's
    blocks −1."""
    import torch

    generator = torch.Generator().manual_seed(block_size)
    needed = [-(-length // block_size) for length in kv_lengths]
    num_blocks = sum(needed) + 2  # two blocks no sequence reads
    table = torch.full((len(kv_lengths), max(needed) + 1), -1, dtype=torch.int32)
    read = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    start = 0
    for b, (length, count) in enumerate(zip(kv_lengths, needed)):
        blocks = torch.arange(start + count - 1, start - 1, -1, dtype=torch.int32)
        if b and count:
            blocks[0] = table[b - 1, 0] if needed[b - 1] else blocks[0]
        table[b, :count] = blocks
        for j in range(length):
            read[table[b, j // block_size], j % block_size] = True
        start += count

    def cache() -> torch.Tensor:
        values = torch.randn(num_blocks, block_size, heads_kv, 16, generator=generator)
        return values.masked_fill(~read[:, :, None, None], float("nan"))

    q = torch.randn(len(kv_lengths), len_q, heads_q, 16, generator=generator)
    return q, cache(), cache(), table, torch.tensor(kv_lengths)


def _assert_paged_agrees(backend: str, spec: AttentionSpec, call: tuple) -> None:
    from attnkit.testing.agreement import ORACLE, compare_outputs

    def results(name: str, tensors: tuple) -> dict:
        out, lse = attnkit.attend_paged(spec, *tensors, return_lse=True, backend=name)
        return {"out": out.double().numpy(), "lse": lse.double().numpy()}

    q, k_cache, v_cache, table, lengths = call
    exact = results(ORACLE, (q.double(), k_cache.double(), v_cache.double(), table, lengths))
    comparisons = compare_outputs("float32", results(backend, call), exact, results(ORACLE, call))
    assert all(comparison.ok for comparison in comparisons), [str(c) for c in comparisons]


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_blocks_cutting_across_key_tiles(backend: str) -> None:
    """Block sizes that do not divide the forward's key tile, one smaller and one larger than it: a tile gathers keys
    from several blocks, or a block spans tiles, and the last block of each sequence is partial; NaN fills every slot
    no sequence reads, so a key read past its length or from an unreferenced block would show."""
    key_tile = next(tile.keys for tile in TILED_BACKENDS[backend](AttentionSpec()) if tile.kernel == "forward")
    assert key_tile is not None
    spec = AttentionSpec(causal=True, window=(2 * key_tile, 0), softcap=20.0, layout="bshd")
    for block_size in (key_tile - 3, key_tile + 5):
        _assert_paged_agrees(backend, spec, _paged_call(block_size, (3 * key_tile + 1, key_tile - 1, 0, block_size)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_k_merges_to_the_oracle(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Split-K forced to three key ranges per query tile, paged and contiguous, forward and backward: rows whose keys
    fill all three ranges (five key tiles), some (two tiles: the third range is empty) and none (kv_length 0, every
    range empty, out 0 and lse −inf), merged by lse to the float64 oracle's result (triton by its own combine kernel,
    launch.TritonLauncher.merge_splits; cupy by the shared torch merge)."""
    from attnkit.contract import kernels

    key_tile = next(tile.keys for tile in TILED_BACKENDS[backend](AttentionSpec()) if tile.kernel == "forward")
    assert key_tile is not None
    merges = []
    merge = kernels.merge_splits
    monkeypatch.setattr(kernels, "decode_splits", lambda programs, keys, processors: 3)
    monkeypatch.setattr(kernels, "merge_splits", lambda out, lse: merges.append(out.shape[0]) or merge(out, lse))
    if backend == "triton":
        from attnkit.backends.triton import launch

        combine = launch.TritonLauncher.merge_splits

        def recorded(self: Any, call: Any, out: Any, lse: Any, *targets: Any) -> None:
            merges.append(out.shape[0])
            combine(self, call, out, lse, *targets)

        monkeypatch.setattr(launch.TritonLauncher, "merge_splits", recorded)
    kv_lengths = (5 * key_tile - 2, 2 * key_tile - 1, 0)
    spec = AttentionSpec(causal=True, layout="bshd")
    _assert_paged_agrees(backend, spec, _paged_call(7, kv_lengths, len_q=2))
    # With dropout where declared: each range's partial out carries the keep-mask and 1 / (1 − p) into the merge.
    dropout = (0.3, DROPOUT_SEED) if _declares_dropout(backend) else None
    case = Case(spec=spec, batch=3, len_q=2, len_k=5 * key_tile, heads_q=4, heads_kv=2, kv_lengths=kv_lengths,
                dropout=dropout)  # fmt: skip
    assert_backends_agree(case, backends=[backend])
    assert merges and set(merges) == {3}, merges


#: Per backend, a call its one-pass backward serves (triton: head dims up to 128 interpreted; cupy: float16 / bfloat16
#: at head dims up to 64), where dq sums several key tiles and, under GQA, several query heads per kv head.
ONE_PASS_CASES = {
    "triton": MULTI_TILE_CASES[0],
    "cupy-emulated": Case(spec=AttentionSpec(causal=True), len_q=50, len_k=70, heads_q=4, heads_kv=2, dtype="float16"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("asked", ["nothing", "torch", "config"])
def test_backward_scheme_follows_deterministic_settings(
    backend: str, asked: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel backends' backward runs in one pass (the dK/dV kernel adds dq atomically, no dQ kernel) unless
    deterministic results are asked for, by torch.use_deterministic_algorithms(True) or the backend's
    ``deterministic`` option in the config: then as dQ and dK/dV kernels, each gradient element written by one
    program. Both agree with the oracle."""
    import contextlib

    import torch

    from attnkit.contract.kernels import Kernel, KernelBackend

    kernel_backend = attnkit.get_backend(backend)
    assert isinstance(kernel_backend, KernelBackend)
    launched = []
    launcher = type(kernel_backend.kernel_launcher())
    run = launcher.run

    def recording(self, kernel, call, grid, args, switches):  # type: ignore[no-untyped-def]
        launched.append((kernel, switches.atomic_dq))
        return run(self, kernel, call, grid, args, switches)

    monkeypatch.setattr(launcher, "run", recording)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(asked == "torch")
    config = {"backend_options": {backend: {"deterministic": True}}}
    try:
        with attnkit.use_config(config) if asked == "config" else contextlib.nullcontext():
            assert_backends_agree(ONE_PASS_CASES[backend], backends=[backend])
    finally:
        torch.use_deterministic_algorithms(before)
    backward = [(kernel, atomic) for kernel, atomic in launched if kernel in (Kernel.DQ, Kernel.DKDV)]
    expected = [(Kernel.DKDV, True)] if asked == "nothing" else [(Kernel.DQ, False), (Kernel.DKDV, False)]
    assert backward == expected


# ---------------------------------------------------------------------------------------------- ALiBi (§16)

#: A multi-tile ALiBi call: GQA with per (batch, query head) slopes, lengths moving each batch element's bottom-right
#: offset, causal, and a softcap and bias beside the term (float16 for cupy's register kernels, float32 for its
#: shared-memory ones).
ALIBI_CASES = [
    Case(spec=AttentionSpec(causal=True), len_q=50, len_k=70, heads_q=4, heads_kv=2, kv_lengths=(70, 41),
         q_lengths=(50, 23), alibi_shape=(2, 4), dtype="float16"),
    Case(spec=AttentionSpec(window=(9, 3), softcap=8.0, causal_alignment="top_left"), len_q=49, len_k=35,
         bias_shape=(1, 2, 49, 35), bias_grad=True, alibi_shape=(2,)),
]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("deterministic", [False, True], ids=["one-pass", "dq-kernel"])
@pytest.mark.parametrize("case", ALIBI_CASES, ids=range(len(ALIBI_CASES)))
def test_alibi_over_several_tiles_in_both_backward_schemes(backend: str, deterministic: bool, case: Case) -> None:
    """The term is recomputed by every backward kernel: the dK/dV kernel with atomic dq (one pass, where the backend
    runs it: triton; cupy keeps ALiBi off it) and the dQ and dK/dV kernels (deterministic), over several tiles of
    queries and keys."""
    config = {"backend_options": {backend: {"deterministic": deterministic}}}
    with attnkit.use_config(config):
        assert_backends_agree(case, backends=[backend])


# ---------------------------------------------------------------------------------------------- dropout (§18)

#: Several query and key tiles (the conformance shapes stay within one query tile), GQA, causal, ragged lengths.
DROPOUT_CASE = Case(spec=AttentionSpec(causal=True), len_q=40, len_k=37, heads_q=2, heads_kv=1, kv_lengths=(37, 20),
                    q_lengths=(40, 11), dtype="float16", dropout=(0.3, DROPOUT_SEED))  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("deterministic", [False, True], ids=["one-pass", "dq-kernel"])
def test_dropout_over_several_tiles_in_both_backward_schemes(backend: str, deterministic: bool) -> None:
    """The keep-mask regenerated by every backward kernel over several tiles of queries and keys: the dK/dV kernel
    with atomic dq (one pass), and the dQ and dK/dV kernels (deterministic)."""
    if not _declares_dropout(backend):
        pytest.skip(f"{backend} does not declare dropout")
    with attnkit.use_config({"backend_options": {backend: {"deterministic": deterministic}}}):
        assert_backends_agree(DROPOUT_CASE, backends=[backend])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_alibi_measures_logical_positions(backend: str, splits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """§13, §16: in a paged forward the distance |i + kv_len_b − Lq − j| takes the key's logical position j, not its
    slot in a block or the cache: blocks that cut across key tiles in reverse order, per (batch, query head) slopes,
    split-K off and forced to three key ranges. attend_paged takes no slopes yet: the backend's forward_paged gets
    them in PagedInputs, as attend_paged will pass them; the oracle runs on the gathered keys."""
    import torch

    from attnkit.backend import AttentionInputs, PagedInputs
    from attnkit.contract import kernels
    from attnkit.contract.torch import gather_pages
    from attnkit.testing.agreement import ORACLE, compare_outputs

    monkeypatch.setattr(kernels, "decode_splits", lambda programs, keys, processors: splits)
    key_tile = next(tile.keys for tile in TILED_BACKENDS[backend](AttentionSpec()) if tile.kernel == "forward")
    assert key_tile is not None
    spec = AttentionSpec(causal=True, layout="bshd")
    q, k_cache, v_cache, table, lengths = _paged_call(key_tile - 3, (3 * key_tile + 1, key_tile - 1, 0, 5), len_q=4)
    slopes = torch.rand(q.shape[0], q.shape[2], generator=torch.Generator().manual_seed(7))

    def results(out_lse: tuple) -> dict:
        out, lse = out_lse
        return {"out": out.double().numpy(), "lse": lse.double().numpy()}

    def oracle(dtype: torch.dtype) -> dict:
        keys, values = (gather_pages(cache, table).to(dtype) for cache in (k_cache, v_cache))
        gathered = AttentionInputs(q.to(dtype), keys, values, kv_lengths=lengths, alibi_slopes=slopes)
        return results(attnkit.get_backend(ORACLE).forward(spec, gathered, need_lse=True))

    paged = PagedInputs(q, k_cache, v_cache, table, lengths, alibi_slopes=slopes)
    with torch.no_grad():
        got = results(attnkit.get_backend(backend).forward_paged(spec, paged, need_lse=True))
    comparisons = compare_outputs("float32", got, oracle(torch.float64), oracle(torch.float32))
    assert all(comparison.ok for comparison in comparisons), [str(c) for c in comparisons]
