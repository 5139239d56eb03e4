"""attn_implementation="attnkit" in Hugging Face transformers (attnkit/integrations/transformers.py,
docs/integrations.md): the visibility each mask it makes stands for is exactly transformers' own mask, and whole
models (GQA, softcap, sliding windows; left, right and no padding) agree with transformers' attention in logits,
every parameter gradient and greedy generation with dynamic and static caches.

The float64 oracle of the model comparisons is transformers' eager attention with its softmax in float64
(`exact_eager` below): eager itself takes its softmax in float32, so in float64 it is neither exact nor, with
left padding, finite (docs/integrations.md). Tiny models built from configs, no downloads; each family is built
once per module.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch._dynamo.testing

pytest.importorskip(
    "transformers", reason="the transformers extra is not installed (pip install attnkit[transformers])"
)

import transformers  # noqa: E402
from attnkit.backends.reference.torch_naive import oracle_visibility  # noqa: E402
from transformers import AttentionInterface, AttentionMaskInterface, masking_utils  # noqa: E402

import attnkit  # noqa: E402
import attnkit.programs  # noqa: E402
from attnkit.backend import AttentionInputs  # noqa: E402
from attnkit.contract.programs import dense  # noqa: E402
from attnkit.frontends import ops_for  # noqa: E402
from attnkit.integrations import transformers as attnkit_hf  # noqa: E402
from attnkit.testing.agreement import compare_outputs  # noqa: E402

BATCH, LENGTH, NEW_TOKENS, VOCAB = 3, 12, 5, 96
PADDINGS = ("none", "left", "right")


def exact_eager(
    module: torch.nn.Module, query, key, value, attention_mask, scaling=None, softcap=None, s_aux=None, **kwargs
):
    """transformers' eager attention (kv heads repeated, scale, softcap, additive mask; gpt-oss's sinks ``s_aux``
    as one more logit column, softmaxed and dropped) with the softmax in the inputs' dtype."""
    groups = query.shape[1] // key.shape[1]
    key, value = (tensor.repeat_interleave(groups, dim=1) for tensor in (key, value))
    scores = query @ key.transpose(2, 3) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask
    if s_aux is None:
        return (scores.softmax(-1) @ value).transpose(1, 2).contiguous(), None
    sinks = s_aux.reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1).to(scores.dtype)
    weights = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    return (weights @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register("exact_eager", exact_eager)
AttentionMaskInterface.register("exact_eager", masking_utils.eager_mask)

SHARED = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)  # fmt: skip
CONFIGS: dict[str, Callable[[], Any]] = {
    # GQA: 4 query heads on 2 kv heads.
    "llama": lambda: transformers.LlamaConfig(**SHARED),
    # Softcap on scores of order 1 (a wider init than the default 0.02, where tanh would be linear), and sliding
    # layers (4 keys, the query's own included) alternating with full ones.
    "gemma2": lambda: transformers.Gemma2Config(
        **SHARED, sliding_window=4, attn_logit_softcapping=2.0, query_pre_attn_scalar=8, initializer_range=0.3
    ),
    # Every layer sliding, 5 keys.
    "mistral": lambda: transformers.MistralConfig(**SHARED, sliding_window=5),
    # Sinks (s_aux, one learned logit per query head) on sliding layers (4 keys) alternating with full ones; a
    # small mixture of experts. Sinks of order 1 (initializer_range), so a row's sink weight is far from 0 and 1.
    "gpt_oss": lambda: transformers.GptOssConfig(
        **SHARED,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.5,
    ),  # fmt: skip
}
MODELS = {
    "llama": transformers.LlamaForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "gpt_oss": transformers.GptOssForCausalLM,
}


@functools.cache
def build(name: str) -> tuple[str, torch.nn.Module, torch.nn.Module]:
    """(name, float32 model, the same weights in float64), in train mode with attention dropout 0."""
    torch.manual_seed(0)
    model = MODELS[name](CONFIGS[name]()).train()
    if name == "gpt_oss":
        model.set_experts_implementation("eager")  # its default, grouped_mm, takes no float64
    return name, model, copy.deepcopy(model).double()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, torch.nn.Module]:
    return build(request.param)


def token_ids(seed: int, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def supports_sdpa(model: torch.nn.Module) -> bool:
    return type(model)._supports_sdpa  # sdpa has no softcap, so Gemma2 refuses it


def padding_mask(padding: str) -> torch.Tensor:
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    if padding == "left":
        mask[1, :4] = mask[2, :1] = 0
    elif padding == "right":
        mask[1, 8:] = mask[2, 11:] = 0
    return mask


def logits_and_gradients(
    model: torch.nn.Module, implementation: str, ids, real=None, forward=None, **inputs
) -> dict[str, np.ndarray]:
    """The logits of the ``real`` positions (default: all) and every parameter's gradient of a fixed linear loss on
    them, through ``forward`` (default: the model itself)."""
    model.set_attn_implementation(implementation)
    model.zero_grad(set_to_none=True)
    logits = (model if forward is None else forward)(ids, **inputs).logits
    real = torch.ones(ids.shape, dtype=torch.bool) if real is None else real
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (logits[real] * weights[real].to(logits.dtype)).sum().backward()
    results = {"logits": logits[real].detach().double().numpy()}
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, f"{name} got no gradient"
        results[name] = parameter.grad.double().numpy()
    return results


def assert_agree(dtype: str, results, exact, baseline, what: str) -> None:
    failures = [str(comparison) for comparison in compare_outputs(dtype, results, exact, baseline) if not comparison.ok]
    assert not failures, f"{what}:\n  " + "\n  ".join(failures)


def float64_peer(exact, float32_peer):
    """The baseline of a float64 model comparison: float32 ``eager``'s deviation from the oracle, shrunk by the ratio
    of the two precisions. The rule's floor is for one call; a whole model amplifies a call's rounding by its own
    condition (gpt_oss, with weights of order 0.5, took a few ulps per call to 33 ulps of a gradient: a flake that hung
    on which backend ``auto`` measured fastest). float32 eager rounds the same model everywhere, so its error is that
    amplification seen at float32's epsilon; a float64 run must stay within twice it at float64's."""
    shrink = np.finfo(np.float64).eps / np.finfo(np.float32).eps
    return {name: expected + (float32_peer[name] - expected) * shrink for name, expected in exact.items()}


def float64_backends(model: torch.nn.Module, run: Callable[..., Any]) -> dict[str, dict[str, np.ndarray]]:
    """The float64 model's results through attnkit on every registered backend that serves it, not on the one that
    ``auto`` happens to time fastest: each backend rounds differently, and every one must agree."""
    results = {}
    for backend in attnkit.registered_backends():
        try:
            with attnkit.use_backend(backend):
                results[backend] = run(model, "attnkit")
        except attnkit.BackendUnavailableError:
            continue
    assert results, "no backend serves the float64 model"
    return results


@pytest.mark.parametrize("padding", PADDINGS)
def test_logits_and_every_parameter_gradient_agree_with_transformers(family, padding: str) -> None:
    name, model32, model64 = family
    ids = token_ids(2)
    mask = padding_mask(padding)
    run = functools.partial(logits_and_gradients, ids=ids, real=mask.bool(), attention_mask=mask)
    exact = run(model64, "exact_eager")
    baselines = {peer: run(model32, peer) for peer in (["eager", "sdpa"] if supports_sdpa(model32) else ["eager"])}
    peer64 = float64_peer(exact, baselines["eager"])
    for backend, attnkit64 in float64_backends(model64, run).items():
        assert_agree("float64", attnkit64, exact, peer64, f"{name} float64 attnkit on {backend}, against the oracle")
    attnkit32 = run(model32, "attnkit")
    for peer, baseline in baselines.items():
        assert_agree("float32", attnkit32, exact, baseline, f"{name} float32 attnkit, with {peer} as the baseline")
    if supports_sdpa(model64):  # the oracle itself, against a float64 peer
        sdpa64 = run(model64, "sdpa")
        assert_agree("float64", sdpa64, exact, peer64, f"{name} float64 sdpa against the test's oracle")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_on_a_left_padded_batch_matches_transformers(family, cache: str) -> None:
    name, _, model = family
    ids = token_ids(3)
    mask = padding_mask("left")
    references = ["exact_eager", "sdpa"] if supports_sdpa(model) else ["exact_eager"]
    tokens = {}
    for implementation in ["attnkit", *references]:
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            tokens[implementation] = model.generate(
                ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation=cache
            )[:, LENGTH:]
    for reference in references:
        assert torch.equal(tokens["attnkit"], tokens[reference]), (name, cache, reference, tokens)


def test_a_static_cache_unwritten_slots_are_never_read(family) -> None:
    """NaN in the slots a static cache has not written yet reaches no logit: they are beyond kv_lengths, padding
    (docs/semantics.md §5), and the decode step agrees with a dynamic cache's."""
    _, _, model = family
    model.set_attn_implementation("attnkit")
    ids, mask, step = token_ids(4), padding_mask("left"), token_ids(5, length=1)
    longer = torch.cat([mask, torch.ones(BATCH, 1, dtype=mask.dtype)], dim=1)

    def decode(cache: transformers.Cache, poison: bool) -> np.ndarray:
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
            for layer in cache.layers if poison else ():
                layer.keys[:, :, LENGTH:] = layer.values[:, :, LENGTH:] = float("nan")
            return model(step, attention_mask=longer, past_key_values=cache).logits.numpy()

    static = decode(transformers.StaticCache(config=model.config, max_cache_len=LENGTH + 4), poison=True)
    dynamic = {"logits": decode(transformers.DynamicCache(config=model.config), poison=False)}
    assert_agree("float64", {"logits": static}, dynamic, dynamic, "static cache with NaN unwritten slots")


# Where the queries and keys sit, (q_length, kv_length, q_offset, kv_offset), as transformers' caches report them.
GEOMETRIES = {
    "prefill": (8, 8, 0, 0),
    "decode": (1, 9, 8, 0),
    "chunked prefill": (3, 9, 6, 0),
    "static cache prefill": (8, 12, 0, 0),
    "static cache decode": (1, 12, 8, 0),
    # A dynamic sliding-window cache of 4 after 9 tokens keeps the last 3: keys at positions 6.. .
    "sliding cache decode": (1, 4, 9, 6),
    "sliding cache chunk": (3, 6, 9, 6),
}
PATTERNS = {
    "causal": masking_utils.causal_mask_function,
    "sliding 1": masking_utils.sliding_window_causal_mask_function(1),
    "sliding 3": masking_utils.sliding_window_causal_mask_function(3),
    "bidirectional": masking_utils.bidirectional_mask_function,
    "bidirectional sliding 2": masking_utils.sliding_window_bidirectional_mask_function(2),
}
TWO_D_PADDINGS = {
    "none": lambda length: [1] * length,
    "left": lambda length: [0, 0] + [1] * (length - 2),
    "right": lambda length: [1] * (length - 2) + [0, 0],
    "holes": lambda length: [1, 0] + [1] * (length - 3) + [0],
}


def visibility(made: attnkit_hf.AttnkitMask, batch: int) -> torch.Tensor:
    """What attnkit sees (docs/semantics.md §4, the oracle's visibility, segment ids included) of a mask made, its
    mask program (§17) ANDed in."""
    q = torch.empty(batch, 1, made.q_length, 1)
    k = torch.empty(batch, 1, made.kv_length, 1)
    inputs = AttentionInputs(q, k, k, kv_lengths=made.kv_lengths, q_segment_ids=made.q_segment_ids,
                             kv_segment_ids=made.kv_segment_ids)  # fmt: skip
    seen = oracle_visibility(made.spec(None, None), inputs, made.q_length, made.kv_length)
    if made.mask_mod is None:
        return seen
    bound = attnkit.programs.bind(made.mask_mod, ops_for(q, "q"), q, batch, 1, made.q_length, made.kv_length)
    return seen & dense(bound, batch, 1, made.q_length, made.kv_length, q)


@pytest.mark.parametrize("padding", sorted(TWO_D_PADDINGS))
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_the_mask_made_stands_for_exactly_transformers_mask(geometry: str, pattern: str, padding: str) -> None:
    """What attnkit sees of the mask made for transformers' raw facts equals transformers' own boolean mask, query
    by key: padding is a length (right padding from the row's start) or segment ids (left padding, holes, right
    padding behind a cache), never a mask."""
    q_length, kv_length, q_offset, kv_offset = GEOMETRIES[geometry]
    seen = q_offset + q_length
    two_d = torch.tensor([[1] * seen, TWO_D_PADDINGS[padding](seen)], dtype=torch.bool)
    facts = dict(batch_size=2, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                 mask_function=PATTERNS[pattern], attention_mask=two_d)  # fmt: skip
    expected = masking_utils.sdpa_mask(**facts, allow_is_causal_skip=False)
    made = attnkit_hf.make_mask(**facts)
    assert isinstance(made, attnkit_hf.AttnkitMask)
    if padding == "none" or (padding == "right" and q_offset == kv_offset):
        assert made.kv_segment_ids is None  # right padding is a length
    elif not two_d[1, kv_offset:].all():  # the cache holds pad positions
        assert made.q_segment_ids.shape == (2, q_length) and made.kv_segment_ids.shape == (2, kv_length)
    assert torch.equal(visibility(made, 2), expected)


# Packed rows (transformers reads them from position_ids): the lengths of the sequences in each row.
PACKINGS = {"two": [[5, 7], [5, 7]], "one-token and whole-row sequences": [[1, 4, 1, 6], [12]]}


def packed_mask_function(pattern: Callable, positions: torch.Tensor, ids: torch.Tensor) -> Callable:
    """The mask function transformers' create_causal_mask builds for packed rows, as the installed version writes it:
    one function up to 5.23, the pattern on the positions AND-ed with the same-sequence term from 5.24."""
    if hasattr(masking_utils, "packed_sequence_compatibility_function"):
        return masking_utils.packed_sequence_compatibility_function(pattern, positions, ids)
    return masking_utils.and_masks(
        masking_utils.remap_positions_for_packed_sequence(pattern, positions),
        masking_utils.packed_sequence_mask_function(ids),
    )


@pytest.mark.parametrize("packing", sorted(PACKINGS))
@pytest.mark.parametrize("pattern", ["causal", "sliding 1", "sliding 3"])
def test_packed_sequences_are_segment_ids_standing_for_transformers_mask(packing: str, pattern: str) -> None:
    """transformers' packed-sequence mask function (its own sequence ids, the pattern on the positions) becomes
    segment ids, one per sequence, whose visibility equals transformers' mask."""
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in PACKINGS[packing]])
    ids = masking_utils.find_packed_sequence_indices(positions)
    mask_function = packed_mask_function(PATTERNS[pattern], positions, ids)
    facts = dict(batch_size=2, q_length=LENGTH, kv_length=LENGTH, mask_function=mask_function)
    made = attnkit_hf.make_mask(**facts)
    assert isinstance(made, attnkit_hf.AttnkitMask) and made.kv_segment_ids is ids
    assert torch.equal(visibility(made, 2), masking_utils.sdpa_mask(**facts, allow_is_causal_skip=False))


def test_packed_sequences_agree_with_transformers() -> None:
    """Two sequences packed in each row, told apart by position_ids: segment ids, whole model."""
    _, _, model = build("llama")
    ids = token_ids(6)
    positions = torch.cat([torch.arange(5), torch.arange(LENGTH - 5)]).expand(BATCH, -1)
    exact = logits_and_gradients(model, "exact_eager", ids, position_ids=positions)
    ours = logits_and_gradients(model, "attnkit", ids, position_ids=positions)
    assert_agree("float64", ours, exact, exact, "packed sequences")


@pytest.mark.parametrize("mask_dtype", ["bool", "additive"])
def test_a_four_d_mask_from_the_caller_is_the_whole_truth(mask_dtype: str) -> None:
    """A caller's own 4-D mask (boolean, or additive floats as eager takes them) is used as given."""
    _, _, model = build("llama")
    ids = token_ids(7)
    visible = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril(-2).logical_not().tril()  # causal, last 2 keys
    visible = visible.expand(BATCH, 1, LENGTH, LENGTH)
    mask = (
        visible
        if mask_dtype == "bool"
        else torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, -1e30)
    )
    expected = logits_and_gradients(model, "sdpa", ids, attention_mask=mask)
    got = logits_and_gradients(model, "attnkit", ids, attention_mask=mask)
    assert_agree("float64", got, expected, expected, f"caller's {mask_dtype} 4-D mask")


@pytest.mark.parametrize("sliding_window", [None, 1, 3])
def test_without_a_mask_is_causal_and_sliding_window_decide(sliding_window: int | None) -> None:
    """An attention module called with no mask (nothing made one): causal from the module, the window from the
    call (N keys, the query's own included), against eager on transformers' own mask for the same pattern."""
    generator = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, heads, 6, 8, generator=generator, dtype=torch.float64) for heads in (4, 2, 2))
    module = torch.nn.Module()
    module.is_causal = True
    pattern = masking_utils.causal_mask_function
    if sliding_window is not None:
        pattern = masking_utils.sliding_window_causal_mask_function(sliding_window)
    mask = masking_utils.eager_mask(2, 6, 6, mask_function=pattern, dtype=torch.float64)
    expected = {"out": exact_eager(module, q, k, v, mask, scaling=0.3)[0].numpy()}
    got = {"out": attnkit_hf.attention(module, q, k, v, None, scaling=0.3, sliding_window=sliding_window)[0].numpy()}
    assert_agree("float64", got, expected, expected, f"no mask, sliding_window={sliding_window}")


def test_attention_dropout_trains_repeatably_under_torch_manual_seed() -> None:
    """attention_dropout = 0.1 in training is attnkit's dropout (§18), its seeds drawn from torch's generator: a
    training step repeats bit for bit under the same torch.manual_seed (loss and every parameter gradient), differs
    under another, and drops something (its loss is not dropout 0's); in eval transformers passes dropout 0."""
    _, model, _ = build("llama")
    model.set_attn_implementation("attnkit")
    layers = [layer.self_attn for layer in model.model.layers]
    ids = token_ids(9)

    def run(seed: int, dropout: float) -> list[torch.Tensor]:
        for layer in layers:
            layer.attention_dropout = dropout
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        if not model.training:
            with torch.no_grad():
                return [model(ids).logits]
        loss = model(ids, labels=ids).loss
        loss.backward()
        return [loss.detach(), *(parameter.grad for parameter in model.parameters())]

    try:
        first, again, other, undropped = run(1, 0.1), run(1, 0.1), run(2, 0.1), run(1, 0.0)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), "a training step did not repeat"
        assert not torch.equal(first[0], other[0]), "another seed gave the same loss"
        assert not torch.equal(first[0], undropped[0]), "dropout 0.1 gave dropout 0's loss"
        model.eval()
        assert torch.equal(run(1, 0.1)[0], run(2, 0.1)[0]), "eval mode dropped"
    finally:
        model.train()
        for layer in layers:
            layer.attention_dropout = 0.0


@pytest.mark.parametrize("argument", ["position_bias", "cache"])
def test_what_attnkit_cannot_express_is_refused(argument: str) -> None:
    """A T5 position bias, a paged KV cache: a typed error naming the argument."""
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(attnkit.InvalidInputError, match=f"{argument} is given"):
        attnkit_hf.attention(torch.nn.Module(), q, q, q, None, **{argument: torch.zeros(1)})


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_forced_backend_serves_every_call(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """register(backend=...) or ATTNKIT_TRANSFORMERS_BACKEND names the backend of every call; a backend that
    cannot serve torch tensors then refuses the model's calls rather than anything falling back."""
    _, model, _ = build("llama")
    model.set_attn_implementation("attnkit")
    try:
        if how == "argument":
            attnkit_hf.register(backend="jax-reference")
        else:
            monkeypatch.setenv(attnkit_hf.BACKEND_ENV, "jax-reference")
            attnkit_hf.register()
        with pytest.raises(attnkit.BackendUnavailableError, match="jax-reference"):
            model(token_ids(10))
        with pytest.raises(attnkit.UnknownBackendError, match="no-such-backend"):
            attnkit_hf.register(backend="no-such-backend")
    finally:
        attnkit_hf.register(backend="auto")


@pytest.mark.parametrize(
    "name, feature", [("gemma2", "softcap"), ("gemma2", "window"), ("mistral", "window"), ("gpt_oss", "sinks")]
)
def test_the_models_exercise_what_they_are_here_for(name: str, feature: str) -> None:
    """Softcap and the sliding windows change these models' logits far beyond any tolerance, so the comparisons
    above check them (the sequence is longer than the windows and the scores are of order 1)."""
    _, _, model = build(name)
    model.set_attn_implementation("exact_eager")
    ids = token_ids(11)
    with torch.no_grad():
        with_it = model(ids).logits
        if feature == "sinks":
            sinks = [layer.self_attn.sinks for layer in model.model.layers]
            saved = [parameter.detach().clone() for parameter in sinks]
            for parameter in sinks:
                parameter.data.fill_(float("-inf"))  # no sink
            without = model(ids).logits
            for parameter, value in zip(sinks, saved):
                parameter.data.copy_(value)
        elif feature == "softcap":
            modules = [layer.self_attn for layer in model.model.layers]
            for module in modules:
                module.attn_logit_softcapping = None
            without = model(ids).logits
            for module in modules:
                module.attn_logit_softcapping = model.config.attn_logit_softcapping
        else:
            window, model.config.sliding_window = model.config.sliding_window, LENGTH
            without = model(ids).logits
            model.config.sliding_window = window
    assert (with_it - without).abs().max() > 1e-3


# Under torch.compile(fullgraph=True): aot_eager (AOTAutograd's forward and backward graphs, no code generation).
COMPILED_PADDINGS = [("llama", "left"), ("llama", "right"), ("gemma2", "left")]


@pytest.fixture
def compile_counter() -> Any:
    torch._dynamo.reset()  # every test counts its own traces, whatever an earlier test compiled for the same code
    return torch._dynamo.testing.CompileCounterWithBackend("aot_eager")


@pytest.mark.parametrize("name, padding", COMPILED_PADDINGS)
def test_a_compiled_training_step_agrees_with_transformers(compile_counter, name: str, padding: str) -> None:
    """torch.compile(model, fullgraph=True): logits and every parameter gradient against the float64 oracle (and
    float64 sdpa where the model takes it), with no graph break, and the second step not traced again."""
    _, _, model = build(name)
    ids, mask = token_ids(12), padding_mask(padding)
    run = functools.partial(logits_and_gradients, ids=ids, real=mask.bool(), attention_mask=mask)
    exact = run(model, "exact_eager")
    peers = {"oracle": exact, "sdpa": run(model, "sdpa")} if supports_sdpa(model) else {"oracle": exact}
    compiled = torch.compile(model, fullgraph=True, backend=compile_counter)
    traces = []
    for step in range(2):
        got = logits_and_gradients(model, "attnkit", ids, real=mask.bool(), attention_mask=mask, forward=compiled)
        traces.append(compile_counter.frame_count)
        for peer, expected in peers.items():
            assert_agree("float64", got, expected, expected, f"{name} compiled, step {step}, against {peer}")
    # The first step traced (Gemma2's float64 embedding scale makes Dynamo restart that trace once: two backend calls
    # for one frame, with the sdpa or eager attention too); the second reuses it.
    assert traces[0] >= 1 and traces[1] == traces[0], traces


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_compiled_static_cache_decoding_matches_eager_without_a_trace_per_step(compile_counter, name: str) -> None:
    """The compiled-generate setup, by hand: an eager prefill of a left-padded batch into a StaticCache, then decode
    steps through the compiled forward (the mask made inside the graph, from the cache's q_offset tensor). The
    tokens equal the float64 oracle's (decoding eagerly), and no step is traced again once the cache offsets are
    symbolic: Llama's full layers read a tensor offset (one trace); Gemma2's sliding layers keep a Python int, which
    transformers itself (any attention) specialises on the first step and makes dynamic on the second."""
    _, _, model = build(name)
    ids, mask, steps = token_ids(13), padding_mask("left"), 4
    full_mask = torch.cat([mask, torch.ones(BATCH, steps, dtype=mask.dtype)], dim=1)  # one shape for every step
    positions = full_mask.cumsum(1) - 1

    def decode(implementation: str, forward: Callable[..., Any]) -> tuple[torch.Tensor, list[int]]:
        model.set_attn_implementation(implementation)
        cache = transformers.StaticCache(config=model.config, max_cache_len=LENGTH + steps)
        traces = []
        with torch.no_grad():
            tokens = [model(ids, attention_mask=mask, past_key_values=cache).logits[:, -1].argmax(-1)]
            for step in range(LENGTH, LENGTH + steps - 1):
                logits = forward(tokens[-1][:, None], attention_mask=full_mask, past_key_values=cache,
                                 position_ids=positions[:, step : step + 1]).logits  # fmt: skip
                tokens.append(logits[:, -1].argmax(-1))
                traces.append(compile_counter.frame_count)
        return torch.stack(tokens, dim=1), traces

    exact, _ = decode("exact_eager", model)
    compiled, traces = decode("attnkit", torch.compile(model, fullgraph=True, backend=compile_counter))
    assert torch.equal(compiled, exact), (exact, compiled)
    settled = traces[0] if name == "llama" else traces[1]
    assert traces[-1] == settled, traces
