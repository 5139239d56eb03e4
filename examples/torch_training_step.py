"""Training a small causal language model whose attention is attnkit.attend (torch).

One transformer block with causal grouped-query attention (GQA: several query heads share each key/value head, and
attnkit reads the shared heads without repeating them), trained with AdamW on a fixed batch of random tokens, which
it learns by heart: the loss falls step by step.

    python examples/torch_training_step.py [--steps 20] [--batch 8] [--length 256] [--dropout 0.1]

Before training, one step's gradients are checked against the same model with its attention written
out in plain torch (kv heads repeated, a causal mask, softmax, and with --dropout the keep-mask that
attnkit.dropout_keep_mask gives for the seed: every attnkit backend drops the same probabilities).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit

# Layout "bshd": the projections give (batch, seq, heads, head_dim) with no transpose. Causal aligns bottom-right
# (docs/semantics.md §4.1), the same as top-left here since queries and keys have one length.
SPEC = attnkit.AttentionSpec(causal=True, layout="bshd")
CHECK_SEED = 1234  # the dropout seed of the check: the same keep-mask for attnkit and the reference


def reference_attend(spec, q, k, v, dropout_p=0.0, dropout_seed=None):
    """The attention of SPEC written out in plain torch: the check's independent reference."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # bshd -> bhsd
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # query head h reads kv head h // G
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    if dropout_p:
        keep = attnkit.dropout_keep_mask(dropout_seed, dropout_p, *probs.shape)  # (B, Hq, Lq, Lk) numpy booleans
        probs = probs * torch.from_numpy(keep) / (1 - dropout_p)
    return (probs @ v).transpose(1, 2)


class Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, dropout_p: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)  # fewer kv heads: GQA
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.dropout_p = dropout_p
        self.attend: Callable[..., torch.Tensor] = attnkit.attend  # the check swaps in reference_attend
        self.dropout_seed: int | None = None  # None: attnkit draws a seed from torch's generator on every call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).unflatten(-1, (self.heads, self.head_dim))  # (B, L, Hq, D)
        k, v = self.kv(x).unflatten(-1, (2, self.kv_heads, self.head_dim)).unbind(2)  # (B, L, Hkv, D) each
        dropout_p = self.dropout_p if self.training else 0.0
        out = self.attend(SPEC, q, k, v, dropout_p=dropout_p, dropout_seed=self.dropout_seed)
        return self.out(out.flatten(2))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, kv_heads: int, dropout_p: float) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm1, self.norm2, self.norm_out = (torch.nn.LayerNorm(dim) for _ in range(3))
        self.attention = Attention(dim, heads, kv_heads, dropout_p)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.attention(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return self.head(self.norm_out(x))


def loss_of(model: TinyLM, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position i predicts token i + 1."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def check_against_reference(model: TinyLM, tokens: torch.Tensor) -> float:
    """The largest difference of one step's gradients between attnkit and the reference, each parameter's relative
    to its largest gradient."""
    reference = copy.deepcopy(model)
    reference.attention.attend = reference_attend
    errors = []
    for one in (model, reference):
        one.attention.dropout_seed = CHECK_SEED
        one.zero_grad()
        loss_of(one, tokens).backward()
        one.attention.dropout_seed = None
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        errors.append(((ours.grad - theirs.grad).abs().max() / theirs.grad.abs().max()).item())
    model.zero_grad()
    return max(errors)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps (default %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch (default %(default)s)")
    parser.add_argument("--length", type=int, default=256, help="tokens per sequence (default %(default)s)")
    parser.add_argument("--dim", type=int, default=256, help="model width (default %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (default %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default %(default)s)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size (default %(default)s)")
    parser.add_argument("--dropout", type=float, default=0.0, help="attention dropout_p (default %(default)s)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> tuple[list[float], float]:
    """Returns the loss of every step and the check's largest relative gradient difference."""
    args = arguments(argv)
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.heads, args.kv_heads, args.dropout)
    tokens = torch.randint(args.vocab, (args.batch, args.length + 1))

    error = check_against_reference(model, tokens)
    print(f"first step against plain torch attention: largest relative gradient difference {error:.2e}")
    if error > 1e-4:
        raise SystemExit(f"attnkit and the reference disagree: {error:.2e}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step}: loss {loss.item():.4f}")
    if args.steps > 1 and not losses[-1] < losses[0]:
        raise SystemExit(f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses, error


if __name__ == "__main__":
    main()
