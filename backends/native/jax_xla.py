"""``jax-xla``: the contract lowered onto ``jax.nn.dot_product_attention`` (its XLA path; cuDNN on CUDA).

* Layout: the call takes (B, T, N, H) = bshd; bhsd inputs are swapped in and out.
* Causal: top-left (and bottom-right with Lq = Lk) is ``is_causal=True``. Bottom-right with Lq != Lk, windows
  (jax's ``local_window_size`` is top-left aligned, with no per-batch offset) and lengths become one boolean mask,
  ANDed with the user's: the XLA path materialises the (Lq, Lk) scores anyway.
* Fully masked rows: jax fills hidden scores with a large *finite* negative, so an empty row outputs the mean of V;
  here such rows are found from the visibility mask and set to 0, which also zeroes their cotangent.
* Mask programs (§17): materialised by :func:`attnkit.contract.programs.dense` in jnp (outside the jitted lowering,
  whose arguments are arrays) and ANDed into the user's mask.
* Segment ids: jax.nn.dot_product_attention has none; ``q_ids == kv_ids >= 0`` joins the same boolean mask, so a
  packed row costs its whole (Lq, Lk) scores, (Σ Lᵢ)², with nothing skipped.
* Padding beyond lengths and at negative segment ids is zeroed first (0·NaN would otherwise reach visible rows). On
  CPU, when there are fewer queries than keys (a KV cache's decode or chunk step), that pass sits in a ``lax.cond``
  on whether there is any padding, which XLA does not fuse through: fused, the select joins the transposing copy of
  k and v that feeds each dot, an elementwise loop reading the cache with a stride, about 6x the select and the copy
  apart (a jitted decode step over a 2048-key cache took 4x jax.nn.dot_product_attention's time). With Lq >= Lk the
  dots dominate, and the conditional measured slower at Lq = Lk = 768 and 1024 (15%), so the select stays fused.
* Differentiated by JAX itself (``differentiable_forward``): jax.grad of attend is jax.grad of the library call.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from attnkit.backend import (
    ALL_FEATURES,
    AttentionInputs,
    AttentionSpec,
    BaseBackend,
    Capabilities,
    CausalAlignment,
    Feature,
    Framework,
    Gradients,
    Layout,
    Problem,
    Runner,
    Variant,
)
from attnkit.contract import conjoin
from attnkit.contract.jax import (
    band_visibility,
    length_visibility,
    normalize,
    segment_visibility,
    zero_padding,
)
from attnkit.contract.programs import dense


def _bshd(spec: AttentionSpec, x: Any) -> Any:
    return x if spec.layout is Layout.BSHD else jnp.swapaxes(x, 1, 2)


def _unit_rows(x: Any) -> Any:
    """x̂ in float32 at least: rounding q̂ to a half type before q̂·k̂ costs more than the tolerance allows.
    Differentiated by JAX, so only the unit rows are kept."""
    wide = x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x
    return normalize(wide).unit


def _visibility(spec: AttentionSpec, inputs: AttentionInputs, len_q: int, len_k: int) -> Any:
    """Boolean (B|1, Hq|1, Lq, Lk) per §4, or None when SDPA-style top-left causal (or nothing) expresses it."""
    i = jnp.arange(len_q)[None, None, :, None]
    j = jnp.arange(len_k)[None, None, None, :]
    q_len = inputs.q_lengths.astype(jnp.int32)[:, None, None, None] if inputs.q_lengths is not None else None
    kv_len = inputs.kv_lengths.astype(jnp.int32)[:, None, None, None] if inputs.kv_lengths is not None else None
    band = band_visibility(spec, i, j, len_q if q_len is None else q_len, len_k if kv_len is None else kv_len)
    q_ids, kv_ids = inputs.q_segment_ids, inputs.kv_segment_ids
    segments = None if q_ids is None else segment_visibility(q_ids[:, None, :, None], kv_ids[:, None, None, :])
    # Lengths limit only where given: with none, a spec without a band or mask needs no mask at all.
    return conjoin(band, length_visibility(i, j, q_len, kv_len), inputs.mask, segments)


def _without_padding(inputs: AttentionInputs, q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """q, k, v (bshd) with their padding zeroed (§5). Zeroed in both passes: V's garbage would reach out through
    0·NaN, and K's the gradient of q (dq = dS·K, whose dS is 0 there).

    On CPU with Lq < Lk the zeroing is a branch of a ``lax.cond`` taken when any position is padding (see the module
    docstring); the predicate is a tracer, so XLA keeps the conditional, and its backward (JAX transposes the cond)
    too. Other platforms fuse the select well and get it plain."""
    q_lengths, kv_lengths = inputs.q_lengths, inputs.kv_lengths
    q_ids, kv_ids = inputs.q_segment_ids, inputs.kv_segment_ids
    if all(x is None for x in (q_lengths, kv_lengths, q_ids, kv_ids)):
        return q, k, v

    def zero(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
        q = zero_padding(q, q_lengths, axis=1, segment_ids=q_ids)
        k, v = (zero_padding(x, kv_lengths, axis=1, segment_ids=kv_ids) for x in (k, v))
        return q, k, v

    if q.shape[1] >= k.shape[1]:
        return zero(q, k, v)

    def apart(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
        short = [jnp.any(n < x.shape[1]) for n, x in ((q_lengths, q), (kv_lengths, k)) if n is not None]
        padded = functools.reduce(
            jnp.logical_or, short + [jnp.any(ids < 0) for ids in (q_ids, kv_ids) if ids is not None]
        )
        return jax.lax.cond(padded, zero, lambda *x: x, q, k, v)

    return jax.lax.platform_dependent(q, k, v, cpu=apart, default=zero)


def _native_causal(spec: AttentionSpec, inputs: AttentionInputs, len_q: int, len_k: int) -> bool:
    """Whether is_causal=True expresses all of the visibility but the user mask."""
    if spec.window is not None or any(
        x is not None for x in (inputs.q_lengths, inputs.kv_lengths, inputs.q_segment_ids)
    ):
        return False
    return spec.causal and (spec.causal_alignment is CausalAlignment.TOP_LEFT or len_q == len_k)


def _lse(spec: AttentionSpec, inputs: AttentionInputs, q: Any, k: Any, bias: Any, scale: float) -> Any:
    """float32 (B, Hq, Lq) logsumexp of the visible scores, −inf for empty rows; q, k bshd, prepared.

    jax.nn.dot_product_attention does not return it, so the scores are computed once more (XLA materialises
    them anyway)."""
    len_q, len_k = q.shape[1], k.shape[1]
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    visible = _visibility(spec, inputs, len_q, len_k)
    if visible is None:
        return jax.nn.logsumexp(logits, axis=-1)
    empty = ~jnp.any(visible, axis=-1)
    # where twice: an empty row's −inf must not reach the gradient as −inf − (−inf).
    safe = jnp.where(visible, logits, jnp.where(empty[..., None], 0.0, -jnp.inf))
    return jnp.where(empty, -jnp.inf, jax.nn.logsumexp(safe, axis=-1))


def _program_as_mask(spec: AttentionSpec, inputs: AttentionInputs) -> AttentionInputs:
    """A mask program materialised, (B|1, Hq|1, Lq, Lk), and ANDed into the mask; the inputs then hold no program."""
    bound = inputs.mask_program
    if bound is None:
        return inputs
    q, k = _bshd(spec, inputs.q), _bshd(spec, inputs.k)
    visible = dense(bound, q.shape[0], q.shape[2], q.shape[1], k.shape[1], q)
    return inputs._replace(mask=conjoin(visible, inputs.mask), mask_program=None)


def xla_attention(spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool = False) -> tuple[Any, Any]:
    """(out, lse | None). Jitted as a whole (eager JAX compiles each primitive of the lowering apart), except
    float16: jax's CPU dot_general rejects the F16_F16_F32 dot that the jitted backward of
    jax.nn.dot_product_attention contains (eager dispatch avoids it; under a user's jax.jit it is jax's limit)."""
    inputs = _program_as_mask(spec, inputs)
    if inputs.q.dtype == jnp.float16:
        return _xla_attention(spec, inputs, need_lse)
    return _jitted(spec, inputs, need_lse)


def _xla_attention(spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool = False) -> tuple[Any, Any]:
    # Every product at full float32 precision, gradients included (the setting is fixed on each dot as it is traced):
    # JAX's default on GPUs since Ampere multiplies float32 in TF32, 10 mantissa bits, past the float32 tolerance.
    with jax.default_matmul_precision("highest"):
        return _xla_attention_traced(spec, inputs, need_lse)


def _xla_attention_traced(spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[Any, Any]:
    q, k, v = _bshd(spec, inputs.q), _bshd(spec, inputs.k), _bshd(spec, inputs.v)
    batch, len_q, heads_q, head_dim = q.shape
    len_k, dim_v = k.shape[1], v.shape[-1]
    if q.size == 0 or len_k == 0:  # §9
        out = jnp.zeros((batch, len_q, heads_q, dim_v), q.dtype)
        empty_lse = jnp.full((batch, heads_q, len_q), -jnp.inf, jnp.float32)
        return (out if spec.layout is Layout.BSHD else jnp.swapaxes(out, 1, 2)), empty_lse
    q, k, v = _without_padding(inputs, q, k, v)
    dtype = q.dtype
    if spec.variant is Variant.COSINE:
        q, k = _unit_rows(q), _unit_rows(k)
        v = v.astype(q.dtype)
    # With a user mask, the whole visibility goes into one mask, so empty rows are found from all of it.
    native = _native_causal(spec, inputs, len_q, len_k) and inputs.mask is None
    visible = None if native else _visibility(spec, inputs, len_q, len_k)
    width = max(head_dim, dim_v)
    if width != head_dim or width != dim_v:  # the call wants one head size: zero columns change no score
        pad = [(0, 0)] * 3
        q, k, v = (jnp.pad(x, [*pad, (0, width - x.shape[-1])]) for x in (q, k, v))
    bias = inputs.bias
    if bias is not None and bias.dtype != jnp.float32:
        bias = bias.astype(jnp.float32 if q.dtype != jnp.float64 else q.dtype)
    if dtype == jnp.bfloat16 and batch * heads_q * len_q * len_k == 1:
        # XLA's CPU compiler rejects the jitted call whose products are single dot products of bfloat16 vectors
        # ("Algorithm not supported by the ElementalIrEmitter: ALG_DOT_BF16_BF16_F32"); float32 operands give
        # the same result (the contract accumulates in float32), rounded to bfloat16 below.
        q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    out = jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=visible, scale=spec.resolved_scale(head_dim), is_causal=native
    )
    out = out[..., :dim_v].astype(dtype)
    if visible is not None:  # empty rows: jax's finite fill gives the mean of V; the contract says 0
        empty = ~jnp.any(visible, axis=-1)  # (B|1, Hq|1, Lq)
        out = jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], jnp.zeros((), out.dtype), out)
    lse = _lse(spec, inputs, q, k, bias, spec.resolved_scale(head_dim)) if need_lse else None
    return (out if spec.layout is Layout.BSHD else jnp.swapaxes(out, 1, 2)), lse


_jitted = jax.jit(_xla_attention, static_argnums=(0, 2))


class JaxXlaBackend(BaseBackend):
    """jax.nn.dot_product_attention on JAX arrays, differentiated by JAX."""

    name = "jax-xla"
    capabilities = Capabilities(
        length_generic=True,
        frameworks=frozenset({Framework.JAX}),
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        devices=frozenset({"cpu", "cuda"}),
        features=ALL_FEATURES - {Feature.SOFTCAP, Feature.PAGED, Feature.ALIBI, Feature.DROPOUT},
        unsupported_because=((Feature.DROPOUT, "jax.nn.dot_product_attention has no dropout"),),
        materialises_mask_programs=True,
        description="jax.nn.dot_product_attention (XLA; materialises the (Lq, Lk) scores), differentiated by JAX",
        notes=(
            "lse: jax.nn.dot_product_attention does not return it; computed from the scores once more when asked",
            "softcap: no score modifier in jax.nn.dot_product_attention",
            "float64: its XLA path computes logits in float32",
            "fully masked rows: set to 0 from the visibility mask (jax itself gives the mean of V)",
            "mask programs: no mask_mod in jax.nn.dot_product_attention; the program is materialised as a boolean "
            "(B|1, Hq|1, Lq, Lk) mask and ANDed into the call's",
            "segment ids: no such argument in jax.nn.dot_product_attention; passed as a dense (B, 1, Lq, Lk) mask, "
            "so a packed row costs (Σ Lᵢ)² scores and memory, not Σ Lᵢ²",
            "paged KV cache: not declared; jax.nn.dot_product_attention takes no block table, so it could only run "
            "on a gathered copy of the cache (jax-reference reads it so, pallas through the table)",
        ),
    )

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[Any, Any]:
        return xla_attention(spec, inputs, need_lse)

    def differentiable_forward(self, spec: AttentionSpec, problem: Problem) -> Runner:
        """JAX differentiates the lowering itself; the frontend does not wrap it in its custom_vjp."""
        return functools.partial(xla_attention, spec, need_lse=problem.return_lse)

    def backward(
        self,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        out: Any,
        lse: Any,
        dout: Any,
        dlse: Any | None,
        *,
        need_dbias: bool,
    ) -> Gradients:
        """For callers of the protocol itself: jax.vjp of the forward, through the bias only when its gradient is
        wanted."""
        need_dbias = need_dbias and inputs.bias is not None
        need_lse = dlse is not None

        def run(q: Any, k: Any, v: Any, *bias: Any) -> Any:
            differentiated = inputs._replace(q=q, k=k, v=v, bias=bias[0] if bias else inputs.bias)
            return xla_attention(spec, differentiated, need_lse=need_lse)

        primals = (inputs.q, inputs.k, inputs.v, *((inputs.bias,) if need_dbias else ()))
        (_, lse_again), vjp = jax.vjp(run, *primals)
        dq, dk, dv, *dbias = vjp((dout, dlse if dlse is not None else lse_again))
        return Gradients(dq=dq, dk=dk, dv=dv, dbias=dbias[0] if need_dbias else None)
