"""Run a case on a backend in its own framework; results come back as float64 NumPy arrays."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from attnkit import api, registry
from attnkit.backend import Capabilities, Framework
from attnkit.testing.cases import Case

Results = dict[str, np.ndarray]
DIFFERENTIABLE = ("q", "k", "v", "bias")
OPTIONAL = ("mask", "bias", "q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids")


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
    optional = {name: arrays.get(name) for name in OPTIONAL}
    return api.attend(
        case.spec, arrays["q"], arrays["k"], arrays["v"], **optional, return_lse=return_lse, backend=backend
    )


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

    torch_dtype = getattr(torch, dtype or case.dtype)
    tensors: dict[str, Any] = {}
    for name, value in arrays.items():
        if name in ("q", "k", "v", "dout"):
            tensors[name] = torch.tensor(value, dtype=torch_dtype, device=device)
        elif name in ("bias", "dlse"):
            tensors[name] = torch.tensor(value, dtype=torch.float32 if name == "dlse" else torch_dtype, device=device)
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


def run_jax(case: Case, arrays: dict[str, np.ndarray], backend: str, dtype: str | None = None) -> Results:
    """attend() on JAX arrays through the public API, differentiated with jax.vjp."""
    import jax
    import jax.numpy as jnp

    jax_dtype = jnp.dtype(dtype or case.dtype)
    converted: dict[str, Any] = {}
    for name, value in arrays.items():
        if name in ("q", "k", "v", "dout", "bias"):
            converted[name] = jnp.asarray(value, dtype=jax_dtype)
        elif name == "dlse":
            converted[name] = jnp.asarray(value, dtype=jnp.float32)
        else:  # masks, and lengths as JAX makes integers: int32, or int64 under jax_enable_x64
            converted[name] = jnp.asarray(value)
    names = [name for name in DIFFERENTIABLE if name in converted and (name != "bias" or case.bias_grad)]
    fixed = {name: converted.get(name) for name in ("q", "k", "v", *OPTIONAL) if name not in names}

    def call(*differentiable: Any) -> tuple[Any, Any]:
        return _attend(case, {**fixed, **dict(zip(names, differentiable))}, backend)

    primals = [converted[name] for name in names]
    if case.grad:
        (out, lse), pullback = jax.vjp(call, *primals)
        grads = pullback((converted["dout"], converted["dlse"]))
        results = {"out": out, "lse": lse, **{"d" + name: grad for name, grad in zip(names, grads)}}
    else:
        out, lse = call(*primals)
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
    """attend() on ``backend`` in its native framework on :func:`harness_device`, with gradients when the case asks
    for them. (JAX places arrays on its default device, which is the GPU whenever JAX has one.)"""
    framework = native_framework(backend)
    if framework is Framework.TORCH:
        return run_torch(case, arrays, backend, device=harness_device(backend))
    return run_jax(case, arrays, backend)
