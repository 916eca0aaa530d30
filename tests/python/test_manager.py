"""tensorstash.CheckpointManager: async saves, items of a step, retention, locking, leftovers,
statistics, restore progress, preemption, and a job of two processes."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import types

import jax
import numpy as np
import pytest

import tensorstash
from tensorstash import _ext
from tshelpers import (assert_jax_array, assert_same_array, global_array, mesh, named, pattern,
                       record_read_stats)


def numpy_state(step: int) -> dict:
    return {"params": {"w": pattern((32, 16), np.float32, seed=step),
                       "b": pattern((16,), np.float32, seed=step + 1000)},
            "opt": {"count": step, "mu": pattern((32, 16), np.float64, seed=step + 2000)}}


def abstract_numpy_state() -> dict:
    return {"params": {"w": np.zeros((32, 16), np.float32), "b": np.zeros((16,), np.float32)},
            "opt": {"count": 0, "mu": np.zeros((32, 16), np.float64)}}


def assert_numpy_state(got: dict, step: int) -> None:
    want = numpy_state(step)
    assert_same_array(got["params"]["w"], want["params"]["w"], "w")
    assert_same_array(got["params"]["b"], want["params"]["b"], "b")
    assert_same_array(got["opt"]["mu"], want["opt"]["mu"], "mu")
    assert got["opt"]["count"] == step


class DataIter:
    """A stand-in for a data iterator with a resumable position."""

    def __init__(self, pos: int = 0):
        self.pos = pos

    def next(self) -> None:
        self.pos += 3

    def state(self) -> dict:
        return {"pos": self.pos}


class GateCoordinator:
    """A one-process coordinator (the protocol of tensorstash.jax.JaxCoordinator) that holds a
    save's background commit when it reports its write status, i.e. after the shards were
    copied and written and before the commit, until `release` is set."""

    def __init__(self, hold: bool = True):
        self.kv: dict[str, str] = {}
        self.cond = threading.Condition()
        self.held = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def process_index(self) -> int:
        return 0

    def process_count(self) -> int:
        return 1

    def barrier(self, name: str, timeout_ms: int) -> None:
        pass

    def key_value_set(self, key: str, value: str) -> None:
        if "/status/" in key:
            self.held.set()
            if not self.release.wait(60):
                raise TimeoutError("the test never released the save")
        with self.cond:
            self.kv[key] = value
            self.cond.notify_all()

    def key_value_get(self, key: str, timeout_ms: int) -> str:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.kv, timeout_ms / 1000):
                raise TimeoutError(key)
            return self.kv[key]


def listing(root: str) -> list[str]:
    return sorted(os.listdir(root))


def root_listing(steps) -> list[str]:
    """What a manager's root holds with these complete steps."""
    return sorted(["LOCK"] + [_ext.Manager.step_dir(s) for s in steps])


# --- the issue's example ------------------------------------------------------------------------

def test_issue_example_numpy(tmp_path):
    root = str(tmp_path / "ckpt")
    cfg = {"lr": 0.001, "layers": [4, 8]}
    it = DataIter()
    mgr = tensorstash.CheckpointManager(root, max_to_keep=3, save_interval_steps=100)
    saved = []
    for step in range(0, 701):
        state = numpy_state(step)
        it.next()
        if mgr.save(step, state, metadata={"config": cfg}, per_process={"data_iter": it.state()}):  # returns fast
            saved.append(step)
    assert saved == [0, 100, 200, 300, 400, 500, 600, 700]
    mgr.wait_until_finished(); mgr.close()
    assert listing(root) == root_listing([500, 600, 700])

    # A restart.
    abstract_state = abstract_numpy_state()
    mgr = tensorstash.CheckpointManager(root, max_to_keep=3, save_interval_steps=100)
    step = mgr.latest_step()          # newest complete step, or None
    assert step == 700
    state = mgr.restore(step, target=abstract_state)
    assert_numpy_state(state, 700)
    assert mgr.metadata(step) == {"config": cfg}
    assert mgr.per_process(step) == {"data_iter": {"pos": 701 * 3}}
    assert mgr.per_process(500) == {"data_iter": {"pos": 501 * 3}}
    assert_numpy_state(mgr.restore(), 700)  # step None: the latest; without target: as saved
    mgr.wait_until_finished(); mgr.close()


def test_issue_example_sharded_jax(tmp_path):
    root = str(tmp_path / "ckpt")
    cfg = {"model": "mlp"}
    it = DataIter()
    save_mesh = mesh((2, 4))
    w = pattern((16, 24), np.float32, seed=5)
    emb = pattern((40, 8), np.int32, seed=6)

    def make_state(step):
        return {"w": global_array(w + step, named(save_mesh, "a", "b")),
                "emb": global_array(emb + step, named(save_mesh, ("a", "b"))),
                "step": step}

    with tensorstash.CheckpointManager(root, max_to_keep=3, save_interval_steps=100) as mgr:
        for step in (0, 50, 100, 200):
            state = make_state(step)
            it.next()
            mgr.save(step, state, metadata={"config": cfg}, per_process={"data_iter": it.state()})  # returns fast
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0, 100, 200]

    # Restored onto another mesh: 4 x 2 over the devices in reverse order.
    restore_mesh = mesh((4, 2), devices=jax.devices()[::-1])
    shardings = {"w": named(restore_mesh, "b", "a"), "emb": named(restore_mesh, None, "a")}
    abstract_state = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=shardings["w"]),
                      "emb": jax.ShapeDtypeStruct(emb.shape, emb.dtype, sharding=shardings["emb"]),
                      "step": 0}
    mgr = tensorstash.CheckpointManager(root, max_to_keep=3, save_interval_steps=100)
    step = mgr.latest_step()          # newest complete step, or None
    state = mgr.restore(step, target=abstract_state)
    mgr.wait_until_finished(); mgr.close()
    assert step == 200 and state["step"] == 200
    assert_jax_array(state["w"], w + 200, shardings["w"], "w")
    assert_jax_array(state["emb"], emb + 200, shardings["emb"], "emb")


# --- async saves --------------------------------------------------------------------------------

def test_async_save_returns_before_commit_and_buffers_may_change(tmp_path):
    root = str(tmp_path / "ckpt")
    gate = GateCoordinator()
    mgr = tensorstash.CheckpointManager(root, coordinator=gate, chunk_bytes=4096)
    state = numpy_state(1)
    want = {k: v.copy() for k, v in state["params"].items()}
    assert mgr.save(1, state, metadata={"m": 1}, per_process=b"p")
    # save() returned while the commit is still held: nothing of the step is visible yet.
    assert gate.held.wait(30)
    assert mgr.all_steps() == [] and mgr.latest_step() is None
    assert not os.path.exists(mgr.step_path(1))
    with pytest.raises(FileNotFoundError):
        mgr.metadata(1)
    with pytest.raises(FileNotFoundError):
        tensorstash.restore(mgr.step_path(1))
    # The caller's buffers are free as soon as save() returns.
    for a in state["params"].values():
        a[...] = -7
    gate.release.set()
    mgr.wait_until_finished()
    assert mgr.all_steps() == [1]
    got = mgr.restore(1)
    assert_same_array(got["params"]["w"], want["w"], "w")
    assert_same_array(got["params"]["b"], want["b"], "b")
    mgr.close()


def test_async_save_of_jax_arrays_survives_donation(tmp_path):
    """A training step that donates the saved jax.Arrays while the save is in flight changes
    nothing of the step, and the save holds nothing once it ends. (On CPU devices the save has
    copied the arrays before save() returned, as their memory may be a NumPy array's; on other
    devices it writes from its host copy, holding the arrays meanwhile, so that JAX copies
    rather than donates them.)"""
    root = str(tmp_path / "ckpt")
    gate = GateCoordinator()
    m = mesh((2, 4))
    w = pattern((64, 32), np.float32, seed=9)
    x = global_array(w, named(m, "a", "b"))
    mgr = tensorstash.CheckpointManager(root, coordinator=gate, chunk_bytes=1024)
    assert mgr.save(1, {"w": x})
    assert gate.held.wait(30)  # the save is in flight, nothing committed
    # A training step that donates the state: its buffers must not be overwritten in place.
    step = jax.jit(lambda a: a * 0 - 5, donate_argnums=0)
    y = jax.block_until_ready(step(x))
    gate.release.set()
    mgr.wait_until_finished()
    got = mgr.restore(1, target={"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=named(m, "a", "b"))})
    assert_jax_array(got["w"], w, named(m, "a", "b"), "w")
    assert np.all(np.asarray(y) == -5)
    # Once a save is over it holds nothing: what it saved can be donated. (Not x: on CPU the
    # step above donated it, and this JAX crashes when given a deleted array.)
    z = global_array(w, named(m, "a", "b"))
    assert mgr.save(2, {"w": z})
    mgr.wait_until_finished()
    jax.block_until_ready(step(z))
    assert z.is_deleted()
    mgr.close()


def test_second_save_waits_for_the_first(tmp_path):
    gate = GateCoordinator()
    mgr = tensorstash.CheckpointManager(str(tmp_path / "ckpt"), coordinator=gate)
    mgr.save(1, numpy_state(1))
    assert gate.held.wait(30)
    done = threading.Event()

    def second():
        mgr.save(2, numpy_state(2))
        done.set()

    t = threading.Thread(target=second)
    t.start()
    assert not done.wait(0.5)  # at most one save in flight
    gate.release.set()
    t.join(30)
    assert done.is_set()
    mgr.wait_until_finished()
    assert mgr.all_steps() == [1, 2]
    mgr.close()


def test_sync_save_is_committed_on_return(tmp_path):
    with tensorstash.CheckpointManager(str(tmp_path / "ckpt"), async_save=False) as mgr:
        assert mgr.save(3, numpy_state(3))
        assert mgr.all_steps() == [3]
        assert mgr.last_save_stats.step == 3 and not mgr.last_save_stats.async_save
        assert_numpy_state(mgr.restore(3), 3)


# --- items --------------------------------------------------------------------------------------

def test_metadata_per_process_and_metrics_round_trip(tmp_path):
    with tensorstash.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        meta = {"config": {"lr": 0.5, "name": "ünïcode", "layers": [1, 2, None]}, "ok": True}
        blob = bytes(range(256)) * 10
        mgr.save(1, numpy_state(1), metadata=meta, per_process={"it": [1, 2, 3]},
                 metrics={"loss": 0.25, "acc": np.float32(0.5)})
        mgr.save(2, numpy_state(2), per_process=blob)
        mgr.save(3, numpy_state(3), per_process=b"{\"looks\": \"like json\"}")
        mgr.save(4, numpy_state(4), per_process="a string")
        mgr.wait_until_finished()
        assert mgr.metadata(1) == meta
        assert mgr.per_process(1) == {"it": [1, 2, 3]}
        assert mgr.metrics(1) == {"loss": 0.25, "acc": 0.5}
        assert mgr.metadata(2) is None and mgr.metrics(2) is None
        got = mgr.per_process(2)
        assert isinstance(got, bytes) and got == blob
        assert mgr.per_process(3) == b"{\"looks\": \"like json\"}"  # bytes stay bytes
        assert mgr.per_process(4) == "a string"
        assert mgr.per_process(1, process_index=1) is None  # no such process
        assert mgr.per_process() == "a string"  # the latest step
        with pytest.raises(FileNotFoundError):
            mgr.metadata(9)


def test_items_are_checked_against_commit(tmp_path):
    with tensorstash.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        mgr.save(1, numpy_state(1), metadata={"a": 1}, per_process={"pos": 12345})
        mgr.wait_until_finished()
        path = os.path.join(mgr.step_path(1), _ext.process_state_file_name(0))
        with open(path, "r+b") as f:
            data = f.read()
            f.seek(0)
            f.write(data.replace(b"12345", b"12346"))
        with pytest.raises(OSError, match="CRC-32C"):
            mgr.per_process(1)
        assert mgr.metadata(1) == {"a": 1}


def test_bad_items_are_refused_before_saving(tmp_path):
    with tensorstash.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        with pytest.raises(TypeError, match="metadata"):
            mgr.save(1, numpy_state(1), metadata={"f": object()})
        with pytest.raises(TypeError, match="per_process"):
            mgr.save(1, numpy_state(1), per_process={1, 2})
        with pytest.raises(ValueError):
            mgr.save(1, numpy_state(1), per_process=b"x" * ((64 << 20) + 1))
        with pytest.raises(TypeError):
            mgr.save(1, {"x": object()})
        mgr.wait_until_finished()
        assert mgr.all_steps() == []
        assert mgr.save(1, numpy_state(1))  # the manager still works
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]


def test_all_items_are_committed_together(tmp_path):
    gate = GateCoordinator()
    mgr = tensorstash.CheckpointManager(str(tmp_path / "ckpt"), coordinator=gate)
    mgr.save(5, numpy_state(5), metadata={"m": 5}, per_process={"p": 5}, metrics={"loss": 5.0})
    assert gate.held.wait(30)
    # Written but not committed: not listed, not readable, not even under the step's name.
    assert mgr.all_steps() == []
    assert not os.path.exists(mgr.step_path(5))
    temps = [n for n in os.listdir(mgr.root) if n.startswith("0000000005.tmp-")]
    assert len(temps) == 1  # where the step is being written, items included
    assert os.path.exists(os.path.join(mgr.root, temps[0], _ext.METADATA_FILE))
    for read in (mgr.metadata, mgr.per_process, mgr.metrics):
        with pytest.raises(FileNotFoundError):
            read(5)
    gate.release.set()
    mgr.wait_until_finished()
    assert mgr.all_steps() == [5]
    # Listed: every item is readable, and COMMIT accounts for each.
    assert mgr.metadata(5) == {"m": 5}
    assert mgr.per_process(5) == {"p": 5}
    assert mgr.metrics(5) == {"loss": 5.0}
    assert_numpy_state(mgr.restore(5), 5)
    with open(os.path.join(mgr.step_path(5), "COMMIT")) as f:
        files = json.load(f)["files"]
    assert {_ext.METADATA_FILE, _ext.METRICS_FILE, _ext.process_state_file_name(0)} <= set(files)
    mgr.close()


# --- retention and scheduling -------------------------------------------------------------------

def save_steps(mgr, losses: dict[int, float] | None = None, steps=range(1, 6)) -> None:
    for step in steps:
        metrics = None if losses is None else {"loss": losses[step]}
        mgr.save(step, {"x": np.full((4,), step, np.int32)}, metrics=metrics)
    mgr.wait_until_finished()


@pytest.mark.parametrize("options, want", [
    (dict(max_to_keep=2), [4, 5]),
    (dict(max_to_keep=1, keep_period=2), [2, 4, 5]),
    (dict(), [1, 2, 3, 4, 5]),
])
def test_retention(tmp_path, options, want):
    root = str(tmp_path / "ckpt")
    with tensorstash.CheckpointManager(root, **options) as mgr:
        save_steps(mgr)
        assert mgr.all_steps() == want
    # Dropped steps are deleted (in the background, done by close()).
    assert listing(root) == root_listing(want)
    with tensorstash.CheckpointManager(root, **options) as mgr:
        assert mgr.all_steps() == want
        for step in want:
            assert_same_array(mgr.restore(step)["x"], np.full((4,), step, np.int32))


@pytest.mark.parametrize("mode, losses, want", [
    # min: the two lowest (steps 2, 4) and the newest (5).
    ("min", {1: 5.0, 2: 1.0, 3: 3.0, 4: 2.0, 5: 4.0}, [2, 4, 5]),
    # max: the two highest (steps 1, 3) and the newest (5).
    ("max", {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 0.0}, [1, 3, 5]),
])
def test_best_metric_retention(tmp_path, mode, losses, want):
    root = str(tmp_path / "ckpt")
    with tensorstash.CheckpointManager(root, max_to_keep=2, best_metric="loss",
                                       best_mode=mode) as mgr:
        save_steps(mgr, losses)
        assert mgr.all_steps() == want
        assert [mgr.metrics(s)["loss"] for s in want] == [losses[s] for s in want]
    assert listing(root) == root_listing(want)


def test_bad_options(tmp_path):
    root = str(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="best_mode"):
        tensorstash.CheckpointManager(root, max_to_keep=2, best_metric="loss", best_mode="low")
    with pytest.raises(ValueError, match="max_to_keep"):
        tensorstash.CheckpointManager(root, max_to_keep=0)
    with pytest.raises(ValueError, match="codec"):
        tensorstash.CheckpointManager(root, codec="lz4")
    with tensorstash.CheckpointManager(root):  # none of them kept the lock
        pass


def test_save_interval_should_save_and_force(tmp_path):
    with tensorstash.CheckpointManager(str(tmp_path / "ckpt"), save_interval_steps=10) as mgr:
        assert [s for s in range(0, 35) if mgr.should_save(s)] == [0, 10, 20, 30]
        assert mgr.save(5, numpy_state(5)) is False
        assert mgr.save(10, numpy_state(10)) is True
        assert mgr.save(15, numpy_state(15), force=True) is True
        mgr.wait_until_finished()
        assert mgr.all_steps() == [10, 15]
        with pytest.raises(FileExistsError):
            mgr.save(10, numpy_state(10))


# --- locking, leftovers, errors -----------------------------------------------------------------

def test_second_manager_is_refused_until_the_first_closes(tmp_path):
    root = str(tmp_path / "ckpt")
    first = tensorstash.CheckpointManager(root)
    with pytest.raises(ValueError, match="locked by another manager"):
        tensorstash.CheckpointManager(root)
    first.save(1, numpy_state(1))
    first.close()
    first.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        first.save(2, numpy_state(2))
    assert first.all_steps() == [1]  # queries still work
    with tensorstash.CheckpointManager(root) as second:
        assert second.all_steps() == [1]
    # The context manager closed it.
    tensorstash.CheckpointManager(root).close()


def test_leftovers_are_removed_at_open_and_never_listed(tmp_path):
    root = str(tmp_path / "ckpt")
    with tensorstash.CheckpointManager(root) as mgr:
        save_steps(mgr, steps=[3])
    temp = os.path.join(root, "0000000005.tmp-0123456789abcdef")
    os.makedirs(os.path.join(temp, "state", "data"))
    with open(os.path.join(temp, "state", "data", "0-0.dat"), "wb") as f:
        f.write(b"partial")
    incomplete = os.path.join(root, "0000000006")
    os.makedirs(os.path.join(incomplete, "state"))
    with open(os.path.join(incomplete, "state", "tree.json"), "w") as f:
        f.write("{}")
    with tensorstash.CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [3]
        assert listing(root) == root_listing([3])
        save_steps(mgr, steps=[5, 6])  # the leftovers' steps can be saved
        assert mgr.all_steps() == [3, 5, 6]


def test_background_error_surfaces_on_the_next_call(tmp_path):
    root = str(tmp_path / "ckpt")
    mgr = tensorstash.CheckpointManager(root)

    def block(step):  # a file where the step's folder must go: the commit's rename fails
        with open(os.path.join(root, _ext.Manager.step_dir(step)), "w") as f:
            f.write("in the way")

    block(7)
    assert mgr.save(7, numpy_state(7))  # the failure comes later, in the background
    with pytest.raises(FileExistsError, match="0000000007"):
        mgr.save(8, numpy_state(8))
    mgr.wait_until_finished()  # reported once
    assert mgr.all_steps() == []  # and step 8 was not saved either
    assert sorted(n for n in os.listdir(root) if ".tmp-" in n) == []  # nothing left behind

    block(9)
    mgr.save(9, numpy_state(9))
    with pytest.raises(FileExistsError, match="0000000009"):
        mgr.wait_until_finished()
    mgr.save(10, numpy_state(10))
    mgr.wait_until_finished()
    assert mgr.all_steps() == [10]

    block(11)
    mgr.save(11, numpy_state(11))
    with pytest.raises(FileExistsError, match="0000000011"):
        mgr.close()
    mgr.close()  # closed all the same
    tensorstash.CheckpointManager(root).close()


# --- statistics and logging ---------------------------------------------------------------------

def test_save_and_restore_stats(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tensorstash")
    saves, restores = [], []
    gate = GateCoordinator()
    mgr = tensorstash.CheckpointManager(str(tmp_path / "ckpt"), coordinator=gate,
                                        on_save=saves.append, on_restore=restores.append)
    state = numpy_state(2)
    nbytes = sum(a.nbytes for a in (state["params"]["w"], state["params"]["b"], state["opt"]["mu"]))
    mgr.save(2, state)
    assert gate.held.wait(30)
    time.sleep(0.3)  # the commit is held: the total time includes this, the blocking time not
    assert saves == []
    gate.release.set()
    mgr.wait_until_finished()
    assert len(saves) == 1 and saves[0] is mgr.last_save_stats
    s = saves[0]
    assert s.step == 2 and s.async_save
    assert s.raw_bytes == nbytes and 0 < s.stored_bytes
    assert 0 < s.blocking_s < 0.3 <= s.total_s
    assert s.gbps == pytest.approx(nbytes / s.total_s / 1e9)
    records = [r.getMessage() for r in caplog.records if r.name == "tensorstash"]
    assert any(m.startswith("saved step 2: 6.1 KiB in ") and "GB/s), blocked " in m
               and m.endswith(" ms") for m in records), records

    mgr.restore(2)
    assert len(restores) == 1 and restores[0] is mgr.last_restore_stats
    r = restores[0]
    assert r.step == 2 and r.bytes == s.stored_bytes and r.seconds > 0
    assert any(m.startswith("restored step 2: 6.1 KiB in ") for m in
               (r.getMessage() for r in caplog.records)), records
    mgr.close()


def test_sync_save_stats_and_failing_callback(tmp_path, caplog):
    def on_save(stats):
        raise RuntimeError("callback broke")

    with tensorstash.CheckpointManager(str(tmp_path / "ckpt"), async_save=False,
                                       on_save=on_save) as mgr:
        assert mgr.save(1, numpy_state(1))  # the callback's error does not fail the save
        s = mgr.last_save_stats
        assert not s.async_save and s.blocking_s == pytest.approx(s.total_s, rel=0.5)
        assert mgr.all_steps() == [1]
    assert any("on_save callback" in r.getMessage() and r.exc_info for r in caplog.records)


# --- restore progress ---------------------------------------------------------------------------

def save_big(tmp_path) -> tuple[str, dict]:
    """A step of several arrays, each of many small chunks."""
    step = str(tmp_path / "root" / "0000000001")
    tree = {f"a{i}": pattern((256, 256), np.float32, seed=i) for i in range(6)}
    tensorstash.save(step, tree, chunk_bytes=4096)
    return step, tree


def test_read_many_progress_is_throttled_and_ends_at_total(tmp_path):
    step, tree = save_big(tmp_path)
    reader = _ext.Reader(os.path.dirname(step), "0000000001", max_inflight_bytes=1 << 16,
                         io_threads=2)

    def requests():
        outs = {k: np.empty_like(v) for k, v in tree.items()}
        return outs, [(k, (0, 0), v.shape, "float32", v.reshape(-1).view(np.uint8))
                      for k, v in outs.items()]

    calls = []
    thread_ids = set()

    def progress(done, total):
        calls.append((time.monotonic(), done, total))
        thread_ids.add(threading.get_ident())
        time.sleep(0.03)  # slows the read down so that it spans several intervals

    outs, reqs = requests()
    started = time.monotonic()
    stats = reader.read_many(reqs, progress=progress)
    elapsed = time.monotonic() - started
    for k in tree:
        assert_same_array(outs[k], tree[k], k)
    assert calls, "progress was never called"
    total = calls[0][2]
    assert total == stats["bytes_read"] > 0
    dones = [d for _, d, _ in calls]
    assert dones == sorted(dones) and all(0 < d <= total for d in dones)
    assert dones[-1] == total and dones.count(total) == 1  # one final call
    assert all(t == total for _, _, t in calls)
    # Throttled: about ten calls a second (plus the final one), far fewer than chunks read.
    assert len(calls) <= elapsed / 0.1 + 2
    assert len(calls) < stats["requests"]
    assert threading.get_ident() not in thread_ids  # called from the reading threads

    # An exception from the callable is raised once the read is over; the data is complete.
    def broken(done, total):
        raise KeyError("stop")

    outs, reqs = requests()
    with pytest.raises(KeyError, match="stop"):
        reader.read_many(reqs, progress=broken)
    # An empty read still reports its end.
    calls.clear()
    reader.read_many([], progress=progress)
    assert [(d, t) for _, d, t in calls] == [(0, 0)]
    with pytest.raises(TypeError):
        reader.read_many([], progress=3)


def test_restore_progress_callable_spans_batches(tmp_path, monkeypatch):
    step, tree = save_big(tmp_path)
    monkeypatch.setattr(tensorstash._options, "HOST_BATCH_BYTES", 256 * 256 * 4 * 2)  # 3 batches
    reads = record_read_stats(tensorstash, monkeypatch.setattr)
    calls = []
    # Read, not mapped: the reads go in three batches.
    got = tensorstash.restore(step, target={k: np.zeros_like(v) for k, v in tree.items()},
                              progress=lambda done, total: calls.append((done, total)),
                              mmap=False)
    for k in tree:
        assert_same_array(got[k], tree[k], k)
    total = sum(v.nbytes for v in tree.values())
    assert {t for _, t in calls} == {total}
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and dones[-1] == total
    assert [r["read_calls"] for r in reads] == [3]  # one count over the batches, not three
    # Mapped: the same total, reached.
    calls.clear()
    tensorstash.restore(step, target={k: np.zeros_like(v) for k, v in tree.items()},
                        progress=lambda done, total: calls.append((done, total)))
    assert reads[-1]["mapped_bytes"] == total and reads[-1]["read_calls"] == 0
    assert calls[-1] == (total, total) and {t for _, t in calls} == {total}


class FakeTqdm:
    instances: list = []

    def __init__(self, total, desc, unit, unit_scale, unit_divisor, file):
        self.total, self.desc, self.file, self.n, self.closed = total, desc, file, 0, False
        FakeTqdm.instances.append(self)

    def update(self, n):
        self.n += n

    def close(self):
        self.closed = True


@pytest.fixture
def fake_tqdm(monkeypatch):
    FakeTqdm.instances = []
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=FakeTqdm))
    return FakeTqdm.instances


def test_restore_progress_bar(tmp_path, monkeypatch, fake_tqdm):
    step, tree = save_big(tmp_path)
    total = sum(v.nbytes for v in tree.values())
    # Automatic: small restores and restores without a terminal show no bar.
    tensorstash.restore(step)
    monkeypatch.setattr(tensorstash._progress, "PROGRESS_MIN_BYTES", total)
    monkeypatch.setattr(sys, "stderr", types.SimpleNamespace(isatty=lambda: False))
    tensorstash.restore(step)
    assert fake_tqdm == []
    # ... a large restore on a terminal does.
    monkeypatch.setattr(sys, "stderr", types.SimpleNamespace(isatty=lambda: True))
    got = tensorstash.restore(step)
    for k in tree:
        assert_same_array(got[k], tree[k], k)
    assert len(fake_tqdm) == 1
    bar = fake_tqdm[0]
    assert bar.total == total and bar.n == total and bar.closed and bar.file is sys.stderr
    assert "0000000001" in bar.desc
    # Forced either way.
    tensorstash.restore(step, progress=False)
    assert len(fake_tqdm) == 1
    monkeypatch.setattr(tensorstash._progress, "PROGRESS_MIN_BYTES", 1 << 40)
    with tensorstash.CheckpointManager(os.path.dirname(step)) as mgr:
        mgr.restore(1, progress=True)
    assert len(fake_tqdm) == 2 and fake_tqdm[1].n == total and fake_tqdm[1].closed
    with pytest.raises(TypeError, match="progress"):
        tensorstash.restore(step, progress="yes")


def test_restore_progress_without_tqdm(tmp_path, monkeypatch, capsys):
    step, tree = save_big(tmp_path)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm fails
    tensorstash.restore(step, progress=True)
    err = capsys.readouterr().err
    assert "restoring 0000000001: 100% of 1.5 MiB" in err and err.endswith("\n")


def test_manager_restore_errors(tmp_path):
    root = str(tmp_path / "ckpt")
    with tensorstash.CheckpointManager(root) as mgr:
        with pytest.raises(FileNotFoundError, match=root):
            mgr.restore()
        with pytest.raises(FileNotFoundError):
            mgr.restore(3)
        save_steps(mgr, steps=[1])
        with pytest.raises(TypeError, match="bogus"):
            mgr.restore(1, bogus=True)
        with pytest.raises(KeyError):
            mgr.restore(1, target={"y": np.zeros(4, np.int32)})
        assert_same_array(mgr.restore(1, target={"x": np.zeros(4, np.int64)})["x"],
                          np.full(4, 1, np.int64))


# --- preemption ---------------------------------------------------------------------------------

@pytest.fixture
def python_sigterm_handler():
    """A Python SIGTERM handler (so that a stray SIGTERM cannot kill the test run), and the
    signals it received."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGTERM, previous)


def test_no_preemption_without_the_handler(tmp_path, python_sigterm_handler):
    # (Before any test that makes a manager see a SIGTERM: see the next but one test.)
    received = python_sigterm_handler
    with tensorstash.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert received == [signal.SIGTERM]
        assert not mgr.reached_preemption(1)


def test_sigterm_sets_reached_preemption(tmp_path, python_sigterm_handler):
    received = python_sigterm_handler
    mgr = tensorstash.CheckpointManager(str(tmp_path / "ckpt"), handle_sigterm=True)
    assert not mgr.reached_preemption(1)
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not mgr.reached_preemption(2) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mgr.reached_preemption(2)
    # The loop's final save still works, and the process lives on.
    assert mgr.save(2, numpy_state(2), force=True)
    mgr.close()
    assert mgr.all_steps() == [2]
    time.sleep(0.1)
    assert received == []  # the manager's handler took it, not the previous one
    # Close put the previous handler back.
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not received and time.monotonic() < deadline:
        time.sleep(0.01)
    assert received == [signal.SIGTERM]


def test_preemption_does_not_outlive_its_manager(tmp_path, python_sigterm_handler):
    with tensorstash.CheckpointManager(str(tmp_path / "a"), handle_sigterm=True) as mgr:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not mgr.reached_preemption(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mgr.reached_preemption(1)
    with tensorstash.CheckpointManager(str(tmp_path / "b")) as mgr:
        assert not mgr.reached_preemption(1)
    with tensorstash.CheckpointManager(str(tmp_path / "c"), handle_sigterm=True) as mgr:
        assert not mgr.reached_preemption(1)


# --- several processes --------------------------------------------------------------------------

def test_two_processes_incremental(tmp_path, monkeypatch):
    # Both processes save against the same base (the newest listed step): each writes only its
    # own changed chunks; the frozen array's chunks refer to step 1, which retention retires.
    import test_multiprocess as mp
    monkeypatch.setattr(mp, "WORKER", os.path.join(mp.HERE, "mp_manager_worker.py"))
    root = str(tmp_path / "ckpt")
    mp.run_job("save", root, 2, "incremental", str(tmp_path))
    assert sorted(os.listdir(root)) == ["0000000001", "0000000003", "0000000004", "LOCK"]
    assert os.path.exists(os.path.join(root, "0000000001", "RETIRED"))
    for step in ("0000000003", "0000000004"):
        with open(os.path.join(root, step, "COMMIT")) as f:
            assert json.load(f)["depends_on"] == ["0000000001"], step
    mp.run_job("restore", root, 2, "incremental", str(tmp_path))


def test_two_processes(tmp_path, monkeypatch):
    import test_multiprocess as mp
    monkeypatch.setattr(mp, "WORKER", os.path.join(mp.HERE, "mp_manager_worker.py"))
    root = str(tmp_path / "ckpt")
    mp.run_job("save", root, 2, "", str(tmp_path))
    assert listing(root) == root_listing([3, 4])
    with open(os.path.join(root, "0000000004", "COMMIT")) as f:
        commit = json.load(f)
    assert commit["process_count"] == 2
    assert {_ext.process_state_file_name(0), _ext.process_state_file_name(1)} <= set(commit["files"])
    mp.run_job("restore", root, 2, "", str(tmp_path))
