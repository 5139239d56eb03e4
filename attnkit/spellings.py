"""What to write instead of a call spelled as torch SDPA, flash-attn, FlexAttention, jax.nn.dot_product_attention
and their neighbours spell it: the table of their keywords, and the messages of UnexpectedArgumentError.

Only error paths come here: a call that fits attnkit's signature never does. (attnkit.spec's errors come here too,
so this module stands on attnkit.errors alone: the spec's fields are passed in.)
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from attnkit.errors import UnexpectedArgumentError


def _flash_window(size: Any) -> Any:
    """flash-attn's ``window_size=(left, right)`` with −1 for an unbounded side, as attnkit's window."""
    if isinstance(size, tuple | list) and len(size) == 2:
        sides = tuple(None if side == -1 else side for side in size)
        return None if sides == (None, None) else sides
    return size


def _jax_window(size: Any) -> Any:
    """jax.nn's ``local_window_size``: an int w is (w, w)."""
    return (size, size) if isinstance(size, int) else _flash_window(size)


@dataclass(frozen=True)
class Spelling:
    """A keyword another library takes: who spells it so, what attnkit writes instead, and, where its value becomes
    an AttentionSpec field, which one and how (so that a call without a spec can be shown with the spec it needs)."""

    peers: str
    instead: str
    field: str | None = None
    as_field: Callable[[Any], Any] = lambda value: value


#: The keyword-only arguments of attnkit.attend: given to AttentionSpec, the message moves them to the call (attend's
#: signature is not read here: attnkit.spec, which attnkit.api imports, comes here for its messages).
CALL_ARGUMENTS = (
    "mask", "bias", "q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids", "return_lse", "backend", "sinks",
    "alibi_slopes", "mask_mod", "dropout_p", "dropout_seed", "dropout_key",
)  # fmt: skip

_TOP_LEFT = "AttentionSpec(causal=True, causal_alignment='top_left')"

#: Keywords of other attention libraries that attnkit spells otherwise (docs/semantics.md §10 compares them).
PEER_SPELLINGS: dict[str, Spelling] = {
    "is_causal": Spelling(
        "torch SDPA, jax.nn.dot_product_attention",
        "causal is a field of the spec: AttentionSpec(causal=True). Theirs aligns the diagonal top-left, attnkit's "
        f"default bottom-right (the same when Lq == Lk): {_TOP_LEFT} for theirs when Lq != Lk",
        "causal",
    ),
    "softmax_scale": Spelling("flash-attn", "the spec's scale: AttentionSpec(scale=...)", "scale"),
    "sm_scale": Spelling("Triton tutorials, FlashInfer", "the spec's scale: AttentionSpec(scale=...)", "scale"),
    "window_size": Spelling(
        "flash-attn",
        "the spec's window=(left, right), None for an unbounded side where flash-attn writes -1, aligned as causal "
        "is (bottom-right by default, as flash-attn's)",
        "window",
        _flash_window,
    ),
    "local_window_size": Spelling(
        "jax.nn.dot_product_attention",
        "the spec's window=(left, right), an int w being (w, w); jax.nn aligns its window top-left: add "
        "causal_alignment='top_left' for theirs when Lq != Lk",
        "window",
        _jax_window,
    ),
    "sliding_window": Spelling(
        "Hugging Face transformers",
        "the spec's window: sliding_window=N holds N keys, the query's own included, which is "
        "AttentionSpec(causal=True, window=(N - 1, 0))",
        "window",
        lambda size: (size - 1, 0) if isinstance(size, int) else size,
    ),
    "logits_soft_cap": Spelling("FlashInfer", "the spec's softcap: AttentionSpec(softcap=...)", "softcap"),
    "attn_mask": Spelling(
        "torch SDPA",
        "a boolean mask (True = may attend, as SDPA's) goes in mask=; a float one, added to the scores, in bias=",
    ),
    "attn_bias": Spelling(
        "xformers",
        "a tensor added to the scores goes in bias=; a mask class becomes the spec: LowerTriangularMask is "
        f"{_TOP_LEFT}, LowerTriangularFromBottomRightMask AttentionSpec(causal=True)",
    ),
    "key_padding_mask": Spelling(
        "torch.nn.MultiheadAttention",
        "right padding is kv_lengths= (the number of real keys per batch element); or mask=, whose True means may "
        "attend (key_padding_mask's True means ignore)",
    ),
    "enable_gqa": Spelling(
        "torch SDPA",
        "not needed: attnkit reads grouped-query attention from the shapes (Hq a multiple of Hkv; query head h uses "
        "key/value head h // (Hq / Hkv))",
    ),
    "block_mask": Spelling(
        "FlexAttention",
        "pass the mask_mod function itself as mask_mod= (attnkit skips empty tiles on its own; there is no block "
        "mask to create)",
    ),
    "score_mod": Spelling(
        "FlexAttention",
        "attnkit takes no score function: the spec's softcap, alibi_slopes=, bias= and sinks= are the common "
        "ones, and a score_mod that only hides scores is a mask_mod=",
    ),
    "return_attn_probs": Spelling(
        "flash-attn", "return_lse=True returns (out, lse); attnkit does not return the probability matrix"
    ),
    "return_softmax": Spelling(
        "flash-attn", "return_lse=True returns (out, lse); attnkit does not return the probability matrix"
    ),
    "query_seq_lengths": Spelling("jax.nn.dot_product_attention", "q_lengths="),
    "key_value_seq_lengths": Spelling("jax.nn.dot_product_attention", "kv_lengths="),
    "cache_seqlens": Spelling("flash-attn", "kv_lengths="),
    "seqused_k": Spelling("flash-attn", "kv_lengths="),
    "segment_ids": Spelling("JAX Pallas splash attention", "q_segment_ids= and kv_segment_ids="),
    "cu_seqlens_q": Spelling(
        "flash-attn", "packed sequences are attnkit.attend_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k)"
    ),
    "cu_seqlens_k": Spelling(
        "flash-attn", "packed sequences are attnkit.attend_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k)"
    ),
    "implementation": Spelling(
        "jax.nn.dot_product_attention",
        'backend= ("auto", or a name from attnkit.registered_backends(); attnkit.explain shows the choice)',
    ),
    "deterministic": Spelling(
        "flash-attn",
        "attnkit takes no per-call flag: a backend with a faster, non-deterministic backward declares the option "
        "deterministic (backend_options in attnkit.configure or a config file), and "
        "torch.use_deterministic_algorithms(True) selects the deterministic one",
    ),
    "dropout_rate": Spelling("Flax", "dropout_p="),
    "dropout_rng": Spelling("Flax", "dropout_key= (a JAX PRNG key), or dropout_seed= (an int)"),
    "p": Spelling("xformers", "dropout_p="),
    "need_weights": Spelling(
        "torch.nn.MultiheadAttention", "return_lse=True returns (out, lse); attnkit does not return the weights"
    ),
}


def _shown(value: Any) -> str:
    """A value as a message shows it: a tensor by its type and shape, never its elements."""
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, int | float | bool):
        return f"<{type(value).__name__} of shape {tuple(shape)}>"
    return repr(value)


def spec_text(fields: Mapping[str, Any]) -> str:
    """The AttentionSpec constructor call that ``fields`` describe, as a message shows it."""
    return "attnkit.AttentionSpec(" + ", ".join(f"{name}={value!r}" for name, value in fields.items()) + ")"


def _keyword_line(where: str, name: str, value: Any, accepted: Iterable[str], spec_fields: Iterable[str]) -> str:
    """What to write instead of ``name=value`` given to ``where`` ("AttentionSpec" or a function's name)."""
    given = f"{where}({name}={_shown(value)})"
    if where == "AttentionSpec" and name in CALL_ARGUMENTS:
        call = f"attnkit.attend(spec, q, k, v, {name}={_shown(value)})"
        return f"{given}: {name} is an argument of the call, not a field of the spec: {call}"
    if where != "AttentionSpec" and name in spec_fields:
        return f"{given}: {name} is a field of the spec: {where}(attnkit.AttentionSpec({name}={_shown(value)}), ...)"
    spelling = PEER_SPELLINGS.get(name)
    if spelling is not None:
        peers = " and ".join(f"{peer}'s" for peer in spelling.peers.split(", "))
        of = "" if spelling.field is None else f" of the spec's {spelling.field}={spelling.as_field(value)!r}"
        return f"{given}: {peers} spelling{of}; in attnkit: {spelling.instead}"
    accepted = sorted(accepted)
    closest = difflib.get_close_matches(name, accepted, n=1)
    guess = f"did you mean {closest[0]}=? " if closest else ""
    kind = "field" if where == "AttentionSpec" else "argument"
    return f"{given}: no such {kind}; {guess}{where} takes {', '.join(accepted)}"


def unexpected_keywords(
    where: str, given: Mapping[str, Any], accepted: Iterable[str], spec_fields: Iterable[str]
) -> str:
    """One line per keyword that ``where`` (``"AttentionSpec"``, whose fields are ``spec_fields``, or a function's
    name) does not take, each saying what attnkit writes instead."""
    accepted, spec_fields = tuple(accepted), tuple(spec_fields)
    return "\n".join(_keyword_line(where, name, value, accepted, spec_fields) for name, value in given.items())


def call_error(
    function: Callable[..., Any], spec: Any, positional: Mapping[str, Any], unexpected: Mapping[str, Any],
    spec_type: type, name: str | None = None,
) -> UnexpectedArgumentError:  # fmt: skip
    """The error for a call of ``function`` (attnkit.attend and its siblings) that does not fit it: ``spec`` not a
    ``spec_type`` (attnkit.AttentionSpec), any of the ``positional`` arguments after it missing (given as ``...``), or
    ``unexpected`` keywords."""
    name = name or f"attnkit.{function.__name__}"
    spec_fields = tuple(spec_type.model_fields)  # type: ignore[attr-defined]
    parameters = inspect.signature(function).parameters
    arguments = [p.name for p in parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "spec"]
    keywords = [p.name for p in parameters.values() if p.kind is p.KEYWORD_ONLY]
    lines = []
    if type(spec) is not spec_type:
        fields: dict[str, Any] = {}  # the spec the keywords given describe, shown in the call to write
        for keyword, value in unexpected.items():
            spelling = PEER_SPELLINGS.get(keyword)
            if keyword in spec_fields:
                fields[keyword] = value
            elif spelling is not None and spelling.field is not None:
                fields[spelling.field] = spelling.as_field(value)
        fields = {field: value for field, value in fields.items() if value is not False and value is not None}
        lines.append(
            f"spec must be an attnkit.AttentionSpec, got {type(spec).__name__}: {name} takes the spec first, then "
            f"{', '.join(arguments)}: {name}({spec_text(fields)}, {', '.join(arguments)})"
        )
    else:
        missing = [argument for argument, value in positional.items() if value is ...]
        if missing:
            lines.append(f"{name} is missing {', '.join(missing)}: {name}(spec, {', '.join(arguments)})")
    if unexpected:
        lines.append(unexpected_keywords(name, unexpected, keywords, spec_fields))
    return UnexpectedArgumentError("\n".join(lines))


def positional_fields_error(
    values: tuple[Any, ...], fields: Mapping[str, Any], spec_fields: Iterable[str]
) -> UnexpectedArgumentError:
    """The error for ``AttentionSpec(True)``: its fields are keywords, shown for the values given."""
    spec_fields = tuple(spec_fields)
    named = {**dict(zip(spec_fields, values)), **fields}
    return UnexpectedArgumentError(
        f"AttentionSpec takes its fields by keyword, got {len(values)} by position ({', '.join(map(repr, values))}): "
        f"in field order that is {spec_text(named)}; the fields are {', '.join(spec_fields)}"
    )
