"""attend() and explain(): validate a call, describe it as a Problem, dispatch it."""

from __future__ import annotations

from typing import Any

from attnkit import autotune, config, dispatch, empty_rows, op_calls, programs, spellings
from attnkit.backend import AttentionInputs, Backend, Problem, own_plain_call
from attnkit.call_cache import CACHE
from attnkit.errors import BackendUnavailableError, InvalidInputError
from attnkit.frontends import ops_by_type, ops_for
from attnkit.sinks import check_sinks, with_sinks
from attnkit.spec import AttentionSpec
from attnkit.validation import check_length_values, check_lengths_against_shapes, prepare

# The fast path's tables and the scope state they key on, bound once (attnkit/call_cache.py): at decode sizes an
# attribute read costs about as much as the rest of a cached call.
_cached_class = CACHE.length_classes.get
_cached_call = CACHE.calls.get
_scope_serial = CACHE.scope_serial
_ZERO_TYPES = (float, int)


def _routes_elsewhere(chosen: Backend, backend: str) -> bool:
    """After ``chosen`` raised BackendUnavailableError running a call: whether to dispatch the call again. Only under
    ``auto`` with nothing forced, and only if ``chosen`` now says it is unavailable (a build on first use that
    failed), which dispatch then remembers, so the next dispatch picks another backend."""
    return dispatch.became_unavailable(chosen) and backend == "auto" and config.forced_backend() is None


def attend(
    spec: AttentionSpec,
    q: Any,
    k: Any,
    v: Any = ...,  # required: a call without it, attend(q, k, v) as SDPA's, says what to write instead
    *,
    mask: Any = None,
    bias: Any = None,
    q_lengths: Any = None,
    kv_lengths: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: Any = None,
    alibi_slopes: Any = None,
    mask_mod: Any = None,
    dropout_p: float = 0,  # not 0.0: torch.compile(dynamic=True) traces a float default symbolically, then again
    dropout_seed: Any = None,
    dropout_key: Any = None,
    **peer_kwargs: Any,
) -> Any:
    """Attention as ``spec`` defines it (docs/semantics.md), on torch tensors or JAX arrays.

    Differentiable in q, k, v, ``bias`` and ``sinks`` (torch autograd; ``jax.grad`` and ``jax.jit``), through lse too.
    Every argument after v is a keyword.

    :param spec: what the call computes: causal and its alignment, window, scale, variant, softcap, layout.
    :param q: queries, (B, Hq, Lq, D) in layout ``"bhsd"``, (B, Lq, Hq, D) in ``"bshd"``, or (B, Lq, D) for one head
        (§1); a floating dtype that k and v share.
    :param k: keys, (B, Hkv, Lk, D) in ``"bhsd"``; Hq must be a multiple of Hkv (GQA, query head h reads kv head
        ``h // (Hq // Hkv)``, §2).
    :param v: values, (B, Hkv, Lk, Dv); Dv may differ from D.
    :param mask: boolean, broadcastable to (B, Hq, Lq, Lk); ``True`` means the query may see the key (§4.4). A float
        mask goes in ``bias``.
    :param bias: floating, broadcastable to (B, Hq, Lq, Lk), added to the scores after the softcap (§3);
        differentiable.
    :param q_lengths: integer (B,): query rows at or past the length are padding and output 0 (§4.3).
    :param kv_lengths: integer (B,): keys at or past the length are never seen; with bottom-right alignment each
        row's causal diagonal ends at its own last key (§4.3).
    :param q_segment_ids: integer (B, Lq), given with ``kv_segment_ids``: a query sees only keys of its own
        segment; a negative id is padding (§4.5).
    :param kv_segment_ids: integer (B, Lk), the keys' segment ids.
    :param return_lse: also return the log-sum-exp of each row's scores.
    :param backend: ``"auto"`` (the configured priority list) or a registered name; a named backend that cannot
        serve the call raises :class:`attnkit.BackendUnavailableError` with its reasons, never falling back
        silently.
    :param sinks: (Hq,), one learnable logit per query head joining every row's softmax (§15), differentiable; lse
        then includes it.
    :param alibi_slopes: float32 (Hq,) or (B, Hq), ALiBi's bias ``−slope · |i + off − j|`` on every score (§16),
        computed by the backend from positions; no gradient.
    :param mask_mod: a mask program (§17), ``fn(b, h, q_idx, kv_idx) -> bool`` as FlexAttention's mask_mod (JAX
        operations in a JAX call), ANDed with every other clause; traced once per function, evaluated by the backend
        in its tiles (or materialised, where ``explain`` says so), with empty tiles skipped.
    :param dropout_p: attention dropout (§18), 0 ≤ p < 1: each normalised probability is kept or dropped by a
        counter-based keep-mask of (batch row, query head, query, key) and the seed, the same on every backend,
        device and sharding, and kept ones are scaled by 1 / (1 − p); lse is the scores' before dropout. The
        backward regenerates the mask.
    :param dropout_seed: an int in [0, 2**64) (torch: also a 0-d int64 tensor; JAX: also a uint64 scalar or (2,)
        uint32 words); ``None`` draws one from torch's generator for q's device. (A call that computes part of a
        larger one, as attnkit.distributed's do, passes an attnkit.backend.Dropout: the seed with the indices where
        its heads, queries and keys start in the larger call.)
    :param dropout_key: a JAX PRNG key instead of a seed.
    :returns: ``out`` in q's dtype and layout, or ``(out, lse)`` with ``return_lse=True`` (lse: float32, float64 for
        float64 inputs; (B, Hq, Lq), or (B, Lq) for 3-D inputs). A query row that sees no key outputs 0 with lse −∞
        (§5).
    :raises attnkit.InvalidInputError: a shape, length value or argument combination the contract refuses (§11).
    :raises attnkit.InvalidInputTypeError: an argument of the wrong type or dtype.
    :raises attnkit.BackendUnavailableError: no backend (or not the named one) can serve the call.
    :raises attnkit.UnexpectedArgumentError: a call written as another library writes it (``attend(q, k, v)`` without a
        spec; ``is_causal=``, ``attn_mask=``, ``softmax_scale=``), or an unknown keyword: the message says what to write
        instead.
    """
    if type(spec) is not AttentionSpec or v is ... or peer_kwargs:
        raise spellings.call_error(attend, spec, {"v": v}, peer_kwargs, AttentionSpec)
    if sinks is not None:  # §15: the call without them, then the merge with each row's sink
        check_sinks(ops_for(q, "q"), spec, q, sinks)
        out, lse = attend(spec, q, k, v, mask=mask, bias=bias, q_lengths=q_lengths, kv_lengths=kv_lengths,
                          q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, return_lse=True,
                          backend=backend, alibi_slopes=alibi_slopes, mask_mod=mask_mod, dropout_p=dropout_p,
                          dropout_seed=dropout_seed, dropout_key=dropout_key)  # fmt: skip
        out, lse = with_sinks(spec, out, lse, sinks, q_lengths, q_segment_ids)
        return (out, lse) if return_lse else out
    # Fast path: a call whose metadata (types, shapes, dtypes, devices, grad flags) was validated and
    # dispatched before reuses that work; only length values, which are data, are checked again. At decode
    # sizes every function call and attribute read here costs about as much as the rest, hence the inline read
    # of the frontend table and the call cache's bound lookups (the scope is the only state in the key: a change
    # to the config or registry clears the cache).
    ops = ops_by_type.get(type(q)) or ops_for(q, "q")
    # First by length class, where the sequence lengths enter the key only by their class: a new length of a class
    # seen before (a KV cache growing one key a step, a new prompt length) is served as the first one was.
    class_key = None
    # A call with dropout takes the validating path every time: its seed is drawn or read per call.
    without_dropout = type(dropout_p) in _ZERO_TYPES and not dropout_p and dropout_seed is None and dropout_key is None
    if mask is None and bias is None and alibi_slopes is None and mask_mod is None and without_dropout:
        signature = ops.length_class_signature(spec, q, k, v, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)
        if signature is not None:
            class_key = (spec, signature, return_lse, backend, _scope_serial())
            try:
                served = _cached_class(class_key)
            except TypeError:  # an unhashable argument (backend=[...]): the checks below name it
                served = None
            if served is not None:
                _, runs, plain_call = served
                if plain_call is not None:  # stored only for a call with q, k, v alone that wants no lse
                    return plain_call(q, k, v)
                if q_lengths is not None or kv_lengths is not None:
                    check_lengths_against_shapes(ops, spec, q, k, q_lengths, kv_lengths)
                inputs = AttentionInputs(q, k, v, None, None, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)
                out, lse = runs(inputs)
                return (out, lse) if return_lse else out
    # A call with ALiBi slopes takes the validating path every time (their values are checked, §16), as does one with a
    # mask program (its captured tensors are bound to each call).
    signature = (
        ops.signature(q, k, v, mask, bias, q_lengths, kv_lengths)
        if alibi_slopes is None and mask_mod is None and without_dropout
        else None
    )
    if q_segment_ids is not None or kv_segment_ids is not None:
        signature = ops.segment_signature(signature, q_segment_ids, kv_segment_ids)
    if signature is not None:
        key = (spec, signature, return_lse, backend, _scope_serial())
        try:
            hit = _cached_call(key)
        except TypeError:  # an unhashable argument (backend=[...]): the checks below name it
            hit = None
        if hit is not None:
            problem, run, plain = hit
            if plain is not None:  # stored only for a call with q, k, v alone that wants no lse
                return plain(q, k, v)
            if q_lengths is not None or kv_lengths is not None:
                check_length_values(ops, problem, q_lengths, kv_lengths)
            inputs = AttentionInputs(q, k, v, mask, bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)
            out, lse = run(inputs)
            return (out, lse) if return_lse else out
    if ops.symbolic(q):  # traced by a compiler, or meta tensors: the framework's operator, dispatched where it runs
        from attnkit.frontends import torch_graph

        for name, given in (("alibi_slopes", alibi_slopes), ("mask_mod", mask_mod)):
            if given is not None:
                raise InvalidInputError(
                    f"{name} is not yet taken under torch.compile or on meta/fake tensors: call attend eagerly"
                )

        return torch_graph.attend(
            spec, q, k, v, mask, bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, return_lse, backend,
            dropout_p, dropout_seed, dropout_key,
        )  # fmt: skip
    epoch = CACHE.epoch  # before dispatch reads the config and registry: a clear after it stores nothing
    CACHE.full_paths += 1
    ops, problem, inputs, was_3d = prepare(
        spec, q, k, v, mask, bias, q_lengths, kv_lengths, return_lse, q_segment_ids, kv_segment_ids, alibi_slopes,
        mask_mod=mask_mod, dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_key=dropout_key,
    )  # fmt: skip
    if problem.len_q > problem.len_k and not (problem.has_q_lengths or problem.has_kv_lengths):
        empty_rows.say_once(spec, problem.len_q, problem.len_k)
    if mask_mod is not None:
        spec, inputs, problem = programs.band_apart(spec, inputs, problem)
    # An eager call with values: where the cost table cannot decide, auto may time the contenders on it.
    trial = autotune.Trial(ops, spec, problem, inputs) if backend == config.AUTO else None
    chosen, per_class = dispatch.select_call(spec, problem, backend, trial)
    run = ops.runner(chosen, spec, problem)
    try:
        out, lse = run(inputs)
    except BackendUnavailableError:
        if not _routes_elsewhere(chosen, backend):
            raise
        # (with the seed and offsets of this call, not a new seed)
        return attend(spec, q, k, v, mask=mask, bias=bias, q_lengths=q_lengths, kv_lengths=kv_lengths,
                      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, return_lse=return_lse,
                      backend=backend, alibi_slopes=alibi_slopes, mask_mod=mask_mod, dropout_p=dropout_p,
                      dropout_seed=inputs.dropout)  # fmt: skip
    # Remembered once it ran: a runner on the fast path has worked, so a backend that fails on first use (its build)
    # never sits there. By length class where the decision and the runner hold for the class, else by exact shape.
    if not was_3d:
        if class_key is not None and per_class:
            CACHE.remember(CACHE.length_classes, class_key, (chosen, run, own_plain_call(chosen, spec, problem)), epoch)
        elif signature is not None and inputs.mask is mask and inputs.bias is bias:
            CACHE.remember(CACHE.calls, key, (problem, run, own_plain_call(chosen, spec, problem)), epoch)
    if was_3d:
        out, lse = op_calls.as_3d(ops, spec, out, lse if return_lse else None)
    return (out, lse) if return_lse else out


def explain(
    spec: AttentionSpec,
    q: Any,
    k: Any,
    v: Any = ...,  # required, as attend's
    *,
    mask: Any = None,
    bias: Any = None,
    q_lengths: Any = None,
    kv_lengths: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    return_lse: bool = False,
    sinks: Any = None,
    alibi_slopes: Any = None,
    mask_mod: Any = None,
    dropout_p: float = 0,
    dropout_seed: Any = None,
    dropout_key: Any = None,
    **peer_kwargs: Any,
) -> str:
    """The dispatch table for a call, without running it: each backend, the one that would run, and why not. With
    ``sinks``, the call that runs without them and returns lse (§15's composition runs after it).

    Takes :func:`attend`'s arguments (everything but ``backend``), validated as attend validates them; nothing is
    computed or timed. docs/dispatch.md reads the table.

    :param spec: the call's spec.
    :param q: queries, as for :func:`attend`.
    :param k: keys, as for :func:`attend`.
    :param v: values, as for :func:`attend`.
    :param mask: as for :func:`attend`.
    :param bias: as for :func:`attend`.
    :param q_lengths: as for :func:`attend`.
    :param kv_lengths: as for :func:`attend`.
    :param q_segment_ids: as for :func:`attend`.
    :param kv_segment_ids: as for :func:`attend`.
    :param return_lse: as for :func:`attend`; whether the call wants lse enters the choice.
    :param sinks: as for :func:`attend`.
    :param alibi_slopes: as for :func:`attend`.
    :param mask_mod: as for :func:`attend`.
    :param dropout_p: as for :func:`attend`.
    :param dropout_seed: as for :func:`attend`.
    :param dropout_key: as for :func:`attend`.
    :returns: the spec, the problem, one row per registered backend (the selected one marked, each other with the
        reasons it cannot serve the call, predicted times where the cost table has them) and what decided.
    :raises attnkit.UnexpectedArgumentError: a call written as another library writes it (no spec; ``is_causal=``,
        ``attn_mask=``, ``softmax_scale=``), or an unknown keyword: the message says what to write instead.
    """
    if type(spec) is not AttentionSpec or v is ... or peer_kwargs:
        raise spellings.call_error(explain, spec, {"v": v}, peer_kwargs, AttentionSpec)
    if sinks is not None:
        check_sinks(ops_for(q, "q"), spec, q, sinks)
    ops, problem, inputs, _ = prepare(
        spec, q, k, v, mask, bias, q_lengths, kv_lengths, return_lse or sinks is not None, q_segment_ids,
        kv_segment_ids, alibi_slopes, mask_mod=mask_mod, dropout_p=dropout_p, dropout_seed=dropout_seed,
        dropout_key=dropout_key,
    )  # fmt: skip
    if mask_mod is not None:
        spec, inputs, problem = programs.band_apart(spec, inputs, problem)
    # A dry run: what measuring attend's call would do (or why it would not), never timing anything.
    return explain_problem(spec, problem, autotune.Trial(ops, spec, problem, inputs, dry_run=True))


def explain_problem(spec: AttentionSpec, problem: Problem, trial: autotune.Trial | None = None) -> str:
    rows = dispatch.candidates(spec, problem, trial)
    header = f"spec: {spec.model_dump_json(exclude_defaults=True)}\nproblem: {problem}"
    body = "\n".join(str(row) for row in rows)
    if not any(row.selected for row in rows):
        body += "\n(no backend can serve this call)"
    decided = dispatch.decision(spec, problem, trial)
    bucket = problem.at_bucket_lengths()
    if bucket != problem and any(row.predicted_us is not None for row in rows):  # one decision per bucket
        decided += f" (predictions are for the bucket's largest call, len_q={bucket.len_q}, len_k={bucket.len_k})"
    return f"{header}\n{body}\ndecided by: {decided}"
