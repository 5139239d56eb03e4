"""torch-naive: the contract written literally in torch, materialising the score matrix. The oracle.

It shares the score and softmax arithmetic of ``attnkit.contract.torch.literal_attention`` but not its visibility:
torch-sdpa, torch-flex and torch-chunked build their masks from ``attnkit.contract.torch.Band``, so a slip there would
pass them and an oracle that used it alike. :func:`oracle_visibility` reads docs/semantics.md §4 again, in another
form."""

from __future__ import annotations

import torch

from attnkit.backend import (
    ALL_FEATURES,
    AttentionInputs,
    AttentionSpec,
    Capabilities,
    CausalAlignment,
    Dropout,
    Framework,
    Layout,
    PagedInputs,
)
from attnkit.contract.philox import keep_mask
from attnkit.contract.programs import dense
from attnkit.contract.torch import RecomputingBackend, compute_dtype, gather_pages, literal_attention


def oracle_visibility(spec: AttentionSpec, inputs: AttentionInputs, len_q: int, len_k: int) -> torch.Tensor:
    """Boolean (B, Hq|1, Lq, Lk): may query i see key j, docs/semantics.md §4 clause by clause, one batch element at
    a time. Causal and window are bands of the (Lq, Lk) matrix cut along its diagonals (j − i ≤ off is ``tril_(off)``),
    lengths blank whole rows and columns; written apart from ``attnkit.contract.torch.Band`` (index comparisons) so
    that tests/test_oracle.py can hold each against the other and a per-pair loop. A mask program (§17) is
    materialised, (B|1, Hq|1, Lq, Lk), and ANDed in."""
    batch = inputs.q.shape[0]
    q_lens = inputs.q_lengths.tolist() if inputs.q_lengths is not None else [len_q] * batch
    kv_lens = inputs.kv_lengths.tolist() if inputs.kv_lengths is not None else [len_k] * batch
    visible = torch.ones(batch, 1, len_q, len_k, dtype=torch.bool, device=inputs.q.device)
    for element, q_len, kv_len in zip(visible[:, 0], q_lens, kv_lens):
        # §4.1/4.3: the last real query faces the last real key (bottom-right), or query 0 faces key 0 (top-left).
        off = kv_len - q_len if spec.causal_alignment is CausalAlignment.BOTTOM_RIGHT else 0
        if spec.causal:  # j ≤ i + off: keep diagonal off and below
            element.tril_(off)
        if spec.window is not None:  # i + off − left ≤ j ≤ i + off + right; None: that side is open
            left, right = spec.window
            if left is not None:
                element.triu_(off - left)
            if right is not None:
                element.tril_(off + right)
        element[q_len:, :] = False  # padding queries see nothing
        element[:, kv_len:] = False  # padding keys are seen by none
    if inputs.q_segment_ids is not None:  # §4.5: the same id, and not a negative one
        for element, q_ids, kv_ids in zip(visible[:, 0], inputs.q_segment_ids.tolist(), inputs.kv_segment_ids.tolist()):
            rows = torch.tensor(q_ids, dtype=torch.long, device=element.device).unsqueeze(1)
            cols = torch.tensor(kv_ids, dtype=torch.long, device=element.device).unsqueeze(0)
            element &= (rows == cols) & (rows >= 0)
    if inputs.mask_program is not None:
        heads = inputs.q.shape[2 if spec.layout is Layout.BSHD else 1]
        visible = visible & dense(inputs.mask_program, batch, heads, len_q, len_k, inputs.q)
    return visible if inputs.mask is None else visible & inputs.mask


def oracle_keep(dropout: Dropout, batch: int, heads: int, len_q: int, len_k: int, device: torch.device) -> torch.Tensor:
    """§18's keep-mask from the reference Philox (NumPy, attnkit.contract.philox), not the torch one the other torch
    backends use."""
    seed = int(dropout.seed) % (1 << 64)
    starts = [int(start) for start in (dropout.head_start, dropout.query_start, dropout.key_start)]
    whole = keep_mask(seed, dropout.p, batch, starts[0] + heads, starts[1] + len_q, starts[2] + len_k)
    return torch.from_numpy(whole[:, starts[0] :, starts[1] :, starts[2] :].copy()).to(device)


def oracle_attention(
    spec: AttentionSpec, inputs: AttentionInputs, dtype: torch.dtype, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's (out, lse) in ``dtype``, differentiable: the literal contract with the oracle's own visibility,
    and §15's sinks as a logit column (never the lse composition that attend applies to every backend), and §18's
    keep-mask from the reference Philox."""
    return literal_attention(spec, inputs, dtype, oracle_visibility, sinks, oracle_keep)


class TorchNaiveBackend(RecomputingBackend):
    name = "torch-naive"
    capabilities = Capabilities(
        length_generic=True,
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        devices=frozenset({"cpu", "cuda"}),
        features=ALL_FEATURES,
        materialises_mask_programs=True,
        description="the contract written literally; materialises (Lq, Lk) scores; the float64 oracle",
    )

    def recompute(self, spec: AttentionSpec, inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return oracle_attention(spec, inputs, compute_dtype(inputs.q.dtype))

    def recompute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return compute_dtype(dtype)

    def forward(
        self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            out, lse = self.recompute(spec, inputs)
        return out.to(inputs.q.dtype), lse.to(compute_dtype(inputs.q.dtype))

    def forward_paged(
        self, spec: AttentionSpec, inputs: PagedInputs, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """§13 literally: the blocks gathered into contiguous (bshd) keys, then the oracle with kv_lengths."""
        keys, values = (
            gather_pages(inputs.k_cache, inputs.block_table),
            gather_pages(inputs.v_cache, inputs.block_table),
        )
        if spec.layout is Layout.BHSD:
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        gathered = AttentionInputs(
            inputs.q,
            keys,
            values,
            kv_lengths=inputs.kv_lengths,
            alibi_slopes=inputs.alibi_slopes,
        )
        return self.forward(spec, gathered, need_lse)
