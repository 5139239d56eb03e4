"""Agreement with the float64 oracle, under the tolerance rule of docs/testing.md.

Rule (after flash-attn's tests): for every output (out, lse, dq, dk, dv, dbias),

    max|backend − oracle64|  ≤  2 · max|oracle@dtype − oracle64|  +  floor,
    floor = (eps(dtype) + FLOOR_ULPS · eps(accumulation)) · max(1, max|oracle64|)

(accumulation is float64 for float64 inputs, else float32: one rounding of the result to the
input's dtype plus the reordering noise of float32 sums).

where oracle64 is torch-naive in float64 on the inputs already rounded to the case's dtype, and
oracle@dtype is the same literal algorithm computed in the input's own dtype (no upcast). Beyond that,
structure must match exactly: lse is −inf exactly where the oracle's is, and no NaN/Inf appears
anywhere the oracle is finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnkit import registry
from attnkit.testing.cases import Case, make_arrays, program_table
from attnkit.testing.programs import dense_by_calling, program_function
from attnkit.testing.runners import (
    FLOATING_INPUTS,
    Results,
    dropout_of,
    harness_device,
    native_framework,
    run_backend,
    run_torch,
)

FLOOR_ULPS = 32
ORACLE = "torch-naive"
_EPS = {
    "float64": float(np.finfo(np.float64).eps),
    "float32": float(np.finfo(np.float32).eps),
    "float16": float(np.finfo(np.float16).eps),
    "bfloat16": 2.0**-7,
}


@dataclass(frozen=True)
class Comparison:
    output: str
    error: float
    allowed: float

    @property
    def ratio(self) -> float:
        """error / allowed: at most 1 passes."""
        if self.error == 0:
            return 0.0
        return self.error / self.allowed if self.allowed > 0 else float("inf")

    @property
    def ok(self) -> bool:
        return self.error <= self.allowed

    def __str__(self) -> str:
        return f"{self.output}: error {self.error:.3g} allowed {self.allowed:.3g} (ratio {self.ratio:.2f})"


class DisagreementError(AssertionError):
    """A backend disagrees with the float64 oracle beyond the tolerance rule."""


def rounded(case: Case, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs as the case's dtype holds them (back in float64), so every backend and the oracle see equal values."""
    import torch

    result = dict(arrays)
    for name in FLOATING_INPUTS:
        if name in arrays:
            result[name] = torch.tensor(arrays[name]).to(getattr(torch, case.dtype)).double().numpy()
    if "dlse" in arrays:
        result["dlse"] = arrays["dlse"].astype(np.float32).astype(np.float64)
    return result


def oracle_results(case: Case, arrays: dict[str, np.ndarray]) -> tuple[Results, Results]:
    """(oracle64, oracle at the input's own dtype) for rounded inputs. A case with sinks gets both from the oracle's
    literal function (the sink as a logit column, §15), not through attend, which composes sinks for every backend.
    A case with a mask program gives the oracle the mask the program's function gives when called on index tensors
    (ANDed with the case's own mask), not the program."""
    if case.program is not None:
        case, arrays = _program_as_mask(case, arrays)

    def oracle64(arrays: dict[str, np.ndarray]) -> Results:
        if case.sinks:
            return _literal(case.with_(dtype="float64"), arrays)
        return run_torch(case.with_(dtype="float64"), arrays, ORACLE)

    exact = oracle64(arrays)
    if case.dtype == "float64":
        return exact, exact
    baseline = _literal(case, arrays)
    if case.grad and "dlse" in arrays and case.dtype in ("float16", "bfloat16"):
        # A flash backward takes Δ = rowsum(dO ⊙ O) from O as returned, rounded to the dtype (FlashAttention-2, SDPA's
        # kernels, cuDNN): that rounding, exact otherwise, is a gradient's baseline where it errs more than the
        # literal algorithm (docs/testing.md, "The tolerance rule").
        flash = oracle64({**arrays, "dlse": arrays["dlse"] - _delta_rounding(case, arrays, exact["out"])})
        for name in (name for name in exact if name.startswith("d") and name in flash and name in baseline):
            if _max_error(flash[name], exact[name]) > _max_error(baseline[name], exact[name]):
                baseline[name] = flash[name]
    return exact, baseline


def _delta_rounding(case: Case, arrays: dict[str, np.ndarray], out: np.ndarray) -> np.ndarray:
    """rowsum(dO ⊙ (round(O) − O)), in lse's shape: what rounding the output to the case's dtype adds to Δ."""
    import torch

    rounded = torch.from_numpy(out).to(getattr(torch, case.dtype)).double().numpy()
    error = (arrays["dout"] * (rounded - out)).sum(axis=-1)
    return error if error.shape == arrays["dlse"].shape else np.swapaxes(error, -1, -2)


def _program_as_mask(case: Case, arrays: dict[str, np.ndarray]) -> tuple[Case, dict[str, np.ndarray]]:
    import torch

    assert case.program is not None
    tables = [torch.as_tensor(arrays[program_table(slot)]) for slot in range(len(case.program.tables))]
    heads = 1 if case.three_d else case.heads_q
    visible = dense_by_calling(program_function(case.program, tables), case.batch, heads, case.len_q, case.len_k)
    if case.three_d:
        visible = visible[:, 0]
    if "mask" in arrays:
        visible = visible & arrays["mask"]
    return case.with_(program=None, mask_shape=visible.shape), {**arrays, "mask": visible}


def _literal(case: Case, arrays: dict[str, np.ndarray]) -> Results:
    """The oracle's literal function at the case's dtype, called directly (not through attend), with gradients."""
    import torch

    from attnkit.backends.reference.torch_naive import oracle_attention
    from attnkit.validation import prepare

    dtype = getattr(torch, case.dtype)
    floating = ("q", "k", "v", "bias", "sinks")
    tensors = {
        name: torch.tensor(value, dtype=dtype) if name in floating else torch.tensor(value)
        for name, value in arrays.items()
        if name not in ("dout", "dlse", "k_cache", "v_cache", "block_table")
    }
    names = [name for name in floating if name in tensors and (name != "bias" or case.bias_grad)]
    for name in names:
        tensors[name].requires_grad_(True)
    _, _, inputs, was_3d = prepare(
        case.spec,
        tensors["q"],
        tensors["k"],
        tensors["v"],
        tensors.get("mask"),
        tensors.get("bias"),
        tensors.get("q_lengths"),
        tensors.get("kv_lengths"),
        True,
        tensors.get("q_segment_ids"),
        tensors.get("kv_segment_ids"),
        tensors.get("alibi_slopes"),
        **dropout_of(case),
    )
    out, lse = oracle_attention(case.spec, inputs, dtype, tensors.get("sinks"))
    if was_3d:
        out = out.reshape(tensors["q"].shape[:-1] + (out.shape[-1],))
        lse = lse.reshape(lse.shape[0], lse.shape[2])
    results = {"out": out, "lse": lse}
    if case.grad:
        dout = torch.tensor(arrays["dout"], dtype=dtype)
        dlse = torch.tensor(arrays["dlse"], dtype=dtype)
        finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        grads = torch.autograd.grad((out, finite_lse), [tensors[n] for n in names], (dout, dlse), allow_unused=True)
        for name, grad in zip(names, grads):
            results["d" + name] = grad if grad is not None else torch.zeros_like(tensors[name])
    return {name: value.detach().double().numpy() for name, value in results.items()}


def _max_error(actual: np.ndarray, expected: np.ndarray) -> float:
    if actual.shape != expected.shape:
        return float("inf")
    if actual.size == 0:
        return 0.0
    expected_inf = np.isinf(expected)
    if not np.array_equal(np.isinf(actual) & (actual < 0), expected_inf & (expected < 0)):
        return float("inf")  # −inf rows of lse must match exactly
    finite = ~expected_inf
    if np.isnan(actual[finite]).any() or np.isinf(actual[finite]).any():
        return float("inf")
    return float(np.max(np.abs(actual[finite] - expected[finite]), initial=0.0))


def compare(case: Case, results: Results, exact: Results, baseline: Results) -> list[Comparison]:
    # Dropout multiplies the terms of out's and dP's sums by 1 / (1 − p) while their results stay averages: the
    # reordering noise the floor stands for grows by that factor (docs/testing.md).
    terms = 1.0 if case.dropout is None else 1.0 / (1.0 - case.dropout[0])
    return compare_outputs(case.dtype, results, exact, baseline, terms)


def compare_outputs(
    dtype: str, results: Results, exact: Results, baseline: Results, terms: float = 1.0
) -> list[Comparison]:
    """The tolerance rule for every output of ``exact`` (float64), with ``baseline`` the reference computed at
    ``dtype``: for a whole model as for one call (tests/test_transformers_integration.py compares logits and
    parameter gradients of transformers models so). ``terms``: how much larger than the outputs the terms of their
    sums may be (the floor's scale grows by it)."""
    comparisons = []
    eps = _EPS[dtype]
    accumulation_eps = _EPS["float64" if dtype == "float64" else "float32"]
    for name, expected in exact.items():
        if name not in results:
            comparisons.append(Comparison(name, float("inf"), 0.0))
            continue
        finite = expected[np.isfinite(expected)]
        scale = max(1.0, float(np.max(np.abs(finite), initial=0.0)))
        baseline_error = _max_error(baseline[name], expected) if name in baseline else 0.0
        if not np.isfinite(baseline_error):
            baseline_error = 0.0  # the low-precision literal algorithm overflowed: the floor alone decides
        allowed = 2.0 * baseline_error + (eps + FLOOR_ULPS * accumulation_eps * terms) * scale
        comparisons.append(Comparison(name, _max_error(results[name], expected), allowed))
    return comparisons


def backends_for(case: Case, names: list[str] | None = None) -> dict[str, list[str]]:
    """For each backend (all registered, or ``names``): the reasons it cannot run this case, [] if it can."""
    table = {}
    for name, backend in registry.backends(load=True).items():
        if names is not None and name not in names:
            continue
        reasons = list(backend.available())
        if not reasons:
            reasons = backend.supports(case.spec, case.problem(native_framework(name), harness_device(name)))
        table[name] = reasons
    return table


def check_backend(case: Case, backend: str) -> list[Comparison]:
    """Run ``backend`` on ``case`` and compare every output and gradient with the oracle."""
    arrays = rounded(case, make_arrays(case))
    exact, baseline = oracle_results(case, arrays)
    return compare(case, run_backend(case, arrays, backend), exact, baseline)


def assert_backends_agree(case: Case, backends: list[str] | None = None) -> dict[str, list[Comparison]]:
    """Every named (default: every available) backend that can serve ``case`` agrees with the oracle.

    Raises :class:`DisagreementError` listing each output outside the tolerance rule. Returns the
    comparisons per backend that ran (backends that refuse the case with reasons are left out).

    :param case: the call to check: spec, shapes, optional inputs, dtype and seed.
    :param backends: registered backend names; ``None``: every backend available here.
    :returns: each backend's comparisons of out, lse and the gradients with the float64 oracle.
    :raises DisagreementError: an output or gradient outside the tolerance rule (docs/testing.md).
    """
    arrays = rounded(case, make_arrays(case))
    oracle = oracle_results(case, arrays)
    report = {}
    failures = []
    for name, reasons in backends_for(case, backends).items():
        if reasons:
            continue
        comparisons = compare(case, run_backend(case, arrays, name), *oracle)
        report[name] = comparisons
        failures += [f"{name} {comparison}" for comparison in comparisons if not comparison.ok]
    if failures:
        raise DisagreementError(f"{case.describe()}\n  " + "\n  ".join(failures))
    return report


def assert_agrees_without_lse(case: Case, backend: str) -> list[Comparison]:
    """``backend`` called without lse (torch), which :func:`assert_backends_agree` never does, agrees with the oracle
    on out and, where the case asks for gradients, on the gradients of out alone: a backend may take another path
    for a call that wants no lse (torch-sdpa's masked calls do)."""
    arrays = rounded(case, make_arrays(case))
    arrays["dlse"] = np.zeros_like(arrays["dlse"])  # out alone is differentiated
    exact, baseline = oracle_results(case, arrays)
    results = run_torch(case, arrays, backend, device=harness_device(backend), return_lse=False)
    comparisons = compare(case, results, {name: exact[name] for name in results}, baseline)
    failures = [str(comparison) for comparison in comparisons if not comparison.ok]
    if failures:
        raise DisagreementError(f"{case.describe()} without lse\n  {backend} " + f"\n  {backend} ".join(failures))
    return comparisons
