"""pytest setup for the Python front of tensorstash.

- JAX runs on the CPU with 8 host devices (set before JAX is first imported), with 64-bit types on
  so that every dtype tensorstash stores can live in a jax.Array.
- The tests import the *installed* package (`pip install .`), never the sources in python/, which
  lack the compiled `_ext`: a missing or broken install fails the run loudly instead of skipping.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_ENABLE_X64", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SOURCES = os.path.join(REPO, "python")

# Never import python/tensorstash (no _ext there) even if the caller runs from python/ or put it
# on PYTHONPATH.
sys.path[:] = [p for p in sys.path
               if os.path.realpath(os.path.abspath(p or os.curdir)) != os.path.realpath(SOURCES)]

try:
    import tensorstash  # noqa: E402
    from tensorstash import _ext  # noqa: E402,F401
except ImportError as e:  # pragma: no cover - a broken setup, reported as an error, never a skip
    raise ImportError(
        f"the tensorstash package with its compiled extension is not importable ({e}); install "
        f"it first: cd {REPO} && .venv/bin/pip install --no-build-isolation .") from e

if os.path.realpath(os.path.dirname(tensorstash.__file__)).startswith(os.path.realpath(SOURCES)):
    raise ImportError(f"tests must import the installed tensorstash, not {tensorstash.__file__}")

import pytest  # noqa: E402


def _stale_sources() -> list[str]:
    """Python files of python/tensorstash that differ from the installed copies."""
    installed = os.path.dirname(tensorstash.__file__)
    src = os.path.join(SOURCES, "tensorstash")
    stale = []
    if os.path.isdir(src):
        for name in sorted(os.listdir(src)):
            if not name.endswith(".py"):
                continue
            a, b = os.path.join(src, name), os.path.join(installed, name)
            with open(a, "rb") as fa:
                mine = fa.read()
            try:
                with open(b, "rb") as fb:
                    theirs = fb.read()
            except OSError:
                theirs = None
            if mine != theirs:
                stale.append(name)
    return stale


def pytest_report_header(config):
    lines = [f"tensorstash {tensorstash.__version__} from {os.path.dirname(tensorstash.__file__)}"]
    stale = _stale_sources()
    if stale:
        lines.append("WARNING: the installed tensorstash differs from python/tensorstash in "
                     f"{', '.join(stale)}; reinstall (pip install --no-build-isolation .) to test "
                     "the sources")
    return lines


@pytest.fixture
def step(tmp_path):
    """A fresh step folder path (not yet created) under a fresh root."""
    return str(tmp_path / "root" / "0000000001")
