"""Saves by one process count and restores by another, with real jax.distributed jobs of local
CPU processes (8 devices in all), through tests/python/mp_worker.py."""

from __future__ import annotations

import json
import os

import pytest

import mp_launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_worker.py")  # test_manager runs mp_manager_worker.py instead
TIMEOUT_S = 150  # for a whole job; a hang fails the test instead of blocking the run


def run_job(phase: str, step: str, nproc: int, layout: str, cwd: str) -> str:
    """Runs `nproc` processes of WORKER (mp_launch.run_job); returns their output."""
    return mp_launch.run_job(WORKER, phase, step, nproc, layout, cwd, timeout_s=TIMEOUT_S)


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


@pytest.mark.parametrize("nproc", [2, 4, 1])
def test_the_recorded_sharding_is_the_global_mesh(saved, nproc):
    # Issue 38 part 3: the step records the job's mesh (all processes' devices), and this
    # process of 8 devices restores onto it with metadata() as the target.
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import tensorstash
    from tshelpers import pattern

    meta = tensorstash.metadata(saved[nproc])
    w, emb = meta["params"]["w"], meta["params"]["emb"]
    assert w.saved_sharding["shape"] == [2, 4] and w.saved_sharding["axis_names"] == ["x", "y"]
    assert w.saved_sharding["partition_spec"] == ["x", "y"]
    assert emb.saved_sharding["partition_spec"] == [["x", "y"]]
    assert meta["host"].sharding is None  # a NumPy array
    assert w.sharding is not None and w.sharding.spec == P("x", "y")
    assert dict(w.sharding.mesh.shape) == {"x": 2, "y": 4}
    got = tensorstash.restore(saved[nproc], target=meta)
    assert isinstance(got["params"]["w"], jax.Array) and got["params"]["w"].sharding == w.sharding
    np.testing.assert_array_equal(np.asarray(got["params"]["w"]),
                                  pattern((16, 24), np.float32, seed=0))
