"""Static GPU check of the CUDA C kernels: compile kernels/attention.cu with nvcc for sm_80 and sm_90, read ptxas.

No GPU is needed. Each variant is compiled to a cubin with exactly the -D options the launcher gives NVRTC
(``launch.compile_options`` with the default tile of ``launch.gpu_tile`` for that kernel) and ``-Xptxas -v``:

* compiler warnings: any ``warning`` line from nvcc or ptxas fails the check;
* registers, stack frame, spill stores and loads per kernel, from ptxas's report;
* dynamic shared memory (``launch.shared_memory_bytes``) against the arch's per-block limit;
* tensor-core instructions in ``cuobjdump -sass``: ``HMMA`` (what ``mma.sync`` and ``nvcuda::wmma`` compile to on
  sm_80 and sm_90). float32 multiplies in IEEE float32 on the FMA units;
* the main loop's instruction mix per attention score and the issue-rate model's predicted TFLOP/s
  (:mod:`attnkit.contract.sass`), and the loads of the kernel's innermost loops by kind: scalar 2-byte global loads
  (``LDG.E.U16``), generic loads (``LD``), ``ldmatrix`` (``LDSM``), ``cp.async`` (``LDGSTS``) and barriers.

    python -m attnkit.backends.cupy.inspect                      # every variant, a text table
    python -m attnkit.backends.cupy.inspect --markdown           # the table of docs/performance.md
    python -m attnkit.backends.cupy.inspect --scope required --check --json out.json

Each distinct module is compiled once for both archs (one fatbin); reports are cached by content under
~/.cache/attnkit/cupy-nvcc ($ATTNKIT_NVCC_CACHE).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnkit.contract.kernel_checks import report_check, results_table, static_check_arguments
from attnkit.contract.kernels import KernelSwitches
from attnkit.contract.sass import LoopMix, flops_per_score, innermost_loops, loop_mix

from . import launch, programs

ARCHS = ("sm_80", "sm_90")
#: Dynamic shared memory per block with the opt-in attribute (CUDA C Programming Guide, compute capabilities).
SHARED_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (64, 128, 256)
#: Kernels with matrix products: the ones that must use tensor cores for float16 / bfloat16.
MMA_KERNELS = ("forward", "backward_dq", "backward_dkdv")
NO_SPILL_HEAD_DIMS = (64, 128)
FEATURE_SETS = {
    "plain": KernelSwitches(),
    "all": KernelSwitches.all(),
    # The one-pass backward's dK/dV (atomic dq): alone, and with every switch it runs with: not those of
    # launch.ONE_PASS_EXCLUDED, nor dbias (which needs a bias) and float32 gradients (the cosine variant's).
    "one-pass": KernelSwitches(atomic_dq=True),
    "one-pass-all": KernelSwitches.all().with_(
        **dict.fromkeys((*launch.ONE_PASS_EXCLUDED, "has_dbias", "grad_float32"), False)
    ),
}
ONE_PASS_FEATURES, ONE_PASS_KERNELS, ONE_PASS_DTYPES = ("one-pass", "one-pass-all"), ("backward_dkdv",), DTYPES[:2]
NVCC_FLAGS = ("-std=c++17", "-O3", "-fatbin", "-Xptxas", "-v", "-x", "cu")
#: The kernels' names in the JSON records and the loop mix (attnkit.contract.sass.flops_per_score).
SHORT_NAMES = {"forward": "fwd", "backward_dq": "dq", "backward_dkdv": "dkdv", "backward_delta": "delta"}


@dataclass(frozen=True)
class LoopLoads:
    """Instructions of a kernel's innermost loops, summed over the loops (one iteration each), by kind."""

    scalar_16bit_global: int  # LDG of one 2-byte element: a tile loaded element by element
    generic: int  # LD: a load through a generic pointer (wmma fragments from shared memory)
    ldmatrix: int  # LDSM
    cp_async: int  # LDGSTS
    barriers: int  # BAR


def loop_loads(sass: str) -> LoopLoads:
    found = [i for loop in innermost_loops(sass) for i in loop.instructions]
    return LoopLoads(
        scalar_16bit_global=sum(1 for i in found if i.opcode == "LDG" and re.search(r"\.[US]16\b", i.suffixes)),
        generic=sum(1 for i in found if i.opcode == "LD"),
        ldmatrix=sum(1 for i in found if i.opcode == "LDSM"),
        cp_async=sum(1 for i in found if i.opcode == "LDGSTS"),
        barriers=sum(1 for i in found if i.opcode == "BAR"),
    )


@dataclass(frozen=True)
class Variant:
    kernel: str
    arch: str
    dtype: str
    head_dim: int
    features: str  # a key of FEATURE_SETS


@dataclass
class Result:
    variant: Variant
    tile: str
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    hmma: int
    warnings: list[str]
    mix: LoopMix | None  # the main loop's instruction mix; None without tensor cores (float32, Δ)
    loads: LoopLoads

    @property
    def spill_bytes(self) -> int:
        return self.stack_bytes + self.spill_store_bytes + self.spill_load_bytes


def variants(scope: str = "full") -> list[Variant]:
    """``full``: every kernel, arch, dtype, head dim, with no feature and with every feature, and the one-pass dK/dV
    (float16 / bfloat16, D = 64 and 128, alone and with every switch it runs with). ``required``: what
    tests/test_cupy_static.py asserts, on both archs: the plain variants at D = 64 and 128 and every feature at
    D = 128 in every dtype; the one-pass dK/dV at D = 64 and 128, and with its switches where it runs (D = 64)."""
    selected = []
    for kernel in launch.KERNELS:
        for arch in ARCHS:
            for dtype in DTYPES:
                for head_dim in HEAD_DIMS:
                    for features in FEATURE_SETS:
                        if features in ONE_PASS_FEATURES and (
                            kernel not in ONE_PASS_KERNELS or dtype not in ONE_PASS_DTYPES or head_dim > 128
                        ):
                            continue
                        required = head_dim in NO_SPILL_HEAD_DIMS and {
                            "all": head_dim == 128,
                            "one-pass-all": head_dim <= launch.ONE_PASS_MAX_HEAD_DIM,
                        }.get(features, True)
                        if scope == "full" or required:
                            selected.append(Variant(kernel, arch, dtype, head_dim, features))
    return selected


def tool(name: str) -> Path | None:
    """nvcc or cuobjdump: on PATH, under $CUDA_HOME/bin, next to nvcc's real location, or (cuobjdump) in the triton
    wheel."""
    found = shutil.which(name)
    candidates = [Path(found)] if found else []
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(Path(root) / "bin" / name)
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent / name)
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "backends" / "nvidia" / "bin" / name)
    return next((path for path in candidates if path.is_file() and os.access(path, os.X_OK)), None)


def cache_dir() -> Path:
    root = os.environ.get("ATTNKIT_NVCC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "attnkit", "cupy-nvcc"
    )
    return Path(root)


def source_text(options: tuple[str, ...]) -> str:
    """The kernel source a variant compiles: with -DHAS_MASK_PROGRAM=1, the program of every operation spliced in
    (programs.every_operation), as the launcher splices a call's program."""
    code = programs.program_code(programs.every_operation()) if "-DHAS_MASK_PROGRAM=1" in options else ""
    return programs.splice(launch.SOURCE.read_text(), code)


def compile_module(options: tuple[str, ...]) -> dict[str, Any]:
    """nvcc's report and, per arch, the SASS of one compiled module (every kernel of the source, sm_80 and sm_90 in
    one fatbin), cached by content."""
    nvcc, cuobjdump = tool("nvcc"), tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        raise RuntimeError("nvcc and cuobjdump are needed for the static check")
    targets = [f"-gencode=arch=compute_{arch[3:]},code={arch}" for arch in ARCHS]
    key = hashlib.sha256("\0".join([source_text(options), *targets, *options, *NVCC_FLAGS]).encode()).hexdigest()
    cached = cache_dir() / f"{key[:24]}.json"
    cached.parent.mkdir(parents=True, exist_ok=True)
    with open(cached.with_name(cached.name + ".lock"), "w") as lock:  # one compile per module across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not cached.exists():
            _compile_module(nvcc, cuobjdump, targets, options, cached)
        fcntl.flock(lock, fcntl.LOCK_UN)
    return json.loads(cached.read_text())


def _compile_module(nvcc: Path, cuobjdump: Path, targets: list[str], options: tuple[str, ...], cached: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        fatbin, source = Path(scratch) / "attention.fatbin", Path(scratch) / launch.SOURCE.name
        source.write_text(source_text(options))
        command = [str(nvcc), *NVCC_FLAGS, *targets, *options, str(source), "-o", str(fatbin)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
        sass = {
            arch: subprocess.run(
                [str(cuobjdump), "-sass", "-arch", arch, str(fatbin)], capture_output=True, text=True, check=True
            ).stdout
            for arch in ARCHS
        }
    report = {"ptxas": done.stdout + done.stderr, "sass": sass}
    temporary = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(report))
    os.replace(temporary, cached)


def nvrtc_library() -> Path | None:
    """libnvrtc: from the nvidia-cuda-nvrtc wheels (what cupy-cuda12x/13x load), $CUDA_HOME/lib64, or the system."""
    import ctypes.util
    import glob

    for package in ("nvidia.cuda_nvrtc", "nvidia.cu13"):
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:
            spec = None
        for root in spec.submodule_search_locations or [] if spec else []:
            found = sorted(glob.glob(os.path.join(root, "lib", "libnvrtc.so*")))
            if found:
                return Path(found[0])
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (found := sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))):
            return Path(found[0])
    name = ctypes.util.find_library("nvrtc")
    return Path(name) if name else None


def cuda_include() -> Path | None:
    """The CUDA headers the kernels include (cuda_fp16.h, cuda_bf16.h, mma.h), as CuPy finds them for NVRTC."""
    nvcc = tool("nvcc")
    candidates = [Path(os.path.realpath(nvcc)).parent.parent / "include"] if nvcc else []
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "backends" / "nvidia" / "include")
    return next((path for path in candidates if (path / "mma.h").exists() or (path / "crt" / "mma.h").exists()), None)


def nvrtc_compile(arch: str, options: tuple[str, ...]) -> tuple[int, str, int]:
    """Compile the source with NVRTC, as cupy.RawModule does: (status, log, cubin bytes). Status 0 is success."""
    import ctypes

    library, include = nvrtc_library(), cuda_include()
    if library is None or include is None:
        raise RuntimeError("libnvrtc and the CUDA headers are needed")
    nvrtc = ctypes.CDLL(str(library))
    program = ctypes.c_void_p()
    text = source_text(options).encode()
    nvrtc.nvrtcCreateProgram(ctypes.byref(program), text, b"attention.cu", 0, None, None)
    flags = [flag.encode() for flag in ("--std=c++17", f"-arch={arch}", f"-I{include}", *options)]
    status = nvrtc.nvrtcCompileProgram(program, len(flags), (ctypes.c_char_p * len(flags))(*flags))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    cubin = ctypes.c_size_t(0)
    if status == 0:
        nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(cubin))
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace").strip(), cubin.value


def _ptxas_entry(report: str, name: str, arch: str) -> dict[str, int]:
    """Registers, stack and spills of one entry function for one arch in a ``-Xptxas -v`` report."""
    marker = f"Compiling entry function '{name}' for '{arch}'"
    section = report.split(marker, 1)[1].split("Compiling entry function", 1)[0]
    numbers = {
        "stack": r"(\d+) bytes stack frame",
        "stores": r"(\d+) bytes spill stores",
        "loads": r"(\d+) bytes spill loads",
        "registers": r"Used (\d+) registers",
    }
    return {
        key: int(match.group(1)) if (match := re.search(pattern, section)) else 0 for key, pattern in numbers.items()
    }


def _function_sass(sass: str, name: str) -> str:
    """One kernel's part of a module's ``cuobjdump -sass`` listing."""
    functions = re.split(r"\n\s*Function : ", sass)
    return next((part for part in functions if part.split("\n", 1)[0].strip() == name), "")


def inspect_variant(variant: Variant) -> Result:
    tile = launch.gpu_tile(variant.kernel, variant.head_dim, variant.dtype)
    report = compile_module(variant_options(variant))
    name = f"attention_{variant.kernel}"
    entry = _ptxas_entry(report["ptxas"], name, variant.arch)
    sass = _function_sass(report["sass"][variant.arch], name)
    short = SHORT_NAMES[variant.kernel]
    mix = None
    if variant.kernel in MMA_KERNELS:
        # The register-resident kernels run one tile per iteration; the wmma kernels' innermost loops run fragments of
        # one, so their scores are counted from the tensor-core work (attnkit.contract.sass.loop_mix).
        per_tile = (tile.block_m * tile.block_n, tile.num_warps) if _register_resident(variant) else (None, None)
        atomic_dq = variant.features in ONE_PASS_FEATURES
        flops = flops_per_score(short, variant.head_dim, variant.head_dim, atomic_dq)
        mix = loop_mix(sass, variant.arch, flops, *per_tile)
    return Result(
        variant=variant,
        tile=f"{tile.block_m}x{tile.block_n}/{tile.num_warps}w",
        registers=entry["registers"],
        stack_bytes=entry["stack"],
        spill_store_bytes=entry["stores"],
        spill_load_bytes=entry["loads"],
        shared_bytes=launch.shared_memory_bytes(
            variant.kernel,
            tile,
            variant.head_dim,
            variant.head_dim,
            variant.dtype,
            _register_resident(variant),
            variant.features in ONE_PASS_FEATURES,
        ),
        hmma=len(re.findall(r"\bHMMA\.", sass)),
        warnings=[line for line in report["ptxas"].splitlines() if "warning" in line.lower()],
        mix=mix,
        loads=loop_loads(sass),
    )


def _lean(variant: Variant) -> bool:
    """Whether the variant must not spill: plain at D = 64 and 128, and the one-pass dK/dV where it runs."""
    if variant.features in ONE_PASS_FEATURES:
        return variant.head_dim <= launch.ONE_PASS_MAX_HEAD_DIM
    return variant.features == "plain" and variant.head_dim in NO_SPILL_HEAD_DIMS


def _register_resident(variant: Variant) -> bool:
    """Whether the variant compiles a register-resident kernel (with aligned operands, as a GPU launch has)."""
    switches = launch.canonical_switches(variant.kernel, variant.dtype, FEATURE_SETS[variant.features])
    return launch.register_resident(variant.kernel, variant.dtype, variant.head_dim, variant.head_dim, switches)


def variant_options(variant: Variant) -> tuple[str, ...]:
    tile = launch.gpu_tile(variant.kernel, variant.head_dim, variant.dtype)
    switches = launch.canonical_switches(variant.kernel, variant.dtype, FEATURE_SETS[variant.features])
    return launch.compile_options(
        variant.dtype,
        variant.head_dim,
        variant.head_dim,
        tile,
        switches,
        variant.kernel if _register_resident(variant) else None,
    )


def inspect_all(selected: list[Variant], jobs: int = 2) -> list[Result]:
    """Compiles each distinct module once, in ``jobs`` nvcc processes at a time, then reads every variant."""
    modules = sorted({variant_options(variant) for variant in selected})
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(compile_module, modules))
    return [inspect_variant(variant) for variant in selected]


def violations(results: list[Result]) -> list[str]:
    found = []
    for r in results:
        v = r.variant
        name = f"{v.kernel} {v.arch} {v.dtype} D={v.head_dim} {v.features} ({r.tile})"
        if r.warnings:
            found.append(f"{name}: compiler warnings: {r.warnings}")
        if _lean(v) and r.spill_bytes:
            found.append(f"{name}: spills (stack {r.stack_bytes} B, stores {r.spill_store_bytes} B)")
        if r.shared_bytes > SHARED_LIMIT[v.arch]:
            found.append(f"{name}: {r.shared_bytes} B of shared memory, over {v.arch}'s {SHARED_LIMIT[v.arch]} B")
        if v.kernel in MMA_KERNELS and v.dtype != "float32" and not r.hmma:
            found.append(f"{name}: no HMMA in the SASS: matrix products off the tensor cores")
    return found


HEADER = ("kernel", "arch", "dtype", "D", "features", "tile", "regs", "spill B", "smem B", "tensor cores",
          "instr/score", "ex2/score", "sel/score", "TF/s pred (ceiling)", "loop loads LDG16/LD/LDSM/LDGSTS",
          "loop BAR")  # fmt: skip


def _row(r: Result) -> tuple[str, ...]:
    v = r.variant
    cores = f"HMMA {r.hmma}" if r.hmma else ("none" if v.kernel in MMA_KERNELS else "no mma")
    spill = f"{r.stack_bytes}/{r.spill_store_bytes}/{r.spill_load_bytes}"
    mix = r.mix
    mix_cells = ("-", "-", "-", "-") if mix is None else (
        f"{mix.instructions_per_score:.1f}", f"{mix.ex2_per_score:.2f}", f"{mix.selects_per_score:.2f}",
        f"{mix.predicted_tflops:.0f} ({mix.ceiling_tflops:.0f})")  # fmt: skip
    loads = r.loads
    return (SHORT_NAMES[v.kernel], v.arch, v.dtype, str(v.head_dim), v.features, r.tile, str(r.registers), spill,
            str(r.shared_bytes), cores, *mix_cells,
            f"{loads.scalar_16bit_global}/{loads.generic}/{loads.ldmatrix}/{loads.cp_async}",
            str(loads.barriers))  # fmt: skip


#: The loop mix's fields copied flat into each JSON record (None where the kernel has no tensor-core loop).
MIX_FIELDS = ("instructions_per_score", "ex2_per_score", "selects_per_score", "compares_per_score",
              "loads_per_iteration", "barriers_per_iteration", "tensor_shapes", "predicted_tflops", "ceiling_tflops",
              "bound")  # fmt: skip


def to_json(results: list[Result]) -> list[dict[str, Any]]:
    """One flat record per result: the variant (``kernel`` as fwd, dq, dkdv, delta; the CUDA function as
    ``function``), the cubin's figures, the main loop's mix and the innermost loops' loads."""
    records = []
    for r in results:
        mix = asdict(r.mix) if r.mix is not None else {}
        records.append({
            **asdict(r.variant), "kernel": SHORT_NAMES[r.variant.kernel], "function": f"attention_{r.variant.kernel}",
            "tile": r.tile, "registers": r.registers, "stack_bytes": r.stack_bytes,
            "spill_store_bytes": r.spill_store_bytes, "spill_load_bytes": r.spill_load_bytes,
            "spill_bytes": r.spill_bytes, "shared_bytes": r.shared_bytes, "hmma": r.hmma, "warnings": r.warnings,
            **{name: mix.get(name) for name in MIX_FIELDS}, "loops": mix.get("all_loops"),
            **{f"loop_{name}": count for name, count in asdict(r.loads).items()},
        })  # fmt: skip
    return records


def main(argv: list[str] | None = None) -> int:
    args = static_check_arguments("python -m attnkit.backends.cupy.inspect", __doc__, "nvcc processes at a time", argv)
    missing = [name for name in ("nvcc", "cuobjdump") if tool(name) is None]
    if missing:
        print(f"cannot run the static check: {', '.join(missing)} not found", file=sys.stderr)
        return 2
    results = inspect_all(variants(args.scope), args.jobs)
    table = results_table(HEADER, [_row(r) for r in results], args.markdown)
    return report_check(args, table, to_json(results), violations(results))


if __name__ == "__main__":
    sys.exit(main())
