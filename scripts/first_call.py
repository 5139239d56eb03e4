"""What `auto`'s measuring adds to the first call of each bucket (issue 32), as a user meets it.

Two fresh processes on one fresh records directory run the same buckets in order (B=1, H=8, D=64, float32 and
bfloat16, the given lengths, causal or not, forward or forward+backward; one thread): the first measures each
bucket, the second finds its record and runs the winner. Per bucket, the first call's time in the first process less
that in the second is what measuring added over the chosen backend's own first call; it is printed in ms and in
calls of the slowest contender (each contender's warm call, forced, in the first process). Both processes pay
attend's own one-time costs (imports, registry, availability: seconds, with or without measuring) before the first
bucket, running no backend.

    python scripts/first_call.py --seq-lens 512,2048
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="512,2048")
    parser.add_argument("--child", choices=("measuring", "recorded"))
    args = parser.parse_args()
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
