"""Context parallelism (docs/semantics.md §14, docs/distributed.md): a small causal transformer layer trained for a
few steps with its sequence sharded across ranks, against the same layer in one process.

torch, 4 ranks on CPU (gloo):

    torchrun --nproc-per-node 4 examples/context_parallel.py torch [--strategy ring|allgather|ulysses]

JAX, 4 host devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/context_parallel.py jax [--strategy ...]

The layer's shape and the run take flags (--length, --heads, --head-dim, --batch, --steps, --sharding; --help lists
them): the length must be a multiple of twice the ranks for zigzag (of the ranks for contiguous), and ulysses needs
the heads to be a multiple of the ranks.

Each step prints the sharded loss next to the single-process loss (the same weights and data; they agree to float32
rounding), and the torch run prints each rank's peak extra memory of its first training step.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

MODEL, LEARNING_RATE = 64, 0.05


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("framework", choices=["torch", "jax"])
    parser.add_argument("--strategy", default="ring", choices=["ring", "allgather", "ulysses"])
    parser.add_argument("--sharding", default="zigzag", choices=["zigzag", "contiguous"])
    parser.add_argument("--length", type=int, default=2048, help="sequence length (default %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default %(default)s)")
    parser.add_argument("--head-dim", type=int, default=16, help="head dim (default %(default)s)")
    parser.add_argument("--batch", type=int, default=2, help="batch size (default %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default %(default)s)")
    args = parser.parse_args(argv)
    for name in ("length", "heads", "head_dim", "batch", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def torch_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import attnkit
    import attnkit.distributed as cp
    from attnkit.bench.peak_memory import peak_extra_bytes

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy, sharding = args.strategy, args.sharding
    batch, length, heads, head_dim = args.batch, args.length, args.heads, args.head_dim
    torch.manual_seed(0)  # the same weights and data on every rank
    spec = attnkit.AttentionSpec(causal=True, layout="bshd")
    x = torch.randn(batch, length, MODEL)
    target = torch.randn(batch, length, MODEL)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(MODEL, 3 * heads * head_dim)
            self.out = torch.nn.Linear(heads * head_dim, MODEL)
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(MODEL, 4 * MODEL), torch.nn.GELU(), torch.nn.Linear(4 * MODEL, MODEL)
            )

        def forward(self, x: torch.Tensor, attend: Any) -> torch.Tensor:
            q, k, v = self.qkv(x).unflatten(-1, (3, heads, head_dim)).unbind(2)
            x = x + self.out(attend(spec, q, k, v).flatten(2))
            return x + self.mlp(x)

    single, sharded = Layer(), Layer()
    sharded.load_state_dict(single.state_dict())
    x_local, target_local = (cp.shard(t, sharding=sharding, seq_axis=1) for t in (x, target))

    def sharded_attend(spec: Any, q: Any, k: Any, v: Any) -> Any:
        return cp.attend(spec, q, k, v, strategy=strategy, sharding=sharding)

    def step(model: Layer, inputs: torch.Tensor, wanted: torch.Tensor, attend: Any, shards: int) -> torch.Tensor:
        """One SGD step on the mean squared error over every position: a rank's share is its positions' sum over the
        global count, and the parameters' gradients are summed over the ranks."""
        model.zero_grad()
        loss = ((model(inputs, attend) - wanted) ** 2).sum() / (batch * length * MODEL)
        loss.backward()
        total = loss.detach().clone()
        if shards > 1:
            dist.all_reduce(total)
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= LEARNING_RATE * parameter.grad
        return total

    # Warm up on a short sequence (kernels built, dispatch cached), then measure the first full-length step: the
    # process has not held its tensors yet, so the peak resident memory it adds is what the step allocates.
    short = min(4 * world, length)
    warm = [cp.shard(t[:, :short], sharding=sharding, seq_axis=1) for t in (x, target)]
    step(Layer(), *warm, sharded_attend, world)
    losses: list[torch.Tensor] = []
    peak = peak_extra_bytes(lambda: losses.append(step(sharded, x_local, target_local, sharded_attend, world)))
    print(f"rank {rank}: peak extra memory of a training step {peak / 2**20:.1f} MiB (B={batch}, L={length} sharded)")
    for index in range(args.steps):
        reference = step(single, x, target, attnkit.attend, 1)
        loss = losses[0] if index == 0 else step(sharded, x_local, target_local, sharded_attend, world)
        if rank == 0:
            print(f"step {index}: loss {loss.item():.6f} on {world} ranks ({strategy}), {reference.item():.6f} alone")
    dist.destroy_process_group()


def jax_main(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import attnkit
    import attnkit.distributed as cp

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("seq",))
    strategy, sharding = args.strategy, args.sharding
    batch, length, heads, head_dim = args.batch, args.length, args.heads, args.head_dim
    spec = attnkit.AttentionSpec(causal=True, layout="bshd")
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    params = {
        "qkv": jax.random.normal(keys[0], (MODEL, 3 * heads * head_dim)) / MODEL**0.5,
        "out": jax.random.normal(keys[1], (heads * head_dim, MODEL)) / (heads * head_dim) ** 0.5,
        "up": jax.random.normal(keys[2], (MODEL, 4 * MODEL)) / MODEL**0.5,
        "down": jax.random.normal(keys[3], (4 * MODEL, MODEL)) / (4 * MODEL) ** 0.5,
    }
    x = jax.random.normal(keys[4], (batch, length, MODEL))
    target = jax.random.normal(keys[5], (batch, length, MODEL))

    def layer(params: Any, x: Any, attend: Any) -> Any:
        q, k, v = jnp.split((x @ params["qkv"]).reshape(*x.shape[:2], 3 * heads, head_dim), 3, axis=2)
        x = x + attend(spec, q, k, v).reshape(*x.shape[:2], -1) @ params["out"]
        return x + jax.nn.gelu(x @ params["up"]) @ params["down"]

    def sharded_attend(spec: Any, q: Any, k: Any, v: Any) -> Any:
        return cp.attend(spec, q, k, v, mesh=mesh, axis_name="seq", strategy=strategy, sharding=sharding)

    def train_step(attend: Any) -> Any:
        def loss_of(params: Any, x: Any, wanted: Any) -> Any:
            return jnp.mean((layer(params, x, attend) - wanted) ** 2)

        @jax.jit
        def step(params: Any, x: Any, wanted: Any) -> Any:
            loss, grads = jax.value_and_grad(loss_of)(params, x, wanted)
            return loss, jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)

        return step

    # The mean over positions does not depend on their order: the sharded model sees the zigzag order throughout.
    x_sharded, target_sharded = (
        cp.shard(t, mesh=mesh, axis_name="seq", sharding=sharding, seq_axis=1) for t in (x, target)
    )
    single_step, sharded_step = train_step(attnkit.attend), train_step(sharded_attend)
    single, sharded = params, params
    for index in range(args.steps):
        reference, single = single_step(single, x, target)
        loss, sharded = sharded_step(sharded, x_sharded, target_sharded)
        print(
            f"step {index}: loss {float(loss):.6f} on {len(devices)} devices ({strategy}), {float(reference):.6f} alone"
        )


if __name__ == "__main__":
    chosen = arguments()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    (torch_main if chosen.framework == "torch" else jax_main)(chosen)
