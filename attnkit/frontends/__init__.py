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

    def host_values(self, x: Any) -> Any:
        """x's values as a numpy array on the host, or None where it has none yet (a JAX tracer under jit)."""
        ...

    def needs_grad(self, inputs: AttentionInputs) -> tuple[bool, bool]: ...

    def symbolic(self, q: Any) -> bool:
        """Whether q has no values to compute with (a compiler tracing the call, meta or fake tensors): attend then
        hands the call to the framework's graph operator (frontends/torch_graph.py)."""
        ...

    def signature(self, q: Any, k: Any, v: Any, mask: Any, bias: Any, q_lengths: Any, kv_lengths: Any) -> Any:
        """A hashable summary of everything validation and dispatch read from the arrays (never their
        values), or None where the framework offers no cheap one."""
        ...

    def length_class_signature(
        self,
        spec: AttentionSpec,
        q: Any,
        k: Any,
        v: Any,
        q_lengths: Any,
        kv_lengths: Any,
        q_segment_ids: Any,
        kv_segment_ids: Any,
    ) -> Any:
        """For a call without mask, bias or ALiBi slopes: :meth:`signature` (and the segment ids') with each
        sequence length replaced by its :func:`attnkit.backend.length_class` and Lq against Lk, so that every length
        of a class has one key; None where the framework offers no cheap one, or the call is not 4-D with
        ``v``'s length ``k``'s and segment ids of the call's lengths."""
        ...

    def segment_signature(self, signature: Any, q_segment_ids: Any, kv_segment_ids: Any) -> Any:
        """:meth:`signature` of a call with segment ids, extended by theirs; None where it is None or they are not
        this framework's arrays."""
        ...

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any: ...

    def dropout_seed(self, seed: Any, key: Any, q: Any) -> Any:
        """§18's 64-bit seed from ``dropout_seed`` or ``dropout_key`` (at most one given; a seed drawn from the
        framework's generator where it has one and neither is), in the form :class:`attnkit.backend.Dropout`
        holds for this framework; InvalidInputTypeError naming the argument for anything else."""
        ...

    def forward_only(self, what: str, run: Any, arrays: Any) -> Any:
        """``run(arrays)``, a call with no gradient (``what`` names it): differentiating it raises InvalidInputError
        where the framework decides differentiation after the call (JAX); torch refuses grad before it."""
        ...

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
    frontends: list[FrameworkOps] = []
    if "torch" in sys.modules:
        from attnkit.frontends import torch_frontend

        frontends.append(torch_frontend.OPS)
    if "jax" in sys.modules:
        from attnkit.frontends import jax_frontend

        frontends.append(jax_frontend.OPS)
    for ops in frontends:
        if ops.is_array(x):
            if not ops.symbolic(x):  # a compiler's stand-in type is not the caller's (nor a key Dynamo can store)
                ops_by_type[type(x)] = ops
            return ops
    raise InvalidInputTypeError(
        f"{argument} must be a torch.Tensor or a jax.Array, got {type(x).__module__}.{type(x).__qualname__}"
    )


def register_imported_frameworks() -> None:
    """Put the glue of every framework imported so far in attend's table now rather than at the first call. A graph
    torch.compile traced before any eager call would read the table empty, and be traced again once a call filled
    it. An integration that knows its calls will be traced (attnkit.integrations.transformers) calls this; importing
    attnkit does not, because the torch frontend imports torch._dynamo (and triton with it, which must come after
    ``attnkit.environment.interpret_triton_without_gpu``)."""
    if "torch" in sys.modules:
        from attnkit.frontends import torch_frontend

        ops_by_type.setdefault(torch_frontend.ARRAY_TYPE, torch_frontend.OPS)
