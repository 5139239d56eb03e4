"""``cpu-flash``: the plumbing around kernel.cpp (build, layouts, autograd); the math is in kernel.cpp.

SDPA's CPU kernel cannot express softcap, and windows, lengths or bottom-right causal only through a dense mask it
must read; an unfused loop of torch ops pays for every pass over the scores in memory traffic. kernel.cpp is the
FlashAttention-2 algorithm written once in C++: scores and products through the BLAS torch ships (MKL's sgemm),
softcap, visibility (index arithmetic, only on tiles the band crosses) and the online softmax in one vectorised
pass over each tile while it is in cache. A mask and a bias are read per tile through their strides. Memory is
linear in L: nothing of size Lq × Lk exists beyond a mask or bias the caller passed.

Built on first use with ``torch.utils.cpp_extension`` through attnkit/build.py (tens of seconds, once per machine
and CPU: cached under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; a failed build makes the backend
unavailable for the process, with the reason). Operands run in float32 (half types are widened exactly, as the
contract's float32 accumulation asks, §7); float64 is left to the reference backends.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnkit.backend import (
    ALL_FEATURES,
    AttentionInputs,
    AttentionSpec,
    BackendUnavailableError,
    BuildError,
    Capabilities,
    CausalAlignment,
    Dropout,
    Framework,
    PagedInputs,
    Problem,
    Runner,
    TorchExtension,
    Variant,
)
from attnkit.contract import COSINE_EPS, diagonal_band
from attnkit.contract.programs import BoundProgram, MaskProgram, cached_tile_classes, nodes
from attnkit.contract.torch import (
    Band,
    RecomputingBackend,
    from_bhsd,
    normalize_if_cosine,
    to_bhsd,
    zero_padding,
)

KERNEL_SOURCE = Path(__file__).with_name("kernel.cpp")
# Tiles (query rows, key columns): a 64 x 256 float32 score tile and its dP twin stay in L2 beside the K/V rows.
FORWARD_TILE = (64, 256)
BACKWARD_TILE = (64, 256)
# A band bounded on both sides: rows [r0, r0 + n) see n + high − low keys, so a block of n rows takes one key tile
# that wide, with n² hidden pairs computed for nothing (two triangles). 32 rows halve that waste against 64 while the
# GEMMs stay near full speed (16 rows lose more in the GEMMs than they save): window (256, 0) at L=4096 ran 7% faster
# forward, 13% backward (64 keys: 12% / 17%, 512: 4%); from 1024 keys on, every tile shape tried ran alike.
WINDOW_ROWS = 32
WINDOW_MAX_KEYS = 1024
WINDOW_BACKWARD_TILE = (64, 128)  # a band too wide for one tile: it crosses most key tiles, each of them masked
# Segment ids are summarised per granule of this many queries and keys (attnkit.contract.torch.SegmentTiles): a query
# block's key tiles are the runs of key granules whose ids can meet its own, so a key granule of other documents is
# never read. It divides every tile's rows (so a query block is whole granules) and is small against a document.
SEGMENT_GRANULE = 32


def _flags() -> list[str]:
    flags = ["-O3", "-march=native", "-ffp-contract=fast"]
    capability = torch.backends.cpu.get_cpu_capability()  # at::vec picks its vector width from this macro
    if capability in ("AVX2", "AVX512"):
        flags.append(f"-DCPU_CAPABILITY_{capability}")
    return flags


# Keyed by the source, the flags, torch, Python and (for -march=native) the CPU: an edited kernel.cpp or another
# machine sharing the cache never loads a stale or foreign build.
EXTENSION = TorchExtension("attnkit_cpu_flash", KERNEL_SOURCE, _flags(), label="cpu-flash", expected_s=16)


def _blas_reason() -> str | None:
    """Why this torch build lacks the BLAS entry point kernel.cpp calls (MKL's sgemm_, in x86 Linux wheels)."""
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        ctypes.CDLL(str(library)).sgemm_  # noqa: B018 - the lookup is the check
    except (OSError, AttributeError):
        return f"torch {torch.__version__} does not export sgemm_ from {library.name} (a build without MKL)"
    return None


def _kernel() -> Any:
    """The built extension module, built on the first call; a failed build raises BackendUnavailableError with its
    reason, which available() reports from then on (so auto routes elsewhere)."""
    try:
        return EXTENSION.load()
    except BuildError as error:
        raise BackendUnavailableError(f"backend='cpu-flash' is unavailable: {error}") from None


@dataclass(frozen=True)
class _Band:
    """The kernel's view of §4: rel = j − i − offset[b] in [low, high] on each bounded side."""

    low: int | None
    high: int | None
    bottom_right: bool

    @classmethod
    def of(cls, spec: AttentionSpec) -> _Band:
        low, high = diagonal_band(spec)
        return cls(low, high, spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT)

    def arguments(self) -> tuple[bool, int, bool, int, bool]:
        return self.low is not None, self.low or 0, self.high is not None, self.high or 0, self.bottom_right

    def tile(self, default: tuple[int, int], program: _Program | None = None) -> tuple[int, int]:
        """(query rows, key columns) per tile: one tile per row block for a band bounded on both sides, unless a
        mask program's classes need key tiles on a fixed grid (the band's tile starts off it: each cut in two)."""
        if self.low is None or self.high is None or program is not None:
            return default
        width = WINDOW_ROWS + max(self.high - self.low, 0)
        return (WINDOW_ROWS, width) if width <= WINDOW_MAX_KEYS else default


# Mask programs: kernel.cpp's interpreter reads a program as instructions, one per node of
# attnkit.contract.programs.nodes(expr) in that order: these columns, the op codes in ProgramOp's order.
PROGRAM_OPS = (
    "b", "h", "q", "kv", "const", "read",
    "add", "sub", "mul", "floordiv", "mod", "tdiv", "trem", "min", "max",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor",
    "neg", "abs", "not", "bool", "int", "where",
)  # fmt: skip
_OP_CODES = {name: code for code, name in enumerate(PROGRAM_OPS)}
# The level a node's value varies at: neither index (once per tile), q_idx alone (a scalar per row), kv_idx alone
# (lanes once per tile), both (lanes per row).
FIXED, ROW, COLUMN, PAIR = 0, 1, 2, 3


@functools.lru_cache(maxsize=256)
def program_code(program: MaskProgram) -> tuple[torch.Tensor, torch.Tensor]:
    """(code, operands) int32 as kernel.cpp's ProgramRows runs them: per node (op, level, value, first operand,
    operand count, spread), spread where a scalar node's value is read as lanes (by a lane node, or as the root);
    operands are node indices. Made once per program: a new length or captured value reuses it."""
    order = nodes(program.expr)
    position = {node: n for n, node in enumerate(order)}
    levels = [int("q" in node.indices()) + 2 * int("kv" in node.indices()) for node in order]
    spread = [False] * len(order)
    spread[-1] = levels[-1] < COLUMN  # the root, last in dependency order
    for node, level in zip(order, levels):
        for arg in node.args:
            spread[position[arg]] |= level >= COLUMN and levels[position[arg]] < COLUMN
    code: list[list[int]] = []
    operands: list[int] = []
    for n, node in enumerate(order):
        op = str(node.value) if node.op == "index" else node.op
        value = int(node.value) if node.op in ("const", "read") else 0  # type: ignore[arg-type]
        code.append([_OP_CODES[op], levels[n], value, len(operands), len(node.args), int(spread[n])])
        operands.extend(position[arg] for arg in node.args)
    return torch.tensor(code, dtype=torch.int32), torch.tensor(operands or [0], dtype=torch.int32)


@dataclass
class _Program:
    """One call's program as the kernel takes it: code, the captured tensors as int32 (bool as 0/1, converted once
    per call) and the tile classes of each pass's tiles (attnkit.contract.programs' class cache)."""

    bound: BoundProgram
    shape: tuple[int, int, int, int]  # B, Hq, Lq, Lk
    like: torch.Tensor
    captured: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def of(cls, bound: BoundProgram | None, q: torch.Tensor, len_k: int) -> _Program | None:
        if bound is None:
            return None
        captured = [t.to(torch.int32).contiguous() for t in bound.captured]
        return cls(bound, (q.shape[0], q.shape[1], q.shape[2], len_k), q, captured)

    def arguments(self, tile: tuple[int, int]) -> tuple[Any, ...]:
        """The kernel's program arguments for a pass over tiles of ``tile`` (query rows, key columns)."""
        code, operands = program_code(self.bound.program)
        classes = cached_tile_classes(self.bound, *self.shape, *tile, self.like)
        return code, operands, self.captured, classes.contiguous()


_NO_PROGRAM: tuple[Any, ...] = (None, None, [], None)


def _program_arguments(program: _Program | None, tile: tuple[int, int]) -> tuple[Any, ...]:
    return _NO_PROGRAM if program is None else program.arguments(tile)


_DropoutArguments = tuple[bool, int, int, int, float, int, int, int]
_NO_DROPOUT: _DropoutArguments = (False, 0, 0, 0, 1.0, 0, 0, 0)


def _dropout_arguments(dropout: Dropout | None) -> _DropoutArguments:
    """The kernel's dropout arguments (§18): active, the seed's (low, high) words (its bits read unsigned), the
    threshold, the float32 scale 1 / (1 − p) and the (head, query, key) offsets; read once per call, so the backward
    regenerates the forward's mask from the same words."""
    if dropout is None:
        return _NO_DROPOUT
    seed = int(dropout.seed.item()) & 0xFFFF_FFFF_FFFF_FFFF
    return (True, seed & 0xFFFF_FFFF, seed >> 32, dropout.threshold, dropout.scale(False),
            int(dropout.head_start), int(dropout.query_start), int(dropout.key_start))  # fmt: skip


class _CpuFlash(torch.autograd.Function):
    """(out, lse) for float32 contiguous bhsd q, k, v; U = q_scale q kᵀ is the score (or the tanh argument).

    ``mask`` (uint8, 0 = hidden) and ``bias`` (float32) are 4-D and broadcastable to (B, Hq, Lq, Lk), passed as they
    are: the kernel reads them through their strides, so nothing of size Lq × Lk is made that the caller did not
    pass. dbias comes back in the bias's own shape. Dropout's keep-mask is regenerated per tile from its seed in both
    passes (nothing of it is saved)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        bias: torch.Tensor | None,
        q_lens: torch.Tensor,
        kv_lens: torch.Tensor,
        segments: _Segments,
        band: _Band,
        softcap: float,
        q_scale: float,
        slopes: torch.Tensor | None,
        program: _Program | None,
        dropout: _DropoutArguments,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tile = band.tile(FORWARD_TILE, program)
        out, lse = _kernel().forward(
            q, k, v, q_lens, kv_lens, mask, bias, slopes, *segments, SEGMENT_GRANULE, *band.arguments(), softcap,
            q_scale, *tile, *_program_arguments(program, tile), *dropout,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, q_lens, kv_lens, mask, bias, slopes)
        ctx.segments, ctx.band, ctx.softcap, ctx.q_scale, ctx.program = segments, band, softcap, q_scale, program
        ctx.dropout = dropout
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse, q_lens, kv_lens, mask, bias, slopes = ctx.saved_tensors
        need_dbias = bias is not None and ctx.needs_input_grad[4]
        dout = dout.contiguous()
        delta = (dout * out).sum(dim=-1)
        if dlse is not None:
            delta = delta - dlse
        tile = ctx.band.tile(WINDOW_BACKWARD_TILE if ctx.band.low is not None else BACKWARD_TILE, ctx.program)
        dq, dk, dv, dbias = _kernel().backward(
            q, k, v, dout, lse, delta.contiguous(), q_lens, kv_lens, mask, bias, slopes, *ctx.segments,
            SEGMENT_GRANULE, need_dbias, *ctx.band.arguments(), ctx.softcap, ctx.q_scale, *tile,
            *_program_arguments(ctx.program, tile), *ctx.dropout,
        )  # fmt: skip
        if need_dbias:  # the kernel's (B, Hq, …) planes, summed over the batch and heads the bias broadcasts along
            broadcast = [axis for axis in (0, 1) if bias.shape[axis] == 1]
            dbias = dbias.sum(dim=broadcast, keepdim=True) if broadcast else dbias
        return dq, dk, dv, None, dbias if need_dbias else None, *[None] * 9


# The kernel's segment arguments: q_ids (B, Lq) and kv_ids (B, Lk) int64, and their summaries (B, granules, 3) per
# SEGMENT_GRANULE positions; four Nones without segment ids.
_Segments = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _segments(band: Band) -> _Segments:
    if not band.has_segments:
        return None, None, None, None
    assert band.q_segment_ids is not None and band.kv_segment_ids is not None
    query_tiles, key_tiles = band.segment_tiles(SEGMENT_GRANULE, SEGMENT_GRANULE)
    q_ids, kv_ids = (ids.long().contiguous() for ids in (band.q_segment_ids, band.kv_segment_ids))
    return q_ids, kv_ids, query_tiles.packed(), key_tiles.packed()


def flash_attention(spec: AttentionSpec, inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) per the contract, differentiable by torch autograd; lse float32 (B, Hq, Lq)."""
    q, k, v = (to_bhsd(spec, x) for x in inputs[:3])
    head_dim = q.shape[-1]
    # The kernel takes every element's lengths (the full ones where none are given) and aligns the band by them.
    geometry = Band(spec, inputs, q.shape[2], k.shape[2])
    # Padding (beyond the lengths) is never read: the kernel's row and key ranges stop at the lengths, and it writes
    # out 0, lse −inf and zero gradients there itself, so NaN in the padding cannot leak (§5) and needs no copy
    # (zeroing a ragged KV cache first cost 25 ms per tensor at B=4, H=8, Lk=4096, where the decode step takes ~5).
    # Cosine is the exception: torch normalises every row, padding included, and its backward would carry NaN from
    # there into dq and dk (0·NaN), so q and k are zeroed beyond the lengths first. Positions with a negative segment
    # id are zeroed (a copy) where there are any: they lie inside the tiles the kernel reads, where 0·NaN would leak.
    q, k, v = q.float(), k.float(), v.float()
    cosine = spec.variant is Variant.COSINE
    q_ids, kv_ids = (
        ids if ids is not None and bool((ids < 0).any()) else None
        for ids in (inputs.q_segment_ids, inputs.kv_segment_ids)
    )
    q = zero_padding(q, inputs.q_lengths if cosine else None, q_ids)
    k = zero_padding(k, inputs.kv_lengths if cosine else None, kv_ids)
    v = zero_padding(v, None, kv_ids)
    q, k = normalize_if_cosine(spec, q), normalize_if_cosine(spec, k)
    scale = spec.resolved_scale(head_dim)
    # The mask's bytes as uint8 (a view: no copy); the bias in float32 (§7: added in the compute dtype), which
    # autograd casts dbias back from.
    mask = inputs.mask.view(torch.uint8) if inputs.mask is not None else None
    bias = inputs.bias.float() if inputs.bias is not None else None
    slopes = _kernel_slopes(inputs.alibi_slopes, q.shape[0], q.shape[1])
    out, lse = _CpuFlash.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), mask, bias,
        geometry.q_len.contiguous(), geometry.kv_len.contiguous(), _segments(geometry),
        _Band.of(spec), spec.softcap or 0.0, scale / spec.softcap if spec.softcap is not None else scale, slopes,
        _Program.of(inputs.mask_program, q, k.shape[2]), _dropout_arguments(inputs.dropout),
    )  # fmt: skip
    return from_bhsd(spec, out.to(inputs.q.dtype)), lse


def _kernel_slopes(slopes: torch.Tensor | None, batch: int, heads_q: int) -> torch.Tensor | None:
    """ALiBi's (1|B, Hq) float32 slopes (§16) as the kernel takes them: (B, Hq), contiguous."""
    return None if slopes is None else slopes.expand(batch, heads_q).contiguous()


# Split-K did not pay on the 2 shared cores it was measured on (B=1, Hq=Hkv=8, Lk=32768, block 256, 2 threads: 2 key
# ranges took 1.05x the time of 1, load average 11), so it starts from 4 threads, where it is untried.
SPLIT_K_MIN_THREADS = 4


def decode_splits(tasks: int, keys: int, threads: int) -> int:
    """Split-K's key ranges per row: enough for every thread when the (sequence, query block) tasks are fewer than
    the threads, each range at least two tiles long; 1 otherwise, and below SPLIT_K_MIN_THREADS."""
    if tasks >= threads or threads < SPLIT_K_MIN_THREADS:
        return 1
    return max(1, min(-(-threads // max(tasks, 1)), keys // (2 * FORWARD_TILE[1])))


def paged_attention(spec: AttentionSpec, inputs: PagedInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of an attend_paged call (§13): the kernel reads the caches' blocks through the table, in their
    dtype (q alone is widened to float32 here)."""
    q = normalize_if_cosine(spec, to_bhsd(spec, inputs.q).float()).contiguous()
    batch, heads_q, len_q, head_dim = q.shape
    kv_len = inputs.kv_lengths.to(torch.long).contiguous()
    q_len = torch.full((batch,), len_q, dtype=torch.long)
    scale = spec.resolved_scale(head_dim)
    band = _Band.of(spec)
    block_q, block_k = band.tile(FORWARD_TILE)
    splits = decode_splits(batch * -(-len_q // block_q), int(kv_len.max()) if batch else 0, torch.get_num_threads())
    out, lse = _kernel().forward_paged(
        q, inputs.k_cache.contiguous(), inputs.v_cache.contiguous(), inputs.block_table.contiguous(), q_len, kv_len,
        _kernel_slopes(inputs.alibi_slopes, batch, heads_q), *band.arguments(), spec.softcap or 0.0,
        scale / spec.softcap if spec.softcap is not None else scale,
        COSINE_EPS if spec.variant is Variant.COSINE else 0.0, block_q, block_k, splits,
    )  # fmt: skip
    return from_bhsd(spec, out.to(inputs.q.dtype)), lse


class CpuFlashBackend(RecomputingBackend):
    """attnkit's FlashAttention-2 CPU kernel (kernel.cpp): every feature, float16, bfloat16 and float32."""

    name = "cpu-flash"
    capabilities = Capabilities(
        length_generic=True,
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        devices=frozenset({"cpu"}),
        features=ALL_FEATURES,
        description="attnkit's FlashAttention-2 CPU kernel in C++ (MKL sgemm + vectorised softmax), built on first use",
        notes=(
            "mask, bias: read per tile through their strides (broadcast axes never expanded); dbias per batch "
            "element and query head (B, Hq, Lq|1, Lk|1), then summed to the bias's shape",
            "float64: left to torch-chunked and torch-naive (the kernel computes in float32)",
            "paged: caches read where they lie, half types widened as they are read (decode rows slot by slot for "
            "every head, in address order; more rows one GEMM per block piece of a tile); split-K over the keys "
            "when a decode call has fewer rows than threads",
            "half types: widened to float32 exactly, results rounded back once",
            "mask programs: one int32 interpreter compiled with the kernel runs them on tiles the program's tile "
            "classes call partial; empty tiles are never read, full ones never evaluated (docs/cpu_flash.md)",
            "dropout: Philox4x32-10 vectorised over counters, one counter's words for four keys, generated per tile "
            "row on the keys the band lets it see and regenerated in the backward (no mask is stored)",
            "first call builds kernel.cpp (tens of seconds, cached under TORCH_EXTENSIONS_DIR); a failed build makes "
            "it unavailable with the reason (docs/cpu_flash.md)",
        ),
    )

    def cold_start(self, spec: AttentionSpec, problem: Problem) -> str | None:
        if EXTENSION.built():
            return None
        return "its first call builds kernel.cpp (tens of seconds; measured in a process after the build)"

    def run_time_builds(self) -> tuple[TorchExtension, ...]:
        return (EXTENSION,)

    def available(self) -> list[str]:
        blas = _blas_reason()
        return [*EXTENSION.problems(), *([blas] if blas else [])]

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[torch.Tensor, Any]:
        with torch.no_grad():
            return flash_attention(spec, inputs)

    def forward_paged(self, spec: AttentionSpec, inputs: PagedInputs, need_lse: bool) -> tuple[torch.Tensor, Any]:
        with torch.no_grad():
            return paged_attention(spec, inputs)

    def differentiable_forward(self, spec: AttentionSpec, problem: Problem) -> Runner:
        return functools.partial(flash_attention, spec)

    def recompute(self, spec: AttentionSpec, inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """For callers of the protocol's backward: the forward again under torch autograd."""
        return flash_attention(spec, inputs)
