"""attend inside torch.compile(fullgraph=True) and on meta / fake tensors (attnkit/frontends/torch_graph.py).

Every backend that takes torch tensors runs compiled, forward and backward, against the float64 oracle under the
tolerance rule; one trace serves repeated calls and dynamic lengths; the backend that ran is the one explain names;
meta and fake tensors get outputs of the right shapes with no backend chosen. With dropout (§18) the seed is a graph
input or drawn in the graph: compiled equals eager bit for bit, and a new seed is no new trace. Compilation uses the
aot_eager backend (AOTAutograd's forward and backward graphs, no code generation: seconds of inductor per test buy
nothing here), except one inductor test.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch._dynamo.testing
from torch._subclasses.fake_tensor import FakeTensorMode

import attnkit
from attnkit import dispatch, op_calls, registry
from attnkit.backend import Framework
from attnkit.errors import InvalidInputError
from attnkit.testing.agreement import compare, oracle_results, rounded
from attnkit.testing.cases import Case, make_arrays
from attnkit.testing.runners import OPTIONAL, run_torch

TORCH_BACKENDS = sorted(
    name for name, backend in registry.backends().items() if Framework.TORCH in backend.capabilities.frameworks
)
CAUSAL = attnkit.AttentionSpec(causal=True)
#: Richest first: each backend runs the first it serves (the optional tensors go through the operator as arguments).
CASES = (
    Case(CAUSAL.replace(window=(3, 0)), len_q=6, mask_shape=(2, 1, 6, 8), bias_shape=(1, 2, 6, 8), bias_grad=True,
         kv_lengths=(8, 5), q_segment_ids=((0, 0, 1, 1, 1, -1), (0,) * 6),
         kv_segment_ids=((0, 0, 0, 1, 1, 1, 1, -1), (-1, -1, 0, 0, 0, 0, 0, 0))),
    Case(CAUSAL.replace(window=(3, 0)), len_q=6, mask_shape=(2, 1, 6, 8), bias_shape=(1, 2, 6, 8), bias_grad=True,
         kv_lengths=(8, 5)),
    Case(CAUSAL, len_q=6, kv_lengths=(8, 5)),
    Case(CAUSAL),
    Case(CAUSAL, grad=False),
)  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _torch_frontend_known() -> None:
    """As after any eager call: the very first attend call of a process, if traced, is traced once more after it
    (frontends.register_imported_frameworks says why), which a test run's order must not decide."""
    from attnkit.frontends import register_imported_frameworks

    register_imported_frameworks()


def _compiled_call(counter: Any) -> Any:
    @torch.compile(fullgraph=True, backend=counter)
    def compiled(case: Case, tensors: dict[str, Any], backend: str, return_lse: bool = True) -> Any:
        optional = {name: tensors.get(name) for name in OPTIONAL}
        return attnkit.attend(case.spec, tensors["q"], tensors["k"], tensors["v"], **optional, return_lse=return_lse,
                              backend=backend)  # fmt: skip

    return compiled


def _served_case(name: str) -> Case:
    backend = registry.get_backend(name)
    for case in CASES:
        if not backend.supports(case.spec, case.problem(Framework.TORCH)):
            return case
    pytest.skip(f"{name} serves none of the cases")


@pytest.mark.parametrize("name", TORCH_BACKENDS)
def test_every_torch_backend_runs_compiled_with_one_trace_for_repeated_calls(name: str) -> None:
    if registry.get_backend(name).available():
        pytest.skip(f"{name} is unavailable here")
    case = _served_case(name)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = _compiled_call(counter)
    arrays = rounded(case, make_arrays(case))
    exact, baseline = oracle_results(case, arrays)
    for _ in range(2):
        results = run_torch(case, arrays, name, call=compiled)
        failures = [str(c) for c in compare(case, results, exact, baseline) if not c.ok]
        assert not failures, f"{name} compiled, {case.describe()}: {failures}"
    assert counter.frame_count == 1, f"{name}: traced {counter.frame_count} times for one call shape"


def test_dynamic_lengths_are_traced_once_and_dispatched_per_length() -> None:
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter, dynamic=True)
    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lengths: torch.Tensor) -> torch.Tensor:
        out, lse = attnkit.attend(CAUSAL, q, k, v, kv_lengths=kv_lengths, return_lse=True)
        return out.sum() + lse.clamp(min=-1e4).sum()

    generator = torch.Generator().manual_seed(0)
    for length in (5, 9, 13):
        q, k, v = (torch.randn(2, 4, length, 16, generator=generator, dtype=torch.float64) for _ in range(3))
        kv_lengths = torch.tensor([length, length - 2])
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        compiled = torch.autograd.grad(step(q, k, v, kv_lengths), leaves)
        out, lse = attnkit.attend(CAUSAL, q, k, v, kv_lengths=kv_lengths, return_lse=True, backend="torch-naive")
        eager = torch.autograd.grad(out.sum() + lse.clamp(min=-1e4).sum(), leaves)
        for got, want in zip(compiled, eager):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert counter.frame_count == 1, f"traced {counter.frame_count} times for three lengths"


def _dropout_leaves() -> tuple[torch.Tensor, ...]:
    """q (4 heads) on k, v (2 heads), and a cotangent for out: GQA, so query heads index the keep-mask (§18)."""
    generator = torch.Generator().manual_seed(5)
    shapes = ((2, 4, 6, 8), (2, 2, 7, 8), (2, 2, 7, 8), (2, 4, 6, 8))
    return tuple(torch.randn(shape, generator=generator, requires_grad=n < 3) for n, shape in enumerate(shapes))


def _out_and_grads(out: torch.Tensor, leaves: tuple[torch.Tensor, ...], dout: torch.Tensor) -> list[torch.Tensor]:
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


def test_dropout_compiled_equals_eager_for_the_seed_and_a_new_seed_runs_the_same_trace() -> None:
    """§18 under torch.compile(fullgraph=True): the seed is a tensor input of the graph, never a constant, so a new
    seed reuses the trace; out and every gradient (the backward regenerating the mask from the seed) are bit-equal
    to the eager call with that seed."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter)
    def compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        return attnkit.attend(CAUSAL, q, k, v, dropout_p=0.3, dropout_seed=seed, backend="torch-chunked")

    *leaves, dout = _dropout_leaves()
    by_seed = {}
    for seed in (1, 2, (1 << 63) + 5):  # the last one's bits read unsigned: a negative int64
        seed_tensor = torch.tensor(seed - (1 << 64) if seed >= 1 << 63 else seed)
        got = _out_and_grads(compiled(*leaves, seed_tensor), leaves, dout)
        eager = attnkit.attend(CAUSAL, *leaves, dropout_p=0.3, dropout_seed=seed, backend="torch-chunked")
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, _out_and_grads(eager, leaves, dout)):
            assert torch.equal(a, b), f"seed {seed}: compiled {name} differs from eager"
        by_seed[seed] = got[0]
    assert not torch.equal(by_seed[1], by_seed[2]), "two seeds gave the same output"
    assert counter.frame_count == 1, f"traced {counter.frame_count} times for three seeds"


def test_dropout_without_a_seed_draws_one_per_compiled_call_from_torchs_generator() -> None:
    """dropout_seed=None: the seed is drawn inside the graph, so every call of the compiled function drops anew,
    torch.manual_seed repeats a run, and the backward reads the seed its forward drew. (aot_eager runs the graph's
    draw on torch's generator as eager attend does, so here the compiled call is the eager one too.)"""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter)
    def compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attnkit.attend(CAUSAL, q, k, v, dropout_p=0.3, backend="torch-chunked")

    *leaves, dout = _dropout_leaves()
    torch.manual_seed(11)
    first = _out_and_grads(compiled(*leaves), leaves, dout)
    second = compiled(*leaves)
    torch.manual_seed(11)
    again = _out_and_grads(compiled(*leaves), leaves, dout)
    torch.manual_seed(11)
    eager = _out_and_grads(attnkit.attend(CAUSAL, *leaves, dropout_p=0.3, backend="torch-chunked"), leaves, dout)
    assert not torch.equal(first[0], second), "two calls drew the same mask"
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), first, again, eager):
        assert torch.equal(a, b) and torch.equal(a, c), f"{name} differs under the same torch.manual_seed"
    assert counter.frame_count == 1, f"traced {counter.frame_count} times"


def test_dropout_p_given_to_a_compiled_function_is_a_constant_of_its_trace() -> None:
    """A float argument of a compiled function is traced symbolically once it changes: attend takes it as the
    trace's constant (a new p traces again) rather than failing on it."""
    compiled = torch.compile(
        lambda q, k, v, p: attnkit.attend(CAUSAL, q, k, v, dropout_p=p, dropout_seed=3, backend="torch-chunked"),
        fullgraph=True, backend="aot_eager",
    )  # fmt: skip
    *leaves, _ = _dropout_leaves()
    with torch.no_grad():
        for p in (0.1, 0.2, 0.0):
            eager = attnkit.attend(CAUSAL, *leaves, dropout_p=p, dropout_seed=3, backend="torch-chunked")
            assert torch.equal(compiled(*leaves, p), eager), f"dropout_p={p}"


def test_length_values_are_still_checked_where_the_compiled_call_runs() -> None:
    compiled = torch.compile(lambda q, k, v, n: attnkit.attend(CAUSAL, q, k, v, kv_lengths=n), fullgraph=True,
                             backend="aot_eager")  # fmt: skip
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(InvalidInputError, match=r"kv_lengths values must lie in \[0, 4\], got min=9, max=9"):
        compiled(q, q, q, torch.tensor([9]))


def test_the_backend_that_ran_compiled_is_the_one_explain_names(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    decide = op_calls.decide

    def recording(*args: Any) -> op_calls.Call:
        call = decide(*args)
        ran.append(call.backend.name)
        return call

    monkeypatch.setattr(op_calls, "decide", recording)
    q, k, v = (torch.randn(1, 4, 8, 16, requires_grad=True) for _ in range(3))
    mask = torch.rand(1, 1, 8, 8) > 0.3
    compiled = torch.compile(lambda q, k, v, m: attnkit.attend(CAUSAL, q, k, v, mask=m), fullgraph=True,
                             backend="aot_eager")  # fmt: skip
    compiled(q, k, v, mask).sum().backward()
    selected = [row.name for row in dispatch.candidates(CAUSAL, _problem(q, k, v, mask)) if row.selected]
    assert ran == selected * 2, f"forward and backward ran on {ran}; explain selects {selected}"


def _problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> Any:
    from attnkit.validation import prepare

    return prepare(CAUSAL, q, k, v, mask, None, None, None, False)[1]


def test_the_operator_passes_torchs_own_checks() -> None:
    """torch.library.opcheck: schema, autograd registration, fake against real outputs, AOT dispatch with dynamic
    shapes, on a call with every optional tensor, one with none, and one with dropout (its seed a tensor argument)."""
    from attnkit.frontends import torch_graph  # registers the operators

    spec = attnkit.AttentionSpec(causal=True, window=(2, 0))
    q, k = torch.randn(2, 4, 6, 16, requires_grad=True), torch.randn(2, 2, 8, 16, requires_grad=True)
    v, bias = torch.randn(2, 2, 8, 8, requires_grad=True), torch.randn(1, 4, 6, 8, requires_grad=True)
    mask, kv_lengths = torch.rand(2, 1, 6, 8) > 0.2, torch.tensor([8, 5])
    key = torch_graph._spec_key(spec)
    no_ids = (None, None)  # q_segment_ids, kv_segment_ids
    for args in ((q, k, v, None, None, None, None, *no_ids, key, "auto", False, True, False),
                 (q, k, v, mask, bias, None, kv_lengths, *no_ids, key, "torch-naive", True, True, True)):  # fmt: skip
        torch.library.opcheck(torch.ops.attnkit.attend.default, (*args, None, 0.0))  # no dropout: no seed, p = 0
    dropout = (torch.tensor(7), 0.25)  # the seed, a tensor argument, and p
    args = (q, k, v, None, None, None, kv_lengths, *no_ids, key, "torch-naive", True, True, False, *dropout)
    torch.library.opcheck(torch.ops.attnkit.attend.default, args)


def test_an_eager_call_imports_no_compiler_and_one_compiled_later_is_still_traced_to_the_operator() -> None:
    """A process's first eager attend imports neither Dynamo nor inductor (seconds on a small machine); Dynamo
    imported after it still traces attend past the cache of eager calls, to the graph operator, in one trace. In a
    fresh process: this one imported Dynamo long ago."""
    script = """
import sys
import torch
import attnkit
from attnkit import AttentionSpec

spec = AttentionSpec(causal=True)
q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
eager = attnkit.attend(spec, q, k, v)
eager.sum().backward()
loaded = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
assert not loaded, loaded

import torch._dynamo.testing
counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
compiled = torch.compile(lambda q, k, v: attnkit.attend(spec, q, k, v), fullgraph=True, backend=counter)
for _ in range(2):
    torch.testing.assert_close(compiled(q, k, v), eager)
graph = str(counter.graphs[0].graph)
assert counter.frame_count == 1 and "attnkit.attend" in graph, (counter.frame_count, graph)
"""
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]


@pytest.mark.parametrize("cpp_wrapper", [False, True], ids=["python-wrapper", "cpp-wrapper"])
def test_compiled_by_inductor_equals_eager(cpp_wrapper: bool) -> None:
    """Inductor's Python wrapper, and its C++ wrapper, which writes the operator's string arguments into C++
    source (unescaped in torch 2.13: the spec's JSON once failed to compile there) and leaves out of its call the
    arguments equal to their defaults (torch 2.13: the operator has none), with and without dropout."""
    import torch._inductor.config

    spec = attnkit.AttentionSpec(causal=True, softcap=20.0)
    q, k, v = (torch.randn(2, 8, 4, 16, requires_grad=True) for _ in range(3))
    seed = torch.tensor(17)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Transposed views, as a model's projections give them: the operator's outputs keep their own strides.
        q, k, v = (t.transpose(1, 2) for t in (q * 2, k, v))
        dropped = attnkit.attend(spec, q, k, v, dropout_p=0.25, dropout_seed=seed, backend="torch-chunked")
        return attnkit.attend(spec, q, k, v).square().sum() + dropped.square().sum()

    leaves = (q, k, v)
    eager = torch.autograd.grad(step(*leaves), leaves)
    torch._dynamo.reset()  # Dynamo's cache of step's code does not key on inductor's config
    with torch._inductor.config.patch(cpp_wrapper=cpp_wrapper):
        compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(*leaves), leaves)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("three_d", [False, True], ids=["4d", "3d"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_meta_tensors_get_shapes_forward_and_backward_without_a_backend(
    layout: str, three_d: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dispatch, "select", _no_dispatch)
    spec = attnkit.AttentionSpec(causal=True, layout=layout)
    b, hq, hkv, lq, lk, d, dv = 2, 4, 2, 5, 7, 16, 8
    shape: dict[str, tuple[int, ...]] = (
        {"q": (b, lq, d), "k": (b, lk, d), "v": (b, lk, dv)}
        if three_d
        else {name: _layout(layout, b, heads, length, dim)
              for name, heads, length, dim in (("q", hq, lq, d), ("k", hkv, lk, d), ("v", hkv, lk, dv))}
    )  # fmt: skip
    q, k, v = (torch.empty(shape[name], device="meta", dtype=torch.bfloat16, requires_grad=True) for name in "qkv")
    bias = torch.empty(1, lq, lk, device="meta", requires_grad=True, dtype=torch.bfloat16)
    out, lse = attnkit.attend(spec, q, k, v, bias=bias, kv_lengths=torch.empty(b, dtype=torch.int64, device="meta"),
                              return_lse=True, dropout_p=0.1)  # fmt: skip
    assert (out.device.type, out.dtype, tuple(out.shape)) == ("meta", torch.bfloat16, (*shape["q"][:-1], dv))
    assert (lse.dtype, tuple(lse.shape)) == (torch.float32, (b, lq) if three_d else (b, hq, lq))
    (out.float().sum() + lse.sum()).backward()
    for leaf in (q, k, v, bias):
        assert (leaf.grad.device.type, leaf.grad.shape, leaf.grad.dtype) == ("meta", leaf.shape, leaf.dtype)


def _layout(layout: str, batch: int, heads: int, length: int, dim: int) -> tuple[int, ...]:
    return (batch, heads, length, dim) if layout == "bhsd" else (batch, length, heads, dim)


def _no_dispatch(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a backend was chosen for a call with no values")


def test_meta_tensors_get_attends_typed_errors() -> None:
    q = torch.empty(1, 4, 8, 16, device="meta")
    with pytest.raises(InvalidInputError, match=r"heads_q=4 \(query heads\) is not a multiple of heads_kv=3"):
        attnkit.attend(CAUSAL, q, torch.empty(1, 3, 8, 16, device="meta"), torch.empty(1, 3, 8, 16, device="meta"))


def test_fake_tensors_pass_through_attend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "select", _no_dispatch)
    with FakeTensorMode():
        q, k, v = (torch.empty(1, 2, 8, 16) for _ in range(3))
        out = attnkit.attend(CAUSAL, q, k, v)
    assert tuple(out.shape) == (1, 2, 8, 16) and out.dtype == torch.float32


def test_meta_output_matches_a_real_call_in_shape_and_dtype() -> None:
    case = Case(CAUSAL, three_d=True, len_q=3)
    arrays = make_arrays(case)
    real = run_torch(case, arrays, "torch-naive")
    q, k, v = (torch.tensor(np.asarray(arrays[name]), device="meta") for name in "qkv")
    out, lse = attnkit.attend(CAUSAL, q, k, v, return_lse=True)
    assert (tuple(out.shape), tuple(lse.shape)) == (real["out"].shape, real["lse"].shape)
