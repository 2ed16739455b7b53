#!/usr/bin/env bash
# compute-sanitizer over drivers that run every CUDA kernel and configuration branch once:
#   tools/sanitize_cases.py    every op (rms_norm, geglu/swiglu, linear/addmm) fwd+bwd, all dtypes, odd N, strides
#   tools/sanitize_rms_norm.py every rms_norm kernel branch (rows/wide, prefetch, smem dW, misaligned)
# Tools: memcheck, racecheck, initcheck, synccheck (SANITIZE_TOOLS narrows). PyTorch's caching allocator is off so
# out-of-bounds accesses land outside a real allocation; only our kernels (namespace fused_mlp) are checked.
# Prints one summary line per (tool, driver); exit status non-zero on any error or mismatch.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
CS="${COMPUTE_SANITIZER:-compute-sanitizer}"
command -v "$CS" >/dev/null || CS=/usr/local/cuda/bin/compute-sanitizer
tools="${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}"
drivers="${SANITIZE_DRIVERS:-tools/sanitize_cases.py tools/sanitize_rms_norm.py}"
per_run="${SANITIZE_TIMEOUT:-240}"
status=0
for tool in $tools; do
  for driver in $drivers; do
    log="/tmp/sanitize-$tool-$(basename "$driver" .py).log"
    timeout "$per_run" "$CS" --tool "$tool" --kernel-name kns=fused_mlp --error-exitcode 97 \
      python3 "$driver" > "$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|done|mismatch" "$log" | tail -n 2 | tr '\n' ' ')
    [ $rc -eq 124 ] && summary="TIMED OUT after ${per_run}s; $summary"
    echo "$tool $(basename "$driver"): exit $rc; $summary"
    if [ $rc -ne 0 ]; then
      status=1
      grep -m 40 -E -A6 "Invalid|Race reported|hazard|Uninitialized|barrier|MISMATCH|mismatch|Error|error" "$log" | head -n 80
    fi
  done
done
exit $status
