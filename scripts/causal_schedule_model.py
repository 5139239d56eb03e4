"""How long a causal forward's grid takes on a GPU whose blocks start in launch order: a list-scheduling model.

Every query tile of 128 rows is one program; tile t of a causal square call sees t + 1 key tiles, its cost. A GPU
starts programs in launch order (the first grid axis fastest) on whichever slot frees first, so the makespan
depends on the order of the tiles. Three orders, at the FlashAttention-2 paper's shapes (B · L = 16384, D = 128,
H = 16) on an H100's 132 SMs, one program per SM (the sm_90 forward tile takes 225 KB of shared memory):

* launch order: tile 0 (the shortest) of each (batch, head) first;
* longest first within each (batch, head): triton's ``_longest_first``, the last wave holds short tiles;
* longest first over the whole grid: every head's longest tile before any shorter one (a persistent or
  head-minor grid; it changes which heads' K/V share the L2 cache at a time, which only a GPU can weigh).

Printed: each order's makespan over the bound (total work / slots). A model, not a measurement.

    python scripts/causal_schedule_model.py
"""

from __future__ import annotations

import heapq

SLOTS = 132
ROWS = 128
TOKENS = 16384
HEADS = 16


def makespan(costs: list[int], slots: int) -> int:
    """The finish time of programs started in list order, each on the slot that frees first."""
    free = [0] * slots
    finish = 0
    for cost in costs:
        start = heapq.heappop(free)
        finish = max(finish, start + cost)
        heapq.heappush(free, start + cost)
    return finish


def main() -> None:
    print(f"{'L':>6} {'B*H':>5} {'launch order':>13} {'longest first per head':>23} {'longest first overall':>22}")
    for length in (512, 1024, 2048, 4096, 8192, 16384):
        tiles, heads = length // ROWS, TOKENS // length * HEADS
        per_head = [t + 1 for t in range(tiles)]
        orders = (
            per_head * heads,
            per_head[::-1] * heads,
            sorted(per_head * heads, reverse=True),
        )
        bound = sum(per_head) * heads / SLOTS
        ratios = [makespan(order, SLOTS) / bound for order in orders]
        print(f"{length:>6} {heads:>5} {ratios[0]:>13.3f} {ratios[1]:>23.3f} {ratios[2]:>22.3f}")


if __name__ == "__main__":
    main()
