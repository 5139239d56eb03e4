"""Dropout (docs/semantics.md §18) in the cupy backend's kernels, beyond what the shared tests check on
``cupy-emulated`` (the keep-mask bit for bit in tests/test_dropout.py, outputs and gradients in the conformance suite):
the CUDA C Philox4x32-10 against Random123's known answers through the emulator, the keep step's offsets (which only
a part of a larger call has), one compiled variant for every seed and p, and the refusal on CUDA until hardware has
run the path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attnkit.backends.cupy import launch
from attnkit.backends.cupy.backend import DROPOUT_PATH, CupyBackend

import attnkit
from attnkit import AttentionSpec
from attnkit.backend import ALLOW_UNVERIFIED_ENV, AttentionInputs, Dropout, Framework, PendingHardware, Problem
from attnkit.contract import philox
from attnkit.contract.kernels import KernelSwitches, attention_backward, attention_forward
from tests.cupy_emulator import EmulatorLauncher, cached_source, compiler

emulated = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler for the emulator")

#: A test kernel appended to attention.cu: philox4x32 of each (counter, key) row of six words, four words out.
KNOWN_ANSWERS_KERNEL = """
extern "C" __global__ void attention_philox_words(const unsigned* inputs, unsigned* words, int count) {
    for (int n = threadIdx.x; n < count; n += blockDim.x) {
        unsigned c[4] = {inputs[6 * n], inputs[6 * n + 1], inputs[6 * n + 2], inputs[6 * n + 3]};
        philox4x32(c, inputs[6 * n + 4], inputs[6 * n + 5]);
        for (int w = 0; w < 4; ++w) words[4 * n + w] = c[w];
    }
}
"""


@emulated
def test_cuda_c_philox_gives_known_answers() -> None:
    """Random123's known answers, then 64 random counters and keys against the NumPy reference."""
    source = cached_source(launch.SOURCE.read_text() + KNOWN_ANSWERS_KERNEL, "attention.cu with a Philox test kernel")
    known = np.array([[*counter, *key] for counter, key, _ in philox.KNOWN_ANSWERS], dtype=np.uint32)
    rows = np.concatenate([known, np.random.default_rng(0).integers(0, 1 << 32, (64, 6), dtype=np.uint32)])
    words = torch.zeros(len(rows), 4, dtype=torch.int32)
    options = launch.compile_options("float32", 16, 16, launch.EMULATOR_TILE, KernelSwitches())
    arguments = [torch.from_numpy(rows.view(np.int32)), words, np.int32(len(rows))]
    EmulatorLauncher(source).launch("philox_words", options, (1, 1, 1), (32, 1, 1), 0, arguments)
    got = words.numpy().view(np.uint32)
    np.testing.assert_array_equal(got[: len(known)], [answer for _, _, answer in philox.KNOWN_ANSWERS])
    for row, words_got in zip(rows[len(known) :], got[len(known) :]):
        expected = philox.philox4x32(tuple(np.array(word) for word in row[:4]), (int(row[4]), int(row[5])))
        assert tuple(words_got) == tuple(int(word) for word in expected), row


#: Max |error| relative to the oracle's largest entry, per dtype (float16: the register-resident kernels).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2}


@emulated
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_a_part_of_a_larger_call_drops_what_the_oracle_drops(dtype: torch.dtype) -> None:
    """Query heads, queries and keys from given offsets (as a shard of a larger call has them), 4 query heads on 2 kv
    heads: out, lse, dq, dk and dv against the float64 oracle, through the shared-memory kernels (float32) and the
    register-resident ones (float16, whose unmasked interior tiles drop too). A second seed and p run the compiled
    kernels again, compiling nothing."""
    generator = torch.Generator().manual_seed(3)
    # The head dims of tests/test_dropout.py's mask test, whose float32 forward compiles dQ and dK/dV here too.
    q, k = torch.randn(2, 4, 48, 16, generator=generator).to(dtype), torch.randn(2, 2, 40, 16, generator=generator)
    v, dout = torch.randn(2, 2, 40, 32, generator=generator), torch.randn(2, 4, 48, 32, generator=generator)
    k, v, dout = k.to(dtype), v.to(dtype), dout.to(dtype)
    spec, oracle = AttentionSpec(), attnkit.get_backend("torch-naive")
    launcher = EmulatorLauncher()
    kernels = launch.CudaKernels(launcher)
    built = []
    for p, seed in ((0.3, 0xF00D_CAFE_1234_5678 - (1 << 64)), (0.6, 12345)):
        dropout = Dropout(p, torch.tensor(seed), head_start=5, query_start=300, key_start=37)
        inputs = AttentionInputs(q, k, v, dropout=dropout)
        out, lse = attention_forward(kernels, spec, inputs)
        got = [out, lse, *attention_backward(kernels, spec, inputs, out, lse, dout, None, need_dbias=False)[:3]]
        exact = AttentionInputs(q.double(), k.double(), v.double(), dropout=dropout)
        want_out, want_lse = oracle.forward(spec, exact, True)
        grads = oracle.backward(spec, exact, want_out, want_lse, dout.double(), None, need_dbias=False)
        want = [want_out, want_lse, grads.dq, grads.dk, grads.dv]
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            error = (g.double() - w).abs().max().item() / max(1.0, w.abs().max().item())
            assert error < TOLERANCE[dtype], f"{name}: {error:.3g} at p={p}"
        unshifted = oracle.forward(spec, exact._replace(dropout=Dropout(p, torch.tensor(seed))), True)[0]
        assert (out.double() - unshifted).abs().max().item() > 0.1, "the offsets changed nothing"
        built.append(len(launcher._libraries))
    assert built[0] == built[1], "a new seed or p compiled new variants"


def test_dropout_is_refused_on_cuda_until_hardware_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    backend = CupyBackend("cupy", None, "cuda", "")
    problem = Problem(Framework.TORCH, "cuda", "float16", 1, 2, 2, 64, 64, 64, 64, needs_grad=True, has_dropout=True)
    reasons = backend.supports(AttentionSpec(), problem)
    assert len(reasons) == 1 and isinstance(reasons[0], PendingHardware) and DROPOUT_PATH in reasons[0], reasons
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "1")
    assert backend.supports(AttentionSpec(), problem) == []
    assert CupyBackend.emulated().supports(AttentionSpec(), Problem(
        Framework.TORCH, "cpu", "float16", 1, 2, 2, 64, 64, 64, 64, has_dropout=True)) == []  # fmt: skip
