#!/usr/bin/env bash
# The whole GPU benchmark in a few minutes, on a machine with CUDA JAX and no network.
#
#   benchmarks/gpu.sh --prepare     # here, with network: fetch wheels for the GPU host
#   benchmarks/gpu.sh               # there: run; results in $OUT (default benchmarks/results/gpu)
#
# It needs only what a CUDA JAX machine has plus this project: the project is used from
# the source tree (PYTHONPATH, no build). When the machine's orbax-checkpoint is older
# than our floor (or missing), the wheels in benchmarks/wheels (made by --prepare for
# Python $PYVER, no dependencies: the machine has the rest) go into a private folder
# first on PYTHONPATH; the machine's own packages are not touched.
set -euo pipefail
cd "$(dirname "$0")/.."
ORBAX_FLOOR=0.12.8 # pyproject.toml's floor (NumpyHandler(deepcopy_host_arrays=False))

if [ "${1:-}" = "--prepare" ]; then
  python3 -m pip download --dest benchmarks/wheels --no-deps --only-binary=:all: \
    --python-version "${PYVER:-3.12}" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux2014_x86_64 "orbax-checkpoint>=$ORBAX_FLOOR" tensorstore etils
  exit 0
fi

OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
python3 -c "import jax; print(jax.__version__, jax.devices()); assert jax.default_backend() == 'gpu'"
orbax_ok() {
  python3 - "$ORBAX_FLOOR" <<'PY'
import importlib.metadata, sys
def v(s): return tuple(int(p) for p in s.split(".")[:3])
try:
    found = importlib.metadata.version("orbax-checkpoint")
except importlib.metadata.PackageNotFoundError:
    sys.exit(1)
print("orbax-checkpoint", found)
sys.exit(0 if v(found) >= v(sys.argv[1]) else 1)
PY
}
if ! orbax_ok; then
  if ! ls benchmarks/wheels/*.whl >/dev/null 2>&1; then
    echo "orbax-checkpoint < $ORBAX_FLOOR and no benchmarks/wheels (run benchmarks/gpu.sh --prepare)" >&2
    exit 2
  fi
  SITE="${TMPDIR:-/tmp}/jax_cb_ckpt_site"
  python3 -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target "$SITE" \
    benchmarks/wheels/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  orbax_ok
fi
python3 -c "import matplotlib" || { echo "matplotlib is missing" >&2; exit 2; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" || true
# Issue 22's checks first, each writing its report as it goes (a timeout keeps results);
# about 9 minutes in all on an H200 host (2026-12-04: the first four parts ~105 s, the last ~155 s).
# 1. The two crossings bit for bit, and the device wait per 64/256 MB save.
timeout 110 python3 -m benchmarks.gpu_check --out "$OUT" 2>&1 | tee "$OUT/gpu_check.txt" || true
# 2. A save that does not fire: maybe_save and ckpt.scan against bare, per XLA config.
timeout 130 python3 -m benchmarks.gpu_cost --reps 3 --child-timeout 60 --out "$OUT/cost" 2>&1 | tee "$OUT/cost.txt" || true
# 5. Per-device saves (shardings=, pmap, shard_map; int4/uint4/int2) bit for bit.
timeout 60 python3 -m benchmarks.gpu_devices --out "$OUT/devices" 2>&1 | tee "$OUT/devices.txt" || true
# 4. The host's writer next to its disk's write+fsync (same run).
timeout 80 python3 -m benchmarks.writer --quick --only tiny,256MiB --out "$OUT/writer" \
  2>&1 | tee "$OUT/writer.txt" || true
# The benchmark suite's short GPU profile with what time is left.
timeout 180 python3 -m benchmarks.run --gpu --reps 3 --out "$OUT" 2>&1 | tee "$OUT/log.txt"
