"""The hostile-user suite, continued for the RAM tier, gc and the manager (issue 36): each test
failed before its fix. docs/reliability.md lists them with the guarantee each one holds."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tensorstash
from tshelpers import cli_path


def flip_a_byte(path: str, offset: int | None = None) -> None:
    """Flips one bit of the file at `path` (in its middle by default)."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2 if offset is None else offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def data_files(step_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(step_dir, "state", "data", "*")))
    assert files, f"no data file under {step_dir}"
    return files


# --- item 1: a restore without checksums never writes unchecked bytes back ---------------------


def test_a_restore_without_checksums_does_not_launder_a_corrupt_copy(tmp_path):
    w = np.arange(1 << 14, dtype=np.float32)
    options = dict(local_dir=tmp_path / "local", save_interval_steps=1, async_save=False)
    with tensorstash.CheckpointManager(tmp_path / "p", **options) as mgr:
        mgr.save(1, {"w": w})
    shutil.rmtree(tmp_path / "local")  # the node lost its RAM tier: the restore reads the root
    flip_a_byte(data_files(str(tmp_path / "p" / "0000000001"))[0])
    with tensorstash.CheckpointManager(tmp_path / "p", **options) as mgr:
        assert mgr.latest_step() == 1
        unchecked = mgr.restore(1, verify_checksums=False)  # the user opted out: wrong values
        assert not np.array_equal(unchecked["w"], w)
        assert mgr.local_steps() == []  # nothing was written back
        # The next restore checks again, and the only copy is the corrupt one.
        with pytest.raises(OSError, match="(?i)checksum|crc"):
            mgr.restore(1)


def test_a_checked_restore_from_the_root_is_written_back(tmp_path):
    # The write-back itself still happens when the bytes were checked.
    w = np.arange(1 << 14, dtype=np.float32)
    options = dict(local_dir=tmp_path / "local", save_interval_steps=1, async_save=False)
    with tensorstash.CheckpointManager(tmp_path / "p", **options) as mgr:
        mgr.save(1, {"w": w})
    shutil.rmtree(tmp_path / "local")
    with tensorstash.CheckpointManager(tmp_path / "p", **options) as mgr:
        assert mgr.latest_step() == 1
        np.testing.assert_array_equal(mgr.restore(1)["w"], w)
        assert mgr.last_restore_stats.bytes_from["persistent"] == w.nbytes
        assert mgr.local_steps() == [1]
        np.testing.assert_array_equal(mgr.restore(1)["w"], w)
        assert mgr.last_restore_stats.bytes_from["local"] == w.nbytes


# --- item 9: steps are ints, and a bad one is a ValueError ------------------------------------


@pytest.mark.parametrize("step", [6.7, 6.0, True, False, 2**63, -1, 10**10, "3", None, 1j],
                         ids=repr)
def test_a_step_that_is_not_an_int_in_range_is_a_value_error(tmp_path, step):
    with tensorstash.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(ValueError, match="step"):
            mgr.save(step, {"w": np.zeros(3)})
        with pytest.raises(ValueError, match="step"):
            mgr.should_save(step)
        assert mgr.all_steps() == []


def test_integer_scalars_of_numpy_are_steps(tmp_path):
    with tensorstash.CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.save(np.int64(7), {"w": np.zeros(3)})
        assert mgr.save(10**10 - 1, {"w": np.zeros(3)})
        assert mgr.all_steps() == [7, 10**10 - 1]


# --- item 3: a reused local_dir never restores another run's state -----------------------------


def test_a_reused_local_dir_never_restores_another_runs_state(tmp_path, caplog):
    local = tmp_path / "local"
    options = dict(local_dir=local, save_interval_steps=1000, async_save=False)
    with tensorstash.CheckpointManager(tmp_path / "run-a", **options) as a:
        a.save(50, {"w": np.full(100, 50.0)}, per_process={"run": "a"})
        assert a.local_steps() == [50]
    # Run B: a fresh persistent root, the same local_dir.
    with tensorstash.CheckpointManager(tmp_path / "run-b", **options) as b:
        assert "another run" in caplog.text
        assert b.local_steps() == []
        assert b.latest_step() is None
        b.save(3, {"w": np.full(100, 3.0)}, per_process={"run": "b"})
        assert b.local_steps() == [3]  # not deleted by retention for A's higher step
        assert b.latest_step() == 3
        np.testing.assert_array_equal(b.restore(3)["w"], np.full(100, 3.0))
        assert b.per_process(3) == {"run": "b"}
    # B resumed (its own root): its holding still restores.
    with tensorstash.CheckpointManager(tmp_path / "run-b", **options) as b:
        assert b.latest_step() == 3
        np.testing.assert_array_equal(b.restore(3)["w"], np.full(100, 3.0))
        assert b.last_restore_stats.bytes_from["local"] == 800


# --- item 5: a corrupt only copy falls back to the newest step that restores whole -------------


def test_a_corrupt_only_local_copy_falls_back_to_an_intact_older_step(tmp_path, caplog):
    local = tmp_path / "local"
    options = dict(local_dir=local, save_interval_steps=10, local_save_interval_steps=1,
                   local_max_to_keep=1, async_save=False)
    with tensorstash.CheckpointManager(tmp_path / "p", **options) as mgr:
        for step in (10, 11):
            mgr.save(step, {"w": np.full(4096, float(step), np.float32)},
                     per_process={"step": step})
        assert mgr.all_steps() == [10]
        assert 11 in mgr.local_steps()  # (10 may be going: retention deletes in the background)
    # Step 11 lives only in this node's RAM, and a byte of it flips.
    flip_a_byte(data_files(str(local / "p0-of-1" / "0000000011"))[0])
    with tensorstash.CheckpointManager(tmp_path / "p", **options) as mgr:
        step = mgr.latest_step()
        assert step == 11
        tree = mgr.restore(step)
        assert mgr.last_restore_stats.step == 10
        np.testing.assert_array_equal(tree["w"], np.full(4096, 10.0, np.float32))
        assert mgr.per_process(step) == {"step": 10}
        assert mgr.per_process() == {"step": 10}
        assert "step 11" in caplog.text and "does not restore whole" in caplog.text
        assert mgr.restore(10)["w"][0] == 10.0
    # A restart restores step 10 straight away: the job went on from it, so the corrupt step 11
    # (a later step of the abandoned timeline) was dropped from this node.
    caplog.clear()
    with tensorstash.CheckpointManager(tmp_path / "p", **options) as mgr:
        assert mgr.latest_step() == 10
        assert mgr.restore(10)["w"][0] == 10.0
        assert "does not restore whole" not in caplog.text


def test_a_damaged_only_metadata_file_falls_back_to_an_intact_older_step(tmp_path, caplog):
    # The chaos test (seed 808614175) flipped a byte of metadata.json in the only holding of the
    # latest step: the restore took that step with metadata() None instead of the older step.
    local = tmp_path / "local"
    options = dict(local_dir=local, save_interval_steps=10, local_save_interval_steps=1,
                   local_max_to_keep=1, async_save=False)
    with tensorstash.CheckpointManager(tmp_path / "p", **options) as mgr:
        for step in (10, 11):
            mgr.save(step, {"w": np.full(4096, float(step), np.float32)},
                     per_process={"step": step}, metadata={"step": step})
        assert mgr.all_steps() == [10]
    flip_a_byte(str(local / "p0-of-1" / "0000000011" / "metadata.json"), offset=3)
    with tensorstash.CheckpointManager(tmp_path / "p", **options) as mgr:
        step = mgr.latest_step()
        assert step == 11
        tree = mgr.restore(step)
        assert mgr.last_restore_stats.step == 10
        np.testing.assert_array_equal(tree["w"], np.full(4096, 10.0, np.float32))
        assert mgr.metadata(step) == {"step": 10}
        assert mgr.per_process(step) == {"step": 10}
        assert "step 11" in caplog.text and "metadata.json" in caplog.text


def test_the_plain_manager_falls_back_from_a_corrupt_latest_step(tmp_path, caplog):
    with tensorstash.CheckpointManager(tmp_path, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.full(4096, float(step), np.float32)},
                     per_process={"step": step})
    flip_a_byte(data_files(str(tmp_path / "0000000002"))[0])
    with tensorstash.CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() == 2
        tree = mgr.restore()
        assert mgr.last_restore_stats.step == 1
        assert tree["w"][0] == 1.0
        assert mgr.per_process() == {"step": 1}
        assert "step 2" in caplog.text and "does not restore whole" in caplog.text
        with pytest.raises(OSError, match="(?i)checksum|crc"):
            tensorstash.restore(mgr.step_path(2))


# --- items 2 and 8: gc leaves alone what a save may still be writing; Ctrl-C leaves nothing ---


def test_gc_leaves_a_save_in_flight_alone_and_removes_old_leftovers(tmp_path):
    tensorstash.save(str(tmp_path / "0000000001"), {"w": np.arange(10)})
    # What a save that takes no lock has on disk while it writes: its temporary folder.
    tmp = tmp_path / "0000000002.tmp-0123456789abcdef"
    (tmp / "state" / "data").mkdir(parents=True)
    (tmp / "state" / "data" / "0-0.dat").write_bytes(b"x" * 100)
    orbax_tmp = tmp_path / "0000000003.orbax-checkpoint-tmp-1700000000"
    (orbax_tmp / "d").mkdir(parents=True)
    (orbax_tmp / "d" / "0").write_bytes(b"y")
    done = subprocess.run([cli_path(), "gc", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert tmp.exists() and orbax_tmp.exists(), done.stdout
    assert "left 2 folders written less than 6 h ago" in done.stdout, done.stdout
    # Once old (or with --min-age 0), both go; the committed step stays.
    old = time.time() - 7 * 3600
    for path in (tmp / "state" / "data" / "0-0.dat", orbax_tmp / "d" / "0"):
        os.utime(path, (old, old))
    done = subprocess.run([cli_path(), "gc", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not tmp.exists() and not orbax_tmp.exists(), done.stdout
    np.testing.assert_array_equal(tensorstash.restore(str(tmp_path / "0000000001"))["w"],
                                  np.arange(10))


def test_gc_racing_saves_never_damages_a_step(tmp_path):
    """Saves of a step (new and overwrites) while `tensorstash gc` runs again and again: every
    save succeeds and every committed version restores whole."""
    root = tmp_path / "root"
    script = f"""
import numpy as np, tensorstash
for i in range(12):
    w = np.full((1 << 18,), i, np.float32)
    tensorstash.save({str(root)!r} + "/%010d" % (i % 3), {{"w": w, "b": np.arange(i + 1)}},
                     overwrite=True, chunk_bytes=1 << 16, data_file_bytes=1 << 18)
print("saved", flush=True)
"""
    root.mkdir()
    saver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    runs = 0
    while saver.poll() is None:
        done = subprocess.run([cli_path(), "gc", str(root)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        runs += 1
    out, err = saver.communicate()
    assert saver.returncode == 0 and "saved" in out, err
    assert runs > 0
    for step in range(3):
        tree = tensorstash.restore(str(root / f"{step:010d}"))
        i = int(tree["w"][0])
        assert i % 3 == step
        np.testing.assert_array_equal(tree["w"], np.full((1 << 18,), i, np.float32))
        np.testing.assert_array_equal(tree["b"], np.arange(i + 1))


def test_an_interrupted_convert_leaves_no_temporary_folder(tmp_path):
    src = tmp_path / "src"
    arrays = {f"a{i}": np.full((1 << 20,), i, np.float32) for i in range(64)}  # 256 MiB
    tensorstash.save(str(src), arrays, chunk_bytes=1 << 20)
    dst = tmp_path / "out" / "orbax"
    proc = subprocess.Popen([cli_path(), "convert", str(src), str(dst), "--to", "orbax"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not glob.glob(str(dst) + ".orbax-checkpoint-tmp-*") and proc.poll() is None:
        assert time.monotonic() < deadline, "convert wrote no temporary folder"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.fail("convert finished before the signal; make the source larger")
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, err)
    assert "interrupted" in err, err
    assert glob.glob(str(dst) + "*") == []
