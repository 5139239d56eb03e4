"""Hypothesis strategies that draw valid conformance cases, optionally limited to a backend's capabilities."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from hypothesis import strategies as st

from attnkit.backend import ALL_FEATURES, Capabilities, Feature, Sizes
from attnkit.contract.programs import Expr, const, index
from attnkit.spec import AttentionSpec, CausalAlignment, Layout, Variant
from attnkit.testing.cases import SINKS, VARLEN, Case, blocks_needed, paged_case, varlen_case
from attnkit.testing.programs import ProgramCase, Table

SMALL_HEAD_DIMS = (16, 24, 32, 40)
#: One drawn case in this many carries a mask program (where declared and asked for): a program is a new compile on
#: the backends that specialise on it (JAX's jit, the CUDA emulator), so it is drawn more rarely than other clauses.
PROGRAM_ODDS = 4
FLOATING_DTYPES = ("float32", "float16", "bfloat16", "float64")  # float32 first: hypothesis shrinks towards it
HEAD_DIMS = (16, 24, 32, 40, 64, 80, 96, 128, 160, 256)


@st.composite
def specs(draw: st.DrawFn, features: frozenset[Feature] = ALL_FEATURES) -> AttentionSpec:
    """Specs using only ``features`` (names as in attnkit.backend.SPEC_FEATURES)."""
    causal = Feature.CAUSAL in features and draw(st.booleans())
    window = None
    if Feature.WINDOW in features and draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, 12))
        window = draw(st.tuples(side, side).filter(lambda sides: sides != (None, None)))
    alignment = CausalAlignment.BOTTOM_RIGHT
    if Feature.TOP_LEFT in features and (causal or window is not None):
        alignment = draw(st.sampled_from(list(CausalAlignment)))
    cosine = Feature.COSINE in features and draw(st.booleans())
    softcap = draw(st.one_of(st.none(), st.floats(2.0, 50.0))) if Feature.SOFTCAP in features else None
    scale = draw(st.one_of(st.none(), st.floats(0.05, 1.0)))
    layout = draw(st.sampled_from(list(Layout))) if Feature.BSHD in features else Layout.BHSD
    return AttentionSpec(
        causal=causal,
        causal_alignment=alignment,
        window=window,
        scale=scale,
        variant=Variant.COSINE if cosine else Variant.DOT,
        softcap=softcap,
        layout=layout,
    )


@st.composite
def packed_row(draw: st.DrawFn, length: int, documents: int = 3) -> tuple[int, ...]:
    """One row of segment ids as packing makes them: runs of ids 0, 1, ... (documents of any length, one token
    included), each run possibly followed by padding (−1); the whole row padding now and then."""
    if draw(st.integers(0, 7)) == 0:
        return (-1,) * length
    ids: list[int] = []
    document = 0
    while len(ids) < length:
        run = draw(st.integers(1, length - len(ids)))
        ids += [-1 if draw(st.integers(0, 4)) == 0 else min(document, documents)] * run
        document += 1
    return tuple(ids)


@st.composite
def segment_ids(
    draw: st.DrawFn, batch: int, len_q: int, len_k: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(q_segment_ids, kv_segment_ids) per batch element: the same packed row for queries and keys where Lq = Lk
    (self-attention over packed documents, or left padding), or two drawn apart, whose documents then meet at
    any offsets."""
    same = len_q == len_k and draw(st.booleans())
    q_rows, kv_rows = [], []
    for _ in range(batch):
        q_row = draw(packed_row(len_q))
        q_rows.append(q_row)
        kv_rows.append(q_row if same else draw(packed_row(len_k)))
    return tuple(q_rows), tuple(kv_rows)


def _broadcast_shapes(batch: int, heads: int, len_q: int, len_k: int, three_d: bool) -> list[tuple[int, ...]]:
    if three_d:
        return [(batch, len_q, len_k), (1, len_q, len_k), (len_q, len_k), (batch, 1, len_k)]
    return [(batch, heads, len_q, len_k), (batch, 1, len_q, len_k), (len_q, len_k), (1, heads, 1, len_k)]


def _declared(
    capabilities: Capabilities | None, dtypes: Iterable[str] | None, head_dims: Iterable[int]
) -> tuple[frozenset[Feature], list[str], list[int]]:
    """(features, dtypes, head dims) to draw from: the backend's declared ones, or all; ``dtypes`` narrows them."""
    features = capabilities.features if capabilities is not None else ALL_FEATURES
    declared = capabilities.dtypes if capabilities is not None else frozenset(FLOATING_DTYPES)
    allowed_dtypes = [d for d in FLOATING_DTYPES if d in declared and (dtypes is None or d in dtypes)]
    low, high = capabilities.head_dims if capabilities is not None else (1, 1 << 30)
    return frozenset(features), allowed_dtypes, [d for d in head_dims if low <= d <= high]


@st.composite
def _geometry(draw: st.DrawFn, dtypes: list[str], head_dims: list[int]) -> dict[str, Any]:
    """Heads (GQA/MQA), head dims (Dv ≠ D now and then), dtype and seed of a ragged call."""
    heads_kv = draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from(head_dims))
    return {
        "heads_kv": heads_kv,
        "heads_q": heads_kv * draw(st.sampled_from([1, 2, 4])),
        "head_dim": head_dim,
        "head_dim_v": draw(st.one_of(st.just(head_dim), st.sampled_from(head_dims))),
        "dtype": draw(st.sampled_from(dtypes)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@st.composite
def cases(
    draw: st.DrawFn,
    capabilities: Capabilities | None = None,
    dtypes: Iterable[str] | None = None,
    max_len: int = 24,
    head_dims: Iterable[int] = SMALL_HEAD_DIMS,
    every_clause: bool = False,
) -> Case:
    """Valid cases: Lq ≠ Lk both ways, Lq = 1 decode, GQA/MQA, non-power-of-two head dims, masks with fully
    masked rows, bias (with and without its gradient), lengths including 0, both layouts, 3-D inputs; with
    ``every_clause`` (the conformance harness and ``attnkit check``), mask programs and dropout where declared too
    (a program is a compile where a backend specialises on one, and dropout's mask moves under the index
    permutations of the metamorphic relations).

    With ``capabilities``, only the features, dtypes and head dims that backend declares are drawn; ``dtypes``
    (default: every declared one, or all four floating dtypes) narrows the dtypes.
    """
    features, allowed_dtypes, allowed_dims = _declared(capabilities, dtypes, head_dims)
    spec = draw(specs(features))
    three_d = draw(st.booleans()) if draw(st.integers(0, 9)) == 0 else False
    batch = draw(st.integers(1, 3))
    heads_kv = 1 if three_d else draw(st.integers(1, 2))
    heads_q = heads_kv * (1 if three_d else draw(st.sampled_from([1, 2, 4])))
    len_q = draw(st.one_of(st.just(1), st.integers(1, max_len)))
    len_k = draw(st.integers(1, max_len))
    head_dim = draw(st.sampled_from(allowed_dims))
    head_dim_v = draw(st.one_of(st.just(head_dim), st.sampled_from(allowed_dims)))
    dtype = draw(st.sampled_from(allowed_dtypes))
    mask_shape = None
    masked_rows: tuple[int, ...] = ()
    if Feature.MASK in features and draw(st.booleans()):
        mask_shape = draw(st.sampled_from(_broadcast_shapes(batch, heads_q, len_q, len_k, three_d)))
        if mask_shape[-2] == len_q and draw(st.booleans()):  # a broadcast query axis has no row to blank
            masked_rows = tuple(sorted(draw(st.sets(st.integers(0, len_q - 1), min_size=1, max_size=2))))
    bias_shape = None
    bias_grad = False
    if Feature.BIAS in features and draw(st.booleans()):
        bias_shape = draw(st.sampled_from(_broadcast_shapes(batch, heads_q, len_q, len_k, three_d)))
        bias_grad = Feature.DBIAS in features and draw(st.booleans())
    lengths = st.lists(st.integers(0, max_len), min_size=batch, max_size=batch)
    q_lengths = None
    if Feature.Q_LENGTHS in features and draw(st.booleans()):
        q_lengths = tuple(min(n, len_q) for n in draw(lengths))
    kv_lengths = None
    if Feature.KV_LENGTHS in features and draw(st.booleans()):
        kv_lengths = tuple(min(n, len_k) for n in draw(lengths))
    q_segment_ids = kv_segment_ids = None
    if Feature.SEGMENT_IDS in features and draw(st.booleans()):
        q_segment_ids, kv_segment_ids = draw(segment_ids(batch, len_q, len_k))
    return Case(
        spec=spec,
        batch=batch,
        heads_q=heads_q,
        heads_kv=heads_kv,
        len_q=len_q,
        len_k=len_k,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=dtype,
        mask_shape=mask_shape,
        masked_rows=masked_rows,
        bias_shape=bias_shape,
        bias_grad=bias_grad,
        q_lengths=q_lengths,
        kv_lengths=kv_lengths,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        three_d=three_d,
        seed=draw(st.integers(0, 2**31 - 1)),
        grad=Feature.GRAD in features,
        sinks=draw(sinks_drawn()),
        alibi_shape=draw(alibi_drawn(features, batch, heads_q)),
        program=draw(programs(batch, heads_q, len_q, len_k)) if every_clause and Feature.MASK_PROGRAM in features
        and draw(st.integers(1, PROGRAM_ODDS)) == 1 else None,
        dropout=draw(dropout_drawn(features)) if every_clause else None,
    )  # fmt: skip


def dropout_drawn(features: frozenset[Feature]) -> st.SearchStrategy[tuple[float, int] | None]:
    """(p, seed) of §18's dropout in a third of the calls where declared, else None: p from the probabilities models
    train with and the extremes, the seed anywhere in [0, 2⁶⁴)."""
    if Feature.DROPOUT not in features:
        return st.none()
    drawn = st.tuples(st.sampled_from([0.05, 0.1, 0.3, 0.5, 0.9]), st.integers(0, 2**64 - 1))
    return st.integers(0, 2).flatmap(lambda third: drawn if third == 0 else st.none())


def sinks_drawn() -> st.SearchStrategy[bool]:
    """Whether a call has sinks (§15), in a third of the draws, whatever the dtype: every backend serves them (attend
    composes them with its lse, which is float64 in float64 calls, §6)."""
    return st.integers(0, 2).map(lambda draw: draw == 0)


def alibi_drawn(
    features: frozenset[Feature], batch: int, heads_q: int, per_row: bool = True
) -> st.SearchStrategy[tuple[int, ...] | None]:
    """ALiBi slopes' shape (§16) in a third of the calls where declared, as sinks: (Hq,), or (B, Hq) where
    ``per_row`` (a batch row's own slopes), else None."""
    if Feature.ALIBI not in features:
        return st.none()
    shapes = [(heads_q,), (batch, heads_q)] if per_row else [(heads_q,)]
    return st.integers(0, 2).flatmap(lambda third: st.sampled_from(shapes) if third == 0 else st.none())


def _call_features(case: Case) -> frozenset[Feature]:
    """The features a ragged call of this form needs whatever its spec (gradients are drawn only where declared)."""
    return frozenset(Feature(name) for name in case.features() - {VARLEN, SINKS, Feature.GRAD})


# What each ragged form needs, read off the cases it builds: the attend call attend_varlen makes of equal offsets
# (segment ids) and of different ones (lengths), and attend_paged (§12, §13).
_SELF_PACKED = _call_features(varlen_case(AttentionSpec(), (1,), (1,), grad=False))
_CROSS = _call_features(varlen_case(AttentionSpec(), (1,), (2,), grad=False))
_PAGED = _call_features(paged_case(AttentionSpec(), 1, ((0,),), (1,), num_blocks=1))
#: Block sizes of drawn paged caches: 1, and sizes that divide no kernel tile.
PAGED_BLOCK_SIZES = (1, 2, 3, 5, 16)


def varlen_forms(capabilities: Capabilities | None) -> list[bool]:
    """The attend_varlen forms a backend serves, by ``self_packed``: the attend call each makes uses only declared
    features."""
    features = capabilities.features if capabilities is not None else ALL_FEATURES
    return [self_packed for self_packed, needs in ((True, _SELF_PACKED), (False, _CROSS)) if needs <= features]


def serves_paged(capabilities: Capabilities | None) -> bool:
    return _PAGED <= (capabilities.features if capabilities is not None else ALL_FEATURES)


@st.composite
def varlen_cases(
    draw: st.DrawFn,
    capabilities: Capabilities | None = None,
    dtypes: Iterable[str] | None = None,
    max_len: int = 12,
    head_dims: Iterable[int] = SMALL_HEAD_DIMS,
) -> Case:
    """attend_varlen calls (§12): 1 to 4 sequences, empty and one-token ones included, self-packed (cu_q = cu_k) or
    cross, over every spec feature declared; gradients and dropout where declared (a self-packed call with dropout
    is the padded batch's, :func:`attnkit.testing.cases.varlen_case`). Needs :func:`varlen_forms` non-empty."""
    features, allowed_dtypes, allowed_dims = _declared(capabilities, dtypes, head_dims)
    self_packed = draw(st.sampled_from(varlen_forms(capabilities)))
    count = draw(st.integers(1, 4))
    lengths = st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(0, max_len)), min_size=count, max_size=count)
    q_lengths = tuple(draw(lengths))
    if not any(q_lengths):
        q_lengths = (1, *q_lengths[1:])  # some query: an empty packed q is §9's business, not §12's
    kv_lengths = q_lengths if self_packed else tuple(draw(lengths))
    if not self_packed and kv_lengths == q_lengths:  # equal offsets would make it self-packed
        kv_lengths = (*kv_lengths[:-1], kv_lengths[-1] + 1)
    spec = draw(specs(features))
    geometry = draw(_geometry(allowed_dtypes, allowed_dims))
    # A packed row's slopes are one per head; per-sequence slopes make attend_varlen's padded batch (§16).
    alibi_shape = draw(alibi_drawn(features, count, geometry["heads_q"], per_row=not self_packed))
    dropout = draw(dropout_drawn(features)) if _CROSS <= features else None
    return varlen_case(spec, q_lengths, kv_lengths, grad=Feature.GRAD in features, sinks=draw(sinks_drawn()),
                       alibi_shape=alibi_shape, dropout=dropout, **geometry)  # fmt: skip


def _paged_sizes(capabilities: Capabilities | None, head_dims: list[int]) -> tuple[list[int], list[int]]:
    """The block sizes and head dims to draw paged calls from: PAGED_BLOCK_SIZES and ``head_dims`` within what the
    backend declares for paged caches (the least size a rule allows where it allows none of those)."""

    def allowed(sizes: Iterable[int], rule: Sizes | None) -> list[int]:
        if rule is None:
            return list(sizes)
        return [size for size in sizes if size in rule] or [rule.least]

    if capabilities is None:
        return list(PAGED_BLOCK_SIZES), head_dims
    return allowed(PAGED_BLOCK_SIZES, capabilities.paged_block_sizes), allowed(head_dims, capabilities.paged_head_dims)


@st.composite
def paged_cases(
    draw: st.DrawFn,
    capabilities: Capabilities | None = None,
    dtypes: Iterable[str] | None = None,
    max_len: int = 20,
    head_dims: Iterable[int] = SMALL_HEAD_DIMS,
) -> Case:
    """attend_paged calls (§13, forward only): 1 to 4 new queries per sequence; kv_lengths including 0 and partial
    last blocks; block tables drawing blocks from a cache too small for every sequence to have its own (so blocks are
    shared, within a sequence too) in any order; entries past a sequence's blocks −1, out of range, or any block.
    make_arrays puts NaN in every slot no sequence reads. Needs :func:`serves_paged`."""
    features, allowed_dtypes, allowed_dims = _declared(capabilities, dtypes, head_dims)
    block_sizes, allowed_dims = _paged_sizes(capabilities, allowed_dims)
    batch = draw(st.integers(1, 3))
    block_size = draw(st.sampled_from(block_sizes))
    lengths = st.lists(st.one_of(st.just(0), st.integers(0, max_len)), min_size=batch, max_size=batch)
    kv_lengths = tuple(draw(lengths))
    needed = [blocks_needed(n, block_size) for n in kv_lengths]
    max_blocks = max(max(needed) + draw(st.integers(0, 1)), 1)
    num_blocks = draw(st.integers(1, sum(needed) + 2))
    read = st.integers(0, num_blocks - 1)
    never_read = st.one_of(st.sampled_from([-1, num_blocks, 2**31 - 1]), read)
    table = tuple(tuple(draw(read if j < n else never_read) for j in range(max_blocks)) for n in needed)
    spec = draw(specs(features))
    geometry = draw(_geometry(allowed_dtypes, allowed_dims))
    alibi_shape = draw(alibi_drawn(features, batch, geometry["heads_q"]))
    return paged_case(spec, block_size, table, kv_lengths, num_blocks, len_q=draw(st.integers(1, 4)),
                      sinks=draw(sinks_drawn()), alibi_shape=alibi_shape, **geometry)  # fmt: skip


@st.composite
def calls(draw: st.DrawFn, capabilities: Capabilities | None = None, dtypes: Iterable[str] | None = None) -> Case:
    """Every call form a backend serves: attend in half the draws, attend_varlen and attend_paged in the rest."""
    ragged: list[Callable[..., st.SearchStrategy[Case]]] = []
    ragged += [varlen_cases] if varlen_forms(capabilities) else []
    ragged += [paged_cases] if serves_paged(capabilities) else []
    attend_only = not ragged or draw(st.booleans())
    if attend_only:
        return draw(cases(capabilities=capabilities, dtypes=dtypes, every_clause=True))
    return draw(draw(st.sampled_from(ragged))(capabilities=capabilities, dtypes=dtypes))


# Mask programs (docs/semantics.md §17): the grammar's expressions, model masks first.
_INDEX_NAMES = ("b", "h", "q", "kv")


@st.composite
def programs(draw: st.DrawFn, batch: int, heads: int, len_q: int, len_k: int, max_depth: int = 4) -> ProgramCase:
    """A program over a call of these sizes: a model's mask (document causal, prefix-LM, chunked, image groups, a
    window with global tokens, strided) in a third of the draws, else one drawn from the grammar; either may then be
    combined with another drawn clause."""
    length = max(len_q, len_k)
    tables = (Table((batch, length), draw(st.sampled_from(["documents", "ids"]))), Table((length,), "flags"))
    depth = draw(st.integers(1, max_depth))
    if draw(st.integers(0, 2)) == 0:
        expr = draw(_model_masks(len_q, len_k, length))
        if draw(st.booleans()):
            combine = draw(st.sampled_from(["and", "or"]))
            expr = Expr(combine, (expr, draw(_bools(depth - 1, tables))), kind="bool")
    else:
        expr = draw(_bools(depth, tables))
    if not any(node.op == "index" and node.value in ("q", "kv") for node in expr.walk()):
        # a program of b and h alone is a per-head mask: keep one, and make most depend on positions
        if draw(st.booleans()):
            expr = Expr("and", (expr, _cmp("ge", index("q"), index("kv"))), kind="bool")
    used = {int(node.value) for node in expr.walk() if node.op == "read"}  # type: ignore[arg-type]
    kept = tuple(tables[slot] for slot in sorted(used))
    renumber = {slot: new for new, slot in enumerate(sorted(used))}
    return ProgramCase(_renumber(expr, renumber), kept)


def _renumber(expr: Expr, slots: dict[int, int]) -> Expr:
    args = tuple(_renumber(arg, slots) for arg in expr.args)
    value = slots[int(expr.value)] if expr.op == "read" else expr.value  # type: ignore[arg-type]
    return Expr(expr.op, args, value, expr.kind)


def _cmp(op: str, a: Expr, b: Expr) -> Expr:
    return Expr(op, (a, b), kind="bool")


def _int(op: str, *args: Expr) -> Expr:
    return Expr(op, args)


def _clamped(position: Expr, size: int) -> Expr:
    return _int("min", _int("max", position, const(0)), const(size - 1))


@st.composite
def _model_masks(draw: st.DrawFn, len_q: int, len_k: int, length: int) -> Expr:
    q, kv = index("q"), index("kv")
    causal = _cmp("ge", q, kv)
    name = draw(st.sampled_from(["document", "prefix", "chunked", "images", "window_global", "strided", "dilated"]))
    if name == "document":  # packed documents, causal within each
        ids = Expr("read", (index("b"), _clamped(q, length)), 0), Expr("read", (index("b"), _clamped(kv, length)), 0)
        return Expr("and", (_cmp("eq", *ids), causal), kind="bool")
    if name == "prefix":  # a bidirectional prefix, causal after it
        return Expr("or", (_cmp("lt", kv, const(draw(st.integers(0, len_k)))), causal), kind="bool")
    if name == "chunked":  # Llama 4: causal within chunks of C
        chunk = draw(st.integers(1, 8))
        same = _cmp("eq", _int("floordiv", q, const(chunk)), _int("floordiv", kv, const(chunk)))
        return Expr("and", (same, causal), kind="bool")
    if name == "images":  # Gemma 3: causal text, image tokens (flags) bidirectional within their group (ids)
        flag_q = Expr("read", (_clamped(q, length),), 1, "bool")
        flag_kv = Expr("read", (_clamped(kv, length),), 1, "bool")
        group = _cmp(
            "eq",
            Expr("read", (index("b"), _clamped(q, length)), 0),
            Expr("read", (index("b"), _clamped(kv, length)), 0),
        )
        return Expr("or", (causal, Expr("and", (Expr("and", (flag_q, flag_kv), kind="bool"), group), kind="bool")),
                    kind="bool")  # fmt: skip
    if name == "window_global":  # ModernBERT-style local window, plus global tokens that see and are seen by all
        window = _cmp("le", _int("abs", _int("sub", q, kv)), const(draw(st.integers(0, 6))))
        globals_ = const(draw(st.integers(0, 3)))
        return Expr("or", (window, Expr("or", (_cmp("lt", q, globals_), _cmp("lt", kv, globals_)), kind="bool")),
                    kind="bool")  # fmt: skip
    stride = const(draw(st.integers(1, 4)))
    if name == "strided":
        return Expr("and", (causal, _cmp("eq", _int("mod", _int("sub", q, kv), stride), const(0))), kind="bool")
    return Expr("and", (causal, _cmp("eq", _int("trem", kv, stride), _int("trem", q, stride))), kind="bool")


def _ints(depth: int, tables: tuple[Table, ...]) -> st.SearchStrategy[Expr]:
    leaves = st.one_of(st.sampled_from([index(name) for name in _INDEX_NAMES]), st.integers(-2, 6).map(const))
    if depth <= 0:
        return leaves
    smaller = _ints(depth - 1, tables)
    positive = st.integers(1, 5).map(const)
    length = tables[0].shape[1]
    return st.one_of(
        leaves,
        st.tuples(st.sampled_from(["add", "sub", "min", "max"]), smaller, smaller).map(lambda t: _int(*t)),
        st.tuples(smaller, st.integers(-2, 3).map(const)).map(lambda t: _int("mul", *t)),
        st.tuples(st.sampled_from(["floordiv", "mod", "tdiv", "trem"]), smaller, positive).map(lambda t: _int(*t)),
        st.tuples(st.sampled_from(["abs", "neg"]), smaller).map(lambda t: _int(*t)),
        st.tuples(_bools(depth - 1, tables), smaller, smaller).map(lambda t: _int("where", *t)),
        smaller.map(lambda position: Expr("read", (index("b"), _clamped(position, length)), 0)),
    )


def _bools(depth: int, tables: tuple[Table, ...]) -> st.SearchStrategy[Expr]:
    position = st.sampled_from([index("q"), index("kv")])
    comparison = st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge"])
    leaves = st.tuples(comparison, position, st.one_of(position, _ints(0, tables))).map(lambda t: _cmp(*t))
    if depth <= 0:
        return leaves
    smaller, ints = _bools(depth - 1, tables), _ints(depth - 1, tables)
    flags = tables[1].shape[0]
    return st.one_of(
        leaves,
        st.tuples(comparison, ints, ints).map(lambda t: _cmp(*t)),
        st.tuples(st.sampled_from(["and", "or", "xor"]), smaller, smaller).map(
            lambda t: Expr(t[0], t[1:], kind="bool")
        ),
        smaller.map(lambda a: Expr("not", (a,), kind="bool")),
        ints.map(lambda position: Expr("read", (_clamped(position, flags),), 1, "bool")),
    )
