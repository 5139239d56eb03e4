"""Packed documents: many sequences of different lengths in one tensor, with no padding and no mask (torch).

Training on short documents packs them end to end. Attention must then stay inside each document, and attnkit
takes that in either of two forms (docs/semantics.md §12 and §4.5):

* attend_varlen: q, k, v as (total_tokens, heads, head_dim) with flash-attn's cumulative offsets ``cu_seqlens``
  (document s is tokens cu_seqlens[s] to cu_seqlens[s + 1] - 1);
* attend with segment ids: one packed row (1, total_tokens, heads, head_dim) and each token's document id; ids
  compose with every other clause (here causal: causal inside each document), and -1 marks padding.

Neither builds a (total, total) mask, and kernels skip the blocks between documents.

    python examples/packed_documents.py [--documents 16] [--longest 512] [--heads 8] [--kv-heads 2]

Both are checked, outputs and gradients, against one call of torch's scaled_dot_product_attention per document.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import attnkit

SPEC = attnkit.AttentionSpec(causal=True, layout="bshd")  # attend_varlen's packed layout is fixed; bshd for attend


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=16, help="documents packed (default %(default)s)")
    parser.add_argument("--longest", type=int, default=512, help="longest document (default %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (default %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default %(default)s)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim (default %(default)s)")
    return parser.parse_args(argv)


def relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def main(argv: list[str] | None = None) -> float:
    """Returns the largest difference, outputs and gradients, from the per-document calls, relative to each
    tensor's largest magnitude."""
    args = arguments(argv)
    torch.manual_seed(0)
    lengths = torch.randint(1, args.longest + 1, (args.documents,))
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()  # [0, l0, l0 + l1, ...], int32
    total = int(cu_seqlens[-1])
    q = torch.randn(total, args.heads, args.head_dim, requires_grad=True)
    k = torch.randn(total, args.kv_heads, args.head_dim, requires_grad=True)
    v = torch.randn(total, args.kv_heads, args.head_dim, requires_grad=True)
    # A fixed random weighting of the outputs, so that each gradient depends on every output element.
    weights = torch.randn(total, args.heads, args.head_dim)

    def gradients(out: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.autograd.grad((out * weights).sum(), (q, k, v)))

    # 1. attend_varlen, flash-attn's layout.
    varlen = attnkit.attend_varlen(SPEC, q, k, v, cu_seqlens, cu_seqlens)

    # 2. The same documents as segment ids of one packed row: document s's tokens carry id s.
    document_ids = torch.repeat_interleave(torch.arange(args.documents), lengths)[None]  # (1, total)
    segments = attnkit.attend(SPEC, q[None], k[None], v[None], q_segment_ids=document_ids,
                              kv_segment_ids=document_ids)[0]  # fmt: skip

    # The reference: each document on its own, causal, by torch's own attention.
    pieces = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        one_q, one_k, one_v = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # (1, H, L, D)
        out = F.scaled_dot_product_attention(one_q, one_k, one_v, is_causal=True, enable_gqa=True)
        pieces.append(out[0].transpose(0, 1))
    expected = torch.cat(pieces)

    error = 0.0
    expected_gradients = gradients(expected)
    for name, out in (("attend_varlen", varlen), ("segment ids", segments)):
        differences = [relative_difference(out, expected)]
        differences += [relative_difference(*pair) for pair in zip(gradients(out), expected_gradients)]
        print(f"{name}: largest difference from per-document calls {max(differences):.2e} (relative; out, dq, dk, dv)")
        error = max(error, *differences)
    print(f"{args.documents} documents of {lengths.min().item()} to {lengths.max().item()} tokens, {total} in all")
    if error > 1e-5:
        raise SystemExit(f"packed attention and the per-document calls disagree: {error:.2e}")
    return error


if __name__ == "__main__":
    main()
