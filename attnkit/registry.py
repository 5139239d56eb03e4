"""The backend registry: the one piece of global mutable state, guarded by a lock.

Backends come from three places, in this order: the built-in subpackages below (each lists its backends with a
``backends()`` function), then the ``attnkit.backends`` entry points of installed distributions (plugins), then
:func:`register_backend` calls at run time. A plugin whose backend
name is already taken is refused (logged, and listed by ``attnkit info`` with the reason), unless the taken name is
a built-in and the plugin's backend declares ``replaces_builtin = True``; a user who wants a plugin's backend in
place of a built-in can also say so with ``register_backend(backend, replace=True)``. A refused or broken plugin
never breaks ``import attnkit`` or the other backends. :func:`origins` says where each backend came from.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import cast

from attnkit import backend as door
from attnkit.backend import Backend
from attnkit.call_cache import CACHE
from attnkit.errors import InvalidInputError, InvalidInputTypeError, UnknownBackendError

ENTRY_POINT_GROUP = "attnkit.backends"
# Subpackages of attnkit.backends whose backends() lists the built-in backends.
_BUILTIN_MODULES = (
    "attnkit.backends.reference",
    "attnkit.backends.triton",
    "attnkit.backends.pallas",
    "attnkit.backends.native",
    "attnkit.backends.cupy",
    "attnkit.backends.cpu_flash",
)
BUILTIN = "built-in"
#: The attribute by which a plugin's backend asks to replace the built-in backend of its name.
REPLACES_BUILTIN = "replaces_builtin"


@dataclass(frozen=True)
class RefusedPlugin:
    """An entry point whose backends were not registered, and why."""

    entry_point: str  # "name = module:attr from distribution version"
    reason: str


_log = logging.getLogger("attnkit")
_lock = threading.RLock()
_backends: dict[str, Backend] = {}
_origins: dict[str, str] = {}
_refused: list[RefusedPlugin] = []
_loaded = False
_builtins_listed = False


def _register(backend: Backend | door.LazyBackend, replace: bool, origin: str) -> None:
    # A built-in LazyBackend is not checked against the protocol: reading its capabilities would import its module.
    if not isinstance(backend, door.LazyBackend) and not isinstance(backend, Backend):
        raise InvalidInputTypeError(f"backend={backend!r} does not implement attnkit.Backend (see attnkit/backend.py)")
    with _lock:
        previous = _backends.get(backend.name)
        if previous is not None and previous is not backend:
            if not replace:
                raise InvalidInputError(
                    f"a backend named {backend.name!r} is already registered ({_origins[backend.name]}); "
                    "pass replace=True"
                )
            origin = f"{origin}, replacing {_origins[backend.name]}"
        _backends[backend.name] = cast(Backend, backend)  # a LazyBackend answers as its backend does
        _origins[backend.name] = origin
        CACHE.clear()  # after the change: nothing dispatched before it is served again (attnkit/call_cache.py)


def _put_loaded(lazy: door.LazyBackend, backend: Backend, guessed: bool) -> None:
    """A built-in backend's module has been imported (its first real use): the backend takes its stand-in's place.
    What dispatch read of the stand-in stays true, unless its availability was answered without loading."""
    with _lock:
        if _backends.get(lazy.name) is lazy:
            _backends[lazy.name] = backend
            if guessed:
                CACHE.clear()


door.bind_loaded(_put_loaded)


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Add a backend under ``backend.name``. Re-registering a name needs ``replace=True``. Registered at run time,
    it comes after the built-ins and plugins, which are loaded first.

    :param backend: an object implementing :class:`attnkit.Backend` (usually a :class:`attnkit.BaseBackend`).
    :param replace: put it in place of a backend already registered under its name.
    :raises attnkit.InvalidInputTypeError: ``backend`` does not implement the protocol.
    :raises attnkit.InvalidInputError: the name is taken and ``replace`` is not set.
    """
    caller = sys._getframe(1).f_globals.get("__name__", "?")  # only to say who registered it (attnkit info)
    _ensure_loaded()
    _register(backend, replace, f"registered at run time by {caller}")


def unregister_backend(name: str) -> None:
    """Remove the backend registered as ``name``; ``auto`` no longer considers it.

    :param name: the backend's registered name.
    :raises attnkit.UnknownBackendError: nothing is registered under ``name``.
    """
    with _lock:
        _ensure_loaded()
        if name not in _backends:
            raise UnknownBackendError(f"backend={name!r} is not registered (registered: {sorted(_backends)})")
        del _backends[name]
        del _origins[name]
        CACHE.clear()


def _describe(entry: EntryPoint) -> str:
    dist = entry.dist
    source = f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"
    return f"entry point {entry.name} = {entry.value} from {source}"


def _load_plugin(entry: EntryPoint) -> None:
    """Register the backends of one entry point (a Backend, a list of them, or a callable (a class, say) returning
    either), or refuse the whole entry point: a plugin is not half registered."""
    described = _describe(entry)
    try:
        loaded = entry.load()
        # A class satisfies the protocol's attribute check too: it is called, like any other factory.
        made = isinstance(loaded, type) or (callable(loaded) and not isinstance(loaded, Backend))
        found = loaded() if made else loaded
        backends = list(found) if isinstance(found, (list, tuple)) else [found]
        replacing, names = set(), set()
        for backend in backends:
            if not isinstance(backend, Backend) or not isinstance(backend.name, str):
                raise InvalidInputTypeError(f"{backend!r} does not implement attnkit.Backend (a str name and methods)")
            if backend.name in names:
                raise InvalidInputError(f"it gives two backends named {backend.name!r}")
            names.add(backend.name)
            declared = getattr(backend, REPLACES_BUILTIN, False)
            if not isinstance(declared, bool):
                raise InvalidInputTypeError(f"{backend.name}.{REPLACES_BUILTIN}={declared!r}, expected True or False")
            taken = _origins.get(backend.name)
            if taken is None:
                continue
            if declared and taken == BUILTIN:
                replacing.add(backend.name)
                continue
            raise InvalidInputError(
                f"backend name {backend.name!r} is already taken by {taken} (a plugin replaces a built-in only "
                f"if its backend sets {REPLACES_BUILTIN} = True; or register it yourself with "
                "attnkit.register_backend(backend, replace=True))"
            )
    except Exception as error:  # a broken or clashing third-party plugin must not break attnkit
        _refused.append(RefusedPlugin(described, f"{type(error).__name__}: {error}"))
        _log.warning("attnkit: %s refused: %s", described, error)
        return
    for backend in backends:
        _register(backend, backend.name in replacing, described)
        if backend.name in replacing:
            _log.info("attnkit: %s replaces the built-in backend %r, as it declares", described, backend.name)


def _ensure_loaded() -> None:
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        _loaded = True
        global _builtins_listed
        if not _builtins_listed:  # once per process, as the modules' imports are
            _builtins_listed = True
            for module in _BUILTIN_MODULES:
                for backend in importlib.import_module(module).backends():
                    _register(backend, False, BUILTIN)
        _refused.clear()
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            _load_plugin(entry)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; a built-in one's module is imported now if it was not.

    :param name: a registered backend's name (``attnkit info`` lists them).
    :raises attnkit.UnknownBackendError: nothing is registered under ``name``; the message lists what is.
    """
    _ensure_loaded()
    with _lock:
        try:
            backend = _backends[name]
        except KeyError:
            raise UnknownBackendError(
                f"backend={name!r} is not registered (registered: {', '.join(sorted(_backends))})"
            ) from None
    return _itself(backend)  # outside the lock: loading takes it (_put_loaded)


door.bind_registry(get_backend)


def backends(load: bool = False) -> dict[str, Backend]:
    """A snapshot of the registered backends, by name. A built-in backend whose module has not been imported yet is
    its :class:`~attnkit.backend.LazyBackend`, which answers for it (availability, the reasons for a call of another
    framework) without importing its framework, and imports it for anything else. ``load=True`` imports every one
    first (what reports on every backend want: ``attnkit info``, ``attnkit check``): each is then itself, and its
    ``available()`` the backend's own, not the stand-in's "nothing missing" before its framework is imported.

    :param load: import every backend's module first.
    :returns: a new dict of name to backend; changing it changes nothing registered.
    """
    _ensure_loaded()
    with _lock:
        found = dict(_backends)
    if load:
        found = {name: _itself(backend) for name, backend in found.items()}
    return found


def _itself(backend: Backend | door.LazyBackend) -> Backend:
    return backend.load() if isinstance(backend, door.LazyBackend) else backend


def origins() -> dict[str, str]:
    """Where each registered backend came from: ``"built-in"``, the entry point and its distribution and version,
    or the module that registered it at run time (each with what it replaced, if anything)."""
    _ensure_loaded()
    with _lock:
        return dict(_origins)


def refused_plugins() -> tuple[RefusedPlugin, ...]:
    """The entry points that registered nothing, with the reason (a name clash, an import or call that failed)."""
    _ensure_loaded()
    with _lock:
        return tuple(_refused)
