"""The backend registry: the one piece of global mutable state, guarded by a lock."""

from __future__ import annotations

import importlib
import logging
import threading
from importlib.metadata import entry_points

from attnkit.backend import Backend
from attnkit.errors import InvalidInputError, InvalidInputTypeError, UnknownBackendError

ENTRY_POINT_GROUP = "attnkit.backends"
# Subpackages of attnkit.backends that register the built-in backends when imported.
_BUILTIN_MODULES = (
    "attnkit.backends.reference",
    "attnkit.backends.triton",
    "attnkit.backends.pallas",
    "attnkit.backends.native",
    "attnkit.backends.cupy",
    "attnkit.backends.cpu_flash",
)

_log = logging.getLogger("attnkit")
_lock = threading.RLock()
_backends: dict[str, Backend] = {}
_loaded = False
# Bumped on every change, so caches keyed on it never serve stale choices. attend() reads it directly on every
# call (a function call costs as much as the read at decode sizes); it only grows, so a key read before the
# built-in backends loaded can never match again.
serial = 0


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Add a backend under ``backend.name``. Re-registering a name needs ``replace=True``."""
    if not isinstance(backend, Backend):
        raise InvalidInputTypeError(f"backend={backend!r} does not implement attnkit.Backend (see attnkit/backend.py)")
    global serial
    with _lock:
        if backend.name in _backends and not replace and _backends[backend.name] is not backend:
            raise InvalidInputError(f"a backend named {backend.name!r} is already registered; pass replace=True")
        _backends[backend.name] = backend
        serial += 1


def unregister_backend(name: str) -> None:
    global serial
    with _lock:
        _ensure_loaded()
        if name not in _backends:
            raise UnknownBackendError(f"backend={name!r} is not registered (registered: {sorted(_backends)})")
        del _backends[name]
        serial += 1


def _ensure_loaded() -> None:
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        _loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded = entry.load()
                backends = loaded() if callable(loaded) and not isinstance(loaded, Backend) else loaded
                for backend in backends if isinstance(backends, (list, tuple)) else [backends]:
                    register_backend(backend, replace=True)
            except Exception as error:  # a broken third-party plugin must not break attnkit
                _log.warning("attnkit: entry point %s failed to load: %s", entry.name, error)


def get_backend(name: str) -> Backend:
    _ensure_loaded()
    with _lock:
        try:
            return _backends[name]
        except KeyError:
            raise UnknownBackendError(
                f"backend={name!r} is not registered (registered: {', '.join(sorted(_backends))})"
            ) from None


def backends() -> dict[str, Backend]:
    """A snapshot of the registered backends, by name."""
    _ensure_loaded()
    with _lock:
        return dict(_backends)


def generation() -> int:
    """:data:`serial`, once the built-in backends and entry points are loaded."""
    if not _loaded:
        _ensure_loaded()
    return serial
