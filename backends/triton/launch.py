"""Launching the kernels of ``kernels.py``: strides, grids, tile configurations and the interpreter.

Triton decides when a kernel is decorated whether it is compiled for the GPU or run by its interpreter (the
``TRITON_INTERPRET=1`` environment variable, read when ``kernels.py`` is imported). Compiled kernels take CUDA
tensors; interpreted ones take CPU tensors and run one program at a time in NumPy: correct and slow, a
conformance path, never a performance one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from attnkit.backend import AttentionInputs, AttentionSpec, CausalAlignment, Variant
from attnkit.contract.kernels import bhsd

from . import kernels

#: True when the kernels were decorated under TRITON_INTERPRET=1: they then run on CPU tensors only.
INTERPRETED = isinstance(kernels._fwd_kernel, InterpretedFunction)
#: The one device the kernels can take in this process.
KERNEL_DEVICE = "cpu" if INTERPRETED else "cuda"


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


# The interpreter runs one program at a time in NumPy: small tiles keep the conformance shapes (L <= 24) on two key
# tiles, so the tile-skipping bounds are exercised, at little cost. Not square, as most GPU tiles are not: a bound
# that takes BLOCK_M for BLOCK_N (or the reverse) is wrong here too (tests/test_tile_edges.py).
INTERPRETER_CONFIG = TileConfig(32, 16, 1, 1)

# GPU candidates per kernel and padded head dim, the default first. The defaults were chosen to compile without
# register spills on sm_80 and sm_90 (python -m attnkit.backends.triton.inspect, docs/performance.md); the others
# trade tile size for occupancy and are tried by the autotuner. Larger head dims need smaller tiles: the forward
# holds a (BLOCK_M, D) accumulator, the dK/dV kernel two (BLOCK_N, D) ones, all in float32 registers.
GPU_CONFIGS: dict[str, dict[int, tuple[TileConfig, ...]]] = {
    "fwd": {
        64: (TileConfig(128, 64, 4, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 128, 8, 3)),
        128: (TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 32, 4, 3)),
        256: (TileConfig(64, 32, 4, 2), TileConfig(64, 64, 8, 2), TileConfig(32, 32, 4, 2)),
    },
    "dq": {
        64: (TileConfig(64, 64, 4, 2), TileConfig(128, 32, 4, 3), TileConfig(64, 32, 4, 2)),
        128: (TileConfig(64, 64, 8, 2), TileConfig(128, 32, 8, 2), TileConfig(64, 32, 4, 2)),
        # 64 query rows: the smallest wgmma M, so sm_90 runs every dot as HGMMA, spill-free with 8 warps.
        256: (TileConfig(64, 32, 8, 2), TileConfig(32, 32, 4, 2), TileConfig(32, 64, 8, 2)),
    },
    "dkdv": {
        # One stage and 8 warps: (64, 64, 4, 2) and (64, 64, 8, 2) spill 24-52 B on sm_80 / sm_90; 64x64 keeps
        # every dot on HGMMA on sm_90 (a 32-row tile is below wgmma's M = 64 and falls back to HMMA).
        64: (TileConfig(64, 64, 8, 1), TileConfig(32, 128, 8, 2), TileConfig(32, 64, 4, 2)),
        128: (TileConfig(64, 64, 8, 1), TileConfig(32, 128, 8, 2), TileConfig(32, 64, 4, 2)),
        # Spills on sm_90 at every tile tried; 64x64 moves least (STL+LDL 12 B sm_80, 0.9 KB sm_90; 32x32: 11 KB,
        # 1.1 KB) and keeps every dot on HGMMA; (64, 32, 8, 1) is spill-free on sm_80.
        256: (TileConfig(64, 64, 8, 1), TileConfig(64, 32, 8, 1), TileConfig(32, 64, 8, 2)),
    },
}


# float32 operands multiply in IEEE float32 on the FMA units, with operand tiles twice the size: the half-type
# tiles spill kilobytes and some exceed an A100's 163 KB of shared memory per block. These small tiles compile
# without spills on sm_80 (python -m attnkit.backends.triton.inspect); float32 is for accuracy, not speed.
FLOAT32_GPU_CONFIGS: dict[str, dict[int, tuple[TileConfig, ...]]] = {
    "fwd": {
        64: (TileConfig(32, 32, 4, 2), TileConfig(32, 32, 4, 1), TileConfig(16, 32, 4, 1)),
        128: (TileConfig(32, 16, 4, 1), TileConfig(16, 32, 4, 1)),
        256: (TileConfig(32, 16, 4, 1), TileConfig(16, 32, 4, 1)),
    },
    "dq": {
        64: (TileConfig(32, 32, 4, 2), TileConfig(32, 32, 4, 1), TileConfig(16, 32, 4, 1)),
        128: (TileConfig(32, 32, 4, 1), TileConfig(16, 32, 4, 1), TileConfig(32, 16, 4, 1)),
        256: (TileConfig(16, 32, 4, 1), TileConfig(32, 16, 4, 1)),
    },
    "dkdv": {
        64: (TileConfig(32, 32, 4, 1), TileConfig(16, 32, 4, 1), TileConfig(32, 16, 4, 1)),
        128: (TileConfig(16, 32, 4, 1), TileConfig(32, 16, 4, 1)),
        256: (TileConfig(32, 16, 4, 1),),
    },
}


def gpu_configs(kernel: str, block_d: int, dtype: torch.dtype) -> tuple[TileConfig, ...]:
    """The candidates for a kernel at a padded head dim and dtype, the default first."""
    bucket = 64 if block_d <= 64 else 128 if block_d <= 128 else 256
    table = FLOAT32_GPU_CONFIGS if dtype == torch.float32 else GPU_CONFIGS
    return table[kernel][bucket]


# Constexprs: shared by _prepare and the static check (inspect.py), so the cubins it inspects are the ones launched.
#: Rows per program of the Δ kernel when compiled (the interpreter uses INTERPRETER_CONFIG.block_m).
DELTA_BLOCK_M = 64


def padded_head_dim(head_dim: int, head_dim_v: int) -> int:
    """BLOCK_D = BLOCK_DV: the larger head dim padded to a power of two, at least 16 (the smallest tensor-core K).

    One width for both: on an H100 with Triton 3.6, a half-precision forward with BLOCK_D 64 and BLOCK_DV 32 (head
    dims 40 and 24) made an out-of-range shared-memory access inside tl.dot (compute-sanitizer), with every tile
    config; equal widths passed the whole conformance run there. Dv ≠ D then costs zero columns in the P·V product."""
    return max(16, triton.next_power_of_2(max(head_dim, head_dim_v)))


def kernel_constants(
    head_dim: int,
    head_dim_v: int,
    dtype: torch.dtype,
    *,
    has_lower: bool = False,
    has_upper: bool = False,
    bottom_right: bool = False,
    has_mask: bool = False,
    has_bias: bool = False,
    has_softcap: bool = False,
    cosine: bool = False,
    has_q_lengths: bool = False,
    has_kv_lengths: bool = False,
) -> dict[str, Any]:
    """The constexprs of the forward, dQ and dK/dV kernels, tiles aside (dK/dV adds HAS_DBIAS)."""
    block = padded_head_dim(head_dim, head_dim_v)
    return dict(
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_D=block,
        BLOCK_DV=block,
        HAS_LOWER=has_lower,
        HAS_UPPER=has_upper,
        BOTTOM_RIGHT=bottom_right,
        HAS_MASK=has_mask,
        HAS_BIAS=has_bias,
        HAS_SOFTCAP=has_softcap,
        COSINE=cosine,
        HAS_Q_LENGTHS=has_q_lengths,
        HAS_KV_LENGTHS=has_kv_lengths,
        # The one place the interpreter's bfloat16 dot bug is worked around (see kernels._dot).
        UPCAST_DOT=INTERPRETED and dtype == torch.bfloat16,
        # float32 operands multiply in IEEE float32, not TF32: TF32's 10-bit mantissa would miss the tolerance
        # rule for float32 (docs/testing.md) by three orders of magnitude.
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


class _Autotuner:
    """Picks the fastest of a few configurations per key on the first CUDA call, then reuses it."""

    def __init__(self) -> None:
        self._best: dict[tuple, TileConfig] = {}
        self._lock = threading.Lock()

    def choose(self, key: tuple, configs: tuple[TileConfig, ...], launch: Any) -> TileConfig:
        with self._lock:
            if key in self._best:
                return self._best[key]
        timings = []
        for config in configs:
            try:
                timings.append((triton.testing.do_bench(lambda config=config: launch(config)), config))
            except triton.runtime.errors.OutOfResources:
                continue
        best = min(timings, key=lambda item: item[0])[1] if timings else configs[0]
        with self._lock:
            self._best[key] = best
        return best


_autotuner = _Autotuner()


def _launch(kernel_name: str, grid_of: Any, args: tuple, constants: dict[str, Any], key: tuple) -> None:
    """Run one kernel: interpreted with the interpreter tiles, or compiled with an autotuned configuration."""
    kernel = getattr(kernels, f"_{kernel_name}_kernel")

    def run(config: TileConfig) -> None:
        kernel[grid_of(config)](
            *args,
            **constants,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )

    if INTERPRETED:
        run(INTERPRETER_CONFIG)
        return
    block_d, dtype = key[0], key[1]
    configs = gpu_configs(kernel_name.removeprefix("bwd_"), block_d, dtype)
    run(_autotuner.choose((kernel_name, *key), configs, run))


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """Batch, head and sequence strides of a bhsd view (the head-dim stride is 1)."""
    return x.stride(0), x.stride(1), x.stride(2)


def band(spec: AttentionSpec) -> tuple[int | None, int | None]:
    """(lower, upper) on rel = j − i − off (kernels.py): the window's left side gives lower = −left; causal and
    the window's right side give upper = min(0, right). None: unbounded."""
    left, right = spec.window or (None, None)
    uppers = [bound for bound in (0 if spec.causal else None, right) if bound is not None]
    return (-left if left is not None else None), (min(uppers) if uppers else None)


@dataclass(frozen=True)
class _Call:
    """What every kernel of one call shares: bhsd operands, the optional tensors with their strides, the
    geometry scalars and the feature switches."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    optional: tuple[torch.Tensor, ...]  # bias, mask, q_lengths, kv_lengths (q where absent: never dereferenced)
    feature_strides: tuple[int, ...]  # bias then mask, (B, Hq, Lq, Lk) strides, 0 on broadcast axes
    scalars: tuple[int | float, ...]  # heads_q, group, len_q, len_k, qk_scale, softcap
    scale: float
    band: tuple[int, int]  # lower, upper (0 where unbounded: the switch is off)
    constants: dict[str, Any]
    autotune_key: tuple

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        batch, heads_q, len_q, _ = self.q.shape
        return batch, heads_q, len_q, self.k.shape[1], self.k.shape[2]


def _prepare(spec: AttentionSpec, inputs: AttentionInputs) -> _Call:
    q, k = bhsd(spec, inputs.q), bhsd(spec, inputs.k)
    v = bhsd(spec, inputs.v)
    batch, heads_q, len_q, head_dim = q.shape
    heads_kv, len_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    optional: list[torch.Tensor] = []
    feature_strides: list[int] = []
    for x in (inputs.bias, inputs.mask):  # broadcast by stride 0, never copied
        x = x.view(torch.uint8) if x is not None and x.dtype == torch.bool else x
        expanded = x.expand(batch, heads_q, len_q, len_k) if x is not None else None
        optional.append(expanded if expanded is not None else q)
        feature_strides.extend(expanded.stride() if expanded is not None else (0, 0, 0, 0))
    for lengths in (inputs.q_lengths, inputs.kv_lengths):
        optional.append(lengths.to(device=q.device, dtype=torch.int32).contiguous() if lengths is not None else q)
    lower, upper = band(spec)
    scale = spec.resolved_scale(head_dim)
    constants = kernel_constants(
        head_dim,
        head_dim_v,
        q.dtype,
        has_lower=lower is not None,
        has_upper=upper is not None,
        bottom_right=spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT,
        has_mask=inputs.mask is not None,
        has_bias=inputs.bias is not None,
        has_softcap=spec.softcap is not None,
        cosine=spec.variant is Variant.COSINE,
        has_q_lengths=inputs.q_lengths is not None,
        has_kv_lengths=inputs.kv_lengths is not None,
    )
    return _Call(
        q=q,
        k=k,
        v=v,
        optional=tuple(optional),
        feature_strides=tuple(feature_strides),
        # The kernels multiply q kᵀ by qk_scale: scale / c when softcapped, so the product is the tanh argument.
        scalars=(
            heads_q,
            heads_q // heads_kv,
            len_q,
            len_k,
            scale / spec.softcap if spec.softcap is not None else scale,
            spec.softcap or 1.0,
        ),
        scale=scale,
        band=(lower or 0, upper or 0),
        constants=constants,
        autotune_key=(constants["BLOCK_D"], q.dtype, spec.causal, spec.window is not None),
    )


def attention_forward(spec: AttentionSpec, inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """out (spec layout, q's dtype) and lse (B, Hq, Lq) float32."""
    call = _prepare(spec, inputs)
    batch, heads_q, len_q, _, len_k = call.shape
    out = torch.empty((*inputs.q.shape[:3], inputs.v.shape[3]), dtype=inputs.q.dtype, device=inputs.q.device)
    lse = torch.empty((batch, heads_q, len_q), dtype=torch.float32, device=inputs.q.device)
    if out.numel() == 0 or len_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    out_view = bhsd(spec, out)
    args = (
        call.q,
        call.k,
        call.v,
        out_view,
        lse,
        *call.optional,
        *_strides(call.q),
        *_strides(call.k),
        *_strides(call.v),
        *_strides(out_view),
        *call.feature_strides,
        *call.scalars,
        *call.band,
    )
    grid = lambda config: (triton.cdiv(len_q, config.block_m), heads_q, batch)  # noqa: E731
    _launch("fwd", grid, args, call.constants, call.autotune_key)
    return out, lse


def attention_backward(
    spec: AttentionSpec,
    inputs: AttentionInputs,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    grad_dtype: torch.dtype | None,
    need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dq, dk, dv as bhsd tensors (dtype ``grad_dtype``, else the inputs') and dS at full (B, Hq, Lq, Lk) float32
    for dbias. For the cosine variant, dq and dk are the gradients wrt q̂ = q/‖q‖ and k̂."""
    call = _prepare(spec, inputs)
    batch, heads_q, len_q, heads_kv, len_k = call.shape

    def gradient(like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=grad_dtype or like.dtype, device=like.device)

    dq, dk, dv = gradient(call.q), gradient(call.k), gradient(call.v)
    # dS is written only inside the visible band; the rest of dbias is zero.
    dbias = torch.zeros((batch, heads_q, len_q, len_k), dtype=torch.float32, device=dq.device) if need_dbias else None
    if dq.numel() == 0 or len_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dbias
    out_view, dout_view, lse = bhsd(spec, out), bhsd(spec, dout), lse.contiguous()
    delta = torch.empty_like(lse)
    block_rows = INTERPRETER_CONFIG.block_m if INTERPRETED else DELTA_BLOCK_M
    kernels._bwd_delta_kernel[(triton.cdiv(len_q, block_rows), heads_q, batch)](
        out_view,
        dout_view,
        dlse.contiguous() if dlse is not None else lse,
        delta,
        *_strides(out_view),
        *_strides(dout_view),
        heads_q,
        len_q,
        HEAD_DIM_V=call.constants["HEAD_DIM_V"],
        BLOCK_DV=call.constants["BLOCK_DV"],
        BLOCK_M=block_rows,
        HAS_DLSE=dlse is not None,
    )
    operand_strides = (*_strides(call.q), *_strides(call.k), *_strides(call.v), *_strides(dout_view))
    scalars = (*call.scalars, call.scale, *call.band)
    dq_args = (
        call.q,
        call.k,
        call.v,
        dout_view,
        lse,
        delta,
        dq,
        *call.optional,
        *operand_strides,
        *_strides(dq),
        *call.feature_strides,
        *scalars,
    )
    grid = lambda config: (triton.cdiv(len_q, config.block_m), heads_q, batch)  # noqa: E731
    _launch("bwd_dq", grid, dq_args, call.constants, call.autotune_key)
    dkdv_args = (
        call.q,
        call.k,
        call.v,
        dout_view,
        lse,
        delta,
        dk,
        dv,
        dbias if dbias is not None else lse,
        *call.optional,
        *operand_strides,
        *_strides(dk),
        *_strides(dv),
        *call.feature_strides,
        *scalars,
    )
    grid = lambda config: (triton.cdiv(len_k, config.block_n), heads_kv, batch)  # noqa: E731
    _launch("bwd_dkdv", grid, dkdv_args, {**call.constants, "HAS_DBIAS": need_dbias}, call.autotune_key)
    return dq, dk, dv, dbias
