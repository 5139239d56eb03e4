"""``attn_implementation="attnkit"`` for Hugging Face transformers models (docs/integrations.md).

    import attnkit.integrations.transformers as attnkit_hf
    attnkit_hf.register()                     # importing registers too; register() is idempotent
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnkit")

Two hooks are registered under the name ``"attnkit"``:

* in ``AttentionMaskInterface``, :func:`make_mask`: transformers calls it once per forward and mask kind (full,
  sliding) with the raw facts (the 2-D padding mask, where the queries and keys sit in the sequence, the mask
  pattern). It answers with an :class:`AttnkitMask`: the pattern as spec fields, and padding as ``kv_lengths`` or a
  (B, 1, 1, Lk) key mask, never an (Lq, Lk) one, except for patterns attnkit cannot express (below);
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

from attnkit.api import attend
from attnkit.errors import InvalidInputError
from attnkit.frontends import register_imported_frameworks
from attnkit.registry import get_backend
from attnkit.spec import AttentionSpec, CausalAlignment

register_imported_frameworks()  # torch tensors' frontend in attend's table before any trace

NAME = "attnkit"
#: Names the attnkit backend every call uses when register() is given none ("auto" when unset).
BACKEND_ENV = "ATTNKIT_TRANSFORMERS_BACKEND"
#: Keyword arguments of transformers' attention calls whose meaning attnkit cannot express.
_INEXPRESSIBLE = {
    "s_aux": "attention sinks (s_aux): a learned logit per head joining every softmax",
    "position_bias": "position_bias (T5-style learned relative bias)",
    "cache": "a paged KV cache (continuous batching): attnkit reads key and value as given",
}

_backend = "auto"


def register(backend: str | None = None) -> None:
    """Make ``attn_implementation="attnkit"`` available to transformers models. Idempotent.

    ``backend`` forces one attnkit backend for every call (default: the ``ATTNKIT_TRANSFORMERS_BACKEND``
    environment variable, else ``"auto"``, attnkit's own choice per call). An unknown name raises
    :class:`attnkit.UnknownBackendError` here rather than at the first forward.
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
    at the start) it is the padding itself. ``key_mask`` is (B, 1, 1, Lk): padding that no length expresses.
    """

    causal: bool
    window: tuple[int, int] | None
    top_left: bool
    kv_lengths: torch.Tensor | None
    key_mask: torch.Tensor | None
    q_length: int
    kv_length: int

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


class _Index:
    """An index given to a mask function in place of a number: every operation on it returns the expression it
    stands for, so calling the function yields the function's own formula. An operation with anything but an index
    or an int (a tensor's element: packed sequences, chunked attention, padding) yields :data:`_OPAQUE`; tensors
    see an index through ``__torch_function__``, which a compiled graph traces as it does any Python object."""

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


def _pattern(mask_function: Callable[..., Any]) -> tuple[bool, tuple[int, int] | None] | None:
    """(causal, window) of the mask functions transformers builds for causal and bidirectional attention, with or
    without a sliding window, read from the formula the function computes (:class:`_Index`); None for any other
    (packed sequences, chunked attention, or/and overlays). No value is read, so a compiled graph traces it."""
    try:
        formula = mask_function(_Index("batch"), _Index("head"), _Index("q"), _Index("kv")).expr
    except Exception:  # foreign code that does what no index can: transformers' own mask says what it means
        return None
    terms: list[Any] = []
    pending = [formula]
    while pending:  # the conjunction's terms, and_masks' neutral True left out
        term = pending.pop()
        if isinstance(term, tuple) and term[0] == "and":
            pending += term[1:]
        elif term is not True:
            terms.append(term)
    match sorted(terms, key=repr):
        case [("le", "kv", "q")]:  # kv_idx <= q_idx
            return True, None
        case [("ge", "q", 0)]:  # q_idx >= 0: every key
            return False, None
        case [("gt", "kv", ("sub", "q", int(size))), ("le", "kv", "q")] if size >= 1:  # and kv_idx > q_idx − N
            return True, _causal_window(size)
        case [("ge", "q", 0), ("le", ("abs", ("sub", "q", "kv")), int(size))] if size >= 1:  # and |q_idx − kv_idx| <= N
            return False, (size, size)
    return None


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
    own boolean (B, 1, Lq, Lk) mask."""
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
    if pattern is None or not (traced_offset or q_length <= written <= kv_length):
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
    causal, window = pattern
    described = functools.partial(AttnkitMask, causal, window, q_length=q_length, kv_length=kv_length)
    # A static cache's kv_lengths (q_offset a tensor) is there on every step, up to the one that fills the cache, where
    # it clips nothing: the masks generate() hands a compiled forward keep one structure, which it is traced for.
    if isinstance(written, torch.Tensor):  # traced_offset
        clip = written.expand(batch_size)
    elif written < kv_length or isinstance(q_offset, torch.Tensor):
        clip = torch.full((batch_size,), written, device=device)
    else:
        clip = None

    padding = masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    keys = None if padding is None else padding[:, kv_offset : kv_offset + kv_length]
    if torch.compiler.is_compiling():
        # No tensor value may be read in a graph, so none of the compact choices below: any padding goes in as the
        # key mask, which is exact whatever the padding (only right padding had a shorter form).
        key_mask = None if keys is None else keys[:, None, None, :]
        return described(top_left=False, kv_lengths=clip, key_mask=key_mask)
    if keys is None or bool(keys[:, :written].all()):
        return described(top_left=False, kv_lengths=clip, key_mask=None)
    real = keys.sum(1)
    right_padded = torch.equal(keys, torch.arange(kv_length, device=keys.device) < real[:, None])
    if right_padded and diagonal == 0:
        # Queries start at key 0, so top-left alignment places the diagonal; the padding is a length. (Bottom-right
        # would need q_lengths = kv_lengths, which empties the padded query rows that transformers computes.)
        return described(top_left=True, kv_lengths=real, key_mask=None)
    # Left padding (or holes): attnkit has no compact form for it yet, so a key mask, broadcast over queries.
    return described(top_left=False, kv_lengths=clip, key_mask=keys[:, None, None, :])


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
    """transformers' attention hook: (B, H, L, D) inputs, kv heads not repeated; returns ((B, Lq, Hq, Dv), None)."""
    if dropout:
        raise InvalidInputError(
            f"dropout={dropout}: attnkit has no attention dropout, expected 0.0 "
            "(set the model config's attention_dropout to 0, or call model.eval())"
        )
    for name, meaning in _INEXPRESSIBLE.items():
        if kwargs.get(name) is not None:
            raise InvalidInputError(f"{name} is given, but attnkit cannot express {meaning}; expected None")
    mask = bias = kv_lengths = None
    if isinstance(attention_mask, AttnkitMask):
        if (query.shape[2], key.shape[2]) != (attention_mask.q_length, attention_mask.kv_length):
            raise InvalidInputError(
                f"attention_mask was made for Lq={attention_mask.q_length}, Lk={attention_mask.kv_length}; "
                f"got query with Lq={query.shape[2]} and key with Lk={key.shape[2]}"
            )
        spec = attention_mask.spec(scaling, softcap)
        mask, kv_lengths = attention_mask.key_mask, attention_mask.kv_lengths
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
    out = attend(spec, query, key, value, mask=mask, bias=bias, kv_lengths=kv_lengths, backend=_backend)
    return out.transpose(1, 2).contiguous(), None


register()
