"""``mask_mod``: a mask program given as a function (docs/semantics.md §17), traced once and bound to each call.

:func:`bind` checks the function, traces it in the call's framework (attnkit/frontends/torch_programs.py,
jax_programs.py) or takes the trace it made before, and checks the captured tensors against the call: the result is
the :class:`attnkit.contract.programs.BoundProgram` backends read. A function is traced again only when what it
closes over changed: another tensor object, another shape, dtype or device, or another Python value (its
fingerprint); new values in the same tensors never re-trace.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

from attnkit.backend import Framework
from attnkit.contract.programs import (
    BoundProgram,
    CapturedSpec,
    MaskProgram,
    band_of,
    replace_captured,
    whole_range,
)
from attnkit.errors import MaskProgramError

_traces: weakref.WeakKeyDictionary[Any, tuple[Any, MaskProgram, tuple[Any, ...]]] = weakref.WeakKeyDictionary()
_checked: dict[tuple[MaskProgram, tuple[int, ...]], bool] = {}
_lock = threading.Lock()


def check_arity(mask_mod: Any) -> None:
    if not callable(mask_mod):
        raise MaskProgramError(
            f"mask_mod must be a function (b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}"
        )
    try:
        signature = inspect.signature(mask_mod)
    except (TypeError, ValueError):  # a builtin without a signature: its call says whether four arguments fit
        return
    try:
        signature.bind(0, 0, 0, 0)
    except TypeError:
        raise MaskProgramError(
            f"mask_mod must take four positional arguments (b, h, q_idx, kv_idx), as FlexAttention's mask_mod; "
            f"{getattr(mask_mod, '__name__', 'it')}{signature} does not (a score_mod, with a score, is not a mask)"
        ) from None


def trace(mask_mod: Callable[..., Any], framework: Framework) -> tuple[MaskProgram, tuple[Any, ...]]:
    """``mask_mod``'s program and the tensors it captured, traced again only where its fingerprint changed."""
    if not callable(mask_mod):
        check_arity(mask_mod)
    fingerprint = _fingerprint(mask_mod, framework)
    try:
        with _lock:
            hit = _traces.get(mask_mod)
    except TypeError:  # not weakly referable: traced each call
        hit = None
    if hit is not None and hit[0] == fingerprint:
        return hit[1], hit[2]
    check_arity(mask_mod)
    if framework is Framework.TORCH:
        from attnkit.frontends import torch_programs as tracer
    else:
        from attnkit.frontends import jax_programs as tracer  # type: ignore[no-redef]
    try:
        expr, captured = tracer.trace(mask_mod)
    except MaskProgramError:
        raise
    except Exception as error:  # what the function raised on traced indices: name it as the program's
        raise MaskProgramError(
            f"mask_mod could not be traced: {type(error).__name__}: {error} (a mask program takes integer + - * // %, "
            f"comparisons, & | ~, where, minimum/maximum, abs, and reads of captured integer or boolean tensors)"
        ) from error
    specs = tuple(CapturedSpec(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in captured)
    program = MaskProgram(expr, specs, getattr(mask_mod, "__name__", type(mask_mod).__name__))
    try:
        with _lock:
            _traces[mask_mod] = (fingerprint, program, tuple(captured))
    except TypeError:
        pass
    return program, tuple(captured)


def bind(mask_mod: Any, ops: Any, q: Any, batch: int, heads: int, len_q: int, len_k: int) -> BoundProgram:
    """The call's :class:`BoundProgram`: traced (or the trace reused), captured tensors checked against q's framework
    and device, and the program's integers checked to stay in int32 over the call's index domain."""
    program, captured = trace(mask_mod, ops.framework)
    device = ops.device(q)
    for slot, tensor in enumerate(captured):
        if not ops.is_array(tensor):
            raise MaskProgramError(
                f"mask_mod captured a {type(tensor).__name__} (slot {slot}); a {ops.framework.value} call's program "
                f"reads {ops.framework.value} tensors"
            )
        if ops.device(tensor) != device:
            raise MaskProgramError(
                f"mask_mod captured a tensor on device {ops.device(tensor)}, expected q's device {device}"
            )
    bound = BoundProgram(program, captured)
    shapes = (batch, heads, len_q, len_k)
    if not _checked.get((program, shapes)) and not ops.symbolic(q):
        checked = _on_host(bound) if ops.framework is Framework.JAX else (bound, q)
        if checked is not None:
            wide = next(whole_range(checked[0], *shapes, like=checked[1]), None)
            if wide is not None:
                raise MaskProgramError(
                    f"mask_mod's value {wide} may leave the 32-bit integer range over this call's indices "
                    f"(B={batch}, H={heads}, Lq={len_q}, Lk={len_k}); a mask program's integers are int32"
                )
            _checked[(program, shapes)] = True
    return bound


def _on_host(bound: BoundProgram) -> tuple[BoundProgram, Any] | None:
    """A JAX program's captured arrays as NumPy (value ranges in int64, and nothing staged into an enclosing jit),
    or None where one is a tracer of an enclosing jit: its values are unknown, and the range check waits for a call
    that has them."""
    import numpy as np

    from attnkit.frontends import jax_frontend

    host = [jax_frontend.OPS.host_values(array) for array in bound.captured]
    if any(values is None for values in host):
        return None
    return replace_captured(bound, host), np.zeros(())


def _fingerprint(function: Any, framework: Framework) -> tuple[Any, ...]:
    """What ``function`` reads besides its arguments, as identities and values: closure cells, defaults, the globals
    its code names, a partial's arguments, recursively through the functions among them."""
    parts: list[Any] = []
    seen: set[int] = set()

    def visit(value: Any, depth: int) -> None:
        if id(value) in seen or depth > 6:
            return
        seen.add(id(value))
        if isinstance(value, (bool, int, float, str, type(None))):
            parts.append(value)
        elif isinstance(value, functools.partial):
            parts.append(("partial", id(value)))
            for item in (value.func, *value.args, *value.keywords.values()):
                visit(item, depth + 1)
        elif isinstance(value, types.MethodType):
            visit(value.__func__, depth + 1)
            visit(value.__self__, depth + 1)
        elif isinstance(value, types.FunctionType):
            parts.append(("function", id(value)))
            for cell in value.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    parts.append(None)
            for item in (*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()):
                visit(item, depth + 1)
            for name in value.__code__.co_names:
                if name in value.__globals__ and not isinstance(value.__globals__[name], types.ModuleType):
                    visit(value.__globals__[name], depth + 1)
        elif isinstance(value, (tuple, list)):
            parts.append(("sequence", len(value)))
            for item in value:
                visit(item, depth + 1)
        elif hasattr(value, "shape") and hasattr(value, "dtype"):  # a tensor or an array
            parts.append(("array", id(value), tuple(value.shape), str(value.dtype), str(getattr(value, "device", ""))))
        elif not isinstance(value, (type, types.ModuleType, types.BuiltinFunctionType)):
            parts.append(("object", id(value)))

    visit(function, 0)
    return tuple(parts)


def band_apart(spec: Any, inputs: Any, problem: Any) -> tuple[Any, Any, Any]:
    """(spec, inputs, problem) with the program's band moved into the spec (docs/semantics.md §17, "Bands"): where
    the spec has neither causal nor window nor ALiBi (whose distances the alignment would move), the conjuncts that
    bound kv_idx − q_idx become a top-left causal clause or window, and the program keeps the rest (none: the call
    has no program). The same visibility; the backends' band machinery then trims each query block's keys."""
    bound = inputs.mask_program
    if bound is None or spec.causal or spec.window is not None or inputs.alibi_slopes is not None:
        return spec, inputs, problem
    split = _band_split(spec, bound.program)
    if split is None:
        return spec, inputs, problem
    banded, rest = split
    if rest is None:
        return banded, inputs._replace(mask_program=None), dataclasses.replace(problem, has_mask_program=False)
    return banded, inputs._replace(mask_program=BoundProgram(rest, bound.captured)), problem


@functools.lru_cache(maxsize=256)
def _band_split(spec: Any, program: MaskProgram) -> tuple[Any, MaskProgram | None] | None:
    found = band_of(program.expr)
    if found is None:
        return None
    (lo, hi), rest = found
    left = None if lo == -float("inf") else int(-lo)
    right = None if hi in (0, float("inf")) else int(hi)
    window = None if left is None and right is None else (left, right)
    banded = type(spec)(**{**dict(spec), "causal": hi == 0, "window": window, "causal_alignment": "top_left"})
    return banded, None if rest is None else MaskProgram(rest, program.captured, program.name)
