"""What `auto`'s measuring adds to the first call of each bucket, as a user meets it.

Two fresh processes on one fresh records directory run the same buckets in order (B=1, H=8, D=64, float32 and
bfloat16, the given lengths, causal or not, forward or forward+backward; one thread): the first measures each
bucket, the second finds its record and runs the winner. Per bucket, the first call's time in the first process less
that in the second is what measuring added over the chosen backend's own first call; it is printed in ms and in
calls of the slowest contender (each contender's warm call, forced, in the first process). Both processes pay
attend's own one-time costs (imports, registry, availability: seconds, with or without measuring) before the first
bucket, running no backend.

    python scripts/first_call.py --seq-lens 512,2048

With ``--what fresh``: a fresh process's first causal call (B=1, H=8, L=512, D=64, float32, one thread) with warm
caches (cpu-flash built, auto's record present: one untimed process first makes them), in ``--runs`` processes;
printed with the import of torch and of attnkit, and whether the call imported jax or triton. ``--against PATH``
(another checkout of attnkit) interleaves the same runs of that version, and prints the paired ratios.

With ``--what build``: cpu-flash's cold build in an empty private TORCH_EXTENSIONS_DIR (the shared cache is left
alone), as the first call pays it, then its compiler's phases: preprocessing alone, parsing alone (-fsyntax-only),
the full compile, the link.

    python scripts/first_call.py --what fresh --runs 7 [--against ../attnkit-before]
    python scripts/first_call.py --what build
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTENDERS = ("torch-sdpa", "cpu-flash", "torch-chunked")


def timed_call(spec: object, q: object, k: object, v: object, grad: bool, backend: str = "auto") -> float:
    """One call's milliseconds: forward, or forward+backward."""
    import torch

    import attnkit

    start = time.perf_counter()
    out = attnkit.attend(spec, q, k, v, backend=backend)  # type: ignore[arg-type]
    if grad:
        torch.autograd.grad(out, (q, k, v), grad_outputs=torch.ones_like(out))  # type: ignore[arg-type]
    return (time.perf_counter() - start) * 1e3


def child(seq_lens: list[int], measuring: bool) -> None:
    import torch

    torch.set_num_threads(1)
    import attnkit
    from attnkit import autotune, dispatch
    from attnkit.bench.calls import call_problem
    from attnkit.frontends import ops_for

    trials: list[tuple[str, float]] = []
    original = autotune.Trial.seconds

    def traced(self: autotune.Trial, backend: object) -> float:
        seconds = original(self, backend)  # type: ignore[arg-type]
        trials.append((backend.name, round(seconds * 1e3, 1)))  # type: ignore[attr-defined]
        return seconds

    autotune.Trial.seconds = traced  # type: ignore[method-assign]
    x = torch.zeros(1, 1, 1, 8)
    ops_for(x)
    dispatch.select(attnkit.AttentionSpec(), call_problem(attnkit.AttentionSpec(), x, x, x))
    for dtype in ("float32", "bfloat16"):
        for seq_len in seq_lens:
            for causal in (False, True):
                for grad in (False, True):
                    torch.manual_seed(0)
                    shape = (1, 8, seq_len, 64)
                    q, k, v = (torch.randn(shape, dtype=getattr(torch, dtype), requires_grad=grad) for _ in range(3))
                    spec = attnkit.AttentionSpec(causal=causal, causal_alignment="top_left")
                    call = (spec, q, k, v, grad)
                    trials.clear()
                    first_ms = timed_call(*call)
                    steady = {}
                    if measuring:
                        for name in CONTENDERS:
                            timed_call(*call, name)
                            steady[name] = statistics.median(timed_call(*call, name) for _ in range(2))
                    winner = dispatch.auto_choice(spec, call_problem(spec, q, k, v)).backend  # type: ignore[union-attr]
                    row = {"bucket": [dtype, seq_len, causal, grad], "first_ms": first_ms, "winner": winner}
                    print(json.dumps(row | {"trials": list(trials), "steady_ms": steady}), flush=True)


FRESH_CALL = """
import json, sys, time
start = time.perf_counter()
import torch
torch.set_num_threads(1)
imported_torch = time.perf_counter()
import attnkit
imported_attnkit = time.perf_counter()
q, k, v = (torch.randn(1, 8, 512, 64) for _ in range(3))
spec = attnkit.AttentionSpec(causal=True)
called = time.perf_counter()
attnkit.attend(spec, q, k, v)
done = time.perf_counter()
print(json.dumps({"torch_s": imported_torch - start, "attnkit_s": imported_attnkit - imported_torch,
                  "first_call_s": done - called, "jax": "jax" in sys.modules, "triton": "triton" in sys.modules}))
"""


WARM_UP = "from attnkit.backends.cpu_flash.backend import EXTENSION\nEXTENSION.load()\n" + FRESH_CALL


def fresh_call(checkout: str | None, script: str = FRESH_CALL) -> dict[str, float]:
    """One fresh process's figures; ``checkout``: run that attnkit (its attnkit/ and backends/) instead."""
    env = dict(os.environ)
    if checkout:
        env["PYTHONPATH"] = checkout
    run = [sys.executable, "-c", script]  # from a neutral directory: "-c" puts the current one first on the path
    output = subprocess.run(run, env=env, check=True, capture_output=True, text=True, cwd=tempfile.gettempdir())
    return json.loads(output.stdout.splitlines()[-1])


def fresh(runs: int, against: str | None) -> None:
    versions = {"this": None} | ({"against": against} if against else {})
    for checkout in versions.values():
        fresh_call(checkout, WARM_UP)  # warm caches: cpu-flash built (auto measures it only then), auto's record
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in versions}
    for _ in range(runs):
        for name, checkout in versions.items():  # interleaved: a busy moment hits both
            rows[name].append(fresh_call(checkout))
    for name, found in rows.items():
        first = [row["first_call_s"] for row in found]
        print(
            f"{name}: first call median {statistics.median(first):.3f} s (runs: {' '.join(f'{s:.2f}' for s in first)})"
            f"; import torch {statistics.median(row['torch_s'] for row in found):.2f} s, import attnkit "
            f"{statistics.median(row['attnkit_s'] for row in found):.2f} s; imported jax: {found[-1]['jax']}, "
            f"triton: {found[-1]['triton']}"
        )
    if against:
        ratios = [mine["first_call_s"] / theirs["first_call_s"] for mine, theirs in zip(*rows.values(), strict=True)]
        print(
            f"paired ratio this/against: median {statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"
        )


BUILD_CHILD = """
import time
from attnkit.backends.cpu_flash.backend import EXTENSION
start = time.perf_counter()
EXTENSION.load()
print(time.perf_counter() - start)
"""


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def cold_build() -> None:
    """cpu-flash's first-use build in an empty cache, then the phases of its compile command (from the build log)."""
    with tempfile.TemporaryDirectory() as root:
        env = os.environ | {"TORCH_EXTENSIONS_DIR": root}
        output = subprocess.run(
            [sys.executable, "-c", BUILD_CHILD], env=env, check=True, capture_output=True, text=True
        )
        print(f"cold build of cpu-flash, as a first call pays it: {float(output.stdout.split()[-1]):.1f} s")
        [log] = Path(root).glob("*/*.so.log")
        lines = log.read_text().splitlines()
        compiles = [line.split("] ", 1)[1] for line in lines if line.startswith("[") and " -c " in line]
        link = next(line.split("] ", 1)[1] for line in lines if line.startswith("[") and " -shared" in line)
        scratch = Path(root) / "phases"
        scratch.mkdir()
        total = 0.0
        for command in compiles:
            words = command.split()
            source = words[words.index("-c") + 1]
            base = [
                word for word in words[: words.index("-c")] if word not in ("-MMD", "-MF") and not word.endswith(".o.d")
            ]
            out = str(scratch / Path(source).with_suffix(".o").name)
            phases = {
                "preprocess": timed([*base, "-E", source, "-o", os.devnull]),
                "parse (-fsyntax-only)": timed([*base, "-fsyntax-only", source]),
                "compile": timed([*base, "-c", source, "-o", out]),
            }
            total += phases["compile"]
            print(f"{Path(source).name}: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()))
        link_words = link.split()
        objects = [str(scratch / Path(word).name) if word.endswith(".o") else word for word in link_words]
        objects[objects.index("-o") + 1] = str(scratch / "linked.so")
        print(f"link {timed(objects):.1f} s; compiles in sequence {total:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=("measuring", "fresh", "build"), default="measuring")
    parser.add_argument("--seq-lens", default="512,2048")
    parser.add_argument("--runs", type=int, default=5, help="fresh: processes per version")
    parser.add_argument("--against", metavar="PATH", help="fresh: another attnkit checkout to interleave with")
    parser.add_argument("--child", choices=("measuring", "recorded"))
    args = parser.parse_args()
    if args.what == "fresh":
        fresh(args.runs, args.against)
        return
    if args.what == "build":
        cold_build()
        return
    seq_lens = [int(n) for n in args.seq_lens.split(",")]
    if args.child:
        child(seq_lens, args.child == "measuring")
        return
    with tempfile.TemporaryDirectory() as records:
        env = os.environ | {"ATTNKIT_AUTOTUNE_DIR": records, "ATTNKIT_AUTOTUNE": "1"}
        runs = {}
        for mode in ("measuring", "recorded"):
            command = [sys.executable, __file__, "--seq-lens", args.seq_lens, "--child", mode]
            output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            runs[mode] = [json.loads(line) for line in output.splitlines()]
    print(
        "| dtype | L | causal | pass | winner | timed calls (ms) | first call, measuring | with the record | added "
        "| added, in slowest-contender calls |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for measured, recorded in zip(runs["measuring"], runs["recorded"], strict=True):
        dtype, seq_len, causal, grad = measured["bucket"]
        added = measured["first_ms"] - recorded["first_ms"]
        slowest = max(measured["steady_ms"].values())
        timed = " ".join(f"{name.removeprefix('torch-')} {ms:.0f}" for name, ms in measured["trials"])
        print(
            f"| {dtype} | {seq_len} | {'yes' if causal else 'no'} | {'fwd+bwd' if grad else 'fwd'} | "
            f"{measured['winner']} | {timed} | {measured['first_ms']:.0f} ms | {recorded['first_ms']:.0f} ms | "
            f"{added:.0f} ms | {added / slowest:.1f} |"
        )


if __name__ == "__main__":
    main()
