"""Extras of the reference backends: tile sizes do not change results, masked tiles are skipped,
and the JAX path works under jit, grad and vmap."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import attnkit
from attnkit import AttentionSpec
from attnkit.testing import Case, assert_backends_agree

TILED_CASES = [
    Case(spec=AttentionSpec(causal=True), len_q=37, len_k=29, heads_q=4, heads_kv=2),
    Case(
        spec=AttentionSpec(window=(5, 3), softcap=10.0), len_q=33, len_k=33, bias_shape=(1, 2, 33, 33), bias_grad=True
    ),
    Case(spec=AttentionSpec(causal=True, causal_alignment="top_left"), len_q=21, len_k=40, kv_lengths=(40, 13)),
    Case(spec=AttentionSpec(variant="cosine"), len_q=19, len_k=23, q_lengths=(19, 4), mask_shape=(2, 1, 19, 23)),
]


def _tile_variants() -> list[tuple[str, object]]:
    variants = []
    if importlib.util.find_spec("torch"):
        from attnkit.backends.reference.torch_chunked import TorchChunkedBackend

        variants += [
            (f"torch-chunked-{q}x{k}", TorchChunkedBackend(block_q=q, block_k=k)) for q, k in ((16, 16), (7, 5))
        ]
    if importlib.util.find_spec("jax"):
        from attnkit.backends.reference.jax_reference import JaxReferenceBackend

        variants += [(f"jax-reference-{k}", JaxReferenceBackend(block_k=k)) for k in (8, 5)]
    return variants


@pytest.mark.parametrize(("name", "backend"), _tile_variants(), ids=[name for name, _ in _tile_variants()])
@pytest.mark.parametrize("case", TILED_CASES, ids=range(len(TILED_CASES)))
def test_tile_size_does_not_change_results(name: str, backend: object, case: Case) -> None:
    """Tiles smaller than the sequences, not dividing them, straddling lengths and the diagonal."""
    backend.name = name  # type: ignore[attr-defined]
    attnkit.register_backend(backend)  # type: ignore[arg-type]
    try:
        assert_backends_agree(case, backends=[name])
    finally:
        attnkit.unregister_backend(name)


@pytest.mark.skipif(not importlib.util.find_spec("torch"), reason="torch is not installed")
def test_chunked_skips_tiles_the_geometry_hides() -> None:
    """Causal does about half the work of non-causal; a window does a band; nothing is skipped by a mask."""
    import torch
    from attnkit.backends.reference.torch_chunked import _Geometry, _plan

    length, block = 4096, 128
    q = torch.empty(1, 1, length, 8)

    def tiles(spec: AttentionSpec, **lengths: torch.Tensor) -> int:
        inputs = attnkit.AttentionInputs(q, q, q, **lengths)
        plan = _plan(_Geometry(spec, inputs, 1, length, length), length, length, block, block)
        return sum(len(key_tiles) for _, _, key_tiles in plan)

    per_side = length // block
    full = per_side**2
    assert tiles(AttentionSpec()) == full
    assert tiles(AttentionSpec(causal=True)) == per_side * (per_side + 1) // 2  # the lower triangle and diagonal
    assert tiles(AttentionSpec(causal=True, window=(256, 0))) <= 3 * per_side
    assert tiles(AttentionSpec(), kv_lengths=torch.tensor([1000])) == per_side * 8  # keys 0..999 lie in 8 key tiles


jax_only = pytest.mark.skipif(not importlib.util.find_spec("jax"), reason="jax is not installed")


@jax_only
def test_jax_under_jit_grad_and_vmap() -> None:
    import jax
    import jax.numpy as jnp

    spec = AttentionSpec(causal=True, softcap=20.0)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, 6, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 2, 9, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 2, 9, 16)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((1, 4, 6, 9)), jnp.float32)
    lengths = jnp.asarray([9, 4], jnp.int32)

    def loss(q, k, v, bias, lengths):
        out, lse = attnkit.attend(
            spec, q, k, v, bias=bias, kv_lengths=lengths, return_lse=True, backend="jax-reference"
        )
        return (out**2).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    eager = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias, lengths)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias, lengths)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    import torch

    tensors = [torch.tensor(np.asarray(x), dtype=torch.float64, requires_grad=True) for x in (q, k, v, bias)]
    out, lse = attnkit.attend(
        spec, *tensors[:3], bias=tensors[3], kv_lengths=torch.tensor([9, 4]), return_lse=True, backend="torch-naive"
    )
    ((out**2).sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    for grad, tensor in zip(eager, tensors):
        np.testing.assert_allclose(np.asarray(grad), tensor.grad.numpy(), rtol=2e-4, atol=2e-4)

    stacked = jnp.stack([q, q * 0.5])
    batched = jax.vmap(lambda x: attnkit.attend(spec, x, k, v, backend="jax-reference"))(stacked)
    np.testing.assert_allclose(
        np.asarray(batched[1]),
        np.asarray(attnkit.attend(spec, q * 0.5, k, v, backend="jax-reference")),
        rtol=1e-5,
        atol=1e-6,
    )
