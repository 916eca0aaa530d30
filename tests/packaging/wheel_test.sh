#!/usr/bin/env bash
# The portable wheel as a user meets it (issue 18): scripts/build_wheel.sh builds and repairs
# it, a fresh virtual environment installs it (with jax, from the package index), and
# wheel_user.py saves, restores onto another sharding and runs `tensorstash verify` in a mount
# namespace (unshare -m, as root) where the source and build tree is an empty folder and every
# system copy of a library the wheel bundles reads as an empty file. The test first checks that
# the hiding works: a hidden library must fail to load there.
#   tests/packaging/wheel_test.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
scripts/build_wheel.sh
wheel=$(ls "$repo"/dist/tensorstash-*.whl)

work=$(mktemp -d /tmp/tensorstash-wheel-XXXXXX)
trap 'rm -rf "$work"' EXIT
base_python=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
"$base_python" -m venv "$work/venv"
"$work/venv/bin/pip" install -q --disable-pip-version-check -c scripts/constraints.txt \
  "$wheel" jax
cp tests/packaging/wheel_user.py "$work/"

# The libraries the wheel bundles, by their names on the system (auditwheel renames its copies
# <name>-<hash>.so.<version>), less those the interpreter and jax load themselves before
# tensorstash is imported (libffi for ctypes, say: libcurl's dependencies reach it too): they
# are the environment's, and hiding them would break Python, not test the wheel.
libdir=$(dirname "$(ldconfig -p | grep -m1 'libzstd.so.1 ' | sed 's/.*=> //')")
own=$("$work/venv/bin/python" -c '
import ctypes, hashlib, ssl, sys, jax, numpy
for line in open("/proc/self/maps"):
    path = line.split()[-1]
    if ".so" in path:
        print(path)' | sort -u)
hidden=()
for copy in $(unzip -Z1 "$wheel" | grep '^tensorstash.libs/'); do
  name=$(basename "$copy" | sed -E 's/-[0-9a-f]{8}(\.so)/\1/; s/\.so.*$//')
  for file in "$libdir/$name".so*; do
    if [ -f "$file" ] && [ ! -L "$file" ] && ! grep -qxF "$(realpath "$file")" <<<"$own"; then
      hidden+=("$file")
    fi
  done
done
[ "${#hidden[@]}" -gt 0 ] || { echo "wheel_test: found no system copies to hide" >&2; exit 1; }
echo "wheel_test: hiding the build tree and ${#hidden[@]} system libraries"

unshare -m bash -euo pipefail -c '
  work=$1; repo=$2; shift 2
  mount --make-rprivate /
  mount -t tmpfs tmpfs "$repo"
  for file in "$@"; do mount --bind /dev/null "$file"; done
  cd "$work"
  # The hiding works: the first hidden library no longer loads (ctypes itself loads: the
  # libraries of the interpreter are not hidden).
  venv/bin/python -c "import ctypes"
  if venv/bin/python -c "import ctypes, sys; ctypes.CDLL(sys.argv[1])" "$1" 2>/dev/null; then
    echo "wheel_test: the system libraries are still visible" >&2; exit 1
  fi
  test -z "$(ls -A "$repo")"
  env -i PATH=/usr/bin:/bin HOME="$work" venv/bin/python wheel_user.py "$work/store"
' wheel_test "$work" "$repo" "${hidden[@]}"
echo "wheel_test: ok"
