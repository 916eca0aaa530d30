"""torch.distributed jobs (issue 39 parts 1 and 2): DTensors (Shard, Replicate, uneven and
_StridedShard shards) saved and restored by 2 and 4 gloo processes on 127.0.0.1 through
tests/python/torch_worker.py, across world sizes (1 -> 2, 2 -> 1, 2 -> 4, 4 -> 1, 4 -> 2),
with the coordinator over torch.distributed's store (which saves leave empty) and the
manager's local tier.

Spawning is slow (each process imports torch), so each job runs many cases (torch_worker's
"CASE ... ok" lines) and the tests here check their reports and what they wrote."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import mp_launch
import tensorstash
import torch_worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "torch_worker.py")
TIMEOUT_S = 240  # for a whole job; a hang fails the test instead of blocking the run
# The worker imports the tensorstash this test imported (mp_launch drops PYTHONPATH otherwise).
PYTHONPATH = os.pathsep.join([os.path.dirname(os.path.dirname(tensorstash.__file__)), HERE])

JOB2_CASES = ("layouts", "coordinator", "restore_1_to_2", "save_and_restore_2", "load_in_place",
              "manager_local_dir", "fsdp2_get_state_dict")
JOB4_CASES = ("restore_2_to_4", "save_and_restore_4")
JOB2B_CASES = ("restore_4_to_2", "no_keys_left")


def run_job(phase: str, nproc: int, work: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return mp_launch.run_job(WORKER, phase, work, nproc, "-", work, env=env, timeout_s=TIMEOUT_S,
                             pythonpath=PYTHONPATH)


def full_plain() -> dict:
    full = torch_worker.full_tensors()
    return dict(full, plain=full["even"] * 2)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The work folder after the test's own save by 1 process, job2, job4 and job2b (4 -> 2
    and the store's keys), with their outputs."""
    work = str(tmp_path_factory.mktemp("torchjobs"))
    tensorstash.save(os.path.join(work, "root1", "0000000001"), full_plain())
    out2 = run_job("job2", 2, work)
    out4 = run_job("job4", 4, work)
    out2b = run_job("job2b", 2, work)
    return work, out2, out4, out2b


def reports(text: str, nproc: int) -> dict[int, set[str]]:
    """{process: the cases it reported ok} of a job's output."""
    out: dict[int, set[str]] = {}
    pid = None
    for line in text.splitlines():
        if line.startswith("--- process "):
            pid = int(line.split()[2].split("/")[0])
            out[pid] = set()
        elif line.startswith("CASE ") and line.endswith(" ok") and pid is not None:
            out[pid].add(line.split()[1])
    assert sorted(out) == list(range(nproc)), text
    return out


def test_every_case_of_the_2_process_job_passed_in_every_process(jobs):
    _, out2, _, _ = jobs
    for pid, cases in reports(out2, 2).items():
        assert cases == set(JOB2_CASES), (pid, out2)


def test_every_case_of_the_4_process_job_passed_in_every_process(jobs):
    _, _, out4, _ = jobs
    for pid, cases in reports(out4, 4).items():
        assert cases == set(JOB4_CASES), (pid, out4)


def test_every_case_of_the_2_process_job_after_the_4_process_one_passed(jobs):
    # 4 -> 2 with DTensors, and no tensorstash keys left in torch.distributed's store after
    # saves by tensorstash.save and by DCP's save through StorageWriter.
    _, _, _, out2b = jobs
    for pid, cases in reports(out2b, 2).items():
        assert cases == set(JOB2B_CASES), (pid, out2b)


def test_both_processes_wrote_and_replicas_split_the_writing(jobs):
    work, _, _, _ = jobs
    step = os.path.join(work, "root2", "0000000002")
    files = os.listdir(os.path.join(step, "state", "data"))
    assert {int(name.split("-")[0]) for name in files} == {0, 1}, files


@pytest.mark.parametrize("root, step", [("root2", "0000000002"), ("root4", "0000000004")])
def test_restore_by_one_process(jobs, root, step):
    # 2 -> 1 and 4 -> 1: whole arrays, as NumPy without a target and as tensors with one.
    work, _, _, _ = jobs
    path = os.path.join(work, root, step)
    saved = tensorstash.restore(path)["model"]
    full = full_plain()
    for name, value in saved.items():
        want = full[name].contiguous().reshape(-1).view(torch.uint8).numpy()
        assert np.asarray(value).tobytes() == want.tobytes(), name
    target = {name: torch.zeros_like(full[name]) for name in saved}
    got = tensorstash.restore(path, target={"model": target})["model"]
    for name, value in got.items():
        assert torch_worker.same_bits(value, full[name]), name
    if root == "root2":
        meta = tensorstash.metadata(path)
        assert meta["model"]["strided"].saved_sharding["sharding_type"] == "DTensor"


def test_an_fsdp2_state_saved_by_2_restores_whole_in_one_process(jobs):
    work, _, _, _ = jobs
    want = torch.load(os.path.join(work, "fsdp_full.pt"))
    step = os.path.join(work, "fsdp", "0000000001")
    target = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
              "optim": {"state": {fqn: {n: torch.zeros_like(v) for n, v in per.items()}
                                  for fqn, per in want["optim"]["state"].items()},
                        "param_groups": want["optim"]["param_groups"]}}
    got = tensorstash.restore(step, target=target)
    for k, v in want["model"].items():
        assert torch_worker.same_bits(got["model"][k], v), k
    for fqn, per in want["optim"]["state"].items():
        for n, v in per.items():
            assert torch_worker.same_bits(got["optim"]["state"][fqn][n], v), (fqn, n)
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
