#!/usr/bin/env bash
# Formats the C++ sources with .clang-format (Debian's clang-format). With --check, changes
# nothing and exits 1 listing the files that differ.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "format: clang-format is missing (apt-get install clang-format)" >&2; exit 2; }
mapfile -t files < <(git ls-files 'src/*.cc' 'src/*.h' 'cli/*.cc' 'cli/*.h' 'python/bindings/*.cc' \
  'python/bindings/*.h' 'examples/*.cc' 'tests/tools/*.cc' 'fuzz/*.cc' 'bench/*.cc')
if [ "${1:-}" = "--check" ]; then
  status=0
  for f in "${files[@]}"; do
    if ! clang-format "$f" | cmp -s - "$f"; then echo "needs formatting: $f"; status=1; fi
  done
  exit $status
fi
clang-format -i "${files[@]}"
