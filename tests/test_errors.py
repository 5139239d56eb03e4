"""Bad input (issue §9, docs/semantics.md §11): a typed AttnkitError naming the argument, expected and actual."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit
from attnkit import (
    AttentionSpec,
    AttnkitError,
    BackendUnavailableError,
    InvalidInputError,
    InvalidInputTypeError,
    UnknownBackendError,
)

SPEC = AttentionSpec()


def qkv(**shapes):
    q = torch.randn(shapes.get("q", (2, 4, 5, 16)))
    k = torch.randn(shapes.get("k", (2, 2, 6, 16)))
    v = torch.randn(shapes.get("v", (2, 2, 6, 8)))
    return q, k, v


CASES = [
    ("batch", dict(shapes={"k": (3, 2, 6, 16)}), InvalidInputError, "batch sizes differ: q has 2, k has 3"),
    ("head dim", dict(shapes={"k": (2, 2, 6, 32)}), InvalidInputError, "k has head_dim=32, expected q's head_dim=16"),
    ("kv length", dict(shapes={"v": (2, 2, 7, 8)}), InvalidInputError, "v has 7 keys, expected k's 6"),
    ("kv heads", dict(shapes={"v": (2, 1, 6, 8)}), InvalidInputError, "v has num_heads_kv=1, expected k's 2"),
    (
        "gqa",
        dict(shapes={"q": (2, 3, 5, 16)}),
        InvalidInputError,
        r"heads_q=3 \(query heads\) is not a multiple of heads_kv=2",
    ),
    ("ndim", dict(shapes={"q": (2, 4, 5, 16, 1)}), InvalidInputError, "must all be 4-D"),
    (
        "mask dtype",
        dict(mask=torch.ones(5, 6)),
        InvalidInputTypeError,
        r"mask has dtype float32, expected bool \(True = may attend\); an additive float mask .* goes in bias=",
    ),
    (
        "lengths as a list",
        dict(kv_lengths=[6, 6]),
        InvalidInputTypeError,
        r"kv_lengths must be a torch integer array of shape \(B,\) on q's device "
        r"\(e.g. torch.tensor\(\[512, 300\]\)\), got list",
    ),
    (
        "bshd tensors read as bhsd",  # (B, L, H, D) = (2, 5, 4, 16) and (2, 6, 2, 16): in bhsd, 5 heads over 6
        dict(shapes={"q": (2, 5, 4, 16), "k": (2, 6, 2, 16), "v": (2, 6, 2, 8)}),
        InvalidInputError,
        r"heads_q=5 .* is not a multiple of heads_kv=6 .* \(reading q, k, v as layout='bhsd'\); in layout='bshd' these "
        r"shapes fit: pass AttentionSpec\(layout='bshd'\) if they are \(B, L, H, D\)",
    ),
    ("mask shape", dict(mask=torch.ones(5, 7, dtype=torch.bool)), InvalidInputError, r"mask has shape \(5, 7\)"),
    ("bias shape", dict(bias=torch.zeros(3, 4, 5, 6)), InvalidInputError, r"bias has shape \(3, 4, 5, 6\), expected"),
    ("bias dtype", dict(bias=torch.zeros(5, 6, dtype=torch.int32)), InvalidInputTypeError, "bias has dtype int32"),
    ("lengths dtype", dict(kv_lengths=torch.tensor([1.0, 2.0])), InvalidInputTypeError, "kv_lengths has dtype float32"),
    ("lengths shape", dict(kv_lengths=torch.tensor([1, 2, 3])), InvalidInputError, r"kv_lengths has shape \(3,\)"),
    (
        "lengths range",
        dict(kv_lengths=torch.tensor([1, 7])),
        InvalidInputError,
        r"kv_lengths values must lie in \[0, 6\], got min=1, max=7",
    ),
    ("negative lengths", dict(q_lengths=torch.tensor([-1, 2])), InvalidInputError, "q_lengths values must lie in"),
    # §16: q has Hq = 4 query heads, B = 2
    (
        "alibi slopes shape",
        dict(alibi_slopes=torch.ones(2)),
        InvalidInputError,
        r"alibi_slopes has shape \(2,\), expected \(Hq,\)=\(4,\) or \(B, Hq\)=\(2, 4\)",
    ),
    (
        "alibi slopes dtype",
        dict(alibi_slopes=torch.ones(4, dtype=torch.float64)),
        InvalidInputTypeError,
        r"alibi_slopes has dtype float64, expected float32",
    ),
    (
        "alibi slopes negative",
        dict(alibi_slopes=torch.tensor([0.5, -0.25, 0.125, 0.0])),
        InvalidInputError,
        r"alibi_slopes must be finite and >= 0, got \[-0.25\]",
    ),
    (
        "alibi slopes NaN",
        dict(alibi_slopes=torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, float("nan"), 0.5, 0.5]])),
        InvalidInputError,
        r"alibi_slopes must be finite and >= 0, got \[nan\]",
    ),
    (
        "alibi slopes with grad",
        dict(alibi_slopes=torch.ones(4, requires_grad=True)),
        InvalidInputError,
        r"alibi_slopes requires grad, but ALiBi slopes take no gradient",
    ),
    (
        "alibi slopes as a list",
        dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
        InvalidInputTypeError,
        r"alibi_slopes must be a torch float32 array of shape \(Hq,\) or \(B, Hq\), got list",
    ),
]


@pytest.mark.parametrize(("name", "kwargs", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_argument_expected_and_actual(name, kwargs, error, message) -> None:
    kwargs = dict(kwargs)
    q, k, v = qkv(**kwargs.pop("shapes", {}))
    with pytest.raises(error, match=message) as raised:
        attnkit.attend(SPEC, q, k, v, **kwargs)
    assert isinstance(raised.value, AttnkitError)


def test_dtype_mismatch() -> None:
    q, k, v = qkv()
    with pytest.raises(InvalidInputTypeError, match="k has dtype float64, expected q's dtype float32"):
        attnkit.attend(SPEC, q, k.double(), v)


def test_non_floating_input() -> None:
    q, k, v = qkv()
    with pytest.raises(InvalidInputTypeError, match="q has dtype int64, expected a floating dtype"):
        attnkit.attend(SPEC, q.long(), k.long(), v.long())


def test_mixed_frameworks_and_numpy() -> None:
    q, k, v = qkv()
    with pytest.raises(InvalidInputTypeError, match="k must be the same kind of array as q"):
        attnkit.attend(SPEC, q, k.numpy(), v)
    with pytest.raises(InvalidInputTypeError, match="q must be a torch.Tensor or a jax.Array, got numpy.ndarray"):
        attnkit.attend(SPEC, np.zeros((1, 1, 1, 4)), k, v)


def test_spec_must_be_a_spec() -> None:
    q, k, v = qkv()
    with pytest.raises(InvalidInputTypeError, match="spec must be an attnkit.AttentionSpec"):
        attnkit.attend({"causal": True}, q, k, v)  # type: ignore[arg-type]


def test_unknown_backend_lists_registered_ones() -> None:
    q, k, v = qkv()
    with pytest.raises(UnknownBackendError, match="backend='flash' is not registered .*torch-naive"):
        attnkit.attend(SPEC, q, k, v, backend="flash")


def test_zero_heads() -> None:
    q, k, v = qkv(q=(2, 0, 5, 16))
    with pytest.raises(InvalidInputError, match="heads_q=0 and heads_kv=2 must both be positive"):
        attnkit.attend(SPEC, q, k, v)


def test_named_backend_that_cannot_serve_lists_reasons_and_never_falls_back() -> None:
    q, k, v = qkv()
    jax_only = [
        n for n, b in attnkit.registered_backends().items() if attnkit.Framework.TORCH not in b.capabilities.frameworks
    ]
    if not jax_only:
        pytest.skip("no backend here refuses torch tensors")
    with pytest.raises(BackendUnavailableError, match=f"backend='{jax_only[0]}' cannot serve this call") as raised:
        attnkit.attend(SPEC, q, k, v, backend=jax_only[0])
    assert "framework=torch" in str(raised.value)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (
            {"q": (2, 4, 5, 0), "k": (2, 2, 6, 0)},
            r"head_dim=0 \(q and k\) and head_dim_v=8 \(v\) must both be positive",
        ),
        ({"v": (2, 2, 6, 0)}, r"head_dim=16 \(q and k\) and head_dim_v=0 \(v\) must both be positive"),
    ],
)
def test_zero_head_dim_is_invalid_input_in_attend_and_explain(shapes, message) -> None:
    q, k, v = qkv(**shapes)
    for call in (attnkit.attend, attnkit.explain):
        with pytest.raises(InvalidInputError, match=message):
            call(SPEC, q, k, v)


@pytest.mark.parametrize("backend", [None, 3, ["torch-naive"], "registered backend object"])
def test_backend_must_be_auto_or_a_name(backend) -> None:
    """None is not a synonym of "auto": a forgotten value must not pass for a choice (nor a Backend for its name)."""
    q, k, v = qkv()
    if backend == "registered backend object":
        backend = attnkit.get_backend("torch-naive")
    attnkit.attend(SPEC, q, k, v)  # the same call with backend="auto" is cached: the fast path must check too
    with pytest.raises(InvalidInputTypeError, match=r"backend=.*: expected 'auto' or a registered backend's name"):
        attnkit.attend(SPEC, q, k, v, backend=backend)
    with pytest.raises(InvalidInputTypeError, match=r"use_backend\(name=.*\): expected 'auto' or a registered"):
        with attnkit.use_backend(backend):
            pass
