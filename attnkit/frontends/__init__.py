"""Per-framework glue: reading array metadata, and wiring a backend's backward into autograd."""

from __future__ import annotations

import sys
from typing import Any, Protocol

from attnkit.backend import AttentionInputs, Backend, Framework, Problem, Runner
from attnkit.errors import InvalidInputTypeError
from attnkit.spec import AttentionSpec


class FrameworkOps(Protocol):
    framework: Framework

    def dtype_name(self, x: Any) -> str: ...

    def device(self, x: Any) -> str: ...

    def is_array(self, x: Any) -> bool: ...

    def value_range(self, x: Any) -> tuple[int, int]: ...

    def needs_grad(self, inputs: AttentionInputs) -> tuple[bool, bool]: ...

    def signature(self, q: Any, k: Any, v: Any, mask: Any, bias: Any, q_lengths: Any, kv_lengths: Any) -> Any:
        """A hashable summary of everything validation and dispatch read from the arrays (never their
        values), or None where the framework offers no cheap one."""
        ...

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any: ...

    def runner(self, backend: Backend, spec: AttentionSpec, problem: Problem) -> Runner:
        """The function that runs calls with this (spec, problem) on ``backend``, gradients wired in; made once
        per dispatch decision and cached with it."""
        ...


FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})
INTEGER = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})

ops_by_type: dict[type, FrameworkOps] = {}  # filled by ops_for; attend() reads it first


def ops_for(x: Any, argument: str = "q") -> FrameworkOps:
    """The framework glue for array ``x``; torch and JAX are imported only if the caller uses them."""
    ops = ops_by_type.get(type(x))
    if ops is not None:
        return ops
    if "torch" in sys.modules:
        from attnkit.frontends import torch_frontend

        if torch_frontend.OPS.is_array(x):
            ops_by_type[type(x)] = torch_frontend.OPS
            return torch_frontend.OPS
    if "jax" in sys.modules:
        from attnkit.frontends import jax_frontend

        if jax_frontend.OPS.is_array(x):
            ops_by_type[type(x)] = jax_frontend.OPS
            return jax_frontend.OPS
    raise InvalidInputTypeError(
        f"{argument} must be a torch.Tensor or a jax.Array, got {type(x).__module__}.{type(x).__qualname__}"
    )
