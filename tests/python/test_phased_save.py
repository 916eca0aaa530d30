"""The native writer's two phases from Python: each "rank" writes its part (write_part, bytes),
one commits every rank's bytes (commit_parts): two writers in one process stand for two ranks,
each in its own thread, agreeing through a coordinator of their own."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tensorstash
from tensorstash import _ext, _paths, _save
from tshelpers import assert_same_tree, pattern


class ThreadCoordinator:
    """Rank `index` of `count` ranks that are threads of this process (the protocol of
    tensorstash.jax.JaxCoordinator), sharing one key-value store."""

    def __init__(self, shared: dict, cond: threading.Condition, index: int, count: int):
        self.shared, self.cond, self.index, self.count = shared, cond, index, count

    def process_index(self) -> int:
        return self.index

    def process_count(self) -> int:
        return self.count

    def barrier(self, name: str, timeout_ms: int) -> None:
        key = f"barrier/{name}"
        with self.cond:
            self.shared[key] = self.shared.get(key, 0) + 1
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: self.shared[key] >= self.count, timeout_ms / 1000):
                raise TimeoutError(f"barrier {name}")

    def key_value_set(self, key: str, value: str) -> None:
        with self.cond:
            self.shared[key] = value
            self.cond.notify_all()

    def key_value_get(self, key: str, timeout_ms: int) -> str:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.shared, timeout_ms / 1000):
                raise TimeoutError(key)
            return self.shared[key]


TREE = {
    "params": {"w": pattern((33, 17), np.float32, seed=1), "b": pattern((17,), np.float16, seed=2)},
    "opt": [pattern((5, 3, 2), np.int64, seed=3), pattern((), np.int32, seed=4)],
    "note": "phased",
}


def write_parts_at(root: str, name: str, ranks: int = 2) -> tuple[list, list[bytes]]:
    """Every rank's writer of step `name` of `root` (each in its own thread) and its part's
    bytes."""
    shared: dict = {}
    cond = threading.Condition()
    writers: list = [None] * ranks
    parts: list = [None] * ranks
    errors: list = []

    def rank(i: int) -> None:
        try:
            coordinator = ThreadCoordinator(shared, cond, i, ranks)
            arrays, tree_json = _save.arrays_to_save(TREE, coordinator)
            writer = _ext.Writer(root, name, target_chunk_bytes=256,
                                 coordinator=coordinator, coordination_timeout_s=60)
            for path, dtype, shape, shards, _stable in arrays:
                writer.add_array(path, dtype, shape, shards)
            writer.set_tree(tree_json)
            writers[i] = writer
            parts[i] = writer.write_part()
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return writers, parts


def test_parts_carried_as_bytes_commit_a_step_that_restores_bit_exactly(step):
    root, name = _paths.split(step)
    writers, parts = write_parts_at(root, name)
    assert all(isinstance(p, bytes) and p for p in parts)
    with pytest.raises(Exception):
        tensorstash.restore(step)  # nothing is visible before the commit
    # Rank 1 commits, with the parts in another order than the ranks'.
    stats = writers[1].commit_parts(list(reversed(parts)))
    want_bytes = sum(a.nbytes for a in (TREE["params"]["w"], TREE["params"]["b"], *TREE["opt"]))
    assert stats["raw_bytes"] == want_bytes
    assert_same_tree(tensorstash.restore(step), TREE)


def test_a_missing_part_is_refused_and_nothing_becomes_visible(step):
    root, name = _paths.split(step)
    writers, parts = write_parts_at(root, name)
    with pytest.raises(ValueError, match="no part from process 1"):
        writers[0].commit_parts(parts[:1])
    with pytest.raises(Exception):
        tensorstash.restore(step)


def test_tampered_bytes_are_refused(step):
    root, name = _paths.split(step)
    writers, parts = write_parts_at(root, name)
    tampered = bytearray(parts[1])
    tampered[len(tampered) // 2] ^= 1
    with pytest.raises(Exception, match="part 1"):
        writers[0].commit_parts([parts[0], bytes(tampered)])
    # The writer refuses a second commit_parts; untouched bytes commit on the other rank.
    writers[1].commit_parts(parts)
    assert_same_tree(tensorstash.restore(step), TREE)
