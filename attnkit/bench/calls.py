"""The calls benches time: random inputs, FLOP counts, the backend ``auto`` runs, and which backends are left out
because they run an interpreter or an emulator."""

from __future__ import annotations

from typing import Any

#: Work of each pass relative to the forward, as the FlashAttention-2 paper counts it: the forward is two matmuls,
#: the backward five.
PASS_WORK = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def random_inputs(
    framework: str, q_shape: tuple[int, ...], kv_shape: tuple[int, ...], dtype: str = "float32", device: str = "cpu"
) -> tuple[Any, Any, Any, Any]:
    """q, k, v and the output gradient (shaped like q), standard normal from seed 0, as torch tensors on ``device``
    or JAX arrays (on JAX's default device)."""
    shapes = (q_shape, kv_shape, kv_shape, q_shape)
    if framework == "torch":
        import torch

        generator = torch.Generator().manual_seed(0)
        return tuple(  # type: ignore[return-value]
            torch.randn(shape, generator=generator).to(device, getattr(torch, dtype)) for shape in shapes
        )
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    return tuple(jax.random.normal(key, shape, jnp.dtype(dtype)) for key, shape in zip(keys, shapes))  # type: ignore


def attention_flops(
    batch: int, heads: int, seq_len: int, head_dim: int, causal: bool, pass_name: str, len_k: int | None = None
) -> float:
    """The FlashAttention-2 paper's count: 4·B·H·L²·D for the forward (4·B·H·Lq·Lk·D where ``len_k`` differs), 2.5x
    that for the backward, halved when causal."""
    keys = seq_len if len_k is None else len_k
    forward = 4.0 * batch * heads * seq_len * keys * head_dim / (2 if causal else 1)
    return forward * PASS_WORK[pass_name]


def call_problem(spec: Any, q: Any, k: Any, v: Any, kv_lengths: Any = None) -> Any:
    """The Problem dispatch sees for ``attend(spec, q, k, v, kv_lengths=kv_lengths)``."""
    from attnkit.validation import prepare

    return prepare(spec, q, k, v, None, None, None, kv_lengths, False)[1]


def auto_choice(spec: Any, q: Any, k: Any, v: Any, kv_lengths: Any = None) -> str:
    """The backend ``attend(..., backend="auto")`` runs for this call, as dispatch decides it."""
    from attnkit import dispatch

    return dispatch.select(spec, call_problem(spec, q, k, v, kv_lengths)).name


def interpreted(name: str, device: str) -> bool:
    """Whether ``name`` runs an interpreter or emulator on ``device`` (excluded from timings and calibration)."""
    from attnkit import registry
    from attnkit.backend import runs_interpreted

    return runs_interpreted(registry.get_backend(name), device)
