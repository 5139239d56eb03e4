"""A call whose sequence lengths are new, in a length class seen before, is served as the full path would serve it.

attend() keeps its decision and runner per length class (attnkit/call_cache.py, docs/dispatch.md): a KV cache growing
one key a step takes the full path (validation, dispatch) only at a new class. These tests hold that fast path
against the full one, which each call here also takes in a fresh ``use_config`` scope (a scope's calls never match
another scope's cache entries): the same backend chosen, call by call, and the same output, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import attnkit
from attnkit.backend import Framework, Problem, length_bucket, length_class, own_forward, own_plain_call
from attnkit.call_cache import CACHE
from attnkit.errors import BackendUnavailableError
from attnkit.frontends.torch_frontend import OPS
from attnkit.spec import Layout
from tests.conftest import backend_params

#: Lengths on, one below and one past powers of two, and two lengths inside one class.
SWEEP = (1, 2, 3, 5, 7, 8, 9, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 511, 512, 513, 700)
#: What is served with each call: ``call(len_k)`` -> the arguments of attend after the spec.
Call = Callable[[int], dict[str, Any]]


def _tensors(len_q: int, len_k: int, heads_kv: int = 2, grad: bool = False) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(len_q * 7919 + len_k)
    q = torch.randn(1, 4, len_q, 16, generator=generator, requires_grad=grad)
    k, v = (torch.randn(1, heads_kv, len_k, 16, generator=generator, requires_grad=grad) for _ in range(2))
    return {"q": q, "k": k, "v": v}


def _decode(len_k: int) -> dict[str, Any]:
    return _tensors(1, len_k)


def _chunk(len_k: int) -> dict[str, Any]:  # a chunked prefill: 16 new queries over a growing cache
    return _tensors(min(16, len_k), len_k)


def _prefill(len_k: int) -> dict[str, Any]:
    return _tensors(len_k, len_k)


def _uneven(len_k: int) -> dict[str, Any]:  # Lq = Lk at even lengths, one query fewer at odd: both in one class
    return _tensors(len_k - len_k % 2 or 1, len_k)


def _static_cache(len_k: int) -> dict[str, Any]:  # a cache of one capacity past the length, and kv_lengths
    return {**_tensors(1, len_k + 5), "kv_lengths": torch.tensor([len_k])}


def _documents(len_k: int) -> dict[str, Any]:
    ids = (torch.arange(len_k) * 3 // max(len_k, 1)).unsqueeze(0)  # three documents packed in one row
    return {**_tensors(len_k, len_k), "q_segment_ids": ids, "kv_segment_ids": ids}


def _served(spec: attnkit.AttentionSpec, arguments: dict[str, Any], return_lse: bool, backend: str) -> str:
    """The backend attend's length-class table holds for this call in the scope in force (the call has run)."""
    tensors = {name: arguments.get(name) for name in ("q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids")}
    signature = OPS.length_class_signature(spec, arguments["q"], arguments["k"], arguments["v"], *tensors.values())
    return CACHE.length_classes[(spec, signature, return_lse, backend, CACHE.scope_serial())][0].name


def _compare_with_full_path(
    spec: attnkit.AttentionSpec,
    call: Call,
    lengths: tuple[int, ...],
    backend: str = "auto",
    return_lse: bool = False,
    grad: bool = False,
) -> None:
    """Each length through the fast path (one scope for the sweep) and through the full path (a fresh scope each),
    checking the backend, the output and, with ``grad``, dq."""
    with attnkit.use_config({}):
        classes, in_fresh_scopes, before = set(), 0, CACHE.full_paths
        for len_k in lengths:
            arguments = call(len_k)
            if grad:
                arguments["q"].requires_grad_(True)
            fast = attnkit.attend(spec, **arguments, return_lse=return_lse, backend=backend)
            served = _served(spec, arguments, return_lse, backend)
            q, k = arguments["q"], arguments["k"]
            seq = 1 if spec.layout is Layout.BSHD else 2
            classes.add((length_class(q.shape[seq]), length_class(k.shape[seq]), q.shape[seq] < k.shape[seq]))
            assert CACHE.full_paths - before - in_fresh_scopes == len(classes), f"len_k={len_k}: a full path again"
            with attnkit.use_config({}):
                full = attnkit.attend(spec, **arguments, return_lse=return_lse, backend=backend)
                assert _served(spec, arguments, return_lse, backend) == served, f"len_k={len_k}"
            in_fresh_scopes += 1
            fast, full = (fast if return_lse else (fast,)), (full if return_lse else (full,))
            for ours, theirs in zip(fast, full):
                assert torch.equal(ours, theirs), f"len_k={len_k}: {served} ran differently on the fast path"
            if grad:
                (dq_fast,) = torch.autograd.grad(fast[0].sum(), arguments["q"])
                (dq_full,) = torch.autograd.grad(full[0].sum(), arguments["q"])
                assert torch.equal(dq_fast, dq_full), f"len_k={len_k}: dq of {served}"


CALLS = {"decode": _decode, "chunk": _chunk, "prefill": _prefill, "uneven": _uneven, "static-cache": _static_cache}


@pytest.mark.parametrize("shape", sorted(CALLS))
@pytest.mark.parametrize(
    "spec",
    [
        attnkit.AttentionSpec(causal=True),
        attnkit.AttentionSpec(causal=True, causal_alignment="top_left"),
        attnkit.AttentionSpec(window=(8, 0)),
        attnkit.AttentionSpec(),
    ],
    ids=["causal", "top-left", "window", "full"],
)
def test_a_length_sweep_is_decided_and_run_as_the_full_path_would(spec: attnkit.AttentionSpec, shape: str) -> None:
    with torch.no_grad():
        _compare_with_full_path(spec, CALLS[shape], SWEEP)


def test_a_sweep_recording_gradients_with_lse_and_documents_is_served_as_the_full_path_would() -> None:
    spec = attnkit.AttentionSpec(causal=True)
    _compare_with_full_path(spec, _documents, SWEEP[:14], return_lse=True, grad=True)
    _compare_with_full_path(spec, _decode, SWEEP[:14], grad=True)


def test_measured_decisions_are_kept_per_class(tmp_path: Any) -> None:
    """With measuring on, a bucket's first call measures and its record decides the class's later calls, as it
    decides the full path's."""
    spec = attnkit.AttentionSpec(causal=True)
    with attnkit.use_config({"autotune": True}), attnkit.autotune.STORE.use_directory(tmp_path):
        _compare_with_full_path(spec, _chunk, (9, 15, 31, 33, 63, 100), grad=True)


@pytest.mark.parametrize("backend", backend_params(Framework.TORCH))
def test_a_forced_backends_runner_serves_every_length_of_its_class(backend: str) -> None:
    """Each registered backend that declares ``length_generic`` and gives its own runner (``differentiable_forward``,
    ``plain_call``): a runner made for one length of a class gives what the runner of another length gives, forward
    and dq (lengths inside one class, and across classes). The other backends run the frontend's runner, which reads
    nothing but the call's own tensors."""
    served = attnkit.registry.get_backend(backend)
    if not served.capabilities.length_generic:
        pytest.skip(f"{backend} does not declare length_generic: its calls are kept per exact shape")
    causal, window = attnkit.AttentionSpec(causal=True), attnkit.AttentionSpec(causal=True, window=(40, 0))
    problem = Problem(Framework.TORCH, "cpu", "float32", 1, 4, 2, 1, 64, 16, 16, needs_grad=True)
    if own_forward(served, causal, problem) is None and own_plain_call(served, causal, problem) is None:
        pytest.skip(f"{backend} runs the frontend's runner (its forward and backward on the call's tensors)")
    calls = ((causal, _decode), (causal, _prefill), (causal, _documents), (window, _chunk))
    lengths = (63, 64, 65, 100)  # a class's last length, a power of two, two lengths of the class after it
    for spec, call in calls:
        try:
            attnkit.attend(spec, **call(lengths[0]), backend=backend)
        except BackendUnavailableError as refusal:
            pytest.skip(f"{backend} does not serve this call: {refusal}")
        _compare_with_full_path(spec, call, lengths, backend=backend, grad=True)


def test_a_hundred_thousand_lengths_keep_the_tables_small() -> None:
    """A cache growing past the tables' limit of entries: every length after its class's first is served from the
    length-class table, which holds one entry per class; the per-shape table gets none."""
    spec = attnkit.AttentionSpec(causal=True)
    q = torch.randn(1, 1, 1, 4)
    k = torch.randn(1, 1, CACHE.limit + 500, 4)
    with attnkit.use_config({}), torch.no_grad():
        calls_before, full_paths = len(CACHE.calls), CACHE.full_paths
        for len_k in range(1, k.shape[2] + 1):
            attnkit.attend(spec, q, k[:, :, :len_k], k[:, :, :len_k])
        classes = {length_class(len_k) for len_k in range(1, k.shape[2] + 1)}
        assert CACHE.full_paths - full_paths == len(classes)
        assert len(CACHE.calls) == calls_before


def test_length_classes_refine_buckets_and_powers_of_two() -> None:
    """Two lengths of one class fall in one bucket and on one side of every power of two (what a length_generic
    backend may compare them with)."""
    for length in range(0, 5000):
        for other in (length + 1, length - 1):
            if other < 0 or length_class(other) != length_class(length):
                continue
            assert length_bucket(other) == length_bucket(length)
            assert all((length < 1 << p) == (other < 1 << p) for p in range(14)), (length, other)
            assert all((length == 1 << p) == (other == 1 << p) for p in range(14)), (length, other)


def test_the_frontends_signature_groups_lengths_by_class() -> None:
    spec = attnkit.AttentionSpec(causal=True)
    keys = {}
    for len_k in range(1, 300):
        problem = Problem(Framework.TORCH, "cpu", "float32", 1, 4, 2, 1, len_k, 16, 16)
        key = OPS.length_class_signature(spec, *_tensors(1, len_k).values(), None, None, None, None)
        keys.setdefault(problem.length_class(), set()).add(key)
    assert all(len(group) == 1 for group in keys.values())
    assert len({next(iter(group)) for group in keys.values()}) == len(keys)


def test_a_class_hit_still_checks_the_lengths_against_its_own_shapes() -> None:
    """The cached class entry was made for another length: kv_lengths are checked against this call's Lk."""
    spec = attnkit.AttentionSpec(causal=True)
    with attnkit.use_config({}), torch.no_grad():
        attnkit.attend(spec, **_static_cache(100))  # Lk = 105: the class (64, 128)
        full_paths = CACHE.full_paths
        attnkit.attend(spec, **{**_static_cache(110), "kv_lengths": torch.tensor([115])})  # Lk = 115, at its end
        with pytest.raises(attnkit.InvalidInputError, match=r"kv_lengths values must lie in \[0, 115\], got .*116"):
            attnkit.attend(spec, **{**_static_cache(110), "kv_lengths": torch.tensor([116])})
        assert CACHE.full_paths == full_paths  # both served by the class entry, the check included
