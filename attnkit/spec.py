"""AttentionSpec: the semantics of an attention call, with no tensors in it (docs/semantics.md)."""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, field_validator
from pydantic._internal._model_construction import ModelMetaclass

from attnkit.errors import InvalidSpecError, UnexpectedArgumentError
from attnkit.features import Feature
from attnkit.spellings import positional_fields_error, unexpected_keywords


class CausalAlignment(str, enum.Enum):
    """Where the causal diagonal sits when Lq != Lk (docs/semantics.md §4.1): ``bottom_right`` (the default, a KV
    cache's: the last query sees every key) or ``top_left`` (torch SDPA's ``is_causal``: query i sees keys 0..i)."""

    BOTTOM_RIGHT = "bottom_right"
    TOP_LEFT = "top_left"


class Variant(str, enum.Enum):
    """``dot``: scores q·kᵀ; ``cosine``: q and k L2-normalised along the head dim first (default scale 16)."""

    DOT = "dot"
    COSINE = "cosine"


class Layout(str, enum.Enum):
    """The axis order of q, k, v and out: ``bhsd`` (batch, heads, seq, dim) or ``bshd`` (batch, seq, heads, dim)."""

    BHSD = "bhsd"
    BSHD = "bshd"


COSINE_DEFAULT_SCALE = 16.0

#: How many specs ``AttentionSpec(...)`` remembers by their arguments (least recently used go first).
SPEC_CACHE_SIZE = 1024
# Argument types whose equal values validate alike; specs built from others (numpy scalars, Decimal, complex, user
# types) are validated every time: 1+0j == True, yet it is no valid ``causal``.
_REMEMBERED_TYPES = frozenset({bool, int, float, str, type(None), tuple, CausalAlignment, Variant, Layout})


class _NotRemembered(Exception):
    """Raised inside the remembering constructors so that a spec built from other argument types is not cached."""


class _RememberedSpecs(ModelMetaclass):
    """``AttentionSpec(**fields)`` validates once per distinct arguments: dispatch code builds the same few specs on
    every call, and validation costs ~7 us where a look-up costs well under 1. Only successful constructions are
    remembered, so bad input is validated (and raises) every time. model_validate comes here too (pydantic calls the
    class, which has its own __init__); copies and unpickling do not. ``type.__call__(AttentionSpec, **fields)``
    builds one without remembering (the bench and the tests compare with it)."""

    def __call__(cls, /, *positional: Any, **fields: Any) -> Any:  # fields by keyword only, as pydantic takes them
        if positional:
            raise positional_fields_error(positional, fields, cls.model_fields)  # type: ignore[attr-defined]
        window = fields.get("window")
        try:  # lru_cache(typed=True) keys on each argument's type; a window's elements' types are passed with them
            return _by_arguments(cls, tuple(map(type, window)) if type(window) is tuple else None, **fields)
        except (TypeError, _NotRemembered):  # an unhashable argument (a window given as a list): validated each time
            return super().__call__(**fields)


@functools.lru_cache(maxsize=SPEC_CACHE_SIZE, typed=True)
def _by_arguments(cls: _RememberedSpecs, window_types: tuple[type, ...] | None, /, **fields: Any) -> Any:
    """The spec of these arguments; other orders and defaults given explicitly (causal=False) share one spec, equal
    specs being one object (whose model_fields_set is that of the arguments it was first built from)."""
    defaults = {name: field.default for name, field in cls.model_fields.items()}  # type: ignore[attr-defined]
    given = sorted((name, value) for name, value in fields.items() if value is not defaults.get(name, cls))
    if not _REMEMBERED_TYPES.issuperset((*(type(value) for _, value in given), *(window_types or ()))):
        raise _NotRemembered
    return _by_canonical_arguments(cls, window_types, **dict(given))


@functools.lru_cache(maxsize=SPEC_CACHE_SIZE, typed=True)
def _by_canonical_arguments(cls: _RememberedSpecs, window_types: tuple[type, ...] | None, /, **fields: Any) -> Any:
    return super(_RememberedSpecs, cls).__call__(**fields)


class AttentionSpec(BaseModel, metaclass=_RememberedSpecs):
    """What an attention call computes; see docs/semantics.md for the full contract. Immutable and hashable; every
    field is a keyword (``AttentionSpec(causal=True, window=(256, 0))``).

    ``causal_alignment`` places the diagonal when Lq != Lk. For Lq=2, Lk=5 (``x`` = may attend):

        bottom_right (default, KV-cache)     top_left (torch SDPA is_causal)
             k0 k1 k2 k3 k4                      k0 k1 k2 k3 k4
        q0 [ x  x  x  x  . ]                q0 [ x  .  .  .  . ]
        q1 [ x  x  x  x  x ]                q1 [ x  x  .  .  . ]

    The same alignment offset places the sliding ``window``.

    :ivar causal: restrict each query to keys at or before its aligned position (default ``False``).
    :ivar causal_alignment: where the diagonal sits when Lq != Lk: ``"bottom_right"`` (default) or ``"top_left"``,
        a :class:`CausalAlignment`.
    :ivar window: ``(left, right)``, inclusive, either side ``None`` for unbounded; query i sees key j iff
        ``i+off-left <= j <= i+off+right``. ``None`` (default): no window.
    :ivar scale: multiplies q·kᵀ; ``None`` (default) means 1/sqrt(head_dim), or 16 for the cosine variant.
    :ivar variant: ``"dot"`` (default) or ``"cosine"`` (q and k L2-normalised along the head dim first), a
        :class:`Variant`.
    :ivar softcap: ``c > 0`` maps scores S to ``c*tanh(S/c)`` after scaling; ``None`` (default) disables.
    :ivar layout: ``"bhsd"`` (batch, heads, seq, dim; default) or ``"bshd"`` (batch, seq, heads, dim), a
        :class:`Layout`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    causal: bool = False
    causal_alignment: CausalAlignment = CausalAlignment.BOTTOM_RIGHT
    window: tuple[int | None, int | None] | None = None
    scale: float | None = None
    variant: Variant = Variant.DOT
    softcap: float | None = None
    layout: Layout = Layout.BHSD

    # Specs key the dispatch caches on every call: hash once (pydantic's hash re-reads every field each time).
    _hash: int = PrivateAttr(default=0)
    # Every backend's supports() reads the features of each new call's spec: computed once.
    _features: frozenset[Feature] = PrivateAttr(default=frozenset())

    def __init__(self, **fields: Any) -> None:
        try:
            super().__init__(**fields)
        except ValidationError as error:
            unknown = {
                str(item["loc"][0]): item.get("input") for item in error.errors() if item["type"] == "extra_forbidden"
            }
            if unknown:  # other libraries' spellings (is_causal=, dropout_p=, ...) say what attnkit writes instead
                fields = type(self).model_fields
                lines = [unexpected_keywords("AttentionSpec", unknown, fields, fields)]
                lines += [_describe(error, "extra_forbidden")]  # invalid values beside the unknown keywords
                raise UnexpectedArgumentError("\n".join(filter(None, lines))) from None
            raise InvalidSpecError(_describe(error)) from None

    def model_post_init(self, context: Any, /) -> None:
        private = self.__pydantic_private__
        private["_hash"] = hash(tuple(self.__dict__.values()))  # type: ignore[index]  # set while it can be
        private["_features"] = self._used_features()  # type: ignore[index]

    def __setattr__(self, name: str, value: Any) -> None:
        # pydantic's frozen models still let private attributes be set; a remembered spec is shared by every
        # AttentionSpec(...) call with the same arguments, so none of its state may change.
        if name in self.__private_attributes__:
            raise AttributeError(f"AttentionSpec is frozen: {name} cannot be set (equal specs may be one object)")
        super().__setattr__(name, value)

    def __hash__(self) -> int:
        return self.__pydantic_private__["_hash"]  # type: ignore[index]  # self._hash goes through __getattr__

    @classmethod
    def model_validate(cls, obj: Any, **options: Any) -> AttentionSpec:  # type: ignore[override]
        try:
            return super().model_validate(obj, **options)
        except ValidationError as error:
            raise InvalidSpecError(_describe(error)) from None

    @classmethod
    def model_validate_json(cls, json_data: str | bytes, **options: Any) -> AttentionSpec:  # type: ignore[override]
        try:
            return super().model_validate_json(json_data, **options)
        except ValidationError as error:
            raise InvalidSpecError(_describe(error)) from None

    @field_validator("window", mode="before")
    @classmethod
    def _window_from_list(cls, value: Any) -> Any:
        # JSON and TOML have no tuples and TOML has no null: accept a list, and "none" for an open side.
        if isinstance(value, list):
            value = tuple(None if side in ("none", "None") else side for side in value)
        return value

    @field_validator("window")
    @classmethod
    def _check_window(cls, value: tuple[int | None, int | None] | None) -> tuple[int | None, int | None] | None:
        if value is None:
            return None
        for name, side in zip(("left", "right"), value):
            if side is not None and side < 0:
                raise ValueError(
                    f"window {name}={side} must be >= 0 or None (unbounded); "
                    "use window=None instead of -1 for no window"
                )
        if value == (None, None):
            return None
        return value

    @field_validator("scale")
    @classmethod
    def _check_scale(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"scale={value} must be a finite number > 0, or None for the default")
        return value

    @field_validator("softcap")
    @classmethod
    def _check_softcap(cls, value: float | None) -> float | None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"softcap={value} must be a finite number > 0, or None to disable it")
        return value

    def replace(self, **changes: Any) -> AttentionSpec:
        """A copy with ``changes`` applied and validated."""
        return AttentionSpec(**{**self.__dict__, **changes})  # remembered like any construction

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> AttentionSpec:
        """pydantic's copy, except that ``update`` is validated (pydantic skips that, and the cached hash and
        features would describe the old spec)."""
        return self.replace(**update) if update else super().model_copy(deep=deep)

    def resolved_scale(self, head_dim: int) -> float:
        """The scale actually applied for a given head dim."""
        if self.scale is not None:
            return self.scale
        if self.variant is Variant.COSINE:
            return COSINE_DEFAULT_SCALE
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0

    def features(self) -> frozenset[Feature]:
        """The spec features in use, as backends' capabilities name them."""
        return self.__pydantic_private__["_features"]  # type: ignore[index]  # as in __hash__

    def _used_features(self) -> frozenset[Feature]:
        flags = (
            (self.causal, Feature.CAUSAL),
            (
                (self.causal or self.window is not None) and self.causal_alignment is CausalAlignment.TOP_LEFT,
                Feature.TOP_LEFT,
            ),
            (self.window is not None, Feature.WINDOW),
            (self.variant is Variant.COSINE, Feature.COSINE),
            (self.softcap is not None, Feature.SOFTCAP),
            (self.layout is Layout.BSHD, Feature.BSHD),
        )
        return frozenset(feature for used, feature in flags if used)

    def to_toml_dict(self) -> dict[str, Any]:
        """A dict TOML can hold (no None): unset fields are left out, open window sides become "none"."""
        data = self.model_dump(mode="json", exclude_none=True)
        if self.window is not None:
            data["window"] = ["none" if side is None else side for side in self.window]
        return data


def _describe(error: ValidationError, skip: str | None = None) -> str:
    """One line per invalid field, naming it, what was given and what is allowed (but errors of type ``skip``)."""
    lines = []
    for item in error.errors():
        if item["type"] == skip:
            continue
        field = ".".join(str(part) for part in item["loc"]) or "spec"
        given = item.get("input")
        lines.append(f"AttentionSpec.{field}={given!r}: {item['msg']}")
    return "; ".join(lines)
