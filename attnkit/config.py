"""Configuration: which backend ``auto`` picks, per device and per spec feature.

Layers, later ones winning (docs/dispatch.md, "Precedence", says it in one place): ``configs/default.toml``
shipped with the package, the file named by ``ATTNKIT_CONFIG``, :func:`configure`, ``ATTNKIT_BACKEND`` and
``ATTNKIT_AUTOTUNE`` (measuring on or off, attnkit/autotune.py), then the
scoped overrides :func:`use_config` and :func:`use_backend`, the innermost scope winning (ContextVars: per thread
and per asyncio task; a thread pool does not carry them, see README). Each layer is validated on its own, with
strict types, before it is merged, and an error names its file, variable or call and the key. The environment
variables are read when the process-wide config is first built and on every :func:`configure` call, never at
import.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    Strict,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from attnkit import backend as door
from attnkit import registry
from attnkit.call_cache import CACHE
from attnkit.cost import CostTable, load_table
from attnkit.errors import ConfigError, InvalidInputTypeError
from attnkit.features import ALL_FEATURES, ROUTING_FEATURES, Feature

DEVICES = frozenset({"cpu", "cuda"})
#: The value of ``backend`` (and ``ATTNKIT_BACKEND``) that forces nothing: an inner scope's way back to ``auto``.
AUTO = "auto"
#: ``ATTNKIT_LOG`` values (any case): the level of the ``attnkit`` logger's stderr handler.
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
#: Turns measuring (the ``autotune`` key) on or off for the process, over every config file and configure().
AUTOTUNE_VARIABLE = "ATTNKIT_AUTOTUNE"
SWITCH_VALUES = {"1": True, "on": True, "true": True, "yes": True}
SWITCH_VALUES |= {"0": False, "off": False, "false": False, "no": False}
# Strict scalars: "no" is not False and "0.9" is not a number (an int is a fine float); containers stay lax,
# so a TOML array or a Python list serves where a tuple or frozenset is kept.
Names = tuple[StrictStr, ...]
StrictNumber = Annotated[float, Strict()]
OptionValue = StrictBool | Annotated[int, Strict()] | StrictNumber | StrictStr


class Refinement(BaseModel):
    """A priority list used instead of the device default when every feature in ``when`` and at least one in
    ``when_any`` (if given) is used."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    when: frozenset[StrictStr] = frozenset()
    when_any: frozenset[StrictStr] = frozenset()
    priority: dict[StrictStr, Names]

    @field_validator("when", "when_any")
    @classmethod
    def _known_features(cls, value: frozenset[str]) -> frozenset[Feature]:
        allowed = ALL_FEATURES | ROUTING_FEATURES
        unknown = value - allowed
        if unknown:
            raise ValueError(f"unknown feature(s) {sorted(unknown)} (allowed: {sorted(allowed)})")
        return frozenset(Feature(name) for name in value)

    @model_validator(mode="after")
    def _has_condition(self) -> Refinement:
        if not self.when and not self.when_any:
            raise ValueError("a refinement needs `when` (all of) or `when_any` (any of): it would replace every order")
        return self

    def matches(self, features: frozenset[Feature]) -> bool:
        return self.when <= features and (not self.when_any or not self.when_any.isdisjoint(features))


class Config(BaseModel):
    """The validated configuration, and the type of each layer validated alone (the keys a layer gives are its
    ``model_fields_set``). Frozen: what dispatch remembers under it (attnkit/call_cache.py) stays true until it is
    replaced, which clears those caches (configure()) or leaves its scope (use_config, use_backend)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    #: (epoch, use_costs, costs, table) of the last cost_table() read.
    _table: tuple[int, bool, str | None, CostTable | None] | None = PrivateAttr(default=None)

    priority: dict[StrictStr, Names] = {}
    refine: tuple[Refinement, ...] = ()
    #: The backend every call runs on; None (``"auto"`` in a file, dict or ATTNKIT_BACKEND) forces nothing.
    backend: StrictStr | None = None
    #: Let the measured cost table reorder backends that can all serve a call (attnkit/cost.py).
    use_costs: StrictBool = True
    #: The cost table; None: the shipped ones (configs/costs.toml and configs/costs_cuda.toml). A relative path in a
    #: TOML file is relative to that file.
    costs: StrictStr | None = None
    #: Another backend replaces the first in priority only when predicted faster by more than this fraction.
    cost_margin: StrictNumber = 0.5
    #: Measure the backends that can serve a call where the cost table cannot decide, once per bucket of calls, and
    #: keep the winner across processes (attnkit/autotune.py, docs/dispatch.md "Measuring"); also whether the triton
    #: backend keeps its autotuned tiles across processes (docs/triton.md). ATTNKIT_AUTOTUNE=0 or 1 overrides it.
    autotune: StrictBool = True
    #: At most this many backends are measured for a bucket (the fastest predicted first).
    autotune_candidates: Annotated[int, Strict()] = 3
    #: Where the cost table was not fitted on this machine, every backend predicted at most this many times slower
    #: than the fastest prediction is a candidate (the shipped CPU table was off by up to 3.5x on another machine).
    autotune_spread: StrictNumber = 4.0
    #: Backends never measured: a first call whose cost a few repeated calls cannot bound (one compiling per shape).
    autotune_exclude: Names = ()
    #: Under torch.no_grad() a call with fewer queries than keys, Lq's bucket (the power of two at or above it) at
    #: most this, is a decode step: never measured, since a generation loop's step latency matters more than the
    #: step's backend.
    autotune_decode_len_q: Annotated[int, Strict()] = 16
    #: Measuring a bucket's first call times no call that would take it past this many calls of the slowest
    #: contender, first calls included (issue 32's bound: what measuring adds to the call).
    autotune_budget_calls: StrictNumber = 3.0
    #: And past this many seconds (None: no cap): for buckets whose calls take seconds, where even the first calls of
    #: the contenders are too many; the contenders not timed are in the record, the prediction's pick timed first.
    autotune_budget_s: StrictNumber | None = None
    #: The measured records kept on disk; the oldest go past it.
    autotune_records: Annotated[int, Strict()] = 1024
    #: Settings of single backends, ``[backend_options.<name>]``: each name one the backend declares
    #: (``Capabilities.options``; docs/dispatch.md lists them), its value of the declared default's type.
    backend_options: dict[StrictStr, dict[StrictStr, OptionValue]] = {}

    @field_validator("backend")
    @classmethod
    def _auto_forces_nothing(cls, value: str | None) -> str | None:
        return None if value == AUTO else value

    @field_validator("cost_margin")
    @classmethod
    def _non_negative(cls, value: float) -> float:
        if not value >= 0.0:
            raise ValueError(f"cost_margin={value} must be >= 0")
        return value

    @field_validator("autotune_spread")
    @classmethod
    def _a_factor(cls, value: float) -> float:
        if not value >= 1.0:
            raise ValueError(f"autotune_spread={value} must be >= 1 (a factor over the fastest prediction)")
        return value

    @field_validator("autotune_budget_calls")
    @classmethod
    def _at_least_one_call(cls, value: float) -> float:
        if not value >= 1.0:
            raise ValueError(f"autotune_budget_calls={value} must be >= 1 (calls of the slowest contender)")
        return value

    @field_validator("autotune_budget_s")
    @classmethod
    def _positive_seconds(cls, value: float | None) -> float | None:
        if value is not None and not value > 0.0:
            raise ValueError(f"autotune_budget_s={value} must be > 0 seconds, or unset")
        return value

    @field_validator("autotune_candidates", "autotune_records")
    @classmethod
    def _at_least_two(cls, value: int) -> int:
        if value < 2:
            raise ValueError(f"{value} must be >= 2")
        return value

    @field_validator("autotune_decode_len_q")
    @classmethod
    def _a_count(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"autotune_decode_len_q={value} must be >= 0")
        return value

    def cost_table(self) -> CostTable | None:
        """The cost table in force: read once per config and call-cache epoch (configure(), clear_cache() and
        registry changes start a new one), never per call."""
        epoch, kept = CACHE.epoch, self._table
        if kept is not None and kept[:3] == (epoch, self.use_costs, self.costs):  # a model_copy keeps _table
            return kept[3]
        table = None
        if self.use_costs:
            table = load_table(self.costs) if self.costs is not None else shipped_cost_table()
        self._table = (epoch, self.use_costs, self.costs, table)
        return table

    def priority_for(self, device: str, features: frozenset[Feature]) -> tuple[str, ...]:
        for refinement in self.refine:
            if device in refinement.priority and refinement.matches(features):
                return refinement.priority[device]
        return self.priority.get(device, ())


def _check_backend_name(where: str, name: str) -> None:
    known = registry.backends()
    if name != AUTO and name not in known:
        raise ConfigError(f"{where}: unknown backend {name!r} (allowed: {AUTO}, {', '.join(sorted(known))})")


def _check_names(layer: Config, source: str) -> None:
    """What the types cannot say: devices, backend names and the cost table a layer names."""
    known = set(registry.backends())
    allowed = ", ".join(sorted(known))

    def check(key: str, names: Mapping[str, tuple[str, ...]]) -> None:
        for device, order in names.items():
            if device not in DEVICES:
                raise ConfigError(f"{source}: key {key}.{device}: unknown device (allowed: {sorted(DEVICES)})")
            for name in order:
                if name not in known:
                    raise ConfigError(f"{source}: key {key}.{device}: unknown backend {name!r} (allowed: {allowed})")

    check("priority", layer.priority)
    for name in layer.autotune_exclude:
        if name not in known:
            raise ConfigError(f"{source}: key autotune_exclude: unknown backend {name!r} (allowed: {allowed})")
    for index, refinement in enumerate(layer.refine):
        check(f"refine[{index}].priority", refinement.priority)
    if layer.costs is not None:
        try:
            load_table(layer.costs)
        except ConfigError as error:
            raise ConfigError(f"{source}: key costs: {error}") from None
    if layer.backend is not None:
        _check_backend_name(f"{source}: key backend", layer.backend)
    for name, options in layer.backend_options.items():
        if name not in known:
            raise ConfigError(f"{source}: key backend_options.{name}: unknown backend {name!r} (allowed: {allowed})")
        backend = registry.get_backend(name)
        if isinstance(backend, door.MissingPackageBackend):
            continue  # not installed here: what it declares is unknown, and it runs nothing
        declared = dict(backend.capabilities.options)
        for key, value in options.items():
            if key not in declared:
                raise ConfigError(
                    f"{source}: key backend_options.{name}.{key}: backend {name!r} has no option {key!r} "
                    f"(its options: {', '.join(f'{k} = {v!r}' for k, v in declared.items()) or 'none'})"
                )
            if type(value) is not type(declared[key]):
                raise ConfigError(
                    f"{source}: key backend_options.{name}.{key}: expected a {type(declared[key]).__name__} "
                    f"(default {declared[key]!r}), got {value!r}"
                )


# What a top-level key holds, where pydantic's message says only "a valid dictionary" or "tuple".
_KEY_HINTS = {
    "priority": ' (a table of device = [backend names], e.g. [priority] cpu = ["torch-sdpa", "torch-naive"])',
    "refine": " (an array of tables: [[refine]] with when/when_any and priority.<device>)",
}


def _validation_problems(error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in item["loc"]).lstrip(".")
        hint = _KEY_HINTS.get(key, "")
        problems.append(f"key {key}: {item['msg']}{hint} (got {item['input']!r})")
    return "; ".join(problems)


def _without_devices(refinements: tuple[Refinement, ...], devices: Iterable[str]) -> tuple[Refinement, ...]:
    """``refinements`` without their priority lists for ``devices`` (and without those left with none)."""
    dropped = set(devices)
    kept = []
    for refinement in refinements:
        priority = {device: order for device, order in refinement.priority.items() if device not in dropped}
        if priority:
            kept.append(refinement.model_copy(update={"priority": priority}))
    return tuple(kept)


def _merged(base: Config, layer: Config) -> Config:
    """``layer`` on top of ``base``: each key the layer gives replaces the same key below, except ``priority``,
    replaced per device. A device the layer gives a priority list for loses the refinements below it for that
    device, unless the layer also gives ``refine`` (which replaces every refinement below): a user's order is
    obeyed, not overridden by the shipped refinements for windows or offsets."""
    given = layer.model_fields_set
    update: dict[str, Any] = {key: getattr(layer, key) for key in given}
    if "backend_options" in given:  # per backend and option: a layer's setting replaces that one setting below
        merged = {name: dict(options) for name, options in base.backend_options.items()}
        for name, options in layer.backend_options.items():
            merged[name] = {**merged.get(name, {}), **options}
        update["backend_options"] = merged
    if "priority" in given:
        update["priority"] = {**base.priority, **layer.priority}
        if "refine" not in given:
            update["refine"] = _without_devices(base.refine, layer.priority)
    return base.model_copy(update=update)


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any], base: Config | None = None, *, label: str | None = None
) -> Config:
    """Validate a TOML file or dict on its own, then merge it onto ``base`` (:func:`_merged`). Errors name
    ``label`` (default: the file's path, or "config dict") and the key."""
    if isinstance(source, Mapping):
        label, data = label or "config dict", dict(source)
    elif isinstance(source, (str, os.PathLike)):
        label = label or str(source)
        try:
            data = tomllib.loads(Path(source).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
            raise ConfigError(f"{label}: cannot read config: {error}") from error
        if isinstance(data.get("costs"), str):
            data["costs"] = str(Path(source).parent / data["costs"])  # relative to the file that names it
    else:
        raise InvalidInputTypeError(
            f"{label or 'config'}: expected a TOML file's path (str or os.PathLike) or a mapping, "
            f"got {type(source).__name__}"
        )
    try:
        layer = Config.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"{label}: {_validation_problems(error)}") from None
    _check_names(layer, label)
    return layer if base is None else _merged(base, layer)


def default_config_path() -> Path:
    return Path(str(files("attnkit.configs") / "default.toml"))


#: The shipped cost tables: the CPU one ``attnkit bench --calibrate`` writes, and the CUDA one keyed by the GPU model
#: it was measured on (configs/costs_cuda.toml says where its figures come from).
SHIPPED_COST_TABLES = ("costs.toml", "costs_cuda.toml")


def shipped_cost_table() -> CostTable:
    return _combined(tuple(load_table(Path(str(files("attnkit.configs") / name))) for name in SHIPPED_COST_TABLES))


@functools.lru_cache(maxsize=4)
def _combined(tables: tuple[CostTable, ...]) -> CostTable:
    """One table of the shipped ones, made once per version of their files (load_table caches each per version)."""
    return CostTable.combined(tables)


_base_lock = threading.RLock()
_base: Config | None = None
# The innermost use_config/use_backend scope's config, fixed on entry (the config in force then, with the scope's
# keys on top): configure() inside a scope changes nothing it dispatches on until the scope ends. What dispatch
# remembers keys on the scope by a serial number the call cache gives each scope (CACHE.scope()); a change to the
# process-wide config clears what it remembers (CACHE.clear()).
_override: ContextVar[Config | None] = ContextVar("attnkit_config", default=None)

_log = logging.getLogger("attnkit")
_log_handler: logging.Handler | None = None


def _apply_log_setting() -> None:
    """``ATTNKIT_LOG``: log to stderr from that level. Read with the other variables (first config build, every
    configure()), so a typo is a ConfigError naming it on the first call, and never an import error."""
    global _log_handler
    value = os.environ.get("ATTNKIT_LOG", "")
    if not value:
        if _log_handler is not None:  # set by an earlier build: the variable is gone now
            _log.removeHandler(_log_handler)
            _log.setLevel(logging.NOTSET)
            _log_handler = None
        return
    level = LOG_LEVELS.get(value.lower())
    if level is None:
        raise ConfigError(f"ATTNKIT_LOG={value!r}: unknown log level (allowed, any case: {', '.join(LOG_LEVELS)})")
    if _log_handler is None:
        _log_handler = logging.StreamHandler()
        _log_handler.setFormatter(logging.Formatter("%(message)s"))
        _log.addHandler(_log_handler)
    _log.setLevel(level)


def _call_label(caller: str, source: object) -> str | None:
    return f"{caller}(dict)" if isinstance(source, Mapping) else None


def _build_base(extra: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> Config:
    _apply_log_setting()
    config = load_config(default_config_path())
    user_file = os.environ.get("ATTNKIT_CONFIG")
    if user_file:
        config = load_config(user_file, base=config, label=f"ATTNKIT_CONFIG={user_file}")
    if extra is not None:
        config = load_config(extra, base=config, label=_call_label("configure", extra))
    measuring = os.environ.get(AUTOTUNE_VARIABLE)
    if measuring:
        switch = SWITCH_VALUES.get(measuring.lower())
        if switch is None:
            allowed = ", ".join(SWITCH_VALUES)
            raise ConfigError(f"{AUTOTUNE_VARIABLE}={measuring!r}: expected on or off (allowed, any case: {allowed})")
        config = config.model_copy(update={"autotune": switch})
    forced = os.environ.get("ATTNKIT_BACKEND")
    if forced:
        _check_backend_name("ATTNKIT_BACKEND", forced)
        config = config.model_copy(update={"backend": None if forced == AUTO else forced})
    return config


def current_config() -> Config:
    """The config in force here: the innermost :func:`use_config` or :func:`use_backend` scope of this thread or
    task, else the process-wide one (:func:`configure`'s, or the shipped default with ``ATTNKIT_CONFIG`` and
    ``ATTNKIT_BACKEND`` applied, built on first use)."""
    override = _override.get()
    if override is not None:
        return override
    global _base
    if _base is None:
        with _base_lock:
            if _base is None:
                _base = _build_base()  # nothing was dispatched without a config: nothing to clear
    return _base


door.bind_options(lambda name: current_config().backend_options.get(name, {}))
door.bind_lasting_records(lambda: current_config().autotune)


def forced_backend() -> str | None:
    """The backend every call runs on in the config in force (use_backend, use_config, ATTNKIT_BACKEND, ...)."""
    return current_config().backend


def configure(source: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> Config:
    """Set the process-wide config: the shipped default, ``ATTNKIT_CONFIG``, ``source``, then ``ATTNKIT_BACKEND``
    (the environment is read again).

    :param source: a TOML file's path or a mapping of the same keys (configs/default.toml lists them), merged onto
        the shipped default; ``None``: the default and the environment alone.
    :returns: the new process-wide config.
    :raises attnkit.ConfigError: a file that cannot be read, an unknown key or a value out of range.
    """
    global _base
    with _base_lock:
        config = _build_base(source)
        _base = config
        CACHE.clear()  # after the change: a dispatch that read the old config stores nothing (call_cache.py)
    return config


@contextlib.contextmanager
def _scope(config: Config) -> Iterator[Config]:
    token = _override.set(config)
    try:
        with CACHE.scope():
            yield config
    finally:
        _override.reset(token)


@contextlib.contextmanager
def use_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> Iterator[Config]:
    """Within the block (this thread or task only), use ``source`` on top of the config in force: the keys it gives
    win over every outer scope's, including an outer :func:`use_backend` (``{"backend": "auto"}`` lifts it).

    :param source: a TOML file's path or a mapping of config keys (configs/default.toml lists them).
    :returns: a context manager that gives the config in force inside the block.
    :raises attnkit.ConfigError: a file that cannot be read, an unknown key or a value out of range.
    """
    with _scope(load_config(source, base=current_config(), label=_call_label("use_config", source))) as config:
        yield config


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the block (this thread or task only), run every call on backend ``name`` (``"auto"``: force none).
    The same as ``use_config({"backend": name})``, with the registry's error for an unknown name.

    :param name: a registered backend's name, or ``"auto"``.
    :returns: a context manager.
    :raises attnkit.UnknownBackendError: ``name`` is not registered.
    """
    if not isinstance(name, str):
        raise InvalidInputTypeError(
            f"use_backend(name={name!r}): expected {AUTO!r} or a registered backend's name (a str), "
            f"got {type(name).__name__}"
        )
    if name != AUTO:
        registry.get_backend(name)  # raises UnknownBackendError with the registered names
    with _scope(current_config().model_copy(update={"backend": None if name == AUTO else name})):
        yield
