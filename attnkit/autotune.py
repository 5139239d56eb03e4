"""Measuring where the cost model cannot decide: ``auto``'s benchmark mode (docs/dispatch.md, "Measuring").

The cost table (attnkit/cost.py) is a prior: fitted on one machine, it was off by up to 3.5x on another, where it
made ``auto`` 2x slower than the SDPA call it replaced (issue 32). So where more than one backend can serve a call and
either the table's predictions for them are within ``cost_margin`` of each other, or the table was not fitted on this
machine (its ``fitted_on`` is not this CPU's fingerprint), ``auto`` times the few *contenders* on the call's own
inputs, keeps the winner in a :class:`Record`, and uses it from then on, in this process and in later ones. As
cuDNN's benchmark mode, Triton's autotuner and FFTW's wisdom do.

* **Bucket.** One record per (device model, framework and versions, torch threads, dtype, shape bucket, spec class,
  pass, contenders): batch, heads and lengths rounded up to a power of two, the head-group ratio and head dims exact,
  the spec class the call's routing features (causal, window, softcap, layout, mask, lse, grad, ...). Its key is a
  hash of all of it, as the build cache keys a build (attnkit/build.py): what a timing depends on is in the key, so
  a record is never read for a machine, version or call kind it was not measured on.
* **Measuring** (:func:`measure`): one timed call per contender, the prediction's pick first; a contender slower
  than the best by more than :data:`CLOSE` is beaten and timed no more; the ones still close, and those whose only
  sample was their first call in the process (which loads code and memory: an upper bound of a call, not a sample
  of one), are timed again, and the first of the close ones in the priority list wins. Every timed call counts,
  first calls included, and none is made that would take the measuring past ``autotune_budget_calls`` calls of the
  slowest contender (issue 32's bound: 3) or ``autotune_budget_s`` seconds: a contender not timed then is not in the
  record, which says why. A contender whose first call in the process costs far more than a call (a build, a
  compile: the backend's ``cold_start`` says so) is not timed at all, the prediction deciding against it; its record
  is kept in the process only, so that a later process, where it is ready, measures it. A call that records gradients
  is measured forward+backward, on detached views of its inputs (no copy; ``torch.autograd.grad``, so nothing is
  accumulated into the caller's ``.grad``).
* **Never measured** (the prediction, or a record already there, decides): under ``torch.compile`` and on meta or
  fake tensors (attend hands those to the graph operator, which never measures), JAX arrays (jit traces attend: its
  tracers have no values), and decode steps under ``torch.no_grad()`` (Lq <= ``autotune_decode_len_q`` and Lq <
  Lk), where a generation loop's step latency matters more than which backend runs it. With ``autotune = false``
  or ``ATTNKIT_AUTOTUNE=0``, nothing is measured and no record is read.
* **Records** (:class:`RecordStore`): one JSON file per bucket under ``ATTNKIT_AUTOTUNE_DIR``, else
  ``$XDG_CACHE_HOME/attnkit/autotune`` (``~/.cache/attnkit/autotune``); written to a private temporary file and moved
  into place with ``os.replace``, so a reader sees a whole record or none and concurrent writers of one bucket each
  write a whole one (the last stays); at most ``autotune_records`` files, the oldest removed first. Read only from a
  directory and files the current user owns and nobody else can write (:func:`attnkit.build.ownership_problem`):
  otherwise the directory is refused (logged once), and measured winners are kept in the process only. The files
  are handled by :mod:`attnkit.records`, which the triton backend's tile records share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnkit import cost, notices
from attnkit.backend import AttentionInputs, Backend, Framework, Problem, length_bucket, routing_features
from attnkit.build import digest
from attnkit.call_cache import CACHE
from attnkit.environment import accelerator_name, cpu_fingerprint
from attnkit.records import RecordDirectory, RecordsRefusedError, default_directory
from attnkit.spec import AttentionSpec

if TYPE_CHECKING:
    from attnkit.config import Config
    from attnkit.frontends import FrameworkOps

_log = logging.getLogger("attnkit")

#: A contender slower than the best time by more than this fraction is beaten: timed no more.
CLOSE = 0.10
#: A contender is timed at most this many times for a bucket (a bound on the loop, whatever the clock says).
SAMPLES_AT_MOST = 5
RECORD_VERSION = 2  # 2: the contenders not timed, and why
#: Buckets remembered as having no record, per process (the call cache's bound: attnkit/call_cache.py).
MISSING_LIMIT = 4096

#: The clock measuring reads (seconds); tests put a fake one here.
clock: Callable[[], float] = time.perf_counter


#: The records directory may not be used (someone else owns it or could write it, or it cannot be created); the
#: message says why. Dispatch catches it: the measured winner is then kept in the process only.
AutotuneStoreError = RecordsRefusedError


@dataclass(frozen=True)
class Record:
    """A bucket's measurement: the winner and each contender's best time, in the order they were timed."""

    key: str
    bucket: str  # the bucket in words (dtype, pass, shape, spec class)
    winner: str
    times_us: tuple[tuple[str, float], ...]
    measured_at: str  # UTC
    path: str = ""  # the file it was read from or written to; "" when kept in the process only
    note: str = ""  # why it is kept in the process only
    #: Contenders of the bucket that were not timed, each with why (the budget, a first call that builds or compiles).
    unmeasured: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        """One line: the times, the contenders not timed, and where the record lives."""
        times = ", ".join(f"{name} {format_us(us)}" for name, us in self.times_us)
        if self.unmeasured:
            times += "; not timed: " + "; ".join(f"{name} ({why})" for name, why in self.unmeasured)
        where = f"record {self.path}" if self.path else f"record kept in this process only: {self.note}"
        return f"{times} ({where}; measured {self.measured_at} for {self.bucket})"

    def to_json(self) -> dict[str, Any]:
        return {
            "version": RECORD_VERSION,
            "key": self.key,
            "bucket": self.bucket,
            "winner": self.winner,
            "times_us": [[name, us] for name, us in self.times_us],
            "measured_at": self.measured_at,
            "unmeasured": [[name, why] for name, why in self.unmeasured],
        }

    @staticmethod
    def from_json(data: Any, path: str) -> Record | None:
        """The record a file holds, or None if it is not one of this version (a reader never trusts a file it
        cannot fully read: it measures again and replaces it)."""
        try:
            if data["version"] != RECORD_VERSION:
                return None
            times = tuple((str(name), float(us)) for name, us in data["times_us"])
            unmeasured = tuple((str(name), str(why)) for name, why in data["unmeasured"])
            record = Record(
                str(data["key"]),
                str(data["bucket"]),
                str(data["winner"]),
                times,
                str(data["measured_at"]),
                path,
                unmeasured=unmeasured,
            )
        except (KeyError, TypeError, ValueError):
            return None
        return record if record.winner in dict(times) else None


# ------------------------------------------------------------------------------------------------------ buckets


@functools.cache
def _source_digest() -> str:
    """A digest of attnkit's own code and its backends' (Python, C++, CUDA C, tables): a changed kernel measures
    anew, where a version number would keep its old records."""
    import importlib.util

    backends = importlib.util.find_spec("attnkit.backends")
    locations = (backends.submodule_search_locations or []) if backends is not None else []
    roots = [Path(__file__).parent, *(Path(location) for location in locations)]
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".cpp", ".cu", ".cuh", ".h", ".toml") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def _versions(framework: Framework) -> str:
    """What a timing depends on besides the machine: attnkit's code, Python's and the framework's versions."""
    code = f"source {_source_digest()}"
    if framework is Framework.TORCH:
        import torch

        return f"attnkit {code}, python {platform.python_version()}, torch {torch.__version__}"
    import jax

    return f"attnkit {code}, python {platform.python_version()}, jax {jax.__version__}"


def _threads(framework: Framework) -> int:
    if framework is Framework.TORCH:
        import torch

        return torch.get_num_threads()
    return os.cpu_count() or 1


def device_model(problem: Problem) -> str:
    """The GPU's model for a CUDA call, this CPU's fingerprint (model and instruction-set flags) for a CPU one."""
    if problem.device == "cpu":
        return f"cpu {cpu_fingerprint()}"
    return f"{problem.device} {accelerator_name(problem.framework.value, problem.device) or 'unknown model'}"


def bucket_of(spec: AttentionSpec, problem: Problem) -> str:
    """The bucket of a call in words: dtype, pass, rounded shape and spec class (module docstring)."""
    group = problem.heads_q // max(problem.heads_kv, 1)
    shape = (
        f"B<={length_bucket(problem.batch)} Hq<={length_bucket(problem.heads_q)} group={group} "
        f"Lq<={length_bucket(problem.len_q)} Lk<={length_bucket(problem.len_k)} D={problem.head_dim} "
        f"Dv={problem.head_dim_v}"
    )
    features = ",".join(sorted(routing_features(spec, problem))) or "plain"
    return f"{problem.framework.value} {problem.device} {problem.dtype} {cost.pass_of(problem)} {shape} {features}"


def bucket_key(spec: AttentionSpec, problem: Problem, contenders: Sequence[str]) -> tuple[str, str]:
    """(key, bucket in words): the key hashes the bucket, the machine, the versions, the thread count and the
    contenders, so a record is read only where all of them are the same."""
    bucket = bucket_of(spec, problem)
    identity = (
        bucket,
        device_model(problem),
        _versions(problem.framework),
        f"threads {_threads(problem.framework)}",
        "contenders " + ",".join(sorted(contenders)),
    )
    return digest(*identity), bucket


# ------------------------------------------------------------------------------------------------ contenders


def contenders(
    servable: Sequence[str], predicted: Mapping[str, float | None], chosen: str, fitted_here: bool, config: Config
) -> tuple[str, ...]:
    """The backends worth measuring for a call (fastest predicted first, at most ``autotune_candidates``), or fewer
    than two when the prediction decides: with a table fitted on this machine, those predicted within
    ``cost_margin`` of the fastest prediction; otherwise those within ``autotune_spread`` of it, and those without
    a prediction. ``chosen`` (the prediction's pick) is always among them; never one of ``autotune_exclude``, and none
    when ``chosen`` is one (only ``chosen`` is returned)."""
    allowed = [name for name in servable if name not in config.autotune_exclude]
    if chosen not in allowed:  # the pick cannot be measured against the others: measuring them would drop it unheard
        return (chosen,)
    times = {name: time for name in allowed if (time := predicted.get(name)) is not None}
    fastest = min(times.values(), default=None)
    factor = 1.0 + config.cost_margin if fitted_here else config.autotune_spread
    picked = [name for name, time in times.items() if fastest is None or time <= fastest * factor]
    if not fitted_here:
        picked += [name for name in allowed if name not in times]
    rank = {name: index for index, name in enumerate(servable)}  # priority order breaks ties and orders unknowns
    picked.sort(key=lambda name: (times.get(name, math.inf), rank[name]))
    if chosen in picked:
        picked.remove(chosen)
    picked.insert(0, chosen)
    return tuple(picked[: config.autotune_candidates])


# ------------------------------------------------------------------------------------------------- measuring


class Trial:
    """Times one backend on the inputs of the call being dispatched (eager torch calls only: :meth:`skip_reason`)."""

    def __init__(
        self,
        ops: FrameworkOps,
        spec: AttentionSpec,
        problem: Problem,
        inputs: AttentionInputs,
        dry_run: bool = False,
    ) -> None:
        self.ops = ops
        self.spec = spec
        self.problem = problem
        self.inputs = inputs
        #: explain's: says whether the call would be measured, never times anything.
        self.dry_run = dry_run

    def skip_reason(self, config: Config) -> str | None:
        """Why this call must not be measured (the prediction decides), or None."""
        if self.problem.framework is not Framework.TORCH:
            return "not measured: a JAX call (jit traces attend, where its arrays have no values)"
        import torch

        q = self.inputs.q
        if torch.compiler.is_compiling() or self.ops.symbolic(q):
            return "not measured: inside a torch.compile trace, or meta/fake tensors"
        problem = self.problem
        # Lq's bucket, not Lq: the rule is then one per length class (Problem.length_class), as the decision is.
        decode = length_bucket(problem.len_q) <= config.autotune_decode_len_q and problem.len_q < problem.len_k
        if decode and not torch.is_grad_enabled():
            return (
                f"not measured: a decode step under torch.no_grad() (Lq={problem.len_q}, in a bucket <= "
                f"autotune_decode_len_q={config.autotune_decode_len_q}, Lq < Lk), whose latency comes first"
            )
        return None

    def seconds(self, backend: Backend) -> float:
        """One call's time on ``backend``: forward, or forward+backward where the call records gradients."""
        import torch

        run = self.ops.runner(backend, self.spec, self.problem)
        inputs = self.inputs
        leaves: list[torch.Tensor] = []
        if self.problem.needs_grad:  # detached views: the backward reaches none of the caller's tensors
            fields = list(inputs)
            for index, tensor in enumerate(fields):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    fields[index] = tensor.detach().requires_grad_(True)
                    leaves.append(fields[index])
            inputs = AttentionInputs(*fields)
        synchronize = torch.cuda.synchronize if self.problem.device == "cuda" else None
        if synchronize is not None:
            synchronize()
        start = clock()
        out, _ = run(inputs)
        if leaves:
            torch.autograd.grad(out, leaves, grad_outputs=torch.ones_like(out))
        if synchronize is not None:
            synchronize()
        return clock() - start


#: Backends measuring has run in this process: a backend's first call loads its code and memory (cpu-flash's
#: extension, a first kernel launch, the allocator's pages) and may take several later calls' time, so a sample of
#: a first call only bounds a call from above.
_warm: set[str] = set()


@dataclass(frozen=True)
class Measurement:
    """What :func:`measure` found: the winner, each timed contender's best time in µs (in the order timed), and the
    contenders it did not time, with why."""

    winner: str
    times_us: dict[str, float]
    unmeasured: tuple[tuple[str, str], ...] = ()
    #: A contender was left out for this process's state only (its first call builds or compiles): the record is
    #: then kept in the process, and a later process measures the bucket again.
    transient: bool = False


def cold_start(backend: Backend, spec: AttentionSpec, problem: Problem) -> str | None:
    """Why ``backend``'s next call on this problem costs far more than a call (its optional ``cold_start`` hook: a
    build, a compile), or None."""
    hook = getattr(backend, "cold_start", None)
    return hook(spec, problem) if hook is not None else None


class _Budget:
    """The time measuring may spend (module docstring, "Measuring"): ``calls`` calls of the slowest contender timed,
    and ``seconds`` (None: no cap)."""

    def __init__(self, calls: float, seconds: float | None) -> None:
        self.calls = calls
        self.seconds = seconds
        self.spent = 0.0

    def refusal(self, estimate: float, best: Mapping[str, float]) -> str | None:
        """Why one more call, estimated at ``estimate`` seconds, would pass the budget, or None (the first call is
        always made: nothing is known before it)."""
        if not best:
            return None
        if self.spent + estimate > self.calls * max(*best.values(), estimate):
            return f"the budget of {self.calls:g} calls of the slowest contender (autotune_budget_calls) was spent"
        if self.seconds is not None and self.spent + estimate > self.seconds:
            return f"the budget of {self.seconds:g} s (autotune_budget_s) was spent"
        return None


def measure(
    contenders: Sequence[Backend],
    trial: Trial,
    priority: Sequence[str],
    budget_calls: float,
    budget_s: float | None = None,
) -> Measurement | None:
    """The fastest of ``contenders`` (the prediction's pick first) on the trial's call, the first in ``priority``
    (every contender is in it) among those within :data:`CLOSE` of the best (module docstring, "Measuring"). Every
    timed call counts against the budget, first calls included: ``budget_calls`` calls of the slowest contender
    timed, and ``budget_s`` seconds; a call that would pass it is not made. None when none could be timed. A
    contender that fails is left out (its error is logged): measuring never fails the call, which then runs its
    backend and raises what it raises. Measuring that took over a second is announced, once per process
    (attnkit/notices.py)."""
    started = clock()
    found = _measure(contenders, trial, priority, budget_calls, budget_s)
    took = clock() - started
    if took > notices.SLOW_S:  # once per process: later buckets are measured in silence
        names = ", ".join(backend.name for backend in contenders)
        notices.once(
            "measuring",
            f"auto timed {names} on a new kind of call ({took:.1f} s, each one's first call included; once per kind "
            f"of call, the choice kept for later processes under {STORE.directory()})",
        )
    return found


def _measure(
    contenders: Sequence[Backend],
    trial: Trial,
    priority: Sequence[str],
    budget_calls: float,
    budget_s: float | None,
) -> Measurement | None:
    by_name = {backend.name: backend for backend in contenders}
    best: dict[str, float] = {}
    first_call_only: set[str] = set()  # sampled once, on its first call in the process: an upper bound
    unmeasured: list[tuple[str, str]] = []
    budget = _Budget(budget_calls, budget_s)

    def time_once(name: str) -> None:
        first = name not in _warm
        try:
            seconds = trial.seconds(by_name[name])
        except Exception as error:  # noqa: BLE001  any failure only removes the contender; the call reports its own
            _log.info("attnkit: measuring %s failed (%s: %s); left out", name, type(error).__name__, error)
            best.pop(name, None)
            first_call_only.discard(name)
            return
        _warm.add(name)
        budget.spent += seconds
        best[name] = min(best.get(name, math.inf), seconds)
        (first_call_only.add if first else first_call_only.discard)(name)

    transient = False
    for index, backend in enumerate(contenders):
        # The prediction's pick (index 0) runs the call anyway: its first call is paid with or without measuring.
        slow_start = None if index == 0 or backend.name in _warm else cold_start(backend, trial.spec, trial.problem)
        refused = slow_start or budget.refusal(max(best.values(), default=0.0), best)  # unknown: as the slowest
        if refused is not None:
            unmeasured.append((backend.name, refused))
            transient = transient or slow_start is not None
        else:
            time_once(backend.name)
    for _ in range(SAMPLES_AT_MOST - 1):
        if not best:
            break
        fastest = min(best.values())
        # Timed again: the close ones, and those whose one sample was a first call (it may be loading, not work).
        close = [name for name, seconds in best.items() if seconds <= fastest * (1.0 + CLOSE)]
        running = sorted(set(close) | first_call_only, key=best.__getitem__)  # the fastest first: likeliest winners
        affordable = [name for name in running if budget.refusal(best[name], best) is None]
        # A round decides something only if it samples a first call again or compares two close ones.
        if len(running) < 2 or (len(affordable) < 2 and not first_call_only & set(affordable)):
            break
        for name in affordable:
            if name in best and budget.refusal(best[name], best) is None:
                time_once(name)
    if not best:
        return None
    fastest = min(best.values())
    # Within CLOSE of the best, one sample each cannot tell them apart on a busy machine (the same backend timed
    # twice differed by 25% in a loaded bench here): the priority order decides among them, as the cost margin
    # leaves a close prediction to it, so the framework's own kernel keeps a tie.
    winner = next(name for name in priority if name in best and best[name] <= fastest * (1.0 + CLOSE))
    times = {name: seconds * 1e6 for name, seconds in best.items()}
    return Measurement(winner, times, tuple(unmeasured), transient)


# --------------------------------------------------------------------------------------------------- records


class RecordStore:
    """The records of measured buckets: on disk (module docstring, "Records"; attnkit/records.py) and, once read or
    written, in the process, so a bucket's record is read from disk at most once per process and directory."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], Record] = {}
        #: Buckets whose file was missing when looked for: not looked for again in the process (a decode loop that
        #: is never measured would otherwise stat a file per step) until forget() or this process's own save.
        self._missing: set[tuple[str, str]] = set()
        self._refused: set[str] = set()  # refusals already logged
        self._lock = threading.Lock()
        self._directory: Path | None = None  # use_directory's, over default_directory()
        #: (epoch, default_directory()): the environment is read once per call-cache epoch (configure(),
        #: clear_cache()), never per call.
        self._default: tuple[int, Path] | None = None
        self.files = RecordDirectory("autotune record", self.directory)

    def directory(self) -> Path:
        if self._directory is not None:
            return self._directory
        default = self._default
        if default is None or default[0] != CACHE.epoch:
            default = self._default = (CACHE.epoch, default_directory())
        return default[1]

    @contextlib.contextmanager
    def use_directory(self, directory: Path | str) -> Iterator[None]:
        """Read and write records in ``directory`` within the block (a bench's fresh records, a test's)."""
        previous, self._directory = self._directory, Path(directory)
        try:
            yield
        finally:
            self._directory = previous

    def forget(self) -> None:
        """Drop what the process holds (dispatch.clear_cache): records are read from disk again."""
        with self._lock:
            self._known.clear()
            self._missing.clear()

    def usable_directory(self, create: bool) -> Path:
        """The records directory, created owner-only when ``create`` and missing; AutotuneStoreError when it may not
        be used (someone else owns it or may write it, or it cannot be created)."""
        return self.files.usable(create)

    def _refusal(self, error: AutotuneStoreError) -> None:
        with self._lock:
            first = str(error) not in self._refused
            self._refused.add(str(error))
        if first:
            _log.warning("attnkit: %s; measured backends are kept in this process only", error)

    def load(self, key: str) -> Record | None:
        """The record of bucket ``key``: the process's, else the directory's file (if the directory and the file
        may be read), else None."""
        directory = self.directory()
        slot = (str(directory), key)
        with self._lock:
            known = self._known.get(slot)
            if known is not None or slot in self._missing:
                return known
        path = self.files.path(key)
        if not path.exists():
            with self._lock:
                if len(self._missing) >= MISSING_LIMIT:
                    self._missing.clear()
                self._missing.add(slot)
            return None
        try:
            data = self.files.read(key)
        except AutotuneStoreError as error:
            self._refusal(error)
            return None
        record = Record.from_json(data, str(path)) if data is not None else None
        if record is None or record.key != key:  # unreadable or foreign: measured again and replaced
            return None
        with self._lock:
            self._known.setdefault(slot, record)
            return self._known[slot]

    def save(self, record: Record, limit: int) -> Record:
        """Keep ``record`` in the process and write it (atomically) to the directory; the record as kept, with its
        path, or with the note of why it is in the process only."""
        directory = self.directory()
        try:
            path = self.files.write(record.key, record.to_json(), limit)
            kept = dataclasses.replace(record, path=str(path), note="")
        except AutotuneStoreError as error:
            self._refusal(error)
            kept = dataclasses.replace(record, path="", note=str(error))
        except OSError as error:
            kept = dataclasses.replace(record, path="", note=f"writing {directory} failed: {error}")
        with self._lock:
            self._known[(str(directory), record.key)] = kept
            self._missing.discard((str(directory), record.key))
        return kept

    def keep(self, record: Record, note: str) -> Record:
        """Keep ``record`` in the process only (``note`` says why): no file is written, a later process measures."""
        kept = dataclasses.replace(record, path="", note=note)
        slot = (str(self.directory()), record.key)
        with self._lock:
            self._known[slot] = kept
            self._missing.discard(slot)
        return kept


#: The one store dispatch uses.
STORE = RecordStore()


def format_us(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.3g} s"
    return f"{us / 1e3:.3g} ms" if us >= 1e3 else f"{us:.3g} us"


def now_utc() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
