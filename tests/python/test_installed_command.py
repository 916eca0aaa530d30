"""The package as installed: one version everywhere (CMakeLists.txt's project() is the one
place), and the `tensorstash` command that `pip install` puts beside the interpreter, which runs
the same commands as build/tensorstash in this process (tensorstash/_cli.py)."""

import importlib.metadata
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import tensorstash
from tensorstash import _ext

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMAND = os.path.join(os.path.dirname(sys.executable), "tensorstash")


def cmake_version():
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        return re.search(r"project\(tensorstash VERSION ([0-9.]+)", f.read()).group(1)


def test_one_version_for_library_package_and_command():
    version = cmake_version()
    assert tensorstash.__version__ == version
    assert _ext.__version__ == version
    assert importlib.metadata.version("tensorstash") == version
    out = subprocess.run([COMMAND, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"tensorstash {version}"


def test_the_installed_command_lists_inspects_and_verifies(tmp_path):
    step = tmp_path / "run" / "7"
    tensorstash.save(str(step), {"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
    listed = subprocess.run([COMMAND, "ls", str(tmp_path / "run")], capture_output=True,
                            text=True)
    assert listed.returncode == 0, listed.stderr
    assert "7" in listed.stdout
    inspected = subprocess.run([COMMAND, "inspect", str(step)], capture_output=True, text=True)
    assert inspected.returncode == 0, inspected.stderr
    assert "w" in inspected.stdout and "float32" in inspected.stdout
    verified = subprocess.run([COMMAND, "verify", str(step)], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stderr
    # A damaged data file: verify names it and exits non-zero, as the executable does.
    data = [p for p in (step / "state").rglob("*") if p.is_file() and "data" in p.parts]
    assert data
    raw = bytearray(data[0].read_bytes())
    raw[0] ^= 0xFF
    data[0].write_bytes(bytes(raw))
    damaged = subprocess.run([COMMAND, "verify", str(step)], capture_output=True, text=True)
    assert damaged.returncode == 1
    assert "w" in damaged.stdout + damaged.stderr


def test_bad_arguments_are_an_error_not_a_crash():
    out = subprocess.run([COMMAND, "inspect"], capture_output=True, text=True)
    assert out.returncode not in (0, -6, -11)
    assert "required" in (out.stdout + out.stderr).lower()
