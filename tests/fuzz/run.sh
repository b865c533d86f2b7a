#!/usr/bin/env bash
# Builds the fuzz targets (clang, libFuzzer, ASan + UBSan) and runs each for a bounded number
# of inputs with a fixed seed, starting from its committed corpus tests/fuzz/corpus/<name>/.
# Exit 0 when no target crashed, hung (-timeout), leaked or had a sanitizer report.
#
#   bash tests/fuzz/run.sh [name...]      # default: every target
#   TALLY_FUZZ_BUILD=build-fuzz (build folder), TALLY_FUZZ_RUNS=N (inputs per target, on top
#   of the corpus; default per target below), CXX_FUZZ=clang++ (the compiler)
#
# The targets are part of any build of the repository configured with
# -DTALLY_SANITIZE=fuzzer-no-link,address,undefined (clang). A build folder that exists is used
# as it is (.ci/run passes its ASan + UBSan build, build-asan: the targets only link there);
# one that does not is configured here with the library alone besides the targets.
#
# A failing input is saved as <build>/artifacts/<name>/crash-* (or timeout-, leak-, oom-);
# reproduce with `<build>/fuzz_<name> <file>`, fix, then add the file to the corpus.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${TALLY_FUZZ_BUILD:-build-fuzz}

# name, inputs, max input length
targets=(
  "idx 5000 4096"
  "cifar 5000 16384"
  "text 5000 4096"
  "safetensors 8000 4096"
  "alloc_conf 4000 1024"
  "checkpoint_spec 5000 64"
  "sizes 10000 256"
  "unpickle 8000 8192"
  "specs 10000 64"
)
if (($#)); then
  picked=()
  for name in "$@"; do
    found=""
    for t in "${targets[@]}"; do
      [ "${t%% *}" = "$name" ] && picked+=("$t") && found=1
    done
    [ -n "$found" ] || { echo "run.sh: no fuzz target '$name'" >&2; exit 2; }
  done
  targets=("${picked[@]}")
fi

# Configured as .ci/run's sanitizer builds: -O1 with line tables only (half the compile time
# of the default -O2 -g; reports keep their file:line).
if [ -f "$build/CMakeCache.txt" ] && grep -q '^CMAKE_HOME_DIRECTORY:.*/tests/fuzz$' "$build/CMakeCache.txt"; then
  echo "run.sh: $build was configured as the old project tests/fuzz; configuring it anew"
  rm -rf "$build"
fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="${CXX_FUZZ:-clang++}" \
    -DTALLY_SANITIZE=fuzzer-no-link,address,undefined -DTALLY_CUDA=OFF -DTALLY_BUILD_TESTS=OFF \
    -DTALLY_BUILD_EXAMPLES=OFF -DTALLY_BUILD_PYTHON=OFF -DTALLY_BUILD_BENCH=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo '-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG' >/dev/null
elif ! grep -q '^TALLY_SANITIZE:STRING=.*fuzzer-no-link' "$build/CMakeCache.txt"; then
  echo "run.sh: $build is not configured with -DTALLY_SANITIZE=fuzzer-no-link,address,undefined" >&2
  exit 2
fi
cmake --build "$build" --target $(for t in "${targets[@]}"; do echo "fuzz_${t%% *}"; done)

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
failed=()
for t in "${targets[@]}"; do
  read -r name runs max_len <<<"$t"
  runs=${TALLY_FUZZ_RUNS:-$runs}
  work="$build/work/$name"
  artifacts="$build/artifacts/$name"
  rm -rf "$work" "$artifacts"
  mkdir -p "$work" "$artifacts"
  echo "== fuzz_$name: $runs inputs after the corpus (tests/fuzz/corpus/$name)"
  start=$SECONDS
  # New inputs go to the first folder (scratch); the committed corpus is only read.
  if "$build/fuzz_$name" -seed=1 -runs="$runs" -max_len="$max_len" -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$artifacts/" \
    "$work" "tests/fuzz/corpus/$name" >"$build/fuzz_$name.log" 2>&1; then
    echo "   ok in $((SECONDS - start)) s: $(grep -E '^stat::(number_of_executed_units|new_units_added)' \
      "$build/fuzz_$name.log" | tr '\n' ' ')"
  else
    echo "   FAILED after $((SECONDS - start)) s; the log's end ($build/fuzz_$name.log):"
    tail -n 60 "$build/fuzz_$name.log"
    ls "$artifacts"
    failed+=("$name")
  fi
done
if ((${#failed[@]})); then
  echo "fuzz targets failed: ${failed[*]}" >&2
  exit 1
fi
echo "all fuzz targets passed"
