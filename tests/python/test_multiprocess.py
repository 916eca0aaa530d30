"""Saves by one process count and restores by another, with real jax.distributed jobs of local
CPU processes (8 devices in all), through tests/python/mp_worker.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_worker.py")
TIMEOUT_S = 150  # for a whole job; a hang fails the test instead of blocking the run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(phase: str, step: str, nproc: int, layout: str, cwd: str) -> str:
    """Runs `nproc` worker processes; returns their output. Fails (and kills them all) when any
    exits non-zero or the job outlives TIMEOUT_S. Retried once with another port when the
    coordinator's port was taken meanwhile."""
    failure, text = _run_job_once(phase, step, nproc, layout, cwd)
    if failure and "already in use" in text.lower():
        failure, text = _run_job_once(phase, step, nproc, layout, cwd)
    if failure:
        pytest.fail(f"{phase} by {nproc} process(es) failed: {failure}\n{text}", pytrace=False)
    return text


def _run_job_once(phase: str, step: str, nproc: int, layout: str, cwd: str) -> tuple[str, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_ENABLE_X64", "PYTHONPATH")}
    env["JAX_PLATFORMS"] = "cpu"
    procs, logs = [], []
    for pid in range(nproc):
        log = open(os.path.join(cwd, f"{phase}-{nproc}-{pid}-{port}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, "--phase", phase, "--step", step, "--nproc", str(nproc),
             "--pid", str(pid), "--port", str(port), "--layout", layout],
            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                failed = f"timed out after {TIMEOUT_S}s"
                break
            if any(p.returncode not in (None, 0) for p in procs):
                # One failed: give the others a little time to report, then stop them.
                try:
                    for p in procs:
                        p.wait(timeout=max(0.0, min(20.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pass
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    output = []
    for pid, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        output.append(f"--- process {pid}/{nproc} ({phase}, layout {layout}), exit {p.returncode}\n"
                      + log.read())
        log.close()
    text = "\n".join(output)
    if failed or any(p.returncode != 0 for p in procs):
        return failed or "non-zero exit", text
    return "", text


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps saved by 2 and by 4 processes, and by 1 process of 8 devices."""
    steps = {}
    for nproc in (2, 4, 1):
        work = tmp_path_factory.mktemp(f"save{nproc}")
        step = str(work / "root" / "0000000100")
        run_job("save", step, nproc, "A", str(work))
        steps[nproc] = step
    return steps


@pytest.mark.parametrize("nproc", [2, 4, 1])
def test_saved_by_n_processes(saved, nproc):
    step = saved[nproc]
    with open(os.path.join(step, "COMMIT")) as f:
        commit = json.load(f)
    assert commit["process_count"] == nproc
    files = os.listdir(os.path.join(step, "state", "data"))
    writers = {int(name.split("-")[0]) for name in files}
    assert writers == set(range(nproc)), files  # every process wrote its own shards
    # Nothing but the step is left in the root (no temporaries, no index parts).
    assert os.listdir(os.path.dirname(step)) == [os.path.basename(step)]
    assert not [n for n in os.listdir(os.path.join(step, "state")) if "part" in n]


@pytest.mark.parametrize("saved_by, restored_by, layout", [
    (2, 4, "B"), (2, 1, "C"), (4, 2, "C"), (4, 1, "B"), (1, 4, "C"), (1, 2, "B"),
])
def test_restore_by_another_process_count(saved, tmp_path, saved_by, restored_by, layout):
    run_job("restore", saved[saved_by], restored_by, layout, str(tmp_path))
