"""Attention dropout (docs/semantics.md §18): the generator against Random123's known answers in every implementation,
each declaring backend's keep-mask bit for bit against the reference, the mask's statistics, the seed's forms and the
errors for bad input. Outputs and gradients against the oracle are the conformance suite's (dropout is drawn there)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import attnkit
from attnkit import AttentionSpec
from attnkit.backend import Dropout, Feature
from attnkit.contract import dropout as torch_dropout
from attnkit.contract import philox
from attnkit.errors import InvalidInputError, InvalidInputTypeError
from attnkit.testing import Case, runners
from attnkit.testing.runners import harness_capabilities, run_backend
from tests.conftest import available_backends, backend_params

SEED = 0xF00D_CAFE_1234_5678  # high word's top bit set: the seed is read unsigned


def _torch_seed(seed: int) -> torch.Tensor:
    return torch.tensor(seed - (1 << 64) if seed >= 1 << 63 else seed, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------- known answers


@pytest.mark.parametrize("counter, key, expected", philox.KNOWN_ANSWERS)
def test_reference_gives_known_answers(counter: Any, key: Any, expected: Any) -> None:
    words = philox.philox4x32(tuple(np.array(word) for word in counter), key)
    assert tuple(int(word) for word in words) == expected


@pytest.mark.parametrize("counter, key, expected", philox.KNOWN_ANSWERS)
def test_torch_generator_gives_known_answers(counter: Any, key: Any, expected: Any) -> None:
    words = torch_dropout.philox4x32(tuple(torch.tensor(w) for w in counter), tuple(torch.tensor(w) for w in key))
    assert tuple(int(word) for word in words) == expected


@pytest.mark.parametrize("counter, key, expected", philox.KNOWN_ANSWERS)
def test_jax_generator_gives_known_answers(counter: Any, key: Any, expected: Any) -> None:
    jnp = pytest.importorskip("jax.numpy")
    from attnkit.contract import jax as jax_contract

    words = jax_contract.philox4x32(tuple(jnp.uint32(w) for w in counter), tuple(jnp.uint32(w) for w in key))
    assert tuple(int(word) for word in words) == expected


def _triton_kernels() -> tuple[Any, Any]:
    """The triton backend's launch module and the test kernels of its dropout helpers; skips where it cannot run."""
    if "triton" not in available_backends():
        pytest.skip("triton is unavailable here")
    from attnkit.backends.triton import launch

    from tests import triton_dropout_kernel

    return launch, triton_dropout_kernel


@pytest.mark.parametrize("counter, key, expected", philox.KNOWN_ANSWERS)
def test_triton_generator_gives_known_answers(counter: Any, key: Any, expected: Any) -> None:
    """The Triton kernels' generator (interpreted here; compiled on a GPU), a 4-word counter and the seed as its key."""
    launch, test_kernels = _triton_kernels()
    device = launch.KERNEL_DEVICE
    words = torch.zeros(4, dtype=torch.int32, device=device)
    counter_bits = torch.tensor([word - (1 << 32) if word >> 31 else word for word in counter], dtype=torch.int32)
    test_kernels.philox_words[(1,)](words, counter_bits.to(device), _torch_seed(key[0] | key[1] << 32).to(device))
    assert tuple(int(word) & 0xFFFFFFFF for word in words.cpu()) == expected


def test_triton_keep_step_is_the_references() -> None:
    """The Triton kernels' keep step on a tile of a shard, with the launcher's arguments: offsets added (a key offset
    off a counter's four keys), p above 1/2 (the threshold's top bit set, passed as a negative int32, compared
    unsigned), the seed's top bit set."""
    launch, test_kernels = _triton_kernels()
    device = torch.device(launch.KERNEL_DEVICE)
    dropout = Dropout(0.7, _torch_seed(SEED), head_start=2, query_start=3, key_start=5)
    tile = torch.zeros(16, 32, dtype=torch.int8, device=device)
    arguments = launch.dropout_arguments(dropout, device)
    test_kernels.keep_tile[(1,)](tile, 1, 1, *arguments, BLOCK_M=16, BLOCK_N=32)
    expected = philox.keep_mask(SEED, 0.7, 2, 4, 3 + 16, 5 + 32)[1, 1 + 2, 3:, 5:]
    np.testing.assert_array_equal(tile.cpu().numpy().astype(bool), expected)


def test_reference_rounds_are_random123s() -> None:
    """Seven rounds give Random123's 7-round answer: the round count is a parameter, not baked into one vector."""
    zero = tuple(np.array(0) for _ in range(4))
    words = philox.philox4x32(zero, (0, 0), rounds=7)
    assert tuple(int(w) for w in words) == (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)


def test_torch_and_jax_masks_are_the_references() -> None:
    """The tile functions of the torch and JAX backends, on a tile that starts off a counter's four keys."""
    reference = philox.keep_mask(SEED, 0.3, 2, 3, 9, 23)
    index = [torch.arange(n).view(shape) for n, shape in ((2, (-1, 1, 1, 1)), (3, (1, -1, 1, 1)), (9, (1, 1, -1, 1)))]
    tile = torch_dropout.keep_tile(Dropout(0.3, _torch_seed(SEED)), *index, 5, 23)
    np.testing.assert_array_equal(tile.numpy(), reference[..., 5:])
    jnp = pytest.importorskip("jax.numpy")
    from attnkit.contract import jax as jax_contract

    b, h, i, j = (jnp.arange(n).reshape(shape) for n, shape in ((2, (-1, 1, 1, 1)), (3, (1, -1, 1, 1)),
                                                                 (9, (1, 1, -1, 1)), (23, (1, 1, 1, -1))))  # fmt: skip
    low, high = jnp.uint32(SEED & 0xFFFFFFFF), jnp.uint32(SEED >> 32)
    keep = jax_contract.dropout_keep(low, high, round(0.3 * 2**32), b, h, i, j)
    np.testing.assert_array_equal(np.asarray(keep), reference)


def test_public_mask_is_the_references_layout() -> None:
    """attnkit.dropout_keep_mask as §18 words it, element by element from the generator itself."""
    mask = attnkit.dropout_keep_mask(SEED, 0.5, batch=2, heads=2, len_q=3, len_k=6)
    threshold = round(0.5 * 2**32)
    for b, h, i, j in np.ndindex(mask.shape):
        counter = tuple(np.array(word) for word in (j >> 2, i, h, b))
        word = int(philox.philox4x32(counter, (SEED & 0xFFFFFFFF, SEED >> 32))[j & 3])
        assert mask[b, h, i, j] == (word >= threshold)


# ---------------------------------------------------------------------------------------------- backends' masks


def _kept(backend: str, case: Case) -> np.ndarray:
    """The keep-mask ``backend`` applies, read through attend: with q = 0 every visible key has the same probability,
    and one-hot values carry each key's kept probability (0 where dropped) to an output column of its own."""
    assert case.dropout is not None
    width = case.head_dim_v
    kept = np.zeros((case.batch, case.heads_q, case.len_q, case.len_k), dtype=bool)
    for first in range(0, case.len_k, width):
        v = np.zeros((case.batch, case.heads_kv, case.len_k, width))
        keys = np.arange(first, min(first + width, case.len_k))
        v[:, :, keys, keys - first] = 1.0
        arrays = {
            "q": np.zeros((case.batch, case.heads_q, case.len_q, case.head_dim)),
            "k": np.ones((case.batch, case.heads_kv, case.len_k, case.head_dim)),
            "v": v,
            "dout": np.zeros((case.batch, case.heads_q, case.len_q, width)),
            "dlse": np.zeros((case.batch, case.heads_q, case.len_q)),
        }
        out = run_backend(case, arrays, backend)["out"]
        kept[..., keys] = out[..., : len(keys)] != 0
    return kept


@pytest.mark.parametrize("len_k", [64, 65])  # on a tile edge and one off it
@pytest.mark.parametrize("backend", backend_params())
def test_backend_keep_mask_is_the_references(backend: str, len_k: int) -> None:
    if Feature.DROPOUT not in harness_capabilities(backend).features:
        pytest.skip(f"{backend} does not declare dropout")
    case = Case(AttentionSpec(), batch=2, heads_q=4, heads_kv=2, len_q=17, len_k=len_k, head_dim=16, head_dim_v=64,
                grad=False, dropout=(0.3, SEED))  # fmt: skip
    expected = philox.keep_mask(SEED, 0.3, 2, 4, 17, len_k)
    np.testing.assert_array_equal(_kept(backend, case), expected)


@pytest.mark.parametrize("backend", backend_params())
def test_backend_keep_mask_of_a_part_is_the_larger_calls(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that is part of a larger one (attnkit.distributed's blocks and head groups) passes a Dropout with the
    offsets of its first query head, query and key as ``dropout_seed``: its mask is the larger call's there (the key
    offset off a word boundary)."""
    if Feature.DROPOUT not in harness_capabilities(backend).features:
        pytest.skip(f"{backend} does not declare dropout")
    heads, queries, keys = 3, 5, 6
    part = Dropout(0.3, SEED, head_start=heads, query_start=queries, key_start=keys)
    monkeypatch.setattr(runners, "dropout_of", lambda case: {"dropout_p": part.p, "dropout_seed": part})
    case = Case(AttentionSpec(), batch=2, heads_q=4, heads_kv=2, len_q=7, len_k=21, head_dim=16, head_dim_v=32,
                grad=False, dropout=(0.3, SEED))  # fmt: skip
    larger = philox.keep_mask(SEED, 0.3, 2, heads + 4, queries + 7, keys + 21)
    np.testing.assert_array_equal(_kept(backend, case), larger[:, heads:, queries:, keys:])


@pytest.mark.parametrize("planted", ["query and key swapped", "word off by one"])
def test_planted_generator_bugs_fail(planted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mask test above fails where the counter or the word index is wrong (planted in torch-chunked's generator)."""
    real = torch_dropout.philox4x32

    def swapped(counter: Any, key: Any) -> Any:
        column, row, head, batch = counter
        return real((row >> 2, column * 4, head, batch), key)

    def shifted(counter: Any, key: Any) -> Any:
        words = real(counter, key)
        return (*words[1:], words[0])

    monkeypatch.setattr(torch_dropout, "philox4x32", swapped if planted.startswith("query") else shifted)
    case = Case(AttentionSpec(), batch=1, heads_q=2, heads_kv=1, len_q=9, len_k=12, head_dim=16, head_dim_v=16,
                grad=False, dropout=(0.5, SEED))  # fmt: skip
    assert not np.array_equal(_kept("torch-chunked", case), philox.keep_mask(SEED, 0.5, 1, 2, 9, 12))


# ---------------------------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
def test_kept_fraction_is_one_minus_p(p: float) -> None:
    """Over 2²⁰ elements the kept fraction lies within 5σ of 1 − p."""
    mask = philox.keep_mask(SEED + int(p * 100), p, 2, 4, 256, 512)
    n = mask.size
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(mask.mean() - (1 - p)) < 5 * sigma, (mask.mean(), 1 - p, sigma)


@pytest.mark.parametrize("axis", [0, 1, 2, 3], ids=["batch rows", "heads", "queries", "keys"])
def test_neighbours_are_independent(axis: int) -> None:
    """A 2×2 χ² test of each element against its neighbour along an axis (keys: within a counter's four words and
    across counters), at significance 10⁻⁴ with a fixed seed."""
    mask = philox.keep_mask(SEED, 0.5, 4, 4, 128, 128)
    first = np.moveaxis(mask, axis, 0)[:-1].ravel()
    second = np.moveaxis(mask, axis, 0)[1:].ravel()
    table = np.array([[np.sum(~first & ~second), np.sum(~first & second)],
                      [np.sum(first & ~second), np.sum(first & second)]], dtype=float)  # fmt: skip
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    assert chi2 < 15.14, chi2  # χ²(1) at 10⁻⁴


# ---------------------------------------------------------------------------------------------- the API


def _small() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 5, 8, generator=generator) for _ in range(3))  # type: ignore[return-value]


def test_seed_forms_agree_in_torch() -> None:
    q, k, v = _small()
    spec = AttentionSpec()
    by_int = attnkit.attend(spec, q, k, v, dropout_p=0.4, dropout_seed=SEED, backend="torch-chunked")
    by_tensor = attnkit.attend(spec, q, k, v, dropout_p=0.4, dropout_seed=_torch_seed(SEED), backend="torch-chunked")
    torch.testing.assert_close(by_int, by_tensor, rtol=0, atol=0)
    other = attnkit.attend(spec, q, k, v, dropout_p=0.4, dropout_seed=SEED + 1, backend="torch-chunked")
    assert not torch.equal(by_int, other)


def test_drawn_seed_repeats_under_manual_seed() -> None:
    q, k, v = _small()
    spec = AttentionSpec()
    torch.manual_seed(7)
    first = attnkit.attend(spec, q, k, v, dropout_p=0.4, backend="torch-chunked")
    second = attnkit.attend(spec, q, k, v, dropout_p=0.4, backend="torch-chunked")
    torch.manual_seed(7)
    again = attnkit.attend(spec, q, k, v, dropout_p=0.4, backend="torch-chunked")
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first, second)


def test_zero_p_is_no_dropout_and_draws_nothing() -> None:
    q, k, v = _small()
    state = torch.get_rng_state()
    out = attnkit.attend(AttentionSpec(), q, k, v, dropout_p=0.0, backend="torch-chunked")
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(out, attnkit.attend(AttentionSpec(), q, k, v, backend="torch-chunked"))


@pytest.mark.parametrize(
    "arguments, error, words",
    [
        ({"dropout_p": 1.0}, InvalidInputError, "dropout_p=1.0"),
        ({"dropout_p": -0.1}, InvalidInputError, "dropout_p=-0.1"),
        ({"dropout_p": float("nan")}, InvalidInputError, "dropout_p=nan"),
        ({"dropout_p": 1 - 2**-40}, InvalidInputError, "dropout_p"),
        ({"dropout_p": torch.tensor(0.1)}, InvalidInputTypeError, "dropout_p must be a Python float"),
        ({"dropout_p": True}, InvalidInputTypeError, "dropout_p must be a Python float"),
        ({"dropout_p": 0.1, "dropout_seed": -1}, InvalidInputError, "dropout_seed=-1"),
        ({"dropout_p": 0.1, "dropout_seed": 1 << 64}, InvalidInputError, "outside [0, 2**64)"),
        ({"dropout_p": 0.1, "dropout_seed": 1.5}, InvalidInputTypeError, "dropout_seed must be an integer"),
        ({"dropout_p": 0.1, "dropout_seed": torch.tensor(3)}, None, None),
        ({"dropout_p": 0.1, "dropout_seed": torch.tensor([3])}, InvalidInputTypeError, "0-d int64"),
        ({"dropout_p": 0.1, "dropout_seed": torch.tensor(3, dtype=torch.int32)}, InvalidInputTypeError, "0-d int64"),
        ({"dropout_p": 0.1, "dropout_key": 3}, InvalidInputTypeError, "dropout_key is taken by JAX"),
        ({"dropout_p": 0.0, "dropout_seed": "x"}, InvalidInputTypeError, "dropout_seed must be an integer"),
    ],
)
def test_bad_dropout_arguments_name_themselves(arguments: dict[str, Any], error: Any, words: str | None) -> None:
    q, k, v = _small()
    if error is None:
        attnkit.attend(AttentionSpec(), q, k, v, backend="torch-chunked", **arguments)
        return
    with pytest.raises(error, match=None) as raised:
        attnkit.attend(AttentionSpec(), q, k, v, backend="torch-chunked", **arguments)
    assert words in str(raised.value)


def test_jax_seed_forms_agree() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v = (jnp.asarray(t.numpy()) for t in _small())
    spec = AttentionSpec()
    key = jax.random.key(42)
    words = jax.random.bits(key, (2,), jnp.uint32)
    seed = int(words[0]) | int(words[1]) << 32
    by_key = attnkit.attend(spec, q, k, v, dropout_p=0.4, dropout_key=key, backend="jax-reference")
    by_int = attnkit.attend(spec, q, k, v, dropout_p=0.4, dropout_seed=seed, backend="jax-reference")
    by_words = attnkit.attend(spec, q, k, v, dropout_p=0.4, dropout_seed=words, backend="jax-reference")
    np.testing.assert_array_equal(np.asarray(by_key), np.asarray(by_int))
    np.testing.assert_array_equal(np.asarray(by_key), np.asarray(by_words))
    with pytest.raises(InvalidInputError, match="needs dropout_key"):
        attnkit.attend(spec, q, k, v, dropout_p=0.4, backend="jax-reference")
    with pytest.raises(InvalidInputTypeError, match="pass it as dropout_key"):
        attnkit.attend(spec, q, k, v, dropout_p=0.4, dropout_seed=key, backend="jax-reference")
    with pytest.raises(InvalidInputTypeError, match="dropout_key must be a PRNG key"):
        attnkit.attend(spec, q, k, v, dropout_p=0.4, dropout_key=5, backend="jax-reference")
    with pytest.raises(InvalidInputError, match="both given"):
        attnkit.attend(spec, q, k, v, dropout_p=0.4, dropout_key=key, dropout_seed=1, backend="jax-reference")


def test_jax_seed_is_traced_under_jit() -> None:
    """A jitted function taking the seed's (2,) uint32 words compiles once: new seeds are values, and each gives the
    mask an eager call with that seed does (the outputs equal up to the fused program's rounding; another mask would
    move them by tenths)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from attnkit.backends.reference import jax_reference

    q, k, v = (jnp.asarray(t.numpy()) for t in _small())
    spec = AttentionSpec()

    @jax.jit
    def attend(seed: Any) -> Any:
        return attnkit.attend(spec, q, k, v, dropout_p=0.4, dropout_seed=seed, backend="jax-reference")

    outs, compiled = [], []
    for seed in (SEED, SEED + 1):
        words = jnp.array([seed & 0xFFFFFFFF, seed >> 32], dtype=jnp.uint32)
        outs.append(attend(words))
        eager = attnkit.attend(spec, q, k, v, dropout_p=0.4, dropout_seed=seed, backend="jax-reference")
        np.testing.assert_allclose(np.asarray(outs[-1]), np.asarray(eager), rtol=1e-5, atol=1e-6)
        compiled.append(jax_reference._compiled()[0]._cache_size())  # the backend's own jit, called eagerly
    assert attend._cache_size() == 1
    assert compiled[0] == compiled[1]
    assert not np.array_equal(np.asarray(outs[0]), np.asarray(outs[1]))


@pytest.mark.parametrize("backend", ["jax-reference", "pallas"])
def test_jax_offsets_place_a_part_in_the_whole_calls_mask(backend: str) -> None:
    """A backend given a part of a larger call (its query heads, queries and keys from offsets that are traced, as a
    rank's are inside shard_map) applies the larger call's mask there. With q = 0 and one-hot values, out[..., j] is
    key j's kept probability, 0 where dropped."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from attnkit.backend import AttentionInputs

    batch, heads_q, heads_kv, len_q, len_k = 2, 4, 2, 9, 16
    q = jnp.zeros((batch, heads_q, len_q, 16), jnp.float32)
    k = jnp.ones((batch, heads_kv, len_k, 16), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(len_k, dtype=jnp.float32), (batch, heads_kv, len_k, len_k))
    seed = jnp.array([SEED & 0xFFFFFFFF, SEED >> 32], jnp.uint32)
    implementation = attnkit.get_backend(backend)

    @jax.jit
    def forward(offsets: Any) -> Any:
        inputs = AttentionInputs(q, k, v, dropout=Dropout(0.3, seed, *offsets))
        return implementation.forward(AttentionSpec(), inputs, need_lse=False)[0]

    out = forward(tuple(jnp.int32(offset) for offset in (2, 5, 7)))
    whole = philox.keep_mask(SEED, 0.3, batch, heads_q + 2, len_q + 5, len_k + 7)
    np.testing.assert_array_equal(np.asarray(out) != 0, whole[:, 2:, 5:, 7:])


def test_native_backends_say_why_they_refuse() -> None:
    q, k, v = _small()
    text = attnkit.explain(AttentionSpec(), q, k, v, dropout_p=0.1, dropout_seed=1)
    assert "dropout is not supported (SDPA draws dropout from its own generator" in text
