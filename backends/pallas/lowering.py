"""Lower every pallas kernel variant for a CUDA GPU, on a machine without one.

With ``jax-cuda13-plugin`` (the same version as jaxlib) installed, ``jax.jit(fn).trace(...).lower(
lowering_platforms=("cuda",))`` runs Pallas' Triton lowering of each kernel (the step that rejects what Triton
cannot express: shapes, dtypes, ops) and yields ``__gpu$xla.gpu.triton`` custom calls, with
``JAX_PLATFORMS=cpu``. What it does not run is Triton's own compile to PTX, which happens on the GPU.

Paged variants (``"paged": block_size``) lower the paged forward only (attend_paged has no backward); the decode
variants with long keys lower the split-K forward (a fourth grid axis). Mask-program variants (``"program"``, a
name of :func:`mask_programs`) lower the kernels that evaluate it on their tiles, reading its captured arrays by
gathers. Dropout variants (``"dropout"``: p) lower the kernels that regenerate the keep-mask, Philox4x32-10 in
uint32 (shifts, xor, multiplies, unsigned compares), from a traced seed and traced offsets.

``python -m attnkit.backends.pallas.lowering`` prints one JSON line per variant and pass:
``{"variant": ..., "pass": "forward"|"backward", "ok": bool, "targets": [...], "error": ...}``.
tests/test_pallas.py runs it in a subprocess (``JAX_PLATFORMS=cpu``) and checks every line.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from attnkit.backend import AttentionInputs, AttentionSpec, Dropout, PagedInputs
from attnkit.contract.programs import CapturedSpec, Expr, MaskProgram, const, index

TRITON_TARGET = "__gpu$xla.gpu.triton"


def variants() -> dict[str, dict[str, Any]]:
    """Each feature switch of the kernels, one at a time, at sizes that are not block multiples."""
    causal = AttentionSpec(causal=True)
    return {
        "causal bf16 GQA": {"spec": causal},
        "float32": {"spec": causal, "dtype": "float32"},
        "float16": {"spec": causal, "dtype": "float16"},
        "no mask": {"spec": AttentionSpec()},
        "top_left window": {"spec": AttentionSpec(window=(64, 16), causal_alignment="top_left")},
        "sliding causal": {"spec": AttentionSpec(causal=True, window=(128, 0))},
        "softcap": {"spec": AttentionSpec(causal=True, softcap=30.0)},
        "cosine": {"spec": AttentionSpec(variant="cosine")},
        "bshd": {"spec": AttentionSpec(causal=True, layout="bshd")},
        "bshd GQA bias": {"spec": AttentionSpec(layout="bshd"), "bias": (2, 4, 200, 300)},
        "mask": {"spec": AttentionSpec(), "mask": (2, 4, 200, 300)},
        "mask broadcast": {"spec": AttentionSpec(), "mask": (1, 1, 200, 300)},
        "bias dbias": {"spec": AttentionSpec(softcap=20.0), "bias": (1, 4, 200, 300)},
        "lengths": {"spec": causal, "lengths": True},
        "segment ids": {"spec": causal, "segment_ids": True},
        "segment ids, bias dbias, window": {
            "spec": AttentionSpec(window=(32, 8)),
            "segment_ids": True,
            "bias": (1, 4, 200, 300),
        },
        "alibi GQA, lengths": {"spec": causal, "alibi": (2, 4), "lengths": True},
        "alibi broadcast batch, softcap, bias dbias, top_left": {
            "spec": AttentionSpec(causal=True, causal_alignment="top_left", softcap=30.0),
            "alibi": (1, 4),
            "bias": (1, 4, 200, 300),
        },
        "alibi GQA 3:1, segment ids": {"spec": causal, "heads_q": 6, "alibi": (2, 6), "segment_ids": True},
        "MQA": {"spec": causal, "heads_kv": 1},
        "MHA": {"spec": causal, "heads_kv": 4},
        "GQA 3:1, B=3, mask per head": {"spec": causal, "batch": 3, "heads_q": 6, "mask": (3, 6, 200, 300)},
        "decode Lq=1": {"spec": causal, "len_q": 1},
        "head dim 40": {"spec": causal, "dim": 40, "dim_v": 40},
        "head dim 128, Dv 64": {"spec": causal, "dim": 128, "dim_v": 64},
        "head dim 256": {"spec": causal, "dim": 256, "dim_v": 256},
        "head dim 96, lengths on the tiles": {"spec": causal, "dim": 96, "dim_v": 96, "len_q": 256, "len_k": 256},
        "decode split-K": {"spec": causal, "len_q": 1, "len_k": 2048},
        "paged decode split-K, block 16": {"spec": AttentionSpec(causal=True, layout="bshd"), "len_q": 1, "paged": 16},
        "paged block 256, window softcap": {
            "spec": AttentionSpec(causal=True, window=(300, 0), softcap=30.0, layout="bshd"),
            "len_q": 4,
            "paged": 256,
        },
        "paged cosine float32 bhsd MQA": {
            "spec": AttentionSpec(variant="cosine"),
            "len_q": 3,
            "dtype": "float32",
            "heads_kv": 1,
            "paged": 32,
        },
        "mask program, document causal, GQA": {"spec": AttentionSpec(), "program": "document causal"},
        "mask program, every operation, bias dbias, lengths, bshd": {
            "spec": AttentionSpec(causal=True, layout="bshd"),
            "program": "every operation",
            "bias": (1, 4, 200, 300),
            "lengths": True,
        },
        "mask program, segment ids, mask, decode split-K": {
            "spec": AttentionSpec(),
            "program": "document causal",
            "segment_ids": True,
            "mask": (2, 1, 1, 2048),
            "len_q": 1,
            "len_k": 2048,
        },
        "dropout, GQA": {"spec": causal, "dropout": 0.1},
        "dropout, bias dbias, segment ids, bshd, head dim 128": {
            "spec": AttentionSpec(layout="bshd"),
            "dropout": 0.5,
            "bias": (1, 4, 200, 300),
            "segment_ids": True,
            "dim": 128,
            "dim_v": 128,
        },
        "dropout, decode split-K": {"spec": causal, "dropout": 0.1, "len_q": 1, "len_k": 2048},
        "paged decode split-K alibi, block 16": {
            "spec": AttentionSpec(causal=True, layout="bshd"),
            "len_q": 1,
            "paged": 16,
            "alibi": (2, 4),
        },
    }


def mask_programs() -> dict[str, MaskProgram]:
    """Programs for the lowering: document-causal (a 2-D read at (b, q) and (b, kv)), and one that uses every
    operation of the IR, reads at h, at b alone, at a 0-d tensor and of a boolean tensor."""
    b, h, q, kv = (index(name) for name in ("b", "h", "q", "kv"))

    def node(op: str, *args: Expr, kind: str = "int") -> Expr:
        return Expr(op, args, kind=kind)

    def read(slot: int, *at: Expr, kind: str = "int") -> Expr:
        return Expr("read", at, value=slot, kind=kind)

    same_document = node("eq", read(0, b, q), read(0, b, kv), kind="bool")
    document_causal = node("and", same_document, node("ge", q, kv, kind="bool"), kind="bool")
    chunk = const(24)
    same_chunk = node("eq", node("floordiv", q, chunk), node("floordiv", kv, chunk), kind="bool")
    prefix = node("lt", kv, read(1, b), kind="bool")
    distance = node("abs", node("sub", q, kv))
    pattern = node("ne", node("mod", distance, const(7)), node("trem", node("neg", q), const(5)), kind="bool")
    spread = node("sub", node("max", q, kv), node("min", q, kv))
    near = node("le", spread, node("add", node("tdiv", read(2), const(3)), node("mul", h, const(2))), kind="bool")
    choice = node("where", node("gt", read(3, h), const(0), kind="bool"), node("or", same_chunk, prefix, kind="bool"),
                  node("xor", pattern, near, kind="bool"), kind="bool")  # fmt: skip
    alive = node("not", read(4, b, q, kind="bool"), kind="bool")
    everything = node("and", node("and", choice, alive, kind="bool"), node("bool", node("int", alive)), kind="bool")
    documents = CapturedSpec((2, 300), "int32")
    return {
        "document causal": MaskProgram(document_causal, (documents,)),
        "every operation": MaskProgram(
            everything,
            (
                documents,
                CapturedSpec((2,), "int32"),
                CapturedSpec((), "int32"),
                CapturedSpec((4,), "int32"),
                CapturedSpec((2, 300), "bool"),
            ),
        ),
    }


def passes(variant: dict[str, Any]) -> tuple[str, ...]:
    """The programs a variant lowers: attend_paged is forward only."""
    return ("forward",) if "paged" in variant else ("forward", "backward")


def lower(
    spec: AttentionSpec,
    *,
    batch: int = 2,
    heads_q: int = 4,
    heads_kv: int = 2,
    len_q: int = 200,
    len_k: int = 300,
    dim: int = 64,
    dim_v: int = 64,
    dtype: str = "bfloat16",
    mask: tuple[int, ...] | None = None,
    bias: tuple[int, ...] | None = None,
    lengths: bool = False,
    segment_ids: bool = False,
    alibi: tuple[int, ...] | None = None,
    paged: int | None = None,
    program: str | None = None,
    dropout: float | None = None,
) -> dict[str, list[str]]:
    """Custom-call targets of the forward and backward programs lowered for CUDA, by pass; with ``paged`` (a block
    size), of attend_paged's forward over a cache of ``len_k`` keys per sequence. ``alibi``: the shape of ALiBi's
    slopes, (B|1, Hq); ``program``: a name of :func:`mask_programs` (its captured arrays sized for these shapes);
    ``dropout``: p, with the seed's words and the offsets traced."""
    import jax
    import jax.numpy as jnp

    from .backend import PallasBackend

    if paged is not None:
        return _lower_paged(spec, batch, heads_q, heads_kv, len_q, len_k, dim, dim_v, dtype, paged, alibi)

    def shape(heads: int, length: int, d: int) -> tuple[int, ...]:
        return (batch, length, heads, d) if spec.layout.value == "bshd" else (batch, heads, length, d)

    array = jax.ShapeDtypeStruct
    q = array(shape(heads_q, len_q, dim), jnp.dtype(dtype))
    k = array(shape(heads_kv, len_k, dim), jnp.dtype(dtype))
    v = array(shape(heads_kv, len_k, dim_v), jnp.dtype(dtype))
    length_array = array((batch,), jnp.int32) if lengths else None
    inputs = AttentionInputs(
        q,
        k,
        v,
        None if mask is None else array(mask, jnp.bool_),
        None if bias is None else array(bias, jnp.float32),
        length_array,
        length_array,
        array((batch, len_q), jnp.int32) if segment_ids else None,
        array((batch, len_k), jnp.int32) if segment_ids else None,
        None if alibi is None else array(alibi, jnp.float32),
        None if program is None else _bound_program(program, batch, len_k),
        None if dropout is None else Dropout(dropout, *(array(shape, jnp.uint32) for shape in ((2,), (), (), ()))),
    )
    forward, backward, config, params, band, inputs = PallasBackend(interpret=False)._call(spec, inputs)
    out = array((*q.shape[:-1], dim_v), q.dtype)
    lse = array((batch, heads_q, len_q), jnp.float32)
    programs = {
        "forward": forward.trace(config, params, band, inputs),
        "backward": backward.trace(config, bias is not None, params, band, inputs, out, lse, out, lse),
    }
    return {name: _targets(traced) for name, traced in programs.items()}


def _bound_program(name: str, batch: int, len_k: int) -> Any:
    """The named program bound to int32 arrays as shapes: a captured (2, 300) one becomes (batch, len_k)."""
    import jax
    import jax.numpy as jnp

    from attnkit.contract.programs import BoundProgram

    program = mask_programs()[name]
    wide = (2, 300)
    shapes = [(batch, len_k) if spec.shape == wide else spec.shape for spec in program.captured]
    specs = tuple(CapturedSpec(shape, spec.dtype) for shape, spec in zip(shapes, program.captured))
    program = MaskProgram(program.expr, specs, name)
    return BoundProgram(program, tuple(jax.ShapeDtypeStruct(shape, jnp.int32) for shape in shapes))


def _targets(traced: Any) -> list[str]:
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    return sorted(set(re.findall(r"custom_call @([\w$.]+)", text)))


def _lower_paged(
    spec: AttentionSpec, batch: int, heads_q: int, heads_kv: int, len_q: int, len_k: int, dim: int, dim_v: int,
    dtype: str, block_size: int, alibi: tuple[int, ...] | None,
) -> dict[str, list[str]]:  # fmt: skip
    import jax
    import jax.numpy as jnp

    from .backend import _compiled_paged, _paged_config, _scalars

    array = jax.ShapeDtypeStruct
    max_blocks = -(-len_k // block_size)
    num_blocks = batch * max_blocks + 1
    q_shape = (batch, len_q, heads_q, dim) if spec.layout.value == "bshd" else (batch, heads_q, len_q, dim)
    inputs = PagedInputs(
        array(q_shape, jnp.dtype(dtype)),
        array((num_blocks, block_size, heads_kv, dim), jnp.dtype(dtype)),
        array((num_blocks, block_size, heads_kv, dim_v), jnp.dtype(dtype)),
        array((batch, max_blocks), jnp.int32),
        array((batch,), jnp.int32),
        None if alibi is None else array(alibi, jnp.float32),
    )
    static = _paged_config(spec, len_q, block_size, max_blocks, max(dim, dim_v), False, batch * heads_q, None)
    params, band = _scalars(spec, dim)
    return {"forward": _targets(_compiled_paged().trace(static, params, band, inputs))}


def main() -> int:
    failures = 0
    for name, variant in variants().items():
        options = dict(variant)
        spec = options.pop("spec")
        try:
            targets = lower(spec, **options)
        except Exception as error:  # reported per variant, so one failure does not hide the others
            failures += 1
            message = f"{type(error).__name__}: {error}"[:2000]
            for kernel_pass in passes(variant):
                print(json.dumps({"variant": name, "pass": kernel_pass, "ok": False, "targets": [], "error": message}))
            continue
        for kernel_pass, found in targets.items():
            ok = TRITON_TARGET in found
            failures += not ok
            print(json.dumps({"variant": name, "pass": kernel_pass, "ok": ok, "targets": found, "error": None}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
