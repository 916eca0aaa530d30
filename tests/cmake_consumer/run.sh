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
if find "$work/prefix/include" -name '*_test_util.h' -o -name 'kvstore_conformance.h' \
    -o -name 'testing' | grep -q .; then
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
grep -q "kvstore_s3" "$work/subproject/build.ninja"  # the default build has the S3 driver
# Without the S3 and GCS drivers and the tiers, a consumer links no libcurl, libmicrohttpd, OpenSSL or
# expat (the link line ninja would run for the parent's program says so), and the library
# has no s3, gcs or tiers layer.
cmake -S "$here/subproject" -B "$work/slim" -G Ninja -DTENSORSTASH_WITH_S3=OFF \
  -DTENSORSTASH_WITH_GCS=OFF -DTENSORSTASH_WITH_TIERS=OFF -DTENSORSTASH_SOURCE_DIR="$(cd "$here/../.." && pwd)" \
  > "$work/slim.log" || { cat "$work/slim.log"; exit 1; }
link_line=$(grep -A3 "^build parent_consumer" "$work/slim/build.ninja")
if echo "$link_line" | grep -Eq "curl|microhttpd|ssl|crypto|expat|kvstore_s3|kvstore_gcs|tensorstash_tiers"; then
  echo "cmake_consumer: a build without S3, GCS and tiers still links them:" >&2
  echo "$link_line" >&2
  exit 1
fi
echo "$link_line" | grep -q "tensorstash_kvstore_file" || {
  echo "cmake_consumer: unexpected link line: $link_line" >&2; exit 1; }
echo "cmake_consumer: ok"
