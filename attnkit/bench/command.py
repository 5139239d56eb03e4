"""``attnkit bench``: runs the bench the parsed flags name and prints its table (attnkit/cli.py parses them)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from attnkit.bench import (
    calibrate,
    chunked,
    clauses,
    compiled,
    context_parallel,
    decode,
    masks,
    overhead,
    packed,
    paged,
    programs,
    spec_cost,
    targets,
    tflops,
)
from attnkit.bench.timing import MIN_WARMUP
from attnkit.environment import limit_jax_threads, torch_threads


def _csv(text: str | None, kind: Callable[[str], Any] = str) -> tuple[Any, ...] | None:
    return None if text is None else tuple(kind(part.strip()) for part in text.split(",") if part.strip())


#: What ``--quick`` sets where the flag was not given: every --what a smoke run of seconds (≤ 15 s on 2 shared cores;
#: --calibrate's ~30 s). Keyed by --what, "backend" (--backend NAME) and "calibrate" (which also takes its small
#: shapes).
QUICK: dict[str, dict[str, Any]] = {
    "dispatch": {"rounds": 2, "calls": 100},
    "spec": {"rounds": 3, "calls": 200},
    "chunked": {"seq_len": 512, "repeats": 1},
    "memory": {"seq_len": 1024},
    # float32 alone, and of the non-native paths auto and cpu-flash (torch-flex compiles per shape, naive is slow)
    "targets": {
        "seq_lens": "512",
        "dtypes": "float32",
        "repeats": 2,
        "rounds": 5,
        "calls": 200,
        "no_memory": True,
        "backends": "cpu-flash",
    },
    "compiled": {"repeats": 1, "warmup": 1, "passes": "fwd"},  # inductor's compiles are the time: half as many
    "masks": {"seq_lens": "128", "repeats": 2, "no_memory": True},  # a child process per memory cell
    "packed": {"seq_len": 1024, "repeats": 1, "no_memory": True},
    "paged": {"seq_lens": "1024", "repeats": 1, "backends": "cpu-flash,torch-chunked"},
    "context-parallel": {"world": 2, "seq_len": 1024, "repeats": 1},
    "clauses": {"seq_lens": "256", "repeats": 2, "no_memory": True},
    "backend": {"seq_len": 256, "repeats": 1, "passes": "fwd"},  # after the warm-up every bench takes (timing.py)
    # 200 growing-cache steps a row, 2,000 signatures before the last, one generate() of 32 tokens each
    "decode": {"steps": 200, "seen_signatures": 2000, "new_tokens": 32, "repeats": 1},
    "calibrate": {"repeats": 2},
}
#: The flags' values when neither they nor --quick set them.
FULL = {"rounds": 20, "calls": 2000, "warmup": 1, "world": 4}


def _settled(args: argparse.Namespace) -> argparse.Namespace:
    """The flags with --quick's values (:data:`QUICK`) filled in where not given, then the full defaults."""
    chosen = "calibrate" if args.calibrate else "backend" if args.backend is not None else args.what
    values = vars(args).copy()
    for defaults in (QUICK[chosen] if args.quick else {}, FULL):
        for name, value in defaults.items():
            if values.get(name) is None or values.get(name) is False:
                values[name] = value
    values["warmup"] = max(values["warmup"], MIN_WARMUP)  # what every bench does (timing.interleaved), said so
    return argparse.Namespace(**values)


def run_bench(args: argparse.Namespace, out: TextIO) -> int:
    """``attnkit bench`` with the parsed flags (see attnkit/cli.py); returns the exit status."""
    args = _settled(args)
    if args.backend is None and not args.calibrate and args.what == "spec":
        result = spec_cost.bench_spec(rounds=args.rounds, calls=args.calls)
        print(spec_cost.format_spec(result), file=out)
        _write_json(args, result, out)
        return 0
    try:  # every other bench times torch, or keeps torch's threads in check around JAX
        import torch  # noqa: F401
    except ImportError as error:
        print(f"attnkit bench: needs torch ({error}): pip install 'attnkit[torch]'", file=sys.stderr)
        return 2
    if args.calibrate:
        return run_calibrate(args, out)
    if args.what == "targets":
        return run_targets(args, out)
    if args.what == "masks":
        return run_masks(args, out)
    if args.what == "clauses":
        return run_clauses(args, out)
    if args.what == "paged":
        return run_paged(args, out)
    if args.what == "packed":
        return run_packed(args, out)
    if args.what == "context-parallel":
        return run_context_parallel(args, out)
    if args.what == "decode":
        return run_decode(args, out)
    if args.what == "memory" and args.device != "cpu":
        print("attnkit bench: --what memory measures host memory (peak RSS), on --device cpu only", file=sys.stderr)
        return 2
    repeats = args.repeats if args.repeats is not None else 3
    with torch_threads(args.threads):
        if args.backend is not None:
            try:
                shapes = [tflops.parse_shape(text) for text in args.shape] if args.shape else None
            except ValueError as error:
                print(f"attnkit bench: --shape: {error}", file=sys.stderr)
                return 2
            peers, passes = _csv(args.peer), _csv(args.passes) or tflops.PASSES
            wrong = [p for p in peers or () if p not in tflops.PEERS] + [p for p in passes if p not in tflops.PASSES]
            if wrong:
                known = f"peers {', '.join(tflops.PEER_NAMES)}; passes {', '.join(tflops.PASSES)}"
                print(f"attnkit bench: unknown {', '.join(wrong)} ({known})", file=sys.stderr)
                return 2
            result = tflops.bench_backend(
                args.backend,
                device=args.device,
                seq_lens=(args.seq_len,) if args.seq_len else None,
                dtype=args.dtype,
                repeats=repeats,
                warmup=args.warmup,
                peers=peers,
                shapes=shapes,
                passes=passes,
                progress=_progress,
            )
            text = tflops.format_backend(result)
        elif args.what == "dispatch":
            result = overhead.bench_dispatch(
                rounds=args.rounds, calls=args.calls, device=args.device, progress=_progress
            )
            text = overhead.format_dispatch(result)
        elif args.what == "compiled":
            passes = _csv(args.passes) or ("fwd+bwd",)
            if len(passes) != 1 or passes[0] not in compiled.PASSES:
                allowed = ", ".join(compiled.PASSES)
                print(f"attnkit bench: --what compiled --passes {args.passes}: one of {allowed}", file=sys.stderr)
                return 2
            result = compiled.bench_compiled(
                repeats=repeats, warmup=args.warmup, device=args.device, backward=passes[0] == "fwd+bwd"
            )
            text = compiled.format_compiled(result)
        elif args.what == "chunked":
            result = chunked.bench_chunked(
                seq_len=args.seq_len or 4096, repeats=repeats, warmup=args.warmup, device=args.device
            )
            text = chunked.format_chunked(result)
        else:
            result = chunked.bench_memory(seq_len=args.seq_len or 16384)
            text = chunked.format_memory(result)
    print(text, file=out)
    _write_json(args, result, out)
    return 0


def _write_json(args: argparse.Namespace, result: Any, out: TextIO) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}", file=out)


def _progress(message: str) -> None:
    print(f"[attnkit bench] {message}", file=sys.stderr, flush=True)


def run_targets(args: argparse.Namespace, out: TextIO) -> int:
    if args.device != "cpu":
        print("attnkit bench: --what targets measures the CPU performance targets (--device cpu)", file=sys.stderr)
        return 2
    if args.plot:  # fail before a long run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("attnkit bench: --plot needs matplotlib: pip install 'attnkit[bench]'", file=sys.stderr)
            return 2
    limit_jax_threads(args.threads)
    seq_lens = _csv(args.seq_lens, int) or targets.TARGET_SEQ_LENS
    dtypes = _csv(args.dtypes) or targets.TARGET_DTYPES
    chosen = _csv(args.targets) or targets.TARGETS
    unknown = sorted(set(chosen) - set(targets.TARGETS))
    if unknown:
        known = ", ".join(targets.TARGETS)
        print(f"attnkit bench: unknown --targets {unknown} (known: {known})", file=sys.stderr)
        return 2
    repeats = args.repeats if args.repeats is not None else 7
    with torch_threads(args.threads):
        result = targets.bench_targets(
            seq_lens=seq_lens,
            dtypes=dtypes,
            repeats=repeats,
            warmup=args.warmup,
            targets=chosen,
            memory=not args.no_memory,
            decode_rounds=args.rounds,
            decode_calls=args.calls,
            progress=_progress,
            non_native_paths=_csv(args.backends),
        )
    print(targets.format_targets(result), file=out)
    _write_json(args, result, out)
    if args.plot:
        targets.plot_targets(result, args.plot)
        print(f"wrote {args.plot}", file=out)
    return 0


def run_paged(args: argparse.Namespace, out: TextIO) -> int:
    if args.device != "cpu":
        print("attnkit bench: --what paged measures the CPU backends (--device cpu)", file=sys.stderr)
        return 2
    with torch_threads(args.threads):
        result = paged.bench_paged(
            backends=_csv(args.backends) or paged.PAGED_BACKENDS,
            seq_lens=_csv(args.seq_lens, int) or paged.PAGED_SEQ_LENS,
            repeats=args.repeats if args.repeats is not None else 5,
            warmup=args.warmup,
            progress=_progress,
        )
    print(paged.format_paged(result), file=out)
    _write_json(args, result, out)
    return 0


def run_masks(args: argparse.Namespace, out: TextIO) -> int:
    if args.device != "cpu":
        print("attnkit bench: --what masks measures torch's CPU SDPA (--device cpu)", file=sys.stderr)
        return 2
    if args.programs:
        return run_programs(args, out)
    seq_lens = _csv(args.seq_lens, int) or masks.MASK_SEQ_LENS
    repeats = args.repeats if args.repeats is not None else 5
    with torch_threads(args.threads):
        result = masks.bench_masks(
            seq_lens=seq_lens, repeats=repeats, warmup=args.warmup, memory=not args.no_memory, progress=_progress
        )
    print(masks.format_masks(result), file=out)
    _write_json(args, result, out)
    return 0


def run_programs(args: argparse.Namespace, out: TextIO) -> int:
    """--what masks --programs: cpu-flash's mask programs; the fraction sweep and the classification's share at the
    shortest and longest L."""
    seq_lens = _csv(args.seq_lens, int) or programs.PROGRAM_SEQ_LENS
    peers = _csv(args.peer) or ()
    if any(peer != "flex" for peer in peers):
        print(f"attnkit bench: --what masks --programs takes --peer flex (SDPA is always timed), got {args.peer}",
              file=sys.stderr)  # fmt: skip
        return 2
    with torch_threads(args.threads):
        result = programs.bench_programs(
            seq_lens=seq_lens,
            dtypes=_csv(args.dtypes) or programs.PROGRAM_DTYPES,
            passes=_csv(args.passes) or programs.PASSES,
            repeats=args.repeats if args.repeats is not None else 3,
            warmup=args.warmup,
            sweep_len=min(seq_lens),
            share_len=max(seq_lens),
            progress=_progress,
            flex="flex" in peers,
            memory=not args.no_memory,
        )
    print(programs.format_programs(result), file=out)
    if args.plot:
        print(programs.plot_sweep(result, args.plot), file=out)
    _write_json(args, result, out)
    return 0


def run_clauses(args: argparse.Namespace, out: TextIO) -> int:
    if args.device != "cpu":
        print("attnkit bench: --what clauses measures a CPU backend (--device cpu)", file=sys.stderr)
        return 2
    backends = _csv(args.backends) or ("cpu-flash",)
    seq_lens = _csv(args.seq_lens, int) or clauses.SEQ_LENS
    repeats = args.repeats if args.repeats is not None else 7
    with torch_threads(args.threads):
        result = clauses.bench_clauses(
            backend=backends[0], seq_lens=seq_lens, dtypes=_csv(args.dtypes) or clauses.DTYPES, repeats=repeats,
            warmup=args.warmup, memory=not args.no_memory, progress=_progress,
        )  # fmt: skip
    print(clauses.format_clauses(result), file=out)
    _write_json(args, result, out)
    return 0


def run_packed(args: argparse.Namespace, out: TextIO) -> int:
    if args.device != "cpu":
        print("attnkit bench: --what packed measures the CPU backends (--device cpu)", file=sys.stderr)
        return 2
    repeats = args.repeats if args.repeats is not None else 3
    with torch_threads(args.threads):
        result = packed.bench_packed(
            repeats=repeats, warmup=args.warmup, memory=not args.no_memory, backends=_csv(args.backends),
            document_len=args.seq_len // packed.DOCUMENTS if args.seq_len else packed.DOCUMENT_LEN,
        )  # fmt: skip
    print(packed.format_packed(result), file=out)
    _write_json(args, result, out)
    return 0


def run_context_parallel(args: argparse.Namespace, out: TextIO) -> int:
    if args.device != "cpu":
        print("attnkit bench: --what context-parallel runs gloo groups of CPU processes (--device cpu)",
              file=sys.stderr)  # fmt: skip
        return 2
    result = context_parallel.bench_context_parallel(
        world=args.world,
        seq_len=args.seq_len or context_parallel.SHAPE["seq_len"],
        runs=context_parallel.RUNS[:1] if args.quick else context_parallel.RUNS,  # quick: one group's start-up
        repeats=args.repeats if args.repeats is not None else 2,
        threads=args.threads or 1,
        backend=(_csv(args.backends) or ("auto",))[0],
        progress=_progress,
    )
    print(context_parallel.format_context_parallel(result), file=out)
    _write_json(args, result, out)
    return 0


def run_decode(args: argparse.Namespace, out: TextIO) -> int:
    if args.device != "cpu":
        print("attnkit bench: --what decode measures CPU decode steps (--device cpu)", file=sys.stderr)
        return 2
    threads = args.threads or 1  # one thread unless asked: a decode step's cost, not a second core's wake-up
    limit_jax_threads(threads)
    with torch_threads(threads):
        result = decode.bench_decode(
            steps=args.steps or decode.STEPS,
            seen=args.seen_signatures or decode.SEEN_LENGTHS,
            new_tokens=args.new_tokens or decode.NEW_TOKENS,
            repeats=args.repeats if args.repeats is not None else decode.REPEATS,
            progress=_progress,
        )
    print(decode.format_decode(result), file=out)
    _write_json(args, result, out)
    return 0


def run_calibrate(args: argparse.Namespace, out: TextIO) -> int:
    limit_jax_threads(args.threads)
    shapes = calibrate.QUICK_SHAPES if args.quick else calibrate.CALIBRATION_SHAPES
    dtypes = _csv(args.dtypes) or calibrate.CALIBRATION_DTYPES
    repeats = args.repeats if args.repeats is not None else 5
    with torch_threads(args.threads):
        result = calibrate.calibrate(
            device=args.device,
            dtypes=dtypes,
            shapes=shapes,
            repeats=repeats,
            warmup=args.warmup,
            only=_csv(args.backends),
            progress=_progress,
        )
    command = "attnkit " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "attnkit bench --calibrate"
    table = calibrate.render_table(result, command)
    print(calibrate.format_calibration(result), file=out)
    if args.output:
        Path(args.output).write_text(table)
        print(f"# wrote {args.output} ({len(result['entries'])} entries)", file=out)
    else:
        print(table, file=out, end="")
    _write_json(args, result, out)
    return 0
