"""Conformance cases: a Case describes one call (no tensors); make_arrays() draws its inputs.

An attend_varlen or attend_paged call (docs/semantics.md §12, §13) is a Case too: the attend call the contract says
it equals, which the oracle computes, with a :class:`Varlen` or :class:`Paged` saying how the backend is called instead
(attnkit.testing.runners converts the arrays to the ragged layout and the results back)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from attnkit.backend import Framework, Problem
from attnkit.spec import AttentionSpec, Layout
from attnkit.testing.programs import ProgramCase, table_values

#: Table columns that are call forms rather than backend features: an attend_varlen call runs as an attend call.
VARLEN = "varlen"
#: A call with sinks= (§15): composed by attend with any backend's lse, so a column of its own, not a feature.
SINKS = "sinks"


@dataclass(frozen=True)
class Varlen:
    """An attend_varlen call (§12): sequence s has q_lengths[s] queries and kv_lengths[s] keys, packed. Its Case is the
    attend call attend_varlen makes: one packed bshd row with the sequence index as segment id where the two offsets
    are equal (self-packed) and there is no dropout, else the right-padded batch with q_lengths and kv_lengths (see
    :func:`varlen_case`)."""

    q_lengths: tuple[int, ...]
    kv_lengths: tuple[int, ...]

    @property
    def self_packed(self) -> bool:
        return self.q_lengths == self.kv_lengths


@dataclass(frozen=True)
class Paged:
    """An attend_paged call (§13): the cache's geometry and block table. Its Case is attend on the gathered keys
    (len_k the table's capacity, kv_lengths); entries past a sequence's blocks may be anything (never read)."""

    block_size: int
    num_blocks: int
    block_table: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Case:
    """One attention call to check: the spec, the shapes, which optional inputs, the dtype and a seed."""

    spec: AttentionSpec
    batch: int = 2
    heads_q: int = 2
    heads_kv: int = 1
    len_q: int = 8
    len_k: int = 8
    head_dim: int = 16
    head_dim_v: int = 16
    dtype: str = "float32"
    mask_shape: tuple[int, ...] | None = None
    # Rows of the mask set entirely False, so those queries see no key (docs/semantics.md §5).
    masked_rows: tuple[int, ...] = ()
    bias_shape: tuple[int, ...] | None = None
    bias_grad: bool = False
    q_lengths: tuple[int, ...] | None = None
    kv_lengths: tuple[int, ...] | None = None
    # Per batch element, each query's and each key's segment id (docs/semantics.md §4.5); negative: padding.
    q_segment_ids: tuple[tuple[int, ...], ...] | None = None
    kv_segment_ids: tuple[tuple[int, ...], ...] | None = None
    three_d: bool = False
    seed: int = 0
    grad: bool = True
    varlen: Varlen | None = None
    paged: Paged | None = None
    sinks: bool = False  # one logit per query head joins every row's softmax (§15); make_arrays draws them
    # ALiBi slopes (§16): None, or the slopes' shape, (Hq,) or (B, Hq); make_arrays draws them, float32.
    alibi_shape: tuple[int, ...] | None = None
    # A mask program (§17) over the call, given as mask_mod; make_arrays draws its tables' values.
    program: ProgramCase | None = None
    # Attention dropout (§18): (p, seed), or None.
    dropout: tuple[float, int] | None = None
    notes: tuple[str, ...] = field(default=(), compare=False)

    def problem(self, framework: Framework, device: str = "cpu") -> Problem:
        return Problem(
            framework=framework,
            device=device,
            dtype=self.dtype,
            batch=self.batch,
            heads_q=self.heads_q,
            heads_kv=self.heads_kv,
            len_q=self.len_q,
            len_k=self.len_k,
            head_dim=self.head_dim,
            head_dim_v=self.head_dim_v,
            has_mask=self.mask_shape is not None,
            has_bias=self.bias_shape is not None,
            has_q_lengths=self.q_lengths is not None,
            has_kv_lengths=self.kv_lengths is not None,
            needs_grad=self.grad,
            needs_bias_grad=self.grad and self.bias_grad and self.bias_shape is not None,
            return_lse=True,
            has_segment_ids=self.q_segment_ids is not None,
            paged_block_size=self.paged.block_size if self.paged is not None else None,
            has_alibi=self.alibi_shape is not None,
            has_mask_program=self.program is not None,
            has_dropout=self.dropout is not None,
        )

    def features(self) -> frozenset[str]:
        """Spec and call features this case exercises (names as in attnkit.backend.ALL_FEATURES), and ``varlen`` for
        an attend_varlen call."""
        features = self.spec.features() | self.problem(Framework.TORCH).features()
        forms = {VARLEN} if self.varlen is not None else set()
        return features | forms | ({SINKS} if self.sinks else set())

    def with_(self, **changes: Any) -> Case:
        return replace(self, **changes)

    def shape(self, heads: int, length: int, dim: int) -> tuple[int, ...]:
        if self.three_d:
            return (self.batch, length, dim)
        if self.spec.layout is Layout.BSHD:
            return (self.batch, length, heads, dim)
        return (self.batch, heads, length, dim)

    def describe(self) -> str:
        parts = [
            f"B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} Lq={self.len_q} Lk={self.len_k} "
            f"D={self.head_dim} Dv={self.head_dim_v} {self.dtype}",
            self.spec.model_dump_json(exclude_defaults=True),
        ]
        for name in ("mask_shape", "masked_rows", "bias_shape", "q_lengths", "kv_lengths", "q_segment_ids",
                     "kv_segment_ids", "alibi_shape"):  # fmt: skip
            value = getattr(self, name)
            if value:
                parts.append(f"{name}={value}")
        if self.three_d:
            parts.append("3-D")
        if self.sinks:
            parts.append("sinks")
        if self.program is not None:
            parts.append(str(self.program))
        if self.dropout is not None:
            parts.append(f"dropout_p={self.dropout[0]} dropout_seed={self.dropout[1]}")
        if self.varlen is not None:
            parts.append(
                f"attend_varlen: sequences' q lengths {self.varlen.q_lengths} kv lengths {self.varlen.kv_lengths}"
            )
        if self.paged is not None:
            parts.append(
                f"attend_paged: block_size={self.paged.block_size} num_blocks={self.paged.num_blocks} "
                f"block_table={self.paged.block_table}"
            )
        return " ".join(parts)


def _bshd(spec: AttentionSpec) -> AttentionSpec:
    return spec if spec.layout is Layout.BSHD else spec.model_copy(update={"layout": Layout.BSHD})


def varlen_case(spec: AttentionSpec, q_lengths: tuple[int, ...], kv_lengths: tuple[int, ...], **shape: Any) -> Case:
    """An attend_varlen call over sequences of these lengths (at least one query in all), as the attend call it makes
    (§12): one packed row with segment ids where the lengths are equal, else a right-padded batch with lengths (with
    dropout too: its keep-mask is indexed by sequence and position within it, §18)."""
    varlen = Varlen(tuple(q_lengths), tuple(kv_lengths))
    if varlen.self_packed and shape.get("dropout") is None:
        ids = tuple(s for s, n in enumerate(q_lengths) for _ in range(n))
        return Case(_bshd(spec), batch=1, len_q=len(ids), len_k=len(ids), q_segment_ids=(ids,),
                    kv_segment_ids=(ids,), varlen=varlen, **shape)  # fmt: skip
    return Case(_bshd(spec), batch=len(q_lengths), len_q=max(max(q_lengths), 1), len_k=max(max(kv_lengths), 1),
                q_lengths=varlen.q_lengths, kv_lengths=varlen.kv_lengths, varlen=varlen, **shape)  # fmt: skip


def blocks_needed(kv_length: int, block_size: int) -> int:
    return -(-kv_length // block_size)


def paged_case(
    spec: AttentionSpec, block_size: int, block_table: tuple[tuple[int, ...], ...], kv_lengths: tuple[int, ...],
    num_blocks: int, **shape: Any,
) -> Case:  # fmt: skip
    """An attend_paged call (forward only), as attend on the keys its table gathers (§13)."""
    paged = Paged(block_size, num_blocks, tuple(tuple(row) for row in block_table))
    capacity = len(paged.block_table[0]) * block_size
    return Case(spec, batch=len(block_table), len_k=capacity, kv_lengths=tuple(kv_lengths), grad=False, paged=paged,
                **shape)  # fmt: skip


def shuffled_table(
    kv_lengths: tuple[int, ...], block_size: int, seed: int, shared: int = 1
) -> tuple[tuple[tuple[int, ...], ...], int]:
    """(block_table, num_blocks) for sequences of these lengths: blocks at random places in the cache, the first
    ``shared`` blocks of sequence 0 also the first blocks of every other sequence (a shared prefix), two blocks no
    sequence reads, and every entry past a sequence's blocks −1."""
    needed = [blocks_needed(n, block_size) for n in kv_lengths]
    prefix_blocks = min(shared, needed[0])
    own = [needed[0]] + [max(n - prefix_blocks, 0) for n in needed[1:]]
    num_blocks = sum(own) + 2
    places = iter(np.random.default_rng(seed).permutation(num_blocks).tolist())
    rows = [[next(places) for _ in range(needed[0])]]
    for n, count in zip(needed[1:], own[1:]):
        rows.append(rows[0][: min(n, prefix_blocks)] + [next(places) for _ in range(count)])
    width = max(needed) + 1
    return tuple(tuple(row + [-1] * (width - len(row))) for row in rows), num_blocks


def make_arrays(case: Case) -> dict[str, np.ndarray]:
    """Float64 inputs and cotangents for a case (NumPy), deterministic in the seed.

    Values are rounded to the case's dtype by the caller when converting, and the oracle sees the
    rounded values, so the comparison measures the backend and not the input rounding.
    """
    rng = np.random.default_rng(case.seed)
    heads_q = 1 if case.three_d else case.heads_q
    heads_kv = 1 if case.three_d else case.heads_kv
    arrays: dict[str, np.ndarray] = {
        "q": rng.standard_normal(case.shape(heads_q, case.len_q, case.head_dim)),
        "k": rng.standard_normal(case.shape(heads_kv, case.len_k, case.head_dim)),
        "v": rng.standard_normal(case.shape(heads_kv, case.len_k, case.head_dim_v)),
    }
    out_shape = case.shape(heads_q, case.len_q, case.head_dim_v)
    arrays["dout"] = rng.standard_normal(out_shape)
    lse_shape = (case.batch, case.len_q) if case.three_d else (case.batch, heads_q, case.len_q)
    arrays["dlse"] = rng.standard_normal(lse_shape)
    if case.mask_shape is not None:
        mask = rng.random(case.mask_shape) < 0.75
        for row in case.masked_rows:
            mask[..., row, :] = False
        arrays["mask"] = mask
    if case.bias_shape is not None:
        arrays["bias"] = rng.standard_normal(case.bias_shape)
    if case.q_lengths is not None:
        arrays["q_lengths"] = np.asarray(case.q_lengths, dtype=np.int64)
    if case.kv_lengths is not None:
        arrays["kv_lengths"] = np.asarray(case.kv_lengths, dtype=np.int64)
    if case.q_segment_ids is not None and case.kv_segment_ids is not None:
        arrays["q_segment_ids"] = np.asarray(case.q_segment_ids, dtype=np.int64).reshape(case.batch, case.len_q)
        arrays["kv_segment_ids"] = np.asarray(case.kv_segment_ids, dtype=np.int64).reshape(case.batch, case.len_k)
    if case.paged is not None:
        arrays.update(_paged_cache(case, case.paged, arrays, rng))
    if case.sinks:  # spread wide enough that some rows give most of their weight to the sink
        arrays["sinks"] = 2.0 * rng.standard_normal(heads_q)
    if case.alibi_shape is not None:  # around ALiBi's 2^(−8h/H), some 0, some steep enough to hide far keys
        slopes = np.exp2(-8.0 * rng.random(case.alibi_shape)) * rng.choice([0.0, 1.0, 4.0], size=case.alibi_shape)
        arrays["alibi_slopes"] = slopes.astype(np.float32)
    if case.program is not None:
        for slot, table in enumerate(case.program.tables):
            arrays[program_table(slot)] = table_values(table, rng)
    return arrays


def program_table(slot: int) -> str:
    """The name of a case's program table in make_arrays' dict."""
    return f"program_table_{slot}"


def _paged_cache(
    case: Case, paged: Paged, arrays: dict[str, np.ndarray], rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """The cache of an attend_paged case, and k and v made its gathered keys (§13): key j of sequence b is slot
    j mod block_size of block block_table[b, j // block_size]. Every slot no sequence reads holds NaN."""
    table = np.asarray(paged.block_table, dtype=np.int32)
    positions = np.arange(case.len_k)
    read = positions[None, :] < np.asarray(case.kv_lengths)[:, None]  # (B, Lk): the keys the call has
    blocks = np.where(read, table[:, positions // paged.block_size], 0)[read]
    slots = np.broadcast_to(positions % paged.block_size, read.shape)[read]
    unread = np.ones((paged.num_blocks, paged.block_size), dtype=bool)
    unread[blocks, slots] = False
    caches = {}
    for name, cache_name in (("k", "k_cache"), ("v", "v_cache")):
        in_sequence_order = arrays[name] if case.spec.layout is Layout.BSHD else arrays[name].transpose(0, 2, 1, 3)
        cache = rng.standard_normal((paged.num_blocks, paged.block_size, *in_sequence_order.shape[2:]))
        in_sequence_order[read] = cache[blocks, slots]  # a view: k (v) now holds the gathered keys
        cache[unread] = np.nan
        caches[cache_name] = cache
    return {**caches, "block_table": table}
