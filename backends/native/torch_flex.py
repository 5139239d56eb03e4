"""``torch-flex``: the contract lowered onto ``torch.nn.attention.flex_attention``, compiled by inductor for CPU.

What flex_attention does on CPU in torch 2.13 (measured; docs/native.md): the compiled forward lowers to a fused
C++ template that skips hidden key blocks, for float32, bfloat16 and float16 only. It cannot return the
logsumexp ("torch.compile on CPU only supports inference and `return_lse` is not supported yet") and it has no
backward at all, compiled or eager ("FlexAttention does not support backward on CPU"). Eager flex_attention
materialises the full (Lq, Lk) scores. Dynamic shapes (``dynamic=True``) fail in the C++ compiler for most
shapes, so kernels compile statically (a few seconds each) for bucketed shapes: batch to a power of two, lengths
to 16, 32, 64, 128 and then whole 128-blocks, head dims to multiples of 16 (``bucket_*``). Padded queries are
dropped, padded keys and batch elements are hidden (the block mask skips them), zero head-dim columns add nothing.

The lowering:

* Scores: ``score_mod`` applies scale, softcap, bias and ALiBi in that order (§3, §16) to the float32 score the kernel
  accumulates; flex's own ``scale`` is 1. Scale, softcap, offsets and window sides are 0-d or (B,) tensors
  captured by the mods, never Python numbers, so a new value does not recompile (dynamo specialises on floats).
* Visibility: ``mask_mod`` is §4 (causal and window aligned per batch, lengths); a user mask is folded into one
  dense visibility tensor it reads (the user mask is (Lq, Lk) already). The :class:`BlockMask` is built from
  per-row key ranges, block by block, never from a dense (Lq, Lk) grid, so memory stays linear in L.
* Mask programs (§17): flex's own idea. The program becomes Python source, one temporary per node
  (:func:`program_source`), that the ``mask_mod`` calls on flex's index tensors, ANDed with the clauses above. The
  BlockMask takes the program's tile classes (:func:`attnkit.contract.programs.cached_tile_classes`, from value
  ranges: linear in the blocks, no (Lq, Lk) grid) through ``BlockMask.from_kv_blocks`` as it takes the band's:
  blocks the program hides are skipped, blocks it shows whole (and the band too) run without the mask_mod, rather
  than ``create_block_mask``'s evaluation of every pair. Rows the program leaves empty are found by evaluating it a
  block of rows at a time.
* Segment ids (§4.5), FlexAttention's document masking: a ``mask_mod`` clause, and blocks kept only where the
  blocks' id ranges meet (:class:`SegmentTiles`); q, k, v are zeroed at negative ids before the kernel and any
  hand-over, so padding is never input.
* lse, which the CPU kernel cannot return, comes out of the same fused pass through a sink key: one key after
  the (padded) keys, with score ``t`` (a per-row bound of the scores, below) and v gets two columns, 1 on the real keys
  and 1 on the sink. The kernel then returns ``o_real = Σ_real p`` and ``o_sink = p_sink``, and
  ``lse = t + log(o_real) − log(o_sink)``, ``out = out' / o_real``. Both are exact up to float32 rounding while
  ``|t − lse|`` is within float32's exponent range; ``t`` is an upper bound of the row's scores less a margin,
  and a row where either column underflows sends the whole call to ``torch-chunked`` (exact, linear memory).
  This pass runs in float32 (float16 cannot hold the small columns).
* Gradients: flex has none on CPU, so ``backward`` is ``torch-chunked``'s FlashAttention-2 backward, from this
  forward's ``out`` and ``lse``.
* Fully masked rows: found from the row ranges and ids (:meth:`Band.empty_rows`) or the dense visibility, set to out 0
  and lse −inf.
* Padding beyond lengths is zeroed before the kernel (0·NaN would otherwise reach visible rows).
* NaN: the CPU kernel can turn a row whose scores include NaN into a finite one, so a call with NaN in q, k, v or
  bias (outside padding) runs on ``torch-chunked``, which propagates it (§5).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from attnkit.backend import (
    ALL_FEATURES,
    AttentionInputs,
    AttentionSpec,
    Backend,
    BaseBackend,
    Capabilities,
    Delegation,
    Feature,
    Framework,
    Gradients,
    Problem,
    Variant,
    delegated,
    peer_backend,
)
from attnkit.contract import conjoin, within_band
from attnkit.contract.programs import (
    FULL,
    PARTIAL,
    ArrayOps,
    BoundProgram,
    MaskProgram,
    array_ops,
    cached_tile_classes,
    evaluate,
    nodes,
)
from attnkit.contract.torch import (
    Band,
    SegmentTiles,
    block_of,
    cosine_normalize,
    from_bhsd,
    to_bhsd,
    without_segment_padding,
    zero_padding,
)

BLOCK_SIZE = 128  # the BlockMask block; the CPU kernel's default
MAX_TESTED_HEAD_DIM = 512  # the C++ template states no limit; 1..512 (and Dv != D) agree with the oracle here
# The sink's score sits this far below the row's score bound: lse lies in [max score, bound + log Lk], so the two
# columns stay inside float32's normal range (e^±87) for bounds up to ~(87 + margin) above the true maximum.
SINK_MARGIN = 32.0
TINY = torch.finfo(torch.float32).tiny  # below it a column has lost precision (subnormal): fall back
# The bfloat16/float16 kernel beats float32 only with AMX tiles; measured without them (AVX-512 with bf16), it took
# 1.8x as long as the float32 kernel on the same inputs (B=1 H=8 L=2048 D=64 causal, one thread).
HALF_KERNELS_FAST = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
HUGE = 1e30  # a finite stand-in for an unbounded score bound; the underflow check then sends the call to fallback

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch < 2.5
    flex_attention = None  # type: ignore[assignment]
    BlockMask = None  # type: ignore[assignment,misc]


def _api_reason() -> str | None:
    """Why this torch's flex_attention API cannot serve the lowering (tested with torch 2.13), or None."""
    if flex_attention is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    parameters = inspect.signature(BlockMask.from_kv_blocks).parameters
    missing = [name for name in ("seq_lengths", "compute_q_blocks") if name not in parameters]
    if missing:
        return f"torch {torch.__version__}: BlockMask.from_kv_blocks lacks {', '.join(missing)} (tested with 2.13)"
    return None


def cpu_template_supported() -> bool:
    """Whether inductor's C++ flex template runs here: inductor's own rule (``check_cpu_supported`` in
    torch._inductor.kernel.flex.flex_cpu, torch 2.13), read without importing inductor (seconds at a process's first
    attend). tests/test_native_backends.py holds it to inductor's."""
    avx2 = torch.cpu._is_avx2_supported() and os.environ.get("ATEN_CPU_CAPABILITY") != "default"
    return avx2 and not torch.xpu.is_available() and sys.platform != "darwin"


def _cpu_template_reason() -> str | None:
    """Why inductor's C++ flex template cannot run here, or None."""
    return None if cpu_template_supported() else "inductor's CPU flex_attention template needs AVX2 (x86)"


def _flex_call(q: Any, k: Any, v: Any, score_mod: Any, block_mask: Any, enable_gqa: bool) -> Any:
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=1.0, enable_gqa=enable_gqa)


class _CompiledCache:
    """One compiled ``flex_attention`` per call signature (shapes, dtype, which mods, threads).

    Each entry compiles a copy of ``_flex_call`` with its own code object: dynamo keeps its graphs and its
    recompile limit (8) per code object, so one shared function would fall back to eager (unfused, quadratic
    memory) after eight shapes. Compiled statically: ``dynamic=True`` fails in the C++ compiler (torch 2.13).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._functions: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def __len__(self) -> int:
        return len(self._functions)

    def has_shape(self, q_shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether a kernel for queries of this (bucketed) shape and dtype, on this many threads, is compiled (its
        mods may still differ: close enough to say that the compiler has run for the call's kind)."""
        threads = torch.get_num_threads()
        with self._lock:
            return any(key[0] == q_shape and key[3] == dtype and key[5] == threads for key in self._functions)

    def get(self, key: tuple[Any, ...]) -> Callable[..., Any]:
        with self._lock:
            function = self._functions.get(key)
            if function is None:
                code = _flex_call.__code__.replace(co_name=f"_flex_call_{len(self._functions)}")
                fresh = types.FunctionType(code, _flex_call.__globals__, code.co_name)
                function = torch.compile(fresh, dynamic=False, fullgraph=True)
                self._functions[key] = function
            return function


COMPILED = _CompiledCache()
# Calls with fewer (query, key) pairs than this (after bucketing) run flex_attention eagerly: its unfused kernel
# materialises the scores, which at this size costs less than the seconds a new compiled shape takes (decode steps,
# short prompts, and the test suite's small shapes), and the score and mask mods are the same.
COMPILE_MIN_PAIRS = 256 * 256


def _eager(q: Any, k: Any, v: Any, score_mod: Any, block_mask: Any, enable_gqa: bool) -> Any:
    with warnings.catch_warnings():  # flex warns that the eager path is unfused: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        return _flex_call(q, k, v, score_mod, block_mask, enable_gqa)


# What runs torch-chunked's code (exact, linear memory), reached through the registry as any backend is.
FALLBACK = "torch-chunked"
EMPTY = Delegation(FALLBACK, "calls with no queries or no keys (§9)")
NAN_INPUTS = Delegation(FALLBACK, "calls with NaN in q, k, v or bias (the CPU kernel may not propagate it, §5)")
LSE_RANGE = Delegation(FALLBACK, "calls whose lse the sink cannot carry in float32 (a normaliser column underflows)")
BACKWARD = Delegation(FALLBACK, "backward passes, from flex's out and lse (flex has no CPU backward)")


def bucket_length(n: int) -> int:
    """The sequence length a call is compiled for: 0 and 1 (decode) as they are, then powers of two from 16 to one
    block, then whole blocks. Padding costs a copy and at most one partial block; compiling costs seconds."""
    if n <= 1:
        return n
    if n <= BLOCK_SIZE:
        return max(16, 1 << (n - 1).bit_length())
    return -(-n // BLOCK_SIZE) * BLOCK_SIZE


def bucket_batch(n: int) -> int:
    """Batch sizes compiled for: powers of two. Padded batch elements see no key, so the block mask skips them."""
    return 1 << (n - 1).bit_length()


def bucket_head_dim(n: int) -> int:
    """Head dims compiled for: multiples of 16. Zero columns add nothing to q·k and are cut from out."""
    return -(-n // 16) * 16


def _padded(x: torch.Tensor, shape: tuple[int, ...], value: float = 0.0, broadcast: bool = False) -> torch.Tensor:
    """x padded with ``value`` at the end of each axis up to ``shape``; with ``broadcast``, axes of size 1 stay 1."""
    pads: list[int] = []
    for size, target in zip(reversed(x.shape), reversed(shape)):
        pads += [0, 0 if broadcast and size == 1 else target - size]
    return F.pad(x, pads, value=value) if any(pads) else x


def _dense_blocks_to_mask(
    partial: torch.Tensor, full: torch.Tensor, len_q: int, len_k: int, mask_mod: Any
) -> BlockMask:
    """A BlockMask from (B, H|1, nQ, nK) booleans: blocks that need mask_mod, and blocks seen whole."""

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = blocks.sum(-1, dtype=torch.int32)
        indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts, indices

    kv_num, kv_indices = ordered(partial)
    full_num, full_indices = ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=BLOCK_SIZE,
        mask_mod=mask_mod,
        seq_lengths=(len_q, len_k),
        compute_q_blocks=False,  # the query-side indices serve flex's backward, which CPU does not have
    )


def _row_blocks(
    key_ranges: tuple[torch.Tensor, torch.Tensor],
    batch: int,
    kernel_len_k: int,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, 1, nQ, nK) partial and full blocks from the rows' key ranges (:meth:`Band.key_ranges`) and the
    segment ids (padded to ``batch`` and the kernel's lengths; per-block id ranges, :class:`SegmentTiles`): B·Lq·nK
    work and memory, no (Lq, Lk) grid.

    ``batch`` may exceed the rows' batch (bucket padding): those elements see nothing, so their blocks are skipped.
    """
    first, last = key_ranges
    len_q = first.shape[1]
    n_q, n_k = -(-len_q // BLOCK_SIZE), -(-kernel_len_k // BLOCK_SIZE)
    rows_pad, batch_pad = n_q * BLOCK_SIZE - len_q, batch - first.shape[0]
    big = kernel_len_k + 1

    def laid_out(x: torch.Tensor, past_rows: int, past_batch: int) -> torch.Tensor:
        x = F.pad(F.pad(x, (0, rows_pad), value=past_rows), (0, 0, 0, batch_pad), value=past_batch)
        return x.view(batch, n_q, BLOCK_SIZE, 1)

    # Rows past Lq are computed and dropped: they see nothing for "any" and do not spoil "all".
    first_any, last_any = laid_out(first, big, big), laid_out(last, -1, -1)
    first_all, last_all = laid_out(first, 0, big), laid_out(last, big, -1)
    starts = torch.arange(n_k, device=first.device) * BLOCK_SIZE
    ends = torch.clamp(starts + BLOCK_SIZE, max=kernel_len_k) - 1
    seen = (torch.maximum(first_any, starts) <= torch.minimum(last_any, ends)).any(dim=2)
    whole = ((first_all <= starts) & (last_all >= ends)).all(dim=2)
    seen, whole = seen.unsqueeze(1), whole.unsqueeze(1)
    if segments is not None:  # blocks whose documents cannot meet are skipped; whole ones stay whole
        q_tiles, kv_tiles = (SegmentTiles.of(ids, BLOCK_SIZE) for ids in segments)
        meet, same_document = (pairs.unsqueeze(1) for pairs in q_tiles.pairs(kv_tiles))
        seen, whole = seen & meet, whole & same_document
    return seen & ~whole, whole


def _dense_blocks(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B|1, H|1, nQ, nK) partial blocks (any visible pair) of a dense visibility; no block is taken as whole."""
    len_q, len_k = visible.shape[-2:]
    n_q, n_k = -(-len_q // BLOCK_SIZE), -(-len_k // BLOCK_SIZE)
    padded = F.pad(visible, (0, n_k * BLOCK_SIZE - len_k, 0, n_q * BLOCK_SIZE - len_q), value=False)
    seen = padded.view(*visible.shape[:2], n_q, BLOCK_SIZE, n_k, BLOCK_SIZE).any(dim=5).any(dim=3)
    return seen, torch.zeros_like(seen)


_PROGRAM_OPERATORS = {
    "add": "({0} + {1})",
    "sub": "({0} - {1})",
    "mul": "({0} * {1})",
    "floordiv": "({0} // {1})",
    "mod": "({0} % {1})",
    "tdiv": "ops.tdiv({0}, {1})",
    "trem": "ops.trem({0}, {1})",
    "min": "ops.minimum({0}, {1})",
    "max": "ops.maximum({0}, {1})",
    "eq": "({0} == {1})",
    "ne": "({0} != {1})",
    "lt": "({0} < {1})",
    "le": "({0} <= {1})",
    "gt": "({0} > {1})",
    "ge": "({0} >= {1})",
    "and": "({0} & {1})",
    "or": "({0} | {1})",
    "xor": "({0} ^ {1})",
    "neg": "(-{0})",
    "abs": "abs({0})",
    "not": "ops.logical_not({0})",
    "int": "ops.to_int({0})",
    "bool": "({0} != 0)",
    "where": "ops.where({0}, {1}, {2})",
}
_INDEX_NAMES = {"b": "b", "h": "h", "q": "q_idx", "kv": "kv_idx"}


def program_source(program: MaskProgram) -> str:
    """``program`` as the source of ``program(b, h, q_idx, kv_idx, captured, ops)``: one temporary per node in
    dependency order (:func:`attnkit.contract.programs.nodes`), plain torch operators on flex's index tensors, so
    that dynamo traces straight code (no tree walk, no hashing of nodes). Reads clamp as the contract's evaluation
    does (``ops.read``)."""
    order = nodes(program.expr)
    number = {node: n for n, node in enumerate(order)}
    lines = ["def program(b, h, q_idx, kv_idx, captured, ops):"]
    for n, node in enumerate(order):
        args = [f"t{number[arg]}" for arg in node.args]
        if node.op == "index":
            value = _INDEX_NAMES[str(node.value)]
        elif node.op == "const":
            value = repr(node.value)
        elif node.op == "read":
            read = f"ops.read(captured[{node.value}], ({''.join(a + ', ' for a in args)}))"
            value = read if node.kind == "bool" else f"ops.to_int({read})"
        else:
            value = _PROGRAM_OPERATORS[node.op].format(*args)
        lines.append(f"    t{n} = {value}")
    lines.append(f"    return t{len(order) - 1}")
    return "\n".join(lines) + "\n"


class _ProgramOps(ArrayOps):
    """The contract's torch array operations, and a ``not`` that keeps a Python bool a bool."""

    def logical_not(self, x: Any) -> Any:
        return not x if isinstance(x, bool) else ~x


_PROGRAM_OPS = _ProgramOps(torch, "torch")


@functools.lru_cache(maxsize=256)
def compiled_program(program: MaskProgram) -> Callable[..., Any]:
    """The function :func:`program_source` writes, once per program (programs are hashable)."""
    namespace: dict[str, Any] = {}
    exec(compile(program_source(program), f"<mask program {program.name}>", "exec"), namespace)  # noqa: S102
    return namespace["program"]  # type: ignore[no-any-return]


def _static_view(tensor: torch.Tensor) -> torch.Tensor:
    view = tensor.view(tensor.shape)
    torch._dynamo.mark_static(view)
    return view


def _program_blocks(
    bound: BoundProgram, batch: int, heads: int, len_q: int, len_k: int, kernel_len_q: int, kernel_len_k: int,
    like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(B|1, H|1, nQ, nK) partial and full blocks of the program over the kernel's block grid (``kernel_len_*``:
    the padded lengths; blocks past the call's lengths are neither), from its tile classes."""
    classes = cached_tile_classes(bound, batch, heads, len_q, len_k, BLOCK_SIZE, BLOCK_SIZE, like)
    n_q, n_k = -(-kernel_len_q // BLOCK_SIZE), -(-kernel_len_k // BLOCK_SIZE)
    pads = (0, n_k - classes.shape[3], 0, n_q - classes.shape[2])
    partial, full = (F.pad(classes == kind, pads, value=False) for kind in (PARTIAL, FULL))
    return partial, full


def _program_empty_rows(
    bound: BoundProgram, visible_rows: Callable[[int, int], torch.Tensor | None], batch: int, heads: int,
    len_q: int, len_k: int, like: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """(B, H|1, Lq) bool: the rows that see no key through ``visible_rows(r0, r1)`` (the call's other clauses,
    (B|1, H|1, rows, Lk) or None) and the program, a block of rows at a time (memory B·H·block·Lk)."""
    device = like.device
    env = {
        "b": torch.arange(batch, device=device).view(-1, 1, 1, 1),
        "h": torch.arange(heads, device=device).view(1, -1, 1, 1),
        "kv": torch.arange(len_k, device=device).view(1, 1, 1, -1),
    }
    used, ops = bound.expr.indices(), array_ops(like)
    sizes = (batch if "b" in used else 1, heads if "h" in used else 1)
    empty = []
    for r0 in range(0, len_q, BLOCK_SIZE):
        r1 = min(r0 + BLOCK_SIZE, len_q)
        env["q"] = torch.arange(r0, r1, device=device).view(1, 1, -1, 1)
        program = ops.broadcast(evaluate(bound.expr, ops, env, bound.captured), (*sizes, r1 - r0, len_k), like)
        seen = conjoin(visible_rows(r0, r1), program).any(dim=-1)
        empty.append(~seen.expand(batch, seen.shape[1], r1 - r0))
    return torch.cat(empty, dim=-1)


def _index(tensor_shape: torch.Size, b: Any, h: Any, i: Any, j: Any) -> tuple[Any, Any, Any, Any]:
    """Indices into a (B|1, H|1, Lq|1, Lk|1) tensor: 0 along a broadcast axis."""
    return tuple(index if size > 1 else 0 for index, size in zip((b, h, i, j), tensor_shape))  # type: ignore[return-value]


def _mods(
    spec: AttentionSpec,
    lengths: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    band_sides: tuple[int | None, int | None],
    segments: tuple[torch.Tensor, torch.Tensor] | None,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: float,
    sink: tuple[int, torch.Tensor] | None,
    device: torch.device,
    slopes: torch.Tensor | None = None,
    program: BoundProgram | None = None,
) -> tuple[Any, Any, tuple[Any, ...]]:
    """(score_mod, mask_mod, structure): the mods for this call, and what of them changes the compiled graph.

    ``lengths`` is (offset, q_len, kv_len), each (B,); ``band_sides`` is :class:`Band`'s (lower, upper) on
    j − i − offset; ``segments`` is (q ids (B, Lq), kv ids (B, Lk)), or None; ``sink`` is (its key index,
    (B, Hq, Lq) scores); ``slopes`` ALiBi's (B, Hq) float32 (§16), or None; ``program`` a mask program, ANDed.
    Every number is a tensor the mods capture, so new values reuse the compiled kernel.
    """
    scale_t = torch.tensor(scale, dtype=torch.float32, device=device)
    softcap = torch.tensor(spec.softcap, dtype=torch.float32, device=device) if spec.softcap is not None else None
    offset, q_len, kv_len = lengths
    lower, upper = (torch.tensor(side, device=device) if side is not None else None for side in band_sides)
    sink_index, sink_scores = sink if sink is not None else (-1, None)
    program_function = compiled_program(program.program) if program is not None else None
    # Views of the captured tables marked static: dynamo would make a table dynamic once its shape changes between
    # calls, and a data-dependent read of a dynamic table cannot be traced. Views: the user's tensors stay unmarked.
    captured = [_static_view(t) for t in program.captured] if program is not None else []

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        score = score * scale_t
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            score = score + bias[_index(bias.shape, b, h, q_idx, kv_idx)]
        if slopes is not None:
            score = score - slopes[b, h] * torch.abs(q_idx + offset[b] - kv_idx)
        if sink_scores is not None:
            score = torch.where(kv_idx == sink_index, sink_scores[b, h, q_idx], score)
        return score

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if visible is not None:  # the dense visibility: user mask, and everything else, already folded in
            allowed = visible[_index(visible.shape, b, h, q_idx, kv_idx)] & (kv_idx < kv_len[b])
        else:
            allowed = (kv_idx < kv_len[b]) & (q_idx < q_len[b])
            if lower is not None or upper is not None:
                allowed = allowed & within_band(kv_idx - q_idx - offset[b], lower, upper)
            if segments is not None:  # §4.5: the same document, not padding
                query_id = segments[0][b, q_idx]
                allowed = allowed & (query_id == segments[1][b, kv_idx]) & (query_id >= 0)
        if program_function is not None:  # §17: the program's clause, on the same indices
            allowed = allowed & program_function(b, h, q_idx, kv_idx, captured, _PROGRAM_OPS)
        if sink_scores is not None:
            allowed = allowed | (kv_idx == sink_index)
        return allowed

    # What the traced graph depends on besides q, k and v: which branches run and the shapes the mods index.
    structure = (
        softcap is not None,
        None if bias is None else tuple(bias.shape),
        None if visible is None else tuple(visible.shape),
        segments is not None,
        sink_index,
        lower is not None,
        upper is not None,
        slopes is not None,
        program.program if program is not None else None,  # its captured shapes are the program's
    )
    return score_mod, mask_mod, structure


def _score_bound(
    spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """(B, Hq, Lq) float64: an upper bound of each row's scores (Cauchy–Schwarz, softcap, bias max).

    Non-finite norms count as 0: a NaN key poisons only the rows that see it, through the kernel itself.
    """
    heads_q, heads_kv = q.shape[1], k.shape[1]
    q_norm = torch.linalg.vector_norm(q.double(), dim=-1).nan_to_num(0.0, 0.0, 0.0)
    k_norm = torch.linalg.vector_norm(k.double(), dim=-1).nan_to_num(0.0, 0.0, 0.0)
    k_max = k_norm.amax(dim=-1).repeat_interleave(heads_q // heads_kv, dim=1)
    bound = (scale * q_norm * k_max.unsqueeze(-1)).clamp(max=HUGE)
    if spec.softcap is not None:
        bound = spec.softcap * torch.tanh(bound / spec.softcap)
    if bias is not None:
        bias_max = bias.double().nan_to_num(0.0, HUGE, -HUGE).amax(dim=-1).clamp(-HUGE, HUGE)
        bound = bound + bias_max.expand(q.shape[0], heads_q, q.shape[2])
    return bound


def _normalised_by_sink(
    out: torch.Tensor, sink_scores: torch.Tensor, live: torch.Tensor, dim_v: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out, lse) from the sink pass's (B, Hq, Lq, ≥ Dv+2) output; None where a live row's columns underflowed.

    Columns Dv and Dv+1 are o_real = Σ_real p and o_sink = p_sink, p normalised over real keys and sink together:
    lse = t + log o_real − log o_sink (float64, so t and the logs do not cancel in float32), out = out' / o_real.
    """
    real_weight, sink_weight = out[..., dim_v].double(), out[..., dim_v + 1].double()
    if bool((live & ((real_weight < TINY) | (sink_weight < TINY))).any()):
        return None
    lse = (sink_scores.double() + torch.log(real_weight) - torch.log(sink_weight)).float()
    return out[..., :dim_v] / out[..., dim_v : dim_v + 1], lse.masked_fill(~live, float("-inf"))


def flex_forward(spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[torch.Tensor, Any] | Delegation:
    """(out, lse) per the contract, lse None when not asked for; or the :class:`Delegation` that takes the call.
    Not differentiable (see ``backward``)."""
    # detach: flex refuses inputs that require grad on CPU, even under no_grad; gradients come from ``backward``.
    q, k, v = (to_bhsd(spec, x).detach() for x in (inputs.q, inputs.k, inputs.v))
    batch, heads_q, len_q, head_dim = q.shape
    heads_kv, len_k, dim_v = k.shape[1], k.shape[2], v.shape[-1]
    if q.numel() == 0 or len_k == 0:  # §9: nothing for a kernel to do
        return EMPTY
    dtype = q.dtype
    # With lse the two normaliser columns need float32's range (float16 cannot hold them), so that pass computes
    # in float32; so does every call without AMX, where the float32 kernel is the faster one (docs/native.md).
    kernel_dtype = dtype if dtype == torch.float32 or (HALF_KERNELS_FAST and not need_lse) else torch.float32
    scale = spec.resolved_scale(head_dim)
    q, k, v = zero_padding(q, inputs.q_lengths), zero_padding(k, inputs.kv_lengths), zero_padding(v, inputs.kv_lengths)
    if spec.variant is Variant.COSINE:
        # In float32: 1e-12 underflows to 0 in float16, and 0/0 would make a zero (padding) row NaN.
        q, k = (cosine_normalize(x.float()) for x in (q, k))
    q, k, v = q.to(kernel_dtype), k.to(kernel_dtype), v.to(kernel_dtype)
    if any(bool(x.isnan().any()) for x in (q, k, v, inputs.bias) if x is not None):
        # The CPU kernel does not propagate NaN scores reliably (a row that sees a NaN key can come out finite);
        # §5 wants NaN out wherever a visible input is NaN. Rare, so the exact path takes the whole call.
        return NAN_INPUTS
    band = Band(spec, inputs, len_q, len_k)
    key_ranges = band.key_ranges()
    dense = band.visible(mask=inputs.mask) if inputs.mask is not None else None
    program = inputs.mask_program
    if program is not None:  # the rows it empties, beyond those of the other clauses

        def visible_rows(r0: int, r1: int) -> torch.Tensor | None:
            rows = slice(r0, r1)
            return block_of(dense, rows, slice(None)) if dense is not None else band.visible(rows)

        empty = _program_empty_rows(program, visible_rows, batch, heads_q, len_q, len_k, q)
    else:
        empty = ~dense.any(dim=-1) if dense is not None else band.empty_rows().unsqueeze(1)  # (B|1, H|1, Lq)
    bias = inputs.bias.float() if inputs.bias is not None else None

    # The compiled shapes (bucket_*): padded queries are dropped, padded keys are hidden, zero dims add nothing.
    # With lse, the sink is one key after the padded ones, and v gets its two columns [1 on real keys, 1 on sink].
    batch_p, len_q_p, len_k_p = bucket_batch(batch), bucket_length(len_q), bucket_length(len_k)
    sink_columns = 2 if need_lse else 0
    kernel_len_k = len_k_p + 1 if need_lse else len_k_p
    dim_p, dim_v_p = bucket_head_dim(head_dim), bucket_head_dim(dim_v + sink_columns)
    sink = None
    if need_lse:
        scores = (_score_bound(spec, q, k, bias, scale) - SINK_MARGIN).float()
        sink = (len_k_p, _padded(scores, (batch_p, heads_q, len_q_p)))  # (its key index, its scores)
        v = F.pad(v, (0, 1), value=1.0)  # the real keys' column
    q = _padded(q, (batch_p, heads_q, len_q_p, dim_p))
    k = _padded(k, (batch_p, heads_kv, kernel_len_k, dim_p))
    v = _padded(v, (batch_p, heads_kv, kernel_len_k, dim_v_p))
    if need_lse:
        v[:, :, len_k_p, dim_v + 1] = 1.0  # the sink's column; its key is the zero row k[len_k_p]
    # Padded batch elements get length 0: they see nothing.
    offset, q_len, kv_len = (_padded(x, (batch_p,)) for x in (band.offset, band.q_len, band.kv_len))
    if dense is not None:  # whole along B, Lq and Lk, so that its blocks can be read off it
        dense = dense.expand(batch, dense.shape[1], len_q, len_k)
        dense = _padded(dense, (batch_p, heads_q, len_q_p, kernel_len_k), value=False, broadcast=True)
    if bias is not None:
        bias = _padded(bias, (batch_p, heads_q, len_q_p, kernel_len_k), broadcast=True)
    segments = None
    if inputs.q_segment_ids is not None and dense is None:  # padded positions get id −1: padding
        segments = (
            _padded(inputs.q_segment_ids.long(), (batch_p, len_q_p), value=-1),
            _padded(inputs.kv_segment_ids.long(), (batch_p, kernel_len_k), value=-1),
        )
    slopes = None
    if inputs.alibi_slopes is not None:  # ALiBi only lowers scores: the sink's bound above still holds
        slopes = _padded(inputs.alibi_slopes.expand(batch, heads_q), (batch_p, heads_q))
    lengths, sides = (offset, q_len, kv_len), (band.lower, band.upper)
    score_mod, mask_mod, structure = _mods(
        spec, lengths, sides, segments, dense, bias, scale, sink, q.device, slopes, program
    )
    if dense is not None:
        partial, full = _dense_blocks(dense)
    else:
        partial, full = _row_blocks(key_ranges, batch_p, kernel_len_k, segments)
    if program is not None:  # a block runs where both see a pair, unmasked where both see every pair
        program_partial, program_full = _program_blocks(program, batch, heads_q, len_q, len_k, len_q_p, kernel_len_k, q)
        if program_full.shape[0] > 1:  # padded batch elements: nothing
            past = (0, 0, 0, 0, 0, 0, 0, batch_p - batch)
            program_partial, program_full = (F.pad(x, past, value=False) for x in (program_partial, program_full))
        seen = (partial | full) & (program_partial | program_full)
        full = full & program_full
        partial = seen & ~full
    if need_lse:  # the sink's block is read by every query block
        partial[..., len_k_p // BLOCK_SIZE] |= ~full[..., len_k_p // BLOCK_SIZE]
    block_mask = _dense_blocks_to_mask(partial, full, len_q_p, kernel_len_k, mask_mod)
    if len_q_p * kernel_len_k < COMPILE_MIN_PAIRS:
        call = _eager  # small: the unfused kernel's (Lq, Lk) scores cost less than seconds of compiling
    else:
        call = COMPILED.get(
            (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, structure, torch.get_num_threads())
        )
    out = call(q, k, v, score_mod, block_mask, heads_q != heads_kv)[:batch, :, :len_q]

    lse = None
    if sink is not None:
        recovered = _normalised_by_sink(out, sink[1][:batch, :, :len_q], ~empty.expand(batch, heads_q, len_q), dim_v)
        if recovered is None:  # the bound was too loose for float32: exact, linear memory
            return LSE_RANGE
        out, lse = recovered
    out = out[..., :dim_v].masked_fill(empty.unsqueeze(-1), 0.0).to(dtype)
    return from_bhsd(spec, out), lse


class TorchFlexBackend(BaseBackend):
    """torch flex_attention, compiled for CPU: block-sparse causal/window/lengths, score_mod softcap and bias."""

    name = "torch-flex"
    capabilities = Capabilities(
        length_generic=True,
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        devices=frozenset({"cpu"}),
        features=ALL_FEATURES - {Feature.PAGED, Feature.DROPOUT},
        unsupported_because=((Feature.DROPOUT, "FlexAttention has no dropout"),),
        head_dims=(1, MAX_TESTED_HEAD_DIM),
        description="torch flex_attention compiled by inductor (CPU C++ template, block-sparse); lse via a sink key",
        notes=(
            "float64: inductor's CPU flex template takes float32, bfloat16 and float16 only",
            "cuda: not lowered yet (flex's Triton path; flash-attn and triton serve CUDA)",
            "grad, dbias: torch 2.13 flex has no CPU backward; torch-chunked's backward runs from flex's out and lse",
            "lse: the CPU kernel cannot return it; one sink key and two value columns give it in the same pass, "
            "computed in float32; a row outside float32's range sends the call to torch-chunked",
            "each new bucketed shape compiles once (seconds; dynamic shapes fail to compile on CPU in torch 2.13): "
            "batch to a power of two, lengths to 16..128 then multiples of 128, head dims to multiples of 16",
            "float16/bfloat16: computed by the float32 kernel (one rounding at the end) unless the CPU has AMX tiles; "
            "without them the half kernels are slower",
            "a user mask is read densely (it is (Lq, Lk) already); causal, window, lengths and segment ids are "
            "block-sparse (segment ids: a mask_mod clause, and blocks skipped by their per-block id ranges, as "
            "FlexAttention's document masking; q, k, v zeroed at negative ids)",
            "paged: flex reaches a paged cache only through a map from each cache slot to one logical position "
            "(torch's experimental PagedAttention), which cannot hold a block that a sequence reads twice (§13 "
            "allows it), and each new cache size recompiles",
            "needs inductor's C++ flex template (x86 with AVX2); tested with torch 2.13",
        ),
        delegations=(BACKWARD, EMPTY, NAN_INPUTS, LSE_RANGE),
    )

    def cold_start(self, spec: AttentionSpec, problem: Problem) -> str | None:
        len_q, len_k = bucket_length(problem.len_q), bucket_length(problem.len_k) + int(problem.return_lse)
        if len_q * len_k < COMPILE_MIN_PAIRS:  # run eagerly: nothing to compile
            return None
        q_shape = (bucket_batch(problem.batch), problem.heads_q, len_q, bucket_head_dim(problem.head_dim))
        if COMPILED.has_shape(q_shape, getattr(torch, problem.dtype)):
            return None
        return "its first call of this shape compiles a kernel (seconds)"

    def available(self) -> list[str]:
        reason = _api_reason() or _cpu_template_reason()
        return [reason] if reason else []

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[torch.Tensor, Any]:
        inputs = without_segment_padding(spec, inputs)  # the kernel's P · V, and any delegate's, reads every key
        with torch.no_grad():
            result = flex_forward(spec, inputs, need_lse)
            if isinstance(result, Delegation):
                return self._hand_over(result).forward(spec, inputs, need_lse)
            return result

    def backward(
        self,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        *,
        need_dbias: bool,
    ) -> Gradients:
        """torch-chunked's FlashAttention-2 backward: flex has no backward on CPU (torch 2.13)."""
        inputs = without_segment_padding(spec, inputs)
        return self._hand_over(BACKWARD).backward(spec, inputs, out, lse, dout, dlse, need_dbias=need_dbias)

    def _hand_over(self, delegation: Delegation) -> Backend:
        """The backend that runs ``delegation`` (one of this backend's), noted as run."""
        delegated(self, delegation)
        return peer_backend(delegation.backend)
