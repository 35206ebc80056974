#!/usr/bin/env bash
# Kernel check on one GPU (sized for an H200, ~9 minutes): install, the gpu-marked kernel tests
# (bf16 and full-size shapes), the benchmark table, then the training MFU of a 1B Llama shape
# with --kernels triton and torch. Results land in $OUT (default bench_out/).
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

echo "== model MFU: llama-1b shape, bf16, one GPU, --kernels triton vs torch"
mfu_rc=0
for k in triton torch; do
    rm -f "$OUT/mfu_$k.jsonl"
    timeout 150 $PY pretrain_gpt.py --config configs/llama-1b.yaml --kernels "$k" --train-iters 12 \
        --micro-batch-size 4 --global-batch-size 16 --eval-interval 0 --log-interval 1 \
        --wandb-mode disabled --metrics-file "$OUT/mfu_$k.jsonl" 2>&1 | tail -4 || mfu_rc=1
    # the median of the last 8 steps (the first ones include compilation and warm-up)
    $PY - "$OUT/mfu_$k.jsonl" "$k" <<'PY' || mfu_rc=1
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][-8:]
mfu = statistics.median(r["mfu"] for r in rows)
tps = statistics.median(r["tokens_per_s"] for r in rows)
print(f"kernels={sys.argv[2]}: MFU {mfu:.1%}, {tps:,.0f} tokens/s (median of the last {len(rows)} steps)")
PY
done

echo "pytest exit $test_rc, bench exit $bench_rc, mfu exit $mfu_rc"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$mfu_rc" -eq 0 ]
