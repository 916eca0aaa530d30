#!/usr/bin/env bash
# Every test: the GoogleTest suite, the CLI test and the cross-checks against NumPy/ml_dtypes
# under ctest, then the Python/JAX tests under pytest. Both run even if the first fails.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build || exit 1
(cd build && ctest --output-on-failure -j "$(nproc)" --timeout 600)
ctest_status=$?
.venv/bin/python -m pytest tests/python -q
pytest_status=$?
exit $((ctest_status != 0 || pytest_status != 0))
