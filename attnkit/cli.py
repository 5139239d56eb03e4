"""The ``attnkit`` command: ``info``, ``check``, ``explain``, ``bench`` and ``build``.

Argument parsing and calls only. ``info``, ``explain`` and ``bench --what spec`` need neither torch, JAX nor
hypothesis; ``build`` and the other benches need torch; ``check`` needs torch (the oracle) and hypothesis, and says
which extra to install when they are missing. The modules behind ``check`` (attnkit.testing.check) and ``bench``
(attnkit.bench) are imported inside those subcommands, so the others keep working without them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import attnkit
from attnkit.backend import Framework
from attnkit.capability_matrix import DEFAULT_MARKDOWN_PATH, DTYPE_ORDER, capability_markdown, info_report
from attnkit.environment import interpret_triton_without_gpu
from attnkit.errors import AttnkitError
from attnkit.explain_flags import problem_from_args, spec_from_args, window_side
from attnkit.spec import CausalAlignment, Layout, Variant
from attnkit.tables import terminal_width

#: What ``attnkit check`` imports beyond a plain install, with the extra that installs it.
CHECK_NEEDS = (("torch", "torch"), ("test", "hypothesis"))


def run_info(args: argparse.Namespace, out: TextIO) -> int:
    if not args.markdown:
        print(info_report(attnkit.__version__, None if args.wide else terminal_width(out)), file=out)
        return 0
    text = capability_markdown()
    if args.output == "-":
        out.write(text)
    else:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}", file=out)
    return 0


def run_build(args: argparse.Namespace, out: TextIO) -> int:
    """Build every run-time build this machine can (attnkit/prebuild.py): 1 only if a build failed."""
    try:
        import torch  # noqa: F401  every run-time build is a torch extension
    except ImportError as error:
        print(f"attnkit build: needs torch ({error}): pip install 'attnkit[torch]'", file=sys.stderr)
        return 2  # a missing extra, as for check and bench; 1 is a build that failed
    from attnkit.prebuild import prebuild

    return prebuild(out, sys.stderr)


def run_check(args: argparse.Namespace, out: TextIO) -> int:
    missing = []  # looked for before attnkit.testing.check, which imports hypothesis
    for extra, module in CHECK_NEEDS:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append((extra, module))
    if missing:
        modules = " and ".join(module for _, module in missing)
        extras = ",".join(extra for extra, _ in missing)
        print(f'attnkit check needs {modules}, not installed here: pip install "attnkit[{extras}]"', file=sys.stderr)
        return 2
    from attnkit.testing.check import run_check as check

    return check(args.backend, args.examples, args.profile, args.seed, out)


def run_explain(args: argparse.Namespace, out: TextIO, parser: argparse.ArgumentParser) -> int:
    from attnkit.api import explain_problem

    spec = spec_from_args(args, parser)
    problem = problem_from_args(args, parser)
    print(explain_problem(spec, problem), file=out)
    return 0


def run_bench(args: argparse.Namespace, out: TextIO) -> int:
    from attnkit.bench.command import run_bench as bench

    return bench(args, out)


def _add_info(commands: Any) -> None:
    info = commands.add_parser("info", help="registered backends, availability and capability matrix")
    info.add_argument("--markdown", action="store_true", help="write the capability matrix as Markdown")
    info.add_argument(
        "--wide", action="store_true", help="lines as long as their contents (default: the terminal's width, COLUMNS)"
    )
    info.add_argument(
        "--output",
        default=str(DEFAULT_MARKDOWN_PATH),
        help="where --markdown writes ('-' for stdout; default: %(default)s)",
    )


def _add_check(commands: Any) -> None:
    check = commands.add_parser("check", help="run the conformance suite on the backends available here")
    check.add_argument("--backend", action="append", metavar="NAME", help="check only this backend (repeatable)")
    check.add_argument("--examples", type=int, help="drawn cases per backend (default 30, or the profile's count)")
    check.add_argument("--profile", choices=("ci", "dev", "thorough"), help="hypothesis profile (see testing)")
    check.add_argument("--seed", type=int, default=0, help="seed of the drawn cases (default %(default)s)")


def _add_explain(commands: Any) -> argparse.ArgumentParser:
    explain = commands.add_parser("explain", help="which backend a call would use, and why not the others")
    spec = explain.add_argument_group("spec (either --spec JSON or the flags)")
    spec.add_argument("--spec", help='AttentionSpec as JSON, e.g. \'{"causal": true, "window": [128, 0]}\'')
    spec.add_argument("--causal", action="store_const", const=True, default=None)
    spec.add_argument("--causal-alignment", choices=[a.value for a in CausalAlignment])
    spec.add_argument("--window", nargs=2, type=window_side, metavar=("LEFT", "RIGHT"), help="int or 'none'")
    spec.add_argument("--scale", type=float)
    spec.add_argument("--variant", choices=[v.value for v in Variant])
    spec.add_argument("--softcap", type=float)
    spec.add_argument("--layout", choices=[layout.value for layout in Layout])
    shapes = explain.add_argument_group("call")
    shapes.add_argument("--batch", type=int, default=1)
    shapes.add_argument("--heads-q", type=int, default=8)
    shapes.add_argument("--heads-kv", type=int, help="default: --heads-q")
    shapes.add_argument("--len-q", type=int, default=128)
    shapes.add_argument("--len-k", type=int, help="default: --len-q")
    shapes.add_argument("--head-dim", type=int, default=64)
    shapes.add_argument("--head-dim-v", type=int, help="default: --head-dim")
    shapes.add_argument("--dtype", choices=DTYPE_ORDER, default="float32")
    shapes.add_argument("--framework", choices=[f.value for f in Framework], default="torch")
    shapes.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    for flag, meaning in (
        ("--mask", "a boolean mask is passed"),
        ("--bias", "an additive bias is passed"),
        ("--q-lengths", "q_lengths is passed"),
        ("--kv-lengths", "kv_lengths is passed"),
        ("--grad", "gradients are needed"),
        ("--bias-grad", "the bias needs its gradient (implies --bias --grad)"),
        ("--lse", "return_lse=True"),
    ):
        shapes.add_argument(flag, action="store_true", help=meaning)
    return explain


BENCH_WHATS = "dispatch spec chunked memory targets compiled masks packed paged context-parallel clauses decode".split()


def _add_bench(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="the CPU targets against the frameworks' own attention; dispatch overhead; AttentionSpec construction; "
        "torch-chunked against SDPA and torch-naive in time or peak memory; segment ids (packed rows, left padding); "
        "--backend NAME in TFLOP/s; a decode step over a growing cache, jitted JAX and transformers generate(); "
        "--calibrate the cost table",
    )
    bench.add_argument(
        "--what",
        choices=BENCH_WHATS,
        default="dispatch",
    )
    bench.add_argument(
        "--backend",
        metavar="NAME",
        help="time this backend's fwd, bwd, fwd+bwd in TFLOP/s against its framework's own attention (torch SDPA, "
        "jax.nn.dot_product_attention) at the FlashAttention-2 paper's shapes (replaces --what)",
    )
    bench.add_argument(
        "--calibrate",
        action="store_true",
        help="time every available compiled backend at a few shapes and fit the cost table (attnkit/cost.py); "
        "prints it, or writes it to --output (replaces --what)",
    )
    bench.add_argument("--output", metavar="PATH", help="--calibrate: write the table here (configs/costs.toml)")
    bench.add_argument(
        "--backends",
        metavar="A,B",
        help="--calibrate, paged, packed: only these backends; context-parallel: the local blocks' backend; "
        "targets: the non-native paths timed besides auto (default: every torch backend that serves the call)",
    )
    bench.add_argument(
        "--peer",
        metavar="A,B",
        help="--backend: the peers to time it against, of either framework (sdpa, sdpa-cudnn, sdpa-flash, "
        "sdpa-efficient, sdpa-math, flash-attn, jax, jax-cudnn, jax-xla; default: its framework's own attention, "
        "each kernel pinned on a GPU)",
    )
    bench.add_argument(
        "--shape",
        action="append",
        metavar="BxHxLQxLKxD",
        help="--backend: time this shape instead of the FlashAttention-2 paper's grid (repeatable; BxHxLxD for "
        "Lq == Lk; causal rows only where Lq == Lk, no backward where Lq == 1)",
    )
    bench.add_argument(
        "--passes",
        metavar="A,B",
        help="which passes to time: --backend any of fwd,bwd,fwd+bwd (default: all); "
        "--what compiled fwd or fwd+bwd (default: fwd+bwd)",
    )
    bench.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="--backend")
    bench.add_argument(
        "--dtypes", metavar="A,B", help="targets, --programs, --calibrate: default float32,bfloat16; clauses: float32"
    )
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    bench.add_argument("--rounds", type=int, help="dispatch, spec, targets' decode: interleaved rounds (default 20)")
    bench.add_argument("--calls", type=int, help="dispatch, spec, targets' decode: calls per round (default 2000)")
    bench.add_argument(
        "--seq-len",
        type=int,
        help="chunked, memory, --backend, context-parallel, packed: sequence length (default 4096, 16384, paper's, "
        "16384, 4096)",
    )
    bench.add_argument("--steps", type=int, help="decode: growing-cache steps per row, torch and JAX (default 1000)")
    bench.add_argument(
        "--seen-signatures",
        type=int,
        help="decode: distinct call signatures attend meets before its last growing-cache row (default 100000)",
    )
    bench.add_argument("--new-tokens", type=int, help="decode: tokens per transformers generate() (default 256)")
    bench.add_argument("--world", type=int, help="context-parallel: ranks of the gloo group (default 4)")
    bench.add_argument(
        "--seq-lens",
        metavar="L1,L2",
        help="targets, masks, paged: sequence lengths (default 512,2048,4096; masks 64,512,2048; "
        "paged 1024,8192,32768)",
    )
    bench.add_argument("--targets", metavar="A,B", help="targets: which ones (default torch,jax,non-native,decode)")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="every bench as a smoke run of seconds: short lengths, few repeats and rounds, no memory runs "
        "(flags given still win; attnkit/bench/command.py's QUICK lists them)",
    )
    bench.add_argument("--no-memory", action="store_true", help="targets, masks, packed: skip the peak-memory runs")
    bench.add_argument("--programs", action="store_true", help="masks: cpu-flash's mask_mod (bench/programs.py)")
    bench.add_argument("--plot", metavar="PATH", help="targets, --programs: plot to this PNG")
    bench.add_argument(
        "--repeats",
        type=int,
        help="chunked, --backend, targets, masks, packed, paged, --calibrate: timed repeats (default 3; targets 7; "
        "masks, paged 5; --calibrate 5; --quick 2); decode: transformers generate() turns (default 3)",
    )
    bench.add_argument(
        "--warmup", type=int, help="chunked, --backend, targets: untimed repeats (default 1, at least 1)"
    )
    bench.add_argument("--threads", type=int, help="torch intra-op threads, and XLA's with 1 (default: their choice)")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def _add_build(commands: Any) -> None:
    commands.add_parser(
        "build",
        help="build what attnkit compiles at run time, once per machine, torch and Python: cpu-flash's kernel "
        "(~16 s), the C++ signature that keys attend's cache for torch calls (~15 s; a cached call 3-5 us cheaper)",
    )


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser, and the explain subparser (its errors name the explain usage)."""
    parser = argparse.ArgumentParser(prog="attnkit", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"attnkit {attnkit.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_info(commands)
    _add_check(commands)
    explain = _add_explain(commands)
    _add_bench(commands)
    _add_build(commands)
    return parser, explain


def main(argv: Sequence[str] | None = None) -> int:
    parser, explain_parser = build_parser()
    args = parser.parse_args(argv)
    out = sys.stdout
    # `check` checks every backend this machine can run, Triton's kernels interpreted where there is no GPU; the other
    # commands see what `import attnkit` sees in a Python process (which TRITON_INTERPRET=1 changes the same way).
    if args.command == "check":
        interpret_triton_without_gpu()
    try:
        if args.command == "info":
            return run_info(args, out)
        if args.command == "check":
            return run_check(args, out)
        if args.command == "explain":
            return run_explain(args, out, explain_parser)
        if args.command == "build":
            return run_build(args, out)
        return run_bench(args, out)
    except AttnkitError as error:
        print(f"attnkit {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
