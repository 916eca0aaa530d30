#!/usr/bin/env bash
# The layering check (cmake/check_layering.cmake) on the real tree, then on a copy with one
# include against the layering (the engine reaching up into the manager), which must fail and
# name the file, the header and the layer. Usage: run.sh <source dir> <rules>
set -euo pipefail
SRC=$1
RULES=$2
cmake "-DRULES=$RULES" -DROOT="$SRC/src/tensorstash" -P "$SRC/cmake/check_layering.cmake"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$SRC/src/tensorstash" "$tmp/tensorstash"
printf '#include "tensorstash/manager/checkpoint_manager.h"\n' >> "$tmp/tensorstash/engine/read_plan.cc"
if cmake "-DRULES=$RULES" -DROOT="$tmp/tensorstash" -P "$SRC/cmake/check_layering.cmake" \
    >"$tmp/out" 2>&1; then
  echo "FAIL: an upward include (engine -> manager) passed the layering check"
  exit 1
fi
grep -q "engine/read_plan.cc: includes manager/checkpoint_manager.h (layer 'manager')" "$tmp/out" || {
  echo "FAIL: the check failed without naming the file and the layer:"; cat "$tmp/out"; exit 1; }
# A driver reached from above (the manager into S3) is refused too.
cp "$SRC/src/tensorstash/engine/read_plan.cc" "$tmp/tensorstash/engine/read_plan.cc"
printf '#include "tensorstash/kvstore/s3/s3_kvstore.h"\n' >> "$tmp/tensorstash/manager/retention.cc"
if cmake "-DRULES=$RULES" -DROOT="$tmp/tensorstash" -P "$SRC/cmake/check_layering.cmake" \
    >"$tmp/out" 2>&1; then
  echo "FAIL: the manager including the S3 driver passed the layering check"
  exit 1
fi
grep -q "manager/retention.cc: includes kvstore/s3/s3_kvstore.h (layer 'kvstore_s3')" "$tmp/out" || {
  echo "FAIL: unexpected output:"; cat "$tmp/out"; exit 1; }
echo "layering: the tree passes; upward includes are refused"
