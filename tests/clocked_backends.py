"""Two backends whose time is what a fake clock says: each call advances :data:`CLOCK` by its backend's cost, so a
test of ``auto``'s measuring (tests/test_autotune.py) knows which one is faster without timing anything. Both compute
the attention of tests/third_party_backend.py; a subprocess imports this module to register the same two."""

from __future__ import annotations

from typing import Any

from tests.third_party_backend import TinyBackend

SLOW = "clocked-slow"
FAST = "clocked-fast"
#: Fake seconds per forward call; a backward costs twice its forward.
COSTS = {SLOW: 3.0, FAST: 1.0}
#: Fake seconds a backend's first forward after CLOCK.reset() costs on top (its code and memory loading); none here.
FIRST_CALL_EXTRA = dict.fromkeys(COSTS, 0.0)
#: What a backend's cold_start says (a first call that builds or compiles); none here.
COLD_START: dict[str, str] = {}


class FakeClock:
    """Seconds that pass only when a clocked backend runs; counts each backend's forward and backward calls."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: dict[str, int] = {}
        self.backward_calls: dict[str, int] = {}
        self.reset()

    def reset(self) -> None:
        self.now = 0.0
        self.calls = dict.fromkeys(COSTS, 0)
        self.backward_calls = dict.fromkeys(COSTS, 0)

    def __call__(self) -> float:
        return self.now


CLOCK = FakeClock()


class ClockedBackend(TinyBackend):
    def __init__(self, name: str) -> None:
        self.name = name

    def cold_start(self, spec: Any, problem: Any) -> str | None:
        return COLD_START.get(self.name)

    def forward(self, spec: Any, inputs: Any, need_lse: bool) -> Any:
        CLOCK.now += COSTS[self.name] + (FIRST_CALL_EXTRA[self.name] if CLOCK.calls[self.name] == 0 else 0.0)
        CLOCK.calls[self.name] += 1
        return super().forward(spec, inputs, need_lse)

    def backward(self, spec: Any, inputs: Any, out: Any, lse: Any, dout: Any, dlse: Any, *, need_dbias: bool) -> Any:
        CLOCK.now += 2 * COSTS[self.name]
        CLOCK.backward_calls[self.name] += 1
        return super().backward(spec, inputs, out, lse, dout, dlse, need_dbias=need_dbias)


#: The config that measures the two: the slow one first in priority, no cost table (no prediction for either).
CONFIG = {"priority": {"cpu": [SLOW, FAST]}, "refine": [], "use_costs": False, "autotune": True}


def register() -> None:
    from attnkit import registry

    for name in COSTS:
        registry.register_backend(ClockedBackend(name), replace=True)


def unregister() -> None:
    from attnkit import registry

    for name in COSTS:
        registry.unregister_backend(name)
