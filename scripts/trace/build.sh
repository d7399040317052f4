#!/usr/bin/env bash
# Builds libcupti_trace.so on a machine with the CUDA toolkit (the lent GPU machines).
# Use: CUDA_INJECTION64_PATH=$PWD/libcupti_trace.so MOE_TRACE_OUT=k.csv ./program; then
# python3 summarize.py k.csv.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cuda=${CUDA_HOME:-/usr/local/cuda}
inc=$(dirname "$(find "$cuda"/ -name cupti_activity.h 2>/dev/null | head -1)")
lib=$(dirname "$(find "$cuda"/ -name 'libcupti.so*' 2>/dev/null | head -1)")
# The newest kernel record the header declares; its leading fields are what the tracer reads.
rec=$(grep -o 'CUpti_ActivityKernel[0-9]*;' "$inc"/cupti_activity*.h | sed 's/.*://; s/;//' | sort -V | tail -1)
echo "cupti headers $inc, library $lib, record $rec"
gcc -O2 -shared -fPIC -DKREC="$rec" -I"$cuda/include" -I"$inc" "$here/cupti_trace.c" \
  -o "$here/libcupti_trace.so" -L"$lib" -lcupti -Wl,-rpath,"$lib"
