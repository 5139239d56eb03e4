"""The capability matrix: each registered backend's declared frameworks, devices, dtypes, head dims and features.

Printed by ``attnkit info`` (with what runs on this machine) and written as docs/backends.md by
``attnkit info --markdown`` (declarations only).
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from attnkit import hardware, registry
from attnkit.backend import ALL_FEATURES, CALL_FEATURES, SPEC_FEATURES, Backend, Capabilities, Unverified
from attnkit.tables import fitted_table, markdown_table

DEFAULT_MARKDOWN_PATH = Path("docs") / "backends.md"
STALE_MARKDOWN_MESSAGE = "docs/backends.md is stale: run `attnkit info --markdown`"

#: One line per feature name, for the legend of ``info``'s matrix and docs/backends.md.
FEATURE_MEANINGS: dict[str, str] = {
    "causal": "`causal=True`: each query sees keys at or before its aligned position",
    "top_left": "`causal_alignment=top_left` for causal/window when Lq != Lk (default is bottom-right)",
    "window": "sliding window `window=(left, right)`",
    "cosine": "`variant=cosine`: q and k L2-normalised along the head dim",
    "softcap": "`softcap=c`: scores mapped to c·tanh(S/c)",
    "bshd": "`layout=bshd` (batch, seq, heads, dim) inputs",
    "mask": "a boolean `mask` argument (True = may attend)",
    "bias": "an additive `bias` argument",
    "q_lengths": "per-batch valid query lengths `q_lengths`",
    "kv_lengths": "per-batch valid key lengths `kv_lengths`",
    "lse": "`return_lse=True`: the log-sum-exp per query (float32; float64 for float64 inputs)",
    "grad": "gradients with respect to q, k and v",
    "dbias": "the gradient with respect to `bias`",
    "segment_ids": "`q_segment_ids`/`kv_segment_ids`: packed documents and left padding (§4.5)",
    "paged": "`attend_paged`: a paged KV cache read where its blocks lie (§13; forward only)",
    "alibi": "`alibi_slopes`: ALiBi's −slope·|i + off − j| on every score, computed from positions (§16)",
    "mask_program": "`mask_mod`: a mask program evaluated in the backend's tiles, empty tiles skipped; "
    '"materialised": served as a dense (Lq, Lk) mask (§17)',
    "dropout": "`dropout_p`: attention dropout with the contract's counter-based keep-mask, the same on every "
    "backend, device and sharding (§18)",
}
# Spec features first (what is computed), then call features (what is passed), each alphabetical.
FEATURE_ORDER: tuple[str, ...] = (*sorted(SPEC_FEATURES), *sorted(CALL_FEATURES))
DTYPE_ORDER: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64")
UNBOUNDED_HEAD_DIMS = (1, 1 << 30)


def _ordered(values: Iterable[str], order: Sequence[str]) -> list[str]:
    """Known values in ``order``, then any others alphabetically, so output never depends on set order."""
    values = set(values)
    return [value for value in order if value in values] + sorted(values - set(order))


def _head_dims_text(head_dims: tuple[int, int]) -> str:
    return "any" if tuple(head_dims) == UNBOUNDED_HEAD_DIMS else f"{head_dims[0]}..{head_dims[1]}"


def _per_device(capabilities: Capabilities, text: Callable[[Capabilities], str]) -> str:
    """``text`` of the capabilities, then of each device where they are narrower: "a, b (cuda: a)"."""
    general = text(capabilities)
    narrower = [(device, text(capabilities.on(device))) for device, _ in capabilities.per_device]
    extra = "; ".join(f"{device}: {value}" for device, value in narrower if value != general)
    return f"{general} ({extra})" if extra else general


def _served(capabilities: Capabilities, feature: str) -> str:
    if feature not in capabilities.features:
        return "no"
    return "materialised" if feature == "mask_program" and capabilities.materialises_mask_programs else "yes"


def capability_matrix(registered: Mapping[str, Backend]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the capability matrix: one row per property or feature, one column per backend.

    Features are rows rather than columns so the table stays readable in a terminal: thirteen feature
    columns would be about 150 characters wide, while backends are few.
    """
    names = sorted(registered)
    caps = [registered[name].capabilities for name in names]
    rows = [
        ["frameworks", *(", ".join(sorted(f.value for f in c.frameworks)) or "-" for c in caps)],
        ["devices", *(", ".join(sorted(c.devices)) or "-" for c in caps)],
        ["dtypes", *(_per_device(c, lambda on: ", ".join(_ordered(on.dtypes, DTYPE_ORDER)) or "-") for c in caps)],
        ["head dims", *(_per_device(c, lambda on: _head_dims_text(on.head_dims)) for c in caps)],
    ]
    for feature in FEATURE_ORDER:
        rows.append([feature, *(_served(c, feature) for c in caps)])
    return ["capability", *names], rows


HARDWARE_HEADER = ("backend", "device", "verified on hardware", "by")


def hardware_rows(registered: Mapping[str, Backend]) -> list[list[str]]:
    """Rows under :data:`HARDWARE_HEADER`: one per backend and device (attnkit.hardware.verifications)."""
    return [[row.backend, row.device, row.summary(), row.by] for row in hardware.verifications(registered)]


def _hardware_markdown(registered: Mapping[str, Backend]) -> list[str]:
    rows = hardware.verifications(registered)
    runs = sorted({check.run for check in hardware.HARDWARE_CHECKS}, key=lambda run: run.date, reverse=True)
    return [
        "## Verified on hardware",
        "",
        "Whether each backend's path on each device has passed on real hardware. CPU paths that run natively are",
        "checked by the CI suite on every commit; interpreted or emulated paths (Triton's interpreter, the CUDA C",
        "emulator, Pallas' interpret mode) check conformance, not hardware; GPU paths count from the last hand-run",
        "GPU check ([gpu.md](gpu.md)). A path *refused* is switched off on that device until a hardware run passes",
        "it (`ATTNKIT_ALLOW_UNVERIFIED=1` runs it anyway); a path *not yet run* is served but was added after the",
        "last hardware run.",
        "",
        markdown_table(
            [*HARDWARE_HEADER, "not verified on hardware", "what ran"],
            ([row.backend, row.device, row.summary(), row.by, row.gaps(), row.ran] for row in rows),
        ),
        "",
        "Hardware runs:",
        "",
        *(f"- {run.label()}: {run.versions}; commit {run.commit}" for run in runs),
        "",
    ]


def capability_markdown(registered: Mapping[str, Backend] | None = None) -> str:
    """docs/backends.md: the registered backends' declared capabilities and descriptions, nothing else.

    Deliberately machine-independent: availability (installed packages, devices) is left out, so the
    committed file only goes stale when a backend's declaration changes.
    """
    registered = registry.backends(load=True) if registered is None else registered
    header, rows = capability_matrix(registered)
    parts = [
        "# Backends",
        "",
        "<!-- Generated by `attnkit info --markdown` from each backend's declared capabilities; do not edit. -->",
        "",
        'What each registered backend declares it can do. `attend(..., backend="auto")` picks the first backend',
        "in the configured priority list whose capabilities cover the call (`attnkit explain` shows why);",
        "whether a backend can run on a given machine is not recorded here: run `attnkit info`.",
        "",
        "## Capability matrix",
        "",
        markdown_table(header, ([f"`{row[0]}`" if row[0] in ALL_FEATURES else row[0], *row[1:]] for row in rows)),
        "",
        "## Features",
        "",
        *(f"- `{feature}`: {FEATURE_MEANINGS.get(feature, '')}" for feature in FEATURE_ORDER),
        "",
        *_hardware_markdown(registered),
        "## Descriptions",
        "",
    ]
    for name in sorted(registered):
        capabilities = registered[name].capabilities
        parts += [f"### {name}", "", capabilities.description or "(no description)", ""]
        if capabilities.notes or capabilities.unverified:
            parts += [
                *(f"- {note}" for note in capabilities.notes),
                *map(_unverified_text, capabilities.unverified),
                "",
            ]
    return "\n".join(parts)


def _unverified_text(entry: Unverified) -> str:
    return f"refused on {entry.device} until a GPU run passes it: {entry.path} ({entry.history}; docs/gpu.md)"


def availability_lines(registered: Mapping[str, Backend], width: int | None = None) -> list[str]:
    rows = []
    for name in sorted(registered):
        reasons = registered[name].available()
        rows.append([name, "available" if not reasons else "unavailable: " + "; ".join(reasons)])
    return fitted_table(["backend", "on this machine"], rows, width).splitlines()


def info_report(version: str, width: int | None = None) -> str:
    """What ``attnkit info`` prints: availability, refused plugins, the matrix, and where each backend came from;
    within ``width`` columns (None: each line as long as it is)."""

    def wrapped(*texts: str, indent: int = 4) -> list[str]:
        if width is None:
            return list(texts)
        wrap = textwrap.TextWrapper(width, subsequent_indent=" " * indent, break_on_hyphens=False)
        return [line for text in texts for line in wrap.wrap(text)]

    registered = registry.backends(load=True)
    lines = [f"attnkit {version}: {len(registered)} backends registered"]
    if "torch" in sys.modules:  # registering the torch backends imported it; without torch there is no signature
        from attnkit.frontends import torch_frontend

        lines += wrapped(f"torch call signature (attend's cache key): {torch_frontend.signature_in_use}")
    lines += ["", *availability_lines(registered, width)]
    refused = registry.refused_plugins()
    if refused:
        lines += ["", f"plugins refused ({registry.ENTRY_POINT_GROUP} entry points that registered nothing):"]
        lines += wrapped(*(f"  {plugin.entry_point}: {plugin.reason}" for plugin in refused))
    header, rows = capability_matrix(registered)
    lines += ["", fitted_table(header, rows, width)]
    lines += [
        "",
        "verified on hardware (docs/gpu.md):",
        fitted_table(list(HARDWARE_HEADER), hardware_rows(registered), width),
    ]
    lines += ["", "backends:"]
    origins = registry.origins()
    for name in sorted(registered):
        capabilities = registered[name].capabilities
        lines += wrapped(f"  {name}: {capabilities.description or '(no description)'}")
        lines += wrapped(f"    from: {origins.get(name, 'unknown')}", indent=10)
        lines += wrapped(*(f"    note: {note}" for note in capabilities.notes), indent=10)
        lines += wrapped(
            *(f"    pending hardware: {_unverified_text(entry)}" for entry in capabilities.unverified), indent=10
        )
    return "\n".join(lines)
