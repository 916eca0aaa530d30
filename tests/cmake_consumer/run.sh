#!/usr/bin/env bash
# The installable C++ package, as a user meets it: `cmake --install` of the build into a fresh
# prefix, then tests/cmake_consumer (find_package(tensorstash)) configured against that prefix
# alone, built, and run: a save and a restore across shards.
# Then the source tree as a subproject of another (subproject/): only the library, no settings
# leaked.
#   tests/cmake_consumer/run.sh BUILD_DIR
set -euo pipefail
build_dir=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/lib/cmake/tensorstash/tensorstashConfig.cmake"
test -f "$work/prefix/include/tensorstash/checkpoint/checkpoint_writer.h"
test -f "$work/prefix/include/tensorstash/version.h"
# Test-only headers stay out of the package.
if find "$work/prefix/include" -name '*_test_util.h' -o -name 'kvstore_conformance.h' | grep -q .; then
  echo "cmake_consumer: test headers were installed" >&2
  exit 1
fi
cmake -S "$here" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" || { cat "$work/build.log"; exit 1; }
mkdir "$work/store"
"$work/build/consumer" "$work/store"
cmake -S "$here/subproject" -B "$work/subproject" -G Ninja \
  -DTENSORSTASH_SOURCE_DIR="$(cd "$here/../.." && pwd)" > "$work/subproject.log" \
  || { cat "$work/subproject.log"; exit 1; }
grep "subproject: only" "$work/subproject.log"
echo "cmake_consumer: ok"
