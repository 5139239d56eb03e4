"""Today's SASS model (attnkit.contract.sass) against the one GPU run: the Triton kernels the H100 timed on
2026-11-22 (commit 531af8d, Triton 3.6.0 there), compiled here for sm_90 with that Triton at every tile their
autotuner could pick, and their predicted throughput set beside the measured one (docs/performance-history.md, "First
run on a GPU"). That run's autotune key had no sequence length, so which candidate ran is unknown: the
prediction is a range over the candidates.

It runs in a checkout of 531af8d with triton 3.6.0 installed and reads today's model from a path:

    git worktree add --detach /tmp/old531 531af8d
    python -m venv /tmp/t36 && . /tmp/t36/bin/activate
    pip install torch==2.13.0 triton==3.6.0 numpy pydantic tomli-w && pip install --no-deps -e /tmp/old531
    python scripts/proxy_against_gpu_run.py attnkit/contract/sass.py     # from today's checkout

Backward throughput counts the FlashAttention-2 paper's flops (2.5 × the forward's) over the dQ and dK/dV
kernels' predicted times (the Δ kernel is left out: a memory pass).

The H200 run of 2026-11-27 retired the model's speed projections: its last predictions missed the H200 by 1.4–1.6×
(triton forward) and 1.5–3× (fwd+bwd); docs/performance-history.md, "The static model against the H200".
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: Measured TFLOP/s on the H100 (bfloat16, not causal, B·L = 16384), L = 8192 and 16384, from docs/performance-history.md.
MEASURED = {
    ("fwd", 64): (331, 337),
    ("fwd", 128): (411, 408),
    ("bwd", 64): (188, 198),
    ("bwd", 128): (229, 233),
}


def load_model(path: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("sass_today", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sass_today"] = module
    spec.loader.exec_module(module)
    return module


def candidate_tiles(launch, kernel: str, head_dim: int):  # type: ignore[no-untyped-def]
    """The autotuner's sm_90 bfloat16 candidates for a kernel without features, on either signature of
    ``launch.gpu_configs``: (kernel, block_d, dtype) in 531af8d's checkout, (kernel, block_d, dtype, arch, switches)
    since the Hopper tables; calling the old form on today's code raised TypeError (missing arch and switches)."""
    import torch

    if len(inspect.signature(launch.gpu_configs).parameters) == 3:
        return launch.gpu_configs(kernel, head_dim, torch.bfloat16)
    from attnkit.contract.kernels import KernelSwitches

    return launch.gpu_configs(kernel, head_dim, torch.bfloat16, "sm_90", KernelSwitches())


def predictions(sass):  # type: ignore[no-untyped-def]
    """Predicted TFLOP/s of each kernel's own products, per head dim, one value per autotune candidate."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from attnkit.backends.triton import inspect as old
    from attnkit.backends.triton import kernels, launch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    found: dict[tuple[str, int], list[tuple[str, float]]] = {}
    for kernel in ("fwd", "dq", "dkdv"):
        for head_dim in (64, 128):
            variant = old.Variant(kernel, "sm_90", "bf16", head_dim)
            for tile in candidate_tiles(launch, kernel, head_dim):
                constants, tile = old._constants(variant, tile)
                fn = getattr(kernels, old._KERNEL_FUNCTIONS[kernel])
                signature, attrs, constexprs = old._signature(fn, variant, constants)
                compiled = triton.compile(
                    ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                    target=GPUTarget("cuda", 90, 32),
                    options=dict(num_warps=tile.num_warps, num_stages=tile.num_stages),
                )
                with tempfile.TemporaryDirectory() as folder:
                    cubin = Path(folder) / "kernel.cubin"
                    cubin.write_bytes(compiled.asm["cubin"])
                    listing = subprocess.run(
                        [str(old.tool("cuobjdump")), "-sass", str(cubin)], capture_output=True, text=True, check=True
                    ).stdout
                mix = sass.loop_mix(
                    listing,
                    "sm_90",
                    sass.flops_per_score(kernel, head_dim, head_dim),
                    tile.block_m * tile.block_n,
                    tile.num_warps,
                )
                name = f"{tile.block_m}x{tile.block_n}/{tile.num_warps}w/{tile.num_stages}s"
                print(f"{kernel:5} D={head_dim:<4} {name:14} {mix.instructions_per_score:6.2f} ips  "
                      f"predicted {mix.predicted_tflops:6.1f} TF/s  tensor work {mix.tensor_work}")  # fmt: skip
                found.setdefault((kernel, head_dim), []).append((name, mix.predicted_tflops))
    return found


def main() -> None:
    found = predictions(load_model(sys.argv[1]))
    print("\npass  D     predicted TF/s: default tiles (all candidates)  measured (8k, 16k)  measured / predicted")
    for head_dim in (64, 128):
        forward = [tflops for _, tflops in found[("fwd", head_dim)]]
        # FA2's backward flops (10·D per score) over the two kernels' times (6·D and 8·D flops per score).
        backward = [
            10 / (6 / dq + 8 / dkdv)
            for (_, dq), (_, dkdv) in itertools.product(found[("dq", head_dim)], found[("dkdv", head_dim)])
        ]
        for name, values in (("fwd", forward), ("bwd", backward)):
            measured = MEASURED[(name, head_dim)]
            low, high = min(values), max(values)
            print(f"{name:5} {head_dim:<5} {values[0]:6.1f} ({low:.0f}–{high:.0f}){'':31} {measured[0]}, {measured[1]}"
                  f"{'':10} {min(measured) / high:.2f}–{max(measured) / low:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
