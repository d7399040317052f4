#!/usr/bin/env bash
# The main job: a Qwen3-30B-A3B-shaped MoE layer. With a GPU it is checked against the f64 CPU
# reference and timed (latency and % of the measured copy bandwidth); without one the kernels are
# rendered and compiled for sm_90a, sm_100a and sm_120a and the CPU reference runs.
#   bash scripts/example.sh [--format FORMAT] [--act-dtype bf16|fp16] [--m TOKENS]
# The arguments go to the example (`--help` lists them); a leading `--` is dropped, so
# `bash scripts/example.sh -- --format fp8_e4m3` works too.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--" ]; then
  shift
fi
bash scripts/setup-cuda.sh
cargo run --release -q --example qwen3_decode -- "$@"
