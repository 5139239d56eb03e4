"""The oracle itself is right: torch-naive in float64 against a per-element literal reading of
docs/semantics.md written with Python loops, and its gradients against finite differences."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, note, settings

import attnkit
from attnkit import AttentionSpec, CausalAlignment, Layout, Variant
from attnkit.testing import Case, make_arrays
from attnkit.testing.strategies import cases


def literal_attention(case: Case, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """docs/semantics.md §1-§6 one query row at a time, in float64 (bhsd out, lse (B, Hq, Lq))."""
    spec = case.spec
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    if case.three_d:
        q, k, v = q[:, None], k[:, None], v[:, None]
    elif spec.layout is Layout.BSHD:
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    batch, heads_q, len_q, head_dim = q.shape
    heads_kv, len_k = k.shape[1], k.shape[2]
    full = (batch, heads_q, len_q, len_k)

    def broadcast(name: str) -> np.ndarray | None:
        if name not in arrays:
            return None
        x = arrays[name]
        if case.three_d:
            x = x.reshape((1,) * (3 - x.ndim) + x.shape)[:, None]
        return np.broadcast_to(x, full)

    mask, bias = broadcast("mask"), broadcast("bias")
    scale = spec.scale if spec.scale is not None else (16.0 if spec.variant is Variant.COSINE else head_dim**-0.5)
    out = np.zeros((batch, heads_q, len_q, v.shape[-1]))
    lse = np.full((batch, heads_q, len_q), -np.inf)
    for b in range(batch):
        q_len = case.q_lengths[b] if case.q_lengths is not None else len_q
        kv_len = case.kv_lengths[b] if case.kv_lengths is not None else len_k
        offset = kv_len - q_len if spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT else 0
        for h in range(heads_q):
            kv_head = h // (heads_q // heads_kv)
            for i in range(len_q):
                keys, scores = [], []
                for j in range(len_k):
                    visible = j < kv_len and i < q_len
                    if spec.causal:
                        visible &= j <= i + offset
                    if spec.window is not None:
                        left, right = spec.window
                        visible &= left is None or j >= i + offset - left
                        visible &= right is None or j <= i + offset + right
                    if mask is not None:
                        visible &= bool(mask[b, h, i, j])
                    if not visible:
                        continue
                    qi, kj = q[b, h, i], k[b, kv_head, j]
                    if spec.variant is Variant.COSINE:
                        qi = qi / max(np.linalg.norm(qi), 1e-12)
                        kj = kj / max(np.linalg.norm(kj), 1e-12)
                    s = scale * float(qi @ kj)
                    if spec.softcap is not None:
                        s = spec.softcap * math.tanh(s / spec.softcap)
                    if bias is not None:
                        s += bias[b, h, i, j]
                    keys.append(j)
                    scores.append(s)
                if keys:
                    top = max(scores)
                    weights = np.exp(np.array(scores) - top)
                    lse[b, h, i] = top + math.log(weights.sum())
                    out[b, h, i] = (weights / weights.sum()) @ v[b, kv_head, keys]
    return out, lse


def _oracle(case: Case, arrays: dict[str, np.ndarray], requires_grad: bool = False):
    tensors = {name: torch.tensor(value) for name, value in arrays.items() if name not in ("dout", "dlse")}
    for name in ("q", "k", "v", "bias"):
        if name in tensors:
            tensors[name].requires_grad_(requires_grad)
    out, lse = attnkit.attend(
        case.spec,
        tensors.pop("q"),
        tensors.pop("k"),
        tensors.pop("v"),
        return_lse=True,
        backend="torch-naive",
        **tensors,
    )
    return out, lse


@settings(max_examples=60)
@given(case=cases(dtypes=("float64",), max_len=10))
def test_oracle_matches_literal_loops(case: Case) -> None:
    """§1-§6: every feature, per element, against the contract's own words."""
    note(case.describe())
    arrays = make_arrays(case)
    out, lse = _oracle(case, arrays)
    expected_out, expected_lse = literal_attention(case, arrays)
    out = out.numpy()
    if case.three_d:
        out, lse = out[:, None], lse[:, None]
    elif case.spec.layout is Layout.BSHD:
        out = out.transpose(0, 2, 1, 3)
    np.testing.assert_allclose(out, expected_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), np.isneginf(expected_lse))
    finite = np.isfinite(expected_lse)
    # lse is float32 by contract (§6), whatever the input dtype.
    np.testing.assert_allclose(lse.numpy()[finite], expected_lse[finite], rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(causal=True, softcap=3.0),
        AttentionSpec(variant="cosine", window=(2, 1)),
        AttentionSpec(causal=True, causal_alignment="top_left", layout="bshd"),
    ],
    ids=["causal-softcap", "cosine-window", "top-left-bshd"],
)
def test_oracle_gradients_match_finite_differences(spec: AttentionSpec) -> None:
    """§8: dq, dk, dv, dbias and the gradient through lse, by central differences in float64."""
    case = Case(
        spec=spec,
        batch=1,
        heads_q=2,
        heads_kv=1,
        len_q=3,
        len_k=5,
        head_dim=4,
        head_dim_v=3,
        bias_shape=(1, 2, 3, 5),
        bias_grad=True,
        kv_lengths=(4,),
        mask_shape=(3, 5),
        masked_rows=(0,),
    )
    arrays = make_arrays(case)
    tensors = {name: torch.tensor(arrays[name], requires_grad=True) for name in ("q", "k", "v", "bias")}
    fixed = {"mask": torch.tensor(arrays["mask"]), "kv_lengths": torch.tensor(arrays["kv_lengths"])}
    dlse = torch.tensor(arrays["dlse"])

    def out_only(q, k, v, bias):
        return attnkit.attend(spec, q, k, v, bias=bias, backend="torch-naive", **fixed)

    def lse_only(q, k, v, bias):
        _, lse = attnkit.attend(spec, q, k, v, bias=bias, return_lse=True, backend="torch-naive", **fixed)
        return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dlse

    inputs = tuple(tensors.values())
    assert torch.autograd.gradcheck(out_only, inputs, eps=1e-6, atol=1e-7)
    # lse is float32 by contract (§6): a wider step keeps its rounding (6e-8) out of the difference quotient.
    assert torch.autograd.gradcheck(lse_only, inputs, eps=1e-3, atol=1e-4, rtol=1e-3)
