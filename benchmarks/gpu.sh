#!/usr/bin/env bash
# The whole GPU benchmark in a few minutes, on a machine with CUDA JAX and no network.
#
#   benchmarks/gpu.sh --prepare     # here, with network: fetch wheels for the GPU host
#   benchmarks/gpu.sh               # there: run; results in $OUT (default benchmarks/results/gpu)
#
# It needs only what a CUDA JAX machine has plus this project: the project is used from
# the source tree (PYTHONPATH, no build), and orbax-checkpoint / matplotlib come from
# benchmarks/wheels when the machine lacks them (made by --prepare for Python $PYVER).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  python3 -m pip download --dest benchmarks/wheels --only-binary=:all: \
    --python-version "${PYVER:-3.12}" --platform manylinux2014_x86_64 \
    orbax-checkpoint matplotlib
  exit 0
fi

OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
python3 -c "import jax; print(jax.__version__, jax.devices()); assert jax.default_backend() == 'gpu'"
for pkg in orbax.checkpoint matplotlib; do
  if ! python3 -c "import $pkg" 2>/dev/null; then
    if [ -d benchmarks/wheels ]; then
      python3 -m pip install --quiet --no-index --find-links benchmarks/wheels \
        "$( [ "$pkg" = orbax.checkpoint ] && echo orbax-checkpoint || echo "$pkg" )"
    else
      echo "missing $pkg and no benchmarks/wheels (run benchmarks/gpu.sh --prepare)" >&2
      exit 2
    fi
  fi
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" || true
# First the GPU buffer crossing, bit for bit and its device wait (never run on a GPU yet).
timeout 150 python3 -m benchmarks.gpu_check --out "$OUT" 2>&1 | tee "$OUT/gpu_check.txt" || true
timeout 280 python3 -m benchmarks.run --gpu --reps 3 --out "$OUT" 2>&1 | tee "$OUT/log.txt"
