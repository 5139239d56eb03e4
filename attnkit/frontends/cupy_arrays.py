"""CuPy arrays in and out of ``attnkit.attend``: each array goes to torch and back through DLPack, without a copy."""

from __future__ import annotations

from typing import Any

from attnkit.api import attend
from attnkit.spec import AttentionSpec


def attend_cupy(spec: AttentionSpec, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """``attnkit.attend(..., backend="cupy")`` on CuPy arrays: each array goes to torch and the results come back
    through DLPack, without a copy. CuPy has no autograd, so this is the forward only (``return_lse=True`` gives
    ``(out, lse)``); for gradients, call ``attnkit.attend`` on ``torch.from_dlpack`` views of the arrays."""
    import cupy
    import torch

    def to_torch(x: Any) -> Any:
        return torch.from_dlpack(x) if hasattr(x, "__dlpack__") else x

    converted = {name: to_torch(value) for name, value in kwargs.items() if name != "backend"}
    result = attend(spec, to_torch(q), to_torch(k), to_torch(v), backend="cupy", **converted)
    if isinstance(result, tuple):
        return tuple(cupy.from_dlpack(x.detach()) for x in result)
    return cupy.from_dlpack(result.detach())
