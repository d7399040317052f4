#!/usr/bin/env bash
# Runs on the GPU machine from the bundle made by scripts/gpu-bundle.sh: GPU tests, the example,
# then the decode report (REPORT=0 skips it; SWEEP=1 adds the tile sweep). Logs go to $OUT.
# On an H200 gpu_formats takes about 5.5 minutes, gpu_prefill and gpu_layer more than 7 each:
# where a call is limited to 10 minutes, run them one a call (TESTS=gpu_prefill TT=590 EXAMPLE=0
# REPORT=0), or set DEADLINE (seconds from the start) so that each suite's timeout is cut to what
# is left and a suite with under 20 s left is skipped. Each suite's whole log: $OUT/<suite>.log.
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/moeforge-out}; mkdir -p "$OUT"
export MOEFORGE_CACHE_DIR=/tmp/moecache CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} RUST_LOG=warn
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
end=$(( $(date +%s) + ${DEADLINE:-86400} ))
for t in ${TESTS-gpu_decode gpu_formats gpu_prefill gpu_layer gpu_interop gpu_macro gpu_dispatch gpu_fused gpu_checkpoint}; do
  lim=${TT:-400}; left=$(( end - $(date +%s) ))
  [ $left -lt 20 ] && { echo "=== $t skipped: the deadline"; continue; }
  [ $lim -gt $left ] && lim=$left
  echo "=== $t (at most $lim s)"
  timeout $lim ./$t --ignored --nocapture --test-threads=1 ${FILTER:-} 2>&1 | tee "$OUT/$t.log" \
    | grep -E "m=1 |m=64|replay 3|bit-exact|test result|panicked|FAILED|error" | tail -60
  [ ${PIPESTATUS[0]} = 124 ] && echo "=== $t: timed out after $lim s (passed so far: $(grep -cE '(^|\.\.\. )ok$' "$OUT/$t.log"))"
done
[ "${EXAMPLE:-1}" = 1 ] && { echo "=== example"; timeout 120 ./qwen3_decode 2>&1 | tee "$OUT/example.log"; }
[ -n "${SWEEP:-}" ] && { echo "=== sweep"; timeout 240 ./decode --sweep 2>&1 | tee "$OUT/sweep.log"; }
[ "${REPORT:-1}" = 1 ] && { echo "=== report"; timeout 400 ./decode --report "$OUT/h100-decode.json" 2>&1 | tee "$OUT/bench.log"; }
true
