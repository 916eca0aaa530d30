#!/usr/bin/env bash
# The main job: save a sharded checkpoint with the example program, restore it onto three other
# layouts, then inspect and verify what was written with the CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
OUT=${TENSORSTASH_DEMO_DIR:-$PWD/demo_checkpoints}
./build/sharded_save_restore --root "$OUT" "$@"
STEP=$(ls "$OUT" | grep -v '\.tmp-' | sort | tail -n 1)
echo
echo "== tensorstash ls $OUT"
./build/tensorstash ls "$OUT"
echo
echo "== tensorstash inspect $OUT/$STEP"
./build/tensorstash inspect "$OUT/$STEP"
echo
echo "== tensorstash verify $OUT/$STEP"
./build/tensorstash verify "$OUT/$STEP"
