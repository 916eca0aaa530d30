#!/usr/bin/env bash
# The benchmark against Orbax + TensorStore (issue 5): builds tensorstash (scripts/setup.sh),
# creates or updates the benchmark environment .venv-bench idempotently (the peers from PyPI,
# unpinned, and tensorstash as the wheel of this build), then runs bench/run.py with the
# arguments given, e.g.:
#   scripts/run_bench.sh                       # the issue's sizes, 5 counted runs, into bench/results
#   scripts/run_bench.sh --scale 0.5 --runs 7 --scenarios large,cold --dir /mnt/nvme/bench
# (make bench BENCH_ARGS="--scale 0.5" does the same.) Versions used are recorded in the results.
# BENCHES picks which benchmarks run, of "scenarios recovery scaling" (all by default), e.g.
#   BENCHES=scaling SCALING_ARGS="--runs 5" make bench
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh build

VENV=.venv-bench
PACKAGES=(orbax-checkpoint tensorstore safetensors matplotlib jax numpy ml_dtypes)
if [ ! -x "$VENV/bin/python" ]; then
  echo "run_bench: creating $VENV"
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import orbax.checkpoint, tensorstore, safetensors, matplotlib, jax, numpy, ml_dtypes" 2>/dev/null; then
  echo "run_bench: installing ${PACKAGES[*]} into $VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "${PACKAGES[@]}"
fi

# tensorstash itself: a wheel built from the tree .venv builds from (build/py, incremental), so
# that the benchmark runs the code of this checkout; reinstalled when it changed.
WHEELS=build/bench-wheel
rm -rf "$WHEELS"
.venv/bin/pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w "$WHEELS" .
wheel=$(ls "$WHEELS"/tensorstash-*.whl)
sum=$(python3 -c 'import hashlib, sys, zipfile
z, h = zipfile.ZipFile(sys.argv[1]), hashlib.sha256()
for name in sorted(z.namelist()):
    h.update(name.encode() + z.read(name))
print(h.hexdigest())' "$wheel")
if [ "$(cat "$VENV/.tensorstash-wheel" 2>/dev/null)" != "$sum" ] || ! "$VENV/bin/python" -c "import tensorstash._ext" 2>/dev/null; then
  echo "run_bench: installing tensorstash into $VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
  echo "$sum" > "$VENV/.tensorstash-wheel"
fi

BENCHES=${BENCHES:-scenarios recovery scaling}
for bench in $BENCHES; do
  case $bench in scenarios | recovery | scaling) ;; *)
    echo "run_bench: unknown benchmark '$bench' in BENCHES (scenarios, recovery, scaling)" >&2
    exit 2 ;;
  esac
done
wants() { [[ " $BENCHES " == *" $1 "* ]]; }

if wants scenarios; then "$VENV/bin/python" bench/run.py "$@"; fi
# The node-local tier's recovery benchmark (bench/README.md, "recovery"), into bench/results;
# its options through RECOVERY_ARGS, e.g. RECOVERY_ARGS="--size-mib 256 --runs 7".
if wants recovery; then "$VENV/bin/python" bench/recovery.py --out bench/results ${RECOVERY_ARGS:-}; fi
# The scaling benchmark (bench/README.md, "scaling"), into bench/results; its options through
# SCALING_ARGS, e.g. SCALING_ARGS="--runs 5 --orbax-cap-s 300".
if wants scaling; then "$VENV/bin/python" bench/scaling.py --out bench/results ${SCALING_ARGS:-}; fi
