"""Peak extra host memory of one call, each measurement in a fresh process (Linux: the peak-RSS mark is reset
through ``/proc/self/clear_refs``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_bytes(run: Callable[[], Any]) -> int:
    """VmHWM after ``run()`` minus VmRSS before it: everything the call allocated at its peak, inputs allocated
    beforehand excluded."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    before = status_kib("VmRSS")
    run()
    return (status_kib("VmHWM") - before) * 1024


def print_peak(call: Callable[[], Any]) -> None:
    """In a memory child: print the peak extra bytes of ``call()`` and the seconds it took, as the JSON object
    :func:`run_child` reads."""
    start = time.perf_counter()
    peak = peak_extra_bytes(call)
    print(json.dumps({"peak_extra_bytes": peak, "seconds": time.perf_counter() - start}))


def run_child(code: str, arguments: Sequence[str], what: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``python -c code *arguments`` in a fresh process; the JSON object it printed last."""
    child = subprocess.run([sys.executable, "-c", code, *arguments], capture_output=True, text=True, env=env)
    if child.returncode != 0:
        raise RuntimeError(f"memory run of {what} failed (exit {child.returncode}):\n{child.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return result
