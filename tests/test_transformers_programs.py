"""transformers' mask functions as attnkit mask programs (attnkit/integrations/transformers.py, docs/integrations.md):
chunked attention (Llama 4), the image-token overlays of Gemma 3 and PaliGemma's prefix, padding and packed sequences
reach attnkit as transformers' own mask function on attnkit's raw indices, and no (Lq, Lk) mask is materialised.

The masks made are checked against transformers' own ``sdpa_mask`` query by key, on every cache geometry; whole tiny
models (built from configs, no downloads) against the float64 oracle of tests/test_transformers_integration.py
(transformers' eager attention with its softmax in float64) in logits, every parameter gradient and greedy
generation, while a spy on transformers' mask materialisation counts none.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

pytest.importorskip(
    "transformers", reason="the transformers extra is not installed (pip install attnkit[transformers])"
)

import transformers  # noqa: E402
from transformers import masking_utils  # noqa: E402

import attnkit  # noqa: E402
from attnkit.integrations import transformers as attnkit_hf  # noqa: E402
from tests.test_transformers_integration import (  # noqa: E402
    GEOMETRIES,
    TWO_D_PADDINGS,
    assert_agree,
    float64_backends,
    float64_peer,
    packed_mask_function,
    visibility,
)

BATCH, LENGTH, VOCAB = 2, 12, 96
IMAGE_TOKEN = 95  # the last id of the vocabulary; text ids stay below it


def left_padding(two_d: torch.Tensor) -> torch.Tensor:
    """Each row's count of leading pad positions, as transformers' create_chunked_causal_mask reads it."""
    return (two_d.long().cumsum(-1) == 0).sum(-1)


# The mask functions transformers builds for the patterns no spec field expresses, from a (B, seen) padding mask.
PROGRAM_PATTERNS: dict[str, Callable[[torch.Tensor], Callable[..., Any]]] = {
    # Llama 4's chunks of 3, counted from each row's first real token.
    "chunked 3": lambda two_d: masking_utils.chunked_causal_mask_function(3, left_padding(two_d)),
    # Gemma 3's full layers: causal, or the same image (block ids, −1 for text; padded with −1 past what was seen).
    "causal or image blocks": lambda two_d: masking_utils.or_masks(
        masking_utils.causal_mask_function, masking_utils.blockwise_overlay(image_blocks(two_d.shape[1]))
    ),
    # Gemma 3's sliding layers: a window of 3 over (causal or image blocks).
    "sliding 3 over image blocks": lambda two_d: masking_utils.and_masks(
        masking_utils.or_masks(
            masking_utils.causal_mask_function, masking_utils.blockwise_overlay(image_blocks(two_d.shape[1]))
        ),
        masking_utils.sliding_window_overlay(3),
    ),
    # Gemma 3 with use_bidirectional_attention: an overlay that is a 0-d tensor, whatever the indices.
    "bidirectional overlay": lambda two_d: masking_utils.or_masks(
        masking_utils.causal_mask_function, lambda *indices: torch.tensor(True)
    ),
}


def image_blocks(seen: int) -> torch.Tensor:
    """Block ids of two rows: images at positions 2..4 and 6..7 of row 0, 1..5 of row 1; −1 elsewhere, and −1 for
    the positions of a longer cache, as transformers' maybe_pad_block_sequence_ids pads them."""
    blocks = torch.full((2, seen + 8), -1)
    blocks[0, 2:5], blocks[0, 6:8], blocks[1, 1:6] = 0, 1, 0
    return blocks


def program_visibility(made: attnkit_hf.AttnkitMask) -> torch.Tensor:
    assert made.mask_mod is not None, "a pattern no spec field expresses came without a mask program"
    assert made.q_segment_ids is None and made.kv_segment_ids is None  # the padding is in the program
    return visibility(made, 2)


@pytest.mark.parametrize("padding", sorted(TWO_D_PADDINGS))
@pytest.mark.parametrize("pattern", sorted(PROGRAM_PATTERNS))
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_a_program_stands_for_exactly_transformers_mask(geometry: str, pattern: str, padding: str) -> None:
    """transformers' mask function, positioned by the cache's offsets and ANDed with the padding, as a program on
    attnkit's raw indices: what attnkit sees equals transformers' own boolean mask, query by key, on every cache
    geometry (a static cache's unwritten slots beyond kv_lengths)."""
    q_length, kv_length, q_offset, kv_offset = GEOMETRIES[geometry]
    seen = q_offset + q_length
    two_d = torch.tensor([[1] * seen, TWO_D_PADDINGS[padding](seen)], dtype=torch.bool)
    facts = dict(batch_size=2, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                 mask_function=PROGRAM_PATTERNS[pattern](two_d), attention_mask=two_d)  # fmt: skip
    expected = masking_utils.sdpa_mask(**facts, allow_is_causal_skip=False)
    made = attnkit_hf.make_mask(**facts)
    assert isinstance(made, attnkit_hf.AttnkitMask)
    assert torch.equal(program_visibility(made), expected)


def test_packed_sequences_whose_ids_are_not_the_runs_of_their_positions_are_a_program() -> None:
    """Sequence ids that are not the runs of the positions the pattern is computed on (no longer the same pattern
    on the indices, so no segment ids): transformers' function itself, as a program."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)
    foreign_ids = torch.zeros(2, 6, dtype=torch.long)  # two runs of positions read as one sequence: q3 sees k0
    mask_function = packed_mask_function(masking_utils.causal_mask_function, positions, foreign_ids)
    facts = dict(batch_size=2, q_length=6, kv_length=6, mask_function=mask_function)
    made = attnkit_hf.make_mask(**facts)
    assert made.mask_mod is mask_function  # no offsets, no padding: the very function transformers built
    assert torch.equal(program_visibility(made), masking_utils.sdpa_mask(**facts, allow_is_causal_skip=False))


def test_a_function_no_program_can_hold_gets_transformers_mask() -> None:
    """Foreign code that branches on an index in Python: no program, transformers' own (B, 1, Lq, Lk) mask."""

    def branching(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx <= q_idx if bool((q_idx >= 0).all()) else q_idx < 0

    facts = dict(batch_size=2, q_length=5, kv_length=5, mask_function=branching)
    made = attnkit_hf.make_mask(**facts)
    assert torch.equal(made, masking_utils.sdpa_mask(**facts, allow_is_causal_skip=False))


# --- Whole models ------------------------------------------------------------------------------------------------

TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)  # fmt: skip
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=4, vision_use_head=False)  # fmt: skip


def llama4() -> torch.nn.Module:
    """Chunked layers of 4 keys alternating with full ones; a mixture of 2 experts. Without qk_norm: Llama 4 takes
    it in float32 whatever the model's dtype, which would make a float64 model's gradients float32-accurate."""
    config = transformers.Llama4TextConfig(
        **TEXT, intermediate_size_mlp=64, num_local_experts=2, attention_chunk_size=4, no_rope_layer_interval=2,
        use_qk_norm=False,
    )  # fmt: skip
    assert config.layer_types == ["chunked_attention", "full_attention"]
    return transformers.Llama4ForCausalLM(config)


def gemma3() -> torch.nn.Module:
    """Image tokens (4 per image) attending to their own image both ways; sliding layers of 4 keys alternating with
    full ones; a one-layer vision tower."""
    text = transformers.Gemma3TextConfig(**TEXT, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    config = transformers.Gemma3Config(
        text_config=text, vision_config=transformers.SiglipVisionConfig(**VISION), mm_tokens_per_image=4,
        image_token_index=IMAGE_TOKEN, boi_token_index=93, eoi_token_index=94,
    )  # fmt: skip
    return transformers.Gemma3ForConditionalGeneration(config)


def paligemma() -> torch.nn.Module:
    """A prefix (16 image tokens and the prompt) seen both ways, the suffix causal; a one-layer vision tower."""
    config = transformers.PaliGemmaConfig(
        text_config=transformers.GemmaConfig(**TEXT), vision_config=transformers.SiglipVisionConfig(**VISION),
        image_token_index=IMAGE_TOKEN, projection_dim=32,
    )  # fmt: skip
    return transformers.PaliGemmaForConditionalGeneration(config)


def modernbert() -> torch.nn.Module:
    """Bidirectional; local windows (2 keys each side) on 2 of 3 layers."""
    config = transformers.ModernBertConfig(
        **{key: TEXT[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")},
        num_hidden_layers=3, global_attn_every_n_layers=3, local_attention=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2, attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0,
    )  # fmt: skip
    return transformers.ModernBertForMaskedLM(config)


FAMILIES = {"llama4": llama4, "gemma3": gemma3, "paligemma": paligemma, "modernbert": modernbert}


@functools.cache
def build(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(float32 model, the same weights in float64), in train mode with attention dropout 0."""
    torch.manual_seed(0)
    model = FAMILIES[name]().train()
    return model, copy.deepcopy(model).double()


def inputs(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded rows (row 1 padded by 3), with the family's images: Gemma 3 an image of 4 tokens in each row,
    PaliGemma 16 image tokens then the prompt as the prefix and a 4-token suffix."""
    generator = torch.Generator().manual_seed(seed)
    length = 24 if name == "paligemma" else LENGTH
    ids = torch.randint(3, 90, (BATCH, length), generator=generator)
    mask = torch.ones(BATCH, length, dtype=torch.long)
    mask[1, :3], ids[1, :3] = 0, 0
    given: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask}
    if name in ("gemma3", "paligemma"):
        images = slice(4, 8) if name == "gemma3" else slice(3, 19)
        ids[:, images] = IMAGE_TOKEN
        given["pixel_values"] = torch.randn(BATCH, 3, 16, 16, generator=generator)
        given["token_type_ids"] = (
            (ids == IMAGE_TOKEN).long() if name == "gemma3" else (torch.arange(length) >= 20).long().expand(BATCH, -1)
        )
    return given


@contextmanager
def counted() -> Iterator[dict[str, int]]:
    """Counts transformers' mask materialisations (sdpa_mask, eager_mask, and the two expansions that build every
    (B, 1, Lq, Lk) mask of masking_utils) and attnkit's attention calls with a mask program."""
    counts = {"materialised": 0, "programs": 0}
    saved = {name: getattr(masking_utils, name) for name in ("sdpa_mask", "eager_mask", "_non_vmap_expansion_sdpa",
                                                              "_vmap_expansion_sdpa")}  # fmt: skip
    attend = attnkit_hf.attend

    def spy(function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts["materialised"] += 1
            return function(*args, **kwargs)

        return call

    def attend_spy(*args: Any, **kwargs: Any) -> Any:
        counts["programs"] += kwargs.get("mask_mod") is not None
        return attend(*args, **kwargs)

    for name, function in saved.items():
        setattr(masking_utils, name, spy(function))
    attnkit_hf.attend = attend_spy
    try:
        yield counts
    finally:
        for name, function in saved.items():
            setattr(masking_utils, name, function)
        attnkit_hf.attend = attend


def results(model: torch.nn.Module, implementation: str, given: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The logits of the real positions and every parameter's gradient of a fixed linear loss on them."""
    model.set_attn_implementation(implementation)
    model.zero_grad(set_to_none=True)
    dtype = next(model.parameters()).dtype
    logits = model(**{key: value.to(dtype) if key == "pixel_values" else value for key, value in given.items()}).logits
    real = given["attention_mask"].bool()
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (logits[real] * weights[real].to(logits.dtype)).sum().backward()
    found = {"logits": logits[real].detach().double().numpy()}
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, f"{name} got no gradient"
        found[name] = parameter.grad.double().numpy()
    return found


@functools.cache
def references(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the float64 oracle's results, float32 eager's: the baseline)."""
    model32, model64 = build(name)
    return results(model64, "exact_eager", inputs(name)), results(model32, "eager", inputs(name))


# ModernBERT's windows are spec fields, not programs: it checks that nothing materialises there either.
USES_PROGRAMS = {"llama4": True, "gemma3": True, "paligemma": True, "modernbert": False}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@functools.cache
def programs_served(dtype: torch.dtype) -> bool:
    """Whether some backend serves a torch call on the CPU with a mask program in ``dtype``."""
    q = torch.zeros(1, 1, 2, 4, dtype=dtype)
    try:
        attnkit.attend(attnkit.AttentionSpec(), q, q, q, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)
    except attnkit.BackendUnavailableError:
        return False
    return True


def skip_unless_served(name: str, dtype: str) -> None:
    if USES_PROGRAMS[name] and not programs_served(DTYPES[dtype]):
        pytest.skip(f"no backend serves a torch mask program in {dtype} on the CPU")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_and_every_gradient_agree_with_eager_with_no_mask_materialised(name: str, dtype: str) -> None:
    """Left padding, and each family's pattern: float32 attnkit with float32 eager as the baseline, float64 attnkit
    on every backend that serves it with float32 eager's deviation shrunk to float64 (tests/
    test_transformers_integration.py: float64_peer), against the float64 oracle; no mask materialised, and the
    program families' calls carry their programs."""
    skip_unless_served(name, dtype)
    model32, model64 = build(name)
    exact, eager32 = references(name)
    with counted() as counts:
        if dtype == "float32":
            found = {"auto": results(model32, "attnkit", inputs(name))}
        else:
            found = float64_backends(model64, functools.partial(results, given=inputs(name)))
    assert counts["materialised"] == 0, counts
    assert (counts["programs"] > 0) == USES_PROGRAMS[name], counts
    baseline = eager32 if dtype == "float32" else float64_peer(exact, eager32)
    for backend, got in found.items():
        assert_agree(dtype, got, exact, baseline, f"{name} {dtype} attnkit on {backend}, against the oracle")


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name, cache", [("llama4", "dynamic"), ("llama4", "static"), ("paligemma", "dynamic")])
def test_greedy_generation_matches_eager_with_no_mask_materialised(name: str, cache: str, dtype: str) -> None:
    """Chunks counted from each row's first real token while the cache grows (the program closes over the cache's
    offsets; a static cache's unwritten slots lie beyond kv_lengths), and PaliGemma's prefix at prefill: the tokens
    of a left-padded batch equal the float64 oracle's, and eager's in the same dtype."""
    skip_unless_served(name, dtype)
    model = build(name)[dtype == "float64"]
    given = inputs(name, seed=3)

    def generate(implementation: str, model: torch.nn.Module) -> torch.Tensor:
        model.set_attn_implementation(implementation)
        dtype = next(model.parameters()).dtype
        with torch.no_grad():
            cast = {key: value.to(dtype) if key == "pixel_values" else value for key, value in given.items()}
            return model.generate(**cast, max_new_tokens=6, do_sample=False, cache_implementation=cache)

    exact = generate("exact_eager", build(name)[1])
    eager = generate("eager", model)
    with counted() as counts:
        tokens = generate("attnkit", model)
    assert counts["materialised"] == 0 and counts["programs"] > 0, counts
    assert torch.equal(tokens, exact) and torch.equal(tokens, eager), (tokens, exact, eager)


@pytest.mark.parametrize("name", ["llama4", "gemma3", "paligemma"])
def test_the_models_exercise_the_patterns_they_are_here_for(name: str) -> None:
    """Llama 4's chunks, Gemma 3's image blocks and PaliGemma's prefix change the logits far beyond any tolerance
    (the sequences are longer than the chunks; images and prefixes see later tokens), so the comparisons above
    check them."""
    _, model = build(name)
    model.set_attn_implementation("exact_eager")
    given = {key: value.double() if key == "pixel_values" else value for key, value in inputs(name).items()}
    with torch.no_grad():
        with_it = model(**given).logits
        if name == "llama4":
            chunk, model.config.attention_chunk_size = model.config.attention_chunk_size, 64
            without = model(**given).logits
            model.config.attention_chunk_size = chunk
        else:
            without = model(**{key: value for key, value in given.items() if key != "token_type_ids"}).logits
    assert (with_it - without).abs().max() > 1e-3
