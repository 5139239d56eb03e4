"""Attention sinks (docs/semantics.md §15). The conformance suite draws sinks with every other clause on every backend
(attnkit.testing.strategies.sinks_drawn) and the named edge case "sinks, rows with no key, padding rows, GQA" runs in
`attnkit check`; here: the oracle's sink against a per-row loop written from gpt-oss's reference, the promises §15
makes exactly (a row with no key, padding rows, NaN, −∞), the typed errors, and the composition under jax.jit and
torch.compile."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from attnkit.backends.reference.torch_naive import oracle_attention

import attnkit
from attnkit.backend import AttentionInputs
from attnkit.errors import InvalidInputError, InvalidInputTypeError

SPEC = attnkit.AttentionSpec(causal=True)


def _gpt_oss_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, sinks: np.ndarray, q_lengths, kv_lengths):
    """gpt-oss's reference, one row at a time: the scores of the keys a bottom-right causal row sees, the head's sink
    appended, a max-subtracted softmax, the sink's column dropped; (out, lse) in float64. Padding rows: 0 and −inf."""
    batch, heads, len_q, _ = q.shape
    group = heads // k.shape[1]
    out, lse = np.zeros((*q.shape[:3], v.shape[-1])), np.full(q.shape[:3], -np.inf)
    scale = 1 / math.sqrt(q.shape[-1])
    for b in range(batch):
        offset = kv_lengths[b] - q_lengths[b]
        for h in range(heads):
            for i in range(q_lengths[b]):
                keys = [j for j in range(kv_lengths[b]) if j <= i + offset]
                logits = [scale * q[b, h, i] @ k[b, h // group, j] for j in keys] + [sinks[h]]
                top = max(logits)
                weights = np.exp(np.array(logits) - top)
                lse[b, h, i] = top + math.log(weights.sum())
                probs = weights[:-1] / weights.sum()
                out[b, h, i] = sum((p * v[b, h // group, j] for p, j in zip(probs, keys)), np.zeros(v.shape[-1]))
    return out, lse


def test_the_oracle_writes_the_sink_as_gpt_oss_does() -> None:
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4, 5, 8)), rng.standard_normal((2, 2, 7, 8)), rng.standard_normal((2, 2, 7, 8))
    sinks = 2 * rng.standard_normal(4)
    q_lengths, kv_lengths = (5, 3), (7, 0)  # batch 1: padding rows, and rows that see no key
    expected_out, expected_lse = _gpt_oss_rows(q, k, v, sinks, q_lengths, kv_lengths)
    inputs = AttentionInputs(*map(torch.tensor, (q, k, v)), q_lengths=torch.tensor(q_lengths),
                             kv_lengths=torch.tensor(kv_lengths))  # fmt: skip
    out, lse = oracle_attention(SPEC, inputs, torch.float64, torch.tensor(sinks))
    np.testing.assert_allclose(out.numpy(), expected_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), np.isneginf(expected_lse))
    np.testing.assert_allclose(lse.numpy(), expected_lse, rtol=1e-12)


def _call(dtype=torch.float32, **lengths):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 16, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 2, 7, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, dtype=dtype, requires_grad=True)
    lengths = {name: torch.tensor(value) for name, value in lengths.items()}
    return q, k, v, sinks, lengths


@pytest.mark.parametrize("backend", ["torch-chunked", "cpu-flash"])
def test_a_row_with_no_key_keeps_its_sink_and_padding_rows_get_none(backend: str) -> None:
    """§15 exactly: a row that sees no key has out 0, lse = its head's sink, and sends its dlse to dsinks alone;
    a padding row keeps out 0, lse −∞ and sends nothing anywhere."""
    q, k, v, sinks, lengths = _call(q_lengths=(5, 3), kv_lengths=(7, 0))
    out, lse = attnkit.attend(SPEC, q, k, v, sinks=sinks, return_lse=True, backend=backend, **lengths)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(lse[1, :, :3], sinks.detach().view(4, 1).expand(4, 3))  # no key: lse = s exactly
    assert torch.isneginf(lse[1, :, 3:]).all()  # padding
    dlse = torch.zeros_like(lse)
    dlse[1, :, :3] = 1.0  # the empty rows' cotangent alone
    dq, dk, dv, dsinks = torch.autograd.grad(lse, (q, k, v, sinks), dlse)
    assert torch.equal(dsinks, torch.full_like(dsinks, 3.0))  # p = 1 in each of the three rows
    assert not dq.any() and not dk.any() and not dv.any()


def test_nan_in_a_sink_reaches_its_head_alone() -> None:
    q, k, v, sinks, _ = _call()
    poisoned = sinks.detach().clone()
    poisoned[2] = float("nan")
    out, lse = attnkit.attend(SPEC, q, k, v, sinks=poisoned, return_lse=True)
    assert out[:, 2].isnan().all() and lse[:, 2].isnan().all()
    assert not out[:, [0, 1, 3]].isnan().any() and not lse[:, [0, 1, 3]].isnan().any()


def test_a_sink_of_minus_infinity_is_no_sink() -> None:
    q, k, v, _, _ = _call()
    plain = attnkit.attend(SPEC, q, k, v, return_lse=True)
    with_none = attnkit.attend(SPEC, q, k, v, sinks=torch.full((4,), float("-inf")), return_lse=True)
    for a, b in zip(plain, with_none):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("sinks", "error", "text"),
    [
        (torch.zeros(3), InvalidInputError, "sinks has shape (3,), expected (Hq,)=(4,)"),
        (torch.zeros(1, 4), InvalidInputError, "sinks has shape (1, 4)"),
        (torch.zeros(4, dtype=torch.int64), InvalidInputTypeError, "sinks has dtype int64, expected a floating"),
        ([0.0] * 4, InvalidInputTypeError, "sinks must be a torch array like q"),
        (torch.zeros(4, device="meta"), InvalidInputTypeError, "sinks is on device meta, expected q's device cpu"),
    ],
)
def test_bad_sinks_get_a_typed_error_naming_them(sinks, error, text) -> None:
    q, k, v, _, _ = _call()
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        attnkit.attend(SPEC, q, k, v, sinks=sinks)
    with pytest.raises(error):
        attnkit.explain(SPEC, q, k, v, sinks=sinks)


def test_sinks_under_jax_jit_and_grad_match_the_oracle() -> None:
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    q, k, v, sinks, lengths = _call(dtype=torch.float64, q_lengths=(5, 3), kv_lengths=(7, 0))
    arrays = [jnp.asarray(x.detach().numpy(), dtype=jnp.float32) for x in (q, k, v, sinks)]
    jax_lengths = {name: jnp.asarray(x.numpy()) for name, x in lengths.items()}

    def loss(q, k, v, sinks):
        out, lse = attnkit.attend(SPEC, q, k, v, sinks=sinks, return_lse=True, backend="jax-reference", **jax_lengths)
        return (out**2).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*arrays)
    inputs = AttentionInputs(*(x.detach().float().double() for x in (q, k, v)), **lengths)
    leaves = [x.detach().float().double().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = oracle_attention(SPEC, inputs._replace(q=leaves[0], k=leaves[1], v=leaves[2]), torch.float64, leaves[3])
    expected = (out**2).sum() + torch.where(lse.isfinite(), lse, 0.0).sum()
    expected_grads = torch.autograd.grad(expected, leaves)
    np.testing.assert_allclose(float(value), expected.item(), rtol=1e-5)
    for grad, oracle in zip(grads, expected_grads):
        np.testing.assert_allclose(np.asarray(grad), oracle.numpy(), rtol=2e-4, atol=2e-5)


def test_sinks_in_a_compiled_graph_match_eager() -> None:
    q, k, v, sinks, lengths = _call(kv_lengths=(7, 4))

    def loss(q, k, v, sinks):
        out, lse = attnkit.attend(SPEC, q, k, v, sinks=sinks, return_lse=True, **lengths)
        return (out**2).sum() + lse.sum()

    eager = torch.autograd.grad(loss(q, k, v, sinks), (q, k, v, sinks))
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    for a, b in zip(torch.autograd.grad(compiled(q, k, v, sinks), (q, k, v, sinks)), eager):
        torch.testing.assert_close(a, b)
