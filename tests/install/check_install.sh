#!/usr/bin/env bash
# Installs the build (cmake --install BUILD --prefix), builds tests/install/ against it with
# find_package(Tally), runs it, and checks what it printed and wrote; then the tools in P/bin,
# and that the installed Python package (when built) finds ab_memory there.
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

# The tools and the training programs in P/bin, each one runnable.
for prog in minimal ab_memory tally_memdiff train_resnet train_gpt train_ddp train_model; do
  test -x "$work/prefix/bin/$prog" || { echo "no executable bin/$prog"; exit 1; }
  "$work/prefix/bin/$prog" --help >/dev/null || { echo "bin/$prog --help failed"; exit 1; }
done
echo "install: the tools are in $work/prefix/bin"

# The installed Python package (built when pybind11 was found) runs P/bin/ab_memory, not the
# build tree's: tally.ab.program() names it.
pkg=$(ls -d "$work"/prefix/lib*/python*/*-packages/tally 2>/dev/null | head -1 || true)
if [ -n "$pkg" ]; then
  found=$(cd "$work" && env -u TALLY_AB_MEMORY PYTHONPATH="$(dirname "$pkg")" \
    "${PYTHON:-python3}" -c 'import tally.ab; print(tally.ab.program())')
  want=$(readlink -f "$work/prefix/bin/ab_memory")
  [ "$(readlink -f "$found")" = "$want" ] || { echo "tally.ab.program() is $found, not $want"; exit 1; }
  echo "install: the Python package finds $found"
fi
