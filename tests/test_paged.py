"""attend_paged's fused paths (docs/semantics.md §13) against torch-naive's literal reading, the float64 oracle: every
backend declaring ``Feature.PAGED``, over block tables with shared and out-of-order blocks, garbage past each
sequence's blocks, and NaN in every slot no sequence reads (unreferenced blocks, padding past a length)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attnkit import AttentionSpec, attend_paged, registry  # noqa: E402
from attnkit.backend import Feature, PagedInputs  # noqa: E402
from attnkit.testing.agreement import ORACLE, compare_outputs  # noqa: E402

PAGED_BACKENDS = sorted(
    name
    for name, backend in registry.backends().items()
    if Feature.PAGED in backend.capabilities.features and name != ORACLE
)

# (spec, Lq, Hq, Hkv, block_size, kv_lengths): empty, partial-last-block and full sequences; GQA; Lq > 1 aligned
# bottom-right; a window; softcap and cosine; long enough at block_size 16 for several of cpu-flash's 256-key tiles.
CASES = {
    "causal-gqa": (AttentionSpec(causal=True, layout="bshd"), 3, 4, 2, 4, (0, 5, 8, 13)),
    "window-softcap": (AttentionSpec(causal=True, window=(4, 1), softcap=8.0, layout="bshd"), 2, 2, 2, 4, (3, 11, 16)),
    "cosine-bhsd": (AttentionSpec(variant="cosine", scale=4.0), 1, 2, 1, 3, (7, 1, 12)),
    "long-decode": (AttentionSpec(causal=True, layout="bshd"), 1, 2, 2, 16, (600, 257, 16)),
}


def _paged_inputs(case: str, dtype: Any, seed: int = 0) -> PagedInputs:
    """A cache of the case's geometry: blocks drawn at random for each sequence (shared between sequences, in any
    order), table entries past a sequence's blocks −1 or far outside the cache, NaN in every slot none reads."""
    spec, len_q, heads_q, heads_kv, block_size, kv_lengths = CASES[case]
    generator = torch.Generator().manual_seed(seed)
    batch, head_dim = len(kv_lengths), 16
    needed = [-(-length // block_size) for length in kv_lengths]
    max_blocks, num_blocks = max(needed) + 1, max(needed) + 3
    table = torch.randint(0, num_blocks, (batch, max_blocks), generator=generator, dtype=torch.int32)
    read = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for b, (length, blocks) in enumerate(zip(kv_lengths, needed)):
        table[b, blocks:] = -1 if b % 2 else 1 << 30
        for j in range(length):
            read[table[b, j // block_size], j % block_size] = True
    assert not read.all(), "some slot must hold NaN"

    def cache() -> torch.Tensor:
        values = torch.randn(num_blocks, block_size, heads_kv, head_dim, generator=generator, dtype=dtype)
        return values.masked_fill(~read.view(num_blocks, block_size, 1, 1), float("nan"))

    q_shape = (batch, len_q, heads_q, head_dim) if spec.layout.value == "bshd" else (batch, heads_q, len_q, head_dim)
    q = torch.randn(q_shape, generator=generator, dtype=dtype)
    return PagedInputs(q, cache(), cache(), table, torch.tensor(kv_lengths))


def _as_float64(inputs: PagedInputs) -> PagedInputs:
    return inputs._replace(q=inputs.q.double(), k_cache=inputs.k_cache.double(), v_cache=inputs.v_cache.double())


def _results(backend: str, spec: AttentionSpec, inputs: PagedInputs) -> dict[str, np.ndarray]:
    out, lse = attend_paged(spec, *inputs, return_lse=True, backend=backend)
    return {"out": out.double().numpy(), "lse": lse.double().numpy()}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", PAGED_BACKENDS)
def test_paged_agrees_with_the_oracle(backend: str, case: str) -> None:
    found = registry.get_backend(backend)
    if found.available():
        pytest.skip(f"{backend}: {found.available()}")
    dtype = "float64" if "float64" in found.capabilities.dtypes else "float32"
    spec = CASES[case][0]
    inputs = _paged_inputs(case, getattr(torch, dtype))
    exact = _results(ORACLE, spec, _as_float64(inputs))
    assert np.isfinite(exact["out"]).all(), "the oracle itself let padding leak"
    baseline = _results(ORACLE, spec, inputs)
    comparisons = compare_outputs(dtype, _results(backend, spec, inputs), exact, baseline)
    assert all(comparison.ok for comparison in comparisons), [str(c) for c in comparisons]


def test_cpu_flash_split_k_merges_like_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split-K (each row's keys cut into ranges, merged by lse, §6) gives the oracle's result, for rows whose keys
    fill every range, some ranges and none (kv_lengths 600, 257, 16 with three ranges of 256-key tiles)."""
    cpu_flash = registry.get_backend("cpu-flash")
    if cpu_flash.available():
        pytest.skip(f"cpu-flash: {cpu_flash.available()}")
    from attnkit.backends.cpu_flash import backend as cpu_flash_module

    monkeypatch.setattr(cpu_flash_module, "decode_splits", lambda tasks, keys, threads: 3)
    spec = CASES["long-decode"][0]
    inputs = _paged_inputs("long-decode", torch.float32, seed=1)
    exact = _results(ORACLE, spec, _as_float64(inputs))
    comparisons = compare_outputs("float32", _results("cpu-flash", spec, inputs), exact, _results(ORACLE, spec, inputs))
    assert all(comparison.ok for comparison in comparisons), [str(c) for c in comparisons]
