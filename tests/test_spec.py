"""AttentionSpec: validation at construction, hashing, JSON and TOML round trips (docs/semantics.md §3-§4)."""

from __future__ import annotations

import pickle
import re
import tomllib
from decimal import Decimal

import pydantic
import pytest
import tomli_w
from hypothesis import given

from attnkit import AttentionSpec, AttnkitError, CausalAlignment, InvalidSpecError, Layout, Variant
from attnkit import spec as spec_module
from attnkit.testing.strategies import specs


@given(spec=specs())
def test_json_round_trip(spec: AttentionSpec) -> None:
    assert AttentionSpec.model_validate_json(spec.model_dump_json()) == spec


@given(spec=specs())
def test_toml_round_trip(spec: AttentionSpec) -> None:
    text = tomli_w.dumps({"spec": spec.to_toml_dict()})
    assert AttentionSpec.model_validate(tomllib.loads(text)["spec"]) == spec


def test_frozen_and_hashable() -> None:
    spec = AttentionSpec(causal=True, window=(4, 0))
    assert hash(spec) == hash(AttentionSpec(causal=True, window=(4, 0)))
    assert len({spec, AttentionSpec(causal=True, window=(4, 0)), AttentionSpec()}) == 2
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        spec.causal = False  # type: ignore[misc]


def test_values_become_enums() -> None:
    spec = AttentionSpec(causal_alignment="top_left", variant="cosine", layout="bshd")
    assert spec.causal_alignment is CausalAlignment.TOP_LEFT
    assert spec.variant is Variant.COSINE and spec.layout is Layout.BSHD


def test_default_scales() -> None:
    assert AttentionSpec().resolved_scale(64) == pytest.approx(1 / 8)
    assert AttentionSpec(variant="cosine").resolved_scale(64) == 16.0
    assert AttentionSpec(scale=0.5, variant="cosine").resolved_scale(64) == 0.5


def test_window_of_two_open_sides_is_no_window() -> None:
    assert AttentionSpec(window=(None, None)).window is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"window": (-1, -1)}, "window left=-1 must be >= 0 or None"),
        ({"window": (2, -3)}, "window right=-3"),
        ({"scale": 0.0}, "scale=0.0 must be a finite number > 0"),
        ({"scale": float("nan")}, "scale=nan"),
        ({"softcap": -1.0}, "softcap=-1.0 must be a finite number > 0"),
        ({"causal_alignment": "diagonal"}, "AttentionSpec.causal_alignment='diagonal'"),
        ({"variant": "l2"}, "AttentionSpec.variant='l2'"),
        ({"layout": "sbhd"}, "AttentionSpec.layout='sbhd'"),
        ({"causal": True, "windw": (1, 1)}, "AttentionSpec.windw"),
    ],
)
def test_invalid_values_are_rejected_with_the_field_and_fix(fields: dict, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message.replace("(", r"\(").replace("[", r"\[")) as error:
        AttentionSpec(**fields)
    assert isinstance(error.value, AttnkitError) and isinstance(error.value, ValueError)


def test_replace_validates() -> None:
    assert AttentionSpec().replace(layout="bshd").layout is Layout.BSHD
    with pytest.raises(InvalidSpecError):
        AttentionSpec().replace(softcap=0.0)


def test_model_copy_with_update_validates_and_describes_the_new_spec() -> None:
    """pydantic's model_copy(update=...) skips validation: the cached hash and features would describe the old spec."""
    copied = AttentionSpec(causal=True).model_copy(update={"softcap": 2.0, "layout": "bshd"})
    fresh = AttentionSpec(causal=True, softcap=2.0, layout="bshd")
    assert copied == fresh and hash(copied) == hash(fresh) and len({copied, fresh}) == 1
    assert copied.features() == fresh.features() == frozenset({"causal", "softcap", "bshd"})
    with pytest.raises(InvalidSpecError):
        AttentionSpec().model_copy(update={"softcap": -1.0})
    plain = AttentionSpec(window=(3, None))
    assert plain.model_copy() == plain and plain.model_copy().features() == frozenset({"window"})


def test_docstring_draws_both_alignments() -> None:
    doc = AttentionSpec.__doc__ or ""
    assert "bottom_right" in doc and "top_left" in doc
    assert "q0 [ x  x  x  x  . ]" in doc and "q0 [ x  .  .  .  . ]" in doc


@given(spec=specs())
def test_a_spec_built_again_is_the_remembered_spec_equal_to_a_validated_one(spec: AttentionSpec) -> None:
    """AttentionSpec(...) remembers what it built: the same arguments again, in another order, or with defaults given
    explicitly, give one object, equal and hash-equal to what validation from scratch builds (type.__call__ goes
    around the remembering metaclass)."""
    fields = spec.model_dump()
    first = AttentionSpec(**fields)
    validated = type.__call__(AttentionSpec, **fields)
    assert validated is not first
    assert first == validated and hash(first) == hash(validated) and first.features() == validated.features()
    assert AttentionSpec(**fields) is first
    assert AttentionSpec(**dict(reversed(fields.items()))) is first
    assert AttentionSpec(**spec.model_dump(exclude_defaults=True)) is first


def test_a_remembered_spec_stays_frozen() -> None:
    spec = AttentionSpec(causal=True, window=(3, 0), scale=0.5)
    assert AttentionSpec(causal=True, window=(3, 0), scale=0.5) is spec
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        spec.scale = 1.0  # type: ignore[misc]
    with pytest.raises(AttributeError, match="frozen: _hash"):
        spec._hash = 0  # the shared spec's hash, which pydantic's frozen check does not guard
    assert hash(AttentionSpec(causal=True, window=(3, 0), scale=0.5)) == hash(
        type.__call__(AttentionSpec, **spec.__dict__)
    )


@pytest.mark.parametrize(
    ("valid", "bad", "message"),
    [
        ({"causal": True}, {"causal": 1 + 0j}, "causal=(1+0j): Input should be a valid boolean"),
        ({"scale": 0.5}, {"scale": 0.5 + 0j}, "scale=(0.5+0j): Input should be a valid number"),
        ({"window": (3, 0)}, {"window": (3 + 0j, 0)}, "window.0=(3+0j): Input should be a valid integer"),
        ({"scale": 0.5}, {"scale": -0.5}, "scale=-0.5 must be a finite number > 0"),
    ],
)
def test_bad_input_raises_every_time_even_when_it_equals_a_remembered_argument(
    valid: dict, bad: dict, message: str
) -> None:
    """1+0j == True and hashes alike, so a cache keyed on values alone would hand back the valid spec."""
    AttentionSpec(**valid)
    for _ in range(2):
        with pytest.raises(InvalidSpecError, match=re.escape(message)):
            AttentionSpec(**bad)


def test_arguments_that_cannot_be_remembered_are_validated_each_time() -> None:
    as_list = AttentionSpec(window=[3, "none"])  # unhashable: TOML and JSON give lists
    assert as_list == AttentionSpec(window=(3, None)) and AttentionSpec(window=[3, "none"]) == as_list
    from_decimal = AttentionSpec(scale=Decimal("0.5"))
    assert from_decimal == AttentionSpec(scale=0.5) and from_decimal is not AttentionSpec(scale=Decimal("0.5"))
    with pytest.raises(TypeError):
        AttentionSpec(True)  # type: ignore[misc]  # fields by keyword only


def test_remembered_specs_pickle_and_copy() -> None:
    spec = AttentionSpec(causal=True, softcap=3.0, layout="bshd")
    for copy in (pickle.loads(pickle.dumps(spec)), spec.model_copy(), spec.model_copy(update={"softcap": 3.0})):
        assert copy == spec and hash(copy) == hash(spec) and copy.features() == spec.features()
    assert AttentionSpec(causal=True, softcap=3.0, layout="bshd") is spec


def test_the_remembered_specs_are_bounded() -> None:
    for index in range(2 * spec_module.SPEC_CACHE_SIZE):
        AttentionSpec(scale=1.0 + index)
    for cache in (spec_module._by_arguments, spec_module._by_canonical_arguments):
        assert cache.cache_info().currsize <= spec_module.SPEC_CACHE_SIZE
