"""Poisoned allocations: uninitialised memory made visible on the CPU (docs/testing.md, "Poisoned allocations").

A CUDA caching allocator hands a kernel the bytes its last user left; the CPU's ``torch.empty`` mostly hands out
fresh, zeroed pages. A kernel that leaves part of a buffer unwritten (a grid one tile short, a store mask that drops
a row, a padding row it never zeroes) or reads a buffer before writing it then passes every CPU test and fails on a
GPU. Inside :func:`poisoned_allocations` every buffer allocated uninitialised comes back filled instead:

* torch: ``torch.empty``, ``empty_like``, ``empty_strided``, ``empty_permuted``, ``Tensor.new_empty`` and
  ``Tensor.new_empty_strided`` are wrapped for the duration, so a backend's output, lse, split-K partials, Δ and
  gradient buffers are poisoned with no change to the backend. The whole allocation is filled (a strided one's gaps
  included): floating and complex dtypes with 0xFF bytes, NaN in every float format; integers with 0xA5 bytes, a
  large negative value no index, length or segment id takes (-1515870811 in int32); bool with True.
* native code: :data:`POISON_VARIABLE` is set in the environment, for code that allocates its own scratch (cpu-flash's
  kernel.cpp fills its scratch vectors with NaN instead of zeros while it is set). The CUDA emulator
  (tests/cupy_emulator) fills shared memory with NaN bytes before every block in any case.
* Pallas in interpret mode needs nothing: JAX's interpreter starts every output and scratch buffer not aliased to an
  input at NaN (integers at their minimum), always.

A correct kernel writes every element of what it returns, so poisoning never changes its results; NaN in a result
where the oracle is finite fails the harness's structural check. Meta and fake tensors (shapes only, and anything
traced by torch.compile) are left alone.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: Set to "1" while poisoning is on, for native code that allocates its own buffers.
POISON_VARIABLE = "ATTNKIT_POISON_UNINITIALISED"
#: The byte every floating element is filled with: NaN in float64/32/16, bfloat16 and the float8 formats.
FLOAT_POISON_BYTE = 0xFF
#: The byte every integer element is filled with: large and negative in every signed width, odd, never 0 or -1.
INTEGER_POISON_BYTE = 0xA5

# (owner, attribute) of each allocation function that returns uninitialised memory.
_TORCH_FUNCTIONS = ("empty", "empty_like", "empty_strided", "empty_permuted")
_TENSOR_METHODS = ("new_empty", "new_empty_strided")

_lock = threading.Lock()
_depth = 0
_restore: list[Callable[[], object]] = []


def poison(tensor: Any) -> None:
    """Fill the whole storage under ``tensor`` with the poison of its dtype (in place; nothing for tensors without
    data: meta, fake or subclass tensors)."""
    import torch

    if type(tensor) is not torch.Tensor or tensor.device.type == "meta" or torch.compiler.is_compiling():
        return
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return
    if tensor.dtype == torch.bool:
        byte = 1
    elif tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        byte = FLOAT_POISON_BYTE
    else:
        byte = INTEGER_POISON_BYTE
    storage.fill_(byte)  # type: ignore[attr-defined]  # UntypedStorage.fill_ exists; the stubs lack it


def _poisoning(allocate: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(allocate)
    def allocate_poisoned(*args: Any, **kwargs: Any) -> Any:
        result = allocate(*args, **kwargs)
        poison(result)
        return result

    return allocate_poisoned


def _install() -> None:
    import torch

    for name in _TORCH_FUNCTIONS:
        original = getattr(torch, name, None)
        if original is not None:
            setattr(torch, name, _poisoning(original))
            _restore.append(functools.partial(setattr, torch, name, original))
    for name in _TENSOR_METHODS:
        # torch.Tensor inherits these from the C base class: an attribute on torch.Tensor shadows it, deleted after.
        setattr(torch.Tensor, name, _poisoning(getattr(torch.Tensor, name)))
        _restore.append(functools.partial(delattr, torch.Tensor, name))
    previous = os.environ.get(POISON_VARIABLE)
    os.environ[POISON_VARIABLE] = "1"
    if previous is None:
        _restore.append(functools.partial(os.environ.pop, POISON_VARIABLE, None))
    else:
        _restore.append(functools.partial(os.environ.__setitem__, POISON_VARIABLE, previous))


def _uninstall() -> None:
    while _restore:
        _restore.pop()()


@contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Poison every uninitialised allocation (module docstring) until the block ends. Nests; process-wide while any
    block is open (other threads' allocations are poisoned too, which a correct kernel never notices). Wrap a
    backend's whole call, backward included, or a whole check::

        with poisoned_allocations():
            assert_backends_agree(case, backends=["my-backend"])
    """
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1:
            _install()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _uninstall()


def poisoning() -> bool:
    """Whether a :func:`poisoned_allocations` block is open."""
    return _depth > 0
