"""The backend door: everything a backend author needs from attnkit, in one module.

A backend imports this module, the contract helpers (:mod:`attnkit.contract` and its torch, jax and kernels
modules) and its own framework; never ``attnkit`` itself, its api, config or dispatch. docs/architecture.md shows
where the door sits.

A backend is an object with

* ``name``: the registry key, e.g. ``"torch-chunked"``;
* ``capabilities``: a :class:`Capabilities` (data, not code): frameworks, dtypes, devices, the :class:`Feature`
  members it serves, head dims, and what it runs of another backend (:class:`Delegation`);
* ``available()``: why it cannot run on this machine (empty list: it can);
* ``supports(spec, problem)``: why it cannot serve this call, each reason naming the value and what is supported;
* ``forward(spec, inputs, need_lse)`` -> ``(out, lse)``;
* ``backward(spec, inputs, out, lse, dout, dlse, need_dbias=...)`` -> :class:`Gradients`;
* ``forward_paged(spec, paged_inputs, need_lse)`` -> ``(out, lse)``, where it declares ``Feature.PAGED`` (a paged KV
  cache, :class:`PagedInputs`; forward only).

:class:`BaseBackend` gives the defaults (``available()``: nothing missing; ``supports()``: what the capabilities
say; ``backward``: refused where the capabilities declare no grad) and the optional hooks, one spelling each:

* ``differentiable_forward(spec, problem)``: a :data:`Runner` ``(inputs) -> (out, lse)``, taking one
  :class:`AttentionInputs`, for a backend built on a library call its framework already differentiates (the native
  backends). The frontend calls it with grad recording as the caller has it, instead of wrapping ``forward`` in its
  own autograd.Function / custom_vjp; ``backward`` then serves callers of the protocol itself (attnkit.testing). Made
  once per (spec, problem), so it may be specialised for it. A third-party backend's runner takes the same one
  argument.
* ``plain_call(spec, problem)``: for a problem with q, k, v alone that wants no lse (``problem.is_plain()``), a
  :data:`PlainCall` ``(q, k, v) -> out`` computing what the differentiable forward does; ``attend`` then makes that
  call with nothing around it (at decode sizes a wrapper's frame and tuple are a tenth of the dispatch cost).
* ``interpreted(device)``: whether the backend runs its kernels in an interpreter or emulator on ``device``
  (benchmarks and cost calibration leave it out).
* ``run_time_builds()``: the :class:`TorchExtension` objects it compiles on first use, which ``attnkit build``
  builds ahead of time.

A backend written against the :class:`Backend` protocol alone, without the base class, may define any of them; the
door's :func:`own_forward`, :func:`own_plain_call`, :func:`runs_interpreted` and :func:`run_time_builds` are where
attnkit reads them.

Backends receive tensors of their own framework, already validated, in the spec's layout (4-D: a 3-D call gets a
head axis of 1 added by the frontend). ``mask`` and ``bias`` are 4-D and broadcastable to (B, Hq, Lq, Lk); a
backend may return ``dbias`` in that broadcast shape and the frontend sums it down to the caller's shape. ``lse`` is
float32 (B, Hq, Lq).

Built-in backends are listed by their subpackage's ``backends()`` function; a third-party one reaches the registry
through the ``attnkit.backends`` entry-point group (a Backend, a list of them, or a callable returning either) or
``attnkit.register_backend``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from attnkit.build import TorchExtension
from attnkit.errors import BackendUnavailableError, BuildError, InvalidInputTypeError
from attnkit.features import ALL_FEATURES, CALL_FEATURES, ROUTING_FEATURES, SPEC_FEATURES, Feature
from attnkit.records import RecordDirectory, RecordsRefusedError, attnkit_version, default_directory
from attnkit.spec import AttentionSpec, CausalAlignment, Layout, Variant

__all__ = [
    "ALL_FEATURES",
    "CALL_FEATURES",
    "ROUTING_FEATURES",
    "SPEC_FEATURES",
    "AttentionInputs",
    "AttentionSpec",
    "Backend",
    "BackendUnavailableError",
    "BaseBackend",
    "BuildError",
    "Capabilities",
    "CausalAlignment",
    "Delegation",
    "Dropout",
    "DeviceLimits",
    "Feature",
    "Framework",
    "FRAMEWORK_MODULES",
    "LazyBackend",
    "Gradients",
    "Layout",
    "ALLOW_UNVERIFIED_ENV",
    "MissingPackageBackend",
    "PagedInputs",
    "PendingHardware",
    "PlainCall",
    "Problem",
    "RecordDirectory",
    "RecordsRefusedError",
    "Runner",
    "Sizes",
    "TorchExtension",
    "Unverified",
    "Variant",
    "attnkit_version",
    "capability_reasons",
    "framework_reason",
    "default_directory",
    "delegated",
    "lasting_records",
    "length_bucket",
    "length_class",
    "own_forward",
    "own_plain_call",
    "peer_backend",
    "pending_hardware",
    "recording_delegations",
    "routing_features",
    "run_time_builds",
    "runs_interpreted",
]


class Framework(str, enum.Enum):
    """The array framework of a call: torch tensors or JAX arrays."""

    TORCH = "torch"
    JAX = "jax"


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
    has_segment_ids: bool = False
    #: A paged KV cache's block size (attend_paged, docs/semantics.md §13); None for contiguous keys. len_k is then
    #: the table's capacity, max_blocks · block_size.
    paged_block_size: int | None = None
    #: ALiBi slopes given (docs/semantics.md §16).
    has_alibi: bool = False
    #: A mask program given (mask_mod, docs/semantics.md §17).
    has_mask_program: bool = False
    #: Attention dropout with p > 0 (docs/semantics.md §18).
    has_dropout: bool = False

    def is_plain(self) -> bool:
        """q, k and v alone (no mask, bias, lengths or segment ids), and no lse wanted: a library's plain attention
        call."""
        return not (
            self.return_lse
            or self.has_mask
            or self.has_bias
            or self.has_q_lengths
            or self.has_kv_lengths
            or self.has_segment_ids
            or self.paged_block_size is not None
            or self.has_alibi
            or self.has_mask_program
            or self.has_dropout
        )

    def length_class(self) -> tuple[int, int, int]:
        """The class of this call's sequence lengths: :func:`length_class` of Lq and of Lk, and the sign of Lk − Lq.
        A backend that declares :attr:`Capabilities.length_generic` answers alike for every call of one class."""
        return length_class(self.len_q), length_class(self.len_k), (self.len_k > self.len_q) - (self.len_k < self.len_q)

    def at_bucket_lengths(self) -> Problem:
        """This call with Lq and Lk raised to their buckets (:func:`length_bucket`): the call ``auto``'s predictions
        and records speak for, so that its decision is one per bucket."""
        return dataclasses.replace(self, len_q=length_bucket(self.len_q), len_k=length_bucket(self.len_k))

    def features(self) -> frozenset[Feature]:
        flags = (
            (self.has_mask, Feature.MASK),
            (self.has_bias, Feature.BIAS),
            (self.has_q_lengths, Feature.Q_LENGTHS),
            (self.has_kv_lengths, Feature.KV_LENGTHS),
            (self.return_lse, Feature.LSE),
            (self.needs_grad, Feature.GRAD),
            (self.needs_bias_grad, Feature.DBIAS),
            (self.has_segment_ids, Feature.SEGMENT_IDS),
            (self.paged_block_size is not None, Feature.PAGED),
            (self.has_alibi, Feature.ALIBI),
            (self.has_mask_program, Feature.MASK_PROGRAM),
            (self.has_dropout, Feature.DROPOUT),
        )
        return frozenset(feature for used, feature in flags if used)


def length_bucket(length: int) -> int:
    """The power of two at or above ``length`` (1 for 0 and 1): the lengths ``auto``'s predictions and records group
    together (a record's "Lk<=1024" holds for 513..1024 keys)."""
    return 1 << max(length - 1, 0).bit_length()


def length_class(length: int) -> int:
    """A number per class of sequence lengths: each power of two (and 0) is a class of its own, and so is each open
    interval between two powers of two. Every comparison of a length with a power of two (``< 64``, ``>= 512``,
    ``== 1``) and every :func:`length_bucket` is the same across a class, so a decision or a runner that reads
    lengths only through such comparisons and through Lq against Lk holds for the whole class
    (:attr:`Capabilities.length_generic`)."""
    return 2 * length.bit_length() - (length & (length - 1) == 0)


class AttentionInputs(NamedTuple):
    """The tensors of one call, in one framework, and its bound mask program. Optional ones are None.

    A NamedTuple: built on every call (a frozen dataclass costs twice as much), and a JAX pytree as is.
    """

    q: Any
    k: Any
    v: Any
    mask: Any = None
    bias: Any = None
    q_lengths: Any = None
    kv_lengths: Any = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    #: ALiBi slopes (docs/semantics.md §16), float32 (B|1, Hq); no gradient.
    alibi_slopes: Any = None
    #: A bound mask program (attnkit.programs, docs/semantics.md), None without one.
    mask_program: Any = None
    #: Attention dropout (docs/semantics.md §18), None without it (or with p = 0).
    dropout: Dropout | None = None


class Dropout(NamedTuple):
    """A call's attention dropout (docs/semantics.md §18): probability ``p`` (0 < p < 1) and the 64-bit ``seed``,
    read unsigned. In torch calls ``seed`` is a 0-d int64 tensor on q's device (or the CPU); in JAX calls a (2,) uint32
    array holding the (low, high) words. Element (b, h, i, j) is kept where word ``j & 3`` of Philox4x32-10 with key
    (low, high) and counter (j >> 2, i, h, b) is at least :attr:`threshold`; kept probabilities are multiplied by
    :meth:`scale`. The backward regenerates the keep-mask from the seed.

    The indices are those of the unsharded call: where a call computes part of a larger one (a shard of context
    parallelism, a head group of Ulysses), its query heads, queries and keys are ``head_start``, ``query_start`` and
    ``key_start`` onwards there (ints, or 0-d integer arrays where a JAX rank's offset is traced); batch row b is the
    call's own. Every backend that declares Feature.DROPOUT adds them."""

    p: float
    seed: Any
    head_start: Any = 0
    query_start: Any = 0
    key_start: Any = 0

    @property
    def threshold(self) -> int:
        """round(p · 2³²) (half to even), below 2³²: a word is kept where it is at least this."""
        return dropout_threshold(self.p)

    def scale(self, float64: bool) -> float:
        """1 / (1 − p), rounded to float32 (float64 for float64 inputs)."""
        return dropout_scale(self.p, float64)

    def shifted(self, heads: Any = 0, queries: Any = 0, keys: Any = 0) -> Dropout:
        """This dropout for a part of the call starting ``heads``, ``queries`` and ``keys`` further on."""
        return self._replace(
            head_start=self.head_start + heads, query_start=self.query_start + queries, key_start=self.key_start + keys
        )


def dropout_threshold(p: float) -> int:
    """The integer threshold of §18 for probability ``p``."""
    return round(p * 4294967296.0)


def dropout_scale(p: float, float64: bool) -> float:
    """§18's scale of kept probabilities, 1 / (1 − p): float64 for float64 inputs, else rounded to float32."""
    scale = 1.0 / (1.0 - p)
    return scale if float64 else float(struct.unpack("f", struct.pack("f", scale))[0])


class PagedInputs(NamedTuple):
    """The tensors of one attend_paged call (docs/semantics.md §13), validated: q in the spec's layout (4-D),
    k_cache/v_cache (num_blocks, block_size, Hkv, D|Dv), block_table int32 (B, max_blocks), kv_lengths (B,)."""

    q: Any
    k_cache: Any
    v_cache: Any
    block_table: Any
    kv_lengths: Any
    #: ALiBi slopes (docs/semantics.md §16), float32 (B|1, Hq); no gradient.
    alibi_slopes: Any = None


@dataclass(frozen=True, slots=True)
class Gradients:
    """What ``backward`` returns: the gradients of q, k, v (each in its input's shape and dtype) and, where
    ``need_dbias``, of the bias (its broadcast shape or the caller's; the frontend sums it down)."""

    dq: Any
    dk: Any
    dv: Any
    dbias: Any = None


@dataclass(frozen=True)
class Delegation:
    """Part of a backend's work done by another backend's code: ``part`` of the call runs ``backend``."""

    backend: str
    part: str

    def __str__(self) -> str:
        return f"{self.part} run {self.backend}'s code"


@dataclass(frozen=True)
class Sizes:
    """The sizes a kernel takes: from ``least`` to ``greatest`` (None: no bound), only powers of two where
    ``power_of_two``."""

    least: int
    greatest: int | None = None
    power_of_two: bool = False

    def __contains__(self, size: object) -> bool:
        if not isinstance(size, int) or size < self.least or (self.greatest is not None and size > self.greatest):
            return False
        return not self.power_of_two or size & (size - 1) == 0

    def __str__(self) -> str:
        kind = "a power of two" if self.power_of_two else "a size"
        if self.greatest is None:
            return f"{kind} >= {self.least}"
        return f"{kind} in {self.least}..{self.greatest}"


@dataclass(frozen=True)
class DeviceLimits:
    """What a backend serves on one device where it is narrower than its :class:`Capabilities` say (its kernels
    there take fewer dtypes or head dims, or a paged cache of fewer block sizes); None keeps the backend-wide value."""

    dtypes: frozenset[str] | None = None
    head_dims: tuple[int, int] | None = None
    paged_block_sizes: Sizes | None = None
    paged_head_dims: Sizes | None = None


@dataclass(frozen=True)
class Unverified:
    """A path a backend has code for on ``device`` that has not yet passed there on real hardware (its last run there
    failed, and the cause was fixed without a device to prove the fix): refused on that device, with :class:`
    PendingHardware` reasons, until a hardware run (scripts/gpu_check.sh) has passed it and the entry is removed.
    ``ATTNKIT_ALLOW_UNVERIFIED=1`` runs it anyway, which is how that run reaches it (docs/gpu.md)."""

    device: str
    path: str  # what is refused, e.g. "the compiled backward"
    history: str  # what the last hardware run showed and what changed since


#: The environment variable that lets :class:`Unverified` paths run (scripts/gpu_check.sh sets it to "1").
ALLOW_UNVERIFIED_ENV = "ATTNKIT_ALLOW_UNVERIFIED"


class PendingHardware(str):
    """A refusal reason that says a path is unverified on this device's hardware (:class:`Unverified`), not that the
    backend cannot serve the call: the conformance harness reports such cases as pending, not as failures."""


def pending_hardware(backend: Backend, device: str, path: str) -> list[str]:
    """The refusal of ``backend``'s declared :class:`Unverified` ``path`` on ``device``: one :class:`PendingHardware`
    reason, or none where ``ATTNKIT_ALLOW_UNVERIFIED=1`` (or the path is not declared unverified there)."""
    if os.environ.get(ALLOW_UNVERIFIED_ENV) == "1":
        return []
    for entry in backend.capabilities.unverified:
        if entry.device == device and entry.path == path:
            return [
                PendingHardware(
                    f"{path} on {device} is unverified on hardware ({entry.history}); "
                    f"{ALLOW_UNVERIFIED_ENV}=1 runs it (docs/gpu.md)"
                )
            ]
    return []


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as data. :func:`capability_reasons` reads it."""

    frameworks: frozenset[Framework]
    dtypes: frozenset[str]
    devices: frozenset[str]
    features: frozenset[Feature]
    head_dims: tuple[int, int] = (1, 1 << 30)  # inclusive range, for both D and Dv
    description: str = ""
    notes: tuple[str, ...] = field(default=())
    #: The framework the conformance harness runs it in, where it takes more than one (pallas: JAX, bridging torch
    #: tensors through DLPack); None: torch where it takes torch tensors, else JAX.
    native_framework: Framework | None = None
    #: What of its work runs another backend's code: shown by ``explain`` and in the conformance table.
    delegations: tuple[Delegation, ...] = ()
    #: Narrower dtypes or head dims on some of its devices (device name -> limits): :meth:`on` applies them.
    per_device: tuple[tuple[str, DeviceLimits], ...] = ()
    #: Settings a user may give it under ``[backend_options.<name>]`` in a config, as (name, default) pairs: the
    #: config accepts these names with values of the defaults' types, and :func:`backend_option` reads them.
    options: tuple[tuple[str, bool | int | float | str], ...] = ()
    #: The block sizes and head dims of an attend_paged call it serves (Feature.PAGED); None: any.
    paged_block_sizes: Sizes | None = None
    paged_head_dims: Sizes | None = None
    #: Paths refused on a device until they have passed there on hardware (:func:`pending_hardware`).
    unverified: tuple[Unverified, ...] = ()
    #: Whether ``supports()``, ``differentiable_forward()`` and ``plain_call()`` read the sequence lengths only
    #: through :meth:`Problem.length_class` (comparisons with powers of two, and of Lq with Lk), so that what they
    #: answer for one call holds for every call of its class: ``attend`` then serves a new length of a class it has
    #: seen (a KV cache growing one key a step) with the decision and runner it made before. False (the default)
    #: for a backend that has not said so: calls that consult it are validated and dispatched per exact shape.
    length_generic: bool = False
    #: Where it declares Feature.MASK_PROGRAM: whether it serves a program only by materialising it as a dense
    #: (Lq, Lk) mask (torch-sdpa, jax-xla, the oracle) rather than evaluating it in its tiles. ``auto`` prefers a
    #: backend that evaluates it; ``explain`` says which each does.
    materialises_mask_programs: bool = False
    #: Why it does not serve a feature it leaves out, where there is more to say than "not supported" (feature ->
    #: reason): torch-sdpa's dropout draws from its own generator, which cannot give the contract's keep-mask.
    unsupported_because: tuple[tuple[Feature, str], ...] = ()

    def on(self, device: str) -> Capabilities:
        """These capabilities as they stand on ``device``: its :class:`DeviceLimits` applied, none left."""
        limits = dict(self.per_device).get(device)
        if limits is None:
            return self
        return dataclasses.replace(
            self,
            dtypes=self.dtypes if limits.dtypes is None else limits.dtypes,
            head_dims=self.head_dims if limits.head_dims is None else limits.head_dims,
            paged_block_sizes=limits.paged_block_sizes or self.paged_block_sizes,
            paged_head_dims=limits.paged_head_dims or self.paged_head_dims,
            per_device=(),
        )

    def __post_init__(self) -> None:
        wrong = sorted(repr(f) for f in self.features if not isinstance(f, Feature) or f not in ALL_FEATURES)
        if wrong:
            raise InvalidInputTypeError(
                f"Capabilities.features holds {', '.join(wrong)}; expected attnkit.Feature members "
                f"({', '.join(sorted(ALL_FEATURES))})"
            )
        if self.native_framework is not None and self.native_framework not in self.frameworks:
            raise InvalidInputTypeError(
                f"Capabilities.native_framework={self.native_framework.value} is not among its frameworks "
                f"({', '.join(sorted(f.value for f in self.frameworks))})"
            )


def framework_reason(framework: Framework, frameworks: frozenset[Framework]) -> str:
    """The reason a backend taking ``frameworks`` gives a call of ``framework`` (its only one: see
    :func:`capability_reasons`)."""
    allowed = ", ".join(sorted(f.value for f in frameworks))
    return f"framework={framework.value} (supported: {allowed})"


def capability_reasons(caps: Capabilities, spec: AttentionSpec, problem: Problem) -> list[str]:
    """Why a backend with these capabilities cannot serve (spec, problem); empty when it can. ``BaseBackend.supports``
    answers with it; a backend's own ``supports`` may add its reasons to these.

    :param caps: the backend's declared capabilities.
    :param spec: the call's spec.
    :param problem: the call's shapes, dtype, device and arguments.
    :returns: one reason per unmet requirement, each naming the value and what is supported.
    """
    if problem.framework not in caps.frameworks:  # the one reason: nothing else matters for arrays it cannot take
        return [framework_reason(problem.framework, caps.frameworks)]
    reasons = []
    if problem.device not in caps.devices:
        reasons.append(f"device={problem.device} (supported: {', '.join(sorted(caps.devices))})")
    # Limits of one device name it: "dtype=float64 (supported on cuda: ...)".
    where = f" on {problem.device}" if problem.device in dict(caps.per_device) else ""
    caps = caps.on(problem.device)
    if problem.dtype not in caps.dtypes:
        reasons.append(f"dtype={problem.dtype} (supported{where}: {', '.join(sorted(caps.dtypes))})")
    low, high = caps.head_dims
    for name, value in (("head_dim", problem.head_dim), ("head_dim_v", problem.head_dim_v)):
        if not low <= value <= high:
            reasons.append(f"{name}={value} (supported{where}: {low}..{high})")
    because = dict(caps.unsupported_because)
    for feature in sorted((spec.features() | problem.features()) - caps.features):
        reasons.append(f"{feature} is not supported" + (f" ({because[feature]})" if feature in because else ""))
    if problem.paged_block_size is not None:
        if caps.paged_block_sizes is not None and problem.paged_block_size not in caps.paged_block_sizes:
            reasons.append(f"paged block_size={problem.paged_block_size} (supported{where}: {caps.paged_block_sizes})")
        for name, value in (("head_dim", problem.head_dim), ("head_dim_v", problem.head_dim_v)):
            if caps.paged_head_dims is not None and value not in caps.paged_head_dims:
                reasons.append(f"{name}={value} with a paged cache (supported{where}: {caps.paged_head_dims})")
    return reasons


def routing_features(spec: AttentionSpec, problem: Problem) -> frozenset[Feature]:
    """The features a ``[[refine]]`` entry may match for this call: the spec's, the call's, and the
    ROUTING_FEATURES that hold."""
    used = spec.features() | problem.features()
    offset = problem.len_q != problem.len_k and problem.len_q > 1
    if offset and Feature.CAUSAL in used and Feature.TOP_LEFT not in used:
        used |= {Feature.BOTTOM_RIGHT_OFFSET}
    return used


#: What a frontend calls for one attention call: the call's :class:`AttentionInputs` -> (out, lse or None).
Runner = Callable[[AttentionInputs], tuple[Any, Any]]
#: ``(q, k, v) -> out``, for a call with no mask, bias or lengths that wants no lse.
PlainCall = Callable[[Any, Any, Any], Any]


@runtime_checkable
class Backend(Protocol):
    """What the registry requires of a backend. :class:`BaseBackend` implements the defaults."""

    name: str
    capabilities: Capabilities

    def available(self) -> list[str]:
        """Reasons this backend cannot run on this machine; empty when it can. Read once: dispatch keeps the answer
        until the call cache is cleared (a registry or config change, ``attnkit.dispatch.clear_cache()``)."""
        ...

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        """Reasons this backend cannot serve this call; empty when it can.

        :param spec: the call's spec.
        :param problem: the call's shapes, dtype, device and which optional inputs it has (never values).
        :returns: one reason per unmet requirement, each naming the value and what is supported.
        """
        ...

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[Any, Any]:
        """Return ``(out, lse)``; ``lse`` may be None when ``need_lse`` is False and no grad is needed.

        :param spec: the call's spec; q, k, v are 4-D in its layout.
        :param inputs: the call's validated tensors, in the backend's framework.
        :param need_lse: whether the caller wants lse (float32 (B, Hq, Lq); float64 for float64 inputs).
        """
        ...

    def backward(
        self,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        out: Any,
        lse: Any,
        dout: Any,
        dlse: Any | None,
        *,
        need_dbias: bool,
    ) -> Gradients:
        """Gradients of (out, lse) given their cotangents; ``dlse`` None means zero. ``Gradients.dbias`` is read only
        when ``need_dbias`` (a bias given and differentiated); otherwise it may stay None, and its work be skipped.

        :param spec: the call's spec.
        :param inputs: the forward's inputs.
        :param out: the forward's output.
        :param lse: the forward's lse.
        :param dout: the cotangent of out.
        :param dlse: the cotangent of lse, or None.
        :param need_dbias: whether the bias's gradient is wanted.
        """
        ...


class BaseBackend:
    """The defaults of the :class:`Backend` protocol and its optional hooks, read from ``capabilities``.

    A subclass sets ``name`` and ``capabilities`` (class attributes, or in ``__init__``) and writes ``forward``, and
    ``backward`` where it declares ``Feature.GRAD``; it overrides ``supports`` only to add reasons of its own
    (``super().supports(spec, problem) + [...]``).
    """

    name: str
    capabilities: Capabilities
    #: A plugin's backend that should take the place of the built-in backend of its name says so here.
    replaces_builtin: bool = False

    def available(self) -> list[str]:
        """Nothing missing; a backend that needs a package, a device or a compiler overrides it."""
        return []

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        """What the capabilities say (:func:`capability_reasons`)."""
        return capability_reasons(self.capabilities, spec, problem)

    def cold_start(self, spec: AttentionSpec, problem: Problem) -> str | None:
        """Why this backend's next call on ``problem`` costs far more than a call of it (a build, a compile), or None.
        ``auto``'s measuring does not time a backend then, unless the prediction picked it (attnkit/autotune.py)."""
        return None

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[Any, Any]:
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def backward(
        self,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        out: Any,
        lse: Any,
        dout: Any,
        dlse: Any | None,
        *,
        need_dbias: bool,
    ) -> Gradients:
        if Feature.GRAD not in self.capabilities.features:
            raise BackendUnavailableError(f"backend={self.name!r} has no backward (grad is not supported)")
        raise NotImplementedError(f"{type(self).__name__}.backward (it declares {Feature.GRAD})")

    def forward_paged(self, spec: AttentionSpec, inputs: PagedInputs, need_lse: bool) -> tuple[Any, Any]:
        """(out, lse or None) of an attend_paged call; a backend declaring ``Feature.PAGED`` writes it, reading the
        blocks where they lie. Forward only.

        :param spec: the call's spec; q is 4-D in its layout.
        :param inputs: the cache, block table and lengths (:class:`PagedInputs`), validated.
        :param need_lse: whether the caller wants lse.
        """
        raise NotImplementedError(f"{type(self).__name__}.forward_paged (it declares {Feature.PAGED})")

    def differentiable_forward(self, spec: AttentionSpec, problem: Problem) -> Runner | None:
        """Optional: a :data:`Runner` its framework differentiates itself, made once per (spec, problem); None (the
        default) has the frontend wrap ``forward`` and ``backward``."""
        return None

    def plain_call(self, spec: AttentionSpec, problem: Problem) -> PlainCall | None:
        """Optional: for a plain problem (``problem.is_plain()``), a :data:`PlainCall` ``(q, k, v) -> out`` that
        ``attend`` makes with nothing around it; None (the default): none."""
        return None

    def interpreted(self, device: str) -> bool:
        """Optional: whether its kernels run in an interpreter or emulator on ``device`` (default: no)."""
        return False

    def run_time_builds(self) -> tuple[TorchExtension, ...]:
        """Optional: what it compiles on first use, which ``attnkit build`` builds ahead of time (default: none)."""
        return ()


def own_forward(backend: Backend, spec: AttentionSpec, problem: Problem) -> Runner | None:
    """The backend's ``differentiable_forward`` for (spec, problem), or None where it has none."""
    hook = getattr(backend, "differentiable_forward", None)
    return hook(spec, problem) if hook is not None else None


def own_plain_call(backend: Backend, spec: AttentionSpec, problem: Problem) -> PlainCall | None:
    """The backend's ``plain_call`` for a plain (spec, problem), or None."""
    hook = getattr(backend, "plain_call", None)
    return hook(spec, problem) if hook is not None and problem.is_plain() else None


def run_time_builds(backend: Backend) -> tuple[TorchExtension, ...]:
    """What the backend compiles at run time (its optional ``run_time_builds`` hook): ``attnkit build`` builds them
    ahead of the first call."""
    hook = getattr(backend, "run_time_builds", None)
    return tuple(hook()) if hook is not None else ()


def runs_interpreted(backend: Backend, device: str) -> bool:
    """Whether the backend runs its kernels in an interpreter or emulator on ``device``."""
    hook = getattr(backend, "interpreted", None)
    return bool(hook(device)) if hook is not None else False


class MissingPackageBackend(BaseBackend):
    """Stands in for a built-in backend whose package is not installed, so configs naming it stay valid
    and ``attnkit info`` says what to install.

    :param name: the backend's registry name.
    :param package: the package it needs.
    :param extra: attnkit's extra that installs it (``pip install 'attnkit[extra]'``).
    """

    def __init__(self, name: str, package: str, extra: str) -> None:
        self.name = name
        self.package = package
        self.extra = extra
        self.capabilities = Capabilities(
            frameworks=frozenset(), dtypes=frozenset(), devices=frozenset(), features=frozenset(), length_generic=True
        )

    def available(self) -> list[str]:
        return [f"{self.package} is not installed (pip install 'attnkit[{self.extra}]')"]

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        return self.available()

    def forward(self, spec: AttentionSpec, inputs: AttentionInputs, need_lse: bool) -> tuple[Any, Any]:
        raise BackendUnavailableError(self.available()[0])


#: The module each framework's arrays come from: a call of a framework has imported it.
FRAMEWORK_MODULES = {Framework.TORCH: "torch", Framework.JAX: "jax"}


class LazyBackend:
    """A backend whose module is imported at its first real use, not when the registry loads: a backend built on
    JAX costs a torch-only process nothing (and one built on torch, a JAX-only process), though every backend is
    registered, listed and explained.

    ``frameworks`` are the array frameworks it takes (its capabilities' frameworks: checked by the test suite);
    ``load`` imports its module and returns the backend, or names what to call as ``"module:attribute"`` (an
    entry point's spelling: ``"attnkit.backends.native.torch_sdpa:TorchSdpaBackend"``). Until then it answers
    without importing anything: ``supports()`` for a call of another framework gives :func:`framework_reason`, the
    one reason the backend itself gives (capability_reasons); ``available()`` is empty while no framework it takes
    has been imported (a call it could serve imports one first; its package was found installed), and otherwise the
    backend's own. Everything else (``capabilities``, ``forward``, the optional hooks) loads it, and reports load
    every backend first (``registry.backends(load=True)``). Once loaded, the registry puts the backend
    itself in its place (:func:`bind_loaded`)."""

    def __init__(self, name: str, frameworks: frozenset[Framework], load: Callable[[], Backend] | str) -> None:
        self.name = name
        self.frameworks = frozenset(frameworks)
        self._load = load if callable(load) else functools.partial(_call_named, load)
        self._backend: Backend | None = None
        self._guessed = False  # available() answered without loading: supports() then adds the real reasons once
        self._loading = threading.Lock()

    def __repr__(self) -> str:
        state = "loaded" if self._backend is not None else "not loaded"
        return f"<LazyBackend {self.name!r}, {state}>"

    def loaded(self) -> Backend | None:
        """The backend, if its module has been imported; None otherwise (nothing is imported)."""
        return self._backend

    def load(self) -> Backend:
        """The backend, its module imported first if it was not."""
        backend = self._backend
        if backend is not None:
            return backend
        with self._loading:
            fresh = self._backend is None
            if fresh:
                self._backend = self._load()
            backend = self._backend
        assert backend is not None
        if fresh and _loaded_hook is not None:  # outside the lock: the registry takes its own
            _loaded_hook(self, backend, self._guessed)
        return backend

    def _framework_imported(self) -> bool:
        return any(FRAMEWORK_MODULES[framework] in sys.modules for framework in self.frameworks)

    @property
    def capabilities(self) -> Capabilities:
        return self.load().capabilities

    def available(self) -> list[str]:
        if self._backend is None and not self._framework_imported():
            self._guessed = True
            return []
        return self.load().available()

    def supports(self, spec: AttentionSpec, problem: Problem) -> list[str]:
        if problem.framework not in self.frameworks:
            return [framework_reason(problem.framework, self.frameworks)]
        backend = self.load()
        if self._guessed:  # available() was answered unloaded: the backend's own reasons come once, here
            self._guessed = False
            missing = [f"unavailable: {reason}" for reason in backend.available()]
            if missing:
                return missing
        return backend.supports(spec, problem)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return self.load().forward(*args, **kwargs)

    def backward(self, *args: Any, **kwargs: Any) -> Gradients:
        return self.load().backward(*args, **kwargs)

    def __getattr__(self, attribute: str) -> Any:  # the optional hooks and anything else of the backend's own
        if attribute.startswith("__") or attribute in ("_load", "_backend", "_guessed", "_loading"):
            raise AttributeError(attribute)
        return getattr(self.load(), attribute)


def _call_named(target: str) -> Backend:
    """Call ``"module:attribute"`` (the attribute may be dotted: ``"module:Class.factory"``)."""
    module, _, attribute = target.partition(":")
    found: Any = importlib.import_module(module)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found()


_loaded_hook: Callable[[LazyBackend, Backend, bool], None] | None = None


def bind_loaded(hook: Callable[[LazyBackend, Backend, bool], None]) -> None:
    """The registry binds here what to do when a :class:`LazyBackend` has loaded its backend: put it in its place,
    and forget what was read of it unloaded (the third argument: its ``available()`` was answered so)."""
    global _loaded_hook
    _loaded_hook = hook


# The registry binds its lookup here when it loads (it imports this module, never the other way round).
_lookup: Callable[[str], Backend] | None = None


def bind_registry(lookup: Callable[[str], Backend]) -> None:
    global _lookup
    _lookup = lookup


def peer_backend(name: str) -> Backend:
    """The registered backend ``name``, for a backend that runs another's code (declared in its
    ``Capabilities.delegations``): composition through the registry, never by importing the other backend."""
    if _lookup is None:
        raise BackendUnavailableError(f"backend={name!r}: the registry is not loaded")
    return _lookup(name)


# The config binds its lookup of a backend's options here when it loads (it imports this module, never the other way
# round): ``[backend_options.<name>]`` of the configuration in effect, the innermost scope's.
_options_lookup: Callable[[str], Mapping[str, Any]] | None = None


def bind_options(lookup: Callable[[str], Mapping[str, Any]]) -> None:
    global _options_lookup
    _options_lookup = lookup


def backend_option(backend: Backend, key: str) -> Any:
    """The value of one of ``backend``'s declared :attr:`Capabilities.options` in the configuration in effect, else
    its default. Read it per call: a config scope (``attnkit.use_config``) may change it."""
    declared = dict(backend.capabilities.options)
    if key not in declared:
        raise KeyError(f"backend={backend.name!r} declares no option {key!r} (declared: {sorted(declared)})")
    given = _options_lookup(backend.name) if _options_lookup is not None else {}
    return given.get(key, declared[key])


# The config binds here whether measured choices are kept across processes (its ``autotune`` key, ATTNKIT_AUTOTUNE):
# ``auto``'s records and a backend's own (the triton backend's autotuned tiles) are read and written only when it is on.
_lasting_lookup: Callable[[], bool] | None = None


def bind_lasting_records(lookup: Callable[[], bool]) -> None:
    global _lasting_lookup
    _lasting_lookup = lookup


def lasting_records() -> bool:
    """Whether a backend may read and write records that last across processes (:class:`RecordDirectory`) in the
    configuration in effect: ``autotune = false`` or ``ATTNKIT_AUTOTUNE=0`` turns them off. Read it per call. Off
    until the config has loaded (nothing is kept by a process that never read one)."""
    return _lasting_lookup() if _lasting_lookup is not None else False


# Which code ran: a backend that hands part of a call to another backend's code says so with delegated(); the
# conformance harness records it per case (recording_delegations) to show which rows exercised which code.
_recorded: ContextVar[list[tuple[str, Delegation]] | None] = ContextVar("attnkit_delegations", default=None)


def delegated(by: Backend, delegation: Delegation) -> None:
    """Note that ``by`` has just run ``delegation`` (one of its declared :attr:`Capabilities.delegations`)."""
    trail = _recorded.get()
    if trail is not None:
        trail.append((by.name, delegation))


@contextmanager
def recording_delegations() -> Iterator[list[tuple[str, Delegation]]]:
    """Collect the (backend name, delegation) pairs that ran inside the block, in this context."""
    trail: list[tuple[str, Delegation]] = []
    token = _recorded.set(trail)
    try:
        yield trail
    finally:
        _recorded.reset(token)
