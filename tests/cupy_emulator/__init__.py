"""Test infrastructure: runs the cupy backend's CUDA C kernels on the CPU, so the conformance suite covers them on
a machine without a GPU. It is not a CUDA implementation and not a way to run attention.

``cuda_emulation.h`` provides the CUDA built-ins the kernels use (thread and block indices, dynamic shared memory,
``__syncthreads`` as a real barrier over one OS thread per CUDA thread, warp shuffles, atomics, the half types,
the math intrinsics, ``nvcuda::wmma``, and twins of the kernels' PTX-level functions: ``mma.sync``, ``ldmatrix``,
``cp.async`` with the PTX ISA's per-lane layouts). :class:`EmulatorLauncher` implements the backend's
``launch.Launcher``: it compiles the *same* ``attention.cu`` with the host C++ compiler and the same -D options the
CuPy launcher gives NVRTC, builds a trampoline per kernel that unpacks a ``cuLaunchKernel``-style argument array,
and launches with the grid, block, shared-memory size and arguments that ``launch.py`` and
``attnkit.contract.kernels`` computed, on CPU tensors.
Libraries are built once per (source, header, options) into a cache directory.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import torch
from attnkit.backends.cupy import launch, programs

import attnkit
from attnkit.build import build_timeout, cached, run_bounded
from attnkit.errors import BuildError

HEADER = Path(__file__).parent / "cuda_emulation.h"
#: Bytes of emulated dynamic shared memory per block (sm_90 has 227 KiB), plus the canary.
SHARED_CAPACITY = 256 * 1024
KERNEL_PATTERN = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(')
COMPILER_FLAGS = ("-std=c++20", "-O1", "-fPIC", "-w")


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def cache_dir() -> Path:
    root = os.environ.get("ATTNKIT_EMULATOR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "attnkit", "cupy-emulator"
    )
    return Path(root)


def wrapper_source(source: Path) -> str:
    """The translation unit (after the header, given by -include): the kernel source unchanged, shared memory,
    one trampoline per kernel."""
    names = KERNEL_PATTERN.findall(source.read_text())
    lines = [
        f'#include "{source}"',
        f"__attribute__((aligned(128))) unsigned char shared_memory[{SHARED_CAPACITY}];",
        'extern "C" const char* emu_failure() { return emu::failure; }',
    ]
    for name in names:
        lines.append(
            f'extern "C" int emu_launch_{name}(const unsigned* grid, const unsigned* block, unsigned long shared, '
            f"void** params) {{ return emu::launch(grid, block, shared, shared_memory, sizeof shared_memory, "
            f"[params] {{ emu::call_packed({name}, params); }}); }}"
        )
    return "\n".join(lines) + "\n"


def build(options: tuple[str, ...], source: Path = launch.SOURCE, program: str = "") -> Path:
    """The shared library of one variant (with a mask program's code spliced in), compiled on first use and cached
    by content (attnkit/build.py: a lock between pytest-xdist workers, a time bound, owner-only directories)."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no host C++ compiler (g++ or $CXX) for the CUDA emulation harness")
    if program:
        source = spliced_source(source, program)
    wrapper = wrapper_source(source)
    header = precompiled_header(cxx)
    digest = _digest(wrapper, source.read_text(), HEADER.read_text(), *options, *COMPILER_FLAGS, cxx)

    def make(scratch: Path, log: Path) -> Path:
        cpp = scratch / "wrapper.cpp"
        cpp.write_text(wrapper)
        command = [cxx, *COMPILER_FLAGS, "-shared", *options, "-include", str(header), str(cpp)]
        return _compile(command, scratch / "library.so", log, f"{source.name} with {' '.join(options)}")

    return cached(cache_dir() / f"attention-{digest}.so", f"{source.name} for the emulator", make)


def spliced_source(source: Path, program: str) -> Path:
    """``source`` with a program's code spliced in, as a file in the cache (named by its content)."""
    return cached_source(programs.splice(source.read_text(), program), f"{source.name} with a mask program")


def cached_source(text: str, what: str) -> Path:
    """A kernel source as a file in the cache, named by its content, so the libraries built from it are cached too
    (a library's key holds the path it includes the source by)."""

    def write(scratch: Path, log: Path) -> Path:
        (scratch / launch.SOURCE.name).write_text(text)
        return scratch / launch.SOURCE.name

    return cached(cache_dir() / f"attention-{_digest(text)}.cu", what, write)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _compile(command: list[str], built: Path, log: Path, what: str) -> Path:
    run_bounded([*command, "-o", str(built)], what, log, build_timeout())
    return built


def precompiled_header(cxx: str) -> Path:
    """cuda_emulation.h next to its precompiled .gch in the cache (the standard headers take most of a build)."""
    directory = cache_dir() / f"header-{_digest(HEADER.read_text(), *COMPILER_FLAGS, cxx)}"

    def make_gch(scratch: Path, log: Path) -> Path:
        return _compile([cxx, *COMPILER_FLAGS, "-x", "c++-header", str(HEADER)], scratch / "h.gch", log, HEADER.name)

    def copy_header(scratch: Path, log: Path) -> Path:
        return Path(shutil.copyfile(HEADER, scratch / HEADER.name))

    cached(directory / f"{HEADER.name}.gch", f"{HEADER.name}.gch", make_gch)
    return cached(directory / HEADER.name, HEADER.name, copy_header)  # after the .gch: the header means both


def _c_argument(value: launch.Argument) -> ctypes._SimpleCData:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"the emulator takes CPU tensors, got one on {value.device}")
        return ctypes.c_void_p(value.data_ptr())
    if isinstance(value, np.int32):
        return ctypes.c_int32(int(value))
    if isinstance(value, np.uint32):
        return ctypes.c_uint32(int(value))
    if isinstance(value, np.int64):
        return ctypes.c_int64(int(value))
    if isinstance(value, np.float32):
        return ctypes.c_float(float(value))
    raise TypeError(f"unsupported kernel argument {value!r}")


class EmulatorLauncher:
    """``launch.Launcher`` for the CPU: the kernels compiled by the host C++ compiler, run by cuda_emulation.h."""

    name = "cupy-emulator"
    device = "cpu"

    def __init__(self, source: Path = launch.SOURCE) -> None:
        self.source = source
        self._libraries: dict[tuple[tuple[str, ...], str], ctypes.CDLL] = {}
        self._lock = threading.Lock()  # the emulator runs one launch at a time (shared state in the library)

    def unavailable(self) -> list[str]:
        if compiler() is None:
            return ["no host C++ compiler (g++ or $CXX) for the CUDA emulation harness"]
        return []

    def tile(self, kernel: str, head_dim: int, dtype: str) -> launch.TileConfig:
        register_shaped = kernel in ("forward", "backward_dq") and dtype != "float32"  # 16 query rows per warp
        return launch.EMULATOR_FORWARD_TILE if register_shaped else launch.EMULATOR_TILE

    def library(self, options: tuple[str, ...], program: str = "") -> ctypes.CDLL:
        if (options, program) not in self._libraries:
            self._libraries[(options, program)] = ctypes.CDLL(str(build(options, self.source, program)))
        return self._libraries[(options, program)]

    def launch(
        self,
        kernel: str,
        options: tuple[str, ...],
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        args: list[launch.Argument],
        program: str = "",
    ) -> None:
        values = [_c_argument(arg) for arg in args]
        params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(value) for value in values))
        with self._lock:
            library = self.library(options, program)
            function = getattr(library, f"emu_launch_attention_{kernel}")
            function.restype = ctypes.c_int
            failed = function(
                (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), ctypes.c_ulong(shared_bytes), params
            )
            if failed:
                library.emu_failure.restype = ctypes.c_char_p
                raise RuntimeError(f"emulated {kernel} failed: {library.emu_failure().decode()}")


def attach_emulator() -> None:
    """Register ``cupy-emulated`` with this harness as its launcher (tests/conftest.py calls it). The backend package
    registers it without one, unavailable with the reason; the capabilities are the same either way."""
    from attnkit.backends.cupy.backend import CupyBackend

    attnkit.registered_backends()  # the built-ins first, so this registration replaces theirs
    attnkit.register_backend(CupyBackend.emulated(EmulatorLauncher()), replace=True)
