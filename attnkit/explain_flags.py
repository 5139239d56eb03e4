"""``attnkit explain``'s flags as the AttentionSpec and Problem they describe (the flags are defined in
attnkit/cli.py); bad combinations end in ``parser.error``, as argparse's own checks do."""

from __future__ import annotations

import argparse
from typing import Any

from attnkit.backend import Framework, Problem
from attnkit.spec import AttentionSpec


def window_side(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"window side {text!r} must be an integer >= 0 or 'none'") from None


def spec_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> AttentionSpec:
    spec_flags = (args.causal, args.causal_alignment, args.window, args.scale, args.variant, args.softcap, args.layout)
    flag_given = any(value is not None for value in spec_flags)
    try:
        if args.spec is not None:
            if flag_given:
                parser.error("--spec cannot be combined with --causal/--window/--scale/--variant/--softcap/--layout")
            return AttentionSpec.model_validate_json(args.spec)
        fields: dict[str, Any] = {
            "causal": bool(args.causal),
            "window": tuple(args.window) if args.window is not None else None,
            "scale": args.scale,
            "softcap": args.softcap,
        }
        for name, value in (
            ("causal_alignment", args.causal_alignment),
            ("variant", args.variant),
            ("layout", args.layout),
        ):
            if value is not None:
                fields[name] = value
        return AttentionSpec(**fields)
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        parser.error(f"invalid spec: {error}")
    raise AssertionError("unreachable")


def problem_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Problem:
    heads_kv = args.heads_kv if args.heads_kv is not None else args.heads_q
    # Empty sequences are valid calls (every row then sees no key); empty batches, heads or head dims are not.
    minimum = {"batch": 1, "heads_q": 1, "head_dim": 1, "len_q": 0, "len_k": 0, "head_dim_v": 1}
    for name, low in minimum.items():
        value = getattr(args, name)
        if value is not None and value < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}")
    if heads_kv < 1 or args.heads_q % heads_kv:
        parser.error(f"--heads-q={args.heads_q} must be a multiple of --heads-kv={heads_kv}")
    return Problem(
        framework=Framework(args.framework),
        device=args.device,
        dtype=args.dtype,
        batch=args.batch,
        heads_q=args.heads_q,
        heads_kv=heads_kv,
        len_q=args.len_q,
        len_k=args.len_k if args.len_k is not None else args.len_q,
        head_dim=args.head_dim,
        head_dim_v=args.head_dim_v if args.head_dim_v is not None else args.head_dim,
        has_mask=args.mask,
        has_bias=args.bias or args.bias_grad,
        has_q_lengths=args.q_lengths,
        has_kv_lengths=args.kv_lengths,
        needs_grad=args.grad or args.bias_grad,
        needs_bias_grad=args.bias_grad,
        return_lse=args.lse,
    )
