"""What Triton 3.9's Hopper warp specialisation takes: a minimal FlashAttention forward compiled for sm_90, no GPU.

The pass (``nvgpu-warp-specialization``, run by the NVIDIA backend's ``make_ttgir`` for compute capability 8.x and
9.x) acts on a loop marked ``tl.range(..., warp_specialize=True)``. Each probe below changes one thing against the
form it takes (4 warps, 2 stages, q through a descriptor made in the kernel, one loop) and prints whether the loop
was specialised (``ttg.warp_specialize`` in the TTGIR), the program's warps, the SASS's setmaxnreg count and the
main loop's instructions per score (``attnkit.contract.sass``, the consumers' loop when specialised), or the first
line of the compiler's error. Each compiles in a subprocess: some failures abort the compiler.
docs/triton.md draws its conditions from these.

    env -u TRITON_INTERPRET python scripts/triton_warp_specialize_probe.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import triton
import triton.language as tl

BLOCK_M = BLOCK_N = HEAD_DIM = 128

#: name -> (num_warps, num_stages, where q comes from, whether a masked edge loop follows the marked one)
PROBES = {
    "taken: 4 warps, q by an in-kernel descriptor": (4, 2, "kernel", False),
    "8 warps": (8, 2, "kernel", False),
    "1 stage": (4, 1, "kernel", False),
    "q by a pointer load": (4, 2, "pointer", False),
    "q by a host descriptor of BLOCK_M rows": (4, 2, "host", False),
    "an edge loop after the marked one": (4, 2, "kernel", True),
}


@triton.jit
def _tile(acc, row_max, row_sum, q, KTiles, VTiles, key_row, start, positions, scale,
          BLOCK_N: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One key tile of the online softmax; MASKED: causal on the diagonal, as the kernels' edge tiles."""
    scores = tl.dot(q, KTiles.load([key_row, 0]).T) * scale
    if MASKED:
        scores = tl.where(start + tl.arange(0, BLOCK_N)[None, :] <= positions[:, None], scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    p = tl.math.exp2(scores - new_max[:, None])
    alpha = tl.math.exp2(row_max - new_max)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), VTiles.load([key_row, 0]))
    return acc, new_max, row_sum * alpha + tl.sum(p, 1)


@triton.jit
def _forward(Q, QTiles, KTiles, VTiles, Out, scale, length, heads, interior_end,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
             Q_FROM: tl.constexpr, EDGE_LOOP: tl.constexpr):  # fmt: skip
    """One 128-row query tile of one head: the online softmax over its key tiles, K and V by host descriptors."""
    head_start = tl.program_id(1) * length  # (heads · length, HEAD_DIM) tensors
    positions = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row = head_start + tl.program_id(0) * BLOCK_M
    rows = head_start + positions
    if Q_FROM == "pointer":
        q = tl.load(Q + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :])
    elif Q_FROM == "host":
        q = QTiles.load([row, 0])
    else:
        q = tl.make_tensor_descriptor(Q, [heads * length, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM]).load([row, 0])
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in tl.range(0, interior_end, BLOCK_N, warp_specialize=True):
        acc, row_max, row_sum = _tile(acc, row_max, row_sum, q, KTiles, VTiles, head_start + start, start, positions,
                                      scale, BLOCK_N, False)  # fmt: skip
    if EDGE_LOOP:  # the diagonal tiles, masked, in a loop of their own as the kernels' edge loops
        for start in range(interior_end, length, BLOCK_N):
            acc, row_max, row_sum = _tile(acc, row_max, row_sum, q, KTiles, VTiles, head_start + start, start,
                                          positions, scale, BLOCK_N, True)  # fmt: skip
    out = acc / row_sum[:, None]
    tl.store(Out + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], out.to(tl.bfloat16))


def probe(num_warps: int, num_stages: int, q_from: str, edge_loop: bool) -> dict[str, object]:
    """Compile one probe for sm_90 and read it."""
    from attnkit.backends.triton.inspect import read_cubin
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from attnkit.contract.sass import flops_per_score, loop_mix

    tile = f"bf16[{BLOCK_N},{HEAD_DIM}]"
    signature = {"Q": "*bf16", "QTiles": f"tensordesc<bf16[{BLOCK_M},{HEAD_DIM}]>" if q_from == "host" else "constexpr",
                 "KTiles": f"tensordesc<{tile}>", "VTiles": f"tensordesc<{tile}>", "Out": "*bf16", "scale": "fp32",
                 "length": "i32", "heads": "i32", "interior_end": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                 "HEAD_DIM": "constexpr", "Q_FROM": "constexpr", "EDGE_LOOP": "constexpr"}  # fmt: skip
    constants = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, Q_FROM=q_from, EDGE_LOOP=edge_loop)
    if q_from != "host":
        constants["QTiles"] = None
    divisible = [["tt.divisibility", 16]]
    compiled = triton.compile(
        ASTSource(
            fn=_forward,
            signature=signature,
            constexprs=constants,
            attrs={(0,): divisible, (4,): divisible, (6,): divisible},
        ),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    read = read_cubin(compiled.asm["cubin"])
    specialised = "ttg.warp_specialize" in compiled.asm["ttgir"]
    mix = loop_mix(read["sass"], "sm_90", flops_per_score("fwd", HEAD_DIM, HEAD_DIM))  # scores from its products
    return dict(specialised=specialised, warps=compiled.metadata.num_warps, setmaxnreg=read["setmaxnreg"],
                instructions_per_score=mix.instructions_per_score if mix else None,
                spill_bytes=read["spill_store_bytes"] + read["spill_load_bytes"])  # fmt: skip


def _first_error(stderr: str) -> str:
    for pattern in (r"LLVM ERROR: .*", r"error: '[^\n]*", r"Assertion `[^\n]*", r"\w+Error: [^\n]*"):
        found = re.search(pattern, stderr)
        if found:
            return found.group(0)[:200]
    return stderr.strip().splitlines()[-1][:200] if stderr.strip() else "failed"


def main() -> int:
    if len(sys.argv) == 2:  # one probe, in a subprocess of the loop below
        print(json.dumps(probe(*PROBES[sys.argv[1]])))
        return 0
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    for name in PROBES:
        done = subprocess.run([sys.executable, __file__, name], env=env, capture_output=True, text=True)
        result = json.loads(done.stdout) if done.returncode == 0 else {"error": _first_error(done.stderr)}
        print(f"{name}: {result}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
