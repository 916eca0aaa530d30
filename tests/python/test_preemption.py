"""Crash and preemption of a real training job (examples/train_demo/train.py, a tiny config):

- SIGKILL at seeded random moments, many times: every restart resumes from the newest step whose
  COMMIT exists (never a partial one), with a state identical to an uninterrupted run's (every
  loss logged by every attempt, and the final parameters and Adam state, are bit-identical);
- SIGTERM with --handle-sigterm: the job saves its current step and exits 0, and a restart
  resumes from exactly that step;
- the demo (examples/train_demo/demo.py --quick) end to end, which must report PASS.

The kill moments come from a seeded generator (the seed is printed; set TENSORSTASH_KILL_SEED to
replay a sequence of delays). Where a kill lands in the job's work still depends on the
machine's speed, but every outcome is checked the same way.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEMO_DIR = os.path.join(REPO, "examples", "train_demo")
TRAIN = os.path.join(DEMO_DIR, "train.py")
DEMO = os.path.join(DEMO_DIR, "demo.py")

TINY = ["--d-in", "16", "--hidden", "256", "--layers", "2", "--d-out", "16", "--batch", "16"]
STEPS = 300           # more than the killed attempts can reach, so that every attempt is killed
SAVE_EVERY = 3
STEP_SLEEP = "0.02"   # slows the tiny model so that a kill lands among its steps and saves
KILLS = 12
PROCESS_TIMEOUT_S = 120  # any one process; a hang fails the test instead of blocking the run

_spec = importlib.util.spec_from_file_location("train_demo_driver", DEMO)
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)  # the driver's log readers (it imports no JAX)


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    e["JAX_PLATFORMS"] = "cpu"
    return e


def train_cmd(root, log, mesh="2x4", steps=STEPS, save_every=SAVE_EVERY, extra=()):
    return [sys.executable, TRAIN, "--ckpt-dir", str(root), "--log", str(log), "--mesh", mesh,
            "--steps", str(steps), "--save-every", str(save_every), "--max-to-keep", "2",
            *TINY, *extra]


def run(cmd, output) -> int:
    with open(output, "ab") as out:
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env(),
                              timeout=PROCESS_TIMEOUT_S).returncode


def wait_for(proc, log, predicate, what, output):
    """Polls the log until predicate(events) holds; fails if the process ends first."""
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    while True:
        events = demo.read_events(log)
        if predicate(events):
            return events
        if proc.poll() is not None:
            pytest.fail(f"train.py exited ({proc.returncode}) before {what}:\n"
                        + open(output).read()[-3000:])
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"train.py did not reach {what} in {PROCESS_TIMEOUT_S}s")
        time.sleep(0.005)


def start_event(events):
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) <= 1, starts
    return starts[0] if starts else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of all STEPS without checkpoints: step -> loss, and its digest."""
    work = tmp_path_factory.mktemp("reference")
    log = work / "log.jsonl"
    rc = run(train_cmd(work / "ckpts", log, save_every=0), work / "output.txt")
    events = demo.read_events(log)
    assert rc == 0, (work / "output.txt").read_text()
    losses = demo.losses(events)
    assert sorted(losses) == list(range(STEPS))
    done = [e for e in events if e["event"] == "done"]
    assert len(done) == 1 and done[0]["step"] == STEPS
    return losses, done[0]["digest"]


def test_sigkill_at_random_moments_resumes_from_newest_complete_step(reference, tmp_path):
    ref_losses, ref_digest = reference
    seed = int(os.environ.get("TENSORSTASH_KILL_SEED", "20261122"))
    print(f"\nkill seed {seed} (TENSORSTASH_KILL_SEED={seed} replays these delays)")
    rng = random.Random(seed)
    root = tmp_path / "ckpts"
    output = tmp_path / "output.txt"
    checked_resumes = 0
    kills_in_save = 0
    seen_steps: set[int] = set()
    modes = ["launch", "start", "save"] * (KILLS // 3)
    rng.shuffle(modes)
    for attempt in range(KILLS):
        expected = demo.complete_steps(root)
        expected = expected[-1] if expected else None
        log = tmp_path / f"attempt-{attempt}.jsonl"
        mesh = "2x4" if attempt % 2 == 0 else "4x2"
        # Where the delay counts from: "launch" (the kill can hit the start-up or the restore),
        # "start" (the restore is done: among steps, saves and deletions), or "save": the n-th
        # save() of this attempt has returned, so that its write and commit are most likely
        # still in flight.
        mode = modes[attempt]
        nth_save = rng.randint(1, 3)
        delay = rng.uniform(0.0, {"launch": 2.0, "start": 0.8, "save": 0.03}[mode])
        with open(output, "ab") as out:
            proc = subprocess.Popen(train_cmd(root, log, mesh, extra=["--step-sleep", STEP_SLEEP]),
                                    stdout=out, stderr=subprocess.STDOUT, env=env())
        try:
            if mode == "start":
                wait_for(proc, log, lambda ev: start_event(ev) is not None, "its start", output)
            elif mode == "save":
                wait_for(proc, log, lambda ev: [e["event"] for e in ev].count("save") >= nth_save,
                         f"save number {nth_save}", output)
            time.sleep(delay)
            assert proc.poll() is None, f"attempt {attempt} ended before its kill (exit {proc.returncode})"
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if demo.leftovers(root):
            kills_in_save += 1
        events = demo.read_events(log)
        start = start_event(events)
        if start is not None:
            # The restart resumed from the newest complete step at its launch, never from a
            # partial (uncommitted) one, and nothing else.
            assert start["resumed_from"] == expected, (attempt, start, expected)
            checked_resumes += 1
        losses = demo.losses(events)
        seen_steps |= set(losses)
        # Identical state: every loss this attempt computed equals the uninterrupted run's.
        assert demo.mismatches(losses, ref_losses) == [], attempt
        if losses and expected is not None:
            assert min(losses) == expected
        after = {"launch": "launch", "start": "its start", "save": f"save number {nth_save}"}
        print(f"attempt {attempt} on {mesh}: killed {delay:.3f}s after {after[mode]}; "
              f"resumed from {expected}, "
              f"logged steps {min(losses, default='-')}..{max(losses, default='-')}, "
              f"complete now {demo.complete_steps(root)}, leftovers {demo.leftovers(root)}")

    # The last restart runs to the end, and must end where the uninterrupted run ended.
    expected = demo.complete_steps(root)
    assert expected, "no step was ever committed: the kills all came too early"
    log = tmp_path / "final.jsonl"
    assert run(train_cmd(root, log, "4x2"), output) == 0, output.read_text()[-3000:]
    events = demo.read_events(log)
    assert start_event(events)["resumed_from"] == expected[-1]
    losses = demo.losses(events)
    assert sorted(losses) == list(range(expected[-1], STEPS))
    assert demo.mismatches(losses, ref_losses) == []
    done = [e for e in events if e["event"] == "done"]
    assert len(done) == 1 and done[0]["digest"] == ref_digest
    assert demo.leftovers(root) == []  # leftovers of killed saves are gone after a start-up
    assert demo.complete_steps(root) == [STEPS - SAVE_EVERY, STEPS]  # max_to_keep=2
    assert checked_resumes >= KILLS // 2, checked_resumes
    assert expected[-1] >= 3 * SAVE_EVERY, "the killed attempts made almost no progress"
    print(f"{KILLS} kills, {checked_resumes} restarts checked, {kills_in_save} left a save "
          f"in flight, {len(seen_steps)} steps trained before the last restart from {expected[-1]}")


def test_sigterm_saves_the_current_step_and_exits_zero(reference, tmp_path):
    ref_losses, _ = reference
    root, output = tmp_path / "ckpts", tmp_path / "output.txt"
    log = tmp_path / "first.jsonl"
    with open(output, "ab") as out:
        proc = subprocess.Popen(
            train_cmd(root, log, extra=["--handle-sigterm", "--step-sleep", STEP_SLEEP]),
            stdout=out, stderr=subprocess.STDOUT, env=env())
    try:
        # SIGTERM between two interval saves (step 7: saves are at 3, 6, 9, ...).
        wait_for(proc, log, lambda ev: 7 in demo.losses(ev), "step 7", output)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=PROCESS_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, output.read_text()[-3000:]
    events = demo.read_events(log)
    preempted = [e for e in events if e["event"] == "preempted"]
    assert len(preempted) == 1, events[-5:]
    step = preempted[0]["step"]
    assert step == max(demo.losses(events)) + 1  # the step it was at: every update is saved
    assert demo.complete_steps(root)[-1] == step
    assert demo.leftovers(root) == []
    assert [e["event"] for e in events].count("done") == 0

    # A restart resumes from exactly that step, identically.
    log2 = tmp_path / "second.jsonl"
    assert run(train_cmd(root, log2, "4x2", steps=step + 5), output) == 0, output.read_text()[-3000:]
    events = demo.read_events(log2)
    assert start_event(events)["resumed_from"] == step
    losses = demo.losses(events)
    assert sorted(losses) == list(range(step, step + 5))
    assert demo.mismatches(losses, ref_losses) == []

    # A restart with another model config is refused, not silently resumed.
    log3 = tmp_path / "third.jsonl"
    assert run(train_cmd(root, log3, extra=["--lr", "0.5"]), output) != 0
    assert "saved with another config" in output.read_text()
    assert start_event(demo.read_events(log3)) is None


def test_demo_quick_reports_pass(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, DEMO, "--quick", "--out", str(out)], env=env(),
                          capture_output=True, text=True, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "\nPASS" in proc.stdout and "FAIL" not in proc.stdout
    resumed = demo.read_events(str(out / "resume.jsonl"))
    start = start_event(resumed)
    assert start["mesh"] == [4, 2] and start["resumed_from"] is not None


def test_demo_comparison_sees_a_one_ulp_difference():
    import numpy as np

    ref = {0: 0.5, 1: float(np.float32(0.25))}
    nudged = float(np.nextafter(np.float32(0.25), np.float32(1)))
    assert demo.mismatches({0: 0.5, 1: ref[1]}, ref) == []
    assert demo.mismatches({0: 0.5, 1: nudged}, ref) != []
    assert demo.mismatches({2: 0.5}, ref) != []  # a step the reference lacks
