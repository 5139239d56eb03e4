"""Extras of the pallas backend (the conformance suite covers the contract through the registry):
every kernel variant lowers for a CUDA GPU, jit/grad/vmap, the torch bridge, tiles the geometry hides are
skipped (that they are never read is tests/test_kernel_backends.py's), and lengths/blocks that do not divide."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import attnkit
from attnkit import AttentionSpec
from attnkit.testing import Case
from attnkit.testing.agreement import compare, oracle_results, rounded
from attnkit.testing.cases import make_arrays, paged_case
from attnkit.testing.runners import run_jax, run_torch

pytestmark = pytest.mark.skipif(
    bool(attnkit.get_backend("pallas").available()), reason="pallas is not available here (needs jax)"
)


def _plugin_reason() -> str | None:
    """Why the GPU lowering check cannot run here, or None."""
    try:
        plugin = importlib.metadata.version("jax-cuda13-plugin")
    except importlib.metadata.PackageNotFoundError:
        return "jax-cuda13-plugin is not installed (pip install -e '.[pallas-gpu-check]')"
    jaxlib = importlib.metadata.version("jaxlib")
    if plugin != jaxlib:
        return f"jax-cuda13-plugin {plugin} does not match jaxlib {jaxlib}"
    if importlib.util.find_spec("absl") is None:
        return "absl-py is not installed (pip install -e '.[pallas-gpu-check]')"
    return None


@pytest.fixture(scope="module")
def lowered() -> dict[tuple[str, str], dict]:
    """Every variant lowered for CUDA in one subprocess with JAX_PLATFORMS=cpu (no GPU needed)."""
    reason = _plugin_reason()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "attnkit.backends.pallas.lowering"], env=env, capture_output=True, text=True
    )
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stdout + result.stderr
    return {(line["variant"], line["pass"]): line for line in lines}


def _variant_ids() -> list[tuple[str, str]]:
    from attnkit.backends.pallas.lowering import passes, variants

    return [(name, kernel_pass) for name, variant in variants().items() for kernel_pass in passes(variant)]


# One xdist worker takes every variant (--dist loadgroup): the lowering subprocess runs once, not once per worker.
@pytest.mark.xdist_group("pallas_lowering")
@pytest.mark.parametrize(("variant", "kernel_pass"), _variant_ids(), ids=[f"{v}-{p}" for v, p in _variant_ids()])
def test_kernels_lower_for_gpu(lowered: dict, variant: str, kernel_pass: str) -> None:
    """Pallas' Triton lowering accepts every kernel variant: a __gpu$xla.gpu.triton custom call comes out."""
    line = lowered[(variant, kernel_pass)]
    assert line["ok"], line["error"] or f"no Triton custom call among {line['targets']}"


def test_kernels_lower_for_gpu_onto_wide_wgmma_at_head_dim_128() -> None:
    """The D = 128 dK/dV kernel compiled for sm_90 from the TTIR Pallas emits (scripts/pallas_static_view.py): every
    product on wgmma at least 64 wide, no spill in any loop, and a main loop within 20 instructions per score
    (47.25 on 32 × 64 tiles before; docs/performance.md, Pallas kernels on sm_90)."""
    reason = _plugin_reason()
    if reason:
        pytest.skip(reason)
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"} | {"JAX_PLATFORMS": "cpu"}
    command = [sys.executable, os.path.join("scripts", "pallas_static_view.py"), "--dims", "128"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    rows = {row["kernel"]: row for row in (json.loads(line) for line in done.stdout.splitlines() if line[:1] == "{")}
    assert "dkdv" in rows, done.stdout + done.stderr[-4000:]
    dkdv = rows["dkdv"]
    widths = [int(shape.split(".")[1].split("x")[1]) for shape in dkdv["shapes"] if shape.startswith("HGMMA")]
    assert dkdv["hmma"] == 0 and widths and min(widths) >= 64, dkdv
    assert dkdv["loops_spilling"] == 0, dkdv
    assert dkdv["instructions_per_score"] <= 20, dkdv


def test_under_jit_grad_and_vmap() -> None:
    import jax
    import jax.numpy as jnp

    spec = AttentionSpec(causal=True, softcap=20.0)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, 6, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 2, 9, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 2, 9, 16)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, 4, 6, 9)), jnp.float32)
    lengths = jnp.asarray([9, 4], jnp.int32)

    def loss(backend, q, k, v, bias, lengths):
        out, lse = attnkit.attend(spec, q, k, v, bias=bias, kv_lengths=lengths, return_lse=True, backend=backend)
        return (out**2).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    grad = jax.grad(loss, argnums=(1, 2, 3, 4))
    eager = grad("pallas", q, k, v, bias, lengths)
    jitted = jax.jit(grad, static_argnums=0)("pallas", q, k, v, bias, lengths)
    reference = grad("jax-reference", q, k, v, bias, lengths)
    for a, b, c in zip(eager, jitted, reference):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-4, atol=1e-4)

    # vmap over an extra leading axis, forward and gradient
    stacked = jnp.stack([q, q * 0.5])
    batched = jax.vmap(lambda x: attnkit.attend(spec, x, k, v, backend="pallas"))(stacked)
    single = attnkit.attend(spec, q * 0.5, k, v, backend="pallas")
    np.testing.assert_allclose(np.asarray(batched[1]), np.asarray(single), rtol=1e-5, atol=1e-6)
    batched_grad = jax.vmap(lambda x: grad("pallas", x, k, v, bias, lengths)[0])(stacked)
    np.testing.assert_allclose(np.asarray(batched_grad[0]), np.asarray(eager[0]), rtol=1e-5, atol=1e-5)


TORCH_CASES = [
    Case(spec=AttentionSpec(causal=True), heads_q=4, heads_kv=2, len_q=9, len_k=20, kv_lengths=(20, 7)),
    Case(
        spec=AttentionSpec(window=(3, 1), softcap=5.0, layout="bshd", variant="cosine"),
        len_q=20,
        len_k=18,
        mask_shape=(2, 1, 20, 18),
        masked_rows=(3,),
        bias_shape=(1, 2, 20, 18),
        bias_grad=True,
        dtype="bfloat16",
    ),
    Case(
        spec=AttentionSpec(causal=True, causal_alignment="top_left", softcap=5.0),
        heads_q=4,
        heads_kv=2,
        len_q=9,
        len_k=20,
        q_lengths=(9, 4),
        kv_lengths=(20, 7),
        alibi_shape=(2, 4),
        dropout=(0.3, 0xF00D_CAFE_1234_5678),  # the torch seed's bits read unsigned, high word's top bit set
    ),
]


@pytest.mark.parametrize("case", TORCH_CASES, ids=range(len(TORCH_CASES)))
def test_torch_tensors_through_dlpack(case: Case) -> None:
    """torch in, torch out, gradients through the frontend's autograd.Function into the JAX backward."""
    arrays = rounded(case, make_arrays(case))
    comparisons = compare(case, run_torch(case, arrays, "pallas"), *oracle_results(case, arrays))
    failures = [str(c) for c in comparisons if not c.ok]
    assert not failures, "\n".join(failures)


def test_torch_non_contiguous_inputs() -> None:
    import torch

    spec = AttentionSpec(causal=True)
    q = torch.randn(2, 6, 2, 32)[..., ::2].transpose(1, 2)
    k = torch.randn(2, 7, 1, 16).transpose(1, 2)
    v = torch.randn(2, 1, 16, 7).transpose(-1, -2)
    out = attnkit.attend(spec, q, k, v, backend="pallas")
    expected = attnkit.attend(spec, q.contiguous(), k.contiguous(), v.contiguous(), backend="torch-naive")
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_tile_ranges_skip_what_the_geometry_hides() -> None:
    """Loop bounds, not masking: causal visits about half the tiles, a window a band, lengths stop early."""
    import jax.numpy as jnp
    from attnkit.backends.pallas import kernels

    length, block = 4096, 128

    def tiles(lo: int, hi: int, q_len: int = length, kv_len: int = length) -> tuple[int, int]:
        geom = (jnp.int32(q_len), jnp.int32(kv_len), jnp.int32(lo), jnp.int32(hi))
        forward = backward = 0
        for start in range(0, length, block):
            first, end = kernels._kv_range(geom, jnp.int32(start), block, block)
            forward += max(0, int(end) - int(first))
            first, end = kernels._q_range(geom, jnp.int32(start), block, block)
            backward += max(0, int(end) - int(first))
        return forward, backward

    full = (length // block) ** 2
    assert tiles(-kernels.FAR, kernels.FAR) == (full, full)
    causal = (length // block) * (length // block + 1) // 2
    assert tiles(-kernels.FAR, 0) == (causal, causal)
    band, _ = tiles(-256, 0)  # sliding window of 256 keys: at most 3 tiles per row of tiles
    assert band <= 3 * (length // block)
    short, _ = tiles(-kernels.FAR, kernels.FAR, kv_len=1000)  # keys past kv_len are never loaded
    assert short == (length // block) * 8


def test_tiles_whose_segment_ids_cannot_meet_are_never_loaded() -> None:
    """Two documents on tile boundaries, no band: every kernel would load the other document's tiles but for the
    segment-id ranges. The second document's q, k, v are NaN, so a tile of it loaded by the first document (0·NaN in
    P·V, dP or dS) leaves NaN in the first document's out, lse, dq, dk or dv; they must equal the oracle's."""
    from attnkit.backends.pallas.backend import INTERPRET_BLOCKS

    half = max(max(pair) for pair in INTERPRET_BLOCKS)  # a multiple of every tile of every kernel
    ids = ((0,) * half + (1,) * half,)
    length = 2 * half
    case = Case(spec=AttentionSpec(), batch=1, heads_q=1, heads_kv=1, len_q=length, len_k=length, head_dim=16)
    case = case.with_(q_segment_ids=ids, kv_segment_ids=ids)  # bhsd: the sequence is axis 2 of every result
    arrays = rounded(case, make_arrays(case))
    exact, baseline = oracle_results(case, arrays)
    poisoned = {name: value.copy() for name, value in arrays.items()}
    for name in ("q", "k", "v"):
        poisoned[name][:, :, half:] = np.nan
    results = run_jax(case, poisoned, "pallas")
    first_document = [{name: value[:, :, :half] for name, value in r.items()} for r in (results, exact, baseline)]
    comparisons = compare(case, *first_document)
    failures = [str(c) for c in comparisons if not c.ok]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "case",
    [
        Case(spec=AttentionSpec(causal=True), len_q=37, len_k=29, heads_q=4, heads_kv=2, head_dim=40, head_dim_v=24),
        Case(
            spec=AttentionSpec(window=(5, 3), softcap=10.0),
            len_q=33,
            len_k=50,
            bias_shape=(2, 1, 33, 1),
            bias_grad=True,
        ),
        Case(spec=AttentionSpec(causal=True, causal_alignment="top_left"), len_q=21, len_k=40, kv_lengths=(40, 13)),
    ],
    ids=range(3),
)
def test_lengths_that_are_not_block_multiples(case: Case) -> None:
    """Several tiles per row, tiles straddling lengths and the diagonal, broadcast bias along keys."""
    _assert_agrees_with_oracle(case)


def _assert_agrees_with_oracle(case: Case) -> None:
    arrays = rounded(case, make_arrays(case))
    comparisons = compare(case, run_jax(case, arrays, "pallas"), *oracle_results(case, arrays))
    failures = [str(c) for c in comparisons if not c.ok]
    assert not failures, "\n".join(failures)


def test_info_says_cpu_runs_interpreted() -> None:
    from attnkit import cli

    lines = []

    class Out:
        def write(self, text: str) -> None:
            lines.append(text)

    cli.run_info(type("Args", (), {"markdown": False, "wide": True})(), Out())  # type: ignore[arg-type]
    assert "interpret=True" in "".join(lines)


@pytest.mark.parametrize(
    ("lo", "hi", "q_len", "kv_len"),
    [
        (-(1 << 30), 1 << 30, 96, 96),
        (-(1 << 30), 0, 96, 80),
        (-40, 7, 90, 96),
        (5, 50, 96, 71),
        (-(1 << 30), 16, 64, 96),
    ],
)
def test_interior_runs_are_exactly_the_tiles_with_every_pair_visible(lo: int, hi: int, q_len: int, kv_len: int) -> None:
    """The unmasked loop runs over exactly the tiles whose every pair is visible (brute force over the pairs): one
    tile too many would let a hidden pair in, one too few only costs a mask. Not square tiles, both directions."""
    import jax.numpy as jnp
    from attnkit.backends.pallas import kernels

    block_q, block_k, length = 16, 32, 96
    geom = tuple(jnp.int32(x) for x in (q_len, kv_len, lo, hi))
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = (i < q_len) & (j < kv_len) & (j - i >= lo) & (j - i <= hi)

    def whole(i0: int, j0: int) -> bool:
        return bool(visible[i0 : i0 + block_q, j0 : j0 + block_k].all())

    for i0 in range(0, length, block_q):
        first, end = kernels._kv_range(geom, jnp.int32(i0), block_q, block_k)
        low, high = (int(x) for x in kernels._interior_keys(geom, jnp.int32(i0), first, end, block_q, block_k))
        assert int(first) <= low <= high <= int(end)
        assert set(range(low, high)) == {t for t in range(length // block_k) if whole(i0, t * block_k)}, i0
    for j0 in range(0, length, block_k):
        first, end = kernels._q_range(geom, jnp.int32(j0), block_q, block_k)
        low, high = (int(x) for x in kernels._interior_queries(geom, jnp.int32(j0), first, end, block_q, block_k))
        assert int(first) <= low <= high <= int(end)
        assert set(range(low, high)) == {t for t in range(length // block_q) if whole(t * block_q, j0)}, j0


@pytest.mark.parametrize(
    "case",
    [
        Case(
            spec=AttentionSpec(), len_q=64, len_k=64, heads_q=4, heads_kv=2, bias_shape=(1, 4, 64, 64), bias_grad=True
        ),
        Case(spec=AttentionSpec(causal=True, window=(40, 0), softcap=8.0, layout="bshd"), len_q=64, len_k=96),
        Case(spec=AttentionSpec(causal=True), len_q=64, len_k=96, heads_q=4, heads_kv=2, alibi_shape=(2, 4)),
    ],
    ids=["bias dbias GQA", "causal window softcap", "causal alibi GQA"],
)
def test_interior_tiles_match_the_oracle(case: Case) -> None:
    """Lengths on tile multiples, so that the kernels' interior runs (no masks, no selects) are not empty: the scale
    folded into exp2 (or not, with bias, softcap or ALiBi), dbias written from interior tiles, both loop directions,
    ALiBi's term in interior tiles of every kernel."""
    _assert_agrees_with_oracle(case)


def test_bias_that_hides_a_whole_row_of_interior_tiles() -> None:
    """A −inf bias row empties a row of tiles the geometry calls interior: out 0 and lse −inf there (§5), no NaN."""
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 1, 64, 16)), jnp.float32) for _ in range(3))
    bias = np.asarray(rng.standard_normal((1, 1, 64, 64)), np.float32)
    bias[0, 0, 5] = -np.inf
    out, lse = attnkit.attend(AttentionSpec(), q, k, v, bias=jnp.asarray(bias), return_lse=True, backend="pallas")
    expected, expected_lse = attnkit.attend(
        AttentionSpec(), q, k, v, bias=jnp.asarray(bias), return_lse=True, backend="jax-reference"
    )
    assert np.all(np.asarray(out)[0, 0, 5] == 0) and np.asarray(lse)[0, 0, 5] == -np.inf
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(np.asarray(expected_lse)))


def test_split_k_ranges_cut_the_interior_run() -> None:
    """Split-K over a query tile with interior key tiles: each key range runs its share of the run unmasked and its
    edge tiles masked; merged by lse they must give the unsplit answer (causal, Lq = one query tile, 6 key tiles)."""
    import jax.numpy as jnp
    from attnkit.backends.pallas.backend import PallasBackend

    from attnkit.backend import AttentionInputs

    spec = AttentionSpec(causal=True)
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2, length, 16)), jnp.float32) for length in (32, 96, 96))
    out, lse = PallasBackend(interpret=True, decode_splits=3).forward(spec, AttentionInputs(q, k, v), need_lse=True)
    expected, expected_lse = attnkit.attend(spec, q, k, v, return_lse=True, backend="jax-reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(expected_lse), rtol=1e-5, atol=1e-6)


COSINE_HALF_CASES = [
    # Drawn by hypothesis: q̂·k̂ of unit vectors rounded to float16 missed the single visible key's lse by 2.3 allowed.
    Case(spec=AttentionSpec(variant="cosine"), dtype="float16", heads_q=1, heads_kv=1, len_q=1, len_k=22,
         kv_lengths=(0, 1), seed=1),
    Case(spec=AttentionSpec(variant="cosine"), dtype="bfloat16", head_dim=32, head_dim_v=32, len_q=1, len_k=22,
         kv_lengths=(0, 1), seed=9),
    paged_case(AttentionSpec(variant="cosine"), 16, ((1,), (0,)), (0, 1), 2, heads_q=1, heads_kv=1, len_q=1,
               dtype="bfloat16", seed=10),
]  # fmt: skip


@pytest.mark.parametrize("case", COSINE_HALF_CASES, ids=["float16", "bfloat16 GQA", "paged bfloat16"])
def test_cosine_in_half_precision_never_rounds_the_unit_vectors(case: Case) -> None:
    """§10: rounding q̂ and k̂ back to half before q̂·k̂ costs up to scale (16) x a half ulp in every score, past
    the tolerance; the kernels take the raw q, k and scale q·kᵀ by float32 inverse norms (gradients chained through
    them exactly). One visible key makes lse = U, the score itself."""
    _assert_agrees_with_oracle(case)


def test_operands_reach_the_kernels_unpadded() -> None:
    """No copy pads q, k, v, dO, bias or the outputs to the tiles or to a power-of-two head dim, and none slices
    results back: every kernel takes and returns arrays at their own shapes (ragged last tiles and head dims of 40
    and 24 are bounded inside the kernels). The traced forward and backward, outside the kernels, hold no pad.
    ALiBi's slopes reach the kernels as (1, Hq), never expanded to the batch or to (Lq, Lk)."""
    import jax
    import jax.extend
    import jax.numpy as jnp

    spec = AttentionSpec(causal=True, softcap=20.0)
    q, k, v = (jnp.zeros(shape, jnp.bfloat16) for shape in ((2, 4, 37, 40), (2, 2, 29, 40), (2, 2, 29, 24)))
    bias = jnp.zeros((1, 4, 37, 29), jnp.float32)
    slopes = jnp.full((4,), 0.25, jnp.float32)

    def loss(q, k, v, bias):
        out, lse = attnkit.attend(spec, q, k, v, bias=bias, alibi_slopes=slopes, return_lse=True, backend="pallas")
        return out.astype(jnp.float32).sum() + lse.sum()

    primitives, kernel_shapes = set(), set()

    def walk(jaxpr: jax.extend.core.Jaxpr) -> None:
        for equation in jaxpr.eqns:
            if equation.primitive.name == "pallas_call":
                kernel_shapes.update(tuple(x.aval.shape) for x in (*equation.invars, *equation.outvars))
                continue
            primitives.add(equation.primitive.name)
            for param in equation.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                        walk(getattr(sub, "jaxpr", sub))

    walk(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias).jaxpr)
    assert "pad" not in primitives
    out, lse, dbias, geometry, params, slopes_shape = (2, 4, 37, 24), (2, 4, 37), (2, 4, 37, 29), (2, 5), (4,), (1, 4)
    own_shapes = {q.shape, k.shape, v.shape, bias.shape, out, lse, dbias, geometry, params, slopes_shape}
    assert kernel_shapes <= own_shapes, kernel_shapes - own_shapes


# ------------------------------------------------------------------------------------------------ mask programs


def _document_causal(documents: Any) -> Any:
    def document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)

    return document_causal


def _chunked_prefix(prefix: Any, alive: Any) -> Any:
    """Chunks of 24 (off every tile edge), or a per-batch prefix widened by the query head (h under GQA), on rows
    ``alive`` keeps (a row it drops sees nothing)."""

    def chunked_prefix(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return ((q_idx // 24 == kv_idx // 24) | (kv_idx < prefix[b] + h)) & alive[b, q_idx]

    return chunked_prefix


def _document_ids(lengths: tuple[int, ...]) -> list[int]:
    return [document for document, length in enumerate(lengths) for _ in range(length)]


def _program_cases() -> dict[str, tuple[Case, Any]]:
    """(case, its mask_mod) by name. Document-causal: documents ending on a tile edge of every kernel (32, 64) and
    off one (40), the causal band the program's own. Chunked/prefix: prefixes 32 (on an edge) and 21 (off one),
    composed with causal bottom-right, kv_lengths and GQA, and a row that sees nothing."""
    import torch

    documents = torch.tensor([_document_ids((40, 56)), _document_ids((32, 32, 32))])
    alive = torch.ones(2, 50, dtype=torch.bool)
    alive[0, 7] = False
    chunked = _chunked_prefix(torch.tensor([32, 21]), alive)
    return {
        "document causal": (
            Case(spec=AttentionSpec(), heads_q=4, heads_kv=2, len_q=96, len_k=96, seed=3),
            _document_causal(documents),
        ),
        "chunked prefix": (
            Case(spec=AttentionSpec(causal=True), heads_q=4, heads_kv=2, len_q=50, len_k=80, kv_lengths=(80, 61)),
            chunked,
        ),
    }


def _bound(case: Case, arrays: dict[str, np.ndarray], mask_mod: Any) -> tuple[Any, np.ndarray]:
    """The torch-bound program of the call and its visibility (B, Hq, Lq, Lk) as the oracle's mask."""
    import torch

    from attnkit.contract.programs import dense
    from attnkit.frontends import ops_for
    from attnkit.programs import bind

    q = torch.tensor(arrays["q"])
    shape = (case.batch, case.heads_q, case.len_q, case.len_k)
    bound = bind(mask_mod, ops_for(q, "q"), q, *shape)
    return bound, np.broadcast_to(dense(bound, *shape, like=q).numpy(), shape)


def _run_program(
    backend: Any, case: Case, arrays: dict[str, np.ndarray], bound: Any, framework: str = "jax"
) -> dict[str, np.ndarray]:
    """out, lse, dq, dk, dv of ``backend`` called directly with the program (float32), in ``framework``."""
    from attnkit.backend import AttentionInputs

    if framework == "torch":
        import torch

        def convert(value: np.ndarray, floating: bool) -> Any:
            return torch.tensor(value, dtype=torch.float32 if floating else None)

        program = bound
    else:  # committed to the device, as arrays from DLPack are: the torch bridge then reuses the compiled kernels
        import jax
        import jax.numpy as jnp

        from attnkit.contract.programs import BoundProgram

        def convert(value: np.ndarray, floating: bool) -> Any:
            return jax.device_put(jnp.asarray(value, jnp.float32 if floating else None), jax.devices()[0])

        program = BoundProgram(bound.program, tuple(convert(t.numpy(), False) for t in bound.captured))
    q, k, v, dout, dlse = (convert(arrays[name], True) for name in ("q", "k", "v", "dout", "dlse"))
    lengths = {name: convert(arrays[name], False) for name in ("q_lengths", "kv_lengths") if name in arrays}
    inputs = AttentionInputs(q, k, v, **lengths, mask_program=program)
    out, lse = backend.forward(case.spec, inputs, True)
    grads = backend.backward(case.spec, inputs, out, lse, dout, dlse, need_dbias=False)
    results = {"out": out, "lse": lse, "dq": grads.dq, "dk": grads.dk, "dv": grads.dv}
    return {name: np.asarray(value, dtype=np.float64) for name, value in results.items()}


def _program_comparisons(
    backend: Any, name: str, framework: str = "jax", poisoned: tuple[int, int] | None = None
) -> list[str]:
    """Failures of ``backend`` on the named program case against the oracle given the program's dense mask.
    ``poisoned`` = (batch element, first position): q, k, v NaN from there on in that element; out, lse, dq, dk
    and dv of those positions are not compared (they are NaN by right), the rest must be as without NaN."""
    case, mask_mod = _program_cases()[name]
    arrays = rounded(case, make_arrays(case))
    bound, visible = _bound(case, arrays, mask_mod)
    exact, baseline = oracle_results(case.with_(mask_shape=visible.shape), {**arrays, "mask": visible})
    given = {name: value.copy() for name, value in arrays.items()}
    if poisoned is not None:
        element, start = poisoned
        for name in ("q", "k", "v"):
            given[name][element, :, start:] = np.nan
    results = _run_program(backend, case, given, bound, framework)
    if poisoned is not None:  # bhsd: the sequence is axis 2 of every result
        for outputs in (results, exact, baseline):
            for value in outputs.values():
                value[element, :, start:] = 0.0
    return [str(c) for c in compare(case, results, exact, baseline) if not c.ok]


def test_document_causal_program_in_the_kernels() -> None:
    """out, lse, dq, dk, dv against the float64 oracle, the program evaluated in the tiles of every kernel. The
    third document of element 1 is NaN: its tiles with the other documents are EMPTY, so a kernel that loaded one
    (0·NaN in P·V, dP or dS) would leave NaN in theirs. Then torch tensors, with torch-captured tensors, through
    the bridge (the same compiled kernels)."""
    from attnkit.backends.pallas.backend import PallasBackend

    backend = PallasBackend(interpret=True)
    failures = _program_comparisons(backend, "document causal", poisoned=(1, 64))
    failures += ["torch: " + failure for failure in _program_comparisons(backend, "document causal", "torch")]
    assert not failures, "\n".join(failures)


def test_chunked_prefix_program_in_the_kernels() -> None:
    """As above: chunks and a head-dependent prefix with causal bottom-right, kv_lengths, GQA and an empty row."""
    from attnkit.backends.pallas.backend import PallasBackend

    failures = _program_comparisons(PallasBackend(interpret=True), "chunked prefix")
    assert not failures, "\n".join(failures)


def _classes_in_jnp(program: Any, shape: tuple[int, ...], captured: tuple[Any, ...]) -> Any:
    import jax.numpy as jnp

    from attnkit.contract.programs import BoundProgram, tile_classes

    return tile_classes(BoundProgram(program, captured), *shape, like=jnp.zeros(1))


def test_program_cases_meet_every_tile_class() -> None:
    """The cases above cross EMPTY tiles (skipped), FULL tiles (not evaluated) and PARTIAL ones in every kernel's
    blocks, and the chunked case (the last) has a row that sees nothing. The classes the backend computes under jit
    in jnp (int32) are those torch computes (unrefined) from the same program."""
    import jax
    import jax.numpy as jnp
    import torch
    from attnkit.backends.pallas.backend import INTERPRET_BLOCKS

    from attnkit.contract.programs import EMPTY, FULL, PARTIAL, tile_classes

    met: dict[tuple[int, int], set[int]] = {blocks: set() for blocks in INTERPRET_BLOCKS}
    for case, mask_mod in _program_cases().values():
        arrays = make_arrays(case)
        bound, visible = _bound(case, arrays, mask_mod)
        captured = tuple(jnp.asarray(t.numpy(), jnp.int32) for t in bound.captured)
        for block_q, block_k in INTERPRET_BLOCKS:
            shape = (case.batch, case.heads_q, case.len_q, case.len_k, block_q, block_k)
            classes = tile_classes(bound, *shape, like=torch.tensor(arrays["q"]), refine=False)
            met[block_q, block_k] |= set(classes.flatten().tolist())
        in_jnp = functools.partial(_classes_in_jnp, bound.program, shape)  # the last blocks: one compile a case
        np.testing.assert_array_equal(np.asarray(jax.jit(in_jnp)(captured)), classes.numpy())
    assert all(classes == {EMPTY, PARTIAL, FULL} for classes in met.values()), met
    assert not visible[0, :, 7].any()


DROPOUT_CASES = [
    Case(spec=AttentionSpec(causal=True), heads_q=4, heads_kv=2, len_q=200, len_k=300, head_dim=64, head_dim_v=64,
         dtype="bfloat16", kv_lengths=(300, 123), dropout=(0.1, 0xF00D_CAFE_1234_5678)),
    Case(spec=AttentionSpec(layout="bshd", softcap=20.0), len_q=130, len_k=70, head_dim=128, head_dim_v=128,
         bias_shape=(1, 2, 130, 70), bias_grad=True, q_segment_ids=((0,) * 60 + (1,) * 70, (0,) * 130),
         kv_segment_ids=((0,) * 30 + (1,) * 40, (0,) * 70), dropout=(0.5, 12345)),
]  # fmt: skip


def test_dropout_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout in the compiled kernels against the oracle, forward and backward (unverified on hardware until this
    passes: scripts/gpu_check.py runs it on a GPU; it skips elsewhere)."""
    import jax

    from attnkit.backend import ALLOW_UNVERIFIED_ENV

    if jax.default_backend() not in ("gpu", "cuda"):
        pytest.skip("no GPU in JAX's default backend")
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "1")
    failures = []
    for case in DROPOUT_CASES:
        arrays = rounded(case, make_arrays(case))
        comparisons = compare(case, run_jax(case, arrays, "pallas"), *oracle_results(case, arrays))
        failures += [f"{case}: {c}" for c in comparisons if not c.ok]
    assert not failures, "\n".join(failures)


def test_mask_programs_on_the_gpu() -> None:
    """The program cases on the compiled kernels (scripts/gpu_check.py runs this on a GPU; it skips elsewhere)."""
    import jax
    from attnkit.backends.pallas.backend import PallasBackend

    if jax.default_backend() not in ("gpu", "cuda"):
        pytest.skip("no GPU in JAX's default backend")
    failures = [f"{name}: {failure}" for name in _program_cases()
                for failure in _program_comparisons(PallasBackend(interpret=False), name)]  # fmt: skip
    assert not failures, "\n".join(failures)
