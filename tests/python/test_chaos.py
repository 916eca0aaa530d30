"""Chaos test of the multi-tier job (issue 36 item 12): 4 JAX processes as 2 slices on simulated
nodes (examples/multitier/cluster.py: each process in its own mount namespace with its node's
RAM tier) train the tiny deterministic model of chaos_worker.py with a local save every step
and a persistent save every 3 steps, while, at random points drawn from a seed:

- the job is SIGKILLed (a random subset of its processes first, the rest a moment later: a job
  restarts whole), at a random step or while it restores;
- between runs, a node's RAM tier is wiped (Cluster.lose_node), a byte of a committed holding
  on a node is flipped, and `tensorstash gc <persistent root>` runs (the installed command),
  with `--min-age 0` or with its default;
- the job restarts with its processes on the nodes in a random order, with 4 processes or
  sometimes 2 (the mesh spans all processes' 8 devices, the data replicated across 2 slices,
  so both sizes restore each other's steps).

After every restart each worker checks (chaos_worker.py) that the restored state is
bit-identical to the state of the step it restored (a function of the step number), that its
per-process value is the one it saved at that step (None only for a process index the saving
job did not have) and that the metadata names that step. Here: every process restored the same
step, never older than the newest committed persistent step (those are never damaged: nothing
committed is lost) nor newer than any step reached; no process fails on its own (a restart
must succeed while an intact step exists); every committed persistent step restores
bit-identically after each run and each gc; and the last run, without faults, trains to its
end. The counts of kills, wipes, flips and gc runs are printed in a summary line.

TS_CHAOS_SEED=<n> replays a run (the seed is printed); TS_CHAOS_ROUNDS=<n> runs longer (the
default keeps the test to a few minutes); TS_CHAOS_JOB_SECONDS caps each job's wall time.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

import tensorstash

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "multitier"))
sys.path.insert(0, HERE)
from cluster import Cluster  # noqa: E402
import chaos_worker  # noqa: E402

WORKER = os.path.join(HERE, "chaos_worker.py")
NODES = 4
LOCAL_INTERVAL = 1
PERSISTENT_INTERVAL = 3


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


class ChaosFailure(AssertionError):
    pass


class PortTaken(Exception):
    """The JAX coordinator could not listen on the port picked for it."""


class Chaos:
    def __init__(self, workdir: str, seed: int, job_seconds: float):
        self.seed = seed
        self.rng = random.Random(seed)
        self.cluster = Cluster(workdir, nodes=NODES)
        self.job_seconds = job_seconds
        self.high = 0  # the highest step any process reached (a committed step is never above)
        self.counts = dict(runs=0, kills=0, wipes=0, flips=0, gc_min_age_0=0, gc_default=0,
                           gc_removed=0, restarts=0, fallbacks=0, runs_of_2=0, restores_checked=0)
        self.resumed: list[int] = []
        self.events: list[str] = []  # what happened, for the failure messages

    # --- the persistent tier, seen from outside -------------------------------------------------

    def committed(self) -> list[int]:
        root = self.cluster.persistent
        if not os.path.isdir(root):
            return []
        return sorted(int(n) for n in os.listdir(root)
                      if n.isdigit() and os.path.exists(os.path.join(root, n, "COMMIT")))

    def check_persistent(self, when: str, before: list[int] | None = None) -> list[int]:
        """Every committed persistent step restores bit-identically; none listed `before` went."""
        steps = self.committed()
        if before is not None:
            gone = sorted(set(before) - set(steps))
            if gone:
                self.fail(f"{when}: committed persistent steps {gone} are gone (were {before}, "
                          f"now {steps})")
        for s in steps:
            path = os.path.join(self.cluster.persistent, f"{s:010d}")
            try:
                tree = tensorstash.restore(path)
            except Exception as e:  # noqa: BLE001
                self.fail(f"{when}: committed persistent step {s} does not restore: "
                          f"{type(e).__name__}: {e}")
            want = chaos_worker.expected(s)
            for k in chaos_worker.SHAPES:
                if not chaos_worker.same_bits(tree[k], want[k]):
                    self.fail(f"{when}: persistent step {s}: array {k!r} is not the state of "
                              f"step {s}")
            self.counts["restores_checked"] += 1
        return steps

    # --- faults between runs --------------------------------------------------------------------

    def wipe(self) -> None:
        node = self.rng.randrange(NODES)
        self.cluster.lose_node(node)
        self.counts["wipes"] += 1
        self.events.append(f"wiped node {node}")

    def holdings(self, node: int) -> list[str]:
        found = []
        root = self.cluster.node_dir(node)
        for folder in sorted(os.listdir(root)):
            if not folder.startswith("p"):
                continue
            for step in sorted(os.listdir(os.path.join(root, folder))):
                path = os.path.join(root, folder, step)
                if step.isdigit() and os.path.exists(os.path.join(path, "COMMIT")):
                    found.append(path)
        return found

    def flip(self) -> None:
        candidates = [h for k in range(NODES) for h in self.holdings(k)]
        if not candidates:
            self.events.append("no holding to flip")
            return
        holding = self.rng.choice(candidates)
        files = sorted(os.path.join(d, n) for d, _, names in os.walk(holding) for n in names)
        files = [f for f in files if os.path.getsize(f) > 0]
        data = [f for f in files if f.endswith(".dat")]
        path = self.rng.choice(data if data and self.rng.random() < 0.7 else files)
        size = os.path.getsize(path)
        offset = self.rng.randrange(size)
        mask = self.rng.randrange(1, 256)
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ mask]))
        self.counts["flips"] += 1
        self.events.append(f"flipped byte {offset} of {os.path.relpath(path, self.cluster.workdir)}"
                           f" (^{mask:#04x})")

    def gc(self) -> None:
        script = os.path.join(os.path.dirname(sys.executable), "tensorstash")
        cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "tensorstash._cli"]
        min_age_0 = self.rng.random() < 0.5
        cmd += ["gc", self.cluster.persistent] + (["--min-age", "0"] if min_age_0 else [])
        before = self.committed()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        self.events.append(f"gc{' --min-age 0' if min_age_0 else ''}: exit {done.returncode}, "
                           f"{done.stdout.strip()[-300:]}")
        if done.returncode != 0:
            self.fail(f"`{' '.join(cmd)}` between runs (no manager open) exit "
                      f"{done.returncode}:\n{done.stdout}{done.stderr}")
        self.counts["gc_min_age_0" if min_age_0 else "gc_default"] += 1
        self.counts["gc_removed"] += sum(line.startswith("removed ")
                                         for line in done.stdout.splitlines())
        self.check_persistent("after gc", before)

    # --- one run of the job ---------------------------------------------------------------------

    def run(self, nproc: int, kill: bool) -> None:
        nodes = self.rng.sample(range(NODES), nproc)
        floor = max(self.committed(), default=None)
        ceiling = self.high
        last = self.high + self.rng.randint(3, 7)
        # Where the kill lands: while the job restores (None), or once a process reached the
        # resumed step + k.
        kill_at = None if self.rng.random() < 0.15 else self.rng.randint(1, last - self.high)
        victims = self.rng.sample(range(nproc), self.rng.randint(1, nproc))
        pause = self.rng.uniform(0.0, 0.5)
        self.counts["runs"] += 1
        if nproc == 2:
            self.counts["runs_of_2"] += 1
        if self.counts["runs"] > 1:
            self.counts["restarts"] += 1
        plan = (f"run {self.counts['runs']}: {nproc} processes on nodes {nodes}, to step {last}"
                + (f", SIGKILL {victims} then the rest when "
                   + ("restoring" if kill_at is None else f"a process reaches resumed+{kill_at}")
                   if kill else ", no kill"))
        self.events.append(plan)
        args = ["--last-step", str(last), "--local-interval", str(LOCAL_INTERVAL),
                "--persistent-interval", str(PERSISTENT_INTERVAL),
                "--timeout", str(min(60, int(self.job_seconds)))]
        for _attempt in range(3):
            job = self.cluster.start(nodes, args, worker=WORKER)
            try:
                codes, killed = self.watch(job, plan, kill, kill_at, victims, pause)
                break
            except PortTaken:  # another program took the free port first: not the job's fault
                self.events.append("  the coordinator's port was taken meanwhile: started again")
        else:
            self.fail(f"{plan}: the coordinator could not listen, 3 times:", job)
        results = self.results(job)
        errors = {pid: r["error"] for pid, r in results.items() if "error" in r}
        for pid, error in errors.items():
            if error.startswith("AssertionError"):  # a failed check, killed or not
                self.fail(f"{plan}: process {pid}: {error}", job)
        restored = {}
        for pid in range(nproc):
            path = os.path.join(job.out, f"restore-{pid}.json")
            if os.path.exists(path):
                info = json.load(open(path))
                if info["checked"]:
                    restored[pid] = info
                elif not killed:
                    self.fail(f"{plan}: process {pid} restored without its checks passing", job)
        if not killed and len(restored) != nproc:
            self.fail(f"{plan}: processes {sorted(set(range(nproc)) - set(restored))} "
                      f"reported no restore", job)
        steps = {info["resumed_from"] for info in restored.values()}
        if len(steps) > 1:
            self.fail(f"{plan}: the processes restored different steps: "
                      f"{ {pid: info['resumed_from'] for pid, info in restored.items()} }", job)
        if steps:
            step = steps.pop()
            latest = {info["latest"] for info in restored.values()}
            self.events.append(f"  restored step {step} (latest_step() {sorted(latest, key=str)}"
                               f", persistent newest {floor})")
            if floor is not None and step < floor:
                self.fail(f"{plan}: restored step {step}, older than the committed persistent "
                          f"step {floor}", job)
            if step > ceiling:
                self.fail(f"{plan}: restored step {step}, which no run reached (the highest "
                          f"was {ceiling})", job)
            if latest != {step} and latest != {None}:
                self.counts["fallbacks"] += 1
            self.resumed.append(step)
        if not killed:
            for pid, r in results.items():
                if r.get("resumed_from") is None or "saved" not in r:
                    self.fail(f"{plan}: process {pid} did not finish: {r}", job)
        else:
            at = [(self.marks(self.read(job, p), "STEP") or [None])[-1] for p in range(nproc)]
            self.events.append(f"  killed; the processes had reached steps {at}")
        self.check_persistent(f"after {plan}")

    def watch(self, job, plan: str, kill: bool, kill_at: int | None, victims: list[int],
              pause: float) -> tuple[list[int | None], bool]:
        """Follows the job until every process ended, SIGKILLs it as planned; its exit codes
        and whether it was killed. A process that fails before the kill fails the test."""
        nproc = len(job.procs)
        started = time.monotonic()
        killed = False
        try:
            while True:
                codes = [p.poll() for p in job.procs]
                lines = [self.read(job, pid) for pid in range(nproc)]
                reached = [self.marks(text, "STEP") for text in lines]
                self.high = max([self.high] + [s for r in reached for s in r])
                if all(c is not None for c in codes) and (killed or not any(codes)):
                    return codes, killed
                failed = [pid for pid, code in enumerate(codes) if code not in (None, 0)]
                if failed and not killed:
                    if "Failed to start RPC server" in lines[0] and not any(
                            "OPENED" in text for text in lines):
                        raise PortTaken()
                    self.fail(f"{plan}: process {failed[0]} failed (exit {codes[failed[0]]}) "
                              f"before any kill", job)
                if kill and not killed:
                    resumed = [self.marks(text, "RESUMED") for text in lines]
                    if kill_at is None:
                        fire = any("LATEST" in text for text in lines)
                    else:
                        fire = any(r and max(st, default=0) >= r[0] + kill_at
                                   for r, st in zip(resumed, reached))
                    if fire:
                        self.kill(job, victims)
                        time.sleep(pause)
                        self.kill(job, list(range(nproc)))
                        killed = True
                        continue
                if time.monotonic() - started > self.job_seconds:
                    self.fail(f"{plan}: not done within {self.job_seconds:.0f} s (a hang)", job)
                time.sleep(0.05)
        finally:
            job.kill()

    @staticmethod
    def read(job, pid: int) -> str:
        with open(job.logs[pid], errors="replace") as f:
            return f.read()

    @staticmethod
    def marks(text: str, word: str) -> list[int]:
        return [int(line.split()[1]) for line in text.splitlines()
                if line.startswith(word + " ") and line.split()[1].isdigit()]

    def kill(self, job, pids: list[int]) -> None:
        for pid in pids:
            p = job.procs[pid]
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                self.counts["kills"] += 1

    @staticmethod
    def results(job) -> dict[int, dict]:
        out = {}
        for pid in range(len(job.procs)):
            path = os.path.join(job.out, f"process-{pid}.json")
            out[pid] = json.load(open(path)) if os.path.exists(path) else {}
        return out

    def fail(self, message: str, job=None) -> None:
        if job is not None:
            job.kill()
        text = [f"chaos seed {self.seed} (replay: TS_CHAOS_SEED={self.seed}): {message}",
                "so far: " + self.summary(), "what happened:",
                *("  " + e for e in self.events[-30:])]
        if job is not None:
            for pid in range(len(job.procs)):
                log = self.read(job, pid)
                text.append(f"--- process {pid} (exit {job.procs[pid].poll()}), its log's end:")
                text.append(log[-3000:])
        raise ChaosFailure("\n".join(text))

    def summary(self) -> str:
        c = self.counts
        return (f"chaos seed={self.seed}: {c['runs']} runs ({c['runs_of_2']} of 2 processes), "
                f"{c['restarts']} restarts, {c['kills']} SIGKILLs, {c['wipes']} wipes, "
                f"{c['flips']} flips, {c['gc_min_age_0'] + c['gc_default']} gc runs "
                f"({c['gc_min_age_0']} with --min-age 0, {c['gc_removed']} leftovers removed), "
                f"{c['fallbacks']} fallbacks to an older step, {c['restores_checked']} persistent "
                f"restores checked; resumed steps {self.resumed}")


def test_chaos_of_the_multi_tier_job(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("simulated nodes need root (mount namespaces and bind mounts)")
    if shutil.which("unshare") is None:
        pytest.skip("simulated nodes need util-linux's unshare")
    seed = env_int("TS_CHAOS_SEED", random.SystemRandom().randrange(2**31))
    rounds = env_int("TS_CHAOS_ROUNDS", 16)
    chaos = Chaos(str(tmp_path), seed, float(env_int("TS_CHAOS_JOB_SECONDS", 150)))
    print(f"\nchaos seed {seed}, {rounds} rounds (replay: TS_CHAOS_SEED={seed} "
          f"TS_CHAOS_ROUNDS={rounds})", flush=True)
    rng = chaos.rng
    for r in range(rounds):
        if r > 0:
            # Faults between runs, each drawn on its own; the job was killed or finished.
            for _ in range(rng.choice([0, 1, 1, 2])):
                chaos.wipe()
            for _ in range(rng.choice([0, 1, 1, 2])):
                chaos.flip()
            if rng.random() < 0.5:
                chaos.gc()
        nproc = 4 if r == 0 else rng.choice([4, 4, 2])
        # The first run is never killed: it commits a persistent step (an intact step exists
        # from then on, so no later restart may fail).
        chaos.run(nproc, kill=r > 0 and rng.random() < 0.75)
    # The last run, without faults, must train to its end from what the chaos left.
    chaos.run(4, kill=False)
    print(chaos.summary(), flush=True)
    for line in chaos.events:
        print("  " + line)
