"""Background saves of torch state (issue 39 part 7): save() returns once the state is copied,
so training may change the tensors in place at once; a job killed (SIGKILL) while a save is in
flight resumes from the newest complete step with the state of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch

import tensorstash

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "torch_train.py")
STEPS = 12


def test_a_background_save_keeps_the_values_of_the_moment_save_returned(tmp_path):
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    with tensorstash.CheckpointManager(str(tmp_path), async_save=True) as mgr:
        mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
        with torch.no_grad():  # training goes on at once, in place
            for p in model.parameters():
                p.mul_(-3).add_(7)
            opt.state_dict()["state"][0]["momentum_buffer"].fill_(123)
        mgr.wait_until_finished()
        got = mgr.restore(1)
    for k, v in want.items():
        assert got["model"][k].tobytes() == v.numpy().tobytes(), k
    assert got["optim"]["state"][0]["momentum_buffer"].tobytes() == momentum.numpy().tobytes()


def run_train(root: str, out: str, kill_after_saved: int | None = None) -> list[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(tensorstash.__file__)))
    proc = subprocess.Popen([sys.executable, TRAIN, root, str(STEPS), out], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if kill_after_saved is not None and line.strip() == f"SAVED {kill_after_saved}":
                proc.send_signal(signal.SIGKILL)  # its write is in the background now
                break
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if kill_after_saved is None:
        assert rc == 0, "\n".join(lines)
    else:
        assert rc == -signal.SIGKILL, "\n".join(lines)
    return lines


def test_sigkill_during_a_background_save_then_resume(tmp_path):
    ref_out = str(tmp_path / "ref.pt")
    run_train(str(tmp_path / "ref"), ref_out)
    root, out = str(tmp_path / "run"), str(tmp_path / "run.pt")
    run_train(root, out, kill_after_saved=5)
    with tensorstash.CheckpointManager(root) as mgr:
        latest = mgr.latest_step()
    assert latest is not None and 4 <= latest <= 5, latest  # newest complete step
    lines = run_train(root, out)
    assert lines[0] == f"RESUMED {latest}", lines
    ref, got = torch.load(ref_out), torch.load(out)
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), k
    for i, per in ref["optim"]["state"].items():
        for name, v in per.items():
            assert torch.equal(got["optim"]["state"][i][name], v), (i, name)
