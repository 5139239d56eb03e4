#!/usr/bin/env bash
# Fetches into .whl/ the wheels attnkit needs that the GPU image lacks (docs/gpu.md): run on a machine with a
# package registry, before scripts/gpu_check.sh on one without. The image (Python 3.12, x86-64) has numpy, torch,
# triton, jax, cupy, hypothesis and pytest, but no pydantic, pydantic-core, annotated-types, typing-inspection or
# tomli-w, and its typing-extensions may be older than the 4.16 pydantic 2.14 requires.
#
# Exact pins, so the install needs no resolver: pydantic pins pydantic-core to one version (==), and the check
# below reads that pin from the downloaded pydantic wheel, so a bumped pydantic cannot travel with the wrong core.
set -euo pipefail
cd "$(dirname "$0")/.."

PYDANTIC=2.14.4
PYDANTIC_CORE=2.50.5        # pydantic 2.14.4's Requires-Dist: pydantic-core==2.50.5
ANNOTATED_TYPES=0.8.0
TYPING_INSPECTION=0.4.5
TYPING_EXTENSIONS=4.16.0    # pydantic 2.14 and pydantic-core 2.50 require >= 4.16.0
TOMLI_W=1.2.0
PYTHON_VERSION=${GPU_WHEELS_PYTHON:-3.12}
PY=${PYTHON:-python3}

rm -rf .whl && mkdir .whl
# .gitignore keeps .whl/ out of git: copy it to the GPU machine beside the checkout.

platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    "${platforms[@]}" -d .whl \
    "pydantic==$PYDANTIC" "pydantic-core==$PYDANTIC_CORE" "annotated-types==$ANNOTATED_TYPES" \
    "typing-inspection==$TYPING_INSPECTION" "typing-extensions==$TYPING_EXTENSIONS" "tomli-w==$TOMLI_W"

# pydantic's own pin on pydantic-core must be the one fetched: a mismatch fails at `import pydantic` on the GPU.
pinned=$(unzip -p .whl/pydantic-"$PYDANTIC"-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
if [ "$pinned" != "$PYDANTIC_CORE" ]; then
    echo "gpu_wheels: pydantic $PYDANTIC requires pydantic-core==$pinned, not $PYDANTIC_CORE: fix the pins" >&2
    exit 1
fi
count=$(find .whl -type f -name '*.whl' | wc -l)
if [ "$count" -ne 6 ]; then
    echo "gpu_wheels: expected 6 wheels in .whl/, found $count" >&2
    exit 1
fi
ls -l .whl
