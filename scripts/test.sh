#!/usr/bin/env bash
# The test command: everything CI checks, on a machine with or without a GPU.
# Installs what it needs on a fresh machine (pinned NVRTC + CUDA headers into .cuda/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-cuda.sh
export CARGO_TERM_COLOR=never
echo "== format and lints"
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
echo "== tests (GPU tests are #[ignore]d here; see README: GPU tests)"
# every_variant_compiles_for_every_arch compiles the same set as `moe-jit check` below: run once.
cargo test --workspace -- --skip every_variant_compiles_for_every_arch
echo "== every kernel variant compiles with NVRTC for sm_90a, sm_100a, sm_120a"
cargo run --release -q -p moe-runtime --bin moe-jit -- check --arch sm_90a,sm_100a,sm_120a
echo "== downstream crate (depends on moeforge by path, as a crates.io user would)"
cargo run -q --manifest-path examples/downstream/Cargo.toml
echo "== all checks passed"
