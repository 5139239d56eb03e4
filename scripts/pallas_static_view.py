"""Static GPU view of the Pallas kernels, without a GPU (local use; not run in CI).

Pallas lowers each kernel to Triton IR (TTIR) on the way to its ``__gpu$xla.gpu.triton`` custom call; this script
lowers the forward and backward for CUDA with ``JAX_PLATFORMS=cpu`` (needs ``jax-cuda13-plugin``, as the lowering
test), keeps each kernel's TTIR, compiles it with the ``triton`` wheel for sm_90 at the kernel's ``num_warps`` and
``num_stages``, and reads the cubin as backends/triton/inspect.py does: wgmma (HGMMA) or mma.sync (HMMA), spills, and
the main loop's instructions per score (``attnkit.contract.sass.loop_mix``). XLA compiles the same TTIR with the
Triton it bundles, so the SASS is a close view, not the very one a GPU would run.

The band is a run-time operand (geom), so causal and full attention lower to the same kernels: one row per kernel.

    JAX_PLATFORMS=cpu python scripts/pallas_static_view.py                 # D = 64 and 128, the backend's GPU tiles
    JAX_PLATFORMS=cpu python scripts/pallas_static_view.py --dims 256
    JAX_PLATFORMS=cpu python scripts/pallas_static_view.py --arch 80                        # A100 (sm_80) instead
    JAX_PLATFORMS=cpu python scripts/pallas_static_view.py --tiles 128,64,128,64,8,8,2   # fwd/dQ, dK/dV tiles,
                                                        # warps, then the dK/dV kernel's warps and stages (else 1)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns unless told; XLA's Triton fuses too


def _capture() -> list[tuple[str, str]]:
    """Make Pallas' Triton lowering keep (kernel name, TTIR) of every kernel it lowers from now on."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    captured: list[tuple[str, str]] = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def keep(jaxpr: Any, *args: Any, **kwargs: Any) -> Any:
        result = lower(jaxpr, *args, **kwargs)
        captured.append((jaxpr.debug_info.func_name, result.module.operation.get_asm(enable_debug_info=False)))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = keep
    return captured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="64,128", help="head dims, comma-separated")
    parser.add_argument(
        "--tiles", help="fwd_q,fwd_k,dkdv_q,dkdv_k,warps[,dkdv_warps[,dkdv_stages]] instead of the backend's GPU choice"
    )
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--arch", type=int, default=90, choices=(80, 90), help="compile for sm_80 or sm_90")
    args = parser.parse_args()

    captured = _capture()
    import triton
    from attnkit.backends.pallas import backend, lowering
    from attnkit.backends.triton.inspect import read_cubin
    from triton.backends.compiler import GPUTarget

    from attnkit.backend import AttentionSpec
    from attnkit.contract.sass import flops_per_score, loop_mix, tensor_loops

    if args.tiles:
        fwd_q, fwd_k, bwd_q, bwd_k, warps, *dkdv = (int(x) for x in args.tiles.split(","))
        tiles = backend._Tiles((fwd_q, fwd_k), (bwd_q, bwd_k), warps, *(dkdv or [warps]))
        backend._blocks = lambda *_: tiles  # type: ignore[assignment]
    spec, length = AttentionSpec(causal=True), args.length
    with tempfile.TemporaryDirectory() as folder:
        for dim in (int(d) for d in args.dims.split(",")):
            captured.clear()
            lowering.lower(spec, batch=1, heads_q=4, heads_kv=4, len_q=length, len_k=length, dim=dim, dim_v=dim)
            config = backend._config(spec, length, length, dim, interpret=False)
            for name, ttir in captured:
                kernel = name.rsplit("_", 1)[-1]  # fwd, dkdv, dq
                static = config.kernel_dkdv if kernel == "dkdv" else config.kernel
                path = Path(folder) / f"{name}_{dim}.ttir"
                path.write_text(ttir)
                options = {"num_warps": static.num_warps, "num_stages": static.num_stages}
                compiled = triton.compile(str(path), target=GPUTarget("cuda", args.arch, 32), options=options)
                read = read_cubin(compiled.asm["cubin"])
                tile_scores = static.block_q * static.block_k
                mix = loop_mix(
                    read["sass"], f"sm_{args.arch}", flops_per_score(kernel, dim, dim), tile_scores, static.num_warps
                )
                row = {"D": dim, "kernel": kernel, "tile": [static.block_q, static.block_k, static.num_warps]}
                row |= {
                    "registers": read["registers"],
                    "hgmma": read["hgmma"],
                    "hmma": read["hmma"],
                    "spill_bytes": read["spill_store_bytes"],
                }
                row |= {"shared_bytes": compiled.metadata.shared + read["static_shared"]}
                if mix is not None:
                    row |= {"instructions_per_score": round(mix.instructions_per_score, 2)}
                    row |= {"selects_per_score": round(mix.selects_per_score, 3), "shapes": list(mix.tensor_shapes)}
                    row |= {"tensor_work": mix.tensor_work, "predicted_tflops": mix.predicted_tflops}
                    spilling = sum(loop.count(("STL", "LDL")) > 0 for loop in tensor_loops(read["sass"]))
                    row |= {"loops_spilling": spilling}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
