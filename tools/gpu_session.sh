#!/usr/bin/env bash
# Everything the GPU machine is needed for, in one call (the session's GPU minutes are few):
#   build the CUDA variant for that machine's torch, run the whole test suite on the GPU, compute-sanitizer
#   over the compact kernel set, then the benchmarks. Logs, CSVs and plots go under $OUT (fetched back).
# Usage on the GPU machine (with the wheels folder carried):  bash tools/gpu_session.sh [stages...]
# What comes back is kept to a few files (the device tool returns at most 8, the rest is dropped): $OUT/session.log
# (every stage's output tail), tests.txt, large.txt, failures.txt, sanitize.txt, $OUT/<device>/sweep.csv and e2e.csv (the
# benchmarks mirror their CSVs there).
# stages: build tests large props sanitize bench e2e example multigpu (default: build tests large sanitize bench)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/fused-mlp-out}"
mkdir -p "$OUT"
LOG="$OUT/session.log"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export FUSED_MLP_CUDA_CAPABILITIES="${FUSED_MLP_CUDA_CAPABILITIES:-9.0}"
# NVLink multicast stays off on shared multi-GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stages="${*:-build tests large sanitize bench}"
[ -f .whl/prelude.sh ] && source .whl/prelude.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
# The toolchain that builds the variant there (a device-built binary once crashed in C++ error paths where one
# built elsewhere did not: record what built it).
{ c++ --version | head -n 1; nvcc --version | tail -n 1; ldd --version | head -n 1; } 2>/dev/null
# CSV rows carry the git revision: the device copy has no .git, so pass FUSED_MLP_GIT_REV=$(git rev-parse --short HEAD).
export FUSED_MLP_GIT_REV="${FUSED_MLP_GIT_REV:-unknown}"
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }
for s in $stages; do
  case "$s" in
    build)
      stamp build
      python3 tools/build.py -j 16 2>&1 | tail -n 40 ;;
    tests)
      stamp tests
      # pytest-xdist spreads the suite over the machine's cores when it is installed; the full report goes to
      # $OUT/tests.txt (a killed run still leaves what it printed), the summary to the session log.
      xdist=""
      python3 -c "import xdist" 2>/dev/null && xdist="-n ${PYTEST_WORKERS:-8}"
      export FUSED_MLP_FAILURE_LOG="$OUT/failures.txt"
      timeout "${TEST_TIMEOUT:-420}" python3 -m pytest tests -q -rfE --tb=short --durations=15 -p no:cacheprovider \
        -m "not large_tensors" $xdist ${PYTEST_ARGS:-} > "$OUT/tests.txt" 2>&1
      echo "pytest exit $?"
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -n 60 ;;
    large)
      stamp large
      # Tensors of 2^31+ elements (10-45 GiB per case), one case at a time.
      export FUSED_MLP_FAILURE_LOG="$OUT/failures.txt"
      timeout "${LARGE_TIMEOUT:-300}" python3 -m pytest tests/robustness/test_large_tensors.py -q -rfEs --tb=short \
        --durations=12 -p no:cacheprovider -p no:xdist > "$OUT/large.txt" 2>&1
      echo "pytest exit $?"
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/large.txt" | tail -n 30 ;;
    props)
      stamp props
      # The large hypothesis sweep: >= 2000 fresh random examples per property test, each test split into
      # PROPS_SHARDS processes of 2000/PROPS_SHARDS examples with distinct seeds (one process per test did not
      # finish in 510 s on the H200 with 7 workers), one CPU thread each (half the examples run on the CPU).
      # Each failure (falsifying example and reproduction blob) goes to $OUT/failures.txt the moment it is
      # reported; every shard's summary line and time go to $OUT/props.txt.
      export FUSED_MLP_FAILURE_LOG="$OUT/failures.txt"
      shards="${PROPS_SHARDS:-2}"
      export FUSED_MLP_HYPOTHESIS_EXAMPLES=$(( (2000 + shards - 1) / shards ))
      mkdir -p /tmp/props
      pids=()
      for t in $(grep -oE "^def (test_[a-z0-9_]+)" tests/robustness/test_properties.py | cut -c5-); do
        for k in $(seq 1 "$shards"); do
          seed=$((1000 * k + RANDOM))
          ( s0=$(date +%s)
            OMP_NUM_THREADS=1 HYPOTHESIS_PROFILE=gpu timeout "${PROPS_TIMEOUT:-480}" python3 -m pytest \
              "tests/robustness/test_properties.py::$t" -q -rfE --tb=short -p no:cacheprovider -p no:xdist \
              --hypothesis-seed="$seed" > "/tmp/props/$t.$k.txt" 2>&1
            rc=$?
            echo "$t shard $k/$shards (seed $seed): exit $rc, $(( $(date +%s) - s0 )) s: $(tail -n 1 "/tmp/props/$t.$k.txt")" \
              >> "$OUT/props.txt" ) &
          pids+=($!)
        done
      done
      wait "${pids[@]}"
      cat "$OUT/props.txt"
      grep -h "^E   AssertionError" /tmp/props/*.txt | head -n 20 ;;
    sanitize)
      stamp sanitize
      # The whole report to a file; the session log gets the per-(tool, driver) summary lines, which a plain tail
      # of the hazard details once cut off.
      timeout "${SANITIZE_STAGE_TIMEOUT:-300}" bash tools/sanitize.sh > "$OUT/sanitize.txt" 2>&1
      echo "sanitize exit $?"
      grep -E "^(memcheck|racecheck|initcheck|synccheck) |last case started" "$OUT/sanitize.txt" ;;
    bench)
      stamp bench
      timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/sweep.py ${BENCH_ARGS:-} 2>&1 | tail -n 80 ;;
    e2e)
      stamp e2e
      timeout 300 python3 benchmarks/e2e.py ${E2E_ARGS:-} 2>&1 | tail -n 40 ;;
    example)
      stamp example
      timeout "${EXAMPLE_TIMEOUT:-150}" python3 example.py ${EXAMPLE_ARGS:-} 2>&1 | tail -n 30 ;;
    multigpu)
      stamp multigpu
      timeout 300 python3 -m pytest tests/models/test_distributed.py -q -rfEs 2>&1 | tail -n 30 ;;
    *) echo "unknown stage $s" ;;
  esac
done
stamp done
