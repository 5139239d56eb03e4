"""``attnkit bench --what packed``: segment ids (docs/semantics.md §4.5) on the CPU, forward+backward through
``auto``, as paired ratios (issue 17's bars).

* ``packed``: one row of ``DOCUMENTS`` causal documents of ``DOCUMENT_LEN`` tokens told apart by segment ids,
  against the same documents as a batch (``DOCUMENTS`` rows of ``DOCUMENT_LEN``, causal) through auto and through
  the backend auto ran the row on (``-same``: what the ids cost that backend), and against SDPA with the equivalent
  dense (1, 1, L, L) boolean mask (built before timing); ``varlen`` is the same row through ``attend_varlen``
  (cu_seqlens, (total, H, D) tensors). With ``backends``, one such cell per named backend, the row, ``varlen`` and
  the ``-same`` batch run on it. Skipping the tiles of other documents, the row costs Σ Lᵢ²
  like the batch, not (Σ Lᵢ)².
* ``left-padded``: a causal batch whose odd rows are left-padded by a quarter (segment id −1 on the pads, 0 on the
  rest), against the unpadded causal call of the same shape, through auto and through the same backend.
* memory: the peak extra memory of the packed call at two row lengths (fresh process each): linear in L.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from attnkit.bench.calls import random_inputs
from attnkit.bench.peak_memory import print_peak, run_child
from attnkit.bench.timing import device_banner, environment, interleaved, paired_ratio
from attnkit.tables import format_table

DOCUMENTS, DOCUMENT_LEN = 8, 512
HEADS, HEAD_DIM = 8, 64
LEFT_PADDED_BATCH = 4  # rows of 2 documents' length; the odd rows' first quarter is padding
MEMORY_DOCUMENTS = (8, 16)
_MEMORY_CHILD = "import sys; from attnkit.bench.packed import _memory_child as m; m(int(sys.argv[1]))"


def packed_ids(documents: int, document_len: int | None = None) -> Any:
    """(1, documents · document_len) int64 (default ``DOCUMENT_LEN``): document d's positions hold id d."""
    import torch

    return torch.arange(documents).repeat_interleave(document_len or DOCUMENT_LEN).view(1, -1)


def causal_document_mask(ids: Any) -> Any:
    """(1, 1, L, L) bool for a (1, L) row of ids: causal inside each document, what SDPA needs for the packed row."""
    import torch

    row = ids.view(-1)
    same = row.view(-1, 1) == row.view(1, -1)
    return (same & torch.ones(len(row), len(row), dtype=torch.bool).tril()).view(1, 1, len(row), len(row))


def left_padded_ids(batch: int, seq_len: int, pad: int) -> Any:
    """(B, L) int64: −1 on the first ``pad`` positions of the odd rows, 0 elsewhere."""
    import torch

    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    ids[1::2, :pad] = -1
    return ids


def _backend_of(spec: Any, *tensors: Any, **keywords: Any) -> str:
    import attnkit

    chosen = attnkit.explain(spec, *tensors, **keywords)
    return next(line.split()[1] for line in chosen.splitlines() if line.startswith("->"))


def _fwd_bwd(call: Callable[..., Any], q: Any, k: Any, v: Any, dout: Any) -> Callable[[], Any]:
    import torch

    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    return lambda: torch.autograd.grad(call(*leaves), leaves, dout)


def _packed_cell(repeats: int, warmup: int, named: str | None, document_len: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import attnkit

    length = DOCUMENTS * document_len
    spec = attnkit.AttentionSpec(causal=True)
    ids = packed_ids(DOCUMENTS, document_len)
    q, k, v, dout = random_inputs("torch", (1, HEADS, length, HEAD_DIM), (1, HEADS, length, HEAD_DIM))
    # The same documents as a batch: (1, H, D·n, ·) -> (D, H, n, ·), each row one document, contiguous as a batch is.
    as_batch = [
        x.view(1, HEADS, DOCUMENTS, document_len, HEAD_DIM).transpose(0, 2).squeeze(2).contiguous()
        for x in (q, k, v, dout)
    ]
    dense = causal_document_mask(ids)
    # attend_varlen's (total, H, D) tensors and offsets: the same row, as flash-attn's callers hold it.
    as_packed = [x[0].transpose(0, 1).contiguous() for x in (q, k, v, dout)]
    offsets = torch.arange(0, length + 1, document_len, dtype=torch.int32)

    def varlen(q: Any, k: Any, v: Any) -> Any:
        return attnkit.attend_varlen(spec, q, k, v, offsets, offsets, backend=named or "auto")

    def packed(q: Any, k: Any, v: Any) -> Any:
        return attnkit.attend(spec, q, k, v, q_segment_ids=ids, kv_segment_ids=ids, backend=named or "auto")

    backend = named or _backend_of(spec, q.detach().requires_grad_(True), k, v, q_segment_ids=ids, kv_segment_ids=ids)
    functions = {
        "packed": _fwd_bwd(packed, q, k, v, dout),
        "batch": _fwd_bwd(lambda q, k, v: attnkit.attend(spec, q, k, v), *as_batch),
        "batch-same": _fwd_bwd(lambda q, k, v: attnkit.attend(spec, q, k, v, backend=backend), *as_batch),
        "sdpa-mask": _fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), q, k, v, dout),
        "varlen": _fwd_bwd(varlen, *as_packed),
    }
    samples = interleaved(functions, repeats, warmup)
    return {
        "cell": "packed",
        "shape": f"B=1 L={length} ({DOCUMENTS} x {document_len})",
        "backend": backend,
        "baseline_backend": _backend_of(spec, as_batch[0].requires_grad_(True), *as_batch[1:3]),
        "ms": {name: statistics.median(values) / 1e6 for name, values in samples.items()},
        "ratios": {
            "packed / batch": paired_ratio(samples, "packed", "batch"),
            "packed / batch-same": paired_ratio(samples, "packed", "batch-same"),
            "sdpa-mask / packed": paired_ratio(samples, "sdpa-mask", "packed"),
            "varlen / batch": paired_ratio(samples, "varlen", "batch"),
        },
    }


def _left_padded_cell(repeats: int, warmup: int, length: int) -> dict[str, Any]:
    import attnkit

    batch, pad = LEFT_PADDED_BATCH, length // 4
    spec = attnkit.AttentionSpec(causal=True)
    ids = left_padded_ids(batch, length, pad)
    q, k, v, dout = random_inputs("torch", (batch, HEADS, length, HEAD_DIM), (batch, HEADS, length, HEAD_DIM))

    def padded(q: Any, k: Any, v: Any) -> Any:
        return attnkit.attend(spec, q, k, v, q_segment_ids=ids, kv_segment_ids=ids)

    grad = q.detach().requires_grad_(True)
    backend = _backend_of(spec, grad, k, v, q_segment_ids=ids, kv_segment_ids=ids)
    functions = {
        "left-padded": _fwd_bwd(padded, q, k, v, dout),
        "unpadded": _fwd_bwd(lambda q, k, v: attnkit.attend(spec, q, k, v), q, k, v, dout),
        "unpadded-same": _fwd_bwd(lambda q, k, v: attnkit.attend(spec, q, k, v, backend=backend), q, k, v, dout),
    }
    samples = interleaved(functions, repeats, warmup)
    return {
        "cell": "left-padded",
        "shape": f"B={batch} L={length}, odd rows padded {pad}",
        "backend": backend,
        "baseline_backend": _backend_of(spec, grad, k, v),
        "ms": {name: statistics.median(values) / 1e6 for name, values in samples.items()},
        "ratios": {
            "left-padded / unpadded": paired_ratio(samples, "left-padded", "unpadded"),
            "left-padded / unpadded-same": paired_ratio(samples, "left-padded", "unpadded-same"),
        },
    }


def bench_packed(
    repeats: int = 3, warmup: int = 1, memory: bool = True, backends: tuple[str, ...] | None = None,
    document_len: int = DOCUMENT_LEN,
) -> dict[str, Any]:  # fmt: skip
    """The packed-row and left-padding cells (float32, forward+backward through auto; the packed row on each of
    ``backends`` instead where given), and with ``memory`` the packed call's peak extra memory per row length."""
    result: dict[str, Any] = {
        "what": "packed",
        "environment": environment("cpu"),
        "shape": {"heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32", "causal": True},
        "repeats": repeats,
        "warmup": warmup,
        "cells": [
            *(_packed_cell(repeats, warmup, named, document_len) for named in backends or (None,)),
            _left_padded_cell(repeats, warmup, 2 * document_len),
        ],
    }
    if memory:
        result["memory"] = [
            {"len": documents * DOCUMENT_LEN, **run_child(_MEMORY_CHILD, [str(documents)], f"{documents} documents")}
            for documents in MEMORY_DOCUMENTS
        ]
    return result


def _memory_child(documents: int) -> None:
    """In a fresh process: print the peak RSS growth of one packed forward+backward of ``documents`` documents."""
    import torch

    import attnkit

    torch.set_num_threads(1)
    spec = attnkit.AttentionSpec(causal=True)

    def run(documents: int) -> Callable[[], None]:
        shape = (1, HEADS, documents * DOCUMENT_LEN, HEAD_DIM)
        q, k, v, dout = random_inputs("torch", shape, shape)
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        ids = packed_ids(documents)
        return lambda: attnkit.attend(spec, *leaves, q_segment_ids=ids, kv_segment_ids=ids).backward(dout)

    run(1)()  # load modules and build kernels before measuring
    print_peak(run(documents))


def format_packed(result: dict[str, Any]) -> str:
    shape = result["shape"]
    lines = [
        device_banner(result),
        "segment ids, causal, forward+backward (the packed row on `runs on`: auto's choice, or --backends): "
        f"H={shape['heads']}, D={shape['head_dim']}, "
        f"{shape['dtype']}; paired ratio = median over {result['repeats']} interleaved repeats of the two times in "
        "the same repeat",
    ]
    rows = [
        [c["cell"], c["shape"], c["backend"], c["baseline_backend"], name, f"{ratio:.3f}", "  ".join(
            f"{key} {ms:.0f}" for key, ms in c["ms"].items()
        )]
        for c in result["cells"]
        for name, ratio in c["ratios"].items()
    ]  # fmt: skip
    lines.append(format_table(["cell", "shape", "runs on", "baseline runs", "ratio", "value", "median ms"], rows))
    if "memory" in result:
        lines.append(f"\npeak extra memory of the packed call (documents of {DOCUMENT_LEN}), fresh process each")
        memory_rows = [[str(m["len"]), f"{m['peak_extra_bytes'] / 2**20:.1f}"] for m in result["memory"]]
        lines.append(format_table(["L", "peak extra MiB"], memory_rows))
    return "\n".join(lines)
