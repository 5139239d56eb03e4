"""``attn_implementation="attnkit"`` for Hugging Face transformers models (docs/integrations.md).

    import attnkit.integrations.transformers as attnkit_hf
    attnkit_hf.register()                     # importing registers too; register() is idempotent
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnkit")

Two hooks are registered under the name ``"attnkit"``:

* in ``AttentionMaskInterface``, :func:`make_mask`: transformers calls it once per forward and mask kind (full,
  sliding) with the raw facts (the 2-D padding mask, where the queries and keys sit in the sequence, the mask
  pattern). It answers with an :class:`AttnkitMask`: the pattern as spec fields, padding as ``kv_lengths`` or
  segment ids (docs/semantics.md §4.5), packed sequences as segment ids; never a mask, except transformers' own
  (Lq, Lk) one for patterns attnkit cannot express (docs/integrations.md);
* in ``AttentionInterface``, :func:`attention`: every attention layer's call, which runs :func:`attnkit.attend`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import AttentionInterface, AttentionMaskInterface, masking_utils

from attnkit import programs
from attnkit.api import attend
from attnkit.backend import Framework
from attnkit.errors import InvalidInputError, MaskProgramError
from attnkit.frontends import register_imported_frameworks
from attnkit.registry import get_backend
from attnkit.spec import AttentionSpec, CausalAlignment

register_imported_frameworks()  # torch tensors' frontend in attend's table before any trace

NAME = "attnkit"
#: Names the attnkit backend every call uses when register() is given none ("auto" when unset).
BACKEND_ENV = "ATTNKIT_TRANSFORMERS_BACKEND"
#: Keyword arguments of transformers' attention calls whose meaning attnkit cannot express.
_INEXPRESSIBLE = {
    "position_bias": "position_bias (T5-style learned relative bias)",
    "cache": "a paged KV cache (continuous batching): attnkit reads key and value as given",
}

_backend = "auto"


def register(backend: str | None = None) -> None:
    """Make ``attn_implementation="attnkit"`` available to transformers models. Idempotent.

    :param backend: one attnkit backend for every call (default: the ``ATTNKIT_TRANSFORMERS_BACKEND``
        environment variable, else ``"auto"``, attnkit's own choice per call).
    :raises attnkit.UnknownBackendError: an unknown name, here rather than at the first forward.
    """
    global _backend
    chosen = backend or os.environ.get(BACKEND_ENV) or "auto"
    if chosen != "auto":
        get_backend(chosen)
    _backend = chosen
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, make_mask)


@dataclass(frozen=True, eq=False)  # tensors inside: identity, not element-wise equality
class AttnkitMask:
    """The visibility of one forward's attention calls, as attnkit's spec fields and call arguments.

    ``kv_lengths`` clips the unwritten slots of a static cache and, with bottom-right alignment, places the causal
    diagonal (docs/semantics.md §4.3: ``off_b = kv_lengths[b] − Lq``); with ``top_left`` (right padding, queries
    at the start) it is the padding itself. ``q_segment_ids`` (B, Lq) and ``kv_segment_ids`` (B, Lk) (§4.5) carry
    what no length expresses: padding anywhere else (key ids −1 on the pad positions) and packed sequences (one id
    per sequence of the row); both None otherwise. ``mask_mod``: transformers' own mask function as a mask program
    on attnkit's raw indices (§17), padding included, for the patterns no spec field expresses; the spec is then
    neither causal nor windowed, and ``kv_lengths`` only clips a static cache's unwritten slots.
    """

    causal: bool
    window: tuple[int, int] | None
    top_left: bool
    kv_lengths: torch.Tensor | None
    q_segment_ids: torch.Tensor | None
    kv_segment_ids: torch.Tensor | None
    q_length: int
    kv_length: int
    mask_mod: Callable[..., Any] | None = None

    # transformers' mask preparation reads .ndim (2 would mark a raw padding mask to convert), and generate()
    # calls .contiguous() on the masks it prepares for static caches.
    ndim: ClassVar[int] = 4

    def contiguous(self) -> AttnkitMask:
        return self

    def spec(self, scale: float | None, softcap: float | None) -> AttentionSpec:
        return _spec(self.causal, self.top_left, self.window, scale, softcap)


def _causal_window(size: int) -> tuple[int, int]:
    """transformers' causal sliding window of ``size`` holds that many keys, the query's own included
    (kv_idx > q_idx − size): attnkit's window reaches size − 1 keys back."""
    return size - 1, 0


class _Table:
    """A tensor that a mask function indexes by (batch, position), held in a formula without reading its values."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __repr__(self) -> str:  # formulas are sorted by repr: a tensor's would read its values
        return "table"


class _Index:
    """An index given to a mask function in place of a number: every operation on it returns the expression it
    stands for, so calling the function yields the function's own formula. Indexing a tensor with indices yields
    ``("take", table, *indices)`` (packed sequences read their sequence ids and positions so); an operation with
    anything but an index or an int (chunked attention, padding) yields :data:`_OPAQUE`. Tensors see an index
    through ``__torch_function__``, which a compiled graph traces as it does any Python object."""

    __slots__ = ("expr",)
    device = None  # and_masks moves each part's result to the first's device

    def __init__(self, expr: Any) -> None:
        self.expr = expr

    def new_ones(self, *args: Any, **kwargs: Any) -> _Index:  # and_masks' neutral element
        return _Index(True)

    def to(self, *args: Any, **kwargs: Any) -> _Index:
        return self

    def __bool__(self) -> bool:  # a function that branches on an index is no pattern _pattern knows
        raise TypeError("an index of a mask function's formula has no truth value")

    def __abs__(self) -> _Index:
        return _Index(("abs", self.expr))

    def __invert__(self) -> _Index:
        return _OPAQUE

    __neg__ = __invert__

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> _Index:
        if func is torch.Tensor.__getitem__ and isinstance(args[0], torch.Tensor) and isinstance(args[1], tuple):
            if all(isinstance(index, _Index) for index in args[1]):
                return _Index(("take", _Table(args[0]), *(index.expr for index in args[1])))
        return _OPAQUE


def _operation(name: str) -> Callable[[_Index, Any], _Index]:
    def apply(self: _Index, other: Any) -> _Index:
        if isinstance(other, _Index):
            return _Index((name, self.expr, other.expr))
        return _Index((name, self.expr, other)) if type(other) is int else _OPAQUE

    return apply


for _name in ("sub", "add", "mul", "floordiv", "mod", "and", "or", "xor"):
    setattr(_Index, f"__{_name}__", _operation(_name))
    setattr(_Index, f"__r{_name}__", _operation(f"r{_name}"))
for _name in ("lt", "le", "gt", "ge", "eq", "ne", "getitem"):
    setattr(_Index, f"__{_name}__", _operation(_name))
_OPAQUE = _Index("opaque")


@dataclass(frozen=True, eq=False)
class _Pattern:
    """What a mask function computes, in attnkit's terms. ``packed`` (B, L): the sequence id of each position of
    packed rows, whose pattern transformers computes on ``positions`` (B, L) rather than on the indices."""

    causal: bool
    window: tuple[int, int] | None
    packed: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def _conjunction(formula: Any) -> list[Any]:
    """The terms of a formula's conjunction, and_masks' neutral True left out."""
    terms: list[Any] = []
    pending = [formula]
    while pending:
        term = pending.pop()
        if isinstance(term, tuple) and term[0] == "and":
            pending += term[1:]
        elif term is not True:
            terms.append(term)
    return terms


def _sequence_ids(term: Any) -> torch.Tensor | None:
    """``ids`` of the term ``ids[batch, q] == ids[batch, kv]`` (query and key in the same packed sequence), else
    None."""
    match term:
        case ("eq", ("take", _Table(tensor=ids), "batch", "q"), ("take", _Table(tensor=same), "batch", "kv")):
            return ids if ids is same else None
    return None


def _unpack(terms: list[Any]) -> tuple[list[Any], torch.Tensor | None, torch.Tensor | None]:
    """transformers' packed sequences (``packed_sequence_compatibility_function``: the same sequence id, and the
    pattern computed on ``positions[batch, q_idx]``, ``positions[batch, kv_idx]``) as (the other terms with those
    positions read as the indices q and kv, the sequence ids, the positions); anything else as (terms, None,
    None)."""
    packing = [term for term in terms if _sequence_ids(term) is not None]
    if len(packing) != 1:
        return terms, None, None
    tables: dict[int, torch.Tensor] = {}

    def as_index(expr: Any) -> Any:
        match expr:
            case ("take", _Table(tensor=table), "batch", ("q" | "kv") as index):
                tables[id(table)] = table
                return index
            case tuple():
                return tuple(as_index(part) for part in expr)
        return expr

    rest = [as_index(term) for term in terms if term is not packing[0]]
    if len(tables) != 1:  # the pattern reads one positions table, and only by (batch, index)
        return terms, None, None
    return rest, _sequence_ids(packing[0]), next(iter(tables.values()))


def _pattern(mask_function: Callable[..., Any]) -> _Pattern | None:
    """The :class:`_Pattern` of the mask functions transformers builds for causal and bidirectional attention, with
    or without a sliding window, and for packed sequences with a causal one, read from the formula the function
    computes (:class:`_Index`); None for any other (chunked attention, or/and overlays). No value is read, so a
    compiled graph traces it."""
    try:
        formula = mask_function(_Index("batch"), _Index("head"), _Index("q"), _Index("kv")).expr
    except Exception:  # foreign code that does what no index can: transformers' own mask says what it means
        return None
    terms, packed, positions = _unpack(_conjunction(formula))
    match sorted(terms, key=repr):
        case [("le", "kv", "q")]:  # kv_idx <= q_idx
            causal, window = True, None
        case [("ge", "q", 0)]:  # q_idx >= 0: every key
            causal, window = False, None
        case [("gt", "kv", ("sub", "q", int(size))), ("le", "kv", "q")] if size >= 1:  # and kv_idx > q_idx − N
            causal, window = True, _causal_window(size)
        case [("ge", "q", 0), ("le", ("abs", ("sub", "q", "kv")), int(size))] if size >= 1:  # and |q_idx − kv_idx| <= N
            causal, window = False, (size, size)
        case _:
            return None
    if packed is not None and not causal:  # transformers packs causal attention only; positions[q] >= 0 is no index
        return None
    return _Pattern(causal, window, packed, positions)


def _may_index_tensors(attention_mask: Any, q_offset: int | torch.Tensor, kv_offset: int, overlaid: bool) -> bool:
    """Inside a compiled graph, whether the mask function may index a tensor by (batch, position), which a graph
    cannot trace with :class:`_Index` positions: the overlays a model adds (transformers sets ``use_vmap`` for them),
    and packed sequences, which transformers assumes in a graph whenever there is neither a padding mask nor a cache
    (it cannot read position_ids there). Those patterns get transformers' own mask, as outside a graph."""
    no_cache = type(q_offset) is int and q_offset == 0 and kv_offset == 0
    return torch.compiler.is_compiling() and (overlaid or (attention_mask is None and no_cache))


def make_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] = masking_utils.causal_mask_function,
    attention_mask: torch.Tensor | AttnkitMask | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> AttnkitMask | torch.Tensor:
    """transformers' mask hook: an :class:`AttnkitMask`, or for a pattern attnkit cannot express, transformers'
    own boolean (B, 1, Lq, Lk) mask. transformers calls it (``AttentionMaskInterface``); a model's code does not.

    :param batch_size: B.
    :param q_length: the forward's query count Lq.
    :param kv_length: the key count Lk (a static cache's whole length, written or not).
    :param q_offset: the position of the first query in the sequence (a tensor for static caches).
    :param kv_offset: the position of the first key.
    :param mask_function: transformers' mask pattern (causal, sliding, chunked, packed, overlays), read into spec
        fields or a mask program.
    :param attention_mask: the 2-D (B, Lk) padding mask, or an :class:`AttnkitMask` already made for this call.
    :param local_size: the local attention's size, passed on to transformers' own mask where one is made.
    :param use_vmap: transformers' request to build its mask with vmap (arbitrary index functions).
    :param device: where transformers' own mask, where one is made, lives.
    :param kwargs: transformers' further arguments, unused.
    """
    if isinstance(attention_mask, AttnkitMask):  # prepared by generate() for this very call
        return attention_mask
    pattern = None if _may_index_tensors(attention_mask, q_offset, kv_offset, use_vmap) else _pattern(mask_function)
    # Query i sits at position q_offset + i, key j at kv_offset + j: key j is at or before query i when
    # j <= i + diagonal. Keys from diagonal + Lq on are later than every query: a static cache's unwritten slots.
    # q_offset is a tensor for static caches. Inside a compiled graph its value cannot be read: a static cache keeps
    # q_length <= written <= Lk (an overflowing write fails in the cache), and kv_lengths = written is then checked
    # against Lk where the graph runs.
    traced_offset = isinstance(q_offset, torch.Tensor) and torch.compiler.is_compiling()
    q_start = q_offset if traced_offset else int(q_offset)
    diagonal = q_start - kv_offset
    written = diagonal + q_length
    expressible = pattern is not None and (traced_offset or q_length <= written <= kv_length)
    if pattern is not None and pattern.packed is not None:
        expressible = expressible and _packed_as_indexed(pattern, q_length, kv_length, diagonal)
    if pattern is None or not expressible:
        # attend takes no mask program inside a compiled graph yet (q_start may be a tensor there), and foreign code
        # that no program can trace gets none: transformers' own mask is then the truth.
        if not torch.compiler.is_compiling() and isinstance(q_start, int):
            program = _program_mask(batch_size, q_length, kv_length, q_start, kv_offset, mask_function,
                                    attention_mask, device)  # fmt: skip
            if program is not None:
                return program
        materialised = masking_utils.sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_start,  # type: ignore[arg-type]  # a tensor in a graph, as transformers itself passes it
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            local_size=local_size,
            allow_is_causal_skip=False,
            use_vmap=use_vmap,
            device=device,
        )
        assert materialised is not None  # None only where a skip is allowed
        return materialised
    described = functools.partial(
        AttnkitMask, pattern.causal, pattern.window, q_length=q_length, kv_length=kv_length, top_left=False
    )
    if pattern.packed is not None:  # the whole row, Lq = Lk (_packed_as_indexed): each sequence its own id
        return described(kv_lengths=None, q_segment_ids=pattern.packed, kv_segment_ids=pattern.packed)
    # A static cache's kv_lengths (q_offset a tensor) is there on every step, up to the one that fills the cache, where
    # it clips nothing: the masks generate() hands a compiled forward keep one structure, which it is traced for.
    if isinstance(written, torch.Tensor):  # traced_offset
        clip = written.expand(batch_size)
    elif written < kv_length or isinstance(q_offset, torch.Tensor):
        clip = torch.full((batch_size,), written, device=device)
    else:
        clip = None

    padding = masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    keys = None if padding is None else padding[:, kv_offset : kv_offset + kv_length].bool()
    unpadded = functools.partial(described, kv_lengths=clip, q_segment_ids=None, kv_segment_ids=None)
    if keys is None:
        return unpadded()

    def by_segments() -> AttnkitMask:
        q_ids, kv_ids = _padding_ids(keys, q_length)
        return described(kv_lengths=clip, q_segment_ids=q_ids, kv_segment_ids=kv_ids)

    if torch.compiler.is_compiling():
        # No tensor value may be read in a graph, so none of the compact choices below: any padding goes in as
        # segment ids, which are exact whatever the padding (only right padding had a shorter form).
        return by_segments()
    if bool(keys[:, :written].all()):
        return unpadded()
    real = keys.sum(1)
    right_padded = torch.equal(keys, torch.arange(kv_length, device=keys.device) < real[:, None])
    if right_padded and diagonal == 0:
        # Queries start at key 0, so top-left alignment places the diagonal; the padding is a length. (Bottom-right
        # would need q_lengths = kv_lengths, which empties the padded query rows that transformers computes.)
        return described(top_left=True, kv_lengths=real, q_segment_ids=None, kv_segment_ids=None)
    return by_segments()  # left padding (or holes, or right padding behind a cache)


def _program_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    mask_function: Callable[..., Any],
    attention_mask: torch.Tensor | None,
    device: torch.device | str,
) -> AttnkitMask | None:
    """transformers' mask function as attnkit's mask program (docs/semantics.md §17), for patterns that no spec field
    expresses (chunked attention, the overlays of vision-language models, packed sequences on other geometries):
    the visibility ``sdpa_mask`` would materialise, with nothing materialised. None where the function does what a
    program cannot (foreign code): transformers' own mask is then the truth.

    The function takes absolute positions; attnkit's program its raw indices 0..Lq−1, 0..Lk−1. Query i sits at
    ``q_offset + i`` and key j at ``kv_offset + j``, so the program is transformers' function behind its own
    ``add_offsets_to_mask_function`` (what its flex_attention mask does), and the padding its own
    ``padding_mask_function`` ANDed in, as ``sdpa_mask`` does. With neither, the program is the very function object
    transformers built, shared by every layer of the forward (attnkit traces a function once)."""
    padding = masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None and not bool(padding[:, kv_offset : kv_offset + kv_length].all()):
        padding_function = masking_utils.padding_mask_function(padding.bool())
        mask_function = masking_utils.and_masks(mask_function, padding_function)
    if q_offset or kv_offset:
        mask_function = masking_utils.add_offsets_to_mask_function(mask_function, q_offset, kv_offset)
    try:
        programs.trace(mask_function, Framework.TORCH)  # cached by the function: attend's bind takes it from there
    except MaskProgramError:
        return None
    # Keys from `written` on are later than every query: a static cache's unwritten slots, never read (§5).
    written = q_offset - kv_offset + q_length
    clip = torch.full((batch_size,), written, device=device) if q_length <= written < kv_length else None
    return AttnkitMask(False, None, False, clip, None, None, q_length, kv_length, mask_mod=mask_function)


def _padding_ids(keys: torch.Tensor, q_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_segment_ids, kv_segment_ids) of a (B, Lk) boolean padding mask (True: a real key): every key id 0, and −1
    on the pad positions, which are then never read; every query id 0, so that each query sees what transformers'
    own mask shows it: a padded query row sees the real keys its pattern reaches (none, for causal attention behind
    left padding), as in transformers."""
    kv_ids = keys.to(torch.int32) - 1
    return kv_ids.new_zeros(keys.shape[0], q_length), kv_ids


def _packed_as_indexed(pattern: _Pattern, q_length: int, kv_length: int, diagonal: Any) -> bool:
    """Whether packed sequences' pattern, which transformers computes on the positions, is the same pattern on the
    indices: the call covers the whole row from its start (transformers packs only without a cache), and inside each
    sequence the positions step by one, which holds where the sequence ids are transformers' own reading of the
    positions (``find_packed_sequence_indices``). That reads the positions' values, so inside a compiled graph, where
    transformers itself cannot read them and calls every row packed, it is transformers' own mask."""
    assert pattern.packed is not None and pattern.positions is not None
    if torch.compiler.is_compiling() or isinstance(diagonal, torch.Tensor) or diagonal != 0:
        return False
    if not q_length == kv_length == pattern.packed.shape[1] == pattern.positions.shape[1]:
        return False
    runs = masking_utils.find_packed_sequence_indices(pattern.positions.expand(pattern.packed.shape[0], -1))
    return runs is not None and torch.equal(runs, pattern.packed)


class _Specs:
    """The specs the attention calls use, one attribute each (see :func:`_spec`)."""


_specs = _Specs()
_spec_names: dict[tuple[Any, ...], str] = {}


def _spec(
    causal: bool, top_left: bool, window: tuple[int, int] | None, scale: float | None, softcap: float | None
) -> AttentionSpec:
    """The spec of these fields, built once. Inside a compiled graph pydantic's validation does not trace, so the
    spec is built where the trace cannot see (:func:`_spec_name`, whose name the graph keeps as a constant) and read
    as an attribute of a module global, guarded by identity like any object's attribute. (A spec returned by an
    assume_constant_result function itself is a constant Dynamo cannot guard, which attend's type check needs.)"""
    return getattr(_specs, _spec_name(causal, top_left, window, scale, softcap))


@torch.compiler.assume_constant_result
def _spec_name(*fields: Any) -> str:
    name = _spec_names.get(fields)
    if name is None:
        causal, top_left, window, scale, softcap = fields
        alignment = CausalAlignment.TOP_LEFT if top_left else CausalAlignment.BOTTOM_RIGHT
        spec = AttentionSpec(causal=causal, causal_alignment=alignment, window=window, scale=scale, softcap=softcap)
        name = _spec_names[fields] = f"spec_{len(_spec_names)}"
        setattr(_specs, name, spec)
    return name


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: AttnkitMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: (B, H, L, D) inputs, kv heads not repeated; returns ((B, Lq, Hq, Dv), None).
    ``dropout`` (the models pass their attention_dropout in training, 0.0 in eval) is attnkit's (§18), its seed
    drawn from torch's generator: torch.manual_seed repeats a training step. Every attention layer of a model loaded
    with ``attn_implementation="attnkit"`` calls it; it runs :func:`attnkit.attend` on the backend
    :func:`register` chose.

    :param module: the attention layer (its ``is_causal`` is read when no mask was made).
    :param query: (B, Hq, Lq, D).
    :param key: (B, Hkv, Lk, D).
    :param value: (B, Hkv, Lk, Dv).
    :param attention_mask: :func:`make_mask`'s answer; a 4-D boolean mask (True = attend) or float bias given by the
        caller; or ``None`` (the call's own ``is_causal`` and ``sliding_window``).
    :param dropout: attention dropout's probability.
    :param scaling: the spec's scale (``None``: 1/sqrt(D)).
    :param softcap: the spec's softcap.
    :param sliding_window: N keys, the query's own included: attnkit's window (N − 1, 0); used without a mask.
    :param is_causal: whether the layer is causal, used without a mask.
    :param kwargs: ``s_aux`` (gpt-oss's attention sinks, one logit per query head, §15); ``position_bias`` and a
        paged ``cache`` are refused with :class:`attnkit.InvalidInputError`.
    :returns: ``(out, None)``, out (B, Lq, Hq, Dv).
    """
    for name, meaning in _INEXPRESSIBLE.items():
        if kwargs.get(name) is not None:
            raise InvalidInputError(f"{name} is given, but attnkit cannot express {meaning}; expected None")
    mask = bias = kv_lengths = q_segment_ids = kv_segment_ids = mask_mod = None
    if isinstance(attention_mask, AttnkitMask):
        if (query.shape[2], key.shape[2]) != (attention_mask.q_length, attention_mask.kv_length):
            raise InvalidInputError(
                f"attention_mask was made for Lq={attention_mask.q_length}, Lk={attention_mask.kv_length}; "
                f"got query with Lq={query.shape[2]} and key with Lk={key.shape[2]}"
            )
        spec = attention_mask.spec(scaling, softcap)
        kv_lengths = attention_mask.kv_lengths
        q_segment_ids, kv_segment_ids = attention_mask.q_segment_ids, attention_mask.kv_segment_ids
        mask_mod = attention_mask.mask_mod
    elif attention_mask is None:  # no mask made (a module called on its own): the call's own arguments
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if sliding_window is not None and not causal:
            raise InvalidInputError(
                f"sliding_window={sliding_window} with is_causal=False and no attention_mask: the bidirectional "
                "window's extent is ambiguous, expected an attention_mask made by transformers"
            )
        window = None if sliding_window is None else _causal_window(sliding_window)
        spec = _spec(causal, False, window, scaling, softcap)
    else:  # a 4-D mask, given by the caller or materialised for a pattern attnkit cannot express: it is the truth
        spec = _spec(False, False, None, scaling, softcap)
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask
    out = attend(
        spec,
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        kv_lengths=kv_lengths,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        backend=_backend,
        sinks=kwargs.get("s_aux"),  # gpt-oss: one learned logit per query head in every softmax (§15)
        mask_mod=mask_mod,
        dropout_p=dropout,
    )
    return out.transpose(1, 2).contiguous(), None


register()
