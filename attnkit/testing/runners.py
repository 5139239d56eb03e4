"""Run a case on a backend in its own framework; results come back as float64 NumPy arrays."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from attnkit import api, empty_rows, ragged, registry
from attnkit.backend import Capabilities, Framework
from attnkit.testing.cases import Case, program_table
from attnkit.testing.programs import program_function

Results = dict[str, np.ndarray]
DIFFERENTIABLE = ("q", "k", "v", "bias", "sinks")
#: Inputs in the case's dtype (an attend_paged case's caches too); dlse is lse's (float32, float64 for float64 calls),
#: the rest integer or boolean.
FLOATING_INPUTS = ("q", "k", "v", "dout", "bias", "k_cache", "v_cache", "sinks")
OPTIONAL = ("mask", "bias", "q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids", "sinks", "alibi_slopes")


def harness_device(backend: str) -> str:
    """Where the harness runs ``backend``: on the accelerator when the backend declares one and this machine has it,
    else on the CPU. So ``attnkit check`` on a GPU machine checks the GPU kernels users will run there."""
    declared = registry.get_backend(backend).capabilities.devices
    if "cuda" not in declared:
        return "cpu"
    if native_framework(backend) is Framework.TORCH:
        import torch

        on_gpu = torch.cuda.is_available()
    else:
        import jax

        on_gpu = jax.default_backend() == "gpu"
    return "cuda" if on_gpu or "cpu" not in declared else "cpu"


def _attend(case: Case, arrays: dict[str, Any], backend: str, return_lse: bool = True) -> Any:
    """attend() on the case's arrays (q, k, v and whichever optional ones it has), with the log-sum-exp unless not
    ``return_lse``."""
    optional: dict[str, Any] = {name: arrays.get(name) for name in OPTIONAL}
    with empty_rows.intended():  # cases draw rows that see no key on purpose
        return api.attend(
            case.spec, arrays["q"], arrays["k"], arrays["v"], **optional, return_lse=return_lse, backend=backend,
            mask_mod=mask_mod_of(case, arrays), **dropout_of(case),
        )  # fmt: skip


def dropout_of(case: Case) -> dict[str, Any]:
    """The case's dropout as attend's keyword arguments (none without it)."""
    if case.dropout is None:
        return {}
    p, seed = case.dropout
    return {"dropout_p": p, "dropout_seed": seed}


def mask_mod_of(case: Case, arrays: dict[str, Any]) -> Callable[..., Any] | None:
    """The case's program as the mask_mod a user passes, closing over its tables in the call's framework."""
    if case.program is None:
        return None
    tables = [arrays[program_table(slot)] for slot in range(len(case.program.tables))]
    framework = "torch" if type(arrays["q"]).__module__.startswith("torch") else "jax"
    return program_function(case.program, tables, framework)


def _offsets(lengths: tuple[int, ...]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _framework_of(x: Any) -> tuple[Callable[[np.ndarray], Any], Callable[..., Any]]:
    """(NumPy array -> array of x's framework on x's device, where) for x a torch tensor or a JAX array."""
    if type(x).__module__.startswith("torch"):
        import torch

        return (lambda a: torch.as_tensor(a, device=x.device)), torch.where
    import jax.numpy as jnp

    return jnp.asarray, jnp.where


def _varlen(case: Case, arrays: dict[str, Any], backend: str, return_lse: bool = True) -> Any:
    """attend_varlen on the case's arrays packed (§12), its results laid out as the case's attend call's: the
    packed row itself (self-packed without dropout), or the padded batch with zeros in out and −inf in lse past each
    length."""
    assert case.varlen is not None
    as_array, where = _framework_of(arrays["q"])
    q_lengths, kv_lengths = case.varlen.q_lengths, case.varlen.kv_lengths
    cu_q, cu_k = as_array(_offsets(q_lengths)), as_array(_offsets(kv_lengths))
    if case.varlen.self_packed and case.dropout is None:
        q, k, v = (arrays[name][0] for name in ("q", "k", "v"))
        result = ragged.attend_varlen(case.spec, q, k, v, cu_q, cu_q, return_lse=return_lse, backend=backend,
                                      sinks=arrays.get("sinks"), alibi_slopes=arrays.get("alibi_slopes"))  # fmt: skip
        return (result[0][None], result[1][None]) if return_lse else result[None]

    def pack(x: Any, lengths: tuple[int, ...]) -> Any:  # the padded batch's real rows, sequence after sequence
        sequence = np.repeat(np.arange(len(lengths)), lengths)
        position = np.arange(sum(lengths)) - np.repeat(_offsets(lengths)[:-1], lengths)
        return x[as_array(sequence), as_array(position)]

    q, k, v = pack(arrays["q"], q_lengths), pack(arrays["k"], kv_lengths), pack(arrays["v"], kv_lengths)
    out, lse = ragged.attend_varlen(case.spec, q, k, v, cu_q, cu_k, return_lse=True, backend=backend,
                                    sinks=arrays.get("sinks"), alibi_slopes=arrays.get("alibi_slopes"),
                                    **dropout_of(case))  # fmt: skip
    # Position (b, t) of the padded batch is packed row cu_q[b] + t, for t < q_lengths[b].
    positions = np.arange(case.len_q)[None, :]
    real = positions < np.asarray(q_lengths)[:, None]
    packed_row = as_array(np.where(real, _offsets(q_lengths)[:-1, None] + positions, 0))
    real = as_array(real)
    padded_out = where(real[:, :, None, None], out[packed_row], 0.0)
    if not return_lse:
        return padded_out
    return padded_out, where(real[:, None, :], lse[:, packed_row].swapaxes(0, 1), -np.inf)


def _paged(case: Case, arrays: dict[str, Any], backend: str, return_lse: bool = True) -> Any:
    """attend_paged on the case's cache and block table (§13)."""
    return ragged.attend_paged(
        case.spec, arrays["q"], arrays["k_cache"], arrays["v_cache"], arrays["block_table"], arrays["kv_lengths"],
        return_lse=return_lse, backend=backend, sinks=arrays.get("sinks"), alibi_slopes=arrays.get("alibi_slopes"),
    )  # fmt: skip


def call_of(case: Case) -> Callable[..., Any]:
    """How a backend is called on ``case``: attend_varlen or attend_paged where the case is one of those calls, else
    attend. Each takes what :func:`_attend` takes and returns results laid out as the case's attend call's."""
    if case.varlen is not None:
        return _varlen
    if case.paged is not None:
        return _paged
    return _attend


def run_torch(
    case: Case,
    arrays: dict[str, np.ndarray],
    backend: str,
    dtype: str | None = None,
    device: str = "cpu",
    return_lse: bool = True,
    call: Callable[..., Any] | None = None,
) -> Results:
    """attend() on torch tensors on ``device`` through the public API, with autograd; ``dtype`` overrides the case's.

    ``return_lse=False``: the call without lse (a backend may take another path for it), gradients from ``dout``
    alone; the results then hold no lse. ``call`` stands in for the attend call, taking what :func:`_attend` takes
    (a compiled one, say)."""
    import torch

    from attnkit.contract.torch import compute_dtype

    torch_dtype = getattr(torch, dtype or case.dtype)
    tensors: dict[str, Any] = {}
    for name, value in arrays.items():
        if name in FLOATING_INPUTS:
            tensors[name] = torch.tensor(value, dtype=torch_dtype, device=device)
        elif name == "dlse":
            tensors[name] = torch.tensor(value, dtype=compute_dtype(torch_dtype), device=device)  # lse's own (§6)
        else:
            tensors[name] = torch.tensor(value, device=device)
    leaves = [tensors[name] for name in DIFFERENTIABLE if name in tensors]
    if case.grad:
        for name in DIFFERENTIABLE:
            if name in tensors and (name != "bias" or case.bias_grad):
                tensors[name].requires_grad_(True)
    attend = call or _attend
    if return_lse:
        out, lse = attend(case, tensors, backend)
        results = {"out": out, "lse": lse}
        outputs, cotangents = [out, lse], [tensors["dout"], tensors["dlse"]]
    else:
        results = {"out": attend(case, tensors, backend, return_lse=False)}
        outputs, cotangents = [results["out"]], [tensors["dout"]]
    if case.grad:
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        grads = torch.autograd.grad(outputs, wanted, cotangents, allow_unused=True)
        names = [name for name in DIFFERENTIABLE if name in tensors and tensors[name].requires_grad]
        for name, grad, leaf in zip(names, grads, wanted):
            results["d" + name] = grad if grad is not None else torch.zeros_like(leaf)
    return {name: value.detach().double().cpu().numpy() for name, value in results.items()}


def run_jax(
    case: Case,
    arrays: dict[str, np.ndarray],
    backend: str,
    dtype: str | None = None,
    call: Callable[..., Any] | None = None,
) -> Results:
    """attend() on JAX arrays through the public API, differentiated with jax.vjp; ``call`` as for :func:`run_torch`."""
    import jax
    import jax.numpy as jnp

    jax_dtype = jnp.dtype(dtype or case.dtype)
    converted: dict[str, Any] = {}
    for name, value in arrays.items():
        if name in FLOATING_INPUTS:
            converted[name] = jnp.asarray(value, dtype=jax_dtype)
        elif name == "dlse":
            converted[name] = jnp.asarray(value, dtype=jnp.float64 if jax_dtype == jnp.float64 else jnp.float32)
        else:  # masks, float32 ALiBi slopes, and lengths as JAX makes integers: int32, or int64 under x64
            converted[name] = jnp.asarray(value)
    names = [name for name in DIFFERENTIABLE if name in converted and (name != "bias" or case.bias_grad)]
    fixed = {name: value for name, value in converted.items() if name not in names}
    attend = call or _attend

    def attend_on(*differentiable: Any) -> tuple[Any, Any]:
        return attend(case, {**fixed, **dict(zip(names, differentiable))}, backend)  # type: ignore[no-any-return]

    primals = [converted[name] for name in names]
    if case.grad:
        (out, lse), pullback = jax.vjp(attend_on, *primals)
        grads = pullback((converted["dout"], converted["dlse"]))
        results = {"out": out, "lse": lse, **{"d" + name: grad for name, grad in zip(names, grads)}}
    else:
        out, lse = attend_on(*primals)
        results = {"out": out, "lse": lse}
    return {name: np.asarray(value, dtype=np.float64) for name, value in results.items()}


def native_framework(backend: str) -> Framework:
    """The framework a backend is run in by the harness: the one its capabilities name as native (a backend written
    for JAX that also bridges torch tensors), else torch where it takes torch tensors, else JAX."""
    capabilities = registry.get_backend(backend).capabilities
    if capabilities.native_framework is not None:
        return capabilities.native_framework
    return Framework.TORCH if Framework.TORCH in capabilities.frameworks else Framework.JAX


def harness_capabilities(backend: str) -> Capabilities:
    """What ``backend`` declares on :func:`harness_device`, where the harness runs it: the cases drawn for it."""
    return registry.get_backend(backend).capabilities.on(harness_device(backend))


def drawable_dtypes(backend: str, x64_per_case: bool = False) -> tuple[str, ...]:
    """Every dtype ``backend`` declares on the harness's device, as the harness draws them: float64 for a backend run
    in JAX only while jax_enable_x64 is on (JAX has no float64 array otherwise; the suite turns it on for its own x64
    run), or always with ``x64_per_case``, for a caller that runs each case inside :func:`dtype_scope`
    (``attnkit check``)."""
    declared = harness_capabilities(backend).dtypes
    if "float64" in declared and not x64_per_case and native_framework(backend) is Framework.JAX:
        import jax

        if not jax.config.read("jax_enable_x64"):
            declared = declared - {"float64"}
    return tuple(sorted(declared))


def dtype_scope(backend: str, dtype: str) -> AbstractContextManager[Any]:
    """What a ``dtype`` case on ``backend`` runs inside: jax_enable_x64 turned on for a float64 case of a backend run
    in JAX, for that case alone (a scoped setting, restored after), so no other case, of this backend or another, runs
    under it; nothing otherwise."""
    if dtype == "float64" and native_framework(backend) is Framework.JAX:
        import jax

        return jax.enable_x64(True)  # type: ignore[no-any-return]
    return contextlib.nullcontext()


def run_backend(case: Case, arrays: dict[str, np.ndarray], backend: str) -> Results:
    """The case's call (:func:`call_of`) on ``backend`` in its native framework on :func:`harness_device`, with
    gradients when the case asks for them. (JAX places arrays on its default device, the GPU whenever JAX has one.)"""
    framework = native_framework(backend)
    if framework is Framework.TORCH:
        return run_torch(case, arrays, backend, device=harness_device(backend), call=call_of(case))
    return run_jax(case, arrays, backend, call=call_of(case))
