"""JAX glue: metadata, and a jax.custom_vjp that calls the backend's backward (works under jit/grad)."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from attnkit.backend import AttentionInputs, Backend, Dropout, Feature, Framework, Problem, Runner, own_forward
from attnkit.contract.programs import BoundProgram
from attnkit.errors import BackendUnavailableError, InvalidInputError, InvalidInputTypeError
from attnkit.frontends.seeds import unsigned_seed
from attnkit.spec import AttentionSpec


def sum_to_shape(gradient: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Reduce a broadcast gradient back to the shape of the array that was broadcast."""
    if gradient.shape == tuple(shape):
        return gradient
    leading = gradient.ndim - len(shape)
    if leading:
        gradient = gradient.sum(axis=tuple(range(leading)))
    axes = tuple(axis for axis, size in enumerate(shape) if size == 1 and gradient.shape[axis] != 1)
    return gradient.sum(axis=axes, keepdims=True) if axes else gradient


# A call's mask program travels inside AttentionInputs through jit and custom_vjp: its captured arrays are the
# leaves, the program (hashable) the static part.
jax.tree_util.register_pytree_node(
    BoundProgram,
    lambda bound: (bound.captured, bound.program),
    lambda program, captured: BoundProgram(program, tuple(captured)),
)


# A call's dropout: the seed's words and the offsets are leaves (traced under jit: a new seed never recompiles; a
# rank's offset may be traced), p the static part.
jax.tree_util.register_pytree_node(
    Dropout,
    lambda dropout: ((dropout.seed, dropout.head_start, dropout.query_start, dropout.key_start), dropout.p),
    lambda p, leaves: Dropout(p, *leaves),
)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(backend: Backend, spec: AttentionSpec, inputs: AttentionInputs) -> tuple[jax.Array, jax.Array]:
    return backend.forward(spec, inputs, need_lse=True)


def _attend_fwd(backend: Backend, spec: AttentionSpec, inputs: AttentionInputs) -> tuple[Any, Any]:
    # symbolic_zeros: each leaf arrives as CustomVJPPrimal(value, perturbed), so the backward knows
    # whether bias is being differentiated. That choice rides in the residuals' tree structure (an
    # empty tuple or None), never as a Python bool leaf, which jit could turn into a tracer.
    perturbed = jax.tree.map(lambda leaf: leaf.perturbed, inputs, is_leaf=_is_primal)
    inputs = jax.tree.map(lambda leaf: leaf.value, inputs, is_leaf=_is_primal)
    out, lse = backend.forward(spec, inputs, need_lse=True)
    wants_dbias = () if inputs.bias is not None and perturbed.bias else None
    return (out, lse), (inputs, out, lse, wants_dbias)


def _attend_bwd(backend: Backend, spec: AttentionSpec, residuals: Any, cotangents: Any) -> tuple[Any]:
    inputs, out, lse, wants_dbias = residuals
    dout, dlse = cotangents
    if Feature.GRAD not in backend.capabilities.features:
        raise BackendUnavailableError(f"backend={backend.name!r} has no backward (grad is not supported)")
    if wants_dbias is not None and Feature.DBIAS not in backend.capabilities.features:
        raise BackendUnavailableError(
            f"backend={backend.name!r} cannot differentiate with respect to bias (dbias is not supported)"
        )
    # Only lse used: out's cotangent is a symbolic zero, but backends take an array for dout.
    if isinstance(dout, SymbolicZero):
        dout = jnp.zeros(out.shape, out.dtype)
    # Backends read dlse=None as zero and skip that term.
    if isinstance(dlse, SymbolicZero):
        dlse = None
    grads = backend.backward(spec, inputs, out, lse, dout, dlse, need_dbias=wants_dbias is not None)
    dbias = None
    if wants_dbias is not None:
        dbias = sum_to_shape(grads.dbias, inputs.bias.shape).astype(inputs.bias.dtype)
    # None is a zero cotangent: right for bool mask and integer lengths, and for a bias not differentiated.
    return (AttentionInputs(grads.dq, grads.dk, grads.dv, bias=dbias),)


def _is_primal(leaf: Any) -> bool:
    return isinstance(leaf, CustomVJPPrimal)


_attend.defvjp(_attend_fwd, _attend_bwd, symbolic_zeros=True)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _forward_only(what: str, run: Any, arrays: Any) -> Any:
    return run(arrays)


def _forward_only_fwd(what: str, run: Any, arrays: Any) -> tuple[Any, None]:
    return run(arrays), None


def _forward_only_bwd(what: str, run: Any, residuals: None, cotangents: Any) -> Any:
    raise InvalidInputError(
        f"{what} is forward only, but it is being differentiated: wrap its inputs in jax.lax.stop_gradient"
    )


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)


class JaxOps:
    framework = Framework.JAX

    def is_array(self, x: Any) -> bool:
        return isinstance(x, jax.Array)

    def dtype_name(self, x: jax.Array) -> str:
        return str(x.dtype)

    def device(self, x: jax.Array) -> str:
        try:
            platform = next(iter(x.devices())).platform
        except Exception:  # a tracer under jit has no committed device: the default backend decides
            platform = jax.default_backend()
        return "cuda" if platform in ("gpu", "cuda", "rocm") else platform

    def value_range(self, x: jax.Array) -> tuple[int, int]:
        if isinstance(x, jax.core.Tracer) or x.size == 0:
            return 0, 0  # values are unknown while tracing; backends clamp lengths to [0, L]
        # numpy, not jnp: inside a jit trace jnp.min of a closed-over concrete array is a tracer.
        values = np.asarray(x)
        return int(values.min()), int(values.max())

    def host_values(self, x: jax.Array) -> np.ndarray | None:
        return None if isinstance(x, jax.core.Tracer) else np.asarray(x)

    def signature(self, q: Any, k: Any, v: Any, mask: Any, bias: Any, q_lengths: Any, kv_lengths: Any) -> Any:
        return None  # JAX calls are traced once under jit; the per-call validation cost does not recur there

    def segment_signature(self, signature: Any, q_segment_ids: Any, kv_segment_ids: Any) -> Any:
        return None

    def length_class_signature(self, spec: Any, q: Any, *arrays: Any) -> Any:
        return None  # as signature: jit traces the call once

    def symbolic(self, q: Any) -> bool:
        return False  # jit traces attend itself, with the backend's own JAX code

    def needs_grad(self, inputs: AttentionInputs) -> tuple[bool, bool]:
        # JAX decides differentiation after the call; custom_vjp only runs the backward if asked.
        return False, False

    def reshape(self, x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        return x.reshape(shape)

    def dropout_seed(self, seed: Any, key: Any, q: Any) -> jax.Array:
        """The seed's (low, high) words, a (2,) uint32 array: from ``dropout_key`` the two words
        ``jax.random.bits(key, (2,), jnp.uint32)`` draws; from ``dropout_seed`` a Python int, a uint64 scalar
        (under x64) or the (2,) uint32 words themselves, traced or not."""
        if seed is not None and key is not None:
            raise InvalidInputError("dropout_seed and dropout_key were both given: pass one")
        if key is not None:
            if not isinstance(key, jax.Array | np.ndarray) or not (
                jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or (key.dtype == jnp.uint32 and key.shape == (2,))
            ):
                raise InvalidInputTypeError(
                    f"dropout_key must be a PRNG key (jax.random.key(...)), got {_described(key)}; an integer seed "
                    "goes in dropout_seed"
                )
            if key.shape not in ((), (2,)) or (key.shape == (2,) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)):
                raise InvalidInputError(f"dropout_key must be a single PRNG key, got an array of {key.shape} keys")
            return jax.random.bits(key, (2,), jnp.uint32)
        if seed is None:
            raise InvalidInputError(
                "dropout_p > 0 in a JAX call needs dropout_key (a PRNG key) or dropout_seed (JAX has no global "
                "generator)"
            )
        if isinstance(seed, jax.Array | np.ndarray | np.generic) and not isinstance(seed, np.integer):
            if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
                raise InvalidInputTypeError("dropout_seed was given a PRNG key: pass it as dropout_key")
            if seed.dtype == jnp.uint64 and seed.shape == ():
                words = jnp.asarray(seed)
                return jnp.stack([(words & 0xFFFFFFFF).astype(jnp.uint32), (words >> 32).astype(jnp.uint32)])
            if seed.dtype == jnp.uint32 and seed.shape == (2,):
                return jnp.asarray(seed)
            raise InvalidInputTypeError(
                f"dropout_seed is {_described(seed)}, expected a Python int in [0, 2**64), a uint64 scalar, or a (2,) "
                "uint32 array of (low, high) words"
            )
        value = unsigned_seed(seed)
        return jnp.array([value & 0xFFFFFFFF, value >> 32], dtype=jnp.uint32)

    def forward_only(self, what: str, run: Any, arrays: Any) -> Any:
        # JAX differentiates after the call: the refusal can only come from the backward.
        return _forward_only(what, run, arrays)

    def runner(self, backend: Backend, spec: AttentionSpec, problem: Problem) -> Runner:
        own = own_forward(backend, spec, problem)
        if own is not None:
            return own
        return partial(_attend, backend, spec)


OPS = JaxOps()


def _described(x: Any) -> str:
    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    return f"an array of dtype {dtype} and shape {tuple(shape)}" if shape is not None else type(x).__name__
