"""``attnkit bench --what compiled``: a training step of a small causal transformer block compiled with
``torch.compile(fullgraph=True)``, its attention by ``attnkit.attend`` (auto) against the same block calling
``F.scaled_dot_product_attention``, both compiled by inductor, interleaved in one run. ``--passes fwd`` (and
``--quick``) times the forward alone under ``torch.no_grad()``: half the graphs for inductor to compile, which is
most of a cold run's time."""

from __future__ import annotations

import statistics
from typing import Any

from attnkit.bench.timing import device_banner, environment, in_ms, interleaved, paired_ratio, synchronizer, wall_clock
from attnkit.tables import format_table

SHAPE = {"batch": 4, "heads": 8, "heads_kv": 2, "seq_len": 256, "head_dim": 64}
ATTNKIT = "attnkit.attend"
SDPA = "F.scaled_dot_product_attention"
PASSES = ("fwd", "fwd+bwd")


def _block(attention: str, shape: dict[str, int], device: str) -> Any:
    """A pre-norm block (GQA attention, MLP) whose attention call is ``attention``."""
    import torch
    import torch.nn.functional as F

    import attnkit

    heads, heads_kv, head_dim = shape["heads"], shape["heads_kv"], shape["head_dim"]
    width = heads * head_dim
    spec = attnkit.AttentionSpec(causal=True)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            self.qkv = torch.nn.Linear(width, (heads + 2 * heads_kv) * head_dim, bias=False)
            self.proj = torch.nn.Linear(width, width, bias=False)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                           torch.nn.Linear(4 * width, width))  # fmt: skip

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch, length, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).split([heads * head_dim, heads_kv * head_dim, heads_kv * head_dim], -1)
            q = q.view(batch, length, heads, head_dim).transpose(1, 2)
            k, v = (t.view(batch, length, heads_kv, head_dim).transpose(1, 2) for t in (k, v))
            if attention == ATTNKIT:
                out = attnkit.attend(spec, q, k, v)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.proj(out.transpose(1, 2).reshape(batch, length, width))
            return x + self.mlp(self.norm2(x))

    torch.manual_seed(0)
    return Block().to(device)


def bench_compiled(repeats: int = 5, warmup: int = 3, device: str = "cpu", backward: bool = True) -> dict[str, Any]:
    """Median step time (forward + backward, or the forward alone without autograd) of the compiled block each way,
    and their paired ratio."""
    import torch

    shape = SHAPE
    x = torch.randn(shape["batch"], shape["seq_len"], shape["heads"] * shape["head_dim"], device=device)
    functions = {}
    for attention in (ATTNKIT, SDPA):
        block = torch.compile(_block(attention, shape, device), fullgraph=True)

        def step(block: Any = block) -> None:
            if backward:
                block(x).square().mean().backward()
            else:
                with torch.no_grad():
                    block(x)

        functions[attention] = step
    first_calls: dict[str, float] = {}
    clock = wall_clock(synchronizer(device))
    samples = in_ms(interleaved(functions, repeats, warmup, clock=clock, first_calls=first_calls))
    return {
        "what": "compiled",
        "environment": environment(device),
        "shape": {**shape, "dtype": "float32", "causal": True},
        "pass": "fwd+bwd" if backward else "fwd",
        "repeats": repeats,
        "step_ms": {name: statistics.median(values) for name, values in samples.items()},
        "first_step_ms": {name: value / 1e6 for name, value in first_calls.items()},  # inductor's compile in it
        "ratio_attnkit_over_sdpa": paired_ratio(samples, ATTNKIT, SDPA),
        "samples_ms": samples,
    }


def format_compiled(result: dict[str, Any]) -> str:
    shape = result["shape"]
    first = result.get("first_step_ms", {})
    rows = [
        [name, f"{ms:.2f}", f"{first[name]:.0f}" if name in first else "n/a"] for name, ms in result["step_ms"].items()
    ]
    rows.append(["attnkit / SDPA (paired)", f"{result['ratio_attnkit_over_sdpa']:.2f}x", ""])
    return "\n".join(
        [
            device_banner(result),
            f"compiled {'training step' if result['pass'] == 'fwd+bwd' else 'forward, no_grad'} "
            f"(torch.compile fullgraph, inductor): pre-norm block, B={shape['batch']} "
            f"L={shape['seq_len']} H={shape['heads']} Hkv={shape['heads_kv']} D={shape['head_dim']} float32 causal; "
            f"median of {result['repeats']} interleaved repeats after the warm-up; first step (compile) apart",
            format_table(["attention", "ms/step", "first step ms"], rows),
        ]
    )
