"""restore(share_reads=...) from Python without a JAX job: "processes" that are threads of this
process, each with its own coordinator over one key-value dict (test_multiprocess_share.py runs
real jax.distributed jobs)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import tensorstash
from tensorstash import _ext, _paths
from tshelpers import assert_same_array, pattern

from test_phased_save import ThreadCoordinator

TREE = {"w": pattern((40, 16), np.float32, seed=3), "b": pattern((9, 5), np.int64, seed=4)}


class TryGetCoordinator(ThreadCoordinator):
    def key_value_try_get(self, key: str) -> str | None:
        with self.cond:
            return self.shared.get(key)


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("share") / "0000000002")
    tensorstash.save(path, TREE, chunk_bytes=5 * 16 * 4)
    return path


def stored_bytes(path: str) -> int:
    root, name = _paths.split(path)
    reader = _ext.Reader(root, name)
    try:
        return sum(a["stored_bytes"] for a in reader.arrays())
    finally:
        reader.close()


def restore_in_threads(path: str, n: int, **kwargs) -> list:
    shared: dict = {}
    cond = threading.Condition()
    results: list = [None] * n

    def one(p: int) -> None:
        stats: dict = {}
        try:
            tree = tensorstash.restore(path, coordinator=TryGetCoordinator(shared, cond, p, n),
                                       stats=stats, **kwargs)
            results[p] = (tree, stats)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            results[p] = e

    threads = [threading.Thread(target=one, args=(p,)) for p in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_three_processes_read_each_stored_byte_once_between_them(step):
    results = restore_in_threads(step, 3, share_reads=True)
    for r in results:
        assert not isinstance(r, BaseException), r
        tree, stats = r
        for k in TREE:
            assert_same_array(tree[k], TREE[k], k)
        assert stats["shared"] and stats["fallbacks"] == [], stats
    total = stored_bytes(step)
    assert sum(s["storage_bytes"] for _, s in results) == total
    assert sum(s["peer_bytes"] for _, s in results) == 2 * total
    assert all(s["bytes"] == total for _, s in results)


def test_the_default_shares_only_on_object_stores(step):
    # A file path with share_reads=None: every process reads for itself.
    results = restore_in_threads(step, 2)
    total = stored_bytes(step)
    for r in results:
        assert not isinstance(r, BaseException), r
        assert not r[1]["shared"] and r[1]["storage_bytes"] >= total and r[1]["peer_bytes"] == 0


def test_one_process_or_sharing_off_reads_as_without_it(step):
    stats: dict = {}
    tree = tensorstash.restore(step, share_reads=True, stats=stats)  # no coordinator: one process
    assert_same_array(tree["w"], TREE["w"], "w")
    assert not stats["shared"] and stats["peer_bytes"] == 0 and stats["storage_bytes"] > 0
    results = restore_in_threads(step, 2, share_reads=False)
    assert all(not r[1]["shared"] for r in results), results


def test_an_orbax_step_reads_as_without_sharing(tmp_path):
    path = str(tmp_path / "orbax" / "3")
    tensorstash.save(path, TREE, format="orbax")
    results = restore_in_threads(path, 2, share_reads=True)
    for r in results:
        assert not isinstance(r, BaseException), r
        tree, stats = r
        for k in TREE:
            assert_same_array(tree[k], TREE[k], k)
        assert not stats["shared"] and stats["peer_bytes"] == 0


def test_share_reads_takes_true_false_or_none(step):
    with pytest.raises(TypeError, match="share_reads"):
        tensorstash.restore(step, share_reads="yes")
    with pytest.raises(TypeError, match="stats"):
        tensorstash.restore(step, stats=[])


def test_the_manager_shares_and_reports_it(step):
    root = os.path.dirname(step)
    shared: dict = {}
    cond = threading.Condition()
    results: list = [None] * 2

    def one(p: int) -> None:
        try:
            mgr = tensorstash.CheckpointManager(
                root, coordinator=TryGetCoordinator(shared, cond, p, 2), share_reads=True)
            try:
                tree = mgr.restore(2)
                results[p] = (tree, mgr.last_restore_stats)
            finally:
                mgr.close()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            results[p] = e

    threads = [threading.Thread(target=one, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    total = stored_bytes(step)
    for r in results:
        assert not isinstance(r, BaseException), r
        tree, stats = r
        assert_same_array(tree["w"], TREE["w"], "w")
        assert stats.shared is not None and stats.shared["fallbacks"] == [], stats
    assert sum(r[1].shared["storage_bytes"] for r in results) == total
