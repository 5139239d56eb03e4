"""Configuration: which backend ``auto`` picks, per device and per spec feature.

Sources, later ones winning: ``configs/default.toml`` shipped with the package, the file named by
``ATTNKIT_CONFIG``, :func:`configure`, then the scoped overrides :func:`use_config` and
:func:`use_backend` (ContextVars, so thread- and asyncio-safe). ``ATTNKIT_BACKEND=name`` forces a
backend for the whole process. Environment variables are read when the base config is first built
and on every :func:`configure` call.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import tomllib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from importlib.resources import files
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from attnkit import registry
from attnkit.backend import ALL_FEATURES, ROUTING_FEATURES
from attnkit.cost import CostTable, load_table
from attnkit.errors import ConfigError

DEVICES = frozenset({"cpu", "cuda"})


class Refinement(BaseModel):
    """A priority list used instead of the device default when every feature in ``when`` and at least one in
    ``when_any`` (if given) is used."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    when: frozenset[str] = frozenset()
    when_any: frozenset[str] = frozenset()
    priority: dict[str, tuple[str, ...]]

    @field_validator("when", "when_any")
    @classmethod
    def _known_features(cls, value: frozenset[str]) -> frozenset[str]:
        allowed = ALL_FEATURES | ROUTING_FEATURES
        unknown = value - allowed
        if unknown:
            raise ValueError(f"unknown feature(s) {sorted(unknown)} (allowed: {sorted(allowed)})")
        return value

    @model_validator(mode="after")
    def _has_condition(self) -> Refinement:
        if not self.when and not self.when_any:
            raise ValueError("a refinement needs `when` (all of) or `when_any` (any of): it would replace every order")
        return self

    def matches(self, features: frozenset[str]) -> bool:
        return self.when <= features and (not self.when_any or not self.when_any.isdisjoint(features))


class Config(BaseModel):
    """The validated configuration. Frozen: dispatch caches key on the serial number it is put in force with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    priority: dict[str, tuple[str, ...]]
    refine: tuple[Refinement, ...] = ()
    backend: str | None = None
    #: Let the measured cost table reorder backends that can all serve a call (attnkit/cost.py).
    use_costs: bool = True
    #: The cost table; None is the one shipped in configs/costs.toml. A relative path in a TOML file is
    #: relative to that file.
    costs: str | None = None
    #: Another backend replaces the first in priority only when predicted faster by more than this fraction.
    cost_margin: float = 0.5

    @field_validator("cost_margin")
    @classmethod
    def _non_negative(cls, value: float) -> float:
        if not value >= 0.0:
            raise ValueError(f"cost_margin={value} must be >= 0")
        return value

    def cost_table(self) -> CostTable | None:
        if not self.use_costs:
            return None
        return load_table(self.costs if self.costs is not None else default_costs_path())

    def priority_for(self, device: str, features: frozenset[str]) -> tuple[str, ...]:
        for refinement in self.refine:
            if device in refinement.priority and refinement.matches(features):
                return refinement.priority[device]
        return self.priority.get(device, ())


def _check_names(config: Config, source: str) -> None:
    known = set(registry.backends())
    allowed = ", ".join(sorted(known))

    def check(key: str, names: Mapping[str, tuple[str, ...]]) -> None:
        for device, order in names.items():
            if device not in DEVICES:
                raise ConfigError(f"{source}: key {key}.{device}: unknown device (allowed: {sorted(DEVICES)})")
            for name in order:
                if name not in known:
                    raise ConfigError(f"{source}: key {key}.{device}: unknown backend {name!r} (allowed: {allowed})")

    check("priority", config.priority)
    for index, refinement in enumerate(config.refine):
        check(f"refine[{index}].priority", refinement.priority)
    if config.use_costs and config.costs is not None:
        load_table(config.costs)  # a missing or malformed table is an error of the config that names it
    if config.backend is not None and config.backend not in known:
        raise ConfigError(f"{source}: key backend: unknown backend {config.backend!r} (allowed: {allowed})")


def load_config(source: str | Path | Mapping[str, Any], base: Config | None = None) -> Config:
    """Validate a TOML file or dict. Keys it gives replace the same keys of ``base``."""
    if isinstance(source, Mapping):
        label, data = "config dict", dict(source)
    else:
        label = str(source)
        try:
            data = tomllib.loads(Path(source).read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise ConfigError(f"{label}: cannot read config: {error}") from error
    if not isinstance(source, Mapping) and isinstance(data.get("costs"), str):
        data["costs"] = str(Path(source).parent / data["costs"])  # relative to the file that names it
    merged = {**(base.model_dump() if base is not None else {}), **data}
    if base is not None and "priority" in data:
        merged["priority"] = {**base.priority, **data["priority"]}
    try:
        config = Config.model_validate(merged)
    except ValidationError as error:
        problems = "; ".join(
            f"key {'.'.join(str(part) for part in item['loc'])}: {item['msg']}" for item in error.errors()
        )
        raise ConfigError(f"{label}: {problems}") from None
    _check_names(config, label)
    return config


def default_config_path() -> Path:
    return Path(str(files("attnkit.configs") / "default.toml"))


@functools.cache
def default_costs_path() -> Path:
    return Path(str(files("attnkit.configs") / "costs.toml"))


_base_lock = threading.Lock()
# Each config in force carries a serial number: dispatch caches key on it, which is cheaper than hashing the
# config and, unlike id(), never reused by a later config.
_serials = itertools.count()
_base: tuple[Config, int] | None = None
_override: ContextVar[tuple[Config, int] | None] = ContextVar("attnkit_config", default=None)
_forced_backend: ContextVar[str | None] = ContextVar("attnkit_backend", default=None)

# What dispatch depends on besides the call, kept where attend() reads it on every call without a function call
# (a call costs about as much as the read): outside any scope, the process-wide config's serial; inside a
# use_config/use_backend scope, that scope's (forced backend, config serial), built once on entry. configure() inside
# a scope changes nothing it dispatches on: a use_config scope's config is fixed on entry, and in a use_backend scope
# the forced backend decides alone.
base_serial: int = -1
scope_state: ContextVar[tuple[str | None, int] | None] = ContextVar("attnkit_scope_state", default=None)


def _build_base(extra: str | Path | Mapping[str, Any] | None = None) -> Config:
    config = load_config(default_config_path())
    user_file = os.environ.get("ATTNKIT_CONFIG")
    if user_file:
        config = load_config(user_file, base=config)
    if extra is not None:
        config = load_config(extra, base=config)
    forced = os.environ.get("ATTNKIT_BACKEND")
    if forced:
        config = load_config({"backend": forced}, base=config)
    return config


def current_config() -> Config:
    return _active()[0]


def _active() -> tuple[Config, int]:
    override = _override.get()
    if override is not None:
        return override
    global _base, base_serial
    if _base is None:
        with _base_lock:
            if _base is None:
                _base = (_build_base(), next(_serials))
                base_serial = _base[1]
    return _base


def state_key() -> tuple[tuple[str | None, int] | None, int]:
    """What dispatch depends on besides the call: the innermost scope's state and the process-wide config's serial.
    attend() reads the same two values inline on its fast path."""
    _active()  # builds the process-wide config on first use, which sets base_serial
    return scope_state.get(), base_serial


def forced_backend() -> str | None:
    """The backend name forced by :func:`use_backend`, else by the config (``ATTNKIT_BACKEND``)."""
    return _forced_backend.get() or current_config().backend


def configure(source: str | Path | Mapping[str, Any] | None = None) -> Config:
    """Set the process-wide config: the shipped default, ``ATTNKIT_CONFIG``, then ``source``."""
    global _base, base_serial
    config = _build_base(source)
    with _base_lock:
        _base = (config, next(_serials))
        base_serial = _base[1]
    return config


@contextlib.contextmanager
def use_config(source: str | Path | Mapping[str, Any]) -> Iterator[Config]:
    """Within the block (this thread or task only), use ``source`` on top of the current config."""
    config = load_config(source, base=current_config())
    serial = next(_serials)
    token = _override.set((config, serial))
    state_token = scope_state.set((_forced_backend.get(), serial))
    try:
        yield config
    finally:
        scope_state.reset(state_token)
        _override.reset(token)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the block (this thread or task only), run every call on backend ``name``."""
    registry.get_backend(name)  # raises UnknownBackendError with the registered names
    token = _forced_backend.set(name)
    state_token = scope_state.set((name, _active()[1]))
    try:
        yield
    finally:
        scope_state.reset(state_token)
        _forced_backend.reset(token)
