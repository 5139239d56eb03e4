"""attend_paged (docs/semantics.md §13) on JAX arrays, in every JAX backend declaring ``Feature.PAGED``, against
torch-naive's literal reading in float64 on the same values: block tables with shared and out-of-order blocks, −1
or garbage past each sequence's blocks, NaN in every slot no sequence reads, block sizes that do not divide the
kernels' key tile, under jax.jit (the table and lengths traced); and pallas' split-K decode forced onto the
interpreter, for rows whose keys fill every key range, some, and none."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from attnkit import AttentionSpec, attend_paged, registry  # noqa: E402
from attnkit.backend import AttentionInputs, Feature, Framework  # noqa: E402
from attnkit.errors import InvalidInputError  # noqa: E402
from attnkit.ragged import prepare_paged  # noqa: E402
from attnkit.testing.agreement import ORACLE, compare_outputs  # noqa: E402
from tests.conftest import available_backends  # noqa: E402

JAX_PAGED_BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(name not in available_backends(), reason=f"{name} not available"))
    for name, backend in sorted(registry.backends().items())
    if Feature.PAGED in backend.capabilities.features and Framework.JAX in backend.capabilities.frameworks
]


class Paged(NamedTuple):
    spec: AttentionSpec
    len_q: int
    heads_q: int
    heads_kv: int
    block_size: int
    kv_lengths: tuple[int, ...]


# pallas' interpreted key tile is 16 keys: blocks of 3 and 4 are smaller and do not divide it, 24 is larger and is
# read in tiles of 12. Lq > 1 aligned bottom-right and top-left, an empty sequence, GQA and MQA.
CASES = {
    "causal-gqa-block4": Paged(AttentionSpec(causal=True, layout="bshd"), 3, 4, 2, 4, (0, 5, 8, 13)),
    "window-softcap-top-left-block3": Paged(
        AttentionSpec(causal=True, causal_alignment="top_left", window=(4, 1), softcap=8.0), 2, 2, 2, 3, (3, 11, 16)
    ),
    "cosine-mqa-block24": Paged(AttentionSpec(variant="cosine", scale=4.0, layout="bshd"), 1, 2, 1, 24, (40, 1, 70)),
}


def _paged_arrays(case: Paged, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 arrays of the case: a random table (blocks shared between sequences, in any order), −1 or far outside
    the cache past each sequence's blocks, NaN in every cache slot none reads."""
    rng = np.random.default_rng(seed)
    batch, head_dim, size = len(case.kv_lengths), 16, case.block_size
    needed = [-(-length // size) for length in case.kv_lengths]
    max_blocks, num_blocks = max(needed) + 1, max(needed) + 3
    table = rng.integers(0, num_blocks, (batch, max_blocks)).astype(np.int32)
    read = np.zeros((num_blocks, size), bool)
    for b, (length, blocks) in enumerate(zip(case.kv_lengths, needed)):
        table[b, blocks:] = -1 if b % 2 else 1 << 30
        for j in range(length):
            read[table[b, j // size], j % size] = True
    assert not read.all(), "some slot must hold NaN"
    caches = rng.standard_normal((2, num_blocks, size, case.heads_kv, head_dim)).astype(np.float32)
    caches[:, ~read] = np.nan
    q_shape = (batch, case.len_q, case.heads_q, head_dim)
    if case.spec.layout.value == "bhsd":
        q_shape = (batch, case.heads_q, case.len_q, head_dim)
    q = rng.standard_normal(q_shape).astype(np.float32)
    lengths = np.asarray(case.kv_lengths, np.int32)
    return {"q": q, "k_cache": caches[0], "v_cache": caches[1], "block_table": table, "kv_lengths": lengths}


def _oracle(spec: AttentionSpec, arrays: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """torch-naive's literal reading: float64 (exact) and at float32 (the baseline of the tolerance rule)."""

    def run(dtype: Any) -> dict[str, np.ndarray]:
        tensors = {name: torch.from_numpy(value) for name, value in arrays.items()}
        for name in ("q", "k_cache", "v_cache"):
            tensors[name] = tensors[name].to(dtype)
        out, lse = attend_paged(spec, **tensors, return_lse=True, backend=ORACLE)
        return {"out": out.double().numpy(), "lse": lse.double().numpy()}

    exact = run(torch.float64)
    assert np.isfinite(exact["out"]).all(), "the oracle itself let padding leak"
    return exact, run(torch.float32)


def _check(spec: AttentionSpec, arrays: dict[str, np.ndarray], out: Any, lse: Any) -> None:
    results = {"out": np.asarray(out, np.float64), "lse": np.asarray(lse, np.float64)}
    comparisons = compare_outputs("float32", results, *_oracle(spec, arrays))
    assert all(comparison.ok for comparison in comparisons), [str(c) for c in comparisons]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", JAX_PAGED_BACKENDS)
def test_paged_jax_agrees_with_the_oracle(backend: str, case: str) -> None:
    spec = CASES[case].spec
    arrays = _paged_arrays(CASES[case])
    out, lse = attend_paged(spec, **{n: jnp.asarray(x) for n, x in arrays.items()}, return_lse=True, backend=backend)
    _check(spec, arrays, out, lse)


@pytest.mark.parametrize("backend", JAX_PAGED_BACKENDS)
def test_paged_under_jit(backend: str) -> None:
    """The table and lengths are tracers: their values go unchecked (§11) and the kernels read through them."""
    case = CASES["causal-gqa-block4"]
    arrays = _paged_arrays(case, seed=1)
    run = jax.jit(lambda *xs: attend_paged(case.spec, *xs, return_lse=True, backend=backend))
    out, lse = run(*(jnp.asarray(arrays[n]) for n in ("q", "k_cache", "v_cache", "block_table", "kv_lengths")))
    _check(case.spec, arrays, out, lse)


def test_paged_jax_arrays_are_validated() -> None:
    """prepare_paged reads concrete JAX tables as it reads torch ones: a read entry outside the cache is named."""
    arrays = {n: jnp.asarray(x) for n, x in _paged_arrays(CASES["causal-gqa-block4"]).items()}
    arrays["block_table"] = arrays["block_table"].at[3, 0].set(99)
    with pytest.raises(InvalidInputError, match=r"block_table\[3, 0\]=99 points outside the cache"):
        attend_paged(CASES["causal-gqa-block4"].spec, **arrays, backend="jax-reference")


def _pallas(decode_splits: int) -> Any:
    if "pallas" not in available_backends():
        pytest.skip("pallas not available")
    from attnkit.backends.pallas.backend import PallasBackend

    return PallasBackend(interpret=True, decode_splits=decode_splits)


def test_pallas_split_k_paged_decode() -> None:
    """Three key ranges of five 16-key tiles over a 240-key cache: kv_lengths 240, 90 and 0 fill all three ranges,
    some, and none (out 0, lse −inf, no NaN from an empty range's merge)."""
    case = Paged(AttentionSpec(causal=True, window=(100, 0), layout="bshd"), 1, 4, 2, 16, (240, 90, 0))
    arrays = _paged_arrays(case, seed=2)
    backend = _pallas(decode_splits=3)
    _, inputs = prepare_paged(case.spec, *(jnp.asarray(x) for x in arrays.values()), return_lse=True)
    out, lse = backend.forward_paged(case.spec, inputs, need_lse=True)
    _check(case.spec, arrays, out, lse)


def test_pallas_split_k_decode_on_contiguous_keys() -> None:
    """attend's forward split the same way (bhsd, softcap, lengths 150, 40 and 0 over 160 keys)."""
    spec = AttentionSpec(causal=True, softcap=5.0)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((3, 2, length, 16)).astype(np.float32) for length in (1, 160, 160))
    lengths = np.asarray([150, 40, 0], np.int32)
    k[0, :, 150:] = v[1, :, 40:] = np.nan  # padding past each length is never read
    inputs = AttentionInputs(*(jnp.asarray(x) for x in (q, k, v)), kv_lengths=jnp.asarray(lengths))
    out, lse = _pallas(decode_splits=4).forward(spec, inputs, need_lse=True)
    paged = {"q": q, "k_cache": k.transpose(0, 2, 1, 3), "v_cache": v.transpose(0, 2, 1, 3)}
    paged |= {"block_table": np.arange(3, dtype=np.int32)[:, None], "kv_lengths": lengths}  # one block per row
    _check(spec, paged, out, lse)


@pytest.mark.parametrize("backend", JAX_PAGED_BACKENDS)
def test_differentiating_paged_is_a_typed_error(backend: str) -> None:
    """§13 is forward only: under jax.grad the refusal comes from the backward (torch refuses before the call)."""
    case = CASES["causal-gqa-block4"]
    arrays = {n: jnp.asarray(x) for n, x in _paged_arrays(case).items()}

    def loss(q: Any) -> Any:
        return attend_paged(case.spec, **{**arrays, "q": q}, backend=backend).sum()

    with pytest.raises(InvalidInputError, match="attend_paged .* is forward only"):
        jax.grad(loss)(arrays["q"])


@pytest.mark.parametrize(
    ("case", "per_batch", "splits"),
    [("causal-gqa-block4", True, 1), ("window-softcap-top-left-block3", False, 1), ("causal-gqa-block4", True, 2)],
    ids=["bottom-right, per (batch, head)", "top-left, per head", "split-K"],
)
def test_pallas_paged_alibi(case: str, per_batch: bool, splits: int) -> None:
    """§16 in pallas's paged kernel: key j is the sequence's position, not the slot's, read through a table of
    shared, out-of-order blocks; the offset kv_len − Lq bottom-right and 0 top-left; (Hq,) or (B, Hq) slopes; split
    into key ranges too."""
    paged = CASES[case]
    arrays = _paged_arrays(paged, seed=4)
    shape = (len(paged.kv_lengths), paged.heads_q) if per_batch else (paged.heads_q,)
    arrays["alibi_slopes"] = np.random.default_rng(5).uniform(0.05, 1.0, shape).astype(np.float32)
    _, inputs = prepare_paged(paged.spec, **{n: jnp.asarray(x) for n, x in arrays.items()}, return_lse=True)
    out, lse = _pallas(decode_splits=splits).forward_paged(paged.spec, inputs, need_lse=True)
    _check(paged.spec, arrays, out, lse)
