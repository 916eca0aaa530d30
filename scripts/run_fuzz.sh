#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang + ASan + UBSan in build-asan (the tree the ASan
# suite uses too: scripts/lib/clang_tree.sh) and runs each for a while from its seed corpus.
# A crash leaves its input in build-asan/findings/<target>/; copy it
# to fuzz/regressions/<target>/ (replayed by the normal test suite) and fix the parser.
#   scripts/run_fuzz.sh                      short run: 20 s per target (part of the tests)
#   TS_FUZZ_SECONDS=3600 scripts/run_fuzz.sh a longer hunt
#   scripts/run_fuzz.sh --regenerate-corpus  rewrite fuzz/corpus/ from real checkpoints
#   scripts/run_fuzz.sh --build-only         build the fuzz targets, run nothing
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${TS_FUZZ_SECONDS:-20}
BUILD_DIR=build-asan
if ! command -v clang++ >/dev/null; then
  echo "run_fuzz: clang++ not found (scripts/setup.sh installs it)" >&2
  exit 1
fi
. scripts/lib/clang_tree.sh
clang_tree_configure asan
cmake --build "$BUILD_DIR" -j "$(nproc)" --target fuzzers
if [ "${1:-}" = "--build-only" ]; then
  exit 0
fi
if [ "${1:-}" = "--regenerate-corpus" ]; then
  "$BUILD_DIR/make_seed_corpus" fuzz/corpus
  echo "run_fuzz: wrote fuzz/corpus/"
  exit 0
fi
# Every target built (each fuzz/*.cc registered in CMake), as many at a time as there are cores:
# a fuzzer runs on one core, and the short run is part of the test suite's time budget.
fuzz_one() {
  local target=$1
  local work="$BUILD_DIR/work/$target"      # what the fuzzer adds to the corpus (not committed)
  local findings="$BUILD_DIR/findings/$target"
  mkdir -p "$work" "$findings"
  if ! "$BUILD_DIR/${target}_fuzzer" "$work" "fuzz/corpus/$target" -max_total_time="$SECONDS_PER_TARGET" \
      -max_len=65536 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
      -artifact_prefix="$findings/" 2>"$BUILD_DIR/$target.log"; then
    echo "run_fuzz: $target FAILED; input in $findings/, log in $BUILD_DIR/$target.log" >&2
    tail -n 40 "$BUILD_DIR/$target.log" >&2
    return 1
  fi
  echo "== fuzzed $target for ${SECONDS_PER_TARGET}s: $(grep -E "stat::number_of_executed_units|Done [0-9]+ runs" "$BUILD_DIR/$target.log" | tail -n 1)"
}
targets=()
for fuzzer in "$BUILD_DIR"/*_fuzzer; do
  name=$(basename "$fuzzer"); targets+=("${name%_fuzzer}")
done
[ "${#targets[@]}" -gt 0 ] || { echo "run_fuzz: no fuzz targets in $BUILD_DIR" >&2; exit 1; }
for target in "${targets[@]}"; do
  [ -d "fuzz/corpus/$target" ] || { echo "run_fuzz: no seed corpus fuzz/corpus/$target" >&2; exit 1; }
done
status=0
running=0
for target in "${targets[@]}"; do
  fuzz_one "$target" &
  running=$((running + 1))
  if [ "$running" -ge "$(nproc)" ]; then
    wait -n || status=1
    running=$((running - 1))
  fi
done
while [ "$running" -gt 0 ]; do
  wait -n || status=1
  running=$((running - 1))
done
echo "run_fuzz: ${#targets[@]} targets"
exit $status
