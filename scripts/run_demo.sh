#!/usr/bin/env bash
# The main job (`make demo`):
#  1. the training demo: a JAX job on 8 CPU devices (2x4 mesh) with async checkpoints, killed
#     with SIGKILL partway, resumed on a 4x2 mesh, its losses compared bit for bit with an
#     uninterrupted run's (examples/train_demo/demo.py); then `tensorstash ls` and `verify` on
#     its checkpoints;
#  2. the C++ example: a sharded save restored onto four layouts (examples/sharded_save_restore.cc),
#     then `tensorstash inspect` and `verify` on it;
#  3. the multi-tier demo: 4 processes on simulated nodes, a slice killed with SIGKILL, resumed
#     in reverse process order from the peers' RAM tiers (examples/multitier/demo.py).
# Extra arguments go to the training demo (e.g. --quick); TENSORSTASH_DEMO_DIR moves the output
# (default demo_checkpoints/), CPP_DEMO_ARGS replaces the C++ example's (--size-mib 128 --runs 1).
# Exits non-zero when either demo fails.
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what the demo runs: the CLI and the C++ example (and the Python package), not the tests.
scripts/setup.sh build tensorstash_cli sharded_save_restore
OUT=${TENSORSTASH_DEMO_DIR:-$PWD/demo_checkpoints}
mkdir -p "$OUT"
status=0

echo
echo "== 1. Training demo: SIGKILL, resume on another mesh (examples/train_demo/demo.py)"
.venv/bin/python examples/train_demo/demo.py --out "$OUT/train" "$@" || status=1
CKPTS=$OUT/train/ckpts
STEP=$(ls "$CKPTS" 2>/dev/null | grep -E '^[0-9]{10}$' | sort | tail -n 1 || true)
if [ -n "$STEP" ]; then
  echo
  echo "== tensorstash ls $CKPTS"
  ./build/tensorstash ls "$CKPTS"
  echo
  echo "== tensorstash verify $CKPTS/$STEP"
  ./build/tensorstash verify "$CKPTS/$STEP" || status=1
fi

echo
echo "== 2. C++ example: one sharded save, restored onto four layouts (examples/sharded_save_restore.cc)"
# shellcheck disable=SC2086
./build/sharded_save_restore --root "$OUT/sharded" ${CPP_DEMO_ARGS:---size-mib 128 --runs 1} || status=1
STEP=$(ls "$OUT/sharded" | grep -E '^[0-9]{10}$' | sort | tail -n 1)
echo
echo "== tensorstash inspect $OUT/sharded/$STEP"
./build/tensorstash inspect "$OUT/sharded/$STEP"
echo
echo "== tensorstash verify $OUT/sharded/$STEP"
./build/tensorstash verify "$OUT/sharded/$STEP" || status=1
echo
echo "== 3. Multi-tier: a slice lost, resumed from the peers' RAM (examples/multitier/demo.py)"
.venv/bin/python examples/multitier/demo.py --out "$OUT/multitier" || status=1
echo
if [ "$status" -eq 0 ]; then echo "demo: PASS (files in $OUT)"; else echo "demo: FAIL"; fi
exit "$status"
