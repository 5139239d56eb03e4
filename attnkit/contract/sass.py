"""The static proxy of GPU speed shared by the kernel backends' checks: a kernel's SASS read for its innermost loops,
their instruction mix per attention score, and an issue-rate model that turns the mix into a predicted throughput.

A loop is a backward branch (``BRA`` to a label at or before it); an innermost loop contains no other, and an
attention kernel's runs one tile per iteration: BLOCK_M × BLOCK_N scores, a warp's share of them BLOCK_M × BLOCK_N /
warps. Then

    instructions per score = warp instructions per iteration × 32 / scores per warp

(threads' instructions: an SM issues 4 warp instructions, 128 threads' worth, per cycle), and the tensor-core
work per score is counted from the HMMA/HGMMA shapes; ``tensor_work`` is that over the products' own flops, 1.0
unless a layout makes warpgroups repeat a product. An attention loop shares
three resources of an SM, in cycles per score: the tensor cores (flops per score ÷ their flops per cycle), issue
(instructions per score ÷ 128) and the MUFU unit (exp2 per score ÷ 16). Two models turn them into TFLOP/s (flops
per score ÷ cycles × SMs × clock), both assuming memory keeps up:

* ``predicted``: the softmax waits for the products and the products for the softmax, as in a loop of one
  warpgroup without ping-pong scheduling: cycles = tensor + max(issue, MUFU);
* ``ceiling``: the three overlap perfectly (warp specialisation, ping-pong): cycles = max(tensor, issue, MUFU).

They are a proxy for the loop's code, not a measurement (docs/performance.md compares them with one).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field


#: The machines the model prices: SMs, clock (Hz) at the published dense tensor throughput, tensor flops per cycle
#: per SM by instruction (float16/bfloat16 inputs, float32 accumulation). H100 SXM: 989 TFLOP/s dense by wgmma;
#: mma.sync reaches about two thirds of it there. A100 SXM: 312 TFLOP/s by mma.sync.
@dataclass(frozen=True)
class Machine:
    name: str
    sms: int
    clock_hz: float
    tensor: dict[str, int]  # flops per cycle per SM by instruction

    def tensor_rate(self, instruction: str) -> int:
        return self.tensor.get(instruction, self.tensor["HMMA"])


MACHINES = {
    "sm_90": Machine("H100 SXM", 132, 1.83e9, {"HGMMA": 4096, "HMMA": 2731}),
    "sm_80": Machine("A100 SXM", 108, 1.41e9, {"HMMA": 2048}),
}
ISSUE_PER_CYCLE = 128  # thread instructions per SM per cycle: 4 schedulers × one warp instruction
MUFU_PER_CYCLE = 16  # exp2 results per SM per cycle (CUDA programming guide, compute capability 8.x and 9.0)

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)([^;]*);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):", re.MULTILINE)
_TARGET = re.compile(r"`\((\.L_x_\d+)\)|\b0x([0-9a-f]+)\b")  # a label (nvdisasm) or an address (cuobjdump)
_HMMA_SHAPE = re.compile(r"\.(16)(8)(8|16|32)\b")  # HMMA.16816: m16 n8 k16 (and k8, k32)
_HGMMA_SHAPE = re.compile(r"\.(\d+)x(\d+)x(\d+)")  # HGMMA.64x128x16: per warpgroup

#: Instruction classes of the mix.
SELECTS = ("SEL", "FSEL")
COMPARES = ("FSETP", "ISETP", "HSETP2", "DSETP")
LOADS = ("LDG", "LDS", "LDSM", "LDGSTS", "UTMALDG", "UBLKCP", "LD", "LDC")
BARRIERS = ("BAR", "BSYNC", "SYNCS", "WARPSYNC", "DEPBAR")


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str
    suffixes: str  # ".64x128x16.F32.BF16"
    operands: str
    predicated: bool


@dataclass(frozen=True)
class Loop:
    """One innermost loop: its instructions from the branch target to the backward branch, both included."""

    instructions: tuple[Instruction, ...]

    @property
    def opcodes(self) -> Counter[str]:
        return Counter(i.opcode for i in self.instructions)

    def count(self, opcodes: tuple[str, ...]) -> int:
        found = self.opcodes
        return sum(found[name] for name in opcodes)

    @property
    def ex2(self) -> int:
        return sum(1 for i in self.instructions if i.opcode == "MUFU" and i.suffixes.startswith(".EX2"))

    @property
    def tensor_flops_per_warp(self) -> dict[str, int]:
        """Tensor-core flops one warp does per iteration, by instruction (a warpgroup's HGMMA is a quarter each)."""
        flops: Counter[str] = Counter()
        for i in self.instructions:
            if i.opcode == "HMMA" and (shape := _HMMA_SHAPE.match(i.suffixes)):
                m, n, k = map(int, shape.groups())
                flops["HMMA"] += 2 * m * n * k
            elif i.opcode == "HGMMA" and (shape := _HGMMA_SHAPE.match(i.suffixes)):
                m, n, k = map(int, shape.groups())
                flops["HGMMA"] += 2 * m * n * k // 4
        return dict(flops)

    @property
    def tensor_shapes(self) -> tuple[str, ...]:
        return tuple(sorted({i.opcode + i.suffixes.split(".F")[0] for i in self.instructions
                             if i.opcode in ("HMMA", "HGMMA")}))  # fmt: skip


def instructions(sass: str) -> tuple[list[Instruction], dict[str, int]]:
    """The instructions of a one-kernel SASS listing, and each label's address."""
    found = [
        Instruction(int(address, 16), opcode, suffixes, operands, bool(predicate))
        for address, predicate, opcode, suffixes, operands in _LINE.findall(sass)
    ]
    labels = {}
    for match in _LABEL.finditer(sass):
        following = _LINE.search(sass, match.end())
        if following is not None:
            labels[match.group(1)] = int(following.group(1), 16)
    return found, labels


def _loop_spans(listing: list[Instruction], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) instruction index of every loop: a branch back to an earlier instruction."""
    index_at = {instruction.address: index for index, instruction in enumerate(listing)}
    spans = []
    for index, instruction in enumerate(listing):
        target = _TARGET.search(instruction.operands) if instruction.opcode == "BRA" else None
        if target is None:
            continue
        address = labels.get(target.group(1), -1) if target.group(1) else int(target.group(2), 16)
        if address in index_at and index_at[address] < index:  # backward: a loop (a branch to itself is a trap)
            spans.append((index_at[address], index))
    return spans


def _innermost(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]


def innermost_loops(sass: str) -> list[Loop]:
    listing, labels = instructions(sass)
    return [Loop(tuple(listing[a : b + 1])) for a, b in _innermost(_loop_spans(listing, labels))]


def tensor_loops(sass: str) -> list[Loop]:
    """The innermost loops among those with tensor-core instructions: a tile loop may hold loops of its own without
    them (an atomic's retry loop), which it counts as its instructions."""
    listing, labels = instructions(sass)
    spans = [(a, b) for a, b in _loop_spans(listing, labels)
             if any(i.opcode in ("HMMA", "HGMMA") for i in listing[a : b + 1])]  # fmt: skip
    return [Loop(tuple(listing[a : b + 1])) for a, b in _innermost(spans)]


@dataclass(frozen=True)
class LoopMix:
    """A tensor-core loop's mix, per attention score (threads' instructions), and the model's prediction."""

    instructions_per_score: float
    ex2_per_score: float
    selects_per_score: float  # SEL/FSEL
    compares_per_score: float  # FSETP/ISETP/...
    loads_per_iteration: int
    tma_loads_per_iteration: int  # UTMALDG: tensor-descriptor copies (no per-thread addresses)
    barriers_per_iteration: int
    tensor_shapes: tuple[str, ...]
    scores_per_warp: float  # scores one warp's share of an iteration covers
    tensor_work: float  # tensor-core flops per score over the products' own: > 1 when a product is computed twice
    predicted_tflops: float  # products and softmax in series
    ceiling_tflops: float  # products and softmax overlapped
    bound: str  # what limits the ceiling: tensor, issue or mufu
    all_loops: tuple[dict[str, float], ...] = field(default=())  # instructions and ips of every tensor-core loop


def flops_per_score(kernel: str, head_dim: int, head_dim_v: int, atomic_dq: bool = False) -> int:
    """Tensor-core flops per attention score of each kernel: fwd S = QKᵀ and PV; dq S, dP = dO Vᵀ and dS K; dkdv S,
    dP, Pᵀ dO and dSᵀ Q, and with ``atomic_dq`` (the one-pass backward) dS K too."""
    return {"fwd": 2 * (head_dim + head_dim_v), "dq": 4 * head_dim + 2 * head_dim_v,
            "dkdv": 4 * (head_dim + head_dim_v) + 2 * head_dim * atomic_dq}[kernel]  # fmt: skip


def loop_mix(
    sass: str, arch: str, flops_per_score: int, tile_scores: int | None = None, warps: int | None = None
) -> LoopMix | None:
    """The mix of the kernel's main loop: among the innermost loops with tensor-core instructions, the one with the
    fewest instructions per score (the interior loop, where a kernel spends its time on long sequences). None when
    no loop uses the tensor cores (float32 kernels). With ``tile_scores`` and ``warps``, each iteration covers one
    tile of that many scores on that many warps; without, a loop's scores are counted from its tensor-core work
    (for loops that run part of a tile: ``tensor_work`` is then 1 by construction)."""
    machine = MACHINES[arch]
    mixes = []
    for loop in tensor_loops(sass):
        flops = loop.tensor_flops_per_warp
        if not flops:
            continue
        scores = tile_scores / warps if tile_scores and warps else sum(flops.values()) / flops_per_score
        per_score = 32 / scores
        cycles = {
            "tensor": sum(f / machine.tensor_rate(name) for name, f in flops.items()) / scores,
            "issue": len(loop.instructions) * per_score / ISSUE_PER_CYCLE,
            "mufu": loop.ex2 * per_score / MUFU_PER_CYCLE,
        }
        bound = max(cycles, key=lambda name: cycles[name])
        per_cycle = flops_per_score * machine.sms * machine.clock_hz / 1e12  # TFLOP/s at one score a cycle
        serial = cycles["tensor"] + max(cycles["issue"], cycles["mufu"])
        mixes.append(
            LoopMix(
                instructions_per_score=round(len(loop.instructions) * per_score, 2),
                ex2_per_score=round(loop.ex2 * per_score, 3),
                selects_per_score=round(loop.count(SELECTS) * per_score, 3),
                compares_per_score=round(loop.count(COMPARES) * per_score, 3),
                loads_per_iteration=loop.count(LOADS),
                tma_loads_per_iteration=loop.count(("UTMALDG",)),
                barriers_per_iteration=loop.count(BARRIERS),
                tensor_shapes=loop.tensor_shapes,
                scores_per_warp=scores,
                tensor_work=round(sum(flops.values()) / scores / flops_per_score, 3),
                predicted_tflops=round(per_cycle / serial, 1),
                ceiling_tflops=round(per_cycle / cycles[bound], 1),
                bound=bound,
            )
        )
    if not mixes:
        return None
    main = min(mixes, key=lambda mix: mix.instructions_per_score)
    summary = tuple({"instructions_per_score": m.instructions_per_score, "tensor_work": m.tensor_work}
                    for m in mixes)  # fmt: skip
    return LoopMix(**{**main.__dict__, "all_loops": summary})
