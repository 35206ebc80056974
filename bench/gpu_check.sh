#!/usr/bin/env bash
# Kernel check on one GPU (sized for an H200, ~8 minutes): install, the gpu-marked kernel tests
# (bf16 and full-size shapes), then the benchmark table. Results land in $OUT (default bench_out/).
#
# The GPU machine has no internet: put the wheels it lacks (liger-kernel and, if missing there,
# the test extras) in a folder and point WHEELS at it, e.g. on a networked machine
#   pip download liger-kernel pytest pytest-timeout hypothesis --no-deps -d wheels/
# Without liger-kernel the benchmark still runs and its Liger rows read "n/a".
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
OUT=${OUT:-bench_out}
mkdir -p "$OUT"

pip_args=(--quiet --disable-pip-version-check --no-build-isolation)
[ -d "$WHEELS" ] && pip_args+=(--no-index --find-links "$WHEELS")
# Keep the machine's CUDA build of torch: if the full install cannot resolve offline, install
# megalite alone (the kernels need only torch and triton, which a GPU image already has).
$PY -m pip install "${pip_args[@]}" -e '.[test]' 2>/dev/null ||
    $PY -m pip install "${pip_args[@]}" --no-deps -e . ||
    { echo "could not install megalite"; exit 1; }
$PY -m pip install "${pip_args[@]}" --no-deps liger-kernel 2>/dev/null ||
    echo "liger-kernel not installed: its benchmark rows will read n/a"
$PY -c "import liger_kernel" 2>/dev/null && echo "liger-kernel importable" || echo "liger-kernel not importable"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "== pytest -m gpu tests/kernels"
timeout 240 $PY -m pytest -m gpu tests/kernels -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt"
test_rc=${PIPESTATUS[0]}

echo "== bench/kernels.py"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout 300 $PY bench/kernels.py --json "$OUT/kernels.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/kernels.md"
bench_rc=${PIPESTATUS[0]}

echo "pytest exit $test_rc, bench exit $bench_rc"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
