"""A custom mask written as a function: ``mask_mod=`` (torch).

A mask program is FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool``: True where query q_idx of batch row b
may see key kv_idx. attnkit traces it once into integer arithmetic and reads of the tensors it closes over, and the
kernel backends evaluate it in their tiles, skipping the tiles it hides whole: no (L, L) mask is built
(docs/semantics.md §17). Here each batch row packs several documents, and two patterns are combined with the
document mask:

* ``prefix-lm``: each document starts with a prefix its tokens all see (bidirectional), then is causal;
* ``chunked``: causal inside chunks of --chunk tokens counted from each document's start (Llama 4's chunked
  attention, per document).

    python examples/custom_mask.py [--pattern prefix-lm|chunked] [--batch 2] [--length 1024] [--chunk 128]

The output is checked against torch's scaled_dot_product_attention with a dense boolean mask, built block by block
from the documents rather than from the function.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import attnkit

SPEC = attnkit.AttentionSpec()  # the whole pattern is in the program; "bhsd" layout: (batch, heads, seq, head_dim)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", choices=["prefix-lm", "chunked"], default="prefix-lm")
    parser.add_argument("--batch", type=int, default=2, help="batch rows (default %(default)s)")
    parser.add_argument("--length", type=int, default=1024, help="tokens per row (default %(default)s)")
    parser.add_argument("--documents", type=int, default=4, help="documents per row (default %(default)s)")
    parser.add_argument("--chunk", type=int, default=128, help="chunk of the chunked pattern (default %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (default %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default %(default)s)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim (default %(default)s)")
    return parser.parse_args(argv)


def document_bounds(length: int, documents: int, generator: torch.Generator) -> list[tuple[int, int, int]]:
    """(start, end, prefix length) of each document of a row: random cuts, a random prefix of each."""
    cuts = sorted(torch.randperm(length - 1, generator=generator)[: documents - 1].add(1).tolist())
    bounds = []
    for start, end in zip([0, *cuts], [*cuts, length]):
        prefix = int(torch.randint(0, end - start + 1, (1,), generator=generator))
        bounds.append((start, end, prefix))
    return bounds


def main(argv: list[str] | None = None) -> float:
    """Returns the largest difference from the dense-mask reference, relative to its largest magnitude."""
    args = arguments(argv)
    generator = torch.Generator().manual_seed(0)
    rows = [document_bounds(args.length, args.documents, generator) for _ in range(args.batch)]

    # What the program reads, one integer per position: its document, where that document starts, and where its
    # prefix ends (an absolute position).
    document = torch.zeros(args.batch, args.length, dtype=torch.int32)
    start = torch.zeros(args.batch, args.length, dtype=torch.int32)
    prefix_end = torch.zeros(args.batch, args.length, dtype=torch.int32)
    for b, bounds in enumerate(rows):
        for index, (first, end, prefix) in enumerate(bounds):
            document[b, first:end], start[b, first:end], prefix_end[b, first:end] = index, first, first + prefix
    chunk = args.chunk

    def prefix_lm(b, h, q_idx, kv_idx):
        same_document = document[b, q_idx] == document[b, kv_idx]
        return same_document & ((kv_idx <= q_idx) | (kv_idx < prefix_end[b, q_idx]))

    def chunked(b, h, q_idx, kv_idx):
        same_document = document[b, q_idx] == document[b, kv_idx]
        same_chunk = (q_idx - start[b, q_idx]) // chunk == (kv_idx - start[b, kv_idx]) // chunk
        return same_document & same_chunk & (kv_idx <= q_idx)

    mask_mod = prefix_lm if args.pattern == "prefix-lm" else chunked

    torch.manual_seed(0)
    q = torch.randn(args.batch, args.heads, args.length, args.head_dim)
    k = torch.randn(args.batch, args.kv_heads, args.length, args.head_dim)
    v = torch.randn(args.batch, args.kv_heads, args.length, args.head_dim)
    out = attnkit.attend(SPEC, q, k, v, mask_mod=mask_mod)
    chosen = next(line for line in attnkit.explain(SPEC, q, k, v, mask_mod=mask_mod).splitlines() if "->" in line)
    print(f"auto's choice, as attnkit.explain gives it: {chosen.removeprefix('->').strip()}")

    # The reference's dense mask, written block by block: every query sees its own document's keys up to itself;
    # prefix-lm adds its document's prefix, chunked keeps only its own chunk.
    dense = torch.zeros(args.batch, 1, args.length, args.length, dtype=torch.bool)
    for b, bounds in enumerate(rows):
        for first, end, prefix in bounds:
            if args.pattern == "prefix-lm":
                dense[b, 0, first:end, first:end] = torch.ones(end - first, end - first, dtype=torch.bool).tril()
                dense[b, 0, first:end, first : first + prefix] = True
            else:
                for chunk_start in range(first, end, chunk):
                    chunk_end = min(chunk_start + chunk, end)
                    size = chunk_end - chunk_start
                    dense[b, 0, chunk_start:chunk_end, chunk_start:chunk_end] = torch.ones(size, size).tril().bool()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)

    error = ((out - expected).abs().max() / expected.abs().max()).item()
    print(f"{args.pattern}, {args.batch} rows of {args.documents} documents, {args.length} tokens each: "
          f"{dense.float().mean().item():.1%} of the (query, key) pairs visible")  # fmt: skip
    print(f"largest difference from the dense-mask reference: {error:.2e} (relative)")
    if error > 1e-5:
        raise SystemExit(f"the mask program and the dense mask disagree: {error:.2e}")
    return error


if __name__ == "__main__":
    main()
