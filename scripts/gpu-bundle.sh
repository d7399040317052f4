#!/usr/bin/env bash
# Builds the GPU test, benchmark and example binaries here (release) and gathers them, stripped,
# with scripts/gpu-run.sh into gpu-bundle/ (git-ignored): copy that folder to a GPU machine that
# has no Rust toolchain and run `bash gpu-bundle/run.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-cuda.sh >/dev/null
rm -rf gpu-bundle && mkdir -p gpu-bundle
bin() { # the executable cargo reported for target $1 (rest: the cargo command)
  local name=$1; shift
  cargo "$@" --message-format=json 2>/dev/null | NAME=$name python3 -c '
import json, os, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == os.environ["NAME"]:
        print(m["executable"])'
}
for t in ${TESTS:-gpu_decode gpu_formats gpu_prefill gpu_layer gpu_interop gpu_ep gpu_dispatch gpu_fused}; do
  cp "$(bin $t test --release -p moe-runtime --test $t --no-run | tail -1)" gpu-bundle/$t
done
# Tests of the facade crate (the macro's paths are ::moeforge::...).
for f in tests/gpu_*.rs; do
  [ -e "$f" ] || continue
  t=$(basename "$f" .rs)
  cp "$(bin $t test --release -p moeforge --test $t --no-run | tail -1)" gpu-bundle/$t
done
# The checkpoint loader's GPU test.
cp "$(bin gpu_checkpoint test --release -p moe-checkpoint --test gpu_checkpoint --no-run | tail -1)" gpu-bundle/gpu_checkpoint
cp "$(bin cold_start bench --bench cold_start --no-run | tail -1)" gpu-bundle/cold_start
cp "$(bin caller_owned build --release --example caller_owned | tail -1)" gpu-bundle/caller_owned
# Expert parallelism (gpu_ep above, ep_ranks, the ep bench) needs a machine with 2+ GPUs.
cp "$(bin ep_ranks build --release --example ep_ranks | tail -1)" gpu-bundle/ep_ranks
[ -n "${TESTS_ONLY:-}" ] && { strip gpu-bundle/* && cp scripts/gpu-run.sh gpu-bundle/run.sh; cp -r scripts/trace gpu-bundle/trace; du -sh gpu-bundle; exit 0; }
cp "$(bin decode bench --bench decode --no-run | tail -1)" gpu-bundle/decode
cp "$(bin prefill bench --bench prefill --no-run | tail -1)" gpu-bundle/prefill
cp "$(bin dispatch bench --bench dispatch --no-run | tail -1)" gpu-bundle/dispatch
cp "$(bin ep bench --bench ep --no-run | tail -1)" gpu-bundle/ep
cp "$(bin qwen3_decode build --release --example qwen3_decode | tail -1)" gpu-bundle/qwen3_decode
cargo build --release -q -p moe-jit && cp target/release/moe-jit gpu-bundle/
strip gpu-bundle/* && cp scripts/gpu-run.sh gpu-bundle/run.sh && cp -r scripts/trace gpu-bundle/trace
du -sh gpu-bundle
