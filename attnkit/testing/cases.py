"""Conformance cases: a Case describes one call (no tensors); make_arrays() draws its inputs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from attnkit.backend import Framework, Problem
from attnkit.spec import AttentionSpec, Layout


@dataclass(frozen=True)
class Case:
    """One attention call to check: the spec, the shapes, which optional inputs, the dtype and a seed."""

    spec: AttentionSpec
    batch: int = 2
    heads_q: int = 2
    heads_kv: int = 1
    len_q: int = 8
    len_k: int = 8
    head_dim: int = 16
    head_dim_v: int = 16
    dtype: str = "float32"
    mask_shape: tuple[int, ...] | None = None
    # Rows of the mask set entirely False, so those queries see no key (docs/semantics.md §5).
    masked_rows: tuple[int, ...] = ()
    bias_shape: tuple[int, ...] | None = None
    bias_grad: bool = False
    q_lengths: tuple[int, ...] | None = None
    kv_lengths: tuple[int, ...] | None = None
    # Per batch element, each query's and each key's segment id (docs/semantics.md §4.5); negative: padding.
    q_segment_ids: tuple[tuple[int, ...], ...] | None = None
    kv_segment_ids: tuple[tuple[int, ...], ...] | None = None
    three_d: bool = False
    seed: int = 0
    grad: bool = True
    notes: tuple[str, ...] = field(default=(), compare=False)

    def problem(self, framework: Framework, device: str = "cpu") -> Problem:
        return Problem(
            framework=framework,
            device=device,
            dtype=self.dtype,
            batch=self.batch,
            heads_q=self.heads_q,
            heads_kv=self.heads_kv,
            len_q=self.len_q,
            len_k=self.len_k,
            head_dim=self.head_dim,
            head_dim_v=self.head_dim_v,
            has_mask=self.mask_shape is not None,
            has_bias=self.bias_shape is not None,
            has_q_lengths=self.q_lengths is not None,
            has_kv_lengths=self.kv_lengths is not None,
            needs_grad=self.grad,
            needs_bias_grad=self.grad and self.bias_grad and self.bias_shape is not None,
            return_lse=True,
            has_segment_ids=self.q_segment_ids is not None,
        )

    def features(self) -> frozenset[str]:
        """Spec and call features this case exercises (names as in attnkit.backend.ALL_FEATURES)."""
        return self.spec.features() | self.problem(Framework.TORCH).features()

    def with_(self, **changes: Any) -> Case:
        return replace(self, **changes)

    def shape(self, heads: int, length: int, dim: int) -> tuple[int, ...]:
        if self.three_d:
            return (self.batch, length, dim)
        if self.spec.layout is Layout.BSHD:
            return (self.batch, length, heads, dim)
        return (self.batch, heads, length, dim)

    def describe(self) -> str:
        parts = [
            f"B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} Lq={self.len_q} Lk={self.len_k} "
            f"D={self.head_dim} Dv={self.head_dim_v} {self.dtype}",
            self.spec.model_dump_json(exclude_defaults=True),
        ]
        for name in ("mask_shape", "masked_rows", "bias_shape", "q_lengths", "kv_lengths", "q_segment_ids",
                     "kv_segment_ids"):  # fmt: skip
            value = getattr(self, name)
            if value:
                parts.append(f"{name}={value}")
        if self.three_d:
            parts.append("3-D")
        return " ".join(parts)


def make_arrays(case: Case) -> dict[str, np.ndarray]:
    """Float64 inputs and cotangents for a case (NumPy), deterministic in the seed.

    Values are rounded to the case's dtype by the caller when converting, and the oracle sees the
    rounded values, so the comparison measures the backend and not the input rounding.
    """
    rng = np.random.default_rng(case.seed)
    heads_q = 1 if case.three_d else case.heads_q
    heads_kv = 1 if case.three_d else case.heads_kv
    arrays: dict[str, np.ndarray] = {
        "q": rng.standard_normal(case.shape(heads_q, case.len_q, case.head_dim)),
        "k": rng.standard_normal(case.shape(heads_kv, case.len_k, case.head_dim)),
        "v": rng.standard_normal(case.shape(heads_kv, case.len_k, case.head_dim_v)),
    }
    out_shape = case.shape(heads_q, case.len_q, case.head_dim_v)
    arrays["dout"] = rng.standard_normal(out_shape)
    lse_shape = (case.batch, case.len_q) if case.three_d else (case.batch, heads_q, case.len_q)
    arrays["dlse"] = rng.standard_normal(lse_shape)
    if case.mask_shape is not None:
        mask = rng.random(case.mask_shape) < 0.75
        for row in case.masked_rows:
            mask[..., row, :] = False
        arrays["mask"] = mask
    if case.bias_shape is not None:
        arrays["bias"] = rng.standard_normal(case.bias_shape)
    if case.q_lengths is not None:
        arrays["q_lengths"] = np.asarray(case.q_lengths, dtype=np.int64)
    if case.kv_lengths is not None:
        arrays["kv_lengths"] = np.asarray(case.kv_lengths, dtype=np.int64)
    if case.q_segment_ids is not None and case.kv_segment_ids is not None:
        arrays["q_segment_ids"] = np.asarray(case.q_segment_ids, dtype=np.int64).reshape(case.batch, case.len_q)
        arrays["kv_segment_ids"] = np.asarray(case.kv_segment_ids, dtype=np.int64).reshape(case.batch, case.len_k)
    return arrays
