"""Static GPU check of the Triton kernels: compile them ahead of time for sm_80 and sm_90, read the cubins.

No GPU is needed. Every variant is compiled with ``triton.compile`` for ``GPUTarget("cuda", 80, 32)`` and
``GPUTarget("cuda", 90, 32)`` from the constexprs the launcher uses (``launch.kernel_constants``, the default tile
of ``launch.gpu_configs``), and its cubin is read with the ``cuobjdump`` bundled in the triton wheel:

* registers, stack frame and local memory per thread: ``cuobjdump --dump-resource-usage``. Register spills go to
  local memory, so ``STACK + LOCAL`` bytes is the spill footprint; the SASS's local stores and loads
  (``STL`` / ``LDL``) are counted as well, in bytes, and both must be 0 for a spill-free kernel;
* shared memory: Triton's dynamic shared memory (``metadata.shared``) plus the cubin's static ``SHARED``;
* tensor-core instructions in ``cuobjdump -sass``: ``HMMA`` (mma.sync, sm_80 and up) and ``HGMMA`` (wgmma,
  sm_90 only). float32 operands multiply in IEEE float32 (``DOT_PRECISION="ieee"``), on the FMA units.

Runtime arguments are typed as a launch would type them: tensors as 16-byte aligned pointers, the strides of
the dense operands divisible by 16 (true of every contiguous bhsd or bshd tensor with D a multiple of 16), every
other integer a plain ``i32`` (so ``group`` is not specialised to 1: the GQA case, whose head loop is not
unrolled), the scales ``fp32``.

    python -m attnkit.backends.triton.inspect                     # every variant, a text table
    python -m attnkit.backends.triton.inspect --markdown          # the table of docs/performance.md
    python -m attnkit.backends.triton.inspect --scope required --check --json out.json

``--check`` exits 1 when a requirement fails (:func:`violations`). The process must not have TRITON_INTERPRET=1
in its environment (Triton decides when the kernels are decorated whether they are interpreted); when it has,
:func:`main` runs itself again in a subprocess without it.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import triton

from attnkit.contract.kernel_checks import report_check, results_table, static_check_arguments
from attnkit.contract.kernels import Kernel, KernelSwitches
from attnkit.contract.sass import LoopMix, flops_per_score, loop_mix

from . import launch

ARCHS = {"sm_80": 80, "sm_90": 90}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = (64, 128, 256)
KERNELS = ("fwd", "delta", "dq", "dkdv")
#: Kernels with a tl.dot: the ones that must use tensor cores for float16 / bfloat16.
DOT_KERNELS = ("fwd", "dq", "dkdv")
#: Head dims whose default configurations must compile without spills (256 is reported, spills allowed).
NO_SPILL_HEAD_DIMS = (64, 128)
#: Feature variants that must compile without spills there: no feature, and the paged split-K decode forward.
NO_SPILL_FEATURES = ("plain", "paged-split", "warp-specialized")
#: The most threads' instructions per attention score each kernel's interior loop may take at D = 128 on sm_90
#: (attnkit.contract.sass): the tensor cores leave room for about 16 in the forward, 24 in dQ and 32 in dK/dV.
INSTRUCTIONS_PER_SCORE = {"fwd": 9.0, "dq": 20.0, "dkdv": 20.0}
#: The tensor-core instruction each arch must show in every float16 / bfloat16 dot-bearing kernel.
REQUIRED_TENSOR_CORE = {"sm_80": "HMMA", "sm_90": "HGMMA"}

#: Feature switches (``KernelSwitches`` fields), each on by itself, then all of attend's at once (a paged cache and
#: split-K are the forward's, of decode calls with kv_lengths alone: "paged-split" has them together). Inspected at
#: D = 128 bfloat16 on both archs.
FEATURES: dict[str, dict[str, bool]] = {
    "plain": {},
    "upper": {"has_upper": True},  # causal, or a window's right side
    "lower": {"has_lower": True},  # a window's left side
    "mask": {"has_mask": True},
    "bias": {"has_bias": True},
    "softcap": {"has_softcap": True},
    "lengths": {"has_q_lengths": True, "has_kv_lengths": True},
    "segments": {"has_segment_ids": True},
    "cosine": {"cosine": True},
    "alibi": {"has_alibi": True, "bottom_right": True},
    "dropout": {"has_dropout": True},
    "dbias": {"has_dbias": True},  # dkdv only
    "one-pass": {"atomic_dq": True},  # dkdv only: dq added atomically (the GPU default unless deterministic)
    "dlse": {"has_dlse": True},  # delta only
    # attend_paged's decode: keys through the block table, bottom-right causal over kv_lengths (fwd only)
    "paged": {"paged": True, "has_upper": True, "bottom_right": True, "has_kv_lengths": True},
    "split": {"split_k": True},  # fwd only: one key range per program, float32 partials
    # paged decode on a GPU: both
    "paged-split": {"paged": True, "split_k": True, "has_upper": True, "bottom_right": True, "has_kv_lengths": True},
    # no feature, every tile interior: the forward's and dQ's warp-specialised candidate (launch.WARP_SPECIALIZED)
    "warp-specialized": {},
    "all": {
        "has_lower": True,
        "has_upper": True,
        "bottom_right": True,
        "has_mask": True,
        "has_bias": True,
        "has_softcap": True,
        "has_q_lengths": True,
        "has_kv_lengths": True,
        "has_segment_ids": True,
        "cosine": True,
        "has_alibi": True,
        "has_dropout": True,
        "has_dbias": True,
        "has_dlse": True,
    },
}
FEATURE_HEAD_DIM, FEATURE_DTYPE = 128, "bf16"
#: Feature variants with a tile of their own, on the archs that have it.
FEATURE_TILES = {"warp-specialized": (launch.WARP_SPECIALIZED, ("sm_90",))}
#: The feature variants of ``--scope required``: attend's switches all at once, the paged decode and the
#: warp-specialised forward and dQ.
REQUIRED_FEATURES = ("all", "paged-split", "warp-specialized")
_SWITCHES_ALONE = ("upper", "lower", "mask", "bias", "softcap", "lengths", "segments", "cosine", "alibi", "dropout")
_FEATURES_OF = {
    "fwd": (*_SWITCHES_ALONE, "paged", "split", "paged-split", "warp-specialized", "all"),
    "dq": (*_SWITCHES_ALONE, "warp-specialized", "all"),
    "dkdv": (*_SWITCHES_ALONE, "dbias", "one-pass", "all"),
    "delta": ("dlse",),
}

KERNEL_OF = {name: kernel for kernel, name in launch.NAMES.items()}
_FLOAT_ARGS = ("qk_scale", "softcap", "grad_scale")
_FLOAT32_POINTERS = ("Lse", "Delta", "DLse", "DBias")
_SEGMENT_POINTERS = ("QSegmentIds", "KvSegmentIds", "QSegmentRanges", "KvSegmentRanges")
_DESCRIPTORS = ("KTiles", "VTiles", "QTiles", "DOutTiles")
#: A mask program's tensors, None without one (launch.program_arguments): the variants here have none.
_PROGRAM_ARGUMENTS = ("TileClasses", "class_strides", "Captured", "captured_layout")
#: Dropout's arguments (launch.dropout_arguments) and their types with it: the int64 seed tensor, the threshold's bits
#: as an int32, the float32 scale, the offsets; None without.
_DROPOUT_ARGUMENTS = {"Seed": "*i64", "dropout_threshold": "i32", "dropout_scale": "fp32",
                      "dropout_offsets": ("i32", "i32", "i32")}  # fmt: skip
_DENSE_STRIDE = re.compile(r"stride_(q|k|v|o|do|dq|dk|dv)[bhmn]$")
_FEATURE_STRIDE = re.compile(r"stride_(bias|mask)_([bhmn])$")
_TRITON_TYPE = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}


@dataclass(frozen=True)
class Variant:
    kernel: str  # fwd, delta, dq, dkdv
    arch: str  # sm_80, sm_90
    dtype: str  # fp16, bf16, fp32
    head_dim: int
    features: str = "plain"  # a key of FEATURES

    @property
    def has_dot(self) -> bool:
        return self.kernel in DOT_KERNELS


@dataclass(frozen=True)
class Result:
    variant: Variant
    config: str  # BLOCK_MxBLOCK_N, warps, stages
    registers: int
    stack_bytes: int  # per thread, cuobjdump --dump-resource-usage
    local_bytes: int
    spill_store_bytes: int  # STL in the SASS
    spill_load_bytes: int  # LDL in the SASS
    shared_bytes: int  # dynamic (Triton) + static
    hmma: int
    hgmma: int
    warps: int  # the program's, all warpgroups of a warp-specialised kernel included
    setmaxnreg: int  # USETMAXREG in the SASS: a warp-specialised kernel's register hand-over between warpgroups
    compile_s: float
    mix: LoopMix | None  # the main loop's instruction mix (attnkit.contract.sass); None without tensor cores

    @property
    def spill_bytes(self) -> int:
        """Every byte of local memory the kernel uses or touches: 0 for a spill-free kernel."""
        return self.stack_bytes + self.local_bytes + self.spill_store_bytes + self.spill_load_bytes

    @property
    def tensor_core(self) -> str:
        """The tensor-core instructions found, for the table."""
        found = [f"{name} {count}" for name, count in (("HGMMA", self.hgmma), ("HMMA", self.hmma)) if count]
        return ", ".join(found) or ("none" if self.variant.has_dot else "no dot")


def variants(scope: str = "full") -> list[Variant]:
    """``full``: every kernel × arch × dtype × head dim at the default tile, then the feature switches at D = 128
    bfloat16. ``required``: only what :func:`violations` checks (dot kernels, fp16/bf16, D = 64 and 128, and the
    REQUIRED_FEATURES: the feature switches all at once, and the paged split-K decode forward)."""
    if scope not in ("full", "required"):
        raise ValueError(f"scope must be 'full' or 'required', not {scope!r}")
    required = scope == "required"
    kernels_ = DOT_KERNELS if required else KERNELS
    dtypes = ("fp16", "bf16") if required else tuple(DTYPES)
    head_dims = NO_SPILL_HEAD_DIMS if required else HEAD_DIMS
    plain = [
        Variant(kernel, arch, dtype, head_dim)
        for kernel in kernels_
        for arch in ARCHS
        for dtype in dtypes
        for head_dim in head_dims
    ]
    featured = [
        Variant(kernel, arch, FEATURE_DTYPE, FEATURE_HEAD_DIM, features)
        for kernel in kernels_
        for arch in ARCHS
        for features in _FEATURES_OF[kernel]
        if (not required or features in REQUIRED_FEATURES) and arch in _archs_of(features)
    ]
    return plain + featured


def _archs_of(features: str) -> tuple[str, ...]:
    """The archs a feature variant is inspected on: those of its own tile (FEATURE_TILES), else all."""
    return FEATURE_TILES[features][1] if features in FEATURE_TILES else tuple(ARCHS)


def _constants(variant: Variant, tile: launch.TileConfig | None = None) -> tuple[dict[str, Any], launch.TileConfig]:
    """The constexprs of one variant, as the launcher passes them, and the tile: ``tile``, else the variant's own
    (FEATURE_TILES), else the default of gpu_configs."""
    kernel = KERNEL_OF[variant.kernel]
    dtype = DTYPES[variant.dtype]
    switches = KernelSwitches(**FEATURES[variant.features])
    # As launch.uses_descriptors decides for aligned tensors.
    block_d = launch.padded_head_dim(variant.head_dim, variant.head_dim)
    descriptors = kernel is not Kernel.DELTA and launch.descriptors_pay(kernel, switches, dtype, variant.arch, block_d)
    constants = launch.kernel_constants(kernel, variant.head_dim, variant.head_dim, dtype, switches, descriptors)
    if kernel is Kernel.DELTA:
        tile = launch.TileConfig(launch.DELTA_BLOCK_M, 0, 4, 3)  # Triton's launch defaults: 4 warps, 3 stages
        return {**constants, "BLOCK_M": tile.block_m}, tile
    if tile is None and variant.features in FEATURE_TILES:
        tile = FEATURE_TILES[variant.features][0]
    tile = tile or launch.gpu_configs(variant.kernel, constants["BLOCK_D"], dtype, variant.arch, switches)[0]
    return {**constants, **launch.tile_constants(kernel, tile)}, tile


def _signature(fn: Any, variant: Variant, constants: dict[str, Any]) -> tuple[dict[str, Any], dict, dict[str, Any]]:
    """The ASTSource signature, attributes and constexprs of one variant: the types, alignment and
    specialisation a launch would give (see the module's docstring)."""
    element = _TRITON_TYPE[variant.dtype]
    segments = constants.get("HAS_SEGMENT_IDS", False)
    present = {  # the launch passes q in place of an absent optional tensor (attnkit.contract.kernels)
        "Bias": constants.get("HAS_BIAS", False),
        "Mask": constants.get("HAS_MASK", False),
        "QLengths": constants.get("HAS_Q_LENGTHS", False),
        "KvLengths": constants.get("HAS_KV_LENGTHS", False),
        **dict.fromkeys(_SEGMENT_POINTERS, segments),
        "BlockTable": constants.get("PAGED", False),
        "AlibiSlopes": constants.get("HAS_ALIBI", False),
    }
    present_type = {
        "Bias": element,
        "Mask": "u8",
        "QLengths": "i32",
        "KvLengths": "i32",
        **dict.fromkeys(_SEGMENT_POINTERS, "i64"),
        "BlockTable": "i32",
        "AlibiSlopes": "fp32",
    }
    # Split-K's partial outputs are float32 whatever the inputs' dtype.
    float32_pointers = (*_FLOAT32_POINTERS, "Out") if constants.get("SPLIT_K", False) else _FLOAT32_POINTERS
    divisible = [["tt.divisibility", 16]]
    signature: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list] = {}
    constexprs = dict(constants)
    for index, param in enumerate(fn.params):
        name = param.name
        feature = _FEATURE_STRIDE.match(name)
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name in _PROGRAM_ARGUMENTS or (name in _DROPOUT_ARGUMENTS and not constants.get("HAS_DROPOUT")):
            signature[name] = "constexpr"
            constexprs[name] = None
        elif name in _DROPOUT_ARGUMENTS:
            signature[name] = _DROPOUT_ARGUMENTS[name]
        elif name in _DESCRIPTORS:  # TMA descriptors of one tile (launch.descriptors), or None (constexpr) without
            if constants.get("TMA", False):
                along_keys = launch.DESCRIBED[KERNEL_OF[variant.kernel]].along_keys
                rows = constants["BLOCK_N"] if along_keys else constants["BLOCK_M"]
                signature[name] = f"tensordesc<{element}[1,1,{rows},{constants['BLOCK_D']}]>"
            else:
                signature[name] = "constexpr"
                constexprs[name] = None
        elif name[0].isupper():  # a tensor
            if name in float32_pointers:
                signature[name] = "*fp32"
            elif name in present:
                signature[name] = "*" + (present_type[name] if present[name] else element)
            else:
                signature[name] = "*" + element
            attrs[(index,)] = divisible
        elif name in _FLOAT_ARGS:
            signature[name] = "fp32"
        elif feature and feature.group(2) == "n" and present[feature.group(1).capitalize()]:
            signature[name] = "constexpr"  # a contiguous last axis: Triton specialises an int equal to 1
            constexprs[name] = 1
        else:
            signature[name] = "i32"
            if _DENSE_STRIDE.match(name) or feature:  # feature strides: 0 (broadcast, absent) or Lk-multiples
                attrs[(index,)] = divisible
    takes = {p.name for p in fn.params if p.is_constexpr}
    unknown, missing = set(constants) - takes, {p.name for p in fn.params if p.is_constexpr and not p.has_default}
    if unknown or missing - set(constants):
        raise RuntimeError(
            f"{fn.__name__}: launch.kernel_constants and kernels.py disagree on the constexprs "
            f"(unknown {sorted(unknown)}, "
            f"missing {sorted(missing - set(constants))})"
        )
    return signature, attrs, constexprs


def tool(name: str) -> Path:
    """A CUDA binary tool bundled in the triton wheel (cuobjdump, nvdisasm, ptxas)."""
    import triton.backends.nvidia

    return Path(triton.backends.nvidia.__file__).parent / "bin" / name


_RESOURCES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
_OPCODE = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")
_WIDTH = {".64": 8, ".128": 16}


def read_cubin(cubin: bytes) -> dict[str, Any]:
    """Registers, stack, static shared and local memory, local store/load bytes and tensor-core counts of a cubin
    with one kernel, from the bundled cuobjdump."""
    cuobjdump = str(tool("cuobjdump"))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(path)], capture_output=True, text=True)
        sass = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True)
    for done in (usage, sass):
        if done.returncode != 0:
            raise RuntimeError(f"cuobjdump failed: {done.stderr.strip()}")
    match = _RESOURCES.search(usage.stdout)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{usage.stdout}")
    registers, stack, shared, local = map(int, match.groups())
    counts = {"HMMA": 0, "HGMMA": 0, "STL": 0, "LDL": 0, "USETMAXREG": 0}
    for opcode, suffixes in _OPCODE.findall(sass.stdout):
        if opcode in ("HMMA", "HGMMA", "USETMAXREG"):
            counts[opcode] += 1
        elif opcode in ("STL", "LDL"):  # .64 and .128 move 8 and 16 bytes, the others at most 4
            counts[opcode] += max([_WIDTH.get(suffix, 4) for suffix in re.findall(r"\.\w+", suffixes)] + [4])
    return dict(
        registers=registers,
        stack_bytes=stack,
        static_shared=shared,
        local_bytes=local,
        spill_store_bytes=counts["STL"],
        spill_load_bytes=counts["LDL"],
        hmma=counts["HMMA"],
        hgmma=counts["HGMMA"],
        setmaxnreg=counts["USETMAXREG"],
        sass=sass.stdout,
    )


def inspect_variant(variant: Variant, tile: launch.TileConfig | None = None) -> Result:
    """Compile one variant for its arch, at ``tile`` or else the default tile, and read its cubin."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default (fusion on), without its warning
    if launch.INTERPRETED:
        raise RuntimeError("the kernels were decorated under TRITON_INTERPRET=1: run without it to compile them")
    fn = launch.FUNCTIONS[KERNEL_OF[variant.kernel]]
    constants, tile = _constants(variant, tile)
    signature, attrs, constexprs = _signature(fn, variant, constants)
    started = time.perf_counter()
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", ARCHS[variant.arch], 32),
        options=dict(num_warps=tile.num_warps, num_stages=tile.num_stages),
    )
    compile_s = time.perf_counter() - started
    read = read_cubin(compiled.asm["cubin"])
    config = (
        f"{tile.block_m}x{tile.block_n}/{tile.num_warps}w/{tile.num_stages}s{'/ws' if tile.warp_specialize else ''}"
        if tile.block_n
        else f"{tile.block_m}/{tile.num_warps}w"
    )
    # A warp-specialised program's loop runs on its consumer warpgroups: every warp but the producer's num_warps.
    loop_warps = compiled.metadata.num_warps - tile.num_warps if tile.warp_specialize else tile.num_warps
    return Result(
        variant=variant,
        config=config,
        registers=read["registers"],
        stack_bytes=read["stack_bytes"],
        local_bytes=read["local_bytes"],
        spill_store_bytes=read["spill_store_bytes"],
        spill_load_bytes=read["spill_load_bytes"],
        shared_bytes=compiled.metadata.shared + read["static_shared"],
        hmma=read["hmma"],
        hgmma=read["hgmma"],
        warps=compiled.metadata.num_warps,
        setmaxnreg=read["setmaxnreg"],
        compile_s=round(compile_s, 2),
        mix=loop_mix(
            read["sass"],
            variant.arch,
            flops_per_score(variant.kernel, variant.head_dim, variant.head_dim, constants.get("ATOMIC_DQ", False)),
            tile.block_m * tile.block_n,
            loop_warps,
        )
        if variant.has_dot
        else None,
    )


def _worker_init() -> None:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def inspect_all(selected: list[Variant], jobs: int = 1) -> Iterator[Result]:
    """Results in the order of ``selected``; ``jobs`` > 1 compiles in a process pool."""
    _worker_init()
    if jobs <= 1:
        yield from map(inspect_variant, selected)
        return
    # spawn: each worker imports the kernels afresh, in this process's (non-interpreted) environment.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_worker_init) as pool:
        yield from pool.map(inspect_variant, selected)


def violations(results: list[Result]) -> list[str]:
    """The requirements of the static check, broken: no spills at the default tiles for D = 64 and 128 in the
    float16 / bfloat16 dot kernels (NO_SPILL_FEATURES), HMMA on sm_80 and HGMMA on sm_90 in every float16 /
    bfloat16 dot kernel, and without features wgmma N ≥ 64, an interior loop without selects or repeated products,
    TMA copies in the loops where descriptors pay (launch.descriptors_pay) and, at D = 128 on sm_90, within
    INSTRUCTIONS_PER_SCORE; the warp-specialised candidate (no feature either) in three warpgroups with setmaxnreg
    and its copies out of the consumers' loop."""
    broken = []
    for result in results:
        variant = result.variant
        if not variant.has_dot or variant.dtype == "fp32":
            continue
        name = f"{variant.kernel} {variant.arch} {variant.dtype} D={variant.head_dim} {variant.features}"
        if variant.head_dim in NO_SPILL_HEAD_DIMS and variant.features in NO_SPILL_FEATURES and result.spill_bytes:
            broken.append(
                f"{name}: spills (stack {result.stack_bytes} B, local {result.local_bytes} B, "
                f"STL {result.spill_store_bytes} B, LDL {result.spill_load_bytes} B)"
            )
        instruction = REQUIRED_TENSOR_CORE[variant.arch]
        if not getattr(result, instruction.lower()):
            broken.append(f"{name}: no {instruction} ({result.tensor_core})")
        mix = result.mix
        if mix is None or variant.features not in ("plain", "warp-specialized"):
            continue
        narrow = [shape for shape in mix.tensor_shapes if shape.startswith("HGMMA") and int(shape.split("x")[1]) < 64]
        if narrow:
            broken.append(f"{name}: wgmma narrower than N = 64 ({', '.join(narrow)})")
        if mix.selects_per_score:
            broken.append(f"{name}: {mix.selects_per_score} selects per score in the interior loop")
        if mix.tensor_work > 1.0:
            broken.append(f"{name}: {mix.tensor_work}x the products' tensor-core work (a product computed twice)")
        kernel, switches = KERNEL_OF[variant.kernel], KernelSwitches(**FEATURES[variant.features])
        block_d = launch.padded_head_dim(variant.head_dim, variant.head_dim)
        dtype = DTYPES[variant.dtype]
        if variant.features == "warp-specialized":
            tile = FEATURE_TILES[variant.features][0]
            if result.warps != 3 * tile.num_warps or not result.setmaxnreg or mix.tma_loads_per_iteration:
                broken.append(
                    f"{name}: not warp-specialised ({result.warps} warps, {result.setmaxnreg} USETMAXREG, "
                    f"{mix.tma_loads_per_iteration} UTMALDG in the consumers' loop; expected {3 * tile.num_warps} "
                    "warps: a producer and two consumer warpgroups, setmaxnreg, the copies in the producer)"
                )
        elif launch.descriptors_pay(kernel, switches, dtype, variant.arch, block_d) and not mix.tma_loads_per_iteration:
            broken.append(f"{name}: the interior loop loads its tiles without tensor descriptors (no UTMALDG)")
        limit = INSTRUCTIONS_PER_SCORE[variant.kernel]
        if variant.arch == "sm_90" and variant.head_dim == 128 and mix.instructions_per_score > limit:
            broken.append(f"{name}: {mix.instructions_per_score} instructions per score (at most {limit})")
    return broken


_COLUMNS = (
    "kernel",
    "arch",
    "dtype",
    "D",
    "features",
    "tile",
    "regs",
    "local B",
    "STL/LDL B",
    "smem B",
    "tensor cores",
    "instr/score",
    "ex2/score",
    "sel/score",
    "tc work",
    "TF/s pred (ceiling)",
)


def _row(result: Result) -> tuple[str, ...]:
    variant = result.variant
    return (
        variant.kernel,
        variant.arch,
        variant.dtype,
        str(variant.head_dim),
        variant.features,
        result.config,
        str(result.registers),
        str(result.stack_bytes + result.local_bytes),
        f"{result.spill_store_bytes}/{result.spill_load_bytes}",
        str(result.shared_bytes),
        result.tensor_core,
        *_mix_cells(result.mix),
    )


def _mix_cells(mix: LoopMix | None) -> tuple[str, ...]:
    if mix is None:
        return ("-", "-", "-", "-", "-")
    return (f"{mix.instructions_per_score:.1f}", f"{mix.ex2_per_score:.2f}", f"{mix.selects_per_score:.2f}",
            f"{mix.tensor_work:.2f}", f"{mix.predicted_tflops:.0f} ({mix.ceiling_tflops:.0f})")  # fmt: skip


def to_json(results: list[Result]) -> list[dict[str, Any]]:
    """One record per result: the variant's fields (flat, and as ``variant``), the cubin's, and the main loop's mix
    (None where the kernel has no tensor-core loop)."""
    records = []
    for result in results:
        record = {**asdict(result.variant), **asdict(result), "spill_bytes": result.spill_bytes}
        del record["mix"]
        mix = asdict(result.mix) if result.mix is not None else {}
        for name in ("instructions_per_score", "ex2_per_score", "selects_per_score", "compares_per_score",
                     "loads_per_iteration", "tma_loads_per_iteration", "barriers_per_iteration", "tensor_shapes",
                     "tensor_work",
                     "predicted_tflops", "ceiling_tflops", "bound"):  # fmt: skip
            record[name] = mix.get(name)
        records.append({**record, "tensor_core": result.tensor_core, "loops": mix.get("all_loops")})
    return records


def main(argv: list[str] | None = None) -> int:
    args = static_check_arguments("python -m attnkit.backends.triton.inspect", __doc__, "compiling processes", argv)
    if launch.INTERPRETED:  # the kernels here are interpreted: compile them in a process without the switch
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        command = [sys.executable, "-m", "attnkit.backends.triton.inspect", *(sys.argv[1:] if argv is None else argv)]
        return subprocess.run(command, env=env).returncode
    if not tool("cuobjdump").exists():
        print(f"no cuobjdump at {tool('cuobjdump')}: this triton wheel does not bundle it", file=sys.stderr)
        return 2
    selected = variants(args.scope)
    started = time.perf_counter()
    results = []
    for result in inspect_all(selected, args.jobs):
        results.append(result)
        if not args.markdown:
            print(f"[{len(results)}/{len(selected)}] {' '.join(_row(result))}", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started
    print(
        f"{len(results)} variants, triton {triton.__version__}, {elapsed:.0f} s with {args.jobs} job(s)\n",
        file=sys.stderr,
    )
    table = results_table(_COLUMNS, [_row(result) for result in results], args.markdown)
    return report_check(args, table, to_json(results), violations(results))


if __name__ == "__main__":
    sys.exit(main())
