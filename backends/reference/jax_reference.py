"""jax-reference: the contract in jax.numpy, FlashAttention-2 style, over key blocks with lax.scan.

The forward keeps a running max, running sum and rescaled accumulator per query row and saves only
(out, lse); the backward recomputes the probabilities of each key block from lse. Neither pass holds
more than one (Lq, block) slab of scores. Everything is pure jax, so the backend runs under jit, under
the frontend's custom_vjp (grad) and under vmap, with mask, bias, lengths and segment ids as tracers. A mask program
(§17) is evaluated on each key block by broadcasting its index ranges (its captured arrays are arguments of the
jitted passes, the program itself a static one: programs are hashable). Dropout (§18) regenerates each key block's
keep-mask from the seed in both passes (the seed and offsets are arguments, p a static part of their pytree).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from attnkit.backend import (
    ALL_FEATURES,
    AttentionInputs,
    AttentionSpec,
    BaseBackend,
    Capabilities,
    Dropout,
    Framework,
    Gradients,
    Layout,
    PagedInputs,
    Problem,
    Variant,
)

try:
    import jax
    import jax.numpy as jnp
    from jax import lax

    from attnkit.contract import conjoin
    from attnkit.contract.jax import (
        Normalization,
        alibi_distance,
        band_visibility,
        dropout_keep,
        gather_pages,
        length_visibility,
        normalize,
        normalize_backward,
        segment_visibility,
        zero_padding,
    )
    from attnkit.contract.programs import BoundProgram, MaskProgram, array_ops, evaluate
except Exception as error:  # missing or broken (e.g. a jaxlib mismatch): available() reports it
    _JAX_ERROR: str | None = f"jax cannot be imported ({type(error).__name__}: {error})"
else:
    _JAX_ERROR = None

DEFAULT_BLOCK_K = 128


class _Operands(NamedTuple):
    """One call in the shapes the scans use: bhsd, compute dtype, G = Hq // Hkv query heads per kv head.

    ``keys`` is the scan's xs: per key block its first index, k, v, the mask and bias columns and the key segment
    ids (None when absent). A mask or bias broadcast along keys (size 1) is repeated per block, not padded.
    """

    q: Any  # (B, Hkv, G, Lq, D), unit rows for cosine
    # (n,), (n, B, Hkv, blk, D), (n, B, Hkv, blk, Dv), (n, ...blk|1) x2, (n, B, 1, 1, 1, blk)
    keys: tuple[Any, Any, Any, Any, Any, Any]
    q_segment_ids: Any  # (B, 1, 1, Lq, 1), or None
    q_limit: Any  # rows i >= q_limit see nothing: int, or (B, 1, 1, 1, 1)
    kv_limit: Any  # keys j >= kv_limit are invisible (this also hides the padding)
    scale: float
    q_normalization: Normalization | None  # for the cosine backward
    k_normalization: Normalization | None
    alibi: Any  # minus the ALiBi slopes (§16), (B|1, Hkv, G, 1, 1) in the compute dtype, or None
    program: Any  # a BoundProgram of jnp arrays, or None
    dropout: Dropout | None  # §18, or None


def _operands(spec: AttentionSpec, block: int, inputs: AttentionInputs, program: Any = None) -> _Operands:
    """All the plumbing: layout, upcast, GQA grouping, cosine normalisation, lengths, segment ids, key padding."""
    q, k, v, mask, bias, q_lengths, kv_lengths, q_ids, kv_ids, slopes = inputs[:10]
    dtype = _compute_dtype(q.dtype)
    q, k, v = (_bhsd(spec, x).astype(dtype) for x in (q, k, v))
    heads_kv, len_q, len_k = k.shape[1], q.shape[2], k.shape[2]
    # Lengths may be tracers, so they are clamped here rather than trusted to have been checked.
    q_limit = len_q if q_lengths is None else jnp.clip(q_lengths, 0, len_q).reshape(-1, 1, 1, 1, 1)
    kv_limit = len_k if kv_lengths is None else jnp.clip(kv_lengths, 0, len_k).reshape(-1, 1, 1, 1, 1)
    q = zero_padding(q, q_lengths, axis=2, segment_ids=q_ids)
    k, v = (zero_padding(x, kv_lengths, axis=2, segment_ids=kv_ids) for x in (k, v))

    scale = spec.resolved_scale(q.shape[-1])
    q_normalization = k_normalization = None
    if spec.variant is Variant.COSINE:
        q_normalization, k_normalization = normalize(q), normalize(k)
        q, k = q_normalization.unit, k_normalization.unit
    q = _group(q, heads_kv)
    mask = None if mask is None else _group(mask, heads_kv)
    bias = None if bias is None else _group(bias.astype(dtype), heads_kv)

    count = -(-len_k // block)
    starts = jnp.arange(count, dtype=jnp.int32) * block
    keys = (
        starts,
        _key_blocks(k, -2, block, count, 0),
        _key_blocks(v, -2, block, count, 0),
        None if mask is None else _key_blocks(mask, -1, block, count, False),
        None if bias is None else _key_blocks(bias, -1, block, count, 0),
        None if kv_ids is None else _key_blocks(kv_ids.reshape(len(kv_ids), 1, 1, 1, len_k), -1, block, count, -1),
    )
    q_ids = None if q_ids is None else q_ids.reshape(len(q_ids), 1, 1, len_q, 1)  # B, Lq or Lk may be 0
    alibi = None if slopes is None else -_group(slopes.astype(dtype).reshape(*slopes.shape, 1, 1), heads_kv)
    return _Operands(
        q, keys, q_ids, q_limit, kv_limit, scale, q_normalization, k_normalization, alibi, program, inputs.dropout
    )


def _bhsd(spec: AttentionSpec, x: Any) -> Any:
    """bshd <-> bhsd (its own inverse); bhsd stays."""
    return jnp.swapaxes(x, 1, 2) if spec.layout is Layout.BSHD else x


def _compute_dtype(dtype: Any) -> Any:
    """float32 accumulation for the half types (docs/semantics.md §7); float64 stays float64."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _group(x: Any, heads_kv: int) -> Any:
    """(B|1, Hq|1, ...) -> (B|1, Hkv|1, G|1, ...): query head h reads kv head h // G, without a repeat."""
    if x.shape[1] == 1:
        return x.reshape(x.shape[0], 1, 1, *x.shape[2:])
    return x.reshape(x.shape[0], heads_kv, x.shape[1] // heads_kv, *x.shape[2:])


def _ungroup(x: Any) -> Any:
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _key_blocks(x: Any, axis: int, block: int, count: int, fill: Any) -> Any:
    """Split the key axis into ``count`` blocks on a new leading axis; padding takes ``fill``.

    An operand of key size 1 (a mask or bias broadcast along keys) is repeated per block instead.
    """
    axis %= x.ndim
    if x.shape[axis] == 1:  # broadcast along keys: every block sees the same column
        return jnp.broadcast_to(x[None], (count, *x.shape))
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, count * block - x.shape[axis])
    x = jnp.pad(x, pad, constant_values=fill)
    x = x.reshape(*x.shape[:axis], count, block, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _from_key_blocks(x: Any, axis: int, len_k: int, broadcast: bool = False) -> Any:
    """Inverse of :func:`_key_blocks` for per-block results (n, ...) stacked by the scan."""
    if broadcast:  # the operand was repeated per block, so its gradient sums over blocks
        return x.sum(axis=0)
    axis %= x.ndim - 1
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :])
    return lax.slice_in_dim(x, 0, len_k, axis=axis)


def _matmul(subscripts: str, a: Any, b: Any) -> Any:
    # HIGHEST: a reference must not drop to TF32/bf16 passes on GPUs.
    return jnp.einsum(subscripts, a, b, precision=lax.Precision.HIGHEST)


def _block_scores(spec: AttentionSpec, ops: _Operands, keys: tuple[Any, ...]) -> tuple[Any, Any]:
    """S = softcap(scale·q·kᵀ) + bias against one key block, −inf where not visible: (B, Hkv, G, Lq, blk).

    Also returns tanh(raw / c), which the softcap derivative needs (None without softcap).
    """
    start, k, _, mask, bias, kv_ids = keys
    s = _matmul("bhgqd,bhkd->bhgqk", ops.q, k) * ops.scale
    tanh = None
    if spec.softcap is not None:
        tanh = jnp.tanh(s / spec.softcap)
        s = tanh * spec.softcap
    if bias is not None:
        s = s + bias
    i = jnp.arange(ops.q.shape[3])[:, None]
    j = start + jnp.arange(k.shape[2])[None, :]
    if ops.alibi is not None:
        s = s + ops.alibi * alibi_distance(spec, i, j, ops.q_limit, ops.kv_limit).astype(s.dtype)
    # The key limit always applies: it also hides the last block's padding beyond Lk.
    visible = conjoin(
        length_visibility(i, j, ops.q_limit, ops.kv_limit),
        band_visibility(spec, i, j, ops.q_limit, ops.kv_limit),
        mask,
        segment_visibility(ops.q_segment_ids, kv_ids),
        None if ops.program is None else _program_visibility(ops, start, k.shape[2]),
    )
    return jnp.where(visible, s, -jnp.inf), tanh


def _program_visibility(ops: _Operands, start: Any, width: int) -> Any:
    """The mask program over one key block, broadcasting to (B, Hkv, G, Lq, blk): query head h = kv head · G + g
    (§2); the block's keys past Lk are evaluated too (reads clamp) and hidden by the key limit."""
    batch, heads_kv, group, len_q = ops.q.shape[:4]
    heads = jnp.arange(heads_kv, dtype=jnp.int32)[:, None] * group + jnp.arange(group, dtype=jnp.int32)
    env = {
        "b": jnp.arange(batch, dtype=jnp.int32).reshape(-1, 1, 1, 1, 1),
        "h": heads.reshape(1, heads_kv, group, 1, 1),
        "q": jnp.arange(len_q, dtype=jnp.int32).reshape(1, 1, 1, -1, 1),
        "kv": (start + jnp.arange(width, dtype=jnp.int32)).reshape(1, 1, 1, 1, -1),
    }
    return jnp.asarray(evaluate(ops.program.expr, array_ops(ops.q), env, ops.program.captured))


def _dropout_step(ops: _Operands, start: Any, width: int) -> Any:
    """The key block of ``width`` keys from ``start`` as a function x ↦ x ⊙ M / (1 − p) on (B, Hkv, G, Lq, blk)
    tiles, M §18's keep-mask with query head h = kv head · G + g (§2), all at the call's offsets; x itself without
    dropout. The mask is computed once per block, for the block's every use; keys past Lk get one too (their P is
    0)."""
    if ops.dropout is None:
        return lambda x: x
    dropout = ops.dropout
    batch, heads_kv, group, len_q = ops.q.shape[:4]
    heads = jnp.arange(heads_kv, dtype=jnp.uint32)[:, None] * group + jnp.arange(group, dtype=jnp.uint32)
    keep = dropout_keep(
        dropout.seed[0],
        dropout.seed[1],
        dropout.threshold,
        jnp.arange(batch, dtype=jnp.uint32).reshape(-1, 1, 1, 1, 1),
        (heads + jnp.asarray(dropout.head_start).astype(jnp.uint32)).reshape(1, heads_kv, group, 1, 1),
        (jnp.arange(len_q, dtype=jnp.uint32) + jnp.asarray(dropout.query_start).astype(jnp.uint32)).reshape(-1, 1),
        jnp.arange(width, dtype=jnp.uint32) + (start + jnp.asarray(dropout.key_start)).astype(jnp.uint32),
    )
    scale = dropout.scale(ops.q.dtype == jnp.float64)
    return lambda x: jnp.where(keep, x * scale, 0)


def _forward_block(spec: AttentionSpec, ops: _Operands, carry: tuple[Any, Any, Any], keys: tuple[Any, ...]) -> Any:
    row_max, row_sum, acc = carry
    s, _ = _block_scores(spec, ops, keys)
    new_max = jnp.maximum(row_max, s.max(axis=-1))
    # Rows with nothing visible yet keep max −inf; shifting them by 0 keeps exp() at 0 instead of NaN.
    shift = jnp.where(new_max == -jnp.inf, 0, new_max)
    p = jnp.exp(s - shift[..., None])
    alpha = jnp.exp(row_max - shift)
    row_sum = alpha * row_sum + p.sum(axis=-1)
    dropped = _dropout_step(ops, keys[0], p.shape[-1])
    acc = alpha[..., None] * acc + _matmul("bhgqk,bhkv->bhgqv", dropped(p), keys[2])
    return (new_max, row_sum, acc), None


def _online_softmax(spec: AttentionSpec, ops: _Operands) -> tuple[Any, Any]:
    """(out, lse) in the compute dtype, grouped: (B, Hkv, G, Lq, Dv) and (B, Hkv, G, Lq)."""
    rows = ops.q.shape[:-1]
    # full_like keeps q's type inside a shard_map (varying over its axes), which the scan's carry must match.
    init = (
        lax.full_like(ops.q, -jnp.inf, shape=rows),
        lax.full_like(ops.q, 0, shape=rows),
        lax.full_like(ops.q, 0, shape=(*rows, ops.keys[2].shape[-1])),
    )
    # Online softmax over key blocks (FlashAttention-2): m' = max(m, rowmax S), α = exp(m − m'),
    # P = exp(S − m'), l' = α·l + rowsum P, acc' = α·acc + (P ⊙ M/(1−p))·V; finally O = acc / l, lse = m + log l.
    # M: dropout's keep-mask (§18), all ones (and p = 0) without dropout; lse is the scores' before dropout.
    (row_max, row_sum, acc), _ = lax.scan(functools.partial(_forward_block, spec, ops), init, ops.keys)
    # l = 0 only where no key is visible (out 0, lse −inf); a NaN l still propagates NaN to both.
    empty = row_sum == 0
    safe_sum = jnp.where(empty, 1, row_sum)
    out = jnp.where(empty[..., None], 0, acc / safe_sum[..., None])
    lse = jnp.where(empty, -jnp.inf, row_max + jnp.log(safe_sum))
    return out, lse


def _bound(program: MaskProgram | None, captured: tuple[Any, ...]) -> Any:
    return None if program is None else BoundProgram(program, captured)


def _forward(
    spec: AttentionSpec, block: int, program: MaskProgram | None, inputs: AttentionInputs, captured: tuple[Any, ...]
) -> tuple[Any, Any]:
    out, lse = _online_softmax(spec, _operands(spec, block, inputs, _bound(program, captured)))
    # lse in the compute dtype: float64 for float64 calls (§6).
    return _bhsd(spec, _ungroup(out)).astype(inputs.q.dtype), _ungroup(lse).astype(_compute_dtype(inputs.q.dtype))


def _backward_block(
    spec: AttentionSpec,
    ops: _Operands,
    need_dbias: bool,
    rows: tuple[Any, Any, Any],
    dq: Any,
    keys: tuple[Any, ...],
) -> Any:
    lse, delta, dout = rows
    _, k, v, _, bias, _ = keys
    s, tanh = _block_scores(spec, ops, keys)
    p = jnp.exp(s - lse[..., None])
    dropped = _dropout_step(ops, keys[0], k.shape[2])
    ds = p * (dropped(_matmul("bhgqv,bhkv->bhgqk", dout, v)) - delta[..., None])
    dbias = None
    if need_dbias:
        axes = tuple(axis for axis, size in enumerate(bias.shape) if size == 1 and ds.shape[axis] != 1)
        dbias = ds.sum(axis=axes, keepdims=True)
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    dq = dq + _matmul("bhgqk,bhkd->bhgqd", ds, k) * ops.scale
    dk = _matmul("bhgqk,bhgqd->bhkd", ds, ops.q) * ops.scale
    dv = _matmul("bhgqk,bhgqv->bhkv", dropped(p), dout)
    return dq, (dk, dv, dbias)


def _backward(
    spec: AttentionSpec,
    block: int,
    need_dbias: bool,
    program: MaskProgram | None,
    inputs: AttentionInputs,
    captured: tuple[Any, ...],
    out: Any,
    lse: Any,
    dout: Any,
    dlse: Any,
) -> tuple[Any, Any, Any, Any]:
    q, k, bias = inputs.q, inputs.k, inputs.bias
    ops = _operands(spec, block, inputs, _bound(program, captured))
    need_dbias = need_dbias and bias is not None
    heads_kv, len_k = _bhsd(spec, k).shape[1:3]
    dtype = ops.q.dtype
    out, dout = (_group(_bhsd(spec, x).astype(dtype), heads_kv) for x in (out, dout))
    if dtype == lse.dtype:
        lse = _group(lse, heads_kv)
    else:  # lse is float32 by contract; P for float64 inputs needs it to float64 precision: recompute it
        _, lse = _online_softmax(spec, ops)
    delta = jnp.sum(dout * out, axis=-1)
    if dlse is not None:
        delta = delta - _group(dlse.astype(dtype), heads_kv)
    # A row with no visible key (lse −inf) gets P = exp(−inf − +inf) = 0, so every gradient is 0.
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    # Per key block, P recomputed from lse: P = exp(S − lse), dV = (P ⊙ M/(1−p))ᵀ·dO, dP = dO·Vᵀ ⊙ M/(1−p),
    # dS = P ⊙ (dP − Δ) with Δ = rowsum(dO ⊙ O) − dlse (O the dropped output); dS is dbias. M: dropout's keep-mask
    # (§18), regenerated from the seed, all ones (and p = 0) without dropout. Through the softcap
    # dS' = dS ⊙ (1 − tanh²); then dQ += scale·dS'·K (carried), dK = scale·dS'ᵀ·Q per block.
    dq, (dk, dv, dbias) = lax.scan(
        functools.partial(_backward_block, spec, ops, need_dbias, (lse, delta, dout)), jnp.zeros_like(ops.q), ops.keys
    )
    dq = _ungroup(dq)
    dk, dv = (_from_key_blocks(x, -2, len_k) for x in (dk, dv))
    if ops.q_normalization is not None and ops.k_normalization is not None:  # the cosine variant
        dq = normalize_backward(ops.q_normalization, dq)
        dk = normalize_backward(ops.k_normalization, dk)
    if need_dbias:
        dbias = _from_key_blocks(dbias, -1, len_k, bias.shape[-1] == 1).reshape(bias.shape).astype(bias.dtype)
    return (*(_bhsd(spec, x).astype(q.dtype) for x in (dq, dk, dv)), dbias)


@functools.cache
def _compiled() -> tuple[Any, Any]:
    # jit for eager callers (one XLA program instead of op-by-op dispatch); nested under a caller's jit
    # it is inlined. spec, block, need_dbias and the mask program are static: spec is a frozen, hashable pydantic
    # model, a MaskProgram a hashable expression (its captured arrays are arguments).
    return jax.jit(_forward, static_argnums=(0, 1, 2)), jax.jit(_backward, static_argnums=(0, 1, 2, 3))


def _program_apart(inputs: AttentionInputs) -> tuple[MaskProgram | None, tuple[Any, ...], AttentionInputs]:
    """(the static program, its captured arrays, the inputs without it): a BoundProgram is no pytree."""
    bound = inputs.mask_program
    if bound is None:
        return None, (), inputs
    return bound.program, tuple(bound.captured), inputs._replace(mask_program=None)


class JaxReferenceBackend(BaseBackend):
    name = "jax-reference"
    capabilities = Capabilities(
        length_generic=True,
        frameworks=frozenset({Framework.JAX}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        devices=frozenset({"cpu", "cuda"}),
        features=ALL_FEATURES,
        description="FlashAttention-2 in jax.numpy: key blocks under lax.scan, online softmax; jit/grad/vmap",
        notes=(
            "float64 needs jax_enable_x64",
            "paged KV cache: read literally, the table's blocks gathered into contiguous keys (a reference, not a "
            "fused path)",
        ),
    )

    def __init__(self, block_k: int = DEFAULT_BLOCK_K) -> None:
        if block_k < 1:
            raise ValueError(f"block_k={block_k} must be >= 1")
        self.block_k = block_k

    def available(self) -> list[str]:
        return [_JAX_ERROR] if _JAX_ERROR is not None else []

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        reasons = super().supports(spec, problem)
        if problem.framework is not Framework.JAX:
            return reasons  # the one reason (capability_reasons)
        if problem.dtype == "float64" and _JAX_ERROR is None and not jax.config.read("jax_enable_x64"):
            reasons.append("dtype=float64 needs jax_enable_x64 (jax.config.update('jax_enable_x64', True))")
        return reasons

    def _block(self, spec: AttentionSpec, inputs: AttentionInputs) -> int:
        # Never wider than the keys: short calls then run as one unpadded block.
        len_k = inputs.k.shape[1 if spec.layout is Layout.BSHD else 2]
        return max(1, min(self.block_k, len_k))

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[Any, Any]:
        # lse is always computed: the online softmax has it for free.
        forward, _ = _compiled()
        program, captured, inputs = _program_apart(inputs)
        return forward(spec, self._block(spec, inputs), program, inputs, captured)

    def forward_paged(self, spec: AttentionSpec, inputs: PagedInputs, need_lse: bool) -> tuple[Any, Any]:
        """§13 literally: the blocks gathered into contiguous (bshd) keys, then this backend's forward with
        kv_lengths."""
        keys, values = (gather_pages(cache, inputs.block_table) for cache in (inputs.k_cache, inputs.v_cache))
        if spec.layout is Layout.BHSD:
            keys, values = jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2)
        gathered = AttentionInputs(
            inputs.q,
            keys,
            values,
            kv_lengths=inputs.kv_lengths,
            alibi_slopes=inputs.alibi_slopes,
        )
        return self.forward(spec, gathered, need_lse)

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
        _, backward = _compiled()
        program, captured, inputs = _program_apart(inputs)
        block = self._block(spec, inputs)
        dq, dk, dv, dbias = backward(spec, block, need_dbias, program, inputs, captured, out, lse, dout, dlse)
        return Gradients(dq=dq, dk=dk, dv=dv, dbias=dbias)
