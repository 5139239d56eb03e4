"""Context parallelism (docs/semantics.md §14): attention over a sequence sharded across ranks or devices."""

from attnkit.distributed.sharding import Sharding, Strategy

__all__ = ["Sharding", "Strategy"]
