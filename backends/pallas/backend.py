"""pallas: attention in ``jax.experimental.pallas`` kernels (kernels.py), for JAX arrays and, bridged
through DLPack, for torch tensors.

This module is the plumbing around the kernels: layouts, padding to the block sizes, cosine normalisation and
its backward, per-batch geometry, dbias reduced to the bias's shape, empty extents, and the torch bridge.
Forward and backward are plain functions of arrays; the frontends' custom_vjp (JAX) and autograd.Function
(torch) tie them together, so jit, grad and vmap work as for any backend.

On a GPU the kernels lower through Pallas' Triton path; elsewhere they run with ``interpret=True`` (a
``jax.jit`` of a loop over the grid), which is exact but slow: a test and debugging vehicle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from attnkit import (
    AttentionInputs,
    AttentionSpec,
    Capabilities,
    CausalAlignment,
    Framework,
    Gradients,
    Layout,
    Problem,
    Variant,
    capability_reasons,
)
from attnkit.backend import ALL_FEATURES

try:
    import jax
    import jax.numpy as jnp

    from . import kernels
except Exception as error:  # missing or broken (e.g. a jaxlib mismatch): available() reports it
    _JAX_ERROR: str | None = f"jax.experimental.pallas cannot be imported ({type(error).__name__}: {error})"
else:
    _JAX_ERROR = None

COSINE_EPS = 1e-12  # as torch.nn.functional.normalize
MAX_HEAD_DIM = 256
INTERPRET_BLOCK = 16  # interpreted on CPU: small tiles keep the padded work small, and still several per row


@dataclass(frozen=True)
class _Config:
    """The static part of a call (a jit static argument): everything else is an array argument."""

    kernel: Any  # kernels.Static for the forward/dQ kernels
    kernel_dkdv: Any  # kernels.Static for the dK/dV kernel
    cosine: bool
    bottom_right: bool


def _pow2(n: int, low: int = 16) -> int:
    return max(low, 1 << max(0, n - 1).bit_length())


def _blocks(interpret: bool, len_q: int, len_k: int, dim: int) -> tuple[tuple[int, int], tuple[int, int], int]:
    """((block_q, block_k) forward/dQ, (block_q, block_k) dK/dV, num_warps): never wider than the padded length."""
    if interpret:
        fwd, bwd, warps = (INTERPRET_BLOCK, INTERPRET_BLOCK), (INTERPRET_BLOCK, INTERPRET_BLOCK), 4
    elif dim <= 64:
        fwd, bwd, warps = (128, 64), (32, 64), 4
    elif dim <= 128:
        fwd, bwd, warps = (64, 64), (32, 32), 8
    else:
        fwd, bwd, warps = (32, 32), (16, 32), 8

    def clip(pair: tuple[int, int]) -> tuple[int, int]:
        return min(pair[0], _pow2(len_q)), min(pair[1], _pow2(len_k))

    return clip(fwd), clip(bwd), warps


@functools.lru_cache(maxsize=4096)
def _config(spec: AttentionSpec, len_q: int, len_k: int, dim: int, interpret: bool) -> _Config:
    fwd, bwd, warps = _blocks(interpret, len_q, len_k, dim)
    common = {"bshd": spec.layout is Layout.BSHD, "softcap": spec.softcap is not None, "interpret": interpret}
    return _Config(
        kernel=kernels.Static(block_q=fwd[0], block_k=fwd[1], num_warps=warps, **common),
        kernel_dkdv=kernels.Static(block_q=bwd[0], block_k=bwd[1], num_warps=warps, **common),
        cosine=spec.variant is Variant.COSINE,
        bottom_right=spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT,
    )


def _band(spec: AttentionSpec) -> tuple[int, int]:
    """(left, right) of the visible band around each query's aligned position; causal clips right at 0."""
    left, right = spec.window if spec.window is not None else (None, None)
    left = kernels.FAR if left is None else left
    right = kernels.FAR if right is None else right
    if spec.causal:
        right = min(right, 0)
    return left, right


def _scalars(spec: AttentionSpec, dim: int) -> tuple[Any, Any]:
    """The values that change without recompiling: (params [scale, softcap, 0, 0], band [left, right])."""
    left, right = _band(spec)
    params = jnp.asarray([spec.resolved_scale(dim), spec.softcap or 1.0, 0.0, 0.0], jnp.float32)
    return params, jnp.asarray([left, right], jnp.int32)


# --------------------------------------------------------------------------------------------- array plumbing


def _axes(config: _Config) -> tuple[int, int]:
    return (1, 2) if config.kernel.bshd else (2, 1)


def _pad_axis(x: Any, axis: int, size: int, value: float = 0) -> Any:
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _padded_sizes(config: _Config, len_q: int, len_k: int) -> tuple[int, int]:
    step_q = max(config.kernel.block_q, config.kernel_dkdv.block_q)
    step_k = max(config.kernel.block_k, config.kernel_dkdv.block_k)
    return -(-len_q // step_q) * step_q, -(-len_k // step_k) * step_k


def _normalize(x: Any) -> tuple[Any, tuple[Any, Any, Any]]:
    x = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    denominator = jnp.maximum(norm, COSINE_EPS)
    unit = x / denominator
    return unit, (unit, denominator, norm)


def _normalize_backward(normalization: tuple[Any, Any, Any], d_unit: Any) -> Any:
    # x̂ = x / max(‖x‖, eps): dx = (dx̂ − x̂ (x̂·dx̂)) / ‖x‖; below eps only the division contributes.
    unit, denominator, norm = normalization
    radial = jnp.where(norm >= COSINE_EPS, jnp.sum(unit * d_unit, axis=-1, keepdims=True), 0)
    return (d_unit - unit * radial) / denominator


def _geometry(config: _Config, band: Any, batch: int, len_q: int, len_k: int, q_lengths: Any, kv_lengths: Any) -> Any:
    """(B, 4) int32 [q_len, kv_len, lo, hi] (kernels.py); lengths may be tracers, so they are clamped."""
    q_len = jnp.full((batch,), len_q, jnp.int32) if q_lengths is None else jnp.clip(q_lengths, 0, len_q)
    kv_len = jnp.full((batch,), len_k, jnp.int32) if kv_lengths is None else jnp.clip(kv_lengths, 0, len_k)
    q_len, kv_len = q_len.astype(jnp.int32), kv_len.astype(jnp.int32)
    offset = kv_len - q_len if config.bottom_right else jnp.zeros_like(q_len)
    left, right = band[0], band[1]
    lo = jnp.where(left >= kernels.FAR, -kernels.FAR, offset - left)
    hi = jnp.where(right >= kernels.FAR, kernels.FAR, offset + right)
    return jnp.stack([q_len, kv_len, lo, hi], axis=1)


def _pairwise(x: Any, len_q: int, len_k: int, pad_q: int, pad_k: int, dtype: Any) -> Any:
    """A 4-D mask/bias broadcastable to (B, Hq, Lq, Lk): sequence axes broadcast and padded, batch/head kept."""
    x = jnp.broadcast_to(x, (*x.shape[:2], len_q, len_k)).astype(dtype)
    return _pad_axis(_pad_axis(x, 2, pad_q), 3, pad_k)


def _prepare(config: _Config, params: Any, band: Any, inputs: AttentionInputs) -> dict[str, Any]:
    q, k, v = inputs.q, inputs.k, inputs.v
    seq_axis, head_axis = _axes(config)
    batch, len_q, len_k = q.shape[0], q.shape[seq_axis], k.shape[seq_axis]
    pad_q, pad_k = _padded_sizes(config, len_q, len_k)
    dim, dim_v = q.shape[-1], v.shape[-1]
    prepared: dict[str, Any] = {"q_norm": None, "k_norm": None}
    if config.cosine:
        q, prepared["q_norm"] = _normalize(q)
        k, prepared["k_norm"] = _normalize(k)
        q, k = q.astype(inputs.q.dtype), k.astype(inputs.k.dtype)
    dim_p, dim_vp = _pow2(dim), _pow2(dim_v)
    prepared["q"] = _pad_axis(_pad_axis(q, seq_axis, pad_q), -1, dim_p)
    prepared["k"] = _pad_axis(_pad_axis(k, seq_axis, pad_k), -1, dim_p)
    prepared["v"] = _pad_axis(_pad_axis(v, seq_axis, pad_k), -1, dim_vp)
    prepared["mask"] = None if inputs.mask is None else _pairwise(inputs.mask, len_q, len_k, pad_q, pad_k, jnp.int8)
    prepared["bias"] = None if inputs.bias is None else _pairwise(inputs.bias, len_q, len_k, pad_q, pad_k, jnp.float32)
    prepared["geom"] = _geometry(config, band, batch, len_q, len_k, inputs.q_lengths, inputs.kv_lengths)
    prepared["sizes"] = (batch, len_q, len_k, dim, dim_v, q.shape[head_axis])
    return prepared


def _unpad(config: _Config, x: Any, length: int, dim: int) -> Any:
    seq_axis, _ = _axes(config)
    x = jax.lax.slice_in_dim(x, 0, length, axis=seq_axis)
    return x[..., :dim]


def _empty_forward(inputs: AttentionInputs, config: _Config) -> tuple[Any, Any]:
    q, v = inputs.q, inputs.v
    seq_axis, head_axis = _axes(config)
    out_shape = (*q.shape[:-1], v.shape[-1])
    lse_shape = (q.shape[0], q.shape[head_axis], q.shape[seq_axis])
    return jnp.zeros(out_shape, q.dtype), jnp.full(lse_shape, -jnp.inf, jnp.float32)


def _forward(config: _Config, params: Any, band: Any, inputs: AttentionInputs) -> tuple[Any, Any]:
    seq_axis, _ = _axes(config)
    if 0 in (inputs.q.shape[0], inputs.q.shape[seq_axis], inputs.k.shape[seq_axis]):
        return _empty_forward(inputs, config)
    prepared = _prepare(config, params, band, inputs)
    out, lse = kernels.forward_call(
        config.kernel,
        prepared["geom"],
        params,
        prepared["q"],
        prepared["k"],
        prepared["v"],
        prepared["mask"],
        prepared["bias"],
    )
    _, len_q, _, _, dim_v, _ = prepared["sizes"]
    return _unpad(config, out, len_q, dim_v), lse[:, :, :len_q]


def _lse_rows(config: _Config, x: Any) -> Any:
    """(B, Hq, Lq) rows from a per-row quantity in the layout's order (B, Lq, Hq) or (B, Hq, Lq)."""
    return jnp.swapaxes(x, 1, 2) if config.kernel.bshd else x


def _backward(
    config: _Config,
    want_dbias: bool,
    params: Any,
    band: Any,
    inputs: AttentionInputs,
    out: Any,
    lse: Any,
    dout: Any,
    dlse: Any,
) -> tuple[Any, Any, Any, Any]:
    q, k, v, bias = inputs.q, inputs.k, inputs.v, inputs.bias
    seq_axis, _ = _axes(config)
    if 0 in (q.shape[0], q.shape[seq_axis], k.shape[seq_axis]):
        dbias = None if not want_dbias else jnp.zeros(bias.shape, bias.dtype)
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), dbias
    prepared = _prepare(config, params, band, inputs)
    _, len_q, len_k, dim, dim_v, _ = prepared["sizes"]
    pad_q = prepared["q"].shape[seq_axis]
    # Δ = rowsum(dO ⊙ O) − dlse; an empty row (lse −inf) gets lse +inf, so P = 0 and its dlse is ignored.
    delta = _lse_rows(config, jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1))
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)
    empty = lse == -jnp.inf
    delta = _pad_axis(jnp.where(empty, 0.0, delta), 2, pad_q)
    lse = _pad_axis(jnp.where(empty, jnp.inf, lse), 2, pad_q, jnp.inf)
    do = _pad_axis(_pad_axis(dout, seq_axis, pad_q), -1, prepared["v"].shape[-1])
    operands = (prepared["geom"], params, prepared["q"], prepared["k"], prepared["v"], do, lse, delta)
    dk, dv = kernels.dkdv_call(config.kernel_dkdv, *operands, prepared["mask"], prepared["bias"])
    dq, dbias = kernels.dq_call(config.kernel, *operands, prepared["mask"], prepared["bias"], want_dbias)
    dq, dk, dv = _unpad(config, dq, len_q, dim), _unpad(config, dk, len_k, dim), _unpad(config, dv, len_k, dim_v)
    if config.cosine:
        dq = _normalize_backward(prepared["q_norm"], dq)
        dk = _normalize_backward(prepared["k_norm"], dk)
    if dbias is not None:
        dbias = dbias[:, :, :len_q, :len_k]
        axes = tuple(axis for axis, size in enumerate(bias.shape) if size == 1 and dbias.shape[axis] != 1)
        dbias = dbias.sum(axis=axes, keepdims=True).astype(bias.dtype) if axes else dbias.astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias


@functools.cache
def _compiled() -> tuple[Any, Any]:
    # One XLA program per (config, shapes, dtypes); scale, softcap, window and lengths are arguments, so
    # changing them does not recompile. Nested under a caller's jit these are inlined.
    return jax.jit(_forward, static_argnums=(0,)), jax.jit(_backward, static_argnums=(0, 1))


# ----------------------------------------------------------------------------------------------- torch bridge


def _to_jax(x: Any) -> Any:
    """torch -> JAX through DLPack. bool and int64 have no JAX twin by default, so they are narrowed first."""
    import torch

    if x is None:
        return None
    x = x.detach()
    if x.dtype == torch.bool:
        x = x.to(torch.int8)
    elif not x.is_floating_point():
        x = x.to(torch.int32)
    return jax.dlpack.from_dlpack(x.contiguous())


def _to_torch(x: Any) -> Any:
    import torch

    return None if x is None else torch.from_dlpack(x)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _mask_from_int8(inputs: AttentionInputs) -> AttentionInputs:
    return inputs if inputs.mask is None else inputs._replace(mask=inputs.mask != 0)


class PallasBackend:
    name = "pallas"
    capabilities = Capabilities(
        frameworks=frozenset({Framework.JAX, Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        devices=frozenset({"cpu", "cuda"}),
        features=ALL_FEATURES,
        head_dims=(1, MAX_HEAD_DIM),
        description=(
            "FlashAttention-2 in jax.experimental.pallas kernels (Triton path on GPU); "
            "torch tensors bridged through DLPack"
        ),
        notes=(
            "on CPU the kernels run with interpret=True (a jit of a loop over the grid): exact but slow, "
            "for testing; on a GPU they lower through Pallas' Triton path",
            "float64: not declared (Triton's GPU dot has no float64 path)",
            "head dims up to 256, padded to a power of two >= 16; sequences padded to the block size",
            "dense mask/bias: their sequence axes are materialised (batch/head broadcast is kept)",
        ),
    )
    #: The harness (attnkit.testing.runners) drives it through JAX; the torch bridge has its own tests.
    native_framework = Framework.JAX

    def __init__(self, interpret: bool | None = None) -> None:
        self._interpret = interpret

    def available(self) -> list[str]:
        return [_JAX_ERROR] if _JAX_ERROR is not None else []

    def interpret(self) -> bool:
        """True where kernels run in Pallas' interpreter: no GPU in JAX's default backend."""
        if self._interpret is not None:
            return self._interpret
        return jax.default_backend() not in ("gpu", "cuda")

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        reasons = capability_reasons(self.capabilities, spec, problem)
        if problem.device == "cuda" and problem.framework is Framework.TORCH and _JAX_ERROR is None:
            if jax.default_backend() not in ("gpu", "cuda"):
                reasons.append("device=cuda torch tensors need JAX with CUDA (pip install 'jax[cuda13]')")
        return reasons

    def _call(self, spec: AttentionSpec, inputs: AttentionInputs) -> tuple[_Config, Any, Any]:
        seq_axis = 1 if spec.layout is Layout.BSHD else 2
        len_q, len_k, dim = inputs.q.shape[seq_axis], inputs.k.shape[seq_axis], inputs.q.shape[-1]
        config = _config(spec, len_q, len_k, max(dim, inputs.v.shape[-1]), self.interpret())
        params, band = _scalars(spec, dim)
        return config, params, band

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[Any, Any]:
        forward, _ = _compiled()
        if _is_torch(inputs.q):
            jax_inputs = _mask_from_int8(AttentionInputs(*(_to_jax(x) for x in inputs)))
            return tuple(_to_torch(x) for x in forward(*self._call(spec, jax_inputs), jax_inputs))  # type: ignore
        return forward(*self._call(spec, inputs), inputs)

    def backward(
        self,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        out: Any,
        lse: Any,
        dout: Any,
        dlse: Any | None,
    ) -> Gradients:
        _, backward = _compiled()
        want_dbias = inputs.bias is not None
        if _is_torch(inputs.q):
            jax_inputs = _mask_from_int8(AttentionInputs(*(_to_jax(x) for x in inputs)))
            config, params, band = self._call(spec, jax_inputs)
            cotangents = (_to_jax(x) for x in (out, lse, dout, dlse))
            grads = backward(config, want_dbias, params, band, jax_inputs, *cotangents)
            return Gradients(*(_to_torch(x) for x in grads))
        config, params, band = self._call(spec, inputs)
        return Gradients(*backward(config, want_dbias, params, band, inputs, out, lse, dout, dlse))
