"""The compiled torch call signature (attnkit/frontends/torch_compiled.py) keys attend's cache soundly: two calls
that get the same compiled key get the same Python key (so a cached runner never serves metadata it was not
validated for), calls with the same metadata get the same key, and every call it does not key itself is the
Python signature's."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch

import attnkit
from attnkit.frontends import torch_compiled, torch_frontend
from attnkit.spec import Layout

Signature = Callable[..., Any]
python_signature = torch_frontend.TorchOps.signature
python_class_signature = torch_frontend.TorchOps.length_class_signature


@pytest.fixture(scope="module")
def compiled() -> Signature:
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler (c++) to build torch_signature.cpp")
    function, reason = torch_compiled.load(python_signature, build=True)
    assert function is not None, reason
    return function


class Subclass(torch.Tensor):
    pass


def variants() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(q, k, v) triples differing from a base call in one thing each."""
    shapes = {"q": (1, 2, 3, 8), "k": (1, 2, 5, 8), "v": (1, 2, 5, 8)}

    def make(changes: dict[str, dict[str, Any]] | None = None) -> tuple[torch.Tensor, ...]:
        made = []
        for name, shape in shapes.items():
            change = (changes or {}).get(name, {})
            tensor = torch.zeros(change.get("shape", shape), dtype=change.get("dtype", torch.float32))
            tensor = tensor.to(change.get("device", "cpu"))
            made.append(tensor.requires_grad_(change.get("requires_grad", False)))
        return tuple(made)

    found: dict[str, tuple[torch.Tensor, ...]] = {"base": make(), "base again": make()}
    for name, shape in shapes.items():
        for axis in range(4):
            grown = list(shape)
            grown[axis] += 1
            found[f"{name} dim {axis}"] = make({name: {"shape": tuple(grown)}})
        found[f"{name} 3-D"] = make({name: {"shape": shape[1:]}})
        found[f"{name} 5-D"] = make({name: {"shape": (1, *shape)}})
        for dtype in (torch.float64, torch.bfloat16):
            found[f"{name} {dtype}"] = make({name: {"dtype": dtype}})
        found[f"{name} meta"] = make({name: {"device": "meta"}})
        found[f"{name} requires grad"] = make({name: {"requires_grad": True}})
    q, k, v = make()
    found["k transposed view"] = (q, k.transpose(2, 3).transpose(2, 3), v)  # same metadata, another stride path
    found["q parameter"] = (torch.nn.Parameter(q.clone()), k, v)
    found["q subclass"] = (q.as_subclass(Subclass), k, v)
    return found  # type: ignore[return-value]


@pytest.mark.parametrize("grad_mode", [True, False])
def test_equal_compiled_keys_mean_equal_python_keys(compiled: Signature, grad_mode: bool) -> None:
    with torch.set_grad_enabled(grad_mode):
        keys = {
            name: (compiled(*call, None, None, None, None), python_signature(*call, None, None, None, None))
            for name, call in variants().items()
        }
    assert keys["base"][0] == keys["base again"][0]  # the same metadata: the cache serves it
    assert keys["k transposed view"][0] == keys["base"][0]
    for (first, (compiled_a, python_a)), (second, (compiled_b, python_b)) in itertools.combinations(keys.items(), 2):
        if compiled_a is not None and compiled_a == compiled_b:
            assert python_a == python_b, f"{first} and {second} share a compiled key but not a Python one"
    for name in ("q parameter", "q subclass"):  # left to the Python signature, which leaves them to validation
        assert keys[name] == (None, None)


def test_every_other_call_gets_the_python_key(compiled: Signature) -> None:
    q, k, v = (torch.zeros(1, 2, length, 8) for length in (3, 5, 5))
    optional = {
        "mask": torch.ones(3, 5, dtype=torch.bool),
        "bias": torch.zeros(3, 5),
        "q_lengths": torch.tensor([2]),
        "kv_lengths": torch.tensor([4]),
    }
    for position, tensor in enumerate(optional.values()):
        arguments = [q, k, v, None, None, None, None]
        arguments[3 + position] = tensor
        assert compiled(*arguments) == python_signature(*arguments)
    assert compiled(q.numpy(), k, v, None, None, None, None) is None
    with pytest.raises(TypeError, match="takes 7 arguments"):
        compiled(q, k, v)


@pytest.fixture(scope="module")
def compiled_by_class(compiled: Signature) -> Signature:
    function, reason = torch_compiled.load_length_class(python_class_signature, Layout.BSHD)
    assert function is not None, reason
    return function


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_compiled_length_class_keys_group_as_the_python_ones(compiled_by_class: Signature, layout: str) -> None:
    """Over lengths in one class and across classes, and the variants above: two calls share a compiled key exactly
    when they share a Python one (the compiled key is stricter only in grad flags, which these calls share)."""
    spec = attnkit.AttentionSpec(layout=layout)
    calls = {f"{name}": call for name, call in variants().items() if "requires grad" not in name}
    for len_q, len_k in itertools.product((1, 2, 3, 5, 7, 8, 9, 64, 65, 100), repeat=2):
        q, k, v = (torch.zeros(1, 2, length, 8) for length in (len_q, len_k, len_k))
        if layout == "bshd":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        calls[f"Lq={len_q} Lk={len_k}"] = (q, k, v)
    keys = {
        name: (compiled_by_class(spec, *call, None, None, None, None), python_class_signature(spec, *call, *[None] * 4))
        for name, call in calls.items()
    }
    for (first, (compiled_a, python_a)), (second, (compiled_b, python_b)) in itertools.combinations(keys.items(), 2):
        if compiled_a is not None and python_a is not None:
            assert (compiled_a == compiled_b) == (python_a == python_b), f"{first} and {second}"
    for name in ("q parameter", "q subclass", "q 3-D", "k 5-D"):  # left to the Python signature: no key
        assert keys[name] == (None, None), name
    arguments = [attnkit.AttentionSpec(), *calls["base"], torch.tensor([3]), None, None, None]
    assert compiled_by_class(*arguments) == python_class_signature(*arguments)  # lengths: the Python key
    with pytest.raises(TypeError, match="takes 8 arguments"):
        compiled_by_class(spec, *calls["base"])


def test_attend_with_the_compiled_signature(compiled: Signature, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_frontend.OPS, "signature", compiled)
    by_class, reason = torch_compiled.load_length_class(python_class_signature, Layout.BSHD)
    assert by_class is not None, reason
    monkeypatch.setattr(torch_frontend.OPS, "length_class_signature", by_class)
    spec = attnkit.AttentionSpec(causal=True)
    generator = torch.Generator().manual_seed(0)
    for len_k in (80, 80, 81, 80):  # cached, new shape, cached again
        q, k, v = (torch.randn(1, 2, length, 16, generator=generator) for length in (1, len_k, len_k))
        expected = attnkit.attend(spec, q.double(), k.double(), v.double(), backend="torch-naive")
        for _ in range(2):
            assert torch.allclose(attnkit.attend(spec, q, k, v).double(), expected, atol=1e-5)
    with pytest.raises(attnkit.InvalidInputTypeError, match="k has dtype float64"):
        attnkit.attend(spec, q, k.double(), v)  # a cached q, v but another k dtype: validated, not served


def test_without_a_build_the_python_signature_serves(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    function, reason = torch_compiled.load(python_signature)
    assert function is None and "attnkit build" in reason
    monkeypatch.setenv(torch_compiled.DISABLE_VARIABLE, "0")
    assert torch_compiled.load(python_signature, build=True) == (None, f"{torch_compiled.DISABLE_VARIABLE}=0")
