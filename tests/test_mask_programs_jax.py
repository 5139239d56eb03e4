"""The JAX tracer of mask programs (attnkit/frontends/jax_programs.py, docs/semantics.md §17): each program's
materialisation (``dense``, what backends and the oracle read) equals the function itself run by ``jax.vmap`` over
every (b, h, q_idx, kv_idx) of a grid; programs it cannot contain are refused naming mask_mod and the operation; a
closed-over array that is a tracer of an enclosing jax.jit is captured as a slot; the trace cache follows what the
function closes over."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import attnkit.programs
from attnkit.contract.programs import EMPTY, FULL, dense, replace_captured, tile_classes
from attnkit.errors import MaskProgramError
from attnkit.frontends import jax_programs, ops_for

B, H, L = 2, 3, 13
rng = np.random.default_rng(7)
DOC = jnp.asarray(np.sort(rng.integers(0, 4, (B, L)), axis=1), dtype=jnp.int32)
PREFIX = jnp.asarray([4, 9], dtype=jnp.int32)
# Image tokens in groups (ids >= 0), text tokens -1.
GROUP = jnp.asarray([[-1, -1, 0, 0, 0, -1, 1, 1, -1, -1, 2, 2, 2], [3] * 4 + [-1] * 5 + [4] * 4], dtype=jnp.int32)
GLOBAL = jnp.asarray(rng.random((B, L)) < 0.2)
WINDOW = jnp.asarray([1, 2, 4], dtype=jnp.int32)
TABLE = jnp.asarray(rng.integers(-3, 4, (H, 4)), dtype=jnp.int8)


def _visible(mask_mod: Callable[..., Any]) -> np.ndarray:
    """The function's own answer at every (b, h, q_idx, kv_idx) of the grid."""
    b, h, q, kv = (
        g.ravel() for g in jnp.meshgrid(*(jnp.arange(n, dtype=jnp.int32) for n in (B, H, L, L)), indexing="ij")
    )
    visible = np.asarray(jax.jit(jax.vmap(mask_mod))(b, h, q, kv))
    return visible.reshape(B, H, L, L, *visible.shape[1:])


def _dense(mask_mod: Callable[..., Any]) -> np.ndarray:
    """The program bound as a call binds it, materialised in NumPy (int64: exact where JAX's int32 is)."""
    q = jnp.zeros((B, L, H, 8), jnp.float32)
    bound = attnkit.programs.bind(mask_mod, ops_for(q), q, B, H, L, L)
    on_host = replace_captured(bound, [np.asarray(array) for array in bound.captured])
    return np.broadcast_to(dense(on_host, B, H, L, L, like=np.zeros(())), (B, H, L, L))


def _chunk(q: Any, kv: Any) -> Any:
    return q // 4 == kv // 4


@jax.jit
def _jitted_band(q: Any, kv: Any) -> Any:
    return jnp.abs(q - kv) <= 3


PROGRAMS: dict[str, Callable[..., Any]] = {
    "document causal": lambda b, h, q, kv: (DOC[b, q] == DOC[b, kv]) & (q >= kv),
    "prefix lm": lambda b, h, q, kv: (kv < PREFIX[b]) | (q >= kv),
    "chunked causal": lambda b, h, q, kv: (q // 4 == kv // 4) & (q >= kv),
    "image groups over causal": lambda b, h, q, kv: jnp.where(
        (GROUP[b, q] >= 0) & (GROUP[b, q] == GROUP[b, kv]), True, q >= kv
    ),
    "local window with global tokens": lambda b, h, q, kv: (jnp.abs(q - kv) <= 2) | GLOBAL[b, q] | GLOBAL[b, kv],
    "dilated": lambda b, h, q, kv: ((q - kv) % 3 == 0) & (q >= kv),
    # What else jnp lowers to: C rounding, negative operands, clip, sign, powers, integer selects.
    "per-head window": lambda b, h, q, kv: jnp.abs(q - kv) <= WINDOW[h],
    "floor and C rounding": lambda b, h, q, kv: (
        ((q - 6) // 4 == (kv - 6) // 4)
        ^ (lax.div(q - 6, jnp.int32(4)) == lax.rem(kv - 7, jnp.int32(3)))
        ^ (jnp.fmod(kv - 5, 3) == (q - 9) % -4)
    ),
    "clip sign power": lambda b, h, q, kv: (jnp.clip(q - kv, -2, 3) == jnp.sign(kv - 5) * 2) | (q**2 < kv * 5),
    "min max select": lambda b, h, q, kv: lax.select_n(jnp.minimum(q, 2), kv < 3, jnp.maximum(q, kv) > 9, ~(q > kv)),
    "bool casts": lambda b, h, q, kv: (
        ((q % 2).astype(bool) & kv.astype(jnp.bool_)) | ((q >= kv).astype(jnp.int32) == 0)
    ),
    "narrow table": lambda b, h, q, kv: TABLE[h, q % 4] > TABLE[h, kv % 4],
    "negative index wraps": lambda b, h, q, kv: DOC[b, q - 1] == DOC[b, kv],
    "row then column": lambda b, h, q, kv: DOC[b][q] == DOC[b][kv],
    "take and gathers": lambda b, h, q, kv: (
        (jnp.take(DOC[b], q - 2) == DOC.at[b, kv + 3].get(mode="fill", fill_value=-1))
        | (DOC.at[b, kv * 2].get(mode="clip") == 1)
    ),
    "slices and windows": lambda b, h, q, kv: (
        (DOC[b, 1:4][q] == kv % 4)
        | (lax.dynamic_slice(DOC[b], (q,), (3,))[kv % 3] == 2)
        | (DOC[b, jnp.arange(L)[kv - 1]] == 1)
    ),
    "nested calls": lambda b, h, q, kv: jax.checkpoint(_chunk)(q, kv) & _jitted_band(q, kv) & (jax.nn.relu(q - kv) < 3),
}


def test_programs_are_their_functions_over_the_grid() -> None:
    names = list(PROGRAMS)
    expected = _visible(lambda *indices: jnp.stack([PROGRAMS[name](*indices) for name in names]))  # one compile
    for number, name in enumerate(names):
        np.testing.assert_array_equal(_dense(PROGRAMS[name]), expected[..., number], err_msg=name)


def test_jnp_floor_division_and_remainder_are_one_node_each_and_python_ints_fold() -> None:
    chunk = 5
    expr, captured = jax_programs.trace(lambda b, h, q, kv: (q // chunk == kv // chunk) & ((q - kv) % 3 == 0))
    assert str(expr) == "(((q_idx // 5) == (kv_idx // 5)) & (((q_idx - kv_idx) % 3) == 0))"
    assert captured == []
    expr, captured = jax_programs.trace(PROGRAMS["document causal"])
    assert str(expr) == "((captured[0][b, q_idx] == captured[0][b, kv_idx]) & (q_idx >= kv_idx))"
    assert captured[0] is DOC


FLOATS = jnp.zeros((B, L))
NUMPY_DOC = np.asarray(DOC)


def _branches(b: Any, h: Any, q: Any, kv: Any) -> Any:
    if q >= kv:
        return True
    return False


@pytest.mark.parametrize(
    ("mask_mod", "message"),
    [
        (lambda b, h, q, kv: FLOATS[b, q] > 0, "captured an array of dtype float"),
        (_branches, "branched on a traced index in Python"),
        (lambda b, h, q, kv: jnp.sin(q) > 0, "primitive sin"),
        (lambda b, h, q, kv: jnp.left_shift(q, 1) > kv, "primitive shift_left"),
        (lambda b, h, q, kv: (q & kv) > 0, "applied & to an integer"),
        (lambda b, h, q, kv: q / 2 > kv, "float32"),
        (lambda b, h, q, kv: q - kv, "returned int32[]"),
        (lambda b, h, q, kv: NUMPY_DOC[q] == kv, "NumPy array"),
        (lambda b, h, q, kv: TABLE[h, q % 4] + 100 > 0, "add in int8"),
        (lambda b, h, q, kv: jnp.sum(DOC[b]) > q, "primitive reduce_sum"),
        (lambda q, kv: q >= kv, "four positional arguments"),
        (lambda b, h, q, kv: DOC[b, q] * 1_000_000_000 > kv, "32-bit integer range"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_what_a_program_cannot_contain_is_refused_naming_mask_mod(mask_mod: Any, message: str) -> None:
    with pytest.raises(MaskProgramError, match="mask_mod") as raised:
        _dense(mask_mod)
    assert message in str(raised.value)


def test_under_jit_a_closed_over_tracer_is_a_captured_slot() -> None:
    q = jnp.zeros((B, L, H, 8), jnp.float32)

    @jax.jit
    def visible(doc: Any) -> Any:
        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

        bound = attnkit.programs.bind(mask_mod, ops_for(q), q, B, H, L, L)
        assert isinstance(bound.captured[0], jax.core.Tracer)
        return dense(bound, B, H, L, L, like=q)

    for doc in (DOC, DOC[::-1]):  # the second call reuses the compiled function with new values
        expected = _visible(functools.partial(_document_causal, doc))
        np.testing.assert_array_equal(np.broadcast_to(np.asarray(visible(doc)), (B, H, L, L)), expected)


def _document_causal(doc: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)


def test_the_trace_is_reused_until_what_the_function_closes_over_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    traced: list[Any] = []
    real = jax_programs.trace
    monkeypatch.setattr(jax_programs, "trace", lambda function: traced.append(function) or real(function))
    doc = DOC
    chunk = 4

    def closure(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (doc[b, q] == doc[b, kv]) & (q // chunk == kv // chunk)

    framework = ops_for(DOC).framework
    first, captured = attnkit.programs.trace(closure, framework)
    again, captured_again = attnkit.programs.trace(closure, framework)
    assert again is first and captured_again[0] is captured[0] and len(traced) == 1
    doc = DOC + 1  # another array: traced again, the new array captured
    program, captured = attnkit.programs.trace(closure, framework)
    assert captured[0] is doc and len(traced) == 2
    chunk = 3  # another Python int: traced again, the new constant folded in
    program, _ = attnkit.programs.trace(closure, framework)
    assert "// 3" in str(program) and len(traced) == 3


def _random_program(seed: int) -> Callable[..., Any]:
    """A random mask_mod of jnp operations on the indices, constants and reads of DOC and WINDOW (constant nonzero
    divisors of both signs)."""
    draw = np.random.default_rng(seed)

    def integer(depth: int) -> Callable[..., Any]:
        if depth == 0 or draw.random() < 0.25:
            leaf = int(draw.integers(0, 6))
            if leaf < 4:
                return lambda *indices: indices[leaf]
            if leaf == 4:
                constant = int(draw.integers(-5, 6))
                return lambda *indices: jnp.int32(constant)
            row, column = integer(0), integer(0)
            return lambda *indices: DOC[row(*indices) % B, column(*indices)]
        a, b = integer(depth - 1), integer(depth - 1)
        divisor = int(draw.choice([-3, -2, 2, 3, 5]))
        choice = int(draw.integers(0, 10))
        condition = boolean(depth - 1) if choice == 8 else None
        operations: list[Callable[..., Any]] = [
            lambda *i: a(*i) + b(*i),
            lambda *i: a(*i) - b(*i),
            lambda *i: a(*i) * b(*i),
            lambda *i: a(*i) // divisor,
            lambda *i: a(*i) % divisor,
            lambda *i: lax.div(a(*i), jnp.int32(divisor)) - lax.rem(b(*i), jnp.int32(divisor)),
            lambda *i: jnp.minimum(a(*i), b(*i)) - jnp.maximum(a(*i), 1),
            lambda *i: jnp.abs(a(*i)) * jnp.sign(b(*i)),
            lambda *i: jnp.where(condition(*i), a(*i), b(*i)),  # type: ignore[misc]
            lambda *i: jnp.clip(a(*i), -2, WINDOW[i[1]]),
        ]
        return operations[choice]

    def boolean(depth: int) -> Callable[..., Any]:
        a, b = integer(depth), integer(depth)
        comparison = [jnp.equal, jnp.not_equal, jnp.less, jnp.less_equal, jnp.greater, jnp.greater_equal]
        compare = comparison[int(draw.integers(0, 6))]
        if depth == 0 or draw.random() < 0.4:
            return lambda *i: compare(a(*i), b(*i))
        left, right = boolean(depth - 1), boolean(depth - 1)
        joins = [jnp.logical_and, jnp.logical_or, jnp.logical_xor, lambda x, y: ~x | y]
        join = joins[int(draw.integers(0, 4))]
        return lambda *i: join(left(*i), right(*i))

    return boolean(3)


def test_random_programs_are_their_functions_over_the_grid() -> None:
    mask_mods = [_random_program(seed) for seed in range(16)]
    expected = _visible(lambda *indices: jnp.stack([mask_mod(*indices) for mask_mod in mask_mods]))
    for number, mask_mod in enumerate(mask_mods):
        np.testing.assert_array_equal(
            _dense(mask_mod), expected[..., number], err_msg=str(jax_programs.trace(mask_mod)[0])
        )


def test_tile_classes_in_jnp_are_sound_for_a_traced_program() -> None:
    # jnp computes value ranges in int32: a division's "unbounded" must fit it.
    mask_mod = PROGRAMS["chunked causal"]
    q = jnp.zeros((B, L, H, 8), jnp.float32)
    bound = attnkit.programs.bind(mask_mod, ops_for(q), q, B, H, L, L)
    block_q, block_k = 4, 3
    classes = np.asarray(jax.jit(lambda: tile_classes(bound, B, H, L, L, block_q, block_k, like=q))())
    visible = _visible(mask_mod)[0, 0]
    assert classes.shape == (1, 1, 4, 5) and (classes == FULL).any() and (classes == EMPTY).any()
    for tile_q, tile_k in np.ndindex(4, 5):
        tile = visible[tile_q * block_q : (tile_q + 1) * block_q, tile_k * block_k : (tile_k + 1) * block_k]
        assert {FULL: tile.all(), EMPTY: not tile.any()}.get(int(classes[0, 0, tile_q, tile_k]), True)
