"""Calls written as torch SDPA, flash-attn, FlexAttention or jax.nn.dot_product_attention write them get
UnexpectedArgumentError naming what attnkit writes instead; a causal call whose alignment leaves rows with no key
warns once per process."""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import attnkit
import attnkit.distributed
from attnkit import AttentionSpec, AttnkitError, EmptyRowsWarning, InvalidSpecError, UnexpectedArgumentError, empty_rows
from attnkit.spellings import CALL_ARGUMENTS

B, H, D = 1, 2, 8
q = torch.randn(B, H, 3, D)
k = torch.randn(B, H, 3, D)
v = torch.randn(B, H, 3, D)
SPEC_FIELDS = set(AttentionSpec.model_fields)
CALL_KEYWORDS = {name for name, p in inspect.signature(attnkit.attend).parameters.items() if p.kind is p.KEYWORD_ONLY}


def _message(call: Any) -> str:
    with pytest.raises(UnexpectedArgumentError) as error:
        call()
    # Python's own error for these calls is a TypeError: code catching that still catches attnkit's.
    assert isinstance(error.value, TypeError) and isinstance(error.value, AttnkitError)
    return str(error.value)


def test_a_call_without_a_spec_says_to_put_one_first() -> None:
    assert "attnkit.attend(attnkit.AttentionSpec(), q, k, v)" in _message(lambda: attnkit.attend(q, k, v))
    message = _message(lambda: attnkit.attend(q, k, v, is_causal=True, scale=0.25))  # type: ignore[call-arg]
    assert "attnkit.attend(attnkit.AttentionSpec(causal=True, scale=0.25), q, k, v)" in message
    assert "causal_alignment='top_left'" in message  # SDPA's is_causal is top-left, attnkit's default bottom-right
    assert "attnkit.explain(attnkit.AttentionSpec(), q, k, v)" in _message(lambda: attnkit.explain(q, k, v))
    assert "attend is missing v" in _message(lambda: attnkit.attend(AttentionSpec(), q, k))


def test_the_ragged_and_sharded_calls_without_a_spec_say_so() -> None:
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    packed = q[0].transpose(0, 1)
    message = _message(lambda: attnkit.attend_varlen(packed, packed, packed, cu, cu, causal=True))
    assert "attnkit.attend_varlen(attnkit.AttentionSpec(causal=True), q, k, v, cu_seqlens_q, cu_seqlens_k)" in message
    message = _message(
        lambda: attnkit.attend_paged(packed, packed, packed, block_table=cu, cache_seqlens=cu)  # type: ignore[call-arg]
    )
    assert "attnkit.attend_paged(attnkit.AttentionSpec(), q, k_cache, v_cache, block_table, kv_lengths)" in message
    assert "cache_seqlens=<Tensor of shape (3,)>): flash-attn's spelling; in attnkit: kv_lengths=" in message
    assert "attnkit.distributed.attend(attnkit.AttentionSpec()" in _message(lambda: attnkit.distributed.attend(q, k, v))
    # A keyword the sharded call does not take is refused before any collective runs.
    message = _message(lambda: attnkit.distributed.attend(AttentionSpec(), q, k, v, is_causal=True))
    assert "AttentionSpec(causal=True)" in message


# (keyword another library takes, its value, attnkit's spelling the message must name)
PEER_KEYWORDS = [
    ("is_causal", True, "causal=True"),
    ("causal", True, "causal=True"),
    ("scale", 0.5, "scale=0.5"),
    ("softmax_scale", 0.5, "scale=0.5"),
    ("attn_mask", torch.ones(3, 3, dtype=torch.bool), "mask="),
    ("attn_mask", torch.zeros(3, 3), "bias="),
    ("enable_gqa", True, "from the shapes"),
    ("window_size", (4, -1), "window=(4, None)"),
    ("local_window_size", 3, "window=(3, 3)"),
    ("softcap", 30.0, "softcap=30.0"),
    ("logits_soft_cap", 30.0, "softcap=30.0"),
    ("block_mask", object(), "mask_mod="),
    ("score_mod", lambda score, b, h, i, j: score, "mask_mod="),
    ("return_attn_probs", True, "return_lse="),
    ("return_softmax", True, "return_lse="),
    ("query_seq_lengths", torch.tensor([3]), "q_lengths="),
    ("key_value_seq_lengths", torch.tensor([3]), "kv_lengths="),
    ("implementation", "xla", "backend="),
    ("deterministic", True, "torch.use_deterministic_algorithms(True)"),
    ("maks", None, "did you mean mask=?"),
]


@pytest.mark.parametrize(("keyword", "value", "spelling"), PEER_KEYWORDS, ids=[case[0] for case in PEER_KEYWORDS])
def test_a_peer_keyword_to_attend_names_attnkits_spelling(keyword: str, value: Any, spelling: str) -> None:
    message = _message(lambda: attnkit.attend(AttentionSpec(), q, k, v, **{keyword: value}))
    assert spelling in message
    # The spelling named is one attnkit takes: a spec field or a keyword of the call.
    named = re.match(r"\w+", spelling.removeprefix("did you mean ")).group()  # type: ignore[union-attr]
    assert named in SPEC_FIELDS | CALL_KEYWORDS or spelling == "from the shapes" or "deterministic" in spelling


@pytest.mark.parametrize(
    ("fields", "spelling"),
    [
        ({"is_causal": True}, "AttentionSpec(causal=True)"),
        ({"dropout_p": 0.1}, "attnkit.attend(spec, q, k, v, dropout_p=0.1)"),
        ({"softmax_scale": 0.125}, "scale=0.125"),
        ({"window_size": (8, 0)}, "window=(8, 0)"),
        ({"attn_mask": None}, "mask="),
        ({"logits_soft_cap": 50.0}, "softcap=50.0"),
        ({"mask": None}, "attnkit.attend(spec, q, k, v, mask=None)"),
        ({"casual": True}, "did you mean causal=?"),
    ],
)
def test_a_peer_keyword_to_attention_spec_names_attnkits_spelling(fields: dict[str, Any], spelling: str) -> None:
    message = _message(lambda: AttentionSpec(**fields))
    assert spelling in message
    # Still an InvalidSpecError, as an unknown field always was.
    with pytest.raises(InvalidSpecError):
        AttentionSpec(**fields)


def test_the_call_arguments_a_spec_refuses_are_attends() -> None:
    """attnkit.spec reads its messages from attnkit.spellings, which cannot read attend's signature (an import cycle):
    its list of attend's keywords must stay attend's."""
    assert set(CALL_ARGUMENTS) == CALL_KEYWORDS


def test_a_positional_spec_field_names_the_fields_as_keywords() -> None:
    message = _message(lambda: AttentionSpec(True))  # type: ignore[call-arg]
    assert "attnkit.AttentionSpec(causal=True)" in message and "causal_alignment, window, scale" in message
    with pytest.raises(TypeError, match="by keyword"):
        AttentionSpec(True, window=(2, 0))  # type: ignore[call-arg]


@pytest.fixture
def caught() -> Iterator[list[warnings.WarningMessage]]:
    empty_rows.forget()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        yield records
    empty_rows.forget()


def _rows_without_key(spec: AttentionSpec, len_q: int, len_k: int, **options: Any) -> int:
    """How many rows the call's own output says see no key (lse −∞, §5): the oracle of the warning's count."""
    shape_q, shape_k = (B, H, len_q, D), (B, H, len_k, D)
    _, lse = attnkit.attend(
        spec, torch.randn(shape_q), torch.randn(shape_k), torch.randn(shape_k), return_lse=True,
        backend="torch-naive", **options,
    )  # fmt: skip
    return int(torch.isneginf(lse[0, 0]).sum())


def test_rows_that_see_no_key_warn_once_per_process(caught: list[warnings.WarningMessage]) -> None:
    empty = _rows_without_key(AttentionSpec(causal=True), 5, 2)
    assert empty == 3 and len(caught) == 1
    assert caught[0].category is EmptyRowsWarning and issubclass(EmptyRowsWarning, UserWarning)
    text = str(caught[0].message)
    assert f"the first {empty} query rows see no key" in text
    assert "attnkit.AttentionSpec(causal=True, causal_alignment='top_left')" in text
    assert _rows_without_key(AttentionSpec(causal=True), 7, 3) == 4 and len(caught) == 1  # once per process


@pytest.mark.parametrize(
    ("spec", "len_q", "len_k"),
    [
        (AttentionSpec(causal=True, window=(3, 0)), 6, 2),
        (AttentionSpec(window=(None, 1)), 5, 2),  # the window's right side alone empties rows too
    ],
)
def test_the_warning_counts_the_rows_the_output_leaves_empty(
    caught: list[warnings.WarningMessage], spec: AttentionSpec, len_q: int, len_k: int
) -> None:
    empty = _rows_without_key(spec, len_q, len_k)
    assert empty > 0 and len(caught) == 1 and f"the first {empty} query rows" in str(caught[0].message)


@pytest.mark.parametrize(
    ("spec", "len_q", "len_k"),
    [
        (AttentionSpec(causal=True), 2, 5),
        (AttentionSpec(causal=True), 4, 4),
        (AttentionSpec(causal=True, causal_alignment="top_left"), 5, 2),
        (AttentionSpec(), 5, 2),
        (AttentionSpec(window=(1, None)), 5, 2),
    ],
)
def test_no_warning_where_every_row_sees_a_key(
    caught: list[warnings.WarningMessage], spec: AttentionSpec, len_q: int, len_k: int
) -> None:
    assert _rows_without_key(spec, len_q, len_k) == 0 and not caught
