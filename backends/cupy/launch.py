"""Launching the CUDA C kernels of ``kernels/attention.cu``: -D options, tiles, shared memory, grids, arguments.

One launcher interface, two implementations: :class:`CupyLauncher` compiles the source with NVRTC
(``cupy.RawModule``) and launches on CUDA tensors; the CPU emulation harness of the test tree
(``tests/cupy_emulator``) compiles the same source with the host C++ compiler and launches on CPU tensors. Both
receive exactly what this module computes (the -D options, grid, block, dynamic shared-memory size and the
packed argument list), so the emulator exercises the real argument packing, grid computation and kernel source.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from attnkit.backend import AttentionInputs, AttentionSpec, CausalAlignment, Variant
from attnkit.contract.kernels import bhsd

#: The kernel source: one file, compiled by NVRTC, nvcc and the emulator's host compiler alike.
SOURCE = Path(__file__).parent / "kernels" / "attention.cu"
KERNELS = ("forward", "backward_delta", "backward_dq", "backward_dkdv")
ELEMENT_TYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int


@dataclass(frozen=True)
class Features:
    """The feature switches: each a -D option, so a call without a feature compiles without its code."""

    has_lower: bool = False
    has_upper: bool = False
    bottom_right: bool = False
    has_mask: bool = False
    has_bias: bool = False
    has_softcap: bool = False
    cosine: bool = False
    has_q_lengths: bool = False
    has_kv_lengths: bool = False
    has_dlse: bool = False
    has_dbias: bool = False
    grad_float32: bool = False  # dq, dk, dv stored in float32 (the cosine variant's chain rule follows)

    @classmethod
    def all(cls) -> Features:
        return cls(**{field.name: True for field in fields(cls)})


def padded_head_dim(head_dim: int) -> int:
    """BLOCK_D / BLOCK_DV: the head dim padded to a multiple of 16, the tensor-core K."""
    return max(16, -(-head_dim // 16) * 16)


# GPU tiles per kernel, element size and padded-head-dim bucket. Accumulators live in shared memory, so tiles are
# sized by shared memory: every default fits sm_80's 163 KiB per block (docs/performance.md has the table).
GPU_TILES: dict[str, dict[tuple[int, int], TileConfig]] = {
    "forward": {
        (2, 64): TileConfig(64, 64, 4),
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

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def gpu_tile(kernel: str, head_dim: int, dtype: str) -> TileConfig:
    bucket = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    return GPU_TILES[kernel][(ELEMENT_BYTES[dtype], bucket)]


# Dynamic shared memory, region by region, in the order each kernel carves it (SharedCursor in attention.cu):
# (rows, columns, element) with rows/columns "M", "N", "D", "DV" or 1, and element "elem" (the input dtype) or
# "float". Each region is rounded up to 128 bytes.
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


def shared_memory_bytes(kernel: str, tile: TileConfig, head_dim: int, head_dim_v: int, dtype: str) -> int:
    sizes = {"M": tile.block_m, "N": tile.block_n, "D": padded_head_dim(head_dim), "DV": padded_head_dim(head_dim_v)}
    element = {"elem": ELEMENT_BYTES[dtype], "float": 4}
    total = 0
    for rows, cols, kind in SHARED_REGIONS[kernel]:
        count = sizes.get(rows, 1) * sizes.get(cols, 1)
        total += -(-count * element[kind] // 128) * 128
    return total


#: The switches each kernel reads; the others are compiled as 0, so kernels of one call share compiled modules.
KERNEL_SWITCHES = {
    "forward": frozenset(field.name for field in fields(Features)) - {"has_dlse", "has_dbias", "grad_float32"},
    "backward_delta": frozenset({"has_dlse"}),
    "backward_dq": frozenset(field.name for field in fields(Features)) - {"has_dlse", "has_dbias"},
    "backward_dkdv": frozenset(field.name for field in fields(Features)) - {"has_dlse"},
}


def canonical_features(kernel: str, dtype: str, features: Features) -> Features:
    """The switches a kernel reads, the others off; GRAD_FLOAT32 is moot for float32 inputs, BOTTOM_RIGHT without
    a band."""
    kept = {name: value and name in KERNEL_SWITCHES[kernel] for name, value in features.__dict__.items()}
    if dtype == "float32":
        kept["grad_float32"] = False
    if not (kept["has_lower"] or kept["has_upper"]):  # the offset only places the band
        kept["bottom_right"] = False
    return Features(**kept)


def compile_options(
    dtype: str, head_dim: int, head_dim_v: int, tile: TileConfig, features: Features
) -> tuple[str, ...]:
    """The -D options of one compiled variant: the same for NVRTC (CuPy), nvcc (the static check) and the
    emulator's host compiler."""
    values = {
        "ELEMENT_TYPE": ELEMENT_TYPES[dtype],
        "HEAD_DIM": head_dim,
        "HEAD_DIM_V": head_dim_v,
        "BLOCK_D": padded_head_dim(head_dim),
        "BLOCK_DV": padded_head_dim(head_dim_v),
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "NUM_WARPS": tile.num_warps,
        **{field.name.upper(): int(getattr(features, field.name)) for field in fields(Features)},
    }
    return tuple(f"-D{name}={value}" for name, value in values.items())


#: A kernel argument: a tensor (its data pointer) or a typed scalar.
Argument = torch.Tensor | np.int32 | np.int64 | np.float32


class Launcher(Protocol):
    """Compiles attention.cu with a set of -D options and launches one of its kernels."""

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
        self._modules: dict[tuple[str, ...], Any] = {}
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

    def _module(self, options: tuple[str, ...]) -> Any:
        import cupy

        with self._lock:
            if options not in self._modules:
                include = f"-I{cuda_headers()}"
                self._modules[options] = cupy.RawModule(
                    code=SOURCE.read_text(), options=("-std=c++17", include, *options)
                )
            return self._modules[options]

    def launch(
        self,
        kernel: str,
        options: tuple[str, ...],
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        args: list[Argument],
    ) -> None:
        import cupy

        function = self._module(options).get_function(f"attention_{kernel}")
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


# ---------------------------------------------------------------------------------------------- calls


def _strides(x: torch.Tensor) -> list[Argument]:
    """Batch, head and sequence strides of a bhsd view (the head-dim stride is 1)."""
    return [np.int64(x.stride(0)), np.int64(x.stride(1)), np.int64(x.stride(2))]


def band(spec: AttentionSpec) -> tuple[int | None, int | None]:
    """(lower, upper) on rel = j − i − off (attention.cu): the window's left side gives lower = −left; causal and
    the window's right side give upper = min(0, right). None: unbounded."""
    left, right = spec.window or (None, None)
    uppers = [bound for bound in (0 if spec.causal else None, right) if bound is not None]
    return (-left if left is not None else None), (min(uppers) if uppers else None)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class _Call:
    """What every kernel of one call shares: bhsd operands, the optional tensors with their strides, scalars."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    optional: list[Argument]  # bias (float32), mask (uint8), q_lengths, kv_lengths (int32); q where absent
    feature_strides: list[Argument]  # bias then mask, (B, Hq, Lq, Lk) strides, 0 on broadcast axes
    geometry: list[Argument]  # heads_q, group, len_q, len_k
    qk_scale: np.float32
    softcap: np.float32
    scale: np.float32
    band: list[Argument]  # lower, upper (0 where unbounded: the switch is off)
    features: Features
    dtype: str

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        batch, heads_q, len_q, _ = self.q.shape
        return batch, heads_q, len_q, self.k.shape[1], self.k.shape[2]

    def options(self, launcher: Launcher, kernel: str, **switches: bool) -> tuple[TileConfig, tuple[str, ...]]:
        head_dim, head_dim_v = self.q.shape[3], self.v.shape[3]
        tile = launcher.tile(kernel, max(head_dim, head_dim_v), self.dtype)
        features = canonical_features(kernel, self.dtype, Features(**{**self.features.__dict__, **switches}))
        return tile, compile_options(self.dtype, head_dim, head_dim_v, tile, features)

    def run(
        self, launcher: Launcher, kernel: str, tiles: int, heads: int, args: list[Argument], **switches: bool
    ) -> None:
        tile, options = self.options(launcher, kernel, **switches)
        count = _cdiv(tiles, tile.block_n if kernel == "backward_dkdv" else tile.block_m)
        head_dim, head_dim_v = self.q.shape[3], self.v.shape[3]
        shared = shared_memory_bytes(kernel, tile, head_dim, head_dim_v, self.dtype)
        batch = self.q.shape[0]
        launcher.launch(kernel, options, (count, heads, batch), (tile.num_warps * 32, 1, 1), shared, args)


def _prepare(spec: AttentionSpec, inputs: AttentionInputs) -> _Call:
    q, k, v = bhsd(spec, inputs.q), bhsd(spec, inputs.k), bhsd(spec, inputs.v)
    batch, heads_q, len_q, head_dim = q.shape
    heads_kv, len_k = k.shape[1], k.shape[2]
    optional: list[Argument] = []
    feature_strides: list[Argument] = []
    for x in (inputs.bias, inputs.mask):  # broadcast by stride 0, never expanded in memory
        if x is not None:
            x = x.view(torch.uint8) if x.dtype == torch.bool else x.float()
            x = x.expand(batch, heads_q, len_q, len_k)
        optional.append(x if x is not None else q)
        feature_strides.extend(np.int64(s) for s in (x.stride() if x is not None else (0, 0, 0, 0)))
    for lengths in (inputs.q_lengths, inputs.kv_lengths):
        optional.append(lengths.to(device=q.device, dtype=torch.int32).contiguous() if lengths is not None else q)
    lower, upper = band(spec)
    scale = spec.resolved_scale(head_dim)
    features = Features(
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
        optional=optional,
        feature_strides=feature_strides,
        geometry=[np.int32(heads_q), np.int32(heads_q // heads_kv), np.int32(len_q), np.int32(len_k)],
        # The kernels multiply q kᵀ by qk_scale: scale / c when softcapped, so the product is the tanh argument.
        qk_scale=np.float32(scale / spec.softcap if spec.softcap is not None else scale),
        softcap=np.float32(spec.softcap or 1.0),
        scale=np.float32(scale),
        band=[np.int32(lower or 0), np.int32(upper or 0)],
        features=features,
        dtype=str(q.dtype).removeprefix("torch."),
    )


def attention_forward(
    launcher: Launcher, spec: AttentionSpec, inputs: AttentionInputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (spec layout, q's dtype) and lse (B, Hq, Lq) float32."""
    call = _prepare(spec, inputs)
    batch, heads_q, len_q, _, len_k = call.shape
    out = torch.empty((*inputs.q.shape[:3], inputs.v.shape[3]), dtype=inputs.q.dtype, device=inputs.q.device)
    lse = torch.empty((batch, heads_q, len_q), dtype=torch.float32, device=inputs.q.device)
    if out.numel() == 0 or len_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    out_view = bhsd(spec, out)
    args: list[Argument] = [
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
        *call.geometry,
        call.qk_scale,
        call.softcap,
        *call.band,
    ]
    call.run(launcher, "forward", len_q, heads_q, args)
    return out, lse


def attention_backward(
    launcher: Launcher,
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
    dbias = torch.zeros((batch, heads_q, len_q, len_k), dtype=torch.float32, device=dq.device) if need_dbias else None
    if dq.numel() == 0 or len_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dbias
    out_view, dout_view, lse = bhsd(spec, out), bhsd(spec, dout), lse.contiguous()
    delta = torch.empty_like(lse)
    delta_args: list[Argument] = [
        out_view,
        dout_view,
        dlse.contiguous() if dlse is not None else lse,
        delta,
        *_strides(out_view),
        *_strides(dout_view),
        np.int32(heads_q),
        np.int32(len_q),
    ]
    call.run(launcher, "backward_delta", len_q, heads_q, delta_args, has_dlse=dlse is not None)
    operand_strides = [*_strides(call.q), *_strides(call.k), *_strides(call.v), *_strides(dout_view)]
    scalars = [*call.geometry, call.qk_scale, call.softcap, call.scale, *call.band]
    dq_args: list[Argument] = [
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
    ]
    grad_float32 = (grad_dtype or call.q.dtype) == torch.float32
    call.run(launcher, "backward_dq", len_q, heads_q, dq_args, grad_float32=grad_float32)
    dkdv_args: list[Argument] = [
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
    ]
    call.run(launcher, "backward_dkdv", len_k, heads_kv, dkdv_args, has_dbias=need_dbias, grad_float32=grad_float32)
    return dq, dk, dv, dbias
