"""What cpu-flash's mask-program interpreter costs: one program's forward (B=1, H=4, D=64, float32, one thread) with
its tile classes as computed, against the same call with PARTIAL tiles relabelled FULL (the program never evaluated:
wrong results, the time of a mask that cost nothing, below any generated code), every tile PARTIAL (evaluated
everywhere, nothing skipped), every tile FULL (neither), and cpu-flash's native clause for the same mask.

    python scripts/mask_program_cost.py [L] [document-causal|prefix-lm|chunked-causal|local+global]
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import attnkit.backends.cpu_flash.backend as cpu_flash
import torch

import attnkit
from attnkit.backend import AttentionInputs
from attnkit.bench.programs import _bound, program
from attnkit.bench.timing import interleaved, paired_ratio
from attnkit.registry import get_backend

RELABELLINGS = ("as computed", "partial->full", "all partial", "all full")


def relabelled(classes: torch.Tensor, how: str) -> torch.Tensor:
    if how == "partial->full":
        return torch.where(classes == 1, 2, classes).to(torch.uint8)
    if how == "all partial":
        return torch.ones_like(classes)
    if how == "all full":
        return torch.full_like(classes, 2)
    return classes


def main() -> None:
    torch.set_num_threads(1)
    seq_len = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    kind = sys.argv[2] if len(sys.argv) > 2 else "document-causal"
    q, k, v = (torch.randn(1, 4, seq_len, 64) for _ in range(3))
    mask_mod, native, fields = program(kind, seq_len)
    bound = _bound(mask_mod, q, seq_len)
    backend: Any = get_backend("cpu-flash")
    arguments = cpu_flash._Program.arguments
    current = {"how": "as computed"}

    def patched(self: Any, tile: tuple[int, int]) -> tuple[Any, ...]:
        code, operands, captured, classes = arguments(self, tile)
        return code, operands, captured, relabelled(classes, current["how"]).contiguous()

    cpu_flash._Program.arguments = patched  # type: ignore[method-assign]
    spec = attnkit.AttentionSpec()

    def call(how: str) -> Any:
        def run() -> None:
            current["how"] = how
            backend.forward(spec, AttentionInputs(q, k, v, mask_program=bound), True)

        return run

    functions = {how: call(how) for how in RELABELLINGS}
    if native is not None:
        functions["native"] = lambda: backend.forward(native, AttentionInputs(q, k, v, **fields), True)
    with torch.no_grad():
        samples = interleaved(functions, 3, 1)
    print(f"{kind}, L={seq_len}, B=1, H=4, D=64, float32, forward, one thread; paired ratios over 3 repeats")
    for name, times in samples.items():
        ratio = paired_ratio(samples, name, "as computed")
        print(f"{name:14s} {statistics.median(times) / 1e6:9.2f} ms   / as computed {ratio:.3f}")


if __name__ == "__main__":
    main()
