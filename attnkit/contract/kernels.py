"""The shared launch module of the kernel backends (Triton, and CUDA C through CuPy or the test suite's emulator;
public, imports torch): what their launchers compute alike, and the backend class they share.

Both kernel sets take the same arguments in the same order (:func:`attention_forward`, :func:`attention_backward`
write them): bhsd operands with their batch, head and sequence strides; the optional bias, mask, lengths and
segment ids, each replaced by q where absent (never dereferenced) and switched on by a :class:`KernelSwitches` flag;
bias and mask broadcast to (B, Hq, Lq, Lk) by stride 0; ALiBi's float32 (B|1, Hq) slopes, broadcast over the batch
by stride 0 (the kernels add −slope · |i + off_b − j| to each score themselves, docs/semantics.md §16); the geometry,
the scales and the band of :func:`attnkit.contract.diagonal_band`.

A paged KV cache (attend_paged, docs/semantics.md §13) is read where its blocks lie: the caches arrive as
(num_blocks, Hkv, block_size, D) views whose first stride, the block stride, takes the batch stride's place, with
the block table and the block size; a kernel compiled with :attr:`KernelSwitches.paged` finds key j of batch row b
at block ``block_table[b, j // block_size]``, slot ``j % block_size``, and never copies the cache.

Split-K (flash-decoding): when a call has too few (batch, head, query tile) programs to fill the GPU and long keys
(:func:`decode_splits`), each program runs one of ``splits`` ranges of its key tiles and writes a float32 partial
out and lse; :func:`merge_splits` combines them by their lse.

Segment ids (docs/semantics.md §4.5) arrive as int64 (B, L) rows and, for tile skipping, as the range of the
non-negative ids in each granule of SEGMENT_GRANULE positions (:func:`segment_ranges`): a kernel's tile is a whole
number of granules, so it reads its range from them whatever its tile size, and a (query tile, key tile) pair
whose ranges cannot meet is never loaded.

A launcher (:class:`KernelLauncher`) keeps what is its own: how scalars are typed, tiles, compile-time constants
and the launch itself.

The backward is the FlashAttention-2 sequence: Δ = rowsum(dO ⊙ O) − dlse, then a dQ kernel over query tiles and a
dK/dV kernel over key tiles (which also writes dS for dbias). Kernels for the cosine variant differentiate with
respect to the normalised q̂ = q/‖q‖ and k̂; the chain rule through the normalisation runs here, in float32, once
per backward.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from attnkit.backend import (
    ALL_FEATURES,
    AttentionInputs,
    AttentionSpec,
    BaseBackend,
    Capabilities,
    CausalAlignment,
    Feature,
    Framework,
    Gradients,
    Layout,
    PagedInputs,
    Unverified,
    Variant,
    backend_option,
)
from attnkit.contract import COSINE_EPS, diagonal_band
from attnkit.contract.torch import SegmentTiles, zero_padding

# ---------------------------------------------------------------------------------------------- the math


def cosine_input_gradient(
    x: torch.Tensor, lengths: torch.Tensor | None, segment_ids: torch.Tensor | None, grad_unit: torch.Tensor
) -> torch.Tensor:
    """The gradient wrt bhsd ``x`` (B, H, L, D) of ``F.normalize(x, dim=-1, eps=1e-12)``, given the gradient wrt
    the normalised x; float32.

    Rows at or beyond ``lengths[b]``, and rows whose segment id is negative, are padding: zeroed first, so garbage
    there (NaN) cannot reach their zero gradient (docs/semantics.md §5).
    """
    x = zero_padding(x, lengths, segment_ids)
    leaf = x.detach().float().requires_grad_(True)
    with torch.enable_grad():
        unit = F.normalize(leaf, dim=-1, eps=COSINE_EPS)
    return torch.autograd.grad(unit, leaf, grad_unit)[0]


def bhsd(spec: AttentionSpec, x: torch.Tensor) -> torch.Tensor:
    """A (B, H, L, D) view of a tensor in the spec's layout, copied only when its last stride is not 1: kernels
    take the other three strides as they are."""
    view = x.permute(0, 2, 1, 3) if spec.layout is Layout.BSHD else x
    return view if view.stride(-1) == 1 else view.contiguous()


def kernel_gradients(
    spec: AttentionSpec,
    inputs: AttentionInputs,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dscores: torch.Tensor | None,
) -> Gradients:
    """The Gradients of a kernel backend whose backward gives bhsd dq, dk, dv (with respect to q̂ and k̂, in float32,
    for the cosine variant) and, when dbias is wanted, dS at full (B, Hq, Lq, Lk) float32: the frontend sums it to
    the bias's shape and dtype."""
    if spec.variant is Variant.COSINE:
        dq = cosine_input_gradient(bhsd(spec, inputs.q), inputs.q_lengths, inputs.q_segment_ids, dq)
        dk = cosine_input_gradient(bhsd(spec, inputs.k), inputs.kv_lengths, inputs.kv_segment_ids, dk)

    def in_layout(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return (x.transpose(1, 2) if spec.layout is Layout.BSHD else x).to(like.dtype)

    return Gradients(dq=in_layout(dq, inputs.q), dk=in_layout(dk, inputs.k), dv=in_layout(dv, inputs.v), dbias=dscores)


# ---------------------------------------------------------------------------------------------- the launch


class Kernel(enum.StrEnum):
    """The four kernels of both kernel sets (the values are attention.cu's names, ``attention_<value>``)."""

    FORWARD = "forward"
    DELTA = "backward_delta"  # Δ = rowsum(dO ⊙ O) − dlse, one row per query
    DQ = "backward_dq"  # over query tiles
    DKDV = "backward_dkdv"  # over key tiles; writes dS for dbias


@dataclass(frozen=True)
class KernelSwitches:
    """The feature switches of the kernels: compile-time constants, so a call without a feature runs without its
    code. Each kernel reads some of them (the forward none of has_dlse, has_dbias and grad_float32; only the forward
    paged and split_k)."""

    has_lower: bool = False  # the band's lower side: a window's left
    has_upper: bool = False  # the band's upper side: causal, or a window's right
    bottom_right: bool = False
    has_mask: bool = False
    has_bias: bool = False
    has_softcap: bool = False
    cosine: bool = False
    has_q_lengths: bool = False
    has_kv_lengths: bool = False
    has_segment_ids: bool = False
    has_alibi: bool = False  # −slope[b, h] · |i + off_b − j| added to every score (§16)
    has_dlse: bool = False  # Δ kernel: lse has a cotangent
    has_dbias: bool = False  # dK/dV kernel: write dS
    grad_float32: bool = False  # dq, dk, dv are float32 buffers (the cosine variant's chain rule follows)
    paged: bool = False  # forward: keys through a block table (attend_paged)
    split_k: bool = False  # forward: one of several key ranges per program, float32 partials for merge_splits
    atomic_dq: bool = False  # dK/dV kernel: also add each tile's dS K into a float32 dq sum (one-pass backward)
    has_mask_program: bool = False  # a mask program (KernelCall.program) evaluated in the tiles, where it serves
    has_dropout: bool = False  # §18's keep-mask on P (KernelCall.dropout), regenerated in every pass

    @classmethod
    def all(cls) -> KernelSwitches:
        return cls(**{field.name: True for field in fields(cls)})

    def with_(self, **changes: bool) -> KernelSwitches:
        return KernelSwitches(**{**self.__dict__, **changes})


class ArgumentTypes(NamedTuple):
    """How a launcher types scalar kernel arguments: int32 scalars, int64 strides, float32 scales."""

    int32: Callable[[int], Any]
    int64: Callable[[int], Any]
    float32: Callable[[float], Any]


class Grid(NamedTuple):
    """Programs along a sequence (query rows, or keys with ``along_keys``) × heads × batch; with split-K, ``splits``
    programs per query tile (the first axis is split-major: split · tiles + tile)."""

    length: int
    heads: int
    batch: int
    along_keys: bool = False
    splits: int = 1

    def blocks(self, block_m: int, block_n: int) -> tuple[int, int, int]:
        """The launch grid for a tile of ``block_m`` query rows × ``block_n`` keys."""
        block = block_n if self.along_keys else block_m
        return -(-self.length // block) * self.splits, self.heads, self.batch


@dataclass(frozen=True)
class KernelCall:
    """What every kernel of one call shares: bhsd operands, the optional tensors with their strides, the geometry,
    scales and band, typed by the launcher."""

    spec: AttentionSpec
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    # bias, mask (uint8), q_lengths, kv_lengths (int32), q and kv segment ids, q and kv segment ranges (int64),
    # ALiBi slopes (float32 (B|1, Hq), heads contiguous); q where absent
    optional: tuple[torch.Tensor, ...]
    # bias then mask, (B, Hq, Lq, Lk) strides, 0 on broadcast axes; then the slopes' batch stride (0: one row for all)
    feature_strides: tuple[Any, ...]
    geometry: tuple[Any, ...]  # heads_q, group, len_q, len_k (a paged cache's len_k: the table's capacity)
    qk_scale: Any
    softcap: Any
    scale: Any
    band: tuple[Any, Any]  # lower, upper (0 where unbounded: the switch is off)
    switches: KernelSwitches
    types: ArgumentTypes
    block_table: torch.Tensor  # int32 (B, max_blocks) of a paged cache; q where contiguous
    paging: tuple[Any, Any]  # block_size, max_blocks (1, 0 where contiguous)
    # The call's mask program (attnkit.contract.programs.BoundProgram) and its captured tensors as contiguous int32
    # (the contract's integers): a launcher that serves programs appends them, and the tile classes at each kernel's
    # own tiles, to the arguments (the launch arguments above carry none of it).
    program: Any = None
    captured: tuple[torch.Tensor, ...] = ()
    # The call's dropout (attnkit.backend.Dropout), None without: a launcher that serves it appends its arguments.
    dropout: Any = None

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """batch, heads_q, len_q, heads_kv, len_k."""
        batch, heads_q, len_q, _ = self.q.shape
        return batch, heads_q, len_q, self.k.shape[1], int(self.geometry[3])

    @property
    def head_dims(self) -> tuple[int, int]:
        return self.q.shape[3], self.v.shape[3]

    def strides(self, x: torch.Tensor) -> tuple[Any, Any, Any]:
        """Batch, head and sequence strides of a bhsd view (the head-dim stride is 1)."""
        return self.types.int64(x.stride(0)), self.types.int64(x.stride(1)), self.types.int64(x.stride(2))


class KernelLauncher(Protocol):
    """A kernel set's launcher: how it types arguments and reads the bias, and how it runs one kernel."""

    types: ArgumentTypes
    #: The dtype the kernels read the bias in; None: the bias's own.
    bias_dtype: torch.dtype | None

    def run(self, kernel: Kernel, call: KernelCall, grid: Grid, args: list[Any], switches: KernelSwitches) -> None:
        """Launch ``kernel`` over ``grid`` with ``args``, compiled for ``switches``."""
        ...

    # Optional: ``merge_splits(call, partial_out, partial_lse, out, lse)``, split-K's combine as the kernel set's own
    # launch (float32 partials (S, B, Hq, Lq, Dv) and (S, B, Hq, Lq) into out, a bhsd view in q's dtype, and lse).
    # Without it attention_forward merges in torch (merge_splits): ten kernels on a GPU where one does.


#: The option a kernel backend declares when it has a one-pass backward (``[backend_options.<name>]``).
DETERMINISTIC_OPTION = ("deterministic", False)


def one_pass_backward(launcher: KernelLauncher, call: KernelCall) -> bool:
    """Whether the backward may run as one pass: the dK/dV kernel adds dq into a float32 sum with atomics
    (``atomic_dq``) and no dQ kernel recomputes S and dP. A launcher offers it with a method of that name, for the
    calls it compiles lean; without one, the two-kernel scheme, each gradient element written by one program."""
    offers = getattr(launcher, "one_pass_backward", None)
    return bool(offers(call)) if offers is not None else False


#: Positions per granule of the segment ranges: every tile's rows and keys are a multiple of it.
SEGMENT_GRANULE = 16


def rows_on_16_bytes(x: torch.Tensor) -> bool:
    """Whether every row of ``x`` starts on 16 bytes: its data pointer and every stride but the last, in bytes (what
    16-byte copies need: cp.async chunks, tensor descriptors)."""
    return x.data_ptr() % 16 == 0 and all(stride * x.element_size() % 16 == 0 for stride in x.stride()[:-1])


def segment_ranges(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, ⌈L / SEGMENT_GRANULE⌉, 2) int64: per batch element and granule of positions, the least and the greatest
    non-negative id (:class:`attnkit.contract.torch.SegmentTiles`, as the CPU backends plan by; padding, a negative
    id, is in no range, and a granule of padding alone gets an empty one: int64's greatest value over −1). Tiles
    whose ranges do not overlap share no id, so no query of one sees a key of the other."""
    tiles = SegmentTiles.of(segment_ids, SEGMENT_GRANULE)
    return torch.stack((tiles.least, tiles.greatest), -1).contiguous()


def paged_operands(inputs: PagedInputs) -> tuple[AttentionInputs, torch.Tensor, int, int]:
    """An attend_paged call as the kernels take it: the caches as (num_blocks, Hkv, block_size, D) views (a block
    in the batch's place; views, never copies, unless the head dim is strided), kv_lengths among the optional
    tensors, the int32 block table, the block size and the table's capacity in keys."""

    def blocks_first(cache: torch.Tensor) -> torch.Tensor:
        view = cache.permute(0, 2, 1, 3)
        return view if view.stride(-1) == 1 else view.contiguous()

    table = inputs.block_table.to(device=inputs.q.device, dtype=torch.int32).contiguous()
    block_size = inputs.k_cache.shape[1]
    views = AttentionInputs(
        inputs.q,
        blocks_first(inputs.k_cache),
        blocks_first(inputs.v_cache),
        kv_lengths=inputs.kv_lengths,
        alibi_slopes=inputs.alibi_slopes,  # key positions are logical: the same distances as contiguous keys
    )
    return views, table, block_size, table.shape[1] * block_size


def prepare(launcher: KernelLauncher, spec: AttentionSpec, inputs: AttentionInputs | PagedInputs) -> KernelCall:
    types = launcher.types
    table: torch.Tensor | None = None
    if isinstance(inputs, PagedInputs):
        inputs, table, block_size, len_k = paged_operands(inputs)
        q, k, v = bhsd(spec, inputs.q), inputs.k, inputs.v
    else:
        q, k, v = bhsd(spec, inputs.q), bhsd(spec, inputs.k), bhsd(spec, inputs.v)
        block_size, len_k = 1, k.shape[2]
    batch, heads_q, len_q, head_dim = q.shape
    heads_kv = k.shape[1]
    optional: list[torch.Tensor] = []
    feature_strides: list[Any] = []
    for x in (inputs.bias, inputs.mask):  # broadcast by stride 0, never expanded in memory
        if x is not None:
            x = x.view(torch.uint8) if x.dtype == torch.bool else x.to(launcher.bias_dtype or x.dtype)
            x = x.expand(batch, heads_q, len_q, len_k)
        optional.append(x if x is not None else q)
        feature_strides.extend(types.int64(s) for s in (x.stride() if x is not None else (0, 0, 0, 0)))
    for lengths in (inputs.q_lengths, inputs.kv_lengths):
        optional.append(lengths.to(device=q.device, dtype=torch.int32).contiguous() if lengths is not None else q)
    segments = [inputs.q_segment_ids, inputs.kv_segment_ids]
    has_segment_ids = segments[0] is not None
    if has_segment_ids:  # int64 whatever the given integer dtype: every id keeps its value
        segments = [ids.to(device=q.device, dtype=torch.int64).contiguous() for ids in segments]
        optional.extend([*segments, *map(segment_ranges, segments)])
    else:
        optional.extend([q] * 4)
    slopes = inputs.alibi_slopes
    if slopes is not None:  # (B|1, Hq) float32, broadcast over the batch by stride 0
        slopes = slopes.to(device=q.device, dtype=torch.float32).contiguous().expand(batch, heads_q)
    optional.append(slopes if slopes is not None else q)
    feature_strides.append(types.int64(slopes.stride(0) if slopes is not None else 0))
    lower, upper = diagonal_band(spec)
    scale = spec.resolved_scale(head_dim)
    program = getattr(inputs, "mask_program", None)  # PagedInputs have none
    dropout = getattr(inputs, "dropout", None)  # nor this
    captured = tuple(
        t.to(device=q.device, dtype=torch.int32).contiguous() for t in (program.captured if program is not None else ())
    )
    switches = KernelSwitches(
        has_lower=lower is not None,
        has_upper=upper is not None,
        bottom_right=spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT,
        has_mask=inputs.mask is not None,
        has_bias=inputs.bias is not None,
        has_softcap=spec.softcap is not None,
        cosine=spec.variant is Variant.COSINE,
        has_q_lengths=inputs.q_lengths is not None,
        has_kv_lengths=inputs.kv_lengths is not None,
        has_segment_ids=has_segment_ids,
        has_alibi=slopes is not None,
        paged=table is not None,
        has_mask_program=program is not None,
        has_dropout=dropout is not None,
    )
    return KernelCall(
        spec=spec,
        q=q,
        k=k,
        v=v,
        optional=tuple(optional),
        feature_strides=tuple(feature_strides),
        geometry=tuple(types.int32(n) for n in (heads_q, heads_q // heads_kv, len_q, len_k)),
        # The kernels multiply q kᵀ by qk_scale: scale / c when softcapped, so the product is the tanh argument.
        qk_scale=types.float32(scale / spec.softcap if spec.softcap is not None else scale),
        softcap=types.float32(spec.softcap or 1.0),
        scale=types.float32(scale),
        band=(types.int32(lower or 0), types.int32(upper or 0)),
        switches=switches,
        types=types,
        block_table=table if table is not None else q,
        paging=(types.int32(block_size), types.int32(table.shape[1] if table is not None else 0)),
        program=program,
        captured=captured,
        dropout=dropout,
    )


# Split-K's rule (flash-decoding). A forward program is one (batch, query head, query tile); when a call has fewer
# of them than the GPU has SMs, each tile's keys are split into ranges run by separate programs, enough for about
# SPLIT_K_WAVES programs per SM, each range at least SPLIT_K_MIN_KEYS keys (below that, a program's fixed cost and
# the partials' traffic outweigh the parallelism), at most SPLIT_K_MAX ranges. Query tiles are counted as
# SPLIT_K_QUERY_TILE rows, the GPU forward tiles' usual height. Off on CPU tensors: the Triton interpreter and the CUDA
# emulator run one program at a time, where splitting only adds work.
SPLIT_K_WAVES = 2
SPLIT_K_MIN_KEYS = 512
SPLIT_K_MAX = 64
SPLIT_K_QUERY_TILE = 64


def decode_splits(programs: int, keys: int, processors: int) -> int:
    """Key ranges per query tile for ``programs`` unsplit programs over ``keys`` keys on ``processors`` SMs (0 on
    CPU): 1 (no split) unless the programs are fewer than the processors, then by the rule above."""
    if programs >= processors:
        return 1
    return max(1, min(-(-SPLIT_K_WAVES * processors // max(programs, 1)), keys // SPLIT_K_MIN_KEYS, SPLIT_K_MAX))


@functools.cache
def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def merge_splits(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K's merge of float32 partials out (S, ..., Dv) and lse (S, ...) along the first axis:

        lse = log Σ_s exp(lse_s);  out = Σ_s exp(lse_s − lse) · out_s

    A range with no visible key (lse_s = −inf, out_s = 0) weighs exactly 0, never exp(−inf + inf) = NaN, so a row
    empty in every range keeps out 0 and lse −inf; a NaN in any range stays NaN."""
    merged = torch.logsumexp(lse, dim=0)
    weights = torch.where(lse == float("-inf"), 0.0, torch.exp(lse - merged))
    return (weights.unsqueeze(-1) * out).sum(0), merged


def attention_forward(
    launcher: KernelLauncher, spec: AttentionSpec, inputs: AttentionInputs | PagedInputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (spec layout, q's dtype) and lse (B, Hq, Lq) float32, of a call with contiguous keys or a paged cache."""
    call = prepare(launcher, spec, inputs)
    batch, heads_q, len_q, _, len_k = call.shape
    device = call.q.device
    out = torch.empty((*inputs.q.shape[:3], call.v.shape[3]), dtype=inputs.q.dtype, device=device)
    lse = torch.empty((batch, heads_q, len_q), dtype=torch.float32, device=device)
    if out.numel() == 0 or len_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    splits = decode_splits(batch * heads_q * -(-len_q // SPLIT_K_QUERY_TILE), len_k, _processors(device))
    out_view = bhsd(spec, out)
    if splits > 1:  # float32 partials, split-major, then merged into out and lse
        partial_out = torch.empty((splits, *out_view.shape), dtype=torch.float32, device=device)
        partial_lse = torch.empty((splits, *lse.shape), dtype=torch.float32, device=device)
        targets, split_strides = (partial_out[0], partial_lse), (partial_out.stride(0), partial_lse.stride(0))
    else:
        targets, split_strides = (out_view, lse), (0, 0)
    args = [
        call.q,
        call.k,
        call.v,
        *targets,
        *call.optional,
        call.block_table,
        *call.strides(call.q),
        *call.strides(call.k),
        *call.strides(call.v),
        *call.strides(targets[0]),
        *map(call.types.int64, split_strides),
        *call.feature_strides,
        *call.geometry,
        call.qk_scale,
        call.softcap,
        *call.band,
        *call.paging,
        call.types.int32(splits),
    ]
    grid = Grid(len_q, heads_q, batch, splits=splits)
    launcher.run(Kernel.FORWARD, call, grid, args, call.switches.with_(split_k=splits > 1))
    if splits > 1:
        combine = getattr(launcher, "merge_splits", None)
        if combine is not None:  # the kernel set's own combine: one launch
            combine(call, partial_out, partial_lse, out_view, lse)
        else:
            merged_out, merged_lse = merge_splits(partial_out, partial_lse)
            out_view.copy_(merged_out)
            lse.copy_(merged_lse)
    return out, lse


def attention_backward(
    launcher: KernelLauncher,
    spec: AttentionSpec,
    inputs: AttentionInputs,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    need_dbias: bool,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dq, dk, dv as bhsd tensors (float32 for the cosine variant, else the inputs' dtype) and dS at full
    (B, Hq, Lq, Lk) float32 for dbias. For the cosine variant, dq and dk are the gradients wrt q̂ = q/‖q‖ and k̂.
    Not ``deterministic``, the launcher may run it in one pass (:func:`one_pass_backward`)."""
    call = prepare(launcher, spec, inputs)
    batch, heads_q, len_q, heads_kv, len_k = call.shape
    # The cosine chain rule (kernel_gradients) runs in float32: the kernels hand it unrounded gradients.
    grad_dtype = torch.float32 if call.switches.cosine else None

    def gradient(like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=grad_dtype or like.dtype, device=like.device)

    dq, dk, dv = gradient(call.q), gradient(call.k), gradient(call.v)
    # dS is written only inside the visible band; the rest of dbias is zero.
    dbias = torch.zeros((batch, heads_q, len_q, len_k), dtype=torch.float32, device=dq.device) if need_dbias else None
    if dq.numel() == 0 or len_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dbias
    out_view, dout_view, lse = bhsd(spec, out), bhsd(spec, dout), lse.contiguous()
    delta = torch.empty_like(lse)
    int32 = call.types.int32
    delta_args = [
        out_view,
        dout_view,
        dlse.contiguous() if dlse is not None else lse,
        delta,
        *call.strides(out_view),
        *call.strides(dout_view),
        int32(heads_q),
        int32(len_q),
    ]
    by_queries = Grid(len_q, heads_q, batch)
    launcher.run(Kernel.DELTA, call, by_queries, delta_args, KernelSwitches(has_dlse=dlse is not None))
    operand_strides = [*call.strides(call.q), *call.strides(call.k), *call.strides(call.v), *call.strides(dout_view)]
    scalars = [*call.geometry, call.qk_scale, call.softcap, call.scale, *call.band]
    gradient_switches = call.switches.with_(grad_float32=dq.dtype == torch.float32)
    dq_args = [
        call.q,
        call.k,
        call.v,
        dout_view,
        lse,
        delta,
        dq,
        *call.optional,
        *operand_strides,
        *call.strides(dq),
        *call.feature_strides,
        *scalars,
    ]
    one_pass = not deterministic and one_pass_backward(launcher, call)
    if not one_pass:
        launcher.run(Kernel.DQ, call, by_queries, dq_args, gradient_switches)
    dkdv_args = [
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
        *call.strides(dk),
        *call.strides(dv),
        *call.feature_strides,
        *scalars,
    ]
    by_keys = Grid(len_k, heads_kv, batch, along_keys=True)
    dkdv_switches = gradient_switches.with_(has_dbias=need_dbias, atomic_dq=one_pass)
    if one_pass:
        dq_sum = torch.zeros(dq.shape, dtype=torch.float32, device=dq.device)
        dkdv_args += [dq_sum, *call.strides(dq_sum)]
    launcher.run(Kernel.DKDV, call, by_keys, dkdv_args, dkdv_switches)
    if one_pass:
        dq.copy_(dq_sum.mul_(call.scale))  # the dQ kernel's grad_scale, then its rounding to dq's dtype
    return dq, dk, dv, dbias


# ---------------------------------------------------------------------------------------------- the backend

#: What both kernel sets do alike, for their capabilities' notes.
KERNEL_NOTES = (
    "cosine: q·k on the raw inputs, scaled by both inverse norms in float32 (q̂ is never rounded)",
    "dbias is computed at full (B, Hq, Lq, Lk) float32, then summed to the bias's shape",
    "float64: not supported by the kernels (torch-chunked serves it)",
    "paged: the forward reads the caches' blocks where they lie, through the block table, per key (any block size)",
    "split-K (flash-decoding) on CUDA when (batch, head, query tile) programs are fewer than the SMs and keys are "
    "long: float32 partials merged by their lse (contract.kernels.decode_splits)",
)


def kernel_capabilities(
    device: str,
    max_head_dim: int,
    description: str,
    notes: tuple[str, ...] = (),
    how_to_run: tuple[str, ...] = (),
    options: tuple[tuple[str, bool | int | float | str], ...] = (),
    unverified: tuple[Unverified, ...] = (),
    mask_programs: bool = False,
    dropout: bool = False,
) -> Capabilities:
    """A kernel backend's declaration: the whole contract on torch tensors of one device, in the three float dtypes
    the kernels are written for, mask programs and dropout where ``mask_programs`` and ``dropout`` say its kernels
    serve them. Its own ``notes`` come before the shared ones, ``how_to_run`` after."""
    left_out = {feature for feature, served in ((Feature.MASK_PROGRAM, mask_programs), (Feature.DROPOUT, dropout))
                if not served}  # fmt: skip
    return Capabilities(
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        devices=frozenset({device}),
        features=ALL_FEATURES - left_out,
        head_dims=(1, max_head_dim),
        description=description,
        notes=(*notes, *KERNEL_NOTES, *how_to_run),
        options=options,
        unverified=unverified,
        length_generic=True,
    )


class KernelBackend(BaseBackend):
    """A backend whose forward and backward are the kernel sequence of this module, run by its
    :meth:`kernel_launcher`."""

    def kernel_launcher(self) -> KernelLauncher:
        raise NotImplementedError(f"{type(self).__name__}.kernel_launcher")

    def forward(
        self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return attention_forward(self.kernel_launcher(), spec, inputs)

    def forward_paged(
        self, spec: AttentionSpec, inputs: PagedInputs, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return attention_forward(self.kernel_launcher(), spec, inputs)

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
        with torch.no_grad():
            dq, dk, dv, dscores = attention_backward(
                self.kernel_launcher(), spec, inputs, out, lse, dout, dlse, need_dbias, self.deterministic()
            )
        return kernel_gradients(spec, inputs, dq, dk, dv, dscores)

    def deterministic(self) -> bool:
        """Whether gradients must come out the same bits every run: torch.use_deterministic_algorithms(True), or the
        backend's ``deterministic`` option where it declares one (a backend without it is deterministic)."""
        if DETERMINISTIC_OPTION[0] not in dict(self.capabilities.options):
            return True
        return torch.are_deterministic_algorithms_enabled() or bool(backend_option(self, DETERMINISTIC_OPTION[0]))
