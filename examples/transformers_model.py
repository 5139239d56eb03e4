"""A Hugging Face transformers model with attn_implementation="attnkit".

Importing attnkit.integrations.transformers registers "attnkit" as an attention implementation; every attention
layer of the model then calls attnkit.attend, with GQA read without repeating the kv heads and padding passed as
lengths or segment ids rather than as a mask (docs/integrations.md). A small Llama is built here from a config with
random weights (no download), then:

* the logits of a left-padded batch are compared with transformers' own "eager" and "sdpa" attention;
* greedy generate() (a KV cache growing one token a step) is compared with "sdpa", token for token.

    python examples/transformers_model.py [--layers 4] [--hidden 256] [--length 64] [--new-tokens 16]

A pretrained model works the same way:
``AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnkit")``.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import attnkit.integrations.transformers  # noqa: F401  # registers attn_implementation="attnkit"


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (default %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default %(default)s)")
    parser.add_argument("--vocab", type=int, default=1000, help="vocabulary size (default %(default)s)")
    parser.add_argument("--batch", type=int, default=3, help="prompts (default %(default)s)")
    parser.add_argument("--length", type=int, default=64, help="longest prompt (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generate() adds (default %(default)s)")
    return parser.parse_args(argv)


@torch.no_grad()
def main(argv: list[str] | None = None) -> float:
    """Returns the largest logit difference from "eager" and "sdpa", relative to the logits' largest magnitude."""
    args = arguments(argv)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.length + args.new_tokens, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()

    # Prompts of different lengths, left-padded (as generate() wants them): 0 in attention_mask marks padding.
    ids = torch.randint(1, args.vocab, (args.batch, args.length))
    attention_mask = torch.ones_like(ids)
    for b in range(1, args.batch):
        attention_mask[b, : b * args.length // (2 * args.batch)] = 0
    ids = ids.masked_fill(attention_mask == 0, config.pad_token_id)
    real = attention_mask.bool()  # logits at padded positions mean nothing in any implementation

    logits = {}
    for implementation in ("attnkit", "eager", "sdpa"):
        model.set_attn_implementation(implementation)
        logits[implementation] = model(ids, attention_mask=attention_mask).logits[real]
    error = 0.0
    for other in ("eager", "sdpa"):
        difference = (logits["attnkit"] - logits[other]).abs().max() / logits[other].abs().max()
        print(f"logits against {other!r}: largest difference {difference:.2e} (relative)")
        error = max(error, difference.item())

    generated = {}
    for implementation in ("attnkit", "sdpa"):
        model.set_attn_implementation(implementation)
        generated[implementation] = model.generate(
            ids, attention_mask=attention_mask, max_new_tokens=args.new_tokens, do_sample=False
        )[:, args.length :]
    same = torch.equal(generated["attnkit"], generated["sdpa"])
    print(f"generate(), {args.new_tokens} greedy tokens: {'the same' if same else 'different'} tokens as 'sdpa'")
    print(f"first prompt's tokens: {generated['attnkit'][0].tolist()}")

    if error > 1e-4 or not same:
        raise SystemExit(f"attnkit and transformers' attention disagree: {error:.2e}, same tokens: {same}")
    return error


if __name__ == "__main__":
    main()
