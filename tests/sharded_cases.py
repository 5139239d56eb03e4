"""Cases for the context-parallel tests (tests/test_distributed_torch.py, tests/test_distributed_jax.py): cases drawn
by attnkit.testing.strategies, made shardable over P ranks, and drawn in the test's own process (the sharded calls run
in children)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from attnkit.contract.programs import Expr, const, index
from attnkit.testing.cases import Case
from attnkit.testing.programs import ProgramCase, Table
from attnkit.testing.strategies import cases, segment_ids

T = TypeVar("T")

# Not float64 (a known limit of the merge, not of a case): a block's lse is float32 (§6), so the merge's weights
# exp(lse_s − lse) carry float32 rounding and a float64 sharded call agrees with the oracle to ~2e-7, far outside
# float64's tolerance.
SHARDED_DTYPES = ("float32", "float16", "bfloat16")
#: Drawn cases per test: a few under the ``ci`` profile (CI's budget), more the more examples the profile runs.
DRAWN = max(2, settings().max_examples // 8)


def document_causal(batch: int, length: int) -> ProgramCase:
    """Packed documents (drawn ids per batch row), causal within each: mask_mod reads the ids at global positions."""
    same = Expr(
        "eq", (Expr("read", (index("b"), index("q")), 0), Expr("read", (index("b"), index("kv")), 0)), kind="bool"
    )
    causal = Expr("ge", (index("q"), index("kv")), kind="bool")
    return ProgramCase(Expr("and", (same, causal), kind="bool"), (Table((batch, length), "documents"),))


def chunked_per_head() -> ProgramCase:
    """Chunked attention with chunks of h + 2 positions (Ulysses hands each rank its own heads): chunk edges fall
    inside shards and across them."""
    size = Expr("add", (index("h"), const(2)))
    chunk_q, chunk_kv = Expr("floordiv", (index("q"), size)), Expr("floordiv", (index("kv"), size))
    return ProgramCase(Expr("eq", (chunk_q, chunk_kv), kind="bool"), ())


@st.composite
def shardable_cases(draw: st.DrawFn, world: int, dtypes: Iterable[str], mask_and_bias: bool, three_d: bool) -> Case:
    """A case drawn by attnkit.testing.strategies.cases, made shardable over ``world`` ranks: Lq and Lk stretched to
    the next multiple of 2P (zigzag's chunk count; contiguous needs P) with the mask and bias shapes following and the
    segment ids drawn again for them; mask and bias dropped, 3-D inputs refused, where the caller says the call takes
    none; without mask or bias and 4-D, the heads multiplied by P so that Ulysses serves the case too (ALiBi slopes,
    drawn as attend's, following them)."""
    drawn = cases(dtypes=dtypes, max_len=16)
    case = draw(drawn if three_d else drawn.filter(lambda case: not case.three_d))
    if not mask_and_bias:
        case = case.with_(mask_shape=None, masked_rows=(), bias_shape=None, bias_grad=False)
    unit = 2 * world
    len_q, len_k = (unit * -(-length // unit) for length in (case.len_q, case.len_k))

    def stretched(shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return None if shape is None else (*shape[:-2], 1 if shape[-2] == 1 else len_q, len_k)

    ids = (case.q_segment_ids, case.kv_segment_ids)
    if case.q_segment_ids is not None:
        ids = draw(segment_ids(case.batch, len_q, len_k))
    heads = world if case.mask_shape is None and case.bias_shape is None and not case.three_d else 1
    slopes = None if case.alibi_shape is None else (*case.alibi_shape[:-1], case.heads_q * heads)  # one per head
    return case.with_(len_q=len_q, len_k=len_k, mask_shape=stretched(case.mask_shape),
                      bias_shape=stretched(case.bias_shape), q_segment_ids=ids[0], kv_segment_ids=ids[1],
                      heads_q=case.heads_q * heads, heads_kv=case.heads_kv * heads, alibi_shape=slopes)  # fmt: skip


def examples(strategy: st.SearchStrategy[T], count: int = DRAWN) -> list[T]:
    """``count`` examples of ``strategy`` (fewer where it has fewer), the same on every run under the derandomised
    ``ci`` profile."""
    drawn: list[T] = []

    @settings(max_examples=count, database=None, phases=[Phase.generate])
    @given(strategy)
    def collect(example: T) -> None:
        drawn.append(example)

    collect()
    return drawn
