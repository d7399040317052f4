#!/usr/bin/env bash
# Installs the pinned NVRTC and CUDA headers (PyPI wheels, CUDA 13.0 to match the GPU machines'
# driver) when no CUDA toolkit is found, into a per-user cache that does not depend on the source
# tree: $MOEFORGE_CUDA_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/moeforge/cuda (the toolkit root
# is nvidia/cu13 under it). moe-runtime (src/toolkit.rs) searches the same roots in the same order:
# $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, then that cache, so whatever this installs is found by
# every binary and test run as the same user with the same environment.
#
# Idempotent, and fast when already installed: nothing is downloaded when a toolkit is found or
# the cache holds exactly the pinned versions. Prints the root it settled on.
set -euo pipefail
cd "$(dirname "$0")/.."

PINS=(nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88)

# The XDG rule moe-runtime uses (the `dirs` crate): $XDG_CACHE_HOME only if absolute.
cache=${XDG_CACHE_HOME:-}
case $cache in /*) ;; *) cache=$HOME/.cache ;; esac
dir=${MOEFORGE_CUDA_DIR:-$cache/moeforge/cuda}
pinned=$dir/nvidia/cu13

# A usable root: the headers NVRTC needs and a libnvrtc beside them.
usable() { [ -n "$1" ] && [ -f "$1/include/cuda_bf16.h" ] && ls "$1"/lib*/libnvrtc.so* >/dev/null 2>&1; }
# A pip --target dir holding a usable root and exactly the pinned wheel versions.
pinned_ok() {
  usable "$1/nvidia/cu13" || return 1
  local pin name
  for pin in "${PINS[@]}"; do
    name=${pin%%==*}
    [ -d "$1/${name//-/_}-${pin##*==}.dist-info" ] || return 1
  done
}

for root in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
  if usable "$root"; then
    echo "CUDA toolkit: $root"
    exit 0
  fi
done
if pinned_ok "$dir"; then
  echo "CUDA toolkit: $pinned"
  exit 0
fi

# Install into a fresh directory beside the target and rename it into place, so that an
# interrupted install or a concurrent run never leaves a half-filled cache behind.
mkdir -p "$(dirname "$dir")"
tmp=$(mktemp -d "$dir.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
if pinned_ok .cuda; then
  # A checkout set up by an earlier version of this script: reuse its install, no download.
  echo "No CUDA toolkit found: copying the pinned NVRTC wheels from .cuda/ into $dir ..."
  cp -a .cuda/. "$tmp/"
else
  echo "No CUDA toolkit found: installing the pinned NVRTC wheels into $dir ..."
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$tmp" "${PINS[@]}"
fi
pinned_ok "$tmp" || { echo "the pinned wheels did not install a usable toolkit into $tmp" >&2; exit 1; }
if [ -e "$dir" ] && ! pinned_ok "$dir"; then
  rm -rf "$dir" # another version, or a broken install
fi
if ! mv -T "$tmp" "$dir" 2>/dev/null; then
  # A concurrent run got there first: fine if what it installed is the pinned set.
  pinned_ok "$dir" || { echo "could not move the install into $dir" >&2; exit 1; }
fi
echo "CUDA toolkit: $pinned"
