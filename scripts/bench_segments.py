"""A packed row against the same documents as a batch and against SDPA with the equivalent dense mask (issue 17).

    OMP_NUM_THREADS=1 python scripts/bench_segments.py --backends torch-flex torch-sdpa --repeats 5

A row of ``--documents`` causal documents of ``--length / --documents`` tokens each (B=1, H=8, D=64, float32),
given as segment ids to each backend, and the same documents as a batch of that many rows; forward (inference: no
lse, no grad) or, with ``--grad``, ``attend`` then ``backward`` of ``out.sum()``. Each timing is the median of
``--repeats`` calls, the calls interleaved round by round, after one warm-up call each (which compiles torch-flex).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit
from attnkit import AttentionSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["auto"])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--grad", action="store_true")
    args = parser.parse_args()
    length, documents = args.length, args.documents
    document = length // documents
    spec = AttentionSpec(causal=True)
    ids = (torch.arange(length) // document).view(1, -1)
    q, k, v = (torch.randn(1, 8, length, 64, requires_grad=args.grad) for _ in range(3))
    # The same documents as a batch: element d holds document d.
    batched = [x.detach().view(8, documents, document, 64).transpose(0, 1).requires_grad_(args.grad) for x in (q, k, v)]
    dense = (ids.view(1, 1, -1, 1) == ids.view(1, 1, 1, -1)) & torch.ones(length, length, dtype=torch.bool).tril()

    def timed_call(run: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def call() -> None:
            out = run()
            if args.grad:
                out.sum().backward()

        return call

    def packed(backend: str) -> torch.Tensor:
        return attnkit.attend(spec, q, k, v, q_segment_ids=ids, kv_segment_ids=ids, backend=backend)

    def as_batch(backend: str) -> torch.Tensor:
        return attnkit.attend(spec, *batched, backend=backend)

    calls: dict[str, Callable[[], None]] = {}
    for backend in args.backends:
        calls[f"{backend}: packed row (segment ids)"] = timed_call(functools.partial(packed, backend))
        calls[f"{backend}: documents as a batch"] = timed_call(functools.partial(as_batch, backend))
    reference = "SDPA, dense (B, 1, L, L) mask"
    calls[reference] = timed_call(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()  # warm-up
    for _ in range(args.repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    reference_time = statistics.median(times[reference])
    print(f"B=1 H=8 L={length} D=64 float32, {documents} causal documents, {'fwd+bwd' if args.grad else 'fwd'}, "
          f"{torch.get_num_threads()} thread(s), median of {args.repeats}")  # fmt: skip
    for name, measured in times.items():
        median = statistics.median(measured)
        print(f"{name:44s} {median * 1e3:9.1f} ms  {median / reference_time:5.2f}x SDPA's dense mask")


if __name__ == "__main__":
    main()
