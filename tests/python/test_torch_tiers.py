"""The manager's tiers and S3 under torch jobs (issue 39 part 2): a job of 2 gloo processes,
each on its own simulated node (examples/multitier/cluster.py: its own mount namespace, its
node's RAM tier at the same local_dir), with a multi-tier CheckpointManager whose persistent
root is on S3 (a local SeaweedFS, tests/python/s3_fixtures.py); one node is lost and its
process resumes from its peer's copy. And a torch state dict on s3:// in one process, through
tensorstash.save / tensorstash.torch.load and through DCP's save/load with StorageWriter /
StorageReader."""

from __future__ import annotations

import os
import sys
import warnings

import torch

import tensorstash
from s3_fixtures import s3, server  # noqa: F401 - fixtures
from torch_tier_worker import same_bits, state_at

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "multitier"))
from cluster import Cluster  # noqa: E402

WORKER = os.path.join(HERE, "torch_tier_worker.py")


def test_a_lost_node_of_a_torch_job_resumes_from_its_peer(tmp_path, s3):
    root = f"{s3.url}/run"
    cluster = Cluster(str(tmp_path), nodes=2)
    # Steps 1-3 in both nodes' RAM (the tier keeps the newest), step 2 also on S3. The job
    # ends (a crash would leave the root's lease on S3 held for a minute: the restart would
    # wait for it; test_multitier.py kills jobs on file roots).
    first = cluster.start([0, 1], ["--last-step", "3", "--persistent-interval", "2"],
                          persistent=root, worker=WORKER).wait()
    for pid, r in first.items():
        assert (r["resumed_from"], r["all_steps"], r["local_steps"]) == (None, [2], [3]), r
    cluster.lose_node(1)  # node 1 comes back with an empty RAM tier
    results = cluster.start([0, 1], ["--last-step", "4", "--persistent-interval", "2"],
                            persistent=root, worker=WORKER).wait()
    for pid, r in results.items():
        assert r["resumed_from"] == 3, (pid, r)  # newer than S3's step 2: from RAM
        assert r["restore"]["failures"] == [], (pid, r)
        assert r["restore"]["bytes_from"]["persistent"] == 0, (pid, r)
        assert r["all_steps"] == [2, 4], (pid, r)
    assert results[0]["restore"]["bytes_from"]["local"] > 0, results[0]
    assert results[0]["restore"]["bytes_from"]["peer"] == 0, results[0]
    assert results[1]["restore"]["bytes_from"]["local"] == 0, results[1]
    assert results[1]["restore"]["bytes_from"]["peer"] > 0, results[1]  # node 0's copy
    # The job's step 4 on S3, restored here into torch tensors.
    got = tensorstash.restore(f"{root}/0000000004",
                              target={"model": {k: torch.zeros_like(v)
                                                for k, v in state_at(4).items()}})
    for name, want in state_at(4).items():
        assert same_bits(got["model"][name], want), name
    assert f"{s3.prefix}/run/0000000004/COMMIT" in s3.keys()


def torch_state() -> dict:
    g = torch.Generator().manual_seed(5)
    model = torch.nn.Linear(16, 8)
    return {"model": {"weight": torch.randn(8, 16, generator=g),
                      "emb": torch.randn(33, 4, generator=g).to(torch.bfloat16),
                      "f8": torch.randn(6, 2, generator=g).to(torch.float8_e5m2),
                      "mask": torch.tensor([True, False]),
                      "param": model.weight},
            "optim": {"state": {0: {"step": torch.tensor(4.0),
                                    "exp_avg": torch.randn(8, 16, generator=g)}},
                      "param_groups": [{"lr": 0.5, "betas": (0.9, 0.95), "params": [0]}]}}


def zeros_like(tree):
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: zeros_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [zeros_like(v) for v in tree]
    return tree


def assert_same(got, want, where=""):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and same_bits(got.detach(), want.detach()), where
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}/{i}")
    else:
        assert got == want, (where, got, want)


def test_a_torch_state_dict_on_s3_by_tensorstash_and_by_dcp(s3):
    import torch.distributed.checkpoint as dcp

    want = torch_state()
    step = s3.step("0000000001")
    tensorstash.save(step, want)
    target = zeros_like(torch_state())
    assert tensorstash.torch.load(step, target) is target
    assert_same(target, want)

    dcp_step = s3.step("0000000002")
    flat = {"model": want["model"]}
    with warnings.catch_warnings():  # DCP warns that no_dist runs in a single process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(flat, storage_writer=tensorstash.torch.StorageWriter(dcp_step), no_dist=True)
        target = zeros_like({"model": want["model"]})
        dcp.load(target, storage_reader=tensorstash.torch.StorageReader(dcp_step), no_dist=True)
    assert_same(target, flat)
    # The DCP step is a native step there: restored by tensorstash too.
    got = tensorstash.restore(dcp_step, target=zeros_like(flat))
    assert_same(got, flat)
    keys = s3.keys()
    for name in ("0000000001", "0000000002"):
        assert f"{s3.prefix}/{name}/COMMIT" in keys, keys
