#!/usr/bin/env bash
# The first command on a GPU machine (docs/gpu.md): installs the carried wheels (.whl/, from scripts/gpu_wheels.sh)
# and attnkit without a registry, then runs scripts/gpu_check.py, which checks every CUDA backend, runs the GPU
# tests and the benches, and writes gpu_check.json and gpu_check.md to $OUT (else ./gpu_check_out). Exits non-zero
# if any step failed. Arguments go to the driver: --dry-run prints the plan; --device cpu runs it all on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
GPU_CHECK_STARTED=$(date +%s)  # the driver's 6-minute budget counts from here, the installs included
export GPU_CHECK_STARTED
PY=${PYTHON:-python3}

for arg in "$@"; do
    if [ "$arg" = --dry-run ] || [ "$arg" = -h ] || [ "$arg" = --help ]; then
        exec "$PY" scripts/gpu_check.py "$@"
    fi
done

# The wheels go to a folder of their own on PYTHONPATH, never into the image's environment: --no-deps, so pip
# can never replace the image's torch, triton, jax or cupy. Only where attnkit's own needs are missing (the GPU
# image): the wheels are built for its Python 3.12, and an environment that has them keeps its own.
if ! "$PY" -c 'import pydantic, tomli_w' 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    site=${GPU_CHECK_SITE:-/tmp/attnkit_site}
    echo "gpu_check.sh: installing $(find .whl -type f -name '*.whl' | wc -l) wheels from .whl/ into $site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "gpu_check.sh: FAILED to install .whl/" >&2; exit 1; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

# attnkit itself, editable, with no dependency and no build isolation (the image's setuptools builds it; no
# registry is reachable there). Skipped when this checkout is already what `import attnkit` finds.
here=$(pwd -P)
found=$("$PY" -c 'import attnkit, os; print(os.path.realpath(os.path.dirname(attnkit.__file__)))' 2>/dev/null)
if [ "$found" != "$here/attnkit" ]; then
    echo "gpu_check.sh: pip install --no-deps --no-build-isolation --no-index -e ."
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
        || { echo "gpu_check.sh: FAILED to install attnkit (pip install -e .)" >&2; exit 1; }
fi
"$PY" -c 'import attnkit, pydantic' \
    || { echo "gpu_check.sh: FAILED: attnkit does not import (missing wheels? run scripts/gpu_wheels.sh)" >&2; exit 1; }
echo "gpu_check.sh: installs took $(($(date +%s) - GPU_CHECK_STARTED))s"

exec "$PY" scripts/gpu_check.py "$@"
