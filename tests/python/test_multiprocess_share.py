"""Shared reads (issue 42): jax.distributed jobs of local CPU processes restore one step, each
stored chunk that several of them need read from storage by one of them and received by the
others over the peer transport (tests/python/mp_share_worker.py)."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

import mp_launch
from s3_fixtures import s3, server  # noqa: F401 - fixtures

import tensorstash

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_share_worker.py")
TIMEOUT_S = 120
# The workers import the tensorstash this test imported.
WORKER_PYTHONPATH = os.pathsep.join([os.path.dirname(os.path.dirname(tensorstash.__file__)),
                                     HERE])


def run_job(mode: str, step: str, nproc: int, cwd: str, env: dict | None = None) -> str:
    return mp_launch.run_job(WORKER, "restore", step, nproc, mode, cwd, timeout_s=TIMEOUT_S,
                             env=env, pythonpath=WORKER_PYTHONPATH)


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """A step saved by this process: "w" (16 x 24 float32) in chunks of 3 rows, "b" (10 x 6
    int32, zstd)."""
    import tensorstash
    from tshelpers import pattern

    path = str(tmp_path_factory.mktemp("share") / "root" / "0000000007")
    tensorstash.save(path, {"w": pattern((16, 24), np.float32, seed=1),
                            "b": pattern((10, 6), np.int32, seed=2)},
                     chunk_bytes=3 * 24 * 4, codec="zstd")
    return path


def stored_bytes(path: str) -> int:
    from tensorstash import _ext, _paths


    root, step = _paths.split(path)
    reader = _ext.Reader(root, step)
    try:
        return sum(a["stored_bytes"] for a in reader.arrays())
    finally:
        reader.close()


def job_stats(cwd: str, mode: str, nproc: int) -> dict[int, dict]:
    out = {}
    for pid in range(nproc):
        name = os.path.join(cwd, f"share-{mode}-{pid}.json")
        if os.path.exists(name):
            with open(name) as f:
                out[pid] = json.load(f)
    return out


@pytest.mark.parametrize("nproc", [2, 4])
def test_replicas_read_every_stored_chunk_once_between_them(step, tmp_path, nproc):
    run_job("replicated", step, nproc, str(tmp_path))
    stats = job_stats(str(tmp_path), "replicated", nproc)
    assert sorted(stats) == list(range(nproc))
    total = stored_bytes(step)
    assert sum(s["storage_bytes"] for s in stats.values()) == total, stats
    assert sum(s["peer_bytes"] for s in stats.values()) == (nproc - 1) * total, stats
    assert all(s["fallbacks"] == [] for s in stats.values()), stats


def test_uneven_overlapping_boxes_share_their_common_chunks(step, tmp_path):
    # 4 processes of 2 devices: 2 rows per device, 4 per process; stored chunks of 3 rows cut
    # across the processes' blocks.
    run_job("reshard", step, 4, str(tmp_path))
    stats = job_stats(str(tmp_path), "reshard", 4)
    assert sorted(stats) == [0, 1, 2, 3]
    assert sum(s["storage_bytes"] for s in stats.values()) == stored_bytes(step), stats
    assert sum(s["peer_bytes"] for s in stats.values()) > 0, stats


def test_a_corrupt_peer_is_caught_and_its_chunks_read_from_storage(step, tmp_path):
    out = run_job("corrupt", step, 3, str(tmp_path))
    stats = job_stats(str(tmp_path), "corrupt", 3)
    assert sorted(stats) == [0, 1, 2], out
    for pid in (1, 2):
        assert stats[pid]["fallbacks"], stats[pid]
        assert all("process 0" in line and "CRC-32C mismatch" in line
                   for line in stats[pid]["fallbacks"]), stats[pid]
    assert stats[0]["fallbacks"] == []


def test_a_process_killed_mid_restore_does_not_hang_the_others(step, tmp_path):
    failure, text = mp_launch._run_job_once(WORKER, "restore", step, 3, "kill", str(tmp_path),
                                            (), None, TIMEOUT_S, WORKER_PYTHONPATH)
    assert "timed out" not in failure, text
    stats = job_stats(str(tmp_path), "kill", 3)
    # The survivors restored bit-exact (the worker checks), the chunks of process 1 from storage.
    assert sorted(stats) == [0, 2], text
    for pid in (0, 2):
        assert all("process 1" in line for line in stats[pid]["fallbacks"]), stats[pid]


def test_an_s3_step_shares_by_default(s3, tmp_path):  # noqa: F811 - the fixture
    import tensorstash
    from tshelpers import pattern

    step = s3.step("0000000009")
    tensorstash.save(step, {"w": pattern((16, 24), np.float32, seed=1),
                            "b": pattern((10, 6), np.int32, seed=2)}, chunk_bytes=3 * 24 * 4)
    run_job("default", step, 2, str(tmp_path), env=s3.env())
    stats = job_stats(str(tmp_path), "default", 2)
    assert sorted(stats) == [0, 1]
    assert sum(s["storage_bytes"] for s in stats.values()) == stored_bytes(step), stats
