#!/usr/bin/env bash
# One call on the GPU machine: configure and build, run the gpu-labelled tests (plain and
# under compute-sanitizer memcheck), the CUDA memory demo, PyTorch's _memory_viz on the
# snapshots, and the benchmarks. Logs land in $OUT (or ./gpu-out).
#   bash bench/run_gpu.sh [--no-sanitizer] [--no-bench]
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
SAN=1; BENCH=1
for a in "$@"; do
  case $a in --no-sanitizer) SAN=0 ;; --no-bench) BENCH=0 ;; esac
done
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
log "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"

B=build-gpu
t0=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DTALLY_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  > "$OUT/configure.log" 2>&1 || { log "configure FAILED"; tail -30 "$OUT/configure.log"; exit 1; }
cmake --build $B -j 16 > "$OUT/build.log" 2>&1 || { log "build FAILED"; grep -E "error" "$OUT/build.log" | head -30; exit 1; }
log "build ok in $(( $(date +%s) - t0 )) s"

export TALLY_SNAPSHOT_DIR=$OUT
ctest --test-dir $B -L gpu --output-on-failure > "$OUT/ctest_gpu.log" 2>&1
log "gpu tests: $(grep -E 'tests passed|tests failed' "$OUT/ctest_gpu.log")"
grep -E "\*\*\*Failed|Skipped" "$OUT/ctest_gpu.log" | head -20 | tee -a "$OUT/summary.txt"

if [ $SAN = 1 ] && command -v compute-sanitizer >/dev/null; then
  fails=0
  for t in $B/tests/test_cuda_allocator $B/tests/test_*_cuda; do
    [ -x "$t" ] || continue
    # API errors are off: the OOM tests make cudaMalloc fail on purpose.
    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 "$t" >> "$OUT/memcheck.log" 2>&1 || fails=$((fails+1))
  done
  log "compute-sanitizer memcheck: $fails binaries with errors"
fi

./$B/examples/memory_demo --device cuda --snapshot "$OUT/memory_demo_cuda.pickle" > "$OUT/memory_demo.txt" 2>&1
log "memory_demo --device cuda: exit $?"
for snap in "$OUT/memory_demo_cuda.pickle" "$OUT/tally_cuda_snapshot.pickle"; do
  [ -f "$snap" ] || { log "missing $snap"; continue; }
  name=$(basename "$snap" .pickle)
  python3 tests/memory/check_memviz.py "$snap" "$OUT/memviz_$name" > "$OUT/memviz_$name.log" 2>&1
  log "_memory_viz on $name: exit $? ($(tail -1 "$OUT/memviz_$name.log"))"
  python3 tests/memory/check_snapshot.py "$snap" > /dev/null 2>&1; log "check_snapshot $name: exit $?"
done

if [ $BENCH = 1 ]; then
  for b in $B/bench/bench_allocator $B/bench/bench_cpu_ops; do
    [ -x "$b" ] || continue
    "$b" --benchmark_min_time=0.5 > "$OUT/$(basename $b).txt" 2>&1
    log "$(basename $b): exit $?"
  done
  [ -f bench/ops_gpu.py ] && python3 bench/ops_gpu.py $B > "$OUT/ops_gpu.txt" 2>&1; log "ops_gpu: exit $?"; grep -v "^JSON" "$OUT/ops_gpu.txt" | tee -a "$OUT/summary.txt"
fi
# keep only a few files for the way back
tar czf "$OUT/memviz_outputs.tgz" -C "$OUT" $(cd "$OUT" && ls -d memviz_*/ 2>/dev/null) 2>/dev/null
rm -rf "$OUT"/memviz_*/ "$OUT"/*.pickle
# at most 8 files come back: fold the logs into one
for f in configure.log build.log memviz_*.log gpu.txt; do
  [ -f "$OUT/$f" ] && { echo "##### $f"; cat "$OUT/$f"; } >> "$OUT/logs.txt" && rm -f "$OUT/$f"
done
