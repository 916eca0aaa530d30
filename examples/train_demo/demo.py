"""The tensorstash training demo: kill a training job with SIGKILL, resume it on another mesh, and
show that nothing changed.

  1. reference: train.py runs uninterrupted on a 2x4 mesh (no checkpoints) and logs its losses;
  2. run: train.py on a 2x4 mesh with async checkpoints every k steps, killed with a real SIGKILL
     partway (after a checkpoint has committed, just after the next save was started, so that
     it may still be in flight);
  3. resume: train.py again on the same checkpoint folder, now on a 4x2 mesh; it restores the
     newest complete step onto the new mesh and trains to the end.
Then the losses of the resumed run must equal the reference's bit for bit at every step, and so
must the final parameters and optimizer state (a sha256 over all their bytes). It prints a short
report and PASS or FAIL; the exit status is 0 only on PASS.

    python examples/train_demo/demo.py                  # about 2.4 M parameters, 80 steps
    python examples/train_demo/demo.py --quick          # a tiny model, a few seconds of training
    python examples/train_demo/demo.py --out /tmp/demo  # default: demo_checkpoints/train
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TRAIN = os.path.join(HERE, "train.py")

# Model and run sizes: (train.py flags, steps, save every, kill just after the save of this step).
FULL = (["--d-in", "128", "--hidden", "1024", "--layers", "3", "--d-out", "128", "--batch", "64"],
        80, 10, 40)
QUICK = (["--d-in", "32", "--hidden", "128", "--layers", "2", "--d-out", "32", "--batch", "16"],
         30, 5, 15)
RUN_TIMEOUT_S = 300  # for any one process; a hang fails the demo instead of blocking it


def read_events(path: str) -> list[dict]:
    """The events of a train.py log (a missing file has none)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def losses(events: list[dict]) -> dict[int, float]:
    """step -> loss; the last record wins when a step was logged twice."""
    return {e["step"]: e["loss"] for e in events if e["event"] == "loss"}


def mismatches(got: dict[int, float], reference: dict[int, float]) -> list[str]:
    """Steps whose loss differs from the reference in any bit (the logged values are float32
    losses converted exactly to Python floats, so == on them is bit equality), or that the
    reference lacks."""
    out = []
    for step in sorted(got):
        if step not in reference:
            out.append(f"step {step}: not in the reference")
        elif got[step] != reference[step]:
            out.append(f"step {step}: {got[step]!r} != reference {reference[step]!r}")
    return out


def complete_steps(root: str) -> list[int]:
    """Steps whose folder has a COMMIT record (what a restart may resume from)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names
                  if n.isdigit() and os.path.isfile(os.path.join(root, n, "COMMIT")))


def leftovers(root: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(root) if ".tmp-" in n or ".old-" in n)
    except FileNotFoundError:
        return []


def folder_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def train_command(flags: list[str], ckpt: str, log: str, mesh: str, steps: int,
                  save_every: int) -> list[str]:
    return [sys.executable, TRAIN, "--ckpt-dir", ckpt, "--log", log, "--mesh", mesh,
            "--steps", str(steps), "--save-every", str(save_every), *flags]


def run_to_end(cmd: list[str], output: str) -> tuple[int, float]:
    """Runs a train.py process to its end; returns (exit status, seconds)."""
    t0 = time.perf_counter()
    with open(output, "ab") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                timeout=RUN_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    return rc, time.perf_counter() - t0


def run_and_kill(cmd: list[str], log: str, output: str, kill_step: int) -> tuple[str, float]:
    """Runs a train.py process and SIGKILLs it as soon as the save of `kill_step` has returned
    (its write and commit most likely still in flight), once an earlier step has committed.
    Returns (what happened, seconds)."""
    t0 = time.perf_counter()
    with open(output, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            events = read_events(log)
            committed = any(e["event"] == "saved" for e in events)
            started = any(e["event"] == "save" and e["step"] == kill_step for e in events)
            if committed and started:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return "killed", time.perf_counter() - t0
            if proc.poll() is not None:
                return f"exited ({proc.returncode}) before it could be killed", time.perf_counter() - t0
            if time.perf_counter() - t0 > RUN_TIMEOUT_S:
                return f"still not at step {kill_step} after {RUN_TIMEOUT_S}s", time.perf_counter() - t0
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(
                       os.environ.get("TENSORSTASH_DEMO_DIR", os.path.join(REPO, "demo_checkpoints")),
                       "train"),
                   help="output folder (emptied first); default: $TENSORSTASH_DEMO_DIR/train, "
                        "else demo_checkpoints/train in the repository")
    p.add_argument("--quick", action="store_true", help="a tiny model and a short run")
    p.add_argument("--steps", type=int, help="override the number of steps")
    args = p.parse_args(argv)
    flags, steps, save_every, kill_step = QUICK if args.quick else FULL
    if args.steps:
        steps = args.steps
        kill_step = max(2 * save_every, (steps // 2) // save_every * save_every)
        if kill_step >= steps:
            p.error(f"--steps {steps} is too few to kill the run after two saves")

    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    ckpt = os.path.join(out, "ckpts")
    logs = {name: os.path.join(out, f"{name}.jsonl") for name in ("reference", "run", "resume")}
    output = os.path.join(out, "output.txt")  # the train.py processes' stdout and stderr
    problems: list[str] = []

    # 1. The reference: uninterrupted, no checkpoints.
    rc, ref_s = run_to_end(train_command(flags, os.path.join(out, "reference-ckpts"),
                                         logs["reference"], "2x4", steps, 0), output)
    ref_events = read_events(logs["reference"])
    reference = losses(ref_events)
    ref_done = [e for e in ref_events if e["event"] == "done"]
    if rc != 0 or sorted(reference) != list(range(steps)) or not ref_done:
        print(f"FAIL: the reference run failed (exit {rc}); see {output}")
        return 1
    start = next(e for e in ref_events if e["event"] == "start")
    cfg = start["config"]

    # 2. The run on 2x4, killed partway.
    what, run_s = run_and_kill(train_command(flags, ckpt, logs["run"], "2x4", steps, save_every),
                               logs["run"], output, kill_step)
    if what != "killed":
        print(f"FAIL: the run {what}; see {output}")
        return 1
    run_events = read_events(logs["run"])
    at_kill = complete_steps(ckpt)
    left_at_kill = leftovers(ckpt)
    last_logged = max(losses(run_events))
    problems += [f"run (2x4) {m}" for m in mismatches(losses(run_events), reference)]
    if not at_kill:
        problems.append("no complete step after the kill")
    newest = at_kill[-1] if at_kill else None

    # 3. The restart on 4x2.
    rc, resume_s = run_to_end(train_command(flags, ckpt, logs["resume"], "4x2", steps,
                                            save_every), output)
    res_events = read_events(logs["resume"])
    res_start = [e for e in res_events if e["event"] == "start"]
    res_done = [e for e in res_events if e["event"] == "done"]
    resumed = losses(res_events)
    if rc != 0 or not res_start or not res_done:
        problems.append(f"the resumed run failed (exit {rc}; see {output})")
    else:
        if res_start[0]["resumed_from"] != newest:
            problems.append(f"resumed from step {res_start[0]['resumed_from']}, but the newest "
                            f"complete step at the kill was {newest}")
        if newest is not None and sorted(resumed) != list(range(newest, steps)):
            problems.append(f"the resumed run logged steps {min(resumed, default=None)}.."
                            f"{max(resumed, default=None)}, expected {newest}..{steps - 1}")
        problems += [f"resumed (4x2) {m}" for m in mismatches(resumed, reference)]
        if res_done[0]["digest"] != ref_done[0]["digest"]:
            problems.append("the final parameters and Adam state differ from the reference's")

    # The report.
    saves = [e for e in run_events + res_events if e["event"] == "saved"]
    n_params = sum(a * b + b for a, b in zip(
        [cfg["d_in"]] + [cfg["hidden"]] * cfg["layers"],
        [cfg["hidden"]] * cfg["layers"] + [cfg["d_out"]]))
    final_steps = complete_steps(ckpt)
    shown = lambda path: os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    print(f"tensorstash training demo: an MLP of {n_params / 1e6:.2f} M parameters + Adam "
          f"(float32), batch {cfg['batch']}, {steps} steps, 8 CPU devices")
    print(f"  reference  2x4 mesh, uninterrupted, no checkpoints ({ref_s:.1f} s)")
    print(f"  run        2x4 mesh, async save every {save_every} steps, SIGKILL right after "
          f"save({kill_step}) returned ({run_s:.1f} s; last loss logged: step {last_logged})")
    print(f"             at the kill: complete steps {', '.join(map(str, at_kill)) or 'none'}; "
          f"unfinished: {', '.join(left_at_kill) or 'none'}")
    if res_start:
        rs = res_start[0]
        restore = (f", restore {rs['restore_s'] * 1e3:.0f} ms" if rs["restore_s"] is not None
                   else "")
        print(f"  resume     4x2 mesh, from step {rs['resumed_from']} (the newest complete step)"
              f"{restore} ({resume_s:.1f} s)")
    if saves:
        blocking = [e["blocking_s"] * 1e3 for e in saves]
        total = [e["total_s"] * 1e3 for e in saves]
        print(f"  saves      {len(saves)} committed, "
              f"{mb(statistics.median(e['stored_bytes'] for e in saves))} of data each; "
              f"blocking per save: median {statistics.median(blocking):.1f} ms (min "
              f"{min(blocking):.1f}, max {max(blocking):.1f}); until committed: median "
              f"{statistics.median(total):.0f} ms")
    print(f"  on disk    {shown(ckpt)}/: " + ", ".join(
        f"{s:010d} {mb(folder_bytes(os.path.join(ckpt, f'{s:010d}')))}" for s in final_steps))
    print(f"  logs       {shown(out)}/{{reference,run,resume}}.jsonl, output.txt")
    if newest is not None and resumed:
        print("  losses     step  reference             resumed on 4x2")
        for step in sorted(set(range(newest, steps, max(1, (steps - newest) // 5))) | {steps - 1}):
            if step in resumed:
                same = "same bits" if resumed[step] == reference[step] else "DIFFERENT"
                print(f"             {step:4d}  {reference[step]!r:21s} {resumed[step]!r:21s} "
                      f"{same}")
    if problems:
        print("FAIL:")
        for line in problems[:20]:
            print(f"  {line}")
        return 1
    print(f"PASS: all {len(resumed)} losses after the resume (steps {newest}..{steps - 1}) and the "
          f"final parameters and Adam state are bit-identical to the uninterrupted run's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
