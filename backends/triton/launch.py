"""Launching the kernels of ``kernels.py``: constexprs, tile configurations, the autotuner and the interpreter.

The arguments, grids and the backward sequence are the kernel backends' shared ones
(:mod:`attnkit.contract.kernels`); :class:`TritonLauncher` runs each kernel.

Triton decides when a kernel is decorated whether it is compiled for the GPU or run by its interpreter (the
``TRITON_INTERPRET=1`` environment variable, read when ``kernels.py`` is imported). Compiled kernels take CUDA
tensors; interpreted ones take CPU tensors and run one program at a time in NumPy: correct and slow, a
conformance path, never a performance one.

What a launch does is planned for a :class:`Target` (the compiled kernels of an arch, or the interpreter's plan): the
tiles, the autotuner, tensor descriptors, warp specialisation, the one-pass backward. The process's own target
follows its mode and device; a test may plan for another (tests/test_triton_planning.py plans the compiled launches
on CPU). Only what depends on how the kernels execute reads :data:`INTERPRETED`, through the
:class:`KernelExecutor` that runs a planned launch: the interpreter's bfloat16 workaround, the compiled kernels' inline
assembly, the allocator of in-kernel descriptors.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from attnkit.backend import (
    Dropout,
    RecordDirectory,
    RecordsRefusedError,
    attnkit_version,
    default_directory,
    lasting_records,
)
from attnkit.contract.kernels import (
    SEGMENT_GRANULE,
    ArgumentTypes,
    Grid,
    Kernel,
    KernelCall,
    KernelSwitches,
    rows_on_16_bytes,
)
from attnkit.contract.programs import cached_tile_classes

from . import kernels, programs

_log = logging.getLogger("attnkit")

#: True when the kernels were decorated under TRITON_INTERPRET=1: they then run on CPU tensors only.
INTERPRETED = isinstance(kernels._fwd_kernel, InterpretedFunction)
#: The one device the kernels can take in this process.
KERNEL_DEVICE = "cpu" if INTERPRETED else "cuda"
#: The tile tables of compiled kernels (gpu_configs): "sm_80" for Ampere and older, "sm_90" for Hopper and newer.
ARCHS = ("sm_80", "sm_90")


class UnknownArchError(ValueError):
    """A compiled target names an arch without a tile table (not one of ARCHS)."""


@dataclass(frozen=True)
class Target:
    """What a launch is planned for: compiled kernels of ``arch`` (one of ARCHS), or, not ``compiled``, the
    interpreter's plan (its small tiles, no autotuner, descriptors and warp specialisation wherever they serve)."""

    compiled: bool
    arch: str | None = None  # compiled only

    def __post_init__(self) -> None:
        if self.compiled and self.arch not in ARCHS:
            raise UnknownArchError(f"a compiled target needs an arch among {ARCHS}, not {self.arch!r}")


INTERPRETER_TARGET = Target(compiled=False)


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    warp_specialize: bool = False  # the key loop warp-specialised (WARP_SPECIALIZED)


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
        64: (TileConfig(128, 128, 8, 3), TileConfig(128, 64, 4, 3), TileConfig(64, 64, 4, 3)),
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
        64: (TileConfig(64, 64, 4, 1), TileConfig(64, 64, 8, 1), TileConfig(32, 64, 4, 2)),
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


#: Hopper's own half-precision tiles where they differ, for calls that read nothing beyond q, k, v (no mask, bias,
#: segment ids or block table, no split-K partials: those spill there, or need more than 227 KB of shared memory).
#: The forward on 128 × 128 tiles, 8 warps (two warpgroups of 64 rows each, wgmma N = 128) and 3 stages: 8.7
#: instructions per score at D = 128 (8.0 with tensor descriptors) and 7.3 at D = 64 against 11.5 and 8.1 on
#: 128 × 64, spill-free, 226 KB of shared memory at D = 128 (an H100 block has 227 KB); on an A100 the same tile
#: spills at D = 128.
SM90_GPU_CONFIGS: dict[str, dict[int, tuple[TileConfig, ...]]] = {
    "fwd": {
        64: (TileConfig(128, 128, 8, 3), TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 2)),
        128: (TileConfig(128, 128, 8, 3), TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3)),
    },
    # 128 rows on 8 warps: each warpgroup owns 64 rows of every product. 64 rows on 8 warps split N between the
    # warpgroups and repeat part of the work (1.5-1.7x the products' flops, tensor_work in the static check).
    "dq": {
        64: (TileConfig(64, 64, 4, 2), TileConfig(128, 64, 8, 2), TileConfig(64, 32, 4, 2)),
        128: (TileConfig(128, 64, 8, 2), TileConfig(64, 64, 4, 2), TileConfig(64, 64, 8, 2)),
    },
    "dkdv": {
        64: (TileConfig(64, 64, 4, 1), TileConfig(128, 64, 8, 1), TileConfig(64, 64, 8, 1)),
        128: (TileConfig(128, 64, 8, 1), TileConfig(64, 64, 8, 1), TileConfig(64, 64, 4, 1)),
    },
}


#: The forward's and dQ's warp-specialised candidate on Hopper, tried by the autotuner beside SM90_GPU_CONFIGS where
#: every tile is interior (warp_specialization_serves) and the triton backend's warp_specialize option is on (off
#: until a GPU has run it). Triton 3.9's Hopper pass (nvgpu-warp-specialization) takes a
#: loop marked warp_specialize only in a kernel of num_warps = 4 and num_stages > 1, and makes it 3 warpgroups: a
#: producer issuing the copies and two consumers of 64 rows each (12 warps, setmaxnreg). At D = 128 the consumers'
#: loop reads 7.3 instructions per score in the forward (8.0 on the 8-warp tile) and 6.8 in dQ (9.6), with no copy in
#: it (docs/triton.md).
WARP_SPECIALIZED = TileConfig(128, 128, 4, 2, warp_specialize=True)
WARP_SPECIALIZED_KERNELS = (Kernel.FORWARD, Kernel.DQ)

#: The switches under which some tile is not interior: a band, a mask or bias, softcap, cosine, ALiBi and dropout
#: (kept off the warp-specialised loop: the static check has not found them lean there), lengths, segment ids,
#: paging, split-K.
_EDGE_SWITCHES = ("has_lower", "has_upper", "has_mask", "has_bias", "has_softcap", "cosine", "has_alibi",
                  "has_dropout", "has_q_lengths", "has_kv_lengths", "has_segment_ids", "paged", "split_k",
                  "has_mask_program")  # fmt: skip


def gpu_configs(
    kernel: str, block_d: int, dtype: torch.dtype, arch: str, switches: KernelSwitches
) -> tuple[TileConfig, ...]:
    """The candidates for a kernel at a padded head dim, dtype, arch ("sm_80": Ampere and anything older than
    Hopper, "sm_90": Hopper and newer) and switches, the default first."""
    bucket = 64 if block_d <= 64 else 128 if block_d <= 128 else 256
    heavy = (switches.has_mask, switches.has_bias, switches.has_segment_ids, switches.paged, switches.split_k,
             switches.has_mask_program)  # fmt: skip
    hopper = dtype != torch.float32 and arch == "sm_90" and not any(heavy)
    if hopper and bucket in SM90_GPU_CONFIGS.get(kernel, {}):
        return SM90_GPU_CONFIGS[kernel][bucket]
    table = FLOAT32_GPU_CONFIGS if dtype == torch.float32 else GPU_CONFIGS
    return table[kernel][bucket]


def arch_of(device: torch.device) -> str:
    """The tile table a CUDA device takes: "sm_90" from compute capability 9.0 on, else "sm_80"."""
    major, _ = torch.cuda.get_device_capability(device)
    return "sm_90" if major >= 9 else "sm_80"


def target_of(device: torch.device) -> Target:
    """The target this process's kernels serve on ``device``: the interpreter's plan, or compiled for its arch."""
    return INTERPRETER_TARGET if INTERPRETED else Target(compiled=True, arch=arch_of(device))


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1). triton.next_power_of_2 is a constexpr function whose every call
    pays an import and argument unwrapping (13 µs a call against 1 µs here, on a loaded 2-core machine)."""
    return 1 << max(n - 1, 0).bit_length()


def length_bucket(length: int) -> int:
    """The autotuner's sequence-length bucket: the next power of two from 512 to 16384, so that a tile chosen on
    a short call is not reused for a long one."""
    return min(max(next_power_of_2(length), 512), 16384)


#: Each kernel's name here (its tiles: GPU_CONFIGS[name]) and its function in kernels.py.
NAMES = {Kernel.FORWARD: "fwd", Kernel.DELTA: "delta", Kernel.DQ: "dq", Kernel.DKDV: "dkdv"}
#: Split-K's combine (kernels._merge_splits_kernel): this kernel set's own, launched after a split forward in place
#: of the shared sequence's torch merge (ten CUDA kernels: contract.kernels.merge_splits).
MERGE = "merge_splits"
FUNCTIONS: dict[Kernel | str, Any] = {
    Kernel.FORWARD: kernels._fwd_kernel,
    Kernel.DELTA: kernels._bwd_delta_kernel,
    Kernel.DQ: kernels._bwd_dq_kernel,
    Kernel.DKDV: kernels._bwd_dkdv_kernel,
    MERGE: kernels._merge_splits_kernel,
}


#: Rows per program of the Δ kernel when compiled (the interpreter uses INTERPRETER_CONFIG.block_m). Shared by the
#: launcher and the static check (inspect.py), as every constexpr here, so the cubins it inspects are the ones
#: launched.
DELTA_BLOCK_M = 64


def padded_head_dim(head_dim: int, head_dim_v: int) -> int:
    """BLOCK_D = BLOCK_DV: the larger head dim padded to a power of two, at least 16 (the smallest tensor-core K).

    One width for both: on an H100 with Triton 3.6, a half-precision forward with BLOCK_D 64 and BLOCK_DV 32 (head
    dims 40 and 24) made an out-of-range shared-memory access inside tl.dot (compute-sanitizer), with every tile
    config; equal widths passed the whole conformance run there. Dv ≠ D then costs zero columns in the P·V product."""
    return max(16, next_power_of_2(max(head_dim, head_dim_v)))


def kernel_constants(
    kernel: Kernel,
    head_dim: int,
    head_dim_v: int,
    dtype: torch.dtype,
    switches: KernelSwitches | None = None,
    tensor_descriptors: bool = False,
    interpreted: bool = INTERPRETED,
) -> dict[str, Any]:
    """The constexprs of one kernel, tiles aside. ``grad_float32`` has none: the kernels store through pointers
    typed by the gradient buffers. ``tensor_descriptors``: the kernel reads its DESCRIBED operands through the
    descriptors passed after its other arguments (:func:`descriptors`). ``interpreted``: whether the interpreter
    executes the kernel, whatever the plan's target (INTERPRETER_BF16 and COMPILED follow it)."""
    switches = switches or KernelSwitches()
    block = padded_head_dim(head_dim, head_dim_v)
    if kernel is Kernel.DELTA:
        return dict(HEAD_DIM_V=head_dim_v, BLOCK_DV=block, HAS_DLSE=switches.has_dlse)
    constants = dict(
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_D=block,
        BLOCK_DV=block,
        HAS_LOWER=switches.has_lower,
        HAS_UPPER=switches.has_upper,
        BOTTOM_RIGHT=switches.bottom_right,
        HAS_MASK=switches.has_mask,
        HAS_BIAS=switches.has_bias,
        HAS_SOFTCAP=switches.has_softcap,
        COSINE=switches.cosine,
        HAS_Q_LENGTHS=switches.has_q_lengths,
        HAS_KV_LENGTHS=switches.has_kv_lengths,
        HAS_SEGMENT_IDS=switches.has_segment_ids,
        HAS_ALIBI=switches.has_alibi,
        HAS_DROPOUT=switches.has_dropout,
        SEGMENT_GRANULE=SEGMENT_GRANULE,  # every tile above is a multiple of it
        # The one switch for the interpreter's bfloat16 bugs (kernels._dot, kernels._rounded).
        INTERPRETER_BF16=interpreted and dtype == torch.bfloat16,
        # float32 operands multiply in IEEE float32, not TF32: TF32's 10-bit mantissa would miss the tolerance
        # rule for float32 (docs/testing.md) by three orders of magnitude.
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )
    # MASK_PROGRAM: the program's helper (programs.helper), set per call by TritonLauncher.run.
    constants.update(TMA=tensor_descriptors, HAS_PROGRAM=switches.has_mask_program, MASK_PROGRAM=None)
    if kernel is Kernel.FORWARD:
        # COMPILED: the epilogue's inline assembly, which the interpreter cannot run (kernels._epilogue_rows).
        constants.update(PAGED=switches.paged, SPLIT_K=switches.split_k, COMPILED=not interpreted)
    if kernel is Kernel.DKDV:
        constants.update(HAS_DBIAS=switches.has_dbias, ATOMIC_DQ=switches.atomic_dq)
    return constants


class Described(NamedTuple):
    """The two operands a kernel may read through tensor descriptors, by their places in its arguments; whether
    its tiles of them run along the keys (BLOCK_N rows) or the queries (BLOCK_M); and the least padded head dim
    at which they pay (the static check: dK/dV at D = 64 read 8.8 -> 9.5 instructions per score with them)."""

    places: tuple[int, int]
    along_keys: bool
    least_block_d: int


#: K and V in the forward and dQ, q and dO in dK/dV.
DESCRIBED = {
    Kernel.FORWARD: Described((1, 2), True, 16),
    Kernel.DQ: Described((1, 2), True, 16),
    Kernel.DKDV: Described((0, 3), False, 128),
}


def descriptors_serve(kernel: Kernel, switches: KernelSwitches) -> bool:
    """Whether tensor descriptors can serve a kernel's tiles: their zero fill past the sequence must be exactly the
    positions out of play (no per-batch lengths or segment ids on that side, no block table)."""
    if kernel not in DESCRIBED or switches.paged or switches.has_segment_ids:
        return False
    return not (switches.has_q_lengths if kernel is Kernel.DKDV else switches.has_kv_lengths)


def descriptors_pay(kernel: Kernel, switches: KernelSwitches, dtype: torch.dtype, arch: str, block_d: int) -> bool:
    """Whether a compiled kernel takes them: on Hopper (TMA copies, no address arithmetic in the loop), in half
    precision, where they serve and the kernel stays lean by the static check (the cosine variant spills with
    them; DESCRIBED's least head dim). False for a kernel DESCRIBED does not list (Δ)."""
    return (
        descriptors_serve(kernel, switches)  # first: it excludes the kernels DESCRIBED does not list
        and arch == "sm_90"
        and dtype != torch.float32
        and not switches.cosine
        and block_d >= DESCRIBED[kernel].least_block_d
    )


def describable(x: torch.Tensor) -> bool:
    """Whether a tensor can back a tensor descriptor: a unit last stride, 16-byte aligned rows and strides."""
    return x.stride(-1) == 1 and rows_on_16_bytes(x)


def uses_descriptors(
    kernel: Kernel, call: KernelCall, args: list[Any], switches: KernelSwitches, target: Target
) -> bool:
    """Whether a kernel reads its DESCRIBED operands through tensor descriptors: where they pay when compiled,
    wherever they serve in the interpreter's plan (the same kernel code, tested on CPU), and only for operands whose
    rows and strides are 16-byte aligned, as a descriptor requires."""
    if target.compiled:
        assert target.arch is not None  # Target checks it
        block_d = padded_head_dim(*call.head_dims)
        wanted = descriptors_pay(kernel, switches, call.q.dtype, target.arch, block_d)
    else:
        wanted = descriptors_serve(kernel, switches)
    return wanted and all(describable(args[place]) for place in DESCRIBED[kernel].places)


def warp_specialization_serves(
    kernel: Kernel,
    call: KernelCall,
    args: list[Any],
    switches: KernelSwitches,
    described: bool,
    config: TileConfig,
    target: Target,
) -> bool:
    """Whether the forward or dQ can run its key loop warp-specialised at ``config``'s tile (the kernels'
    WARP_SPECIALIZE): every tile interior (none of _EDGE_SWITCHES, both lengths whole tiles), since Triton's pass
    takes one loop and the edge loops are compiled out; K and V through descriptors, and the query side fit for the
    descriptors the kernel makes (q; in dQ dO too, and the lse and Δ rows, contiguous float32 whose rows start on 16
    bytes when Lq is whole tiles). Compiled, only at the padded head dims found lean (64 and 128: docs/performance.md;
    the static test compiles 128)."""
    if kernel not in WARP_SPECIALIZED_KERNELS or not described:
        return False
    if any(getattr(switches, name) for name in _EDGE_SWITCHES):
        return False
    _, _, len_q, len_k = call.geometry
    head_dims_checked = not target.compiled or padded_head_dim(*call.head_dims) in (64, 128)
    whole_tiles = len_q % config.block_m == 0 and len_k % config.block_n == 0
    rows = [args[0]] if kernel is Kernel.FORWARD else [args[0], args[3]]  # q; q and dO
    rows_statistics = [] if kernel is Kernel.FORWARD else [args[4], args[5]]  # lse and Δ
    return (
        head_dims_checked
        and whole_tiles
        and all(describable(x) for x in rows)
        and all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in rows_statistics)
    )


def program_arguments(call: KernelCall, config: TileConfig) -> tuple[Any, ...]:
    """The kernels' mask-program arguments after their others: the tile classes at ``config``'s tiles (uint8, stride
    0 on a batch or head axis of size 1) with their strides, the captured tensors and their layout
    (programs.arguments); without a program, None (never read)."""
    if call.program is None:
        return None, None, None, None
    batch, heads_q, len_q, _, len_k = call.shape
    classes = cached_tile_classes(call.program, batch, heads_q, len_q, len_k, config.block_m, config.block_n, call.q)
    strides = [stride if size > 1 else 0 for size, stride in zip(classes.shape, classes.stride())]
    captured, layout = programs.arguments(call.program, call.q.device)
    return classes, tuple(strides), captured, layout


def dropout_arguments(dropout: Dropout | None, device: torch.device) -> tuple[Any, ...]:
    """The kernels' dropout arguments after the mask program's: the seed as a 0-d int64 tensor on ``device``, which
    the kernels read (no host read of its value: a CUDA graph replays whatever it holds then), the threshold's 32 bits
    as an int32 (one kernel signature for every p), the scale 1 / (1 − p) rounded to float32 and the offsets
    (head_start, query_start, key_start) of §18's indices; without dropout, None (never read)."""
    if dropout is None:
        return None, None, None, None
    seed = torch.as_tensor(dropout.seed, dtype=torch.int64).to(device).reshape(())
    threshold = dropout.threshold - (1 << 32) if dropout.threshold >= 1 << 31 else dropout.threshold
    offsets = tuple(int(offset) for offset in (dropout.head_start, dropout.query_start, dropout.key_start))
    return seed, threshold, dropout.scale(False), offsets


def tile_constants(kernel: Kernel, config: TileConfig) -> dict[str, Any]:
    """The constexprs a tile sets: its sizes and, in the forward and dQ, whether the key loop is warp-specialised."""
    constants: dict[str, Any] = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n)
    if kernel in WARP_SPECIALIZED_KERNELS:
        constants.update(WARP_SPECIALIZE=config.warp_specialize)
    return constants


def _ensure_allocator() -> None:
    """A descriptor made inside a kernel (the warp-specialised kernels' query side) needs global scratch memory, which
    Triton asks of the allocator set by ``triton.set_allocator``: set one from torch where the program set none."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def descriptors(kernel: Kernel, args: list[Any], config: TileConfig, block_d: int) -> tuple[TensorDescriptor, ...]:
    """A kernel's DESCRIBED (B, H, L, D) operands as descriptors of (1, 1, rows, block_d) tiles: a tile reaching
    past L or D reads zeros there, and never the next head's rows."""
    described = DESCRIBED[kernel]
    rows = config.block_n if described.along_keys else config.block_m
    return tuple(
        TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, block_d])
        for x in (args[place] for place in described.places)
    )


#: Each kernel's arguments that a launch adds into rather than overwrites (by parameter name in kernels.py), with the
#: switch under which it does: two launches add twice, so the autotuner restores them between its timed launches.
ACCUMULATED: dict[Kernel, tuple[tuple[str, str], ...]] = {Kernel.DKDV: (("DQSum", "atomic_dq"),)}


def accumulated_arguments(kernel: Kernel, args: list[Any], switches: KernelSwitches) -> list[torch.Tensor]:
    """The tensors among ``args`` that ``kernel``'s launch under ``switches`` accumulates into (ACCUMULATED)."""
    names = FUNCTIONS[kernel].arg_names
    return [args[names.index(name)] for name, switch in ACCUMULATED.get(kernel, ()) if getattr(switches, switch)]


#: Times a launch (a callable of no arguments), in any unit: triton.testing.do_bench's milliseconds by default.
Timer = Callable[[Callable[[], None]], float]

#: The tile records live in this subdirectory of auto's records directory (attnkit/records.py: ATTNKIT_AUTOTUNE_DIR,
#: else ~/.cache/attnkit/autotune), at most TILE_RECORDS_LIMIT of them, the least recently written pruned first.
TILE_RECORDS_SUBDIRECTORY = "triton-tiles"
TILE_RECORDS_LIMIT = 512
TILE_RECORD_VERSION = 1


@functools.cache
def kernel_digest() -> str:
    """A digest of the kernels' source and of this module's (tile tables, constexprs): a changed kernel tunes anew."""
    hashed = hashlib.sha256()
    for source in (kernels.__file__, __file__):
        hashed.update(Path(source).read_bytes())
    return hashed.hexdigest()[:16]


@functools.cache
def _gpu_identity(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} sm_{major}{minor}"


def gpu_identity(device: torch.device) -> str:
    """The GPU a tile was timed on, for its record's key: the model's name and compute capability."""
    return _gpu_identity(device.index if device.index is not None else torch.cuda.current_device())


def tile_from_record(data: Any, key: str, configs: tuple[TileConfig, ...]) -> TileConfig | None:
    """The tile a record names, if the record is whole, of this version and key, and names one of ``configs`` (a
    record can choose among today's candidates, never put another tile in their place); else None."""
    try:
        if data["version"] != TILE_RECORD_VERSION or data["key"] != key:
            return None
        tile = TileConfig(**data["config"])
    except (KeyError, TypeError, ValueError):
        return None
    return tile if tile in configs else None


class TileRecords:
    """The autotuner's choices kept across processes (docs/triton.md, "Autotune records"), one JSON file per lasting
    key (Autotuner.choose), through the door's RecordDirectory: atomic writes, a bounded count, and read only from a
    directory and files the current user alone can write. ``enabled``: read per miss; the config's ``autotune`` key
    (ATTNKIT_AUTOTUNE) by default, so the switch that turns auto's records off turns these off too."""

    def __init__(
        self,
        directory: Callable[[], Path] | None = None,
        limit: int = TILE_RECORDS_LIMIT,
        enabled: Callable[[], bool] = lasting_records,
    ) -> None:
        self.files = RecordDirectory(
            "triton tile record", directory or (lambda: default_directory() / TILE_RECORDS_SUBDIRECTORY)
        )
        self.limit = limit
        self.enabled = enabled
        self._refused: set[str] = set()  # refusals already logged

    def _refusal(self, error: RecordsRefusedError) -> None:
        if str(error) not in self._refused:
            self._refused.add(str(error))
            _log.warning("attnkit: %s; triton tiles are autotuned in this process only", error)

    def load(self, key: str, configs: tuple[TileConfig, ...]) -> TileConfig | None:
        """The recorded tile of ``key`` among ``configs``, or None (no record, or one not to be used)."""
        try:
            data = self.files.read(key)
        except RecordsRefusedError as error:
            self._refusal(error)
            return None
        return tile_from_record(data, key, configs)

    def save(self, key: str, described: str, best: TileConfig, timings: Sequence[tuple[float, TileConfig]]) -> None:
        """Record ``best`` for ``key``; ``described``: the autotuner's key in words, for a reader of the file."""
        record = {
            "version": TILE_RECORD_VERSION,
            "key": key,
            "described": described,
            "config": asdict(best),
            "timings": [[repr(config), time] for time, config in timings],
            "measured_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        }
        try:
            self.files.write(key, record, self.limit)
        except RecordsRefusedError as error:
            self._refusal(error)
        except OSError as error:
            _log.info("attnkit: writing the triton tile record %s failed: %s", key, error)


class Autotuner:
    """Picks the fastest of a few configurations per key on the first compiled call, then reuses it; with a lasting
    key, a choice recorded by an earlier process (:class:`TileRecords`) is taken without timing, and a new one is
    recorded. ``timer``: triton.testing.do_bench (read at each call) unless given; tests give one that needs no GPU."""

    def __init__(self, timer: Timer | None = None, records: TileRecords | None = None) -> None:
        self.timer = timer
        self.records = records if records is not None else TileRecords()
        self._best: dict[tuple, TileConfig] = {}
        self._lock = threading.Lock()

    def choose(
        self,
        key: tuple,
        configs: tuple[TileConfig, ...],
        launch: Callable[[TileConfig], None],
        restore: Sequence[torch.Tensor] = (),
        lasting_key: Callable[[], str] | None = None,
    ) -> TileConfig:
        """The best of ``configs`` for ``key``, timing each by running ``launch`` on the live arguments the first
        time. ``restore``: the tensors a launch adds into (accumulated_arguments). The timer runs a launch many times,
        so each timed launch starts from their values on entry, and they hold those values again on return: the
        caller's one launch then adds into them once (as Triton's own autotuner's restore_value). ``lasting_key``:
        the key of the choice across processes (made only on a miss in the process: it hashes the GPU and versions)."""
        with self._lock:
            if key in self._best:
                return self._best[key]
        records = self.records if lasting_key is not None and self.records.enabled() else None
        lasting = lasting_key() if records is not None and lasting_key is not None else ""
        if records is not None:
            recorded = records.load(lasting, configs)
            if recorded is not None:
                with self._lock:
                    self._best[key] = recorded
                return recorded
        timer = self.timer or triton.testing.do_bench
        saved = [x.clone() for x in restore]

        def timed(config: TileConfig) -> None:
            for x, value in zip(restore, saved):
                x.copy_(value)
            launch(config)

        timings = []
        try:
            for config in configs:
                try:
                    timings.append((timer(functools.partial(timed, config)), config))
                except triton.runtime.errors.OutOfResources:
                    continue
        finally:
            for x, value in zip(restore, saved):
                x.copy_(value)
        best = min(timings, key=lambda item: item[0])[1] if timings else configs[0]
        if records is not None and timings:
            records.save(lasting, repr(key), best, timings)
        with self._lock:
            self._best[key] = best
        return best


_autotuner = Autotuner()


class KernelExecutor:
    """Runs a planned launch of one of FUNCTIONS. ``interpreted``: whether Triton's interpreter runs it, which decides
    what follows execution rather than the plan (kernel_constants' INTERPRETER_BF16 and COMPILED; the allocator that
    compiled in-kernel descriptors need)."""

    interpreted = INTERPRETED

    def launch(
        self,
        kernel: Kernel | str,
        grid: tuple[int, int, int],
        args: list[Any],
        constants: dict[str, Any],
        options: dict[str, int],
    ) -> None:
        """``kernel``: one of FUNCTIONS' keys; ``args``: the positional arguments (descriptors included); ``constants``:
        the constexprs; ``options``: num_warps and num_stages (none: Triton's defaults)."""
        FUNCTIONS[kernel][grid](*args, **constants, **options)


#: The Triton versions (major, minor) on which WARP_SPECIALIZED is known to compile as intended for sm_90 (three
#: warpgroups, setmaxnreg, no copy in the consumers' loop, no spills, a leaner loop than the default tile's): 3.9 by
#: tests/test_triton_static.py, 3.6 by the same compile with Triton 3.6.0 (docs/triton.md). Not offered on others.
WARP_SPECIALIZATION_CHECKED = ((3, 6), (3, 9))


def warp_specialization_checked(version: str) -> bool:
    """Whether a Triton version (``triton.__version__``) is one of WARP_SPECIALIZATION_CHECKED."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return match is not None and (int(match[1]), int(match[2])) in WARP_SPECIALIZATION_CHECKED


class TritonLauncher:
    """Plans each kernel's launch for a :class:`Target` and has a :class:`KernelExecutor` run it: the interpreter's
    tiles, or compiled with an autotuned configuration (the Δ kernel, a row sum, with DELTA_BLOCK_M rows and Triton's
    default warps and stages)."""

    # Triton types Python scalars itself: an int as i32 (i64 when it does not fit), a float as fp32.
    types = ArgumentTypes(int32=int, int64=int, float32=float)
    bias_dtype: torch.dtype | None = None  # the kernels read the bias in its own dtype

    def __init__(
        self,
        offers_warp_specialized: bool = False,
        *,
        target: Target | None = None,
        executor: KernelExecutor | None = None,
        autotuner: Autotuner | None = None,
        triton_version: str = triton.__version__,
        device_identity: Callable[[torch.device], str] = gpu_identity,
    ) -> None:
        # Compiled, whether the autotuner also times WARP_SPECIALIZED where it serves (the triton backend's
        # warp_specialize option), on the Triton versions where it compiles as intended. The interpreter runs that
        # code wherever it serves, so the CPU tests cover it.
        self.offers_warp_specialized = offers_warp_specialized and warp_specialization_checked(triton_version)
        self.target = target  # None: the process's own, per call (target_of)
        self.executor = executor or KernelExecutor()
        self.autotuner = autotuner or _autotuner
        self.triton_version = triton_version
        self.device_identity = device_identity  # the GPU in a tile record's key; tests name a fake one

    def lasting_key(self, key: tuple, device: torch.device) -> str:
        """The key of an autotuned choice across processes: the autotuner's key (kernel, candidates, dtype, arch,
        switches, length bucket) and everything that invalidates a timing: the GPU model, the Triton, torch and
        attnkit versions, and the kernels' source."""
        parts = (repr(key), self.device_identity(device), f"triton {self.triton_version}", f"torch {torch.__version__}",
                 f"attnkit {attnkit_version()}", f"kernels {kernel_digest()}")  # fmt: skip
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]

    def target_for(self, call: KernelCall) -> Target:
        return self.target or target_of(call.q.device)

    def one_pass_backward(self, call: KernelCall) -> bool:
        """The one-pass backward (dq added atomically by the dK/dV kernel) where it compiles lean: head dims up to 128
        on Hopper, and in the interpreter's plan alike (unless deterministic results are asked for: KernelBackend.
        deterministic). On sm_80 Triton's float atomics cost a loop (75 instructions per score); at D = 256 the
        two-kernel tiles spill already. At D = 128 on sm_90 its 316 B of spills lie outside the interior loop, which
        reads 16.7 instructions per score against the two kernels' 9.6 + 13.6 (docs/performance.md)."""
        if padded_head_dim(*call.head_dims) > 128:
            return False
        target = self.target_for(call)
        return not target.compiled or target.arch == "sm_90"

    def candidates(
        self,
        kernel: Kernel,
        call: KernelCall,
        args: list[Any],
        switches: KernelSwitches,
        described: bool,
        target: Target,
    ) -> tuple[TileConfig, ...]:
        """A compiled kernel's tiles for the autotuner, the default first."""
        assert target.arch is not None  # compiled: Target checks it
        block_d = padded_head_dim(*call.head_dims)
        configs = gpu_configs(NAMES[kernel], block_d, call.q.dtype, target.arch, switches)
        if self.offers_warp_specialized and warp_specialization_serves(
            kernel, call, args, switches, described, WARP_SPECIALIZED, target
        ):
            configs = (*configs, WARP_SPECIALIZED)
        return configs

    def merge_splits(
        self,
        call: KernelCall,
        partial_out: torch.Tensor,
        partial_lse: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Split-K's combine as one launch (MERGE) into ``out`` (a bhsd view in q's dtype) and ``lse``, one program per
        query row, in place of the shared sequence's torch merge (contract.kernels.attention_forward calls it)."""
        splits, batch, heads_q, len_q, head_dim_v = partial_out.shape
        constants = dict(
            HEAD_DIM_V=head_dim_v,
            BLOCK_DV=padded_head_dim(*call.head_dims),  # the forward's width
            BLOCK_S=max(2, next_power_of_2(splits)),
            INTERPRETER_BF16=self.executor.interpreted and out.dtype == torch.bfloat16,
        )
        args = [partial_out, partial_lse, out, lse, partial_out.stride(0), partial_lse.stride(0), *out.stride()[:3],
                heads_q, len_q, splits]  # fmt: skip
        self.executor.launch(MERGE, (batch * heads_q * len_q, 1, 1), args, constants, {})

    def run(self, kernel: Kernel, call: KernelCall, grid: Grid, args: list[Any], switches: KernelSwitches) -> None:
        target = self.target_for(call)
        executor = self.executor
        if kernel is Kernel.DKDV and not switches.atomic_dq:  # no dq sum: any pointer and strides stand for it
            args = [*args, args[4], 0, 0, 0]
        described = uses_descriptors(kernel, call, args, switches, target)
        constants = kernel_constants(
            kernel, *call.head_dims, call.q.dtype, switches, described, interpreted=executor.interpreted
        )
        if kernel is Kernel.DELTA:
            rows = DELTA_BLOCK_M if target.compiled else INTERPRETER_CONFIG.block_m
            executor.launch(kernel, grid.blocks(rows, rows), args, {**constants, "BLOCK_M": rows}, {})
            return

        if call.program is not None:
            constants["MASK_PROGRAM"] = programs.helper(call.program.program)
        dropout = dropout_arguments(call.dropout, call.q.device)

        def launch(config: TileConfig) -> None:
            tiles = descriptors(kernel, args, config, constants["BLOCK_D"]) if described else (None, None)
            if config.warp_specialize and not executor.interpreted:
                _ensure_allocator()
            executor.launch(
                kernel,
                grid.blocks(config.block_m, config.block_n),
                [*args, *tiles, *program_arguments(call, config), *dropout],
                {**constants, **tile_constants(kernel, config)},
                dict(num_warps=config.num_warps, num_stages=config.num_stages),
            )

        if not target.compiled:  # the warp-specialised kernels' code wherever it serves, as descriptors (same tiles)
            specialized = replace(INTERPRETER_CONFIG, warp_specialize=True)
            serves = warp_specialization_serves(kernel, call, args, switches, described, specialized, target)
            launch(specialized if serves else INTERPRETER_CONFIG)
            return
        configs = self.candidates(kernel, call, args, switches, described, target)
        spec, (_, _, len_q, len_k) = call.spec, call.geometry
        key = (NAMES[kernel], configs, call.q.dtype, target.arch, spec.causal, spec.window is not None, switches.paged,
               switches.split_k, switches.has_dropout, length_bucket(max(len_q, len_k)))  # fmt: skip
        restore = accumulated_arguments(kernel, args, switches)
        lasting = functools.partial(self.lasting_key, key, call.q.device)
        launch(self.autotuner.choose(key, configs, launch, restore=restore, lasting_key=lasting))


LAUNCHER = TritonLauncher()
WARP_SPECIALIZING_LAUNCHER = TritonLauncher(offers_warp_specialized=True)
