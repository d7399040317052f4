#!/usr/bin/env bash
# The test command: everything CI checks, on a machine with or without a GPU.
# Installs what it needs on a fresh machine (pinned NVRTC + CUDA headers into the user cache,
# $MOEFORGE_CUDA_DIR else ~/.cache/moeforge/cuda, unless a CUDA toolkit is found).
#
# One cargo profile (dev) for every stage, and one kernel cache for every stage: `moe-jit check`
# compiles the reference set (every variant, all three archs) in parallel into it, and the tests
# that compile the same modules (nvrtc_variants, moe_jit_cli) read them back. The cache key is the
# blake3 of source, NVRTC version, options and arch, so a kept cache only saves time and an empty
# one (CI) compiles each module once. Every stage runs; the wall time of each is printed at the
# end, and the exit status is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
export MOEFORGE_CACHE_DIR="${MOEFORGE_CACHE_DIR:-$PWD/target/kernel-cache}"

names=()
secs=()
cpus=()
status=()
t_start=${EPOCHREALTIME/./}
tick=$(getconf CLK_TCK)

# CPU seconds (user + system, in 1/CLK_TCK) of this shell's finished children, theirs included.
children_cpu() {
  local stat
  stat=$(cat /proc/$$/stat)
  local f=(${stat##*) })
  echo $((f[13] + f[14]))
}

# stage NAME COMMAND...: run it, time it, remember how it ended.
stage() {
  local name=$1
  shift
  echo "== $name"
  local t0=${EPOCHREALTIME/./} c0
  c0=$(children_cpu)
  "$@"
  local rc=$?
  local us=$((${EPOCHREALTIME/./} - t0)) cpu=$(($(children_cpu) - c0))
  names+=("$name")
  secs+=("$((us / 1000000)).$((us / 100000 % 10))")
  cpus+=("$((cpu / tick)).$((cpu * 10 / tick % 10))")
  status+=("$([ $rc -eq 0 ] && echo ok || echo "FAILED ($rc)")")
  return 0
}

report() {
  local us=$((${EPOCHREALTIME/./} - t_start)) failed=0 i
  echo
  echo "== wall time per stage ($(nproc) cores; kernel cache $MOEFORGE_CACHE_DIR)"
  printf '%-58s %9s %9s\n' "stage" "wall" "cpu"
  for i in "${!names[@]}"; do
    printf '%-58s %7s s %7s s  %s\n' "${names[$i]}" "${secs[$i]}" "${cpus[$i]}" "${status[$i]}"
    [ "${status[$i]}" = ok ] || failed=1
  done
  printf '%-58s %7s s\n' "total" "$((us / 1000000)).$((us / 100000 % 10))"
  echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
  if [ $failed -eq 0 ]; then echo "== all checks passed"; else echo "== SOME CHECKS FAILED"; fi
  return $failed
}

stage "NVRTC and CUDA headers (scripts/setup-cuda.sh)" bash scripts/setup-cuda.sh
stage "rustfmt" cargo fmt --all --check
stage "clippy -D warnings" cargo clippy --workspace --all-targets -- -D warnings
stage "build: tests and moe-jit (dev profile)" cargo test --workspace --no-run
# The library depends on what it needs: the CLI's (clap, tracing-subscriber) live in moe-jit, and
# rand only behind the `testing` feature, and cudarc's f16 (which brings half's rand features)
# only behind the `f16` one, which the facade turns on by default.
stage "library dependencies: no clap, tracing-subscriber or rand" bash -c \
  't=$(cargo tree -p moe-runtime -e normal --prefix depth) && ! grep -E "^[0-9]+(clap|tracing-subscriber|rand) " <<<"$t"'
stage "moe-jit check: every variant x sm_90a,sm_100a,sm_120a" \
  cargo run -q -p moe-jit -- check --arch sm_90a,sm_100a,sm_120a
# every_variant_compiles_for_every_arch compiles the set `moe-jit check` just did: cache hits.
# GPU tests are #[ignore]d here (see README: GPU tests).
stage "cargo test --workspace" cargo test --workspace
# The downstream crate depends on moeforge by path, as a crates.io user would. Its own workspace,
# built into this target dir: the dependencies it shares with the workspace are built once.
stage "downstream crate (examples/downstream): its tests, then the crate" bash -c \
  'export CARGO_TARGET_DIR="$PWD/target"; cargo test -q --manifest-path examples/downstream/Cargo.toml &&
   cargo run -q --manifest-path examples/downstream/Cargo.toml'
# Every crate packages for crates.io (the .crate files, their contents and sizes) and builds from
# its package alone, as `cargo publish --dry-run` does (about 75 s on 2 cores; PACKAGE_VERIFY=0
# packages without those builds).
stage "cargo publish dry run: every crate packaged and built alone (scripts/package-check.sh)" \
  bash scripts/package-check.sh $([ "${PACKAGE_VERIFY:-1}" = 1 ] || echo --no-verify)
report
