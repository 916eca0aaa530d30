"""The node-local tier of CheckpointManager (docs/multitier.md): the rule that decides which
steps can be restored (on fabricated holdings), and jobs of 4 JAX processes on simulated nodes
(examples/multitier/cluster.py: each process in its own mount namespace, its node's RAM tier
bind-mounted at the same path, so a peer's copy is reachable only through the peer's server),
checked against an uninterrupted run of the same job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import tensorstash
from tensorstash import _adapters, _ext
from tensorstash import numpy as tnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "multitier"))
from cluster import Cluster  # noqa: E402

# --- the rule, on fabricated holdings ---------------------------------------------------------


def holding(holder: int, saved_by: int, step: int, chunks: dict[str, list[int]],
            count: int = 4, digest: str = "d", save_id: str = "s1") -> dict:
    """One holding as processes publish it (tiers/holdings.h, HoldingsToJson)."""
    return dict(holder=holder, folder=f"p{saved_by}-of-{count}", step=step, digest=digest,
                num_chunks={"w": 4, "b": 1}, chunks=chunks, save_id=save_id,
                values=_ext.value_ring(saved_by, count))


# Two slices of two processes: each process holds half of "w" (chunks) and all of "b".
def job_holdings(step: int, alive: list[int]) -> list[dict]:
    half = {0: [0, 1], 1: [2, 3], 2: [0, 1], 3: [2, 3]}
    return [holding(p, p, step, {"w": half[p], "b": [0]}) for p in alive]


def restorable_saves(holdings: list[dict]) -> dict[int, str]:
    return _ext.restorable_saves(json.dumps(holdings))


def restorable_steps(holdings: list[dict], persistent: list[int]) -> list[int]:
    return sorted(set(restorable_saves(holdings)) | set(persistent))


def test_every_holder_alive_restores():
    assert restorable_steps(job_holdings(8, [0, 1, 2, 3]), []) == [8]


def test_one_whole_slice_restores():
    assert restorable_steps(job_holdings(8, [2, 3]), []) == [8]


def test_no_whole_slice_but_every_chunk_held_restores():
    assert restorable_steps(job_holdings(8, [0, 3]), []) == [8]


def test_a_chunk_held_by_nobody_does_not_restore():
    assert restorable_steps(job_holdings(8, [0, 2]), []) == []
    assert restorable_steps(job_holdings(8, [0, 2]), [5]) == [5]


def test_per_process_values_must_all_be_held():
    # 8 processes: each holding carries its own value and the next three; processes 1 and 5
    # hold every chunk between them but not the values of 0 and 4... of 0: only 5..(5+3)%8=0.
    hold = [holding(p, p, 3, {"w": [0, 1, 2, 3], "b": [0]}, count=8) for p in (1, 5)]
    assert _ext.value_ring(5, 8) == [5, 6, 7, 0]
    assert restorable_steps(hold, []) == [3]
    hold = [holding(p, p, 3, {"w": [0, 1, 2, 3], "b": [0]}, count=8) for p in (1, 2)]
    assert restorable_steps(hold, []) == []  # nobody carries 0, 6, 7


def test_holdings_of_different_saves_do_not_mix():
    hold = [holding(0, 0, 4, {"w": [0, 1], "b": [0]}, digest="x"),
            holding(1, 1, 4, {"w": [2, 3], "b": [0]}, digest="y")]
    assert restorable_steps(hold, []) == []


def test_two_saves_of_one_step_never_mix_and_the_later_wins():
    first = [holding(0, 0, 9, {"w": [0, 1], "b": [0]}, save_id="001"),
             holding(1, 1, 9, {"w": [2, 3], "b": [0]}, save_id="002")]
    assert restorable_saves(first) == {}  # halves of two different saves
    whole = [holding(p, p, 9, {"w": [0, 1, 2, 3], "b": [0]}, save_id=sid)
             for p, sid in ((0, "001"), (1, "001"), (2, "001"), (3, "001"),
                            (0, "002"), (1, "002"), (2, "002"), (3, "002"))]
    assert restorable_saves(whole)[9] == "002"


def test_a_value_a_holding_does_not_carry_is_not_counted():
    hold = job_holdings(8, [0, 1, 2, 3])
    hold = [dict(h, values=[int(h["folder"][1])]) for h in hold[:3]] + hold[3:]
    assert restorable_steps(hold, []) == [8]  # process 3 carries 3, 0, 1, 2
    hold = [dict(h, values=[int(h["folder"][1])]) for h in job_holdings(8, [0, 1, 2])]
    assert restorable_steps(hold, []) == []


def test_the_newest_restorable_step_across_tiers():
    hold = job_holdings(12, [0, 1]) + job_holdings(14, [0, 2])
    assert restorable_steps(hold, [10]) == [10, 12]


def test_holdings_that_are_not_valid_are_refused():
    with pytest.raises(ValueError, match="holdings"):
        _ext.restorable_saves('[{"holder": 1}]')


# --- one process ------------------------------------------------------------------------------


def test_single_process_local_tier(tmp_path):
    state = {"w": np.arange(1000, dtype=np.float32)}
    with tensorstash.CheckpointManager(tmp_path / "persistent", local_dir=tmp_path / "local",
                                       local_save_interval_steps=2, save_interval_steps=10,
                                       async_save=True) as mgr:
        for step in range(1, 15):
            state = {"w": state["w"] + 1}
            mgr.save(step, state, per_process={"pos": step}, metadata={"m": step})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [10]
        assert mgr.local_steps() == [14]
        assert mgr.latest_step() == 14
        tree = mgr.restore(14)
        np.testing.assert_array_equal(tree["w"], np.arange(1000, dtype=np.float32) + 14)
        stats = mgr.last_restore_stats
        assert stats.bytes_from == {"local": 4000, "peer": 0, "persistent": 0}
        assert mgr.per_process(14) == {"pos": 14}
        assert mgr.metadata(14) == {"m": 14}
        tree = mgr.restore(10)
        assert mgr.last_restore_stats.bytes_from["persistent"] == 4000


def test_holdings_name_their_run_by_the_root_as_the_user_gave_it(tmp_path):
    # The run a holding carries is "<root> <run id>", the name earlier releases wrote: were it
    # named otherwise, an upgrade between two restarts would delete the node's newest holdings
    # as another run's.
    root = tmp_path / "persistent"
    with tensorstash.CheckpointManager(root, local_dir=tmp_path / "local",
                                       save_interval_steps=100) as mgr:
        mgr.save(1, {"w": np.ones(8, np.float32)})
        mgr.wait_until_finished()
        run = f"{os.path.abspath(root)} {mgr._ext.run_id()}".encode()
    values = [p for p in (tmp_path / "local").rglob("process/0")]
    assert values, "the local save wrote no holding"
    for path in values:
        data = path.read_bytes()
        assert len(run).to_bytes(4, "little") + run in data, (path, data[:200])


class DeviceOnly:
    """A stand-in for an array in device memory that cannot be copied back to the host."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)


class DeviceOnlyAdapter:
    """Restores into DeviceOnly arrays in two boxes (two devices), dropping the host buffers as
    a device_put would; asking it for host copies of what it built fails. A write-back must
    therefore save the host buffers the engine restored into, not ask the restored tree."""

    def __init__(self):
        self.built: list[dict] = []

    def owns(self, x):
        return isinstance(x, DeviceOnly)

    def check_savable(self, x, path):
        raise TypeError(f"{path}: a device-only array has no host copy")

    def dtype_name(self, x):
        return tnp.dtype_name(x.dtype)

    def save_shards(self, x, process_index, process_count):
        raise AssertionError("a restored device array was copied back to the host")

    def restore_boxes(self, target, shape):
        half = shape[0] // 2
        return {0: ((0,), (half,)), 1: ((half,), (shape[0] - half,))}

    def build(self, target, shape, buffers):
        self.built.append({key: np.array(data) for key, data in buffers.items()})
        return DeviceOnly(shape, target.dtype)

    def orbax_sharding(self, x):
        return None


def test_a_write_back_saves_the_restored_host_buffers_not_a_device_copy(tmp_path):
    w = np.arange(1000, dtype=np.float32)
    options = dict(local_dir=tmp_path / "local", save_interval_steps=10,
                   local_save_interval_steps=10)
    with tensorstash.CheckpointManager(tmp_path / "persistent", **options) as mgr:
        mgr.save(10, {"w": w}, per_process={"pos": 10})
        mgr.wait_until_finished()
    shutil.rmtree(tmp_path / "local")  # the node lost its RAM
    adapter = DeviceOnlyAdapter()
    _adapters.register_adapter(adapter)
    try:
        with tensorstash.CheckpointManager(tmp_path / "persistent", **options) as mgr:
            assert mgr.local_steps() == []
            tree = mgr.restore(10, target={"w": DeviceOnly((1000,), np.float32)})
            assert isinstance(tree["w"], DeviceOnly)
            assert mgr.last_restore_stats.bytes_from == {"local": 0, "peer": 0,
                                                         "persistent": 4000}
            np.testing.assert_array_equal(np.concatenate([adapter.built[0][0],
                                                          adapter.built[0][1]]), w)
            assert mgr.per_process(10) == {"pos": 10}
            # Healed from the buffers the engine read into, although the tree holds no copy.
            assert mgr.local_steps() == [10]
        with tensorstash.CheckpointManager(tmp_path / "persistent", **options) as mgr:
            np.testing.assert_array_equal(mgr.restore(10)["w"], w)
            assert mgr.last_restore_stats.bytes_from == {"local": 4000, "peer": 0,
                                                         "persistent": 0}
            assert mgr.per_process(10) == {"pos": 10}
    finally:
        _adapters._reset()


def test_a_restore_into_another_dtype_is_not_written_back(tmp_path, caplog):
    w = np.arange(100, dtype=np.float32)
    options = dict(local_dir=tmp_path / "local", save_interval_steps=10,
                   local_save_interval_steps=10)
    with tensorstash.CheckpointManager(tmp_path / "persistent", **options) as mgr:
        mgr.save(10, {"w": w})
        mgr.wait_until_finished()
    shutil.rmtree(tmp_path / "local")
    with tensorstash.CheckpointManager(tmp_path / "persistent", **options) as mgr:
        caplog.set_level("INFO", logger="tensorstash")
        tree = mgr.restore(10, target={"w": np.zeros(100, np.float64)})
        np.testing.assert_array_equal(tree["w"], w.astype(np.float64))
        assert mgr.local_steps() == []  # float64 bytes are not the step's float32 ones
        assert "this node's copy is not rewritten" in caplog.text


class RefusedReader:
    def __init__(self, *args, **kwargs):
        raise AssertionError("the manager reopened its root by path")


@pytest.mark.parametrize("local", [False, True], ids=["persistent-only", "multi-tier"])
def test_a_manager_restores_through_the_store_it_opened(tmp_path, monkeypatch, local):
    root = f"memory://restores-through-its-store-{local}/run"
    options = dict(local_dir=tmp_path / "local") if local else {}
    w = np.arange(64, dtype=np.int32)
    with tensorstash.CheckpointManager(root, **options) as mgr:
        mgr.save(3, {"w": w}, per_process={"pos": 3}, metadata={"m": 3}, metrics={"loss": 1.5})
        mgr.wait_until_finished()
    if local:
        shutil.rmtree(tmp_path / "local")  # so that the restore reads the persistent tier
    with tensorstash.CheckpointManager(root, **options) as mgr:
        monkeypatch.setattr(_ext, "Reader", RefusedReader)  # no opening of the root by its URL
        assert mgr.latest_step() == 3
        np.testing.assert_array_equal(mgr.restore()["w"], w)
        assert mgr.last_restore_stats.bytes_from["persistent"] == w.nbytes
        assert mgr.metadata(3) == {"m": 3}
        assert mgr.metrics(3) == {"loss": 1.5}
        assert mgr.per_process(3) == {"pos": 3}
        with pytest.raises(FileNotFoundError):
            mgr.metadata(4)
        if local:
            assert mgr.local_steps() == [3]  # written back


def test_fifty_local_saves_keep_at_most_two_steps(tmp_path):
    local = tmp_path / "local"
    with tensorstash.CheckpointManager(tmp_path / "persistent", local_dir=local,
                                       local_max_to_keep=1, save_interval_steps=1000) as mgr:
        for step in range(1, 51):
            mgr.save(step, {"w": np.full(20000, step, np.float32)}, per_process=step)
            held = os.listdir(local / "p0-of-1")
            assert len([n for n in held if n != "LOCK"]) <= 2, held
        mgr.wait_until_finished()
        assert mgr.local_steps() == [50]


def test_a_save_killed_midway_leaves_no_leftovers_after_a_restart(tmp_path):
    script = f"""
import os, signal, numpy as np, tensorstash
mgr = tensorstash.CheckpointManager({str(tmp_path / 'p')!r}, local_dir={str(tmp_path / 'l')!r},
                                    save_interval_steps=1000)
mgr.save(1, {{"w": np.ones(1 << 20, np.float32)}}, per_process=1)
mgr.wait_until_finished()
mgr.save(2, {{"w": np.ones(1 << 24, np.float32)}}, per_process=2)  # in flight when killed
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr.decode()
    with tensorstash.CheckpointManager(tmp_path / "p", local_dir=tmp_path / "l",
                                       save_interval_steps=1000) as mgr:
        assert mgr.latest_step() in (1, 2)
        step = mgr.latest_step()
        assert mgr.restore(step)["w"].size == (1 << 20 if step == 1 else 1 << 24)
        assert mgr.per_process(step) == step
        held = sorted(os.listdir(tmp_path / "l" / "p0-of-1"))
        assert held == sorted(["LOCK", f"{step:010d}"]), held


def test_a_local_save_that_does_not_fit_is_skipped(tmp_path, caplog):
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        with tensorstash.CheckpointManager(tmp_path / "p", local_dir=mount,
                                           save_interval_steps=1000) as mgr:
            assert mgr.save(1, {"w": np.ones(1 << 20, np.float32)})  # 4 MiB
            mgr.wait_until_finished()
            assert mgr.local_steps() == []
        assert "local save of step 1 skipped" in caplog.text
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)  # the store may hold it


def test_the_peer_server_refuses_requests_without_the_secret(tmp_path):
    (tmp_path / "p0-of-1" / "0000000001").mkdir(parents=True)
    (tmp_path / "p0-of-1" / "0000000001" / "COMMIT").write_text("x")
    (tmp_path / "p0-of-1" / "0000000002").mkdir()
    (tmp_path / "p0-of-1" / "0000000002" / "data").write_text("uncommitted")
    (tmp_path / "secret.txt").write_text("private")
    secret = "s" * 32
    server = _ext.PeerServer(str(tmp_path), secret=secret)

    def get(path, with_secret=True):
        request = urllib.request.Request(server.url + path)
        if with_secret:
            request.add_header("X-Tensorstash-Secret", secret)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as e:
            return e.code, b""

    try:
        assert get("/v1/object/p0-of-1/0000000001/COMMIT") == (200, b"x")
        assert get("/v1/object/p0-of-1/0000000001/COMMIT", with_secret=False)[0] == 403
        assert get("/v1/object/p0-of-1/0000000002/data")[0] == 404  # not committed
        assert get("/v1/object/secret.txt")[0] == 404  # not in a step
        assert get("/v1/object/p0-of-1/..%2F..%2Fsecret.txt")[0] == 400
        with pytest.raises(ValueError, match="16 characters"):
            _ext.PeerServer(str(tmp_path), secret="short")
    finally:
        server.close()


# --- 4 processes on 4 simulated nodes -----------------------------------------------------------

STEPS = ["--local-interval", "2", "--persistent-interval", "10"]


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    """The losses of an uninterrupted run to step 20."""
    cluster = Cluster(str(tmp_path_factory.mktemp("reference")))
    results = cluster.start([0, 1, 2, 3], ["--last-step", "20", *STEPS]).wait()
    return results[0]["losses"]


def first_run(tmp_path, last_step: int = 14) -> Cluster:
    """A job trained to `last_step` (a local save there, the last persistent one at 10) whose
    processes are then all killed, their nodes' RAM tiers left as they were."""
    cluster = Cluster(str(tmp_path))
    job = cluster.start([0, 1, 2, 3], ["--last-step", str(last_step), "--hold-at-end", *STEPS])
    job.wait_ready()
    job.kill()
    return cluster


def hide_persistent_steps(cluster: Cluster) -> None:
    """Moves every step folder of the persistent root away, so that the restart can read none
    of them. The root itself, and its RUN_ID, stay: an empty root in their place would be
    another run, whose restart never restores this run's RAM tier (docs/multitier.md)."""
    away = cluster.persistent + ".away"
    os.makedirs(away, exist_ok=True)
    for name in os.listdir(cluster.persistent):
        if name.isdigit():
            os.rename(os.path.join(cluster.persistent, name), os.path.join(away, name))
    assert os.path.exists(os.path.join(cluster.persistent, "RUN_ID"))


def check_resumed(results: dict, reference: dict, step: int) -> None:
    for pid, r in results.items():
        assert r["resumed_from"] == step, (pid, r)
        for s, loss in r["losses"].items():
            assert loss == reference[s], (pid, s, loss, reference[s])


def test_a_lost_slice_resumes_from_peers_without_persistent_storage(tmp_path, reference_losses):
    cluster = first_run(tmp_path)
    cluster.lose_node(2)
    cluster.lose_node(3)
    hide_persistent_steps(cluster)  # unreadable during the restore
    results = cluster.start([0, 1, 2, 3], ["--last-step", "20", *STEPS]).wait()
    check_resumed(results, reference_losses, 14)
    for pid, r in results.items():
        assert r["restore"]["bytes_from"]["persistent"] == 0
        assert r["restore"]["bytes_from"]["peer" if pid >= 2 else "local"] > 0


def test_no_whole_slice_but_every_chunk_held_resumes(tmp_path, reference_losses):
    cluster = first_run(tmp_path)
    cluster.lose_node(1)  # slice 0 loses its second half, slice 1 its first
    cluster.lose_node(2)
    results = cluster.start([0, 1, 2, 3], ["--last-step", "16", *STEPS]).wait()
    check_resumed(results, reference_losses, 14)
    for pid, r in results.items():
        assert r["restore"]["bytes_from"]["persistent"] == 0, (pid, r)


def test_processes_in_reverse_order_restore_from_local_and_peers(tmp_path, reference_losses):
    cluster = first_run(tmp_path)
    results = cluster.start([3, 2, 1, 0], ["--last-step", "18", *STEPS]).wait()
    check_resumed(results, reference_losses, 14)
    for r in results.values():
        assert r["restore"]["bytes_from"]["persistent"] == 0
        assert r["restore"]["bytes_from"]["peer"] > 0


def test_a_flipped_local_byte_is_fetched_from_a_peer_and_healed(tmp_path, reference_losses):
    cluster = first_run(tmp_path)
    results = cluster.start([0, 1, 2, 3], ["--last-step", "14", *STEPS],
                            extra={0: ["--flip-local-byte"]}).wait()
    check_resumed(results, reference_losses, 14)
    assert results[0]["flipped"]
    assert results[0]["restore"]["failures"], results[0]
    assert results[0]["restore"]["bytes_from"]["peer"] > 0
    # Healed: the next restore finds all of process 0's shards intact on its own node.
    hide_persistent_steps(cluster)
    results = cluster.start([0, 1, 2, 3], ["--last-step", "16", *STEPS]).wait()
    check_resumed(results, reference_losses, 14)
    assert results[0]["restore"]["failures"] == []
    assert results[0]["restore"]["bytes_from"]["peer"] == 0
    assert results[0]["restore"]["bytes_from"]["local"] > 0


@pytest.mark.parametrize("point", ["before", "during", "after"])
def test_a_kill_during_a_local_save_restores_one_step_with_its_own_iterators(
        tmp_path, reference_losses, point):
    cluster = first_run(tmp_path)
    args = ["--last-step", "16", *STEPS]
    if point in ("before", "during"):
        job = cluster.start([0, 1, 2, 3], [*args, f"--kill-{point}-local-save"])
        job.wait(expect_ok=False)
    else:
        job = cluster.start([0, 1, 2, 3], [*args, "--hold-at-end"])
        job.wait_ready()
        job.kill()
    results = cluster.start([0, 1, 2, 3], ["--last-step", "18", *STEPS]).wait()
    resumed = {r["resumed_from"] for r in results.values()}
    assert len(resumed) == 1 and resumed <= {14, 16}, results
    check_resumed(results, reference_losses, resumed.pop())  # the worker checks the iterators


def test_a_process_that_does_not_arrive_is_named_within_the_deadline(tmp_path):
    cluster = Cluster(str(tmp_path))
    started = time.monotonic()
    job = cluster.start([0, 1, 2, 3], ["--last-step", "2", "--timeout", "10", *STEPS],
                        extra={3: ["--stall"]})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(job.procs[p].poll() is None for p in (0, 1, 2)):
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    job.kill()
    results = job.wait(expect_ok=False)
    for pid in (0, 1, 2):
        assert results[pid]["exit"] != 0
        assert "TimeoutError" in results[pid]["error"], results[pid]
        assert "process 3" in results[pid]["error"] or "processes 3" in results[pid]["error"]
    assert elapsed < 60
