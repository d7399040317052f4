#!/usr/bin/env bash
# Runs on the GPU machine from the bundle made by scripts/gpu-bundle.sh: GPU tests, the example,
# then the decode report (REPORT=0 skips it; SWEEP=1 adds the tile sweep). Logs go to $OUT.
# On an H200 gpu_formats takes about 5.5 minutes, gpu_prefill and gpu_layer more than 7 each:
# where a call is limited to 10 minutes, run them one a call (TESTS=gpu_prefill TT=590 EXAMPLE=0 REPORT=0).
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/moeforge-out}; mkdir -p "$OUT"
export MOEFORGE_CACHE_DIR=/tmp/moecache CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} RUST_LOG=warn
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for t in ${TESTS-gpu_decode gpu_formats gpu_prefill gpu_layer gpu_interop gpu_macro gpu_dispatch gpu_fused gpu_checkpoint}; do
  echo "=== $t"
  timeout ${TT:-400} ./$t --ignored --nocapture --test-threads=1 ${FILTER:-} 2>&1 | tee -a "$OUT/tests.log" \
    | grep -E "m=1 |m=64|replay 3|bit-exact|test result|panicked|FAILED|error" | tail -60
done
[ "${EXAMPLE:-1}" = 1 ] && { echo "=== example"; timeout 120 ./qwen3_decode 2>&1 | tee "$OUT/example.log"; }
[ -n "${SWEEP:-}" ] && { echo "=== sweep"; timeout 240 ./decode --sweep 2>&1 | tee "$OUT/sweep.log"; }
[ "${REPORT:-1}" = 1 ] && { echo "=== report"; timeout 400 ./decode --report "$OUT/h100-decode.json" 2>&1 | tee "$OUT/bench.log"; }
true
