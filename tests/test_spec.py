"""AttentionSpec: validation at construction, hashing, JSON and TOML round trips (docs/semantics.md §3-§4)."""

from __future__ import annotations

import tomllib

import pydantic
import pytest
import tomli_w
from hypothesis import given

from attnkit import AttentionSpec, AttnkitError, CausalAlignment, InvalidSpecError, Layout, Variant
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
