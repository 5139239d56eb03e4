"""``attnkit bench --calibrate``: measure the cost model's coefficients (attnkit/cost.py) on this machine.

For every registered backend that is available here, takes torch tensors or JAX arrays on the device, and runs
compiled there (the Triton and Pallas interpreters and the CUDA emulator are left out: ``auto`` never picks them),
for float32 and bfloat16 and for the forward and forward+backward passes it supports, one call of
``attend(spec, q, k, v, backend=name)`` is timed at a few shapes (a decode step; L=256, 512, 1024 and 2048 causal and
not; a GQA call with B=2). Each time becomes a point (visible_units, full_units, time_us) by
:func:`attnkit.cost.work_units`, and :func:`attnkit.cost.fit` turns a backend's points into one
:class:`attnkit.cost.CostEntry`. torch calls are timed eagerly; JAX calls jitted (the forward, or ``jax.grad`` of
``sum(out * dout)``), as JAX code runs them. The JAX frontend cannot know at dispatch whether a gradient will be
taken, so dispatch looks JAX calls up under ``forward``; the ``forward+backward`` rows for JAX backends are written
for completeness.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from attnkit.bench.calls import call_problem, interpreted, random_inputs
from attnkit.bench.timing import blocked, environment, interleaved
from attnkit.environment import accelerator_name, cpu_fingerprint
from attnkit.features import Feature
from attnkit.tables import format_table

CALIBRATION_DTYPES = ("float32", "bfloat16")
HEAD_DIM = 64


@dataclass(frozen=True)
class Shape:
    name: str
    causal: bool
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int


CALIBRATION_SHAPES = (
    Shape("decode", True, 1, 8, 8, 1, 128),
    Shape("L=256 full", False, 1, 8, 8, 256, 256),
    Shape("L=256 causal", True, 1, 8, 8, 256, 256),
    # L=512 too: between 256 and 1024 the JAX backends trade places, and a fit without points there picked the
    # slower one at 512 (0.67-0.9x jax.nn.dot_product_attention).
    Shape("L=512 full", False, 1, 8, 8, 512, 512),
    Shape("L=512 causal", True, 1, 8, 8, 512, 512),
    Shape("L=1024 full", False, 1, 8, 8, 1024, 1024),
    Shape("L=1024 causal", True, 1, 8, 8, 1024, 1024),
    # The long shapes keep the fit from extrapolating the short ones: kernels skip hidden tiles only at length.
    Shape("L=2048 full", False, 1, 8, 8, 2048, 2048),
    Shape("L=2048 causal", True, 1, 8, 8, 2048, 2048),
    Shape("GQA B=2 Hkv=2 L=512 causal", True, 2, 8, 2, 512, 512),
)
#: For smoke tests: the same kinds of shape, small.
QUICK_SHAPES = (
    Shape("decode", True, 1, 8, 8, 1, 128),
    Shape("L=64 full", False, 1, 8, 8, 64, 64),
    Shape("L=64 causal", True, 1, 8, 8, 64, 64),
    Shape("L=128 full", False, 1, 8, 8, 128, 128),
    Shape("L=128 causal", True, 1, 8, 8, 128, 128),
    Shape("GQA B=2 Hkv=2 L=64 causal", True, 2, 8, 2, 64, 64),
)


def calibratable(device: str, only: Sequence[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The backends to calibrate on ``device``, and why each other registered backend is left out."""
    from attnkit import registry
    from attnkit.backend import Framework

    chosen, skipped = [], {}
    for name, backend in sorted(registry.backends(load=True).items()):
        missing = backend.available()
        caps = backend.capabilities
        if only is not None and name not in only:
            continue
        if missing:
            skipped[name] = "unavailable: " + "; ".join(missing)
        elif not caps.frameworks & {Framework.TORCH, Framework.JAX}:
            skipped[name] = "takes neither torch nor JAX arrays"
        elif device not in caps.devices:
            skipped[name] = f"does not run on {device}"
        elif interpreted(name, device):
            skipped[name] = f"runs an interpreter or emulator on {device} (auto never picks it)"
        elif device != "cpu" and _framework(name) == "jax" and _jax_platform() != "gpu":
            skipped[name] = f"JAX has no {device} device here (default backend: {_jax_platform()})"
        else:
            chosen.append(name)
    return chosen, skipped


def _jax_platform() -> str:
    import jax

    return jax.default_backend()


def _framework(name: str) -> str:
    from attnkit.testing.runners import native_framework

    return native_framework(name).value


def _inputs(framework: str, shape: Shape, dtype: str, device: str) -> tuple[Any, Any, Any, Any]:
    q_shape = (shape.batch, shape.heads_q, shape.len_q, HEAD_DIM)
    kv_shape = (shape.batch, shape.heads_kv, shape.len_k, HEAD_DIM)
    return random_inputs(framework, q_shape, kv_shape, dtype, device)


def _call(
    name: str, framework: str, spec: Any, inputs: tuple[Any, ...], pass_name: str, device: str
) -> tuple[Callable[[], Any], tuple[Any, Any, Any]]:
    """One timed call of ``attend(spec, ..., backend=name)`` and the (q, k, v) dispatch sees for it."""
    import attnkit

    q, k, v, dout = inputs
    if framework == "torch":
        import torch

        synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        if pass_name == "forward":

            def forward() -> Any:
                out = attnkit.attend(spec, q, k, v, backend=name)
                synchronize()
                return out

            return forward, (q, k, v)
        leaves = tuple(t.detach().clone().requires_grad_(True) for t in (q, k, v))

        def forward_backward() -> None:
            for leaf in leaves:
                leaf.grad = None
            attnkit.attend(spec, *leaves, backend=name).backward(dout)
            synchronize()

        return forward_backward, leaves  # type: ignore[return-value]
    import jax
    import jax.numpy as jnp

    def attention(q: Any, k: Any, v: Any) -> Any:
        return attnkit.attend(spec, q, k, v, backend=name)

    if pass_name == "forward":
        compiled = jax.jit(attention)
    else:
        compiled = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v) * dout), argnums=(0, 1, 2)))
    return partial(blocked, compiled, q, k, v), (q, k, v)


def measure_backend(
    name: str,
    device: str,
    dtypes: Sequence[str],
    shapes: Sequence[Shape],
    repeats: int,
    warmup: int,
) -> list[dict[str, Any]]:
    """Points (visible_units, full_units, time_us) of one backend, per dtype and pass it supports."""
    import attnkit
    from attnkit import cost

    backend = attnkit.get_backend(name)
    framework = _framework(name)
    passes = [cost.FORWARD] + ([cost.FORWARD_BACKWARD] if Feature.GRAD in backend.capabilities.features else [])
    groups = []
    for dtype in dtypes:
        if dtype not in backend.capabilities.dtypes:
            continue
        for pass_name in passes:
            points, skipped = [], {}
            for shape in shapes:
                spec = attnkit.AttentionSpec(causal=shape.causal)
                inputs = _inputs(framework, shape, dtype, device)
                function, call = _call(name, framework, spec, inputs, pass_name, device)
                problem = call_problem(spec, *call)
                if framework == "jax" and pass_name == cost.FORWARD_BACKWARD:
                    from dataclasses import replace

                    problem = replace(problem, needs_grad=True)
                reasons = backend.supports(spec, problem)
                if reasons:
                    skipped[shape.name] = "; ".join(reasons)
                    continue
                samples = interleaved({name: function}, repeats, warmup)[name]  # nanoseconds per call
                visible, full = cost.work_units(spec, problem)
                points.append(
                    {
                        "shape": shape.name,
                        "visible_units": visible,
                        "full_units": full,
                        "time_us": statistics.median(samples) / 1000,
                    }
                )
            groups.append(
                {
                    "backend": name,
                    "device": device,
                    # A GPU's table speaks for its model only (attnkit/cost.py); a CPU's for any machine.
                    "device_name": accelerator_name(framework, device),
                    "dtype": dtype,
                    "pass": pass_name,
                    "points": points,
                    "skipped_shapes": skipped,
                }
            )
    return groups


def calibrate(
    device: str = "cpu",
    dtypes: Sequence[str] = CALIBRATION_DTYPES,
    shapes: Sequence[Shape] = CALIBRATION_SHAPES,
    repeats: int = 5,
    warmup: int = 1,
    only: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure and fit every calibratable backend; a JSON-ready dict whose ``entries`` are CostEntry fields."""
    from attnkit import cost

    say = progress or (lambda message: None)
    names, skipped = calibratable(device, only)
    groups: list[dict[str, Any]] = []
    for name in names:
        say(f"calibrating {name}")
        groups += measure_backend(name, device, dtypes, shapes, repeats, warmup)
    entries = []
    for group in groups:
        points = group["points"]
        if len(points) < 3:
            group["fit"] = None
            continue
        measured = tuple((point["visible_units"], point["full_units"], point["time_us"]) for point in points)
        overhead, per_visible, per_full = cost.fit(measured, relative=True)
        entry = cost.CostEntry(
            group["backend"], group["device"], group["dtype"], group["pass"], overhead, per_visible, per_full, measured,
            device_name=group["device_name"], fitted_on=cpu_fingerprint() if device == "cpu" else "",
        )  # fmt: skip
        group["fit"] = {"overhead_us": overhead, "ns_per_visible_unit": per_visible, "ns_per_full_unit": per_full}
        for point in points:
            point["predicted_us"] = entry.fitted_us(point["visible_units"], point["full_units"])
        entries.append(entry)
    return {
        "what": "calibrate",
        "environment": environment(device),
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "backends": names,
        "skipped_backends": skipped,
        "shapes": [shape.__dict__ for shape in shapes],
        "head_dim": HEAD_DIM,
        "repeats": repeats,
        "groups": groups,
        "entries": [
            {
                "backend": e.backend,
                "device": e.device,
                "device_name": e.device_name,
                "dtype": e.dtype,
                "pass": e.pass_name,
                "overhead_us": e.overhead_us,
                "ns_per_visible_unit": e.ns_per_visible_unit,
                "ns_per_full_unit": e.ns_per_full_unit,
                "measured": [list(point) for point in e.measured],
                "fitted_on": e.fitted_on,
            }
            for e in entries
        ],
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("torch", "jax", "jaxlib", "attnkit"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


def cost_entries(result: dict[str, Any]) -> list[Any]:
    from attnkit import cost

    return [
        cost.CostEntry(
            row["backend"],
            row["device"],
            row["dtype"],
            row["pass"],
            row["overhead_us"],
            row["ns_per_visible_unit"],
            row["ns_per_full_unit"],
            tuple(tuple(point) for point in row.get("measured", ())),
            device_name=row.get("device_name", ""),
            fitted_on=row.get("fitted_on", ""),
        )
        for row in result["entries"]
    ]


def header(result: dict[str, Any], command: str) -> str:
    env, versions = result["environment"], result["versions"]
    shapes = "; ".join(shape["name"] for shape in result["shapes"])
    return "\n".join(
        [
            "attnkit cost table (attnkit/cost.py): regenerate with `attnkit bench --calibrate --output "
            "configs/costs.toml`.",
            f"command: {command}",
            f"date: {result['date']}",
            f"machine: {env['cpu_model']}, {env['cpu_count']} CPUs, {env['machine']}, device={env['device']}"
            + (f" ({env['gpu']})" if "gpu" in env else "")
            + f", torch threads={env['cpu_threads']}, load average {' '.join(map(str, env['load_average']))}",
            "versions: " + ", ".join(f"{name} {value}" for name, value in versions.items()),
            f"shapes (D={result['head_dim']}, median of {result['repeats']}): {shapes}",
            "skipped backends: "
            + (
                "; ".join(f"{name} ({_short(why)})" for name, why in sorted(result["skipped_backends"].items()))
                or "none"
            ),
        ]
    )


def _short(reason: str) -> str:
    first = reason.split(" (")[0].split(";")[0]
    return first if len(first) <= 60 else first[:57] + "..."


def render_table(result: dict[str, Any], command: str) -> str:
    """The TOML text :func:`attnkit.cost.write_table` writes for this calibration."""
    from attnkit import cost

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "costs.toml"
        cost.write_table(cost_entries(result), path, header(result, command))
        return path.read_text()


def format_calibration(result: dict[str, Any]) -> str:
    """Measured against fitted time per point, as '#' comment lines (so stdout stays valid TOML)."""
    rows = []
    for group in result["groups"]:
        for point in group["points"]:
            predicted = point.get("predicted_us")
            rows.append(
                [
                    group["backend"],
                    group["dtype"],
                    group["pass"],
                    point["shape"],
                    f"{point['time_us']:.4g}",
                    "no fit" if predicted is None else f"{predicted:.4g}",
                    "" if predicted is None else f"{predicted / point['time_us']:.2f}",
                ]
            )
    table = format_table(["backend", "dtype", "pass", "shape", "measured us", "fitted us", "fit/measured"], rows)
    return "\n".join("# " + line for line in table.splitlines())
