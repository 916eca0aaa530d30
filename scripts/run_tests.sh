#!/usr/bin/env bash
# Every test: the GoogleTest suite and the cross-checks against NumPy/ml_dtypes, under ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
cd build
ctest --output-on-failure -j "$(nproc)" --timeout 600
