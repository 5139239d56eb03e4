"""Decoding with a paged KV cache: attnkit.attend_paged and a block table (torch, inference).

The decode loop of examples/decode_growing_cache.py, with the keys and values in a pool of fixed-size blocks
(num_blocks, block_size, kv heads, head_dim) shared by every sequence, as vLLM and flash-attn's
``flash_attn_with_kvcache(block_table=...)`` keep them. Sequence b's keys are, in order, the slots of blocks
block_table[b, 0], block_table[b, 1], ...; a sequence takes a new block from the free pool only when its last one
is full, and blocks need not be contiguous or in order (here the pool hands them out shuffled). Entries past a
sequence's last block are never read (-1 here). See docs/semantics.md §13.

    python examples/decode_paged_cache.py [--batch 4] [--prompt 512] [--new-tokens 64] [--block-size 16]

Each step is checked against the same sequences kept in ordinary contiguous tensors, attended by torch's
scaled_dot_product_attention.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import attnkit

SPEC = attnkit.AttentionSpec(causal=True, layout="bshd")  # q: (batch, seq, heads, head_dim)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="sequences (default %(default)s)")
    parser.add_argument("--prompt", type=int, default=512, help="longest prompt, others shorter (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps (default %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="keys per cache block (default %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (default %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default %(default)s)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim (default %(default)s)")
    return parser.parse_args(argv)


class PagedCache:
    """Keys and values in blocks of a shared pool, and each sequence's block table."""

    def __init__(self, batch: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> None:
        self.block_size = block_size
        self.k = torch.empty(num_blocks, block_size, kv_heads, head_dim)
        self.v = torch.empty(num_blocks, block_size, kv_heads, head_dim)
        self.free = torch.randperm(num_blocks).tolist()  # any order: a block's place in the pool does not matter
        self.block_table = torch.full((batch, num_blocks), -1, dtype=torch.int32)
        self.lengths = torch.zeros(batch, dtype=torch.int32)

    def append(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes (n, Hkv, D) keys and values after sequence b's last one, taking blocks from the pool as needed."""
        for key, value in zip(k, v):
            position = int(self.lengths[b])
            index, slot = divmod(position, self.block_size)
            if slot == 0:  # the sequence's last block is full (or it has none yet)
                self.block_table[b, index] = self.free.pop()
            block = self.block_table[b, index]
            self.k[block, slot], self.v[block, slot] = key, value
            self.lengths[b] += 1


@torch.no_grad()
def main(argv: list[str] | None = None) -> float:
    """Returns the largest difference from the contiguous reference, relative to its largest magnitude."""
    args = arguments(argv)
    torch.manual_seed(0)
    batch, heads, kv_heads, head_dim = args.batch, args.heads, args.kv_heads, args.head_dim
    prompt_lengths = torch.linspace(args.prompt, max(1, args.prompt // 2), batch).long().tolist()
    blocks_per_sequence = -(-(args.prompt + args.new_tokens) // args.block_size)
    cache = PagedCache(batch, batch * blocks_per_sequence, args.block_size, kv_heads, head_dim)

    # The contiguous copy of every sequence's keys and values, for the check only.
    contiguous_k: list[torch.Tensor] = []
    contiguous_v: list[torch.Tensor] = []

    # Prefill: each prompt's keys and values go into the pool (in a model they come from the prompt's forward).
    for b, length in enumerate(prompt_lengths):
        k, v = torch.randn(2, length, kv_heads, head_dim).unbind(0)
        cache.append(b, k, v)
        contiguous_k.append(k)
        contiguous_v.append(v)

    error = 0.0
    for _ in range(args.new_tokens):
        # One new token per sequence: its query, and its key and value appended to the cache first.
        q = torch.randn(batch, 1, heads, head_dim)
        new_k, new_v = torch.randn(2, batch, kv_heads, head_dim).unbind(0)
        for b in range(batch):
            cache.append(b, new_k[b : b + 1], new_v[b : b + 1])
            contiguous_k[b] = torch.cat([contiguous_k[b], new_k[b : b + 1]])
            contiguous_v[b] = torch.cat([contiguous_v[b], new_v[b : b + 1]])
        # The table may be cut to the blocks the longest sequence uses; its shape can also stay fixed.
        used_blocks = -(-int(cache.lengths.max()) // args.block_size)
        out = attnkit.attend_paged(SPEC, q, cache.k, cache.v, cache.block_table[:, :used_blocks], cache.lengths)

        for b in range(batch):  # the one query sees its whole sequence: no mask needed for SDPA
            k, v = (t.transpose(0, 1)[None] for t in (contiguous_k[b], contiguous_v[b]))  # (1, Hkv, L, D)
            expected = F.scaled_dot_product_attention(q[b : b + 1].transpose(1, 2), k, v, enable_gqa=True)
            expected = expected.transpose(1, 2)[0]
            error = max(error, ((out[b] - expected).abs().max() / expected.abs().max()).item())

    print(f"{batch} sequences, prompts {prompt_lengths} + {args.new_tokens} decode steps each, "
          f"blocks of {args.block_size} keys")  # fmt: skip
    print(f"block table of sequence 0 (its first 8 blocks): {cache.block_table[0, :8].tolist()}")
    print(f"largest difference from contiguous attention: {error:.2e} (relative)")
    if error > 1e-5:
        raise SystemExit(f"the paged cache and the contiguous one disagree: {error:.2e}")
    return error


if __name__ == "__main__":
    main()
