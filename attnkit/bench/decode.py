"""``attnkit bench --what decode``: what one decode step costs through attnkit against the framework's own
attention, in the same run, on shapes a decode loop really meets: every step a key count the process has not seen.

Three parts, one thread (``--threads``, default 1):

* ``torch``: a KV cache growing one key a step. B=1, Hq=8, D=64, float32, q of length 1, k and v the views
  ``k_all[:, :, :L]`` of one preallocated cache, L from 512 upward for ``steps`` steps; ``attend(AttentionSpec(
  causal=True), q, k, v)`` (auto; bottom-right causal lets the one query see every key) against
  ``F.scaled_dot_product_attention(q, k, v)`` over the same L. attend meets each L once: the rows of one run differ
  in Hkv (8, and 2 for GQA) or in grad mode, which are part of every call signature, so no row's L was seen by
  another. The steps run in blocks of :data:`BLOCK`, attend's and SDPA's blocks alternating (the order swapped every
  block) so both see the same machine state; each was first warmed up on a block of shorter lengths, and its very
  first call is timed apart ("first call"). Under ``torch.no_grad()`` and recording autograd (q, k_all, v_all
  require grad; forward only). A last row first drives attend through ``seen`` distinct (Lq, Lk) signatures on tiny
  tensors, then times the growing cache again on lengths no row used: the fast path must survive a long-lived
  process.
* ``jax``: ``jax.jit`` of one decode step over a fixed-size cache (capacity :data:`JAX_CAPACITY`, layout bshd)
  with the length as data: ``attend(spec, q, k, v, kv_lengths=lens)`` against ``jax.nn.dot_product_attention(q, k,
  v, key_value_seq_lengths=lens)``, the length growing one a step. Each jitted function's compiled-program count
  (``_cache_size()``) is read after the warm-up and after the steps: equal counts are the proof that a growing
  length recompiles nothing. The two outputs are compared.
* ``transformers``: ``generate()`` of ``new_tokens`` greedy tokens on a small randomly initialised Llama (config
  built here, no download) with its default DynamicCache, ``attn_implementation="attnkit"`` against ``"sdpa"``,
  the turns interleaved; every turn starts from a prompt length chosen so that none of the key counts its steps meet
  was met before in the process. Tokens per second, and whether the two generated the same tokens.

Figures are per step (µs) or per generate() (tokens/s); differences and ratios are medians over blocks or turns of
the paired values, which cancels most of a shared machine's drift.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

from attnkit.bench.timing import device_banner, environment, interleaved, paired_difference, paired_ratio
from attnkit.call_cache import CACHE
from attnkit.tables import format_table

SHAPE = {"batch": 1, "heads_q": 8, "head_dim": 64, "dtype": "float32"}
HEADS_KV = (8, 2)
FIRST_LEN = 512
#: Steps per timed block; the blocks of attend and SDPA alternate.
BLOCK = 50
STEPS = 1000
SEEN_LENGTHS = 100_000
JAX_CAPACITY = 2048
NEW_TOKENS = 256
REPEATS = 3
#: The prompt of the first timed generate() turn is drawn from this range; later turns start past every key count
#: the earlier ones met.
PROMPT_RANGE = (100, 400)
LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
}
PARTS = ("torch", "jax", "transformers")
ATTEND = "attend"
SDPA = "sdpa"
JAX_NN = "jax.nn"


def length_blocks(first: int, steps: int, block: int) -> list[range]:
    """``steps`` lengths from ``first`` upward (at least one block), cut in blocks of ``block``."""
    count = max(1, steps // block)
    return [range(first + i * block, first + (i + 1) * block) for i in range(count)]


def block_runner(step: Callable[[int], Any], blocks: Sequence[range]) -> Callable[[], None]:
    """A function whose n-th call runs ``step(L)`` for every L of block n: the blocks are consumed once."""
    left: Iterator[range] = iter(blocks)

    def run() -> None:
        for length in next(left):
            step(length)

    return run


def _first_call_us(call: Callable[[], Any]) -> float:
    start = time.perf_counter_ns()
    call()
    return (time.perf_counter_ns() - start) / 1000


def _paired(samples: dict[str, list[float]], first: str, second: str, steps_per_sample: int) -> dict[str, Any]:
    """Per step: each implementation's mean µs, the median over samples of the paired difference and ratio."""
    per_step = {name: [ns / steps_per_sample / 1000 for ns in values] for name, values in samples.items()}
    return {
        f"{first}_us": statistics.fmean(per_step[first]),
        f"{second}_us": statistics.fmean(per_step[second]),
        "difference_us": paired_difference(per_step, first, second),
        "ratio": paired_ratio(per_step, first, second),
        "blocks_us": per_step,
    }


# ---------------------------------------------------------------------------------------------- torch


def _torch_row(heads_kv: int, recording: bool, first: int, steps: int, block: int) -> dict[str, Any]:
    """One growing-cache row: attend against SDPA over the lengths ``first`` .. (see the module docstring)."""
    import contextlib

    import torch
    import torch.nn.functional as F

    import attnkit
    from attnkit.bench.calls import auto_choice

    batch, heads_q, dim = SHAPE["batch"], SHAPE["heads_q"], SHAPE["head_dim"]
    blocks = length_blocks(first, steps, block)
    warm = range(first - block, first)  # lengths below every timed one
    capacity = blocks[-1].stop
    generator = torch.Generator().manual_seed(heads_kv)
    q = torch.randn(batch, heads_q, 1, dim, generator=generator)
    k_all, v_all = (torch.randn(batch, heads_kv, capacity, dim, generator=generator) for _ in range(2))
    if recording:
        q, k_all, v_all = (t.requires_grad_(True) for t in (q, k_all, v_all))
    spec = attnkit.AttentionSpec(causal=True)  # bottom-right: the one query sees every key, as SDPA's plain call
    ours = partial(attnkit.attend, spec)
    theirs = partial(F.scaled_dot_product_attention, enable_gqa=heads_kv != heads_q)

    def step(attention: Callable[..., Any]) -> Callable[[int], Any]:
        return lambda length: attention(q, k_all[:, :, :length], v_all[:, :, :length])

    mode = contextlib.nullcontext if recording else torch.no_grad
    with mode():
        cold = first - block - 1
        first_call = {
            ATTEND: _first_call_us(lambda: step(ours)(cold)),
            SDPA: _first_call_us(lambda: step(theirs)(cold)),
        }
        length = first - 1
        agree = float((step(ours)(length) - step(theirs)(length)).detach().abs().max())
        path = auto_choice(spec, q, k_all[:, :, :length], v_all[:, :, :length])
    functions = {ATTEND: block_runner(step(ours), [warm, *blocks]), SDPA: block_runner(step(theirs), [warm, *blocks])}
    # warmup=1: the first block of each is ``warm``, the shorter lengths; then one block of each per repeat.
    full_paths = CACHE.full_paths
    samples = interleaved(functions, len(blocks), warmup=1, calls=1, contexts={name: mode for name in functions})
    full_paths = CACHE.full_paths - full_paths  # attend's calls that were validated and dispatched anew
    return {
        "heads_kv": heads_kv,
        "grad": "recording" if recording else "no_grad",
        "len_k": [first, blocks[-1].stop - 1],
        "steps": len(blocks) * block,
        "path": path,
        "full_paths": full_paths,
        "attend_calls": len(warm) + sum(len(lengths) for lengths in blocks),
        "first_call_us": first_call,
        "max_abs_difference": agree,
        **_paired(samples, ATTEND, SDPA, block),
    }


def drive_signatures(count: int) -> dict[str, Any]:
    """``count`` attend calls, each a distinct (Lq, Lk) signature, on tiny tensors (B=1, H=1, D=8; Lq >= 2, so no
    decode row's signature), Lq·Lk kept small so that each call is cheap: what a long-lived process has met."""
    import torch

    import attnkit

    spec = attnkit.AttentionSpec(causal=True)
    pairs: list[tuple[int, int]] = []
    budget = 2
    while len(pairs) < count:  # the (Lq, Lk) with Lq * Lk <= budget, growing the budget until there are enough
        budget *= 2
        pairs = [(lq, lk) for lq in range(2, budget + 1) for lk in range(1, budget // lq + 1)]
    pairs = pairs[:count]
    q = torch.randn(1, 1, max(lq for lq, _ in pairs), 8)
    k = torch.randn(1, 1, max(lk for _, lk in pairs), 8)
    start = time.perf_counter()
    with torch.no_grad():
        for lq, lk in pairs:
            attnkit.attend(spec, q[:, :, :lq], k[:, :, :lk], k[:, :, :lk])
    return {"signatures": len(pairs), "seconds": time.perf_counter() - start}


def bench_torch(steps: int, seen: int, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = progress or (lambda message: None)
    block = BLOCK
    rows = []
    for heads_kv in HEADS_KV:
        for recording in (False, True):
            say(f"torch: growing cache, Hkv={heads_kv}, {'recording' if recording else 'no_grad'}, {steps} steps")
            rows.append(_torch_row(heads_kv, recording, FIRST_LEN, steps, block))
    say(f"torch: {seen} distinct signatures, then the growing cache again")
    driven = drive_signatures(seen)
    fresh = FIRST_LEN + len(length_blocks(FIRST_LEN, steps, block)) * block + block  # past every earlier row's lengths
    row = _torch_row(HEADS_KV[0], False, fresh, steps, block)
    row["after_signatures"] = driven["signatures"]
    row["driving_seconds"] = driven["seconds"]
    rows.append(row)
    return {"shape": {**SHAPE, "len_q": 1}, "block": block, "rows": rows}


# ---------------------------------------------------------------------------------------------- jax


def bench_jax(steps: int, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import attnkit
    from attnkit.bench.calls import auto_choice

    say = progress or (lambda message: None)
    block = BLOCK
    batch, heads, dim = SHAPE["batch"], SHAPE["heads_q"], SHAPE["head_dim"]
    steps = min(steps, JAX_CAPACITY - FIRST_LEN)
    blocks = length_blocks(FIRST_LEN, steps, block)
    warm = range(FIRST_LEN - block, FIRST_LEN)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (batch, 1, heads, dim), jnp.float32)  # bshd, as jax.nn takes it
    k, v = (jax.random.normal(key, (batch, JAX_CAPACITY, heads, dim), jnp.float32) for key in keys[1:])
    # Bottom-right causal with kv_lengths puts the one query at key kv_lengths[b] - 1 (docs/semantics.md §4.3): it
    # sees every key before the length, what jax.nn's key_value_seq_lengths alone shows it.
    spec = attnkit.AttentionSpec(causal=True, layout="bshd")
    jitted = {
        ATTEND: jax.jit(lambda q, k, v, lens: attnkit.attend(spec, q, k, v, kv_lengths=lens)),
        JAX_NN: jax.jit(lambda q, k, v, lens: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lens)),
    }
    lengths = {n: jnp.full((batch,), n, jnp.int32) for n in range(warm.start - 1, blocks[-1].stop)}  # made untimed

    def step(name: str) -> Callable[[int], Any]:
        function = jitted[name]
        return lambda length: jax.block_until_ready(function(q, k, v, lengths[length]))

    say(f"jax: jitted decode step over a {JAX_CAPACITY}-key cache, {steps} steps")
    first_call = {name: _first_call_us(partial(step(name), warm.start - 1)) for name in jitted}
    outputs = {name: step(name)(FIRST_LEN - 1) for name in jitted}
    path = auto_choice(spec, q, k, v, lengths[FIRST_LEN - 1])  # asked eagerly: what the jitted trace dispatched to
    agree = float(jnp.max(jnp.abs(outputs[ATTEND] - outputs[JAX_NN])))
    compiled_before = {name: function._cache_size() for name, function in jitted.items()}
    functions = {name: block_runner(step(name), [warm, *blocks]) for name in jitted}
    samples = interleaved(functions, len(blocks), warmup=1, calls=1)
    compiled_after = {name: function._cache_size() for name, function in jitted.items()}
    return {
        "shape": {**SHAPE, "heads_kv": heads, "len_q": 1, "capacity": JAX_CAPACITY, "layout": "bshd"},
        "spec": spec.model_dump(mode="json", exclude_defaults=True),
        "len_k": [FIRST_LEN, blocks[-1].stop - 1],
        "steps": len(blocks) * block,
        "block": block,
        "path": path,
        "first_call_us": first_call,
        "compiled_programs_before": compiled_before,
        "compiled_programs_after": compiled_after,
        "recompiled": any(compiled_after[name] != compiled_before[name] for name in jitted),
        "max_abs_difference": agree,
        **_paired(samples, ATTEND, JAX_NN, block),
    }


# ---------------------------------------------------------------------------------------------- transformers


def prompt_lengths(turns: int, new_tokens: int, rng: random.Random, floor: int) -> list[int]:
    """A prompt length per turn, the first drawn from :data:`PROMPT_RANGE` above ``floor``, each later one past
    every key count (prompt + new tokens) of the turns before: each turn's every step is a length not met before."""
    low, high = PROMPT_RANGE
    first = rng.randint(max(low, floor), max(high, floor))
    return [first + turn * (new_tokens + 1) for turn in range(turns)]


def bench_transformers(
    new_tokens: int, repeats: int, seed: int | None = None, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import attnkit.integrations.transformers  # noqa: F401  registers attn_implementation="attnkit"

    say = progress or (lambda message: None)
    models = {}
    for name in (ATTEND, SDPA):
        torch.manual_seed(0)  # the same weights for both
        # A config each: a model keeps the config object it is given, and set_attn_implementation writes to it.
        models[name] = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
        models[name].set_attn_implementation("attnkit" if name == ATTEND else "sdpa")
    implementations = {name: model.config._attn_implementation for name, model in models.items()}
    if implementations != {ATTEND: "attnkit", SDPA: "sdpa"}:
        raise RuntimeError(f"the two models run {implementations}, expected attnkit and sdpa")
    vocab = LLAMA["vocab_size"]
    rng = random.Random(seed if seed is not None else time.time_ns())

    def generate(name: str, prompt: int, tokens: int) -> Any:
        # Ids from 1: generate() takes every pad id (0) in the prompt for padding, which would make this a padded
        # batch (segment ids on attnkit's side, a mask on SDPA's) instead of the plain prompt it is meant to be.
        ids = torch.randint(1, vocab, (1, prompt), generator=torch.Generator().manual_seed(prompt))
        with torch.no_grad():
            out = models[name].generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        return out[0, prompt:]

    warm_prompt = PROMPT_RANGE[0] // 2  # a warm-up turn below every timed length
    first_call = {name: _first_call_us(partial(generate, name, warm_prompt, 8)) for name in models}
    prompts = prompt_lengths(repeats, new_tokens, rng, warm_prompt + 9)
    say(f"transformers: generate() of {new_tokens} tokens, prompts {prompts}, attnkit and sdpa interleaved")
    seconds: dict[str, list[float]] = {name: [] for name in models}
    identical = []
    for turn, prompt in enumerate(prompts):
        order = [ATTEND, SDPA] if turn % 2 == 0 else [SDPA, ATTEND]
        tokens = {}
        for name in order:
            start = time.perf_counter()
            tokens[name] = generate(name, prompt, new_tokens)
            seconds[name].append(time.perf_counter() - start)
        identical.append(bool(torch.equal(tokens[ATTEND], tokens[SDPA])))
    rates = {name: [new_tokens / value for value in values] for name, values in seconds.items()}
    return {
        "model": {"class": "LlamaForCausalLM", **LLAMA, "weights": "random, torch.manual_seed(0)"},
        "cache": "DynamicCache",
        "new_tokens": new_tokens,
        "prompts": prompts,
        "first_generate_us": first_call,
        "tokens_per_s": {name: statistics.median(values) for name, values in rates.items()},
        "turns_tokens_per_s": rates,
        "ratio": paired_ratio(rates, ATTEND, SDPA),
        "identical_tokens": identical,
    }


# ---------------------------------------------------------------------------------------------- all


def bench_decode(
    steps: int = STEPS,
    seen: int = SEEN_LENGTHS,
    new_tokens: int = NEW_TOKENS,
    repeats: int = REPEATS,
    parts: Sequence[str] = PARTS,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every part of the module docstring that ``parts`` names; a JSON-ready dict."""
    started = time.time()
    result: dict[str, Any] = {"what": "decode", "environment": environment("cpu"), "parts": {}}
    if "torch" in parts:
        result["parts"]["torch"] = bench_torch(steps, seen, progress=progress)
    if "jax" in parts:
        result["parts"]["jax"] = bench_jax(steps, progress=progress)
    if "transformers" in parts:
        result["parts"]["transformers"] = bench_transformers(new_tokens, repeats, progress=progress)
    result["environment"]["load_average_end"] = [round(load, 2) for load in os.getloadavg()]
    result["seconds"] = time.time() - started
    return result


def _us(value: float) -> str:
    return f"{value:.1f}"


def _duration(microseconds: float) -> str:
    """A first call's time, in the unit that reads best (from tens of µs to seconds)."""
    if microseconds >= 1e6:
        return f"{microseconds / 1e6:.2f} s"
    if microseconds >= 1e3:
        return f"{microseconds / 1e3:.1f} ms"
    return f"{microseconds:.0f} us"


def _first_calls(first_call: dict[str, float]) -> str:
    return " / ".join(_duration(value) for value in first_call.values())


def format_decode(result: dict[str, Any]) -> str:
    end = result["environment"].get("load_average_end")
    lines = [device_banner(result)]
    if end:
        lines.append(f"load average at the end: {' '.join(f'{load:.2f}' for load in end)}; {result['seconds']:.0f} s")
    parts = result["parts"]
    if "torch" in parts:
        torch_part = parts["torch"]
        shape = torch_part["shape"]
        lines += [
            "",
            f"torch: a KV cache growing one key a step, B={shape['batch']} Hq={shape['heads_q']} Lq=1 "
            f"D={shape['head_dim']} {shape['dtype']}; attend(AttentionSpec(causal=True), q, k_all[:, :, :L], "
            "v_all[:, :, :L]) against F.scaled_dot_product_attention over the same L, each L new to attnkit; blocks "
            f"of {torch_part['block']} steps alternating; us per step (mean), difference and ratio: medians of the "
            "per-block pairs; full paths: how many of attend's steps (its warm-up block included) were validated and "
            "dispatched anew rather than served from the length-class cache; first call (attend / sdpa): each row's "
            "first, before its warm-up",
        ]
        rows = []
        for row in torch_part["rows"]:
            label = f"Hkv={row['heads_kv']} {row['grad']}"
            if "after_signatures" in row:
                label += f", after {row['after_signatures']:,} signatures"
            rows.append(
                [
                    label,
                    f"{row['len_k'][0]}..{row['len_k'][1]}",
                    row["path"],
                    f"{row['full_paths']} of {row['attend_calls']}",
                    _us(row["attend_us"]),
                    _us(row["sdpa_us"]),
                    f"{row['difference_us']:+.1f}",
                    f"{row['ratio']:.2f}x",
                    _first_calls(row["first_call_us"]),
                ]
            )
        lines.append(
            format_table(
                [
                    "row",
                    "L",
                    "auto runs",
                    "full paths",
                    "attend us",
                    "sdpa us",
                    "attend - sdpa",
                    "attend / sdpa",
                    "first call",
                ],  # fmt: skip
                rows,
            )
        )
        driven = [row for row in torch_part["rows"] if "after_signatures" in row]
        for row in driven:
            lines.append(
                f"the last row ran after {row['after_signatures']:,} distinct (Lq, Lk) signatures on tiny tensors "
                f"({row['driving_seconds']:.1f} s), on lengths no earlier row used"
            )
        worst = max(row["max_abs_difference"] for row in torch_part["rows"])
        lines.append(f"attend and sdpa outputs: max |difference| {worst:.2g}")
    if "jax" in parts:
        jax_part = parts["jax"]
        before, after = jax_part["compiled_programs_before"], jax_part["compiled_programs_after"]
        lines += [
            "",
            f"jax: jax.jit decode step over a {jax_part['shape']['capacity']}-key cache (B=1 H=8 Lq=1 D=64 float32, "
            "bshd), the length as data growing one a step: attend(AttentionSpec(causal=True, layout='bshd'), ..., "
            "kv_lengths=lens) against jax.nn.dot_product_attention(..., key_value_seq_lengths=lens); blocks of "
            f"{jax_part['block']} steps alternating; first call (attend / jax.nn): the jit's compile",
            format_table(
                ["L", "auto runs", "attend us", "jax.nn us", "attend - jax.nn", "attend / jax.nn", "first call"],
                [
                    [
                        f"{jax_part['len_k'][0]}..{jax_part['len_k'][1]}",
                        jax_part["path"],
                        _us(jax_part["attend_us"]),
                        _us(jax_part["jax.nn_us"]),
                        f"{jax_part['difference_us']:+.1f}",
                        f"{jax_part['ratio']:.2f}x",
                        _first_calls(jax_part["first_call_us"]),
                    ]
                ],
            ),
            "compiled programs (jitted._cache_size()) after the warm-up -> after the steps: "
            + ", ".join(f"{name} {before[name]} -> {after[name]}" for name in before)
            + ("; RECOMPILED as the length grew" if jax_part["recompiled"] else "; no recompile as the length grew"),
            f"attend and jax.nn outputs: max |difference| {jax_part['max_abs_difference']:.2g}",
        ]
    if "transformers" in parts:
        hf = parts["transformers"]
        model = hf["model"]
        rates = hf["tokens_per_s"]
        lines += [
            "",
            f"transformers: generate() of {hf['new_tokens']} greedy tokens, random LlamaForCausalLM (hidden "
            f"{model['hidden_size']}, {model['num_hidden_layers']} layers, {model['num_attention_heads']} heads, "
            f"{model['num_key_value_heads']} kv heads, vocab {model['vocab_size']}), DynamicCache; prompts "
            f"{', '.join(map(str, hf['prompts']))} (each turn's lengths new to the process), turns interleaved",
            format_table(
                ["attn_implementation", "tokens/s (median)", "first generate(), 8 tokens"],
                [
                    ["attnkit", f"{rates[ATTEND]:.1f}", _duration(hf["first_generate_us"][ATTEND])],
                    ["sdpa", f"{rates[SDPA]:.1f}", _duration(hf["first_generate_us"][SDPA])],
                ],
            ),
            f"attnkit / sdpa tokens/s: {hf['ratio']:.3f} (median of the per-turn ratios); "
            f"same tokens in {sum(hf['identical_tokens'])} of {len(hf['identical_tokens'])} turns",
        ]
    return "\n".join(lines)
