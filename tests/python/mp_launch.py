"""The launcher of the multi-process tests: a jax.distributed job of local CPU processes (8
devices in all) with its coordinator on 127.0.0.1, each process running a worker script whose
command line is mp_worker.parse_args's (and its worker main mp_worker.run_in_job)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(worker: str, phase: str, step: str, nproc: int, layout: str, cwd: str, *,
            args: tuple[str, ...] = (), env: dict[str, str] | None = None,
            timeout_s: float = 150, pythonpath: str | None = None) -> str:
    """Runs `nproc` processes of `worker` (python WORKER --phase PHASE --step STEP *ARGS --nproc N
    --pid I --port P --layout LAYOUT) in `cwd`, with the environment `env` (default: this
    process's) less XLA_FLAGS, JAX_ENABLE_X64 and PYTHONPATH (`pythonpath` instead, when given:
    the folder of the tensorstash the test imported), JAX on 8 // nproc CPU devices each;
    returns their output. Fails (and kills them all) when any exits non-zero or the job outlives
    `timeout_s`. Retried once with another port when the coordinator's port was taken
    meanwhile."""
    failure, text = _run_job_once(worker, phase, step, nproc, layout, cwd, args, env, timeout_s,
                                  pythonpath)
    if failure and "already in use" in text.lower():
        failure, text = _run_job_once(worker, phase, step, nproc, layout, cwd, args, env,
                                      timeout_s, pythonpath)
    if failure:
        pytest.fail(f"{phase} by {nproc} process(es) failed: {failure}\n{text}", pytrace=False)
    return text


def _run_job_once(worker, phase, step, nproc, layout, cwd, args, env,
                  timeout_s, pythonpath=None) -> tuple[str, str]:
    port = free_port()
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in ("XLA_FLAGS", "JAX_ENABLE_X64", "PYTHONPATH")}
    env["JAX_PLATFORMS"] = "cpu"
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
    procs, logs = [], []
    try:
        for pid in range(nproc):
            log = open(os.path.join(cwd, f"{phase}-{nproc}-{pid}-{port}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, worker, "--phase", phase, "--step", step, *args,
                 "--nproc", str(nproc), "--pid", str(pid), "--port", str(port),
                 "--layout", layout],
                cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        failed = None
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout_s}s"
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
