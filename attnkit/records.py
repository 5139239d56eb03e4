"""Small JSON records kept across processes in a private directory: ``auto``'s measured buckets (attnkit/autotune.py)
and the triton backend's autotuned tiles (backends/triton/launch.py). Independent of any backend; the door
(attnkit/backend.py) exposes it to backends.

* **Where.** ``ATTNKIT_AUTOTUNE_DIR``, else ``$XDG_CACHE_HOME/attnkit/autotune``, else ``~/.cache/attnkit/autotune``
  (:func:`default_directory`); a kind of record may keep a subdirectory of it.
* **One file per key**, ``<key>.json``, the key a hash of everything the record depends on, so a record is never read
  where it was not made. Written to a private temporary file and moved into place with ``os.replace``: a reader sees a
  whole record or none, and concurrent writers of one key each write a whole one (the last stays).
* **Bounded**: at most ``limit`` records, the least recently written removed first; scratch files of writers that died
  (older than an hour) go too.
* **Private**: read only from a directory and files the current user owns and nobody else can write
  (:func:`attnkit.build.ownership_problem`); otherwise :class:`RecordsRefusedError` says why.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnkit.build import ownership_problem
from attnkit.errors import AttnkitError

DIRECTORY_VARIABLE = "ATTNKIT_AUTOTUNE_DIR"
#: A scratch file older than this (seconds) belongs to a writer that died: pruned.
SCRATCH_AGE_S = 3600.0


class RecordsRefusedError(AttnkitError, RuntimeError):
    """A records directory or file may not be used (someone else owns it or could write it, or it cannot be
    created); the message says why. Callers catch it and keep what they measured in the process only."""


def default_directory() -> Path:
    """``ATTNKIT_AUTOTUNE_DIR``, else ``$XDG_CACHE_HOME/attnkit/autotune``, else ``~/.cache/attnkit/autotune``."""
    given = os.environ.get(DIRECTORY_VARIABLE)
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnkit" / "autotune"


@functools.cache
def attnkit_version() -> str:
    """The installed attnkit's version ("unknown" when it is not installed as a distribution)."""
    from importlib import metadata

    try:
        return metadata.version("attnkit")
    except metadata.PackageNotFoundError:
        return "unknown"


class RecordDirectory:
    """The records of one kind: ``directory()`` is read at each use (a test or bench may point it elsewhere);
    ``what`` names them in refusals, e.g. "autotune record"."""

    def __init__(self, what: str, directory: Callable[[], Path]) -> None:
        self.what = what
        self.directory = directory

    def path(self, key: str) -> Path:
        return self.directory() / f"{key}.json"

    def usable(self, create: bool) -> Path:
        """The directory, created owner-only when ``create`` and missing; RecordsRefusedError when it may not be used
        (someone else owns it or may write it, or it cannot be created)."""
        directory = self.directory()
        if create:
            try:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as error:
                raise RecordsRefusedError(f"cannot create the {self.what}s directory {directory}: {error}") from None
        try:
            problem = ownership_problem(directory)
        except OSError as error:
            raise RecordsRefusedError(f"cannot use the {self.what}s directory {directory}: {error}") from None
        if problem:
            raise RecordsRefusedError(
                f"refusing the {self.what}s directory: {problem} (set {DIRECTORY_VARIABLE} to a private one)"
            )
        return directory

    def read(self, key: str) -> Any | None:
        """The JSON a record holds, or None when there is none or it cannot be read whole (a caller measures again
        and replaces it); RecordsRefusedError when the directory or the file may not be read."""
        path = self.path(key)
        if not path.exists():
            return None
        self.usable(create=False)
        try:
            refused = ownership_problem(path)
            if refused:
                raise RecordsRefusedError(f"refusing the {self.what} {path}: {refused}")
            return json.loads(path.read_text())
        except (OSError, ValueError):  # vanished, unreadable or not JSON
            return None

    def write(self, key: str, data: Any, limit: int) -> Path:
        """Write ``data`` as the record of ``key`` (atomically, mode 0600) and prune to ``limit`` records; the path.
        RecordsRefusedError when the directory may not be used, OSError when writing fails."""
        usable = self.usable(create=True)
        path = usable / f"{key}.json"
        descriptor, scratch = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=usable)  # mode 0600
        try:
            with os.fdopen(descriptor, "w") as file:
                json.dump(data, file, indent=1)
            os.replace(scratch, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(scratch)
            raise
        self.prune(usable, limit)
        return path

    @staticmethod
    def prune(directory: Path, limit: int) -> None:
        """At most ``limit`` records: the least recently written go first, and scratch files of writers that died.
        Another process pruning at once removes some of the same files: ignored."""
        ages: list[tuple[float, Path]] = []
        now = time.time()
        for entry in os.scandir(directory):
            with contextlib.suppress(OSError):
                modified = entry.stat(follow_symlinks=False).st_mtime
                if entry.name.endswith(".json"):
                    ages.append((modified, Path(entry.path)))
                elif entry.name.endswith(".tmp") and now - modified > SCRATCH_AGE_S:
                    os.unlink(entry.path)
        ages.sort()
        for _, path in ages[: max(len(ages) - limit, 0)]:
            with contextlib.suppress(OSError):
                path.unlink()
