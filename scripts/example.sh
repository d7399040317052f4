#!/usr/bin/env bash
# The main job: a Qwen3-30B-A3B-shaped MoE layer. With a GPU it is checked against the f64 CPU
# reference and timed (latency and % of the measured copy bandwidth); without one the kernels are
# rendered and compiled for sm_90a, sm_100a and sm_120a and the CPU reference runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-cuda.sh
cargo run --release -q --example qwen3_decode -- "$@"
