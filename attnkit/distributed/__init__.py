"""Context parallelism (docs/semantics.md §14): attention over a sequence sharded across ranks or devices."""

from __future__ import annotations

from typing import Any

from attnkit.distributed.sharding import Sharding, Strategy
from attnkit.errors import InvalidInputTypeError


def _torch_entry(x: Any, argument: str) -> Any:
    """The torch implementation for a torch tensor; a typed error for anything else (JAX lands separately)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        from attnkit.distributed import torch_cp

        return torch_cp
    raise InvalidInputTypeError(
        f"{argument} is a {type(x).__module__}.{type(x).__name__}: attnkit.distributed takes torch tensors for now "
        "(the JAX entry points are not available yet)"
    )


def attend(spec: Any, q: Any, k: Any, v: Any, **options: Any) -> Any:
    """The sharded call of §14: every rank passes its shards of q, k, v and gets its shard of out (and lse)."""
    return _torch_entry(q, "q").attend_torch(spec, q, k, v, **options)


def shard(x: Any, group: Any = None, sharding: str = "zigzag", seq_axis: int = 2) -> Any:
    """This rank's shard of the whole tensor ``x`` along ``seq_axis``."""
    return _torch_entry(x, "x").shard_torch(x, group, sharding, seq_axis)


def unshard(x_local: Any, group: Any = None, sharding: str = "zigzag", seq_axis: int = 2) -> Any:
    """The whole tensor from every rank's shard along ``seq_axis`` (a collective)."""
    return _torch_entry(x_local, "x_local").unshard_torch(x_local, group, sharding, seq_axis)


__all__ = ["Sharding", "Strategy", "attend", "shard", "unshard"]
