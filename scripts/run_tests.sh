#!/usr/bin/env bash
# Every test: the GoogleTest suite, the CLI test, the installed C++ package and the cross-checks
# against NumPy/ml_dtypes under ctest, then the Python/JAX tests under pytest, short fuzz runs,
# the portable wheel in a fresh environment, and in CI (CI=true or TS_SANITIZERS=1) the
# sanitizer builds. All run even if one fails.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build || exit 1
rm -f build/Testing/Temporary/LastTestsFailed.log
(cd build && ctest --output-on-failure -j "$(nproc)" --timeout 600)
ctest_status=$?
.venv/bin/python -m pytest tests/python tests/s3 tests/gcs -q
pytest_status=$?
# A short run of every fuzz target (clang; scripts/run_fuzz.sh), and the C++ suite under
# ASan+UBSan and TSan in CI (CI=true) or when asked (TS_SANITIZERS=1): docs/reliability.md.
scripts/run_fuzz.sh
fuzz_status=$?
# The portable wheel, installed into a fresh environment that sees neither the build tree nor
# the system's copies of the libraries it bundles (tests/packaging/wheel_test.sh).
tests/packaging/wheel_test.sh
wheel_status=$?
sanitizer_status=0
if [ "${CI:-}" = "true" ] || [ "${TS_SANITIZERS:-0}" = "1" ]; then
  scripts/run_sanitizers.sh
  sanitizer_status=$?
fi
# A summary last, so that the tail of a long log says which part failed.
word() { if [ "$1" = 0 ]; then echo ok; else echo "FAILED ($1)"; fi; }
for failed in build*/Testing/Temporary/LastTestsFailed.log; do
  [ -s "$failed" ] && echo "run_tests: failed in ${failed%%/*}: $(cut -d: -f2 "$failed" | tr '\n' ' ')"
done
echo "run_tests: ctest $(word $ctest_status); pytest $(word $pytest_status);" \
  "fuzz $(word $fuzz_status); wheel $(word $wheel_status); sanitizers $(word $sanitizer_status)"
exit $((ctest_status != 0 || pytest_status != 0 || fuzz_status != 0 || wheel_status != 0 ||
  sanitizer_status != 0))
