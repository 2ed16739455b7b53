#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over tools/sanitize_cases.py, which runs every
# CUDA kernel and configuration branch once. PyTorch's caching allocator is turned off so that out-of-bounds
# accesses land outside a real allocation. Prints one summary line per tool; exit status non-zero on any error.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
CS="${COMPUTE_SANITIZER:-compute-sanitizer}"
command -v "$CS" >/dev/null || CS=/usr/local/cuda/bin/compute-sanitizer
status=0
for tool in memcheck racecheck initcheck synccheck; do
  log="/tmp/sanitize-$tool.log"
  # Only our kernels (all in namespace fused_mlp::) are checked: cuBLAS and PyTorch kernels are not ours.
  "$CS" --tool "$tool" --kernel-name kns=fused_mlp --error-exitcode 97 python3 tools/sanitize_cases.py > "$log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|sanitize cases done" "$log" | tr '\n' ' ')
  echo "$tool: exit $rc; $summary"
  [ $rc -ne 0 ] && status=1 && grep -m 20 -E "Invalid|Race|Uninitialized|barrier|MISMATCH|Error" "$log"
done
exit $status
