#!/usr/bin/env bash
# Installs the pinned NVRTC and CUDA headers (PyPI wheels, CUDA 13.0 to match the GPU machines'
# driver) into .cuda/ when no CUDA toolkit is found. Idempotent; prints the root it settled on.
set -euo pipefail
cd "$(dirname "$0")/.."
for root in "${CUDA_HOME:-}" "${CUDA_PATH:-}" .cuda/nvidia/cu13 /usr/local/cuda; do
  if [ -n "$root" ] && [ -f "$root/include/cuda_bf16.h" ] && ls "$root"/lib*/libnvrtc.so* >/dev/null 2>&1; then
    echo "CUDA toolkit: $root"; exit 0
  fi
done
echo "No CUDA toolkit found: installing the pinned NVRTC wheels into .cuda/ ..."
python3 -m pip install --quiet --disable-pip-version-check --no-deps --target .cuda \
  'nvidia-cuda-nvrtc==13.0.88' 'nvidia-cuda-runtime==13.0.96' 'nvidia-cuda-crt==13.0.88'
test -f .cuda/nvidia/cu13/include/cuda_bf16.h
echo "CUDA toolkit: .cuda/nvidia/cu13"
