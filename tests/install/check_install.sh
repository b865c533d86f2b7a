#!/usr/bin/env bash
# Installs the build (cmake --install BUILD --prefix), builds tests/install/ against it with
# find_package(Tally), runs it, and checks what it printed and wrote.
#   check_install.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -euo pipefail
src=$1 build=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
test -f "$work/prefix/include/tally/nn/module.h" || { echo "no include/tally/nn/module.h"; exit 1; }
test -f "$work/prefix/include/tally/version.h" || { echo "no include/tally/version.h"; exit 1; }
ls "$work"/prefix/lib*/cmake/Tally/TallyConfigVersion.cmake >/dev/null
cmake -S "$src/tests/install" -B "$work/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release >"$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
"$work/consumer/consumer" "$work/step.pickle" | tee "$work/run.log"
grep -q "^tally [0-9]*\.[0-9]*\.[0-9]* allow_tf32=false loss=" "$work/run.log"
grep -q "activation" "$work/run.log"
test -s "$work/step.pickle"
echo "install: the consumer built against $work/prefix and ran"
