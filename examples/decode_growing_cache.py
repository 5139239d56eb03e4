"""Decoding with a KV cache that grows by one key a step (torch, inference).

A batch of prompts of different lengths goes through one attention layer: a prefill over the prompts, then a
decode loop where each sequence adds one query and one key/value per step. The keys live in one preallocated cache
(batch, capacity, kv heads, head_dim); every step writes each sequence's new key at its own position and attends
over the view cache[:, :longest] with ``kv_lengths`` giving each sequence's length:

* no copy and no reallocation of the cache, and no (Lq, Lk) mask: the lengths hide the slots not written yet;
* bottom-right causal alignment (attnkit's default) puts the one new query at its sequence's last key, so it sees
  the whole sequence so far (docs/semantics.md §4.3);
* attnkit remembers how it served a call by its length class, so a view one key longer each step is not validated
  and dispatched again (docs/performance.md, "Decode step cost").

    python examples/decode_growing_cache.py [--batch 4] [--prompt 512] [--new-tokens 64]

Each output is checked against a full recompute: torch's scaled_dot_product_attention over each sequence's
whole history with a causal mask.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import attnkit

SPEC = attnkit.AttentionSpec(causal=True, layout="bshd")  # (batch, seq, heads, head_dim)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="sequences (default %(default)s)")
    parser.add_argument("--prompt", type=int, default=512, help="longest prompt, others shorter (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps (default %(default)s)")
    parser.add_argument("--dim", type=int, default=512, help="model width (default %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (default %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default %(default)s)")
    return parser.parse_args(argv)


@torch.no_grad()
def main(argv: list[str] | None = None) -> float:
    """Returns the largest difference from the full recompute, relative to the outputs' largest magnitude."""
    args = arguments(argv)
    torch.manual_seed(0)
    batch, heads, kv_heads, head_dim = args.batch, args.heads, args.kv_heads, args.dim // args.heads
    project_q = torch.nn.Linear(args.dim, args.dim, bias=False)
    project_kv = torch.nn.Linear(args.dim, 2 * kv_heads * head_dim, bias=False)

    def qkv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, L, dim) hidden states -> q (B, L, Hq, D), k and v (B, L, Hkv, D)."""
        k, v = project_kv(x).unflatten(-1, (2, kv_heads, head_dim)).unbind(2)
        return project_q(x).unflatten(-1, (heads, head_dim)), k, v

    # Prompt lengths from args.prompt down to about half of it; each sequence's hidden states for every position it
    # will reach (in a model these would come from the previous layer, one new token at a time).
    prompt_lengths = torch.linspace(args.prompt, max(1, args.prompt // 2), batch).long()
    total = args.prompt + args.new_tokens
    hidden = torch.randn(batch, total, args.dim)

    capacity = total  # preallocated once; unwritten slots are never read, so empty() is fine
    k_cache = torch.empty(batch, capacity, kv_heads, head_dim)
    v_cache = torch.empty(batch, capacity, kv_heads, head_dim)

    # Prefill: the prompts right-padded to the longest. Passing the lengths as both q_lengths and kv_lengths makes
    # every sequence causal over its own tokens; the padded query rows output 0 (docs/semantics.md §4.3 (b)).
    q, k, v = qkv(hidden[:, : args.prompt])
    prefill = attnkit.attend(SPEC, q, k, v, q_lengths=prompt_lengths, kv_lengths=prompt_lengths)
    k_cache[:, : args.prompt], v_cache[:, : args.prompt] = k, v  # pad slots too: kv_lengths hides them
    outputs = [[prefill[b, : prompt_lengths[b]]] for b in range(batch)]

    lengths = prompt_lengths.clone()
    rows = torch.arange(batch)
    for _ in range(args.new_tokens):
        q, k, v = qkv(hidden[rows, lengths].unsqueeze(1))  # each sequence's next position: (B, 1, ...)
        k_cache[rows, lengths], v_cache[rows, lengths] = k[:, 0], v[:, 0]  # written at each sequence's own end
        lengths += 1
        longest = int(lengths.max())
        out = attnkit.attend(SPEC, q, k_cache[:, :longest], v_cache[:, :longest], kv_lengths=lengths)
        for b in range(batch):
            outputs[b].append(out[b])

    # The full recompute: each sequence's whole history at once, causal, by torch's own attention.
    error = 0.0
    for b in range(batch):
        q, k, v = (t.transpose(1, 2) for t in qkv(hidden[b : b + 1, : lengths[b]]))  # bhsd for SDPA
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)[0]
        got = torch.cat(outputs[b])
        error = max(error, ((got - expected).abs().max() / expected.abs().max()).item())
    print(f"{batch} sequences, prompts {prompt_lengths.tolist()} + {args.new_tokens} decode steps each")
    print(f"largest difference from a full recompute: {error:.2e} (relative)")
    if error > 1e-5:
        raise SystemExit(f"decode and the full recompute disagree: {error:.2e}")
    return error


if __name__ == "__main__":
    main()
