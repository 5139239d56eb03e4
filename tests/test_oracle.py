"""The oracle itself is right: torch-naive in float64 against a per-element literal reading of
docs/semantics.md written with Python loops, and its gradients against finite differences.

The oracle's visibility (torch_naive.oracle_visibility) is written apart from the one torch-sdpa and torch-flex read
(torch_contract.visibility): both are held against the per-pair loop here, and a one-character defect in either is
shown to fail the check that guards it."""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from attnkit.backends.reference import torch_naive
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

import attnkit
from attnkit import AttentionSpec, CausalAlignment, Layout, Variant
from attnkit.contract import torch as torch_contract
from attnkit.testing import Case, assert_backends_agree, make_arrays
from attnkit.testing.agreement import DisagreementError, oracle_results, rounded
from attnkit.testing.strategies import cases
from attnkit.validation import prepare
from tests.test_contract import COSINE_WITHOUT_QUERIES


def _broadcast(case: Case, arrays: dict[str, np.ndarray], name: str) -> np.ndarray | None:
    """Mask or bias broadcast to (B, Hq, Lq, Lk) (Hq = 1 for 3-D calls), None when the call has none."""
    if name not in arrays:
        return None
    x = arrays[name]
    if case.three_d:
        x = x.reshape((1,) * (3 - x.ndim) + x.shape)[:, None]
    return np.broadcast_to(x, (case.batch, 1 if case.three_d else case.heads_q, case.len_q, case.len_k))


def literal_visibility(case: Case, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """docs/semantics.md §4 one (b, h, i, j) at a time: (B, Hq, Lq, Lk) booleans."""
    spec = case.spec
    mask = _broadcast(case, arrays, "mask")
    visible = np.zeros((case.batch, 1 if case.three_d else case.heads_q, case.len_q, case.len_k), dtype=bool)
    for b, h, i, j in itertools.product(*(range(n) for n in visible.shape)):
        q_len = case.q_lengths[b] if case.q_lengths is not None else case.len_q
        kv_len = case.kv_lengths[b] if case.kv_lengths is not None else case.len_k
        offset = kv_len - q_len if spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT else 0
        seen = j < kv_len and i < q_len
        if spec.causal:
            seen &= j <= i + offset
        if spec.window is not None:
            left, right = spec.window
            seen &= left is None or j >= i + offset - left
            seen &= right is None or j <= i + offset + right
        if case.q_segment_ids is not None and case.kv_segment_ids is not None:
            q_id, kv_id = case.q_segment_ids[b][i], case.kv_segment_ids[b][j]
            seen &= q_id >= 0 and q_id == kv_id
        if mask is not None:
            seen &= bool(mask[b, h, i, j])
        visible[b, h, i, j] = seen
    return visible


def literal_attention(case: Case, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """docs/semantics.md §1-§6, §15 (a sink: one more logit in a row that is not padding) and §16 (ALiBi) one query row
    at a time, in float64 (bhsd out, lse (B, Hq, Lq))."""
    spec = case.spec
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    if case.three_d:
        q, k, v = q[:, None], k[:, None], v[:, None]
    elif spec.layout is Layout.BSHD:
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    batch, heads_q, len_q, head_dim = q.shape
    heads_kv, len_k = k.shape[1], k.shape[2]
    visible, bias = literal_visibility(case, arrays), _broadcast(case, arrays, "bias")
    scale = spec.scale if spec.scale is not None else (16.0 if spec.variant is Variant.COSINE else head_dim**-0.5)
    out = np.zeros((batch, heads_q, len_q, v.shape[-1]))
    lse = np.full((batch, heads_q, len_q), -np.inf)
    sinks = arrays.get("sinks")
    slopes = arrays.get("alibi_slopes")
    if slopes is not None:  # (Hq,) or (B, Hq) as (B, Hq), in float64 as the oracle computes
        slopes = np.broadcast_to(slopes.astype(np.float64).reshape(-1, heads_q), (batch, heads_q))

    def padding(b: int, i: int) -> bool:
        return bool(
            (case.q_lengths and i >= case.q_lengths[b]) or (case.q_segment_ids and case.q_segment_ids[b][i] < 0)
        )

    for b in range(batch):
        for h in range(heads_q):
            kv_head = h // (heads_q // heads_kv)
            for i in range(len_q):
                keys, scores = [], []
                for j in range(len_k):
                    if not visible[b, h, i, j]:
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
                    if slopes is not None:
                        q_len = case.q_lengths[b] if case.q_lengths is not None else len_q
                        kv_len = case.kv_lengths[b] if case.kv_lengths is not None else len_k
                        bottom_right = spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT
                        s -= slopes[b, h] * abs(i + (kv_len - q_len if bottom_right else 0) - j)
                    keys.append(j)
                    scores.append(s)
                logits = scores + ([float(sinks[h])] if sinks is not None and not padding(b, i) else [])
                if logits:
                    top = max(logits)
                    weights = np.exp(np.array(logits) - top)
                    lse[b, h, i] = top + math.log(weights.sum())
                    out[b, h, i] = (weights[: len(keys)] / weights.sum()) @ v[b, kv_head, keys]
    return out, lse


def _oracle(case: Case, arrays: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = {name: torch.tensor(value) for name, value in arrays.items() if name not in ("dout", "dlse")}
    return attnkit.attend(
        case.spec,
        tensors.pop("q"),
        tensors.pop("k"),
        tensors.pop("v"),
        return_lse=True,
        backend="torch-naive",
        **tensors,
    )


def assert_oracle_matches_literal_loops(case: Case) -> None:
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
    assert lse.dtype == torch.float64  # §6: float64 calls return a float64 lse
    np.testing.assert_allclose(lse.numpy()[finite], expected_lse[finite], rtol=1e-10, atol=1e-12)


@settings(max_examples=60)
@given(case=cases(dtypes=("float64",), max_len=10))
def test_oracle_matches_literal_loops(case: Case) -> None:
    """§1-§6: every feature, per element, against the contract's own words."""
    note(case.describe())
    assert_oracle_matches_literal_loops(case)


def _inputs(case: Case, tensors: dict[str, torch.Tensor]) -> tuple[attnkit.AttentionInputs, bool]:
    """The call as backends receive it (4-D, mask and bias with unit axes prepended), through attend's own checks;
    and whether it was 3-D."""
    names = ("q", "k", "v", "mask", "bias", "q_lengths", "kv_lengths")
    segment_ids = (tensors.get("q_segment_ids"), tensors.get("kv_segment_ids"))
    _, _, inputs, was_3d = prepare(case.spec, *(tensors.get(name) for name in names), True, *segment_ids)
    return inputs, was_3d


@settings(max_examples=100)  # about 10 ms each: enough draws to meet every combination of §4's clauses
@given(case=cases(dtypes=("float64",), max_len=8, head_dims=(1,)), tile_q=st.integers(1, 8), tile_k=st.integers(1, 8))
@example(
    case=Case(spec=AttentionSpec(window=(1, 0)), len_q=6, len_k=5, mask_shape=(1, 2, 1, 5), dtype="float64"),
    tile_q=2,
    tile_k=2,
).via("a mask broadcast along the query axis, asked for in tiles")
def test_both_visibility_rules_match_the_per_pair_loop(case: Case, tile_q: int, tile_k: int) -> None:
    """§4 for causal in both alignments, each window side, lengths, broadcast masks, Lq ≠ Lk and Lq = 1: the oracle's
    visibility and the one torch-sdpa and torch-flex read, each against the loop; the latter also tile by tile, as
    torch-sdpa asks for it (a mask broadcast along the query axis must give every tile its one row)."""
    note(case.describe())
    arrays = make_arrays(case)
    inputs, _ = _inputs(case, {name: torch.tensor(value) for name, value in arrays.items()})
    expected = literal_visibility(case, arrays)
    oracle = torch_naive.oracle_visibility(case.spec, inputs, case.len_q, case.len_k)
    np.testing.assert_array_equal(torch.broadcast_to(oracle, expected.shape).numpy(), expected)
    whole = [(slice(0, case.len_q), slice(0, case.len_k))]
    tiles = [
        (slice(r, min(r + tile_q, case.len_q)), slice(c, min(c + tile_k, case.len_k)))
        for r in range(0, case.len_q, tile_q)
        for c in range(0, case.len_k, tile_k)
    ]
    for rows, cols in whole + tiles:
        part = expected[:, :, rows, cols]
        production = torch_contract.visibility(case.spec, inputs, case.len_q, case.len_k, rows, cols)
        production = torch.ones((), dtype=torch.bool) if production is None else production
        np.testing.assert_array_equal(
            torch.broadcast_to(production, part.shape).numpy(), part, err_msg=f"{rows} {cols}"
        )


def _defective_copy(module: ModuleType, old: str, new: str, tmp_path: Path) -> ModuleType:
    """``module`` loaded again from a copy of its source with ``old`` replaced by ``new`` (a deliberate defect)."""
    source = Path(module.__file__ or "").read_text()
    count = source.count(old)
    assert count == 1, f"the defect's anchor {old!r} occurs {count} times in {module.__name__}, not once"
    name = "defective_" + module.__name__.replace(".", "_")
    path = tmp_path / f"{name}.py"
    path.write_text(source.replace(old, new))
    loader_spec = importlib.util.spec_from_file_location(name, path)
    assert loader_spec is not None and loader_spec.loader is not None
    copy = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(copy)
    return copy


def _replace_everywhere(monkeypatch: pytest.MonkeyPatch, original: Any, replacement: Any) -> None:
    """Rebind every attnkit module's name for ``original`` (``from ... import`` copies included), as a defect in
    ``original``'s source would reach them all."""
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("attnkit"):
            for name, value in list(vars(module).items()):
                if value is original:
                    monkeypatch.setattr(module, name, replacement)


# defect: (call that shows it, (anchor, replacement) in torch_contract's Band, the same in oracle_visibility)
VISIBILITY_DEFECTS = {
    "window left edge one key short": (
        Case(spec=AttentionSpec(window=(2, 1)), batch=1, len_q=10, len_k=10, dtype="float64"),
        ("else aligned + self.lower,", "else aligned + self.lower + 1,"),
        ("element.triu_(off - left)", "element.triu_(off - left + 1)"),
    ),
    "bottom-right offset one too large": (
        Case(spec=AttentionSpec(causal=True), batch=1, len_q=5, len_k=9, dtype="float64"),
        ("[alignment_offset(self.spec, q_len, kv_len)", "[1 + alignment_offset(self.spec, q_len, kv_len)"),
        ("off = kv_len - q_len if", "off = kv_len - q_len + 1 if"),
    ),
}


@pytest.mark.parametrize("defect", list(VISIBILITY_DEFECTS))
def test_a_defect_in_the_backends_visibility_fails_the_harness(
    defect: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torch_contract's Band with one defect: torch-sdpa (which builds its masks from it) must disagree with the
    oracle, which must not share the defect."""
    case, (old, new), _ = VISIBILITY_DEFECTS[defect]
    assert_backends_agree(case, backends=["torch-sdpa"])  # the unmodified helper agrees on this very call
    defective = _defective_copy(torch_contract, old, new, tmp_path).Band
    _replace_everywhere(monkeypatch, torch_contract.Band, defective)
    with pytest.raises(DisagreementError, match="torch-sdpa"):
        assert_backends_agree(case, backends=["torch-sdpa"])


@pytest.mark.parametrize("defect", list(VISIBILITY_DEFECTS))
def test_a_defect_in_the_oracles_visibility_fails_the_literal_loops(
    defect: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torch_naive.oracle_visibility with one defect: the oracle must disagree with the per-element loops."""
    case, _, (old, new) = VISIBILITY_DEFECTS[defect]
    assert_oracle_matches_literal_loops(case)
    defective = _defective_copy(torch_naive, old, new, tmp_path).oracle_visibility
    _replace_everywhere(monkeypatch, torch_naive.oracle_visibility, defective)
    with pytest.raises(AssertionError):
        assert_oracle_matches_literal_loops(case)


def _gradient_case(spec: AttentionSpec) -> Case:
    return Case(
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
        dtype="float64",
    )


@given(case=cases(dtypes=("float64",), max_len=4, head_dims=(2, 3)))
@example(case=_gradient_case(AttentionSpec(causal=True, softcap=3.0)))
@example(case=_gradient_case(AttentionSpec(variant="cosine", window=(2, 1))))
@example(case=_gradient_case(AttentionSpec(causal=True, causal_alignment="top_left", layout="bshd")))
@example(
    case=Case(
        spec=AttentionSpec(window=(1, 0)),
        batch=2,
        heads_q=1,
        len_q=3,
        len_k=4,
        head_dim=2,
        head_dim_v=3,
        three_d=True,
        bias_shape=(1, 4),
        bias_grad=True,
        q_lengths=(0, 3),
        dtype="float64",
    )
)
def test_oracle_gradients_match_finite_differences(case: Case) -> None:
    """§8: dq, dk, dv, dbias (summed to its broadcast shape) and the gradient through lse, by central differences in
    float64, over drawn calls: lengths (0 included), masks with fully masked rows, 3-D, GQA/MQA, windows, softcap,
    cosine, scale, both layouts."""
    note(case.describe())
    arrays = make_arrays(case)
    differentiable = [name for name in ("q", "k", "v", "bias") if name in arrays and (name != "bias" or case.bias_grad)]
    leaves = tuple(torch.tensor(arrays[name], requires_grad=True) for name in differentiable)
    fixed = {
        name: torch.tensor(arrays[name])
        for name in ("mask", "bias", "q_lengths", "kv_lengths")
        if name in arrays and name not in differentiable
    }

    def named(values: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        return dict(zip(differentiable, values)) | fixed

    def oracle(values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = named(values)
        q, k, v = tensors.pop("q"), tensors.pop("k"), tensors.pop("v")
        return attnkit.attend(case.spec, q, k, v, return_lse=True, backend="torch-naive", **tensors)

    def lse_in_float64(values: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The oracle's lse in float64, shaped as attend returns it."""
        inputs, was_3d = _inputs(case, named(values))
        _, lse = torch_naive.oracle_attention(case.spec, inputs, torch.float64)
        return lse[:, 0] if was_3d else lse

    class FiniteLse(torch.autograd.Function):
        """lse with −inf rows at 0, as the harness takes it: the value in float64, the gradient from attend's own
        autograd through the lse it returns."""

        @staticmethod
        def forward(ctx: Any, *values: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(*values)
            lse = lse_in_float64(values)
            return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

        @staticmethod
        def backward(ctx: Any, dlse: torch.Tensor) -> tuple[torch.Tensor, ...]:
            values = tuple(value.detach().requires_grad_(True) for value in ctx.saved_tensors)
            with torch.enable_grad():
                lse = oracle(values)[1]
                finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
                return torch.autograd.grad(finite, values, dlse.to(lse.dtype))

    # Fast mode compares vᵀJu for random u, v (a wrong entry of J moves it with probability 1) at a few calls per
    # input instead of two per element; float64 differences are good to ~1e-9 here, hence the tight tolerances.
    # (check_undefined_grad exercises autograd.Function plumbing for absent cotangents, not these gradients.)
    both = lambda *values: (oracle(values)[0], FiniteLse.apply(*values))  # noqa: E731
    assert torch.autograd.gradcheck(both, leaves, atol=1e-7, rtol=1e-5, fast_mode=True, check_undefined_grad=False)


def test_the_float16_baseline_is_finite_where_the_oracle_is() -> None:
    """The tolerance rule drops a baseline (the literal algorithm in the case's dtype) that is not finite, leaving
    the floor alone. A cosine row of padding is zero; normalised with eps = 1e-12, which float16 rounds to 0, it was
    0/0, and 0·NaN made the baseline's dk NaN (dq, for a key row) in that batch element."""
    case = COSINE_WITHOUT_QUERIES
    exact, baseline = oracle_results(case, rounded(case, make_arrays(case)))
    for name, expected in exact.items():
        assert np.array_equal(np.isfinite(baseline[name]), np.isfinite(expected)), name
