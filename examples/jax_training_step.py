"""Training a small causal language model whose attention is attnkit.attend (JAX, under jax.jit).

The same model as examples/torch_training_step.py: one transformer block with causal grouped-query attention,
learning a fixed batch of random tokens by heart. The whole step (forward, jax.grad, a plain SGD update) is one
jax.jit function: attnkit.attend traces like any JAX function.

    python examples/jax_training_step.py [--steps 20] [--batch 8] [--length 256]

The first step's gradients are checked against the same model with its attention written out in jax.numpy (kv
heads repeated, a causal mask, softmax).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attnkit

Params = dict[str, jax.Array]  # the model's weights by name

# Layout "bshd": the projections give (batch, seq, heads, head_dim) with no transpose.
SPEC = attnkit.AttentionSpec(causal=True, layout="bshd")


def attnkit_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return attnkit.attend(SPEC, q, k, v)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The attention of SPEC written out in jax.numpy: the check's independent reference."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)  # query head h reads kv head h // groups
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), dtype=bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def init_params(rng: np.random.Generator, vocab: int, dim: int, heads: int, kv_heads: int) -> Params:
    """Random weights scaled by 1/sqrt(fan-in), drawn by numpy (jax.random would do as well, at one more compile)."""
    kv_dim = 2 * kv_heads * (dim // heads)  # fewer kv heads than query heads: GQA
    shapes = {"embed": (vocab, dim), "q": (dim, dim), "kv": (dim, kv_dim), "out": (dim, dim),
              "up": (dim, 4 * dim), "down": (4 * dim, dim), "head": (dim, vocab)}  # fmt: skip
    return {name: jnp.asarray(rng.standard_normal(shape, dtype=np.float32) / shape[0] ** 0.5)
            for name, shape in shapes.items()}  # fmt: skip


def layer_norm(x: jax.Array) -> jax.Array:
    return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)


def forward(params: Params, tokens: jax.Array, heads: int, kv_heads: int, attention: Any) -> jax.Array:
    x = params["embed"][tokens]  # (B, L, dim)
    batch, length, dim = x.shape
    head_dim = dim // heads
    h = layer_norm(x)
    q = (h @ params["q"]).reshape(batch, length, heads, head_dim)
    k, v = jnp.split((h @ params["kv"]).reshape(batch, length, 2 * kv_heads, head_dim), 2, axis=2)
    x = x + attention(q, k, v).reshape(batch, length, dim) @ params["out"]
    x = x + jax.nn.gelu(layer_norm(x) @ params["up"]) @ params["down"]
    return layer_norm(x) @ params["head"]


def loss_of(params: Params, tokens: jax.Array, heads: int, kv_heads: int, attention: Any) -> jax.Array:
    """Next-token cross-entropy: position i predicts token i + 1."""
    logits = forward(params, tokens[:, :-1], heads, kv_heads, attention)
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1).mean()


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps (default %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch (default %(default)s)")
    parser.add_argument("--length", type=int, default=256, help="tokens per sequence (default %(default)s)")
    parser.add_argument("--dim", type=int, default=256, help="model width (default %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (default %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default %(default)s)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size (default %(default)s)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default %(default)s)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> tuple[list[float], float]:
    """Returns the loss of every step and the check's largest relative gradient difference."""
    args = arguments(argv)
    rng = np.random.default_rng(0)
    params = init_params(rng, args.vocab, args.dim, args.heads, args.kv_heads)
    tokens = jnp.asarray(rng.integers(0, args.vocab, (args.batch, args.length + 1)))

    # One step: forward, gradients and the SGD update in one compiled function. heads, kv_heads, the attention
    # function and the learning rate are static: they decide the shapes and the traced code.
    @functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
    def train_step(params: Params, tokens: jax.Array, heads: int, kv_heads: int, attention: Any, lr: float) -> Any:
        loss, grads = jax.value_and_grad(loss_of)(params, tokens, heads, kv_heads, attention)
        return loss, grads, jax.tree.map(lambda p, g: p - lr * g, params, grads)  # plain SGD

    shape = (args.heads, args.kv_heads)
    _, reference_grads, _ = train_step(params, tokens, *shape, reference_attention, args.lr)
    losses = []
    for step in range(args.steps):
        loss, grads, params = train_step(params, tokens, *shape, attnkit_attention, args.lr)
        if step == 0:  # the check: the first step's gradients, each parameter's relative to its largest
            pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(reference_grads))
            error = max(float(np.abs(ours - theirs).max() / np.abs(theirs).max()) for ours, theirs in pairs)
            print(f"first step against attention in jax.numpy: largest relative gradient difference {error:.2e}")
            if error > 1e-4:
                raise SystemExit(f"attnkit and the reference disagree: {error:.2e}")
        losses.append(float(loss))
        print(f"step {step}: loss {float(loss):.4f}")
    if args.steps > 1 and not losses[-1] < losses[0]:
        raise SystemExit(f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses, error


if __name__ == "__main__":
    main()
