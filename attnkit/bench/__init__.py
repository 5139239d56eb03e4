"""Benchmarks behind ``attnkit bench``. Importing this package (or any module in it) imports neither torch nor JAX.

* :mod:`~attnkit.bench.timing`: the one timing loop every bench uses (warm-up, interleaved repeats that can be
  paired, medians) and the machine banner printed above every table.
* :mod:`~attnkit.bench.calls`: the calls benches time: random inputs, FLOP counts, the backend ``auto`` runs, and
  which backends run an interpreter (never timed as a path).
* :mod:`~attnkit.bench.peak_memory`: peak extra host memory of one call, measured in a fresh process (Linux).
* :mod:`~attnkit.bench.overhead`: ``--what dispatch``, what ``attend(..., backend="auto")`` adds to a direct call.
* :mod:`~attnkit.bench.chunked`: ``--what chunked`` and ``--what memory``, torch-chunked against SDPA and
  torch-naive.
* :mod:`~attnkit.bench.tflops`: ``--backend NAME``, one backend in TFLOP/s against its framework's own attention.
* :mod:`~attnkit.bench.targets`: ``--what targets``, the CPU performance targets.
* :mod:`~attnkit.bench.calibrate`: ``--calibrate``, the cost table of attnkit/cost.py.
* :mod:`~attnkit.bench.command`: the ``attnkit bench`` subcommand on top of them.

Results are plain dicts (JSON-ready); each module's ``format_*`` turns them into tables.
"""
