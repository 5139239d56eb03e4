"""torch-naive: the contract written literally in torch, materialising the score matrix. The oracle.

It shares the score and softmax arithmetic of ``attnkit.contract.torch.literal_attention`` but not its visibility:
torch-sdpa and torch-flex build their masks from ``torch_contract.visibility``, so a slip there would pass them and
an oracle that used it alike. :func:`oracle_visibility` reads docs/semantics.md §4 again, in another form."""

from __future__ import annotations

import torch

from attnkit.backend import (
    ALL_FEATURES,
    AttentionInputs,
    AttentionSpec,
    Capabilities,
    CausalAlignment,
    Framework,
    Gradients,
    Problem,
    capability_reasons,
)
from attnkit.contract.torch import compute_dtype, literal_attention


def oracle_visibility(spec: AttentionSpec, inputs: AttentionInputs, len_q: int, len_k: int) -> torch.Tensor:
    """Boolean (B, Hq|1, Lq, Lk): may query i see key j, docs/semantics.md §4 clause by clause, one batch element at
    a time. Causal and window are bands of the (Lq, Lk) matrix cut along its diagonals (j − i ≤ off is ``tril_(off)``),
    lengths blank whole rows and columns; written apart from ``torch_contract.visibility`` (index comparisons) so
    that tests/test_oracle.py can hold each against the other and a per-pair loop."""
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
    return visible if inputs.mask is None else visible & inputs.mask


def oracle_attention(
    spec: AttentionSpec, inputs: AttentionInputs, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's (out, lse) in ``dtype``, differentiable: the literal contract with the oracle's own visibility."""
    return literal_attention(spec, inputs, dtype, oracle_visibility)


class TorchNaiveBackend:
    name = "torch-naive"
    capabilities = Capabilities(
        frameworks=frozenset({Framework.TORCH}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        devices=frozenset({"cpu", "cuda"}),
        features=ALL_FEATURES,
        description="the contract written literally; materialises (Lq, Lk) scores; the float64 oracle",
    )

    def available(self) -> list[str]:
        return []

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        return capability_reasons(self.capabilities, spec, problem)

    def forward(
        self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            out, lse = oracle_attention(spec, inputs, compute_dtype(inputs.q.dtype))
        return out.to(inputs.q.dtype), lse.float()

    def backward(
        self,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        *,
        need_dbias: bool,
    ) -> Gradients:
        dtype = compute_dtype(inputs.q.dtype)
        with torch.enable_grad():
            leaves = [inputs.q.detach().to(dtype), inputs.k.detach().to(dtype), inputs.v.detach().to(dtype)]
            bias = inputs.bias.detach().to(dtype) if inputs.bias is not None else None
            if bias is not None:
                leaves.append(bias)
            for leaf in leaves:
                leaf.requires_grad_(True)
            recomputed = AttentionInputs(
                leaves[0], leaves[1], leaves[2], inputs.mask, bias, inputs.q_lengths, inputs.kv_lengths
            )
            out_again, lse_again = oracle_attention(spec, recomputed, dtype)
            outputs, cotangents = [out_again], [dout.to(dtype)]
            if dlse is not None:
                # −inf rows have no dependence on the inputs; keep their cotangent out of the graph.
                outputs.append(torch.where(torch.isfinite(lse_again), lse_again, torch.zeros_like(lse_again)))
                cotangents.append(dlse.to(dtype))
            found = torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(found, leaves)]
        return Gradients(
            dq=grads[0].to(inputs.q.dtype),
            dk=grads[1].to(inputs.k.dtype),
            dv=grads[2].to(inputs.v.dtype),
            dbias=grads[3].to(inputs.bias.dtype) if bias is not None else None,
        )
