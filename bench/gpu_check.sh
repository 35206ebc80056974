#!/usr/bin/env bash
# The GPU-only checks, on one GPU, in about 8 minutes (BUDGET_S, installs included). In order
# of importance, each under a timeout cut to what is left of the budget, so the script ends in
# time whatever hangs, and each reported PASS / FAIL / TIMEOUT at the end:
#
#   install      megalite into this python (keeping the machine's CUDA torch), liger-kernel if
#                a wheel is reachable
#   kernels_bf16 pytest -m gpu tests/kernels: every Triton kernel compiled, in bf16 and at full
#                size, against its plain-torch reference (forward and backward)
#   kernels_large  bench/gpu/gpu_large_check.py kernels: the cross-entropy at 20,480 tokens x 128,256
#                (past 2^31 elements), attention at 8K tokens, RMSNorm at 32K x 8192, bf16,
#                against fp32 references
#   nccl_1rank   torchrun --nproc_per_node 1 pretrain_gpt.py: the trainer on CUDA through the
#                real NCCL process group (TCP rendezvous, tp=pp=dp=1), --kernels triton, bf16
#   multirank    bench/gpu/gpu_trainer_check.py multirank: tp2, pp2 and dp2 + ZeRO-1 with both ranks
#                on the one GPU (over gloo with CUDA tensors: NCCL refuses two ranks on one
#                device), losses checked against a one-rank run
#   syncs        bench/gpu/gpu_trainer_check.py syncs: host syncs per training step
#                (torch.cuda.set_sync_debug_mode) and the step time; fails above one
#   mfu_torch, mfu_triton
#                llama-1b shape, bf16, 10 steps: MFU and tokens/s, eager (--kernels torch) and
#                with the Triton kernels; the eager run also records a timeline of its last
#                step (--profile-steps 10:11: timeline.json, timeline.png)
#   mfu_compile  the same, eager kernels with --compile (compiled bf16 blocks)
#   mfu_fp8      the same with the attention and MLP linears in FP8 (--fp8-format hybrid,
#                tensorwise then delayed; docs/fp8.md): tokens/s and MFU (bf16 peak) beside mfu_triton
#   memory       bench/gpu/gpu_large_check.py memory: the eager run's peak and state bytes against
#                the planner's estimate for the same flags
#   kernels_table  bench/gpu/kernels.py: Triton vs eager / torch.compile / Liger, with what is left
#
# Results in $OUT (default bench_out/): gpu_check.log (everything printed), multirank.json,
# syncs.json, kernels.json, kernels_large.json, memory.json, nccl_1rank.jsonl, mfu_triton.jsonl,
# mfu_torch.jsonl, mfu_compile.jsonl, timeline.json, timeline.png.
# Every Python piece also runs on CPU in a small mode (tests/unit/test_gpu_check.py).
#
# The GPU machine may have no internet: put the wheels it lacks (liger-kernel, the test extras)
# in a folder and point WHEELS at it, e.g. on a networked machine
#   pip download liger-kernel pytest pytest-timeout hypothesis --no-deps -d wheels/
# Without liger-kernel the kernel table still runs and its Liger rows read "n/a".
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
OUT=${OUT:-bench_out}
BUDGET_S=${BUDGET_S:-480}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
deadline=$((SECONDS + BUDGET_S))
declare -A status=()
order=()

say() { echo "$*" | tee -a "$LOG"; }

# cap N: N seconds, or what is left of the budget when that is less (at least 5)
cap() {
    local left=$((deadline - SECONDS))
    if [ "$left" -lt "$1" ]; then echo $((left > 5 ? left : 5)); else echo "$1"; fi
}

# run NAME SECONDS CMD...: CMD under a timeout of at most SECONDS, its output into the log;
# its exit status is kept in status[NAME] (124: timed out)
run() {
    local name=$1 secs rc
    secs=$(cap "$2")
    shift 2
    say "== $name (timeout ${secs} s, $((deadline - SECONDS)) s of the budget left)"
    timeout --kill-after=10 "$secs" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && say "$name: timed out after ${secs} s"
    status[$name]=$rc
    order+=("$name")
}

# metrics FILE LABEL: the median MFU and tokens/s of a metrics file's last 6 logged steps
metrics() {
    $PY - "$1" "$2" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])][-6:]
if not rows:
    sys.exit(f"{sys.argv[1]}: no logged step")
loss = [r["loss"] for r in rows]
mfu = statistics.median(r.get("mfu") or 0.0 for r in rows)
tps = statistics.median(r["tokens_per_s"] for r in rows)
print(f"{sys.argv[2]}: MFU {mfu:.1%}, {tps:,.0f} tokens/s (median of the last {len(rows)} "
      f"logged steps), losses {[round(x, 3) for x in loss]}")
if not all(x == x and abs(x) < 1e4 for x in loss):
    sys.exit(f"{sys.argv[2]}: non-finite loss")
EOF
}

pip_args=(--quiet --disable-pip-version-check --no-build-isolation)
[ -d "$WHEELS" ] && pip_args+=(--no-index --find-links "$WHEELS")
# Keep the machine's CUDA build of torch: if the full install cannot resolve offline, install
# megalite alone (the kernels need only torch and triton, which a GPU image already has).
install() {
    $PY -m pip install "${pip_args[@]}" -e '.[test]' 2>/dev/null ||
        $PY -m pip install "${pip_args[@]}" --no-deps -e . ||
        { echo "could not install megalite"; return 1; }
    $PY -m pip install "${pip_args[@]}" --no-deps liger-kernel 2>/dev/null ||
        echo "liger-kernel not installed: its benchmark rows will read n/a"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
}
run install 90 bash -c "$(declare -p PY pip_args); $(declare -f install); install"
[ "${status[install]}" -eq 0 ] || { say "FAIL install: stopping"; exit 1; }

run kernels_bf16 100 $PY -m pytest -m gpu tests/kernels -q -p no:cacheprovider

run kernels_large 60 $PY bench/gpu/gpu_large_check.py kernels --out "$OUT"

# A world of one through torchrun: NCCL with a TCP rendezvous, as on a cluster.
rm -f "$OUT/nccl_1rank.jsonl"
run nccl_1rank 60 $PY -m torch.distributed.run --standalone --nproc_per_node 1 pretrain_gpt.py \
    --config configs/tiny.yaml --kernels triton --precision bf16 --train-iters 20 \
    --eval-interval 0 --log-interval 5 --wandb-mode disabled --metrics-file "$OUT/nccl_1rank.jsonl"
if [ "${status[nccl_1rank]}" -eq 0 ]; then
    metrics "$OUT/nccl_1rank.jsonl" nccl_1rank 2>&1 | tee -a "$LOG" || status[nccl_1rank]=1
fi

run syncs 45 $PY bench/gpu/gpu_trainer_check.py syncs --device cuda --steps 5 --out "$OUT"

# Model MFU: llama-1b shape, bf16, one GPU; the median of the last 6 of 10 logged steps (the
# first ones include compilation and warm-up). Eager first: it also gives the timeline and the
# memory check (the planner is asked about the same flags).
MFU_FLAGS=(--config configs/llama-1b.yaml --train-iters 10 --micro-batch-size 4
    --global-batch-size 16 --eval-interval 0 --log-interval 1 --wandb-mode disabled)
for k in torch triton; do
    rm -f "$OUT/mfu_$k.jsonl"
    extra=()
    [ "$k" = torch ] && extra=(--profile-steps 10:11)  # the timeline, into $OUT
    run "mfu_$k" 80 $PY pretrain_gpt.py "${MFU_FLAGS[@]}" --kernels "$k" "${extra[@]}" \
        --metrics-file "$OUT/mfu_$k.jsonl"
    if [ "${status[mfu_$k]}" -eq 0 ]; then
        metrics "$OUT/mfu_$k.jsonl" "kernels=$k" 2>&1 | tee -a "$LOG" || status[mfu_$k]=1
    fi
    if [ "$k" = torch ]; then
        run memory 20 $PY bench/gpu/gpu_large_check.py memory --metrics "$OUT/mfu_torch.jsonl" \
            --out "$OUT" "${MFU_FLAGS[@]}" --kernels torch
    fi
done

# Compiled blocks (--compile: each layer through torch.compile, inductor's Triton on CUDA),
# the same flags and torch ops: its MFU and tokens/s beside mfu_torch's (compilation is in the
# first steps, outside the median of the last 6).
rm -f "$OUT/mfu_compile.jsonl"
run mfu_compile 150 $PY pretrain_gpt.py "${MFU_FLAGS[@]}" --kernels torch --compile \
    --metrics-file "$OUT/mfu_compile.jsonl"
if [ "${status[mfu_compile]}" -eq 0 ]; then
    metrics "$OUT/mfu_compile.jsonl" "compile, kernels=torch" 2>&1 | tee -a "$LOG" ||
        status[mfu_compile]=1
fi
# FP8 (docs/fp8.md): the same shape and kernels, the transformer layers' linears in FP8; MFU
# against the bf16 peak, so it reads beside mfu_triton's (FP8's speed-up is the ratio).
for r in tensorwise delayed; do
    rm -f "$OUT/mfu_fp8_$r.jsonl"
    run "mfu_fp8_$r" 80 $PY pretrain_gpt.py "${MFU_FLAGS[@]}" --kernels triton \
        --fp8-format hybrid --fp8-recipe "$r" --metrics-file "$OUT/mfu_fp8_$r.jsonl"
    if [ "${status[mfu_fp8_$r]}" -eq 0 ]; then
        metrics "$OUT/mfu_fp8_$r.jsonl" "fp8=$r" 2>&1 | tee -a "$LOG" || status[mfu_fp8_$r]=1
    fi
done

run multirank 80 $PY bench/gpu/gpu_trainer_check.py multirank --device cuda --steps 3 \
    --timeout 40 --out "$OUT"

# The kernel table last: it takes what is left of the budget (BENCH_ARGS narrows it, e.g.
# BENCH_ARGS="--impls megalite eager").
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
run kernels_table 300 $PY bench/gpu/kernels.py --json "$OUT/kernels.json" ${BENCH_ARGS:-}

say "== summary ($SECONDS s of a ${BUDGET_S} s budget)"
failed=0
for name in "${order[@]}"; do
    rc=${status[$name]}
    if [ "$rc" -eq 0 ]; then
        say "PASS    $name"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        say "TIMEOUT $name (exit $rc)"
        failed=1
    else
        say "FAIL    $name (exit $rc)"
        failed=1
    fi
done
[ "$failed" -eq 0 ] && say "gpu_check: all passed" || say "gpu_check: FAILED (see $LOG)"
exit "$failed"
