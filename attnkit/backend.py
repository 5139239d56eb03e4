"""The backend protocol: the one interface every attention backend implements.

A backend is an object with

* ``name``: the registry key, e.g. ``"torch-chunked"``;
* ``capabilities``: a :class:`Capabilities` (data, not code) that the generic
  :func:`capability_reasons` checks a call against;
* ``available()``: why it cannot run on this machine (empty list: it can);
* ``supports(spec, problem)``: why it cannot serve this call, each reason naming the value and
  what is supported (most backends return ``capability_reasons(self.capabilities, spec, problem)``
  plus anything particular to them);
* ``forward(spec, inputs, need_lse)`` -> ``(out, lse)``;
* ``backward(spec, inputs, out, lse, dout, dlse)`` -> :class:`Gradients`.

Backends receive tensors of their own framework, already validated, in the spec's layout
(4-D: a 3-D call gets a head axis of 1 added by the frontend). ``mask`` and ``bias`` are 4-D
and broadcastable to (B, Hq, Lq, Lk); a backend may return ``dbias`` in that broadcast shape and the
frontend sums it down to the caller's shape. ``lse`` is float32 (B, Hq, Lq).

A backend built on a library call that its framework already differentiates (the native backends) may also define
``differentiable_forward(spec, problem)``, returning a :data:`Runner` ``(q, k, v, mask, bias, q_lengths,
kv_lengths) -> (out, lse or None)`` for every call with that spec and problem. The frontend then calls that function
directly, with grad recording as the caller has it, instead of wrapping ``forward`` in its own autograd.Function /
custom_vjp: the framework's own backward runs, and a call costs what the library call costs plus the cached dispatch.
``backward`` then serves callers of the protocol itself (attnkit.testing). The function is made once per (spec,
problem), so it may be specialised for it. Where, for calls with q, k, v alone and no lse wanted, it is one library
call, :func:`with_plain_call` attaches that call, and ``attend`` makes it without the wrapper.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from attnkit.spec import AttentionSpec


class Framework(str, enum.Enum):
    TORCH = "torch"
    JAX = "jax"


#: Feature names a spec or call can use; ``Capabilities.features`` lists those a backend serves.
SPEC_FEATURES = frozenset({"causal", "top_left", "window", "cosine", "softcap", "bshd"})
CALL_FEATURES = frozenset({"mask", "bias", "q_lengths", "kv_lengths", "lse", "grad", "dbias"})
ALL_FEATURES = SPEC_FEATURES | CALL_FEATURES
#: Facts of a call's geometry that only routing reads (config ``[[refine]]`` entries), never a capability:
#: ``bottom_right_offset``: causal aligned bottom-right with 1 < Lq != Lk, a diagonal SDPA's ``is_causal``
#: (top-left) cannot place.
ROUTING_FEATURES = frozenset({"bottom_right_offset"})


@dataclass(frozen=True, slots=True)
class Problem:
    """The signature of one call: shapes, dtypes, device, framework, which optional tensors are present.

    Never tensor values, so a dispatch decision made for one Problem holds for every call with it.
    """

    framework: Framework
    device: str  # "cpu" or "cuda"
    dtype: str  # "float32", "float16", "bfloat16", "float64"
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int
    head_dim: int
    head_dim_v: int
    has_mask: bool = False
    has_bias: bool = False
    has_q_lengths: bool = False
    has_kv_lengths: bool = False
    needs_grad: bool = False
    needs_bias_grad: bool = False
    return_lse: bool = False

    def is_plain(self) -> bool:
        """q, k and v alone (no mask, bias or lengths), and no lse wanted: a library's plain attention call."""
        return not (self.return_lse or self.has_mask or self.has_bias or self.has_q_lengths or self.has_kv_lengths)

    def features(self) -> frozenset[str]:
        used = set()
        for flag, name in (
            (self.has_mask, "mask"),
            (self.has_bias, "bias"),
            (self.has_q_lengths, "q_lengths"),
            (self.has_kv_lengths, "kv_lengths"),
            (self.return_lse, "lse"),
            (self.needs_grad, "grad"),
            (self.needs_bias_grad, "dbias"),
        ):
            if flag:
                used.add(name)
        return frozenset(used)


class AttentionInputs(NamedTuple):
    """The tensors of one call, in one framework. Optional ones are None.

    A NamedTuple: built on every call (a frozen dataclass costs twice as much), and a JAX pytree as is.
    """

    q: Any
    k: Any
    v: Any
    mask: Any = None
    bias: Any = None
    q_lengths: Any = None
    kv_lengths: Any = None


@dataclass(frozen=True, slots=True)
class Gradients:
    dq: Any
    dk: Any
    dv: Any
    dbias: Any = None


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as data. :func:`capability_reasons` reads it."""

    frameworks: frozenset[Framework]
    dtypes: frozenset[str]
    devices: frozenset[str]
    features: frozenset[str]
    head_dims: tuple[int, int] = (1, 1 << 30)  # inclusive range, for both D and Dv
    description: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        unknown = self.features - ALL_FEATURES
        assert not unknown, f"unknown feature names {sorted(unknown)}; known: {sorted(ALL_FEATURES)}"


def capability_reasons(caps: Capabilities, spec: AttentionSpec, problem: Problem) -> list[str]:
    """Why a backend with these capabilities cannot serve (spec, problem); empty when it can."""
    reasons = []
    if problem.framework not in caps.frameworks:
        allowed = ", ".join(sorted(f.value for f in caps.frameworks))
        reasons.append(f"framework={problem.framework.value} (supported: {allowed})")
    if problem.device not in caps.devices:
        reasons.append(f"device={problem.device} (supported: {', '.join(sorted(caps.devices))})")
    if problem.dtype not in caps.dtypes:
        reasons.append(f"dtype={problem.dtype} (supported: {', '.join(sorted(caps.dtypes))})")
    low, high = caps.head_dims
    for name, value in (("head_dim", problem.head_dim), ("head_dim_v", problem.head_dim_v)):
        if not low <= value <= high:
            reasons.append(f"{name}={value} (supported: {low}..{high})")
    for feature in sorted((spec.features() | problem.features()) - caps.features):
        reasons.append(f"{feature} is not supported")
    return reasons


def routing_features(spec: AttentionSpec, problem: Problem) -> frozenset[str]:
    """The feature names a ``[[refine]]`` entry may match for this call: the spec's, the call's, and the
    ROUTING_FEATURES that hold."""
    used = spec.features() | problem.features()
    offset = problem.len_q != problem.len_k and problem.len_q > 1
    if offset and "causal" in used and "top_left" not in used:
        used |= {"bottom_right_offset"}
    return used


@runtime_checkable
class Backend(Protocol):
    name: str
    capabilities: Capabilities

    def available(self) -> list[str]:
        """Reasons this backend cannot run on this machine; empty when it can.

        Read once per registry generation: dispatch keeps the answer until the registry changes or
        :func:`attnkit.dispatch.clear_cache` is called."""
        ...

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        """Reasons this backend cannot serve this call; empty when it can."""
        ...

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[Any, Any]:
        """Return ``(out, lse)``; ``lse`` may be None when ``need_lse`` is False and no grad is needed."""
        ...

    def backward(
        self,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        out: Any,
        lse: Any,
        dout: Any,
        dlse: Any | None,
    ) -> Gradients:
        """Gradients of (out, lse) given their cotangents; ``dlse`` None means zero."""
        ...


#: What a frontend calls for one attention call: the fields of AttentionInputs as positional arguments
#: -> (out, lse or None). Positional, not the named tuple: building one cost a sixth of a decode call's dispatch.
Runner = Callable[[Any, Any, Any, Any, Any, Any, Any], tuple[Any, Any]]
#: ``(q, k, v) -> out``, for a call with no mask, bias or lengths that wants no lse.
PlainCall = Callable[[Any, Any, Any], Any]


def with_plain_call(run: Runner, call: PlainCall) -> Runner:
    """``run``, marked as computing ``(call(q, k, v), None)`` whenever mask, bias and lengths are None. attend()
    then makes ``call`` itself on such calls that want no lse: at decode sizes the wrapper's frame and tuple are a
    tenth of the dispatch cost, and ``call`` can be the library function (or a functools.partial of it)."""
    run.plain_call = call  # type: ignore[attr-defined]
    return run


def plain_call(run: Runner) -> PlainCall | None:
    """What :func:`with_plain_call` attached to ``run``, or None."""
    return getattr(run, "plain_call", None)


def differentiable_forward(backend: Backend, spec: AttentionSpec, problem: Problem) -> Runner | None:
    """The backend's own differentiable forward for (spec, problem), or None when it has none (module docstring)."""
    make = getattr(backend, "differentiable_forward", None)
    return make(spec, problem) if make is not None else None


class MissingPackageBackend:
    """Stands in for a built-in backend whose package is not installed, so configs naming it stay valid
    and ``attnkit info`` says what to install."""

    def __init__(self, name: str, package: str, extra: str) -> None:
        self.name = name
        self.package = package
        self.extra = extra
        self.capabilities = Capabilities(
            frameworks=frozenset(), dtypes=frozenset(), devices=frozenset(), features=frozenset()
        )

    def available(self) -> list[str]:
        return [f"{self.package} is not installed (pip install 'attnkit[{self.extra}]')"]

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        return self.available()

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[Any, Any]:
        raise RuntimeError(self.available()[0])

    def backward(
        self, spec: AttentionSpec, inputs: AttentionInputs, out: Any, lse: Any, dout: Any, dlse: Any | None
    ) -> Gradients:
        raise RuntimeError(self.available()[0])
