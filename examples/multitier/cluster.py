"""Simulated nodes for multi-tier jobs on one machine (`make demo` and tests/python/test_multitier.py).

Each process of a job runs in its own mount namespace (`unshare -m`, as root) where its node's
folder is bind-mounted at the job's local_dir, the same path for every process: a process sees
its own node's RAM tier there and nobody else's, so a peer's copy is reachable only through the
peer's server. A node's folder outlives the processes that run on it (a restarted process on the
same node finds it); losing a node removes it.

    cluster = Cluster(tmp_path, nodes=4)
    job = cluster.start(nodes=[0, 1, 2, 3], args=[...])   # process i on node nodes[i]
    job.wait()                                            # {pid: result dict}
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    def __init__(self, procs: list[subprocess.Popen], logs: list[str], out: str):
        self.procs = procs
        self.logs = logs
        self.out = out

    def wait_ready(self, timeout: float = 300) -> None:
        """Waits until every process printed READY (held at the end of its run)."""
        deadline = time.monotonic() + timeout
        for pid, log in enumerate(self.logs):
            while True:
                with open(log, errors="replace") as f:
                    if "READY" in f.read():
                        break
                if self.procs[pid].poll() is not None:
                    raise AssertionError(f"process {pid} exited early:\n{self.log(pid)}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"process {pid} not ready:\n{self.log(pid)}")
                time.sleep(0.2)

    def kill(self, pids: list[int] | None = None) -> None:
        for pid in pids if pids is not None else range(len(self.procs)):
            p = self.procs[pid]
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def wait(self, timeout: float = 300, expect_ok: bool = True) -> dict[int, dict]:
        """Waits for every process; returns {pid: its result}. With expect_ok, an
        AssertionError with the logs of the processes that failed."""
        deadline = time.monotonic() + timeout
        codes = {}
        for pid, p in enumerate(self.procs):
            try:
                codes[pid] = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"process {pid} did not finish in {timeout} s:\n"
                                     + self.log(pid)) from None
        results = {}
        for pid in range(len(self.procs)):
            path = os.path.join(self.out, f"process-{pid}.json")
            results[pid] = json.load(open(path)) if os.path.exists(path) else {}
            results[pid]["exit"] = codes[pid]
        if expect_ok and any(codes.values()):
            raise AssertionError("\n".join(f"process {pid} exit {codes[pid]}:\n{self.log(pid)}"
                                           for pid in codes if codes[pid]))
        return results

    def log(self, pid: int) -> str:
        with open(self.logs[pid], errors="replace") as f:
            return f.read()[-6000:]


class Cluster:
    def __init__(self, workdir: str, nodes: int = 4):
        self.workdir = os.path.abspath(workdir)
        self.local_dir = os.path.join(self.workdir, "local")  # the mount point on every node
        self.persistent = os.path.join(self.workdir, "persistent")
        os.makedirs(self.local_dir, exist_ok=True)
        for k in range(nodes):
            os.makedirs(self.node_dir(k), exist_ok=True)
        self.runs = 0

    def node_dir(self, k: int) -> str:
        return os.path.join(self.workdir, "nodes", f"node{k}")

    def lose_node(self, k: int) -> None:
        """The node is gone with its RAM: its local tier is empty when it comes back."""
        shutil.rmtree(self.node_dir(k))
        os.makedirs(self.node_dir(k))

    def start(self, nodes: list[int], args: list[str], extra: dict[int, list[str]] | None = None,
              persistent: str | None = None, worker: str | None = None) -> Job:
        """Starts process i of len(nodes) on node nodes[i], each in its own mount namespace,
        running `worker` (default: worker.py here; another script takes the same arguments)."""
        self.runs += 1
        out = os.path.join(self.workdir, f"run{self.runs}")
        os.makedirs(out, exist_ok=True)
        port = free_port()
        env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
        procs, logs = [], []
        for pid, node in enumerate(nodes):
            cmd = [sys.executable, worker or WORKER, "--pid", str(pid), "--nproc", str(len(nodes)),
                   "--port", str(port), "--persistent", persistent or self.persistent,
                   "--local-dir", self.local_dir, "--out", out, *args,
                   *((extra or {}).get(pid, []))]
            shell = (f"mount --bind {self.node_dir(node)} {self.local_dir} && exec "
                     + " ".join(_quote(c) for c in cmd))
            log = os.path.join(out, f"process-{pid}.log")
            logs.append(log)
            procs.append(subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell],
                stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                start_new_session=True))
        return Job(procs, logs, out)


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)
