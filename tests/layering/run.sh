#!/usr/bin/env bash
# The layering check (cmake/check_layering.cmake) on the real tree, then on copies with one
# include against the layering each (the engine reaching up into the manager; the manager
# reaching into the S3 driver), which must fail and name the file, the header and the layer.
# Usage: run.sh <source dir> <rules>
set -euo pipefail
SRC=$1
RULES=$2
check() { cmake "-DRULES=$RULES" -DROOT="$1" -P "$SRC/cmake/check_layering.cmake"; }
check "$SRC/src/tensorstash"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# refused <file under src/tensorstash> <header it gains> <what the error must say>
refused() {
  rm -rf "$tmp/tensorstash"
  cp -r "$SRC/src/tensorstash" "$tmp/tensorstash"
  printf '#include "tensorstash/%s"\n' "$2" >> "$tmp/tensorstash/$1"
  if check "$tmp/tensorstash" > "$tmp/out" 2>&1; then
    echo "FAIL: $1 including $2 passed the layering check"
    exit 1
  fi
  grep -qF "$3" "$tmp/out" || { echo "FAIL: the check failed without saying '$3':"; cat "$tmp/out"; exit 1; }
}
refused engine/read_plan.cc manager/checkpoint_manager.h \
  "engine/read_plan.cc: includes manager/checkpoint_manager.h (layer 'manager')"
refused manager/retention.cc kvstore/s3/s3_kvstore.h \
  "manager/retention.cc: includes kvstore/s3/s3_kvstore.h (layer 'kvstore_s3')"
echo "layering: the tree passes; upward includes are refused"
