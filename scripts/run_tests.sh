#!/usr/bin/env bash
# Every test: the GoogleTest suite, the CLI test, the installed C++ package and the cross-checks
# against NumPy/ml_dtypes under ctest, then the Python/JAX tests under pytest, short fuzz runs,
# the portable wheel in a fresh environment, and in CI (CI=true or TS_SANITIZERS=1) the
# sanitizer builds. All run even if one fails.
set -uo pipefail
cd "$(dirname "$0")/.."
# How long each part took, printed with the summary: CI has a time budget, and this says where it goes.
timings=""
part_start=$SECONDS
took() { timings+="$1 $((SECONDS - part_start)) s; "; part_start=$SECONDS; }
scripts/setup.sh build || exit 1
took setup
rm -f build/Testing/Temporary/LastTestsFailed.log
# The clang trees (fuzz targets, and in CI the sanitizer builds) are built in the background at
# the lowest CPU priority while ctest and pytest run: pytest spends much of its time waiting on
# child processes and servers, and those idle cycles would otherwise be wasted. Each script is
# called again below to run its part; its build is then up to date. Only the build overlaps:
# the sanitizer and fuzz runs start after pytest, on an idle machine.
sanitizers_wanted=0
if [ "${CI:-}" = "true" ] || [ "${TS_SANITIZERS:-0}" = "1" ]; then sanitizers_wanted=1; fi
mkdir -p build
# Its own process group (setsid), so that an interrupted run stops the builds too.
setsid bash -c '
  nice -n 19 scripts/run_fuzz.sh --build-only
  if [ "$0" = 1 ]; then nice -n 19 scripts/run_sanitizers.sh --build-only; fi
' "$sanitizers_wanted" > build/prebuild.log 2>&1 &
prebuild_pid=$!
trap 'kill -- -"$prebuild_pid" 2>/dev/null' EXIT
(cd build && ctest --output-on-failure -j "$(nproc)" --timeout 600)
ctest_status=$?
took ctest
.venv/bin/python -m pytest tests/python tests/s3 tests/gcs -q --durations=40
pytest_status=$?
took pytest
# A short run of every fuzz target (clang; scripts/run_fuzz.sh), and the C++ suite under
# ASan+UBSan and TSan in CI (CI=true) or when asked (TS_SANITIZERS=1): docs/reliability.md.
# A failed background build is not fatal here: the scripts below build again and report.
wait "$prebuild_pid" || echo "run_tests: the background build failed (build/prebuild.log); building again"
took "waiting for the background build"
scripts/run_fuzz.sh
fuzz_status=$?
took fuzz
# The portable wheel, installed into a fresh environment that sees neither the build tree nor
# the system's copies of the libraries it bundles (tests/packaging/wheel_test.sh).
tests/packaging/wheel_test.sh
wheel_status=$?
took wheel
sanitizer_status=0
if [ "$sanitizers_wanted" = 1 ]; then
  scripts/run_sanitizers.sh
  sanitizer_status=$?
  took sanitizers
fi
echo "run_tests: time taken: ${timings}total ${SECONDS} s"
# A summary last, so that the tail of a long log says which part failed.
word() { if [ "$1" = 0 ]; then echo ok; else echo "FAILED ($1)"; fi; }
for failed in build*/Testing/Temporary/LastTestsFailed.log; do
  [ -s "$failed" ] && echo "run_tests: failed in ${failed%%/*}: $(cut -d: -f2 "$failed" | tr '\n' ' ')"
done
echo "run_tests: ctest $(word $ctest_status); pytest $(word $pytest_status);" \
  "fuzz $(word $fuzz_status); wheel $(word $wheel_status); sanitizers $(word $sanitizer_status)"
exit $((ctest_status != 0 || pytest_status != 0 || fuzz_status != 0 || wheel_status != 0 ||
  sanitizer_status != 0))
