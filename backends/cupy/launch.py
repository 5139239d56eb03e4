"""Launching the CUDA C kernels of ``kernels/attention.cu``: -D options, tiles, shared memory, NVRTC.

The arguments, grids and the backward sequence are the kernel backends' shared ones
(:mod:`attnkit.contract.kernels`); :class:`CudaKernels` turns each kernel of them into a launch: its tile, -D
options, block and dynamic shared-memory size. One :class:`Launcher` interface, two implementations:
:class:`CupyLauncher` compiles the source with NVRTC (``cupy.RawModule``) and launches on CUDA tensors; the CPU
emulation harness of the test tree (``tests/cupy_emulator``) compiles the same source with the host C++ compiler
and launches on CPU tensors. Both receive exactly what is computed here and in the shared module, so the emulator
exercises the real argument packing, grid computation and kernel source.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol, TypeAlias

import numpy as np
import torch

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

from . import programs

#: The kernel source: one file, compiled by NVRTC, nvcc and the emulator's host compiler alike.
SOURCE = Path(__file__).parent / "kernels" / "attention.cu"
KERNELS = tuple(Kernel)
ELEMENT_TYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int


def padded_head_dim(head_dim: int) -> int:
    """BLOCK_D / BLOCK_DV: the head dim padded to a multiple of 16, the tensor-core K."""
    return max(16, -(-head_dim // 16) * 16)


# GPU tiles per kernel, element size and padded-head-dim bucket. Every default fits sm_80's 163 KiB of shared memory
# per block (docs/performance.md has the table). The 2-byte forward tiles up to D = 128 are the register-resident
# forward's (16 rows per warp; S, P and O in registers): 64x128 at D <= 64, 64x64 at D <= 128 keep ptxas from
# spilling. The 2-byte backward tiles up to D = 128 serve the register-resident dQ (16 query rows per warp) and dK/dV
# (16 keys per warp; query tiles of 64 rows at D <= 64, 32 at D <= 128, where 64 spills); the other tiles (float32,
# D > 128) are the shared-memory kernels', sized by their shared-memory accumulators.
GPU_TILES: dict[str, dict[tuple[int, int], TileConfig]] = {
    "forward": {
        (2, 64): TileConfig(64, 128, 4),
        (2, 128): TileConfig(64, 64, 4),
        (2, 256): TileConfig(64, 32, 4),
        (4, 64): TileConfig(64, 64, 4),
        (4, 128): TileConfig(64, 32, 4),
        (4, 256): TileConfig(32, 32, 4),
    },
    "backward_dq": {
        (2, 64): TileConfig(64, 64, 4),
        (2, 128): TileConfig(64, 64, 4),
        (2, 256): TileConfig(32, 64, 4),
        (4, 64): TileConfig(64, 64, 4),
        (4, 128): TileConfig(64, 32, 4),
        (4, 256): TileConfig(16, 32, 4),
    },
    "backward_dkdv": {
        (2, 64): TileConfig(64, 64, 4),
        (2, 128): TileConfig(32, 64, 4),
        (2, 256): TileConfig(32, 32, 4),
        (4, 64): TileConfig(32, 64, 4),
        (4, 128): TileConfig(32, 32, 4),
        (4, 256): TileConfig(16, 16, 4),
    },
}
GPU_TILES["backward_delta"] = {key: TileConfig(64, 64, 4) for key in GPU_TILES["forward"]}
#: The emulator's tiles: 16 rows keep the conformance shapes (L <= 24) on two query tiles, so the skipping bounds run;
#: 32 keys, so the tile is not square (as GPU tiles often are not) and a bound that takes BLOCK_M for BLOCK_N is
#: wrong here too; two warps, so the tensor-core work is split between warps and every barrier matters.
EMULATOR_TILE = TileConfig(16, 32, 2)
#: The float16 / bfloat16 forward's and dQ's: two warps of 16 rows (their register-resident geometry), keys in tiles
#: of 16, so the conformance shapes run two key tiles through the cp.async pipeline, and the tile is not square the
#: other way. (float32 keeps EMULATOR_TILE: tests/test_tile_edges.py runs float32 on one tile for forward and dQ.
#: dK/dV keeps it in every dtype: two warps of 16 keys is its register-resident geometry.)
EMULATOR_FORWARD_TILE = TileConfig(32, 16, 2)

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def gpu_tile(kernel: str, head_dim: int, dtype: str) -> TileConfig:
    bucket = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    return GPU_TILES[kernel][(ELEMENT_BYTES[dtype], bucket)]


# Dynamic shared memory, region by region, in the order each kernel carves it (SharedCursor in attention.cu):
# (rows, columns, element) with rows/columns "M", "N", "2N" (two stages of N), "D", "DV" or 1, and element "elem"
# (the input dtype) or "float". Each region is rounded up to 128 bytes.
SHARED_REGIONS: dict[str, tuple[tuple[str, Any, str], ...]] = {
    "forward": (
        ("M", "D", "elem"),  # q tile
        ("N", "D", "elem"),  # k tile
        ("N", "DV", "elem"),  # v tile
        ("M", "N", "float"),  # scores
        ("M", "N", "elem"),  # P
        ("M", "DV", "float"),  # output accumulator
        ("M", 1, "float"),  # inverse q norms
        ("N", 1, "float"),  # inverse k norms
    ),
    # The register-resident bodies (-DREGISTER_FORWARD, _DQ, _DKDV): scores, probabilities and accumulators live in
    # registers; the streamed operand's tiles in two stages.
    "register_forward": (
        ("M", "D", "elem"),  # q tile
        ("2N", "D", "elem"),  # k tiles, two stages
        ("2N", "DV", "elem"),  # v tiles, two stages
    ),
    "register_backward_dq": (
        ("M", "D", "elem"),  # q tile
        ("M", "DV", "elem"),  # dO tile
        ("2N", "D", "elem"),  # k tiles, two stages
        ("2N", "DV", "elem"),  # v tiles, two stages
    ),
    "register_backward_dkdv": (
        ("N", "D", "elem"),  # k tile
        ("N", "DV", "elem"),  # v tile
        ("2M", "D", "elem"),  # q tiles, two stages
        ("2M", "DV", "elem"),  # dO tiles, two stages
        ("2M", 1, "float"),  # base-2 lse, two stages
        ("2M", 1, "float"),  # delta, two stages
    ),
    # With ATOMIC_DQ (the one-pass backward), after the register dK/dV's regions: the dUᵀ tile.
    "register_backward_dkdv_atomic_dq": (("N", "M", "elem"),),
    "backward_delta": (),
    "backward_dq": (
        ("M", "D", "elem"),
        ("M", "DV", "elem"),  # dO tile
        ("N", "D", "elem"),
        ("N", "DV", "elem"),
        ("M", "N", "float"),  # scores
        ("M", "N", "float"),  # dP
        ("M", "N", "elem"),  # dS
        ("M", "D", "float"),  # dq accumulator
        ("M", 1, "float"),  # lse
        ("M", 1, "float"),  # delta
        ("M", 1, "float"),
        ("N", 1, "float"),
    ),
    "backward_dkdv": (
        ("N", "D", "elem"),
        ("N", "DV", "elem"),
        ("N", "D", "float"),  # dk accumulator
        ("N", "DV", "float"),  # dv accumulator
        ("M", "D", "elem"),
        ("M", "DV", "elem"),
        ("M", "N", "float"),
        ("M", "N", "float"),
        ("M", "N", "elem"),  # P
        ("M", "N", "elem"),  # dS
        ("M", 1, "float"),
        ("M", 1, "float"),
        ("M", 1, "float"),
        ("N", 1, "float"),
    ),
}


#: Where the one-pass backward runs (CudaKernels.one_pass_backward): the register-resident dK/dV with atomic dq keeps
#: every value in registers up to this padded head dim and without these switches; at D = 128 (causal on sm_80, a
#: window on sm_90), with a bias and dbias (sm_80), with ALiBi beside every other switch (sm_90) and with dropout
#: (both) ptxas spills (docs/cupy.md, "The one-pass backward"). A mask program's registers depend on the program: the
#: two-pass backward.
ONE_PASS_MAX_HEAD_DIM = 64
ONE_PASS_EXCLUDED = ("cosine", "has_bias", "has_alibi", "has_mask_program", "has_dropout")

#: The kernels with a register-resident body (-DREGISTER_<KERNEL>); Δ has only its one-row-per-thread body.
REGISTER_KERNELS = (Kernel.FORWARD, Kernel.DQ, Kernel.DKDV)


def register_resident(kernel: str, dtype: str, head_dim: int, head_dim_v: int, switches: KernelSwitches) -> bool:
    """Whether a kernel compiles its register-resident body (-DREGISTER_<KERNEL>: mma.sync, ldmatrix, cp.async): a
    kernel of REGISTER_KERNELS in float16 / bfloat16, head dims in whole 16-byte chunks up to 128, no cosine variant.
    Other calls compile the shared-memory kernels. The launch also needs 16-byte aligned operands
    (:func:`aligned_for_async_copies`)."""
    return (
        kernel in REGISTER_KERNELS
        and dtype != "float32"
        and head_dim % 8 == 0
        and head_dim_v % 8 == 0
        and max(padded_head_dim(head_dim), padded_head_dim(head_dim_v)) <= 128
        and not switches.cosine
    )


def aligned_for_async_copies(*tensors: torch.Tensor) -> bool:
    """Whether every row of the tensors starts on 16 bytes (cp.async copies 16-byte chunks): the data pointer and
    every stride but the last (1)."""
    return all(rows_on_16_bytes(t) for t in tensors)


def shared_memory_bytes(
    kernel: str,
    tile: TileConfig,
    head_dim: int,
    head_dim_v: int,
    dtype: str,
    registers: bool = False,
    atomic_dq: bool = False,
) -> int:
    """Bytes of dynamic shared memory a kernel's launch asks for: of its register-resident body when registers, with
    the one-pass backward's dUᵀ tile when atomic_dq too."""
    sizes = {
        "M": tile.block_m,
        "N": tile.block_n,
        "2N": 2 * tile.block_n,
        "2M": 2 * tile.block_m,
        "D": padded_head_dim(head_dim),
        "DV": padded_head_dim(head_dim_v),
    }
    element = {"elem": ELEMENT_BYTES[dtype], "float": 4}
    total = 0
    regions = SHARED_REGIONS[f"register_{kernel}" if registers else kernel]
    if registers and atomic_dq:
        regions += SHARED_REGIONS[f"register_{kernel}_atomic_dq"]
    for rows, cols, kind in regions:
        count = sizes.get(rows, 1) * sizes.get(cols, 1)
        total += -(-count * element[kind] // 128) * 128
    return total


#: The switches each kernel reads; the others are compiled as 0, so kernels of one call share compiled modules.
_SWITCHES = frozenset(field.name for field in fields(KernelSwitches))
KERNEL_SWITCHES: dict[str, frozenset[str]] = {
    Kernel.FORWARD: _SWITCHES - {"has_dlse", "has_dbias", "grad_float32", "atomic_dq"},
    Kernel.DELTA: frozenset({"has_dlse"}),
    Kernel.DQ: _SWITCHES - {"has_dlse", "has_dbias", "paged", "split_k", "atomic_dq"},
    Kernel.DKDV: _SWITCHES - {"has_dlse", "paged", "split_k"},
}


def canonical_switches(kernel: str, dtype: str, switches: KernelSwitches) -> KernelSwitches:
    """The switches a kernel reads, the others off; GRAD_FLOAT32 is moot for float32 inputs, BOTTOM_RIGHT without
    a band or ALiBi."""
    kept = {name: value and name in KERNEL_SWITCHES[kernel] for name, value in switches.__dict__.items()}
    if dtype == "float32":
        kept["grad_float32"] = False
    if not (kept["has_lower"] or kept["has_upper"] or kept["has_alibi"]):  # the offset places the band and ALiBi
        kept["bottom_right"] = False
    return KernelSwitches(**kept)


def compile_options(
    dtype: str,
    head_dim: int,
    head_dim_v: int,
    tile: TileConfig,
    switches: KernelSwitches,
    register_kernel: str | None = None,
) -> tuple[str, ...]:
    """The -D options of one compiled variant: the same for NVRTC (CuPy), nvcc (the static check) and the
    emulator's host compiler. register_kernel: the kernel compiled with its register-resident body, if any."""
    values = {
        "ELEMENT_TYPE": ELEMENT_TYPES[dtype],
        "HEAD_DIM": head_dim,
        "HEAD_DIM_V": head_dim_v,
        "BLOCK_D": padded_head_dim(head_dim),
        "BLOCK_DV": padded_head_dim(head_dim_v),
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "NUM_WARPS": tile.num_warps,
        "SEGMENT_GRANULE": SEGMENT_GRANULE,  # every tile above is a multiple of it
        # The register-resident body of one kernel (register_resident); the others keep theirs.
        "REGISTER_FORWARD": int(register_kernel == Kernel.FORWARD),
        "REGISTER_DQ": int(register_kernel == Kernel.DQ),
        "REGISTER_DKDV": int(register_kernel == Kernel.DKDV),
        # The feature switches: each a -D option, so a call without a feature compiles without its code.
        **{field.name.upper(): int(getattr(switches, field.name)) for field in fields(KernelSwitches)},
    }
    return tuple(f"-D{name}={value}" for name, value in values.items())


#: A kernel argument: a tensor (its data pointer) or a typed scalar.
Argument: TypeAlias = torch.Tensor | np.int32 | np.uint32 | np.int64 | np.float32


class Launcher(Protocol):
    """Compiles attention.cu with a set of -D options (and a mask program's code spliced in: ``program``, the text of
    :func:`programs.program_code`, empty without one) and launches one of its kernels."""

    name: str
    device: str  # the torch device type of the tensors it takes: "cuda" or "cpu"

    def unavailable(self) -> list[str]:
        """Why it cannot launch here; empty when it can."""
        ...

    def tile(self, kernel: str, head_dim: int, dtype: str) -> TileConfig: ...

    def launch(
        self,
        kernel: str,
        options: tuple[str, ...],
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        args: list[Argument],
        program: str = "",
    ) -> None: ...


@functools.cache
def cuda_headers() -> Path | None:
    """A CUDA include folder that holds the whole header chain the kernels include (mma.h includes crt/mma.h).

    CuPy gives NVRTC the include folder of the CUDA runtime wheel, which lacks crt/ in CUDA 13 wheels (seen on an
    H100 machine: "cannot open source file crt/mma.h"), so a complete folder goes first on the include path:
    $CUDA_PATH, $CUDA_HOME, nvcc's toolkit, /usr/local/cuda, then the nvidia wheels' own folders."""
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    candidates = [Path(root) / "include" for root in (*roots, "/usr/local/cuda") if root]
    for package in ("nvidia.cu13", "nvidia.cuda_runtime", "nvidia.cuda_nvcc"):
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:
            spec = None
        locations = (spec.submodule_search_locations or []) if spec else []
        candidates += [Path(location) / "include" for location in locations]
    return next(
        (path for path in candidates if (path / "mma.h").is_file() and (path / "crt" / "mma.h").is_file()), None
    )


class CupyLauncher:
    """NVRTC through ``cupy.RawModule``, launched on torch's current CUDA stream; tensors go zero-copy
    through DLPack."""

    name = "cupy"
    device = "cuda"

    def __init__(self) -> None:
        self._modules: dict[tuple[tuple[str, ...], str], Any] = {}
        self._lock = threading.Lock()

    def unavailable(self) -> list[str]:
        if importlib.util.find_spec("cupy") is None:
            return ["cupy is not installed (pip install 'attnkit[cupy]': cupy-cuda12x or cupy-cuda13x)"]
        if not torch.cuda.is_available():
            return ["no CUDA device (torch.cuda.is_available() is False)"]
        try:
            import cupy

            cupy.cuda.runtime.getDeviceCount()
        except Exception as error:  # a driver/toolkit mismatch, no device visible to CuPy
            return [f"cupy cannot use the CUDA device: {error}"]
        if cuda_headers() is None:
            return ["no CUDA include folder with mma.h and crt/mma.h for NVRTC (set CUDA_PATH to a CUDA toolkit)"]
        return []

    def tile(self, kernel: str, head_dim: int, dtype: str) -> TileConfig:
        return gpu_tile(kernel, head_dim, dtype)

    def _module(self, options: tuple[str, ...], program: str) -> Any:
        import cupy

        key = (options, program)  # the program's code: once per program, whatever its captured values and shapes
        with self._lock:
            if key not in self._modules:
                include = f"-I{cuda_headers()}"
                self._modules[key] = cupy.RawModule(
                    code=programs.splice(SOURCE.read_text(), program), options=("-std=c++17", include, *options)
                )
            return self._modules[key]

    def launch(
        self,
        kernel: str,
        options: tuple[str, ...],
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        args: list[Argument],
        program: str = "",
    ) -> None:
        import cupy

        function = self._module(options, program).get_function(f"attention_{kernel}")
        if shared_bytes > 48 * 1024:
            function.max_dynamic_shared_size_bytes = shared_bytes
        tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cuda", torch.cuda.current_device())
        converted = [_to_cupy(cupy, arg) if isinstance(arg, torch.Tensor) else arg for arg in args]
        with cupy.cuda.Device(device.index or 0):
            with cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
                function(grid, block, tuple(converted), shared_mem=shared_bytes)


def _to_cupy(cupy: Any, tensor: torch.Tensor) -> Any:
    """A CuPy view of a torch CUDA tensor (DLPack, no copy); bfloat16 and bool as same-size integers (the kernel
    sees a pointer). Detached first: torch exports no tensor that requires grad."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    elif tensor.dtype == torch.bool:
        tensor = tensor.view(torch.uint8)
    return cupy.from_dlpack(tensor)


class CudaKernels:
    """The shared kernel sequence's launcher for attention.cu: per kernel its tile (from the :class:`Launcher`),
    canonical switches, -D options and shared memory, then the launch."""

    # The kernels take int32 sizes, int64 strides and float32 scales; the bias as float32.
    types = ArgumentTypes(int32=np.int32, int64=np.int64, float32=np.float32)
    bias_dtype: torch.dtype | None = torch.float32

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher

    def one_pass_backward(self, call: KernelCall) -> bool:
        """The one-pass backward (the dK/dV kernel adds dU K into a float32 dq sum atomically, no dQ kernel) where
        dK/dV runs its register-resident body and compiles lean with the atomics: head dims up to
        ONE_PASS_MAX_HEAD_DIM, none of ONE_PASS_EXCLUDED, q, k and v on 16-byte rows; on every arch and in the
        emulator alike. Asked only when deterministic results are not (KernelBackend.deterministic). Should dout's
        rows be off 16 bytes, the shared-memory dK/dV body adds the same sum."""
        head_dim, head_dim_v = call.head_dims
        dtype = str(call.q.dtype).removeprefix("torch.")
        return (
            register_resident(Kernel.DKDV, dtype, head_dim, head_dim_v, call.switches)
            and max(padded_head_dim(head_dim), padded_head_dim(head_dim_v)) <= ONE_PASS_MAX_HEAD_DIM
            and not any(getattr(call.switches, name) for name in ONE_PASS_EXCLUDED)
            and aligned_for_async_copies(call.q, call.k, call.v)
        )

    def run(self, kernel: Kernel, call: KernelCall, grid: Grid, args: list[Any], switches: KernelSwitches) -> None:
        head_dim, head_dim_v = call.head_dims
        dtype = str(call.q.dtype).removeprefix("torch.")
        tile = self.launcher.tile(kernel, max(head_dim, head_dim_v), dtype)
        switches = canonical_switches(kernel, dtype, switches)
        # The operands cp.async copies (q, k, v and, in the backward, dout) are among the input-dtype tensors.
        operands = [arg for arg in args if isinstance(arg, torch.Tensor) and arg.dtype == call.q.dtype]
        registers = register_resident(kernel, dtype, head_dim, head_dim_v, switches) and aligned_for_async_copies(
            *operands
        )
        options = compile_options(dtype, head_dim, head_dim_v, tile, switches, kernel if registers else None)
        shared = shared_memory_bytes(kernel, tile, head_dim, head_dim_v, dtype, registers, switches.atomic_dq)
        blocks = grid.blocks(tile.block_m, tile.block_n)
        code = ""
        if switches.has_dropout:
            args = [*args, *self.dropout_arguments(call)]
        if switches.has_mask_program:
            args = [*args, *self.program_arguments(call, tile)]
            code = programs.program_code(call.program.program)
        self.launcher.launch(kernel, options, blocks, (tile.num_warps * 32, 1, 1), shared, args, code)

    def dropout_arguments(self, call: KernelCall) -> list[Any]:
        """DROPOUT_PARAMETERS of attention.cu: the seed as a pointer to its 0-d int64 tensor on the kernels' device
        (the kernel reads its words: no host read of a device seed, so no synchronisation), the threshold as uint32,
        the scale as float32, then the query-head, query and key offsets."""
        dropout = call.dropout
        int32 = self.types.int32
        return [
            dropout.seed.to(call.q.device),
            np.uint32(dropout.threshold),
            self.types.float32(dropout.scale(False)),
            *(int32(int(offset)) for offset in (dropout.head_start, dropout.query_start, dropout.key_start)),
        ]

    def program_arguments(self, call: KernelCall, tile: TileConfig) -> list[Any]:
        """PROGRAM_PARAMETERS of attention.cu: the program's tile classes at this kernel's tile (cached per program,
        captured tensors and shapes), their batch, head and query-tile strides (0 on a size-1 axis), then each
        captured int32 tensor and its sizes."""
        batch, heads_q, len_q, _, len_k = call.shape
        classes = cached_tile_classes(call.program, batch, heads_q, len_q, len_k, tile.block_m, tile.block_n, call.q)
        classes = classes.contiguous()
        int32, int64 = self.types.int32, self.types.int64
        strides = [int64(stride if size > 1 else 0) for size, stride in zip(classes.shape[:3], classes.stride()[:3])]
        arguments: list[Any] = [classes, *strides]
        for tensor in call.captured:
            arguments += [tensor, *map(int32, tensor.shape)]
        return arguments
