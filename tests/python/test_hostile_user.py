"""The hostile-user suite: tensorstash used as a careless user or an attacker would use it.

A standing suite that grows with every defect found this way: each test is named after the
behaviour it guarantees, and failed before the fix it guards (issue 13 for the first ones; each
section names its item). Tests check behaviour, never timings.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import shutil

import jax
import numpy as np
import pytest

import tensorstash
from tensorstash import _ext
from tensorstash import numpy as tnp
from tshelpers import assert_same_array, assert_same_tree, cli_path, mesh, named, pattern


# --- item 2: an async save of a jax.Array that shares memory with a NumPy array ------------------

def test_async_save_of_jax_array_sharing_numpy_memory_restores_the_values_at_save(tmp_path):
    """On CPU, jax.device_put of an aligned NumPy array adopts its memory. The caller may change
    that NumPy array as soon as save() returns; the step still holds the values at save().
    (Before the fix the background write read the changed memory: wrong values or a CRC-32C
    mismatch. The write is 32 MiB long, so the change below lands while it runs.)"""
    m = mesh((2, 4))
    sharding = named(m, "a", "b")
    want = pattern((2048, 4096), np.float32, seed=2)
    buffers, shards = [], []
    for device, index in sharding.addressable_devices_indices_map(want.shape).items():
        buf = tnp.empty_aligned(want[index].shape, want.dtype)
        buf[...] = want[index]
        buffers.append(buf)
        shards.append(jax.device_put(buf, device))
    x = jax.make_array_from_single_device_arrays(want.shape, sharding, shards)
    buffers[0].flat[0] += 1
    if np.asarray(shards[0]).flat[0] != buffers[0].flat[0]:
        pytest.skip("this JAX copies the NumPy arrays given to device_put: nothing is shared")
    buffers[0].flat[0] -= 1

    with tensorstash.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        assert mgr.save(1, {"x": x})
        for buf in reversed(buffers):  # allowed as soon as save() returned
            buf[...] = -1
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
        assert_same_array(mgr.restore(1)["x"], want, "x")


def test_async_save_without_copies_is_safe_against_donating_the_saved_arrays(tmp_path):
    """copy_host_jax_arrays=False: save() returns before the jax.Arrays on CPU are written, and
    the caller donates them at once to a jitted step that overwrites them. JAX must not reuse
    the buffers the save still reads (the manager holds views of them), so the step holds the
    values at save(). (Without the views JAX donates, the step's output takes over the buffer
    and the background write reads -1s.)"""
    m = mesh((2, 4))
    sharding = named(m, "a", "b")
    want = pattern((2048, 4096), np.float32, seed=5)
    x = jax.jit(lambda: jax.numpy.asarray(want), out_shardings=sharding)()
    overwrite = jax.jit(lambda t: t * 0 - 1, donate_argnums=0)
    control = jax.jit(lambda: jax.numpy.asarray(want), out_shardings=sharding)()
    overwrite(control).block_until_ready()
    assert control.is_deleted()  # the donation is real: JAX reuses a buffer nothing views
    with tensorstash.CheckpointManager(str(tmp_path / "ckpt"), copy_host_jax_arrays=False) as mgr:
        assert mgr.save(1, {"x": x})
        y = overwrite(x)
        y.block_until_ready()
        assert float(y[0, 0]) == -1.0
        mgr.wait_until_finished()
        assert_same_array(mgr.restore(1)["x"], want, "x")


def test_only_immutable_leaves_skip_the_copy(tmp_path):
    """What an async save may write without copying first: with trust_immutable (the manager's
    copy_host_jax_arrays=False) jax.Arrays on CPU, never NumPy arrays; by default neither."""
    from tensorstash import _save
    x = jax.device_put(np.arange(8, dtype=np.float32), jax.devices()[0])
    tree = {"j": x, "n": np.arange(8, dtype=np.float32)}
    for trust, want in ((False, {"j": False, "n": False}), (True, {"j": True, "n": False})):
        arrays, _ = _save.arrays_to_save(tree, None, trust_immutable=trust)
        assert {path: stable for path, _, _, _, stable in arrays} == want, trust


# --- item 4: big-endian NumPy arrays ------------------------------------------------------------

def big_endian_tree() -> dict:
    return {
        "f4": np.arange(6, dtype=">f4").reshape(2, 3) / 4,
        "i8": np.arange(5, dtype=">i8") * -3,
        "f2": np.array([0.5, -2.0, 65504.0], dtype=">f2"),
        "c16": np.array([1 - 2j, 3.5j], dtype=">c16"),
        "u2": np.array([1, 2, 65535], dtype=">u2"),
        "d0": np.array(-2.5, dtype=">f8"),  # 0-d
        "strided": np.arange(20, dtype=">i4")[::3],
        # A NumPy scalar is always in native order, whatever array it came from.
        "scalar": np.array(1.5, dtype=">f4")[()],
    }


@pytest.mark.parametrize("fmt", ["native", "orbax"])
def test_big_endian_arrays_are_saved_as_their_values(tmp_path, fmt):
    tree = big_endian_tree()
    step = str(tmp_path / "0000000001")
    tensorstash.save(step, tree, format=fmt)
    got = tensorstash.restore(step)
    for key, want in tree.items():
        native = np.asarray(want).astype(np.asarray(want).dtype.newbyteorder("="))
        assert_same_array(np.asarray(got[key]), native, key)


def test_manager_saves_big_endian_arrays_as_their_values(tmp_path):
    tree = big_endian_tree()
    with tensorstash.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        got = mgr.restore(1)
    for key, want in tree.items():
        assert np.array_equal(np.asarray(got[key]), want), key


def test_big_endian_target_gets_the_values_in_its_byte_order(step):
    tree = {"f4": pattern((3, 5), np.float32, seed=1), "i8": np.arange(7, dtype=np.int64) - 3,
            # 1 MiB: restored by mapping the data file where it can be.
            "mapped": pattern((512, 512), np.float32, seed=3)}
    tensorstash.save(step, tree)
    target = {k: np.zeros(v.shape, v.dtype.newbyteorder(">")) for k, v in tree.items()}
    for mmap in (True, False):
        got = tensorstash.restore(step, target=target, mmap=mmap)
        for key, want in tree.items():
            assert got[key].dtype == target[key].dtype, key
            assert np.array_equal(got[key], want), key


# --- item 7: a restore closes what it opened ----------------------------------------------------

def held_open(folder: str, descriptors_only: bool = False) -> list[str]:
    """The files under `folder` that this process holds, by descriptor or memory map: either
    keeps a deleted file's space."""
    prefix = os.path.join(folder, "")
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listing the folder is gone
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(prefix):
                held.append(f"descriptor {fd}: {target}")
    if descriptors_only:
        return held
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix):
                held.append(f"mapping: {fields[5].strip()}")
    return held


@pytest.fixture
def no_gc():
    """The garbage collector off: whatever a call leaves open stays open."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def saved_step(tmp_path) -> tuple[tensorstash.CheckpointManager, str, dict]:
    tree = {"big": pattern((512, 512), np.float32, seed=4),  # 1 MiB: mapped by default
            "small": np.arange(10), "nested": [1, {"x": np.ones(3)}]}
    mgr = tensorstash.CheckpointManager(str(tmp_path / "ckpt"), async_save=False)
    mgr.save(1, tree, metadata={"m": 1})
    return mgr, mgr.step_path(1), tree


def test_restore_and_metadata_close_the_step_files_before_returning(tmp_path, no_gc):
    mgr, step, tree = saved_step(tmp_path)
    target = {"big": np.zeros((512, 512), np.float32), "nested": [0, {"x": np.zeros(3)}]}
    gc.collect()
    calls = {
        "restore": lambda: tensorstash.restore(step),
        "restore(target)": lambda: tensorstash.restore(step, target=target),
        "restore(mmap=False)": lambda: tensorstash.restore(step, mmap=False),
        "metadata": lambda: tensorstash.metadata(step),
        "manager restore": lambda: mgr.restore(1, target=target),
        "manager metadata": lambda: mgr.metadata(1),
    }
    for name, call in calls.items():
        result = call()
        # Restored arrays may be mapped from the data files (mmap=True), never by descriptor.
        assert held_open(step, descriptors_only=True) == [], name
        del result
        assert held_open(step) == [], name
        assert gc.collect() == 0, f"{name} left reference cycles behind"
    mgr.close()
    shutil.rmtree(step)  # its space is free once nothing holds its files
    assert held_open(os.path.dirname(step)) == []


def test_restore_closes_the_step_files_when_it_fails(tmp_path, no_gc):
    mgr, step, _ = saved_step(tmp_path)
    with pytest.raises(KeyError, match="missing") as missing:
        tensorstash.restore(step, target={"big": np.zeros((512, 512), np.float32),
                                          "missing": np.zeros(1)})
    with pytest.raises(ValueError, match="rank") as bad_rank:
        tensorstash.restore(step, target={"small": np.zeros((2, 5))})
    # While the exceptions live, their tracebacks keep the failed calls' frames, and with them
    # the arrays restored so far (which may be mapped from the data files); not the reader.
    assert held_open(step, descriptors_only=True) == []
    del missing, bad_rank
    assert held_open(step) == []
    mgr.close()


def test_a_closed_reader_refuses_every_call(tmp_path):
    mgr, step, _ = saved_step(tmp_path)
    mgr.close()
    reader = _ext.Reader(os.path.dirname(step), os.path.basename(step))
    assert not reader.closed
    reader.close()
    assert reader.closed and held_open(step) == []
    for call in (reader.tree_json, reader.arrays, lambda: reader.read_file("metadata.json"),
                 reader.verify, lambda: reader.format):
        with pytest.raises(ValueError, match="closed"):
            call()
    reader.close()  # closing again does nothing


# --- item 11: trees nested as deeply as the format allows ---------------------------------------

MAX_DEPTH = 512  # docs/format.md, section 10: no node more than 512 levels below the root


def nested(depth: int, leaf):
    """`leaf` `depth` levels below the root, through dicts, lists and tuples in turn."""
    for level in range(depth):
        leaf = ({"k": leaf}, [leaf], (leaf,))[level % 3]
    return leaf


def innermost(tree, depth: int):
    for _ in range(depth):
        tree = tree["k"] if isinstance(tree, dict) else tree[0]
    return tree


def test_trees_nested_to_the_format_limit_save_restore_and_give_metadata(tmp_path):
    leaf = np.arange(6, dtype=np.int32)
    tree = nested(MAX_DEPTH, leaf)
    step = str(tmp_path / "0000000001")
    tensorstash.save(step, tree)
    assert_same_tree(tensorstash.restore(step), tree)
    assert_same_tree(tensorstash.restore(step, target=tree), tree)
    meta = innermost(tensorstash.metadata(step), MAX_DEPTH)
    assert meta.shape == (6,) and meta.dtype == np.int32
    # Scalars and empty containers at the limit, through the manager.
    with tensorstash.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        deep = {"scalar": nested(MAX_DEPTH - 1, 2.5), "empty": nested(MAX_DEPTH - 1, [])}
        mgr.save(1, deep)
        mgr.wait_until_finished()
        assert_same_tree(mgr.restore(1), deep)


def test_trees_nested_beyond_the_format_limit_are_a_value_error(tmp_path):
    step = str(tmp_path / "0000000001")
    with pytest.raises(ValueError, match="nested more than 512 levels"):
        tensorstash.save(step, {"a": nested(MAX_DEPTH, 1)})
    cyclic = [1]
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="nested more than 512 levels"):
        tensorstash.save(step, cyclic)
    assert not os.path.exists(step)
    tensorstash.save(step, {"a": 1})
    with pytest.raises(ValueError, match="nested more than 512 levels"):
        tensorstash.restore(step, target={"a": nested(MAX_DEPTH, 1)})


# --- item 13: scalar targets cast as arrays do, and errors name the leaf ------------------------

def test_float_scalars_into_int_or_bool_targets_are_refused_naming_the_leaf(step):
    tensorstash.save(step, {"f": 2.7, "whole": 2.0, "inf": math.inf, "nan": math.nan,
                            "a0": np.array(2.7), "huge": 10**400, "c": np.complex64(1j)})
    for key, target in [("f", 0), ("whole", 0), ("inf", 0), ("nan", 0), ("a0", 0), ("f", False),
                        ("f", np.int32(0)), ("huge", 0.0), ("c", 0.0)]:
        with pytest.raises(ValueError, match=f"'{key}'"):
            tensorstash.restore(step, target={key: target})


def test_scalar_targets_take_the_casts_arrays_take(step):
    tensorstash.save(step, {"i": 3, "b": True, "zero": 0, "f": 2.5, "i0": np.array(7, np.int16),
                            "u0": np.array(2**64 - 1, np.uint64), "f0": np.array(0.25, np.float32),
                            "small": 100, "big": 300})
    target = {"i": 0.0, "b": 0, "zero": True, "f": np.float32(0), "i0": 0, "u0": 0, "f0": 0.0,
              "small": np.int8(0)}
    got = tensorstash.restore(step, target=target)
    assert_same_tree(got, {"i": 3.0, "b": 1, "zero": False, "f": np.float32(2.5), "i0": 7,
                           "u0": 2**64 - 1, "f0": 0.25, "small": np.int8(100)})
    with pytest.raises(ValueError, match="'big'"):
        tensorstash.restore(step, target={"big": np.int8(0)})


def test_a_target_leaf_that_is_neither_array_nor_scalar_is_a_type_error_naming_it(step):
    tensorstash.save(step, {"a": np.zeros(3), "s": 1.5})
    for key in ("a", "s"):
        with pytest.raises(TypeError, match=f"'{key}'"):
            tensorstash.restore(step, target={key: object()})


# --- item 14: no internal exception types ------------------------------------------------------

@pytest.mark.parametrize("tree, named_", [
    ({"\ud800": 1}, r"'\\ud800'"),
    ({"a": {"b\udfff": np.zeros(2)}}, r"'b\\udfff'"),
    ({"s": ["x\ud800y"]}, r"'s/0'"),
])
def test_text_with_a_lone_surrogate_is_a_value_error_naming_it(tmp_path, tree, named_):
    step = str(tmp_path / "0000000001")
    for fmt in ("native", "orbax"):
        with pytest.raises(ValueError, match=named_):
            tensorstash.save(step, tree, format=fmt)
    assert not os.path.exists(step)
    with tensorstash.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        with pytest.raises(ValueError, match=named_):
            mgr.save(1, tree)
        with pytest.raises(ValueError, match=r"'loss\\ud800'"):
            mgr.save(2, {"a": 1}, metrics={"loss\ud800": 1.0})
        assert mgr.all_steps() == []


def test_a_path_that_is_not_utf8_is_a_value_error_naming_it(tmp_path):
    bad = str(tmp_path / "\udcff")  # how Python spells the file name b"\xff"
    with pytest.raises(ValueError, match=r"\\udcff"):
        tensorstash.save(os.path.join(bad, "0000000001"), {"a": 1})
    with pytest.raises(ValueError, match=r"\\udcff"):
        tensorstash.restore(bad)
    with pytest.raises(ValueError, match=r"\\udcff"):
        tensorstash.CheckpointManager(bad)


def test_int_leaves_of_any_number_of_digits_save_and_restore(tmp_path):
    tree = {"big": 10**5000 + 1, "negative": -(7**6000), "in_list": [2**50000, 3]}
    step = str(tmp_path / "0000000001")
    tensorstash.save(step, tree)
    assert_same_tree(tensorstash.restore(step), tree)
    assert_same_tree(tensorstash.restore(step, target={"big": 0, "negative": 0, "in_list": [0, 0]}),
                     tree)
    assert tensorstash.metadata(step) == tree
    with tensorstash.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        assert_same_tree(mgr.restore(1), tree)


def test_orbax_format_refuses_ints_beyond_int64_naming_the_leaf(tmp_path):
    """Orbax stores a Python int as a 0-d int64 array."""
    with pytest.raises(ValueError, match="'big'"):
        tensorstash.save(str(tmp_path / "0000000001"), {"big": 10**5000}, format="orbax")


# --- item 1: save() deletes a folder it did not write -------------------------------------------

def test_save_never_deletes_a_folder_of_the_users_files(tmp_path, monkeypatch):
    """A folder without COMMIT at the step path (the user's files; the working directory with
    save(".")) is refused with FileExistsError naming it, with or without overwrite, and left
    exactly as it was. (Before the fix it was deleted.)"""
    mine = tmp_path / "work"
    (mine / "sub").mkdir(parents=True)
    (mine / "thesis.tex").write_text("years of work")
    (mine / "sub" / "data.csv").write_text("1,2,3")
    monkeypatch.chdir(mine)
    for path in (".", str(mine)):
        for overwrite in (False, True):
            with pytest.raises(FileExistsError, match="neither a tensorstash step nor an Orbax"):
                tensorstash.save(path, {"x": np.arange(3)}, overwrite=overwrite)
            with pytest.raises(FileExistsError, match="work"):
                tensorstash.save(path, {"x": np.arange(3)}, overwrite=overwrite, format="orbax")
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert (mine / "sub" / "data.csv").read_text() == "1,2,3"
    assert sorted(os.listdir(tmp_path)) == ["work"]


def test_overwrite_replaces_an_orbax_checkpoint_but_only_when_asked(tmp_path):
    import orbax.checkpoint as ocp
    path = str(tmp_path / "ckpt")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, {"w": np.arange(4.0)})
    ckptr.wait_until_finished()
    with pytest.raises(FileExistsError, match="holds an Orbax checkpoint"):
        tensorstash.save(path, {"w": np.ones(2)})
    assert_same_array(tensorstash.restore(path)["w"], np.arange(4.0))  # still Orbax's
    tensorstash.save(path, {"w": np.ones(2)}, overwrite=True)
    assert_same_array(tensorstash.restore(path)["w"], np.ones(2))


# --- item 5: an Orbax checkpoint that lost a chunk file ------------------------------------------

def test_an_orbax_checkpoint_missing_a_chunk_is_an_oserror_naming_it(tmp_path):
    """Orbax records that it wrote every chunk (store_array_data_equal_to_fill_value); a chunk
    file that is gone is DataLoss naming it, in restore and in `tensorstash verify`, never zeros.
    (Before the fix it restored as zeros and verified OK.)"""
    import orbax.checkpoint as ocp
    path = tmp_path / "ckpt"
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False))
    ckptr.save(str(path), args=ocp.args.PyTreeSave({"w": np.arange(1, 9, dtype=np.float32)}))
    ckptr.close()
    chunks = [p for p in (path / "w").iterdir() if not p.name.startswith(".")]
    assert chunks, list((path / "w").iterdir())
    chunks[0].unlink()
    with pytest.raises(OSError, match=chunks[0].name):
        tensorstash.restore(str(path))
    verify = _run_cli("verify", path)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "missing" in verify.stdout + verify.stderr
    chunks[0].mkdir()  # a directory where the chunk should be
    with pytest.raises(OSError, match="not a regular file"):
        tensorstash.restore(str(path))


# --- item 15: a damaged COMMIT on the newest step ------------------------------------------------

def test_a_damaged_newest_commit_is_logged_and_the_previous_step_is_the_latest(tmp_path, caplog):
    root = tmp_path / "run"
    with tensorstash.CheckpointManager(str(root)) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": np.full(4, step)}, force=True)
    commit = root / "0000000002" / "COMMIT"
    text = commit.read_text()
    commit.write_text(text.replace('"tree_crc32c": ', '"tree_crc32c": 1', 1)[:-1])
    with caplog.at_level("WARNING", logger="tensorstash"):
        mgr = tensorstash.CheckpointManager(str(root))
    try:
        assert mgr.latest_step() == 1
        assert mgr.all_steps() == [1]
        assert list(mgr.damaged_steps()) == [2]
        assert any("step 2" in r.getMessage() and "damaged" in r.getMessage()
                   for r in caplog.records), caplog.text
        assert_same_array(mgr.restore(1)["x"], np.full(4, 1))
    finally:
        mgr.close()
    ls = _run_cli("ls", root)
    assert "damaged" in ls.stdout and "0000000002" in ls.stdout, ls.stdout


# --- item 16: data files that are not regular files ----------------------------------------------

@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_data_file_that_is_not_a_regular_file_is_an_oserror_saying_so(tmp_path, kind):
    path = tmp_path / "0000000001"
    tensorstash.save(str(path), {"x": np.arange(1000.0)})
    data = next((path / "state" / "data").iterdir())
    copy = tmp_path / "copy.dat"
    shutil.copy(data, copy)
    data.unlink()
    if kind == "symlink":
        data.symlink_to(copy)
    elif kind == "fifo":
        os.mkfifo(data)
    else:
        (data / "inner").mkdir(parents=True)
    with pytest.raises(OSError, match="not a regular file") as raised:
        tensorstash.restore(str(path))
    assert data.name in str(raised.value)
    assert not isinstance(raised.value, (FileNotFoundError, ValueError))


def _run_cli(*args):
    import subprocess
    return subprocess.run([cli_path(), *map(str, args)], capture_output=True, text=True, timeout=300)


# --- issue 14: a URL whose scheme no store serves -------------------------------------------------

def test_a_url_no_store_serves_is_a_value_error_and_writes_nothing(tmp_path, monkeypatch):
    """save("s3://bucket/run/1") wrote a local folder named "s3:" (before the S3 store); any
    scheme no backend serves (az:// here) is a ValueError naming the schemes there are."""
    monkeypatch.chdir(tmp_path)
    for call in (lambda: tensorstash.save("az://bucket/run/1", {"x": np.arange(3)}),
                 lambda: tensorstash.save("az://bucket/run/1", {"x": np.arange(3)},
                                          format="orbax"),
                 lambda: tensorstash.restore("az://bucket/run/1"),
                 lambda: tensorstash.CheckpointManager("az://bucket/run")):
        with pytest.raises(ValueError, match=r"no store serves .*file, gs, memory"):
            call()
    assert os.listdir(tmp_path) == []


def test_stores_open_by_url(tmp_path):
    """Every front takes a store URL where it takes a path (kvstore/registry.h)."""
    tree = {"x": np.arange(6.0).reshape(2, 3)}
    tensorstash.save("memory://url-test/run/0000000001", tree)
    assert_same_tree(tensorstash.restore("memory://url-test/run/0000000001"), tree)
    assert tensorstash.metadata("memory://url-test/run/0000000001")["x"].shape == (2, 3)
    with tensorstash.CheckpointManager("memory://url-test/managed") as mgr:
        mgr.save(5, tree, force=True)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [5]
        assert mgr.step_path(5) == "memory://url-test/managed/0000000005"
        assert_same_tree(tensorstash.restore(mgr.step_path(5)), tree)
    tensorstash.save(f"file://{tmp_path}/0000000002", tree)
    assert_same_tree(tensorstash.restore(str(tmp_path / "0000000002")), tree)
    with pytest.raises(FileNotFoundError):
        tensorstash.restore("memory://url-test-never-made/0000000001")


# --- issue 36: 64-bit targets with JAX's 64-bit types off; scalar leaves into array targets ------

def _run_jax_x64_off(tmp_path, script: str, *args: str) -> None:
    """Runs `script` in a fresh Python with JAX's 64-bit types off (JAX_ENABLE_X64=0, JAX's
    default, which this suite's own process turns on) on 8 CPU devices; fails with its output
    unless it exits 0."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_ENABLE_X64", "PYTHONPATH")}
    env.update(JAX_ENABLE_X64="0", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    p = subprocess.run([sys.executable, "-c", script, *args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"


# The child of the item 7 test: every type JAX narrows, saved wide (in both formats), restored
# into targets of the wide type on every sharding and both placement paths, must come back as
# jax.device_put of the saved NumPy array would: the narrow dtype, the same bits on every
# device, and usable in arithmetic.
_X64_OFF_TARGETS = r'''
import sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
import tensorstash
from tensorstash import jax as tjax

assert not jax.config.jax_enable_x64
root = sys.argv[1]
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
base = np.arange(64, dtype=np.float64).reshape(8, 8)
saved = {  # values in the narrow types' range; floats that float32 must round
    "float64": base / 3 - 7.1,
    "int64": (base.astype(np.int64) - 32) * 40_000_001,
    "uint64": base.astype(np.uint64) * 67_000_003 + 7,
    "complex128": base / 7 + 1j * (base / 3 - 5),
}
shardings = {"sharded": NamedSharding(mesh, P("a", "b")), "rows": NamedSharding(mesh, P("a")),
             "replicated": NamedSharding(mesh, P()),
             "one device": SingleDeviceSharding(jax.devices()[3]), "no sharding": None}
failures = []

def check(got, name, sharding, where):
    want = jax.device_put(saved[name], sharding)  # what JAX itself makes of the saved array
    narrow = jax.dtypes.canonicalize_dtype(np.dtype(name))
    if got.dtype != narrow or want.dtype != narrow:
        # (x + 1 is not tried: XLA fails on, or kills the process over, such an array.)
        failures.append(f"{where}: dtype {got.dtype}, jax.device_put gives {want.dtype}")
        return
    if sharding is not None and not got.sharding.is_equivalent_to(sharding, got.ndim):
        failures.append(f"{where}: sharding {got.sharding}")
    for mine, theirs in zip(sorted(got.addressable_shards, key=lambda s: s.device.id),
                            sorted(want.addressable_shards, key=lambda s: s.device.id)):
        a, b = np.asarray(mine.data), np.asarray(theirs.data)
        if a.dtype != narrow or a.tobytes() != b.tobytes() or a.shape != b.shape:
            failures.append(f"{where}: device {mine.device.id} holds {a.dtype} {a.shape}, "
                            f"not the bits of jax.device_put's {b.dtype} {b.shape}")
    try:
        total = np.asarray(got + 1)
    except Exception as e:
        failures.append(f"{where}: x + 1 fails: {type(e).__name__}: {str(e)[:200]}")
        return
    if total.tobytes() != np.asarray(want + 1).tobytes():
        failures.append(f"{where}: x + 1 differs from jax.device_put's")

for fmt in ("native", "orbax"):
    step = f"{root}/{fmt}/0000000001"
    tensorstash.save(step, saved, format=fmt)
    # Without a target: the saved NumPy arrays, which jax.device_put narrows itself.
    plain = tensorstash.restore(step)
    for name, a in saved.items():
        if plain[name].dtype != a.dtype or plain[name].tobytes() != a.tobytes():
            failures.append(f"{fmt}, no target, {name}: {plain[name].dtype}")
        check(jax.device_put(plain[name], shardings["sharded"]), name, shardings["sharded"],
              f"{fmt}, no target then jax.device_put, {name}")
    batched = tjax._batched_put
    for placement in ("batched", "make_array_from_callback"):
        tjax._batched_put = batched if placement == "batched" else None
        for where, sharding in shardings.items():
            kw = {} if sharding is None else {"sharding": sharding}
            abstract = {n: jax.ShapeDtypeStruct(a.shape, np.dtype(n), **kw)
                        for n, a in saved.items()}
            concrete = {n: jax.device_put(np.zeros(a.shape, np.dtype(n)), sharding)
                        for n, a in saved.items()}
            for kind, target in (("ShapeDtypeStruct", abstract), ("jax.Array", concrete)):
                got = tensorstash.restore(step, target=target)
                one = {n: tensorstash.restore(step, target={n: t})[n] for n, t in target.items()}
                for name in saved:
                    for how, tree in (("batch of 4", got), ("alone", one)):
                        check(tree[name], name, sharding,
                              f"{fmt}, {placement}, {where}, {kind} target, {how}, {name}")
    tjax._batched_put = batched
# Where jax.device_put would wrap (an int64 beyond int32), restore refuses, naming the leaf, as it
# refuses every cast that loses a value.
tensorstash.save(f"{root}/0000000002", {"i": np.array([2**40, 1])})
try:
    tensorstash.restore(f"{root}/0000000002", target={"i": jax.ShapeDtypeStruct((2,), np.int64)})
except ValueError as e:
    if "'i'" not in str(e) or "int32" not in str(e):
        failures.append(f"2**40 into int64 (int32): {e}")
else:
    failures.append("2**40 into int64 (int32): no error")
assert not failures, f"{len(failures)} failures, the first:\n" + "\n".join(failures[:30])
print("ok")
'''


def test_64_bit_targets_with_jax_x64_off_get_jaxs_narrow_types(tmp_path):
    """Issue 36 item 7: with jax_enable_x64 off, a float64 (int64, uint64, complex128) target
    gave a jax.Array that claimed float64 over float32 buffers, and `x + 1` failed in XLA
    (RuntimeProgramInputMismatch). It is now what jax.device_put gives: float32 (int32, uint32,
    complex64), the same bits on every device, usable in arithmetic, on every sharding, through
    the batched placement and the public one, from both formats."""
    _run_jax_x64_off(tmp_path, _X64_OFF_TARGETS, str(tmp_path / "root"))


_SCALARS = {"step": 5, "lr": 0.5, "flag": True, "neg": -3, "big": 2**40, "name": "run-7"}


def test_scalar_leaves_into_0d_array_targets_are_0d_arrays_of_the_targets_dtype(step):
    """Issue 36 item 10: a saved Python scalar restored into an array target came back as the
    scalar itself, whatever the target's dtype and shape. A 0-d target now gets a 0-d array of
    its own kind (NumPy, or jax.Array on the target's sharding) and dtype (byte order too), the
    value cast as a NumPy scalar target of that dtype gets it."""
    import ml_dtypes
    from tshelpers import assert_jax_array
    tensorstash.save(step, _SCALARS)
    for key, dtype in [("step", np.int32), ("step", np.float64), ("step", np.uint8),
                       ("step", ">i4"), ("lr", np.float32), ("lr", ml_dtypes.bfloat16),
                       ("flag", np.int8), ("flag", np.bool_),
                       ("neg", np.int16), ("big", np.int64), ("big", np.float64)]:
        want = np.array(_SCALARS[key], dtype)
        got = tensorstash.restore(step, target={key: np.zeros((), dtype)})[key]
        assert_same_array(got, want, f"{key} into a 0-d {np.dtype(dtype)} array")
        # The same value as a NumPy scalar target of that dtype gets (test item 13 above).
        scalar = tensorstash.restore(step, target={key: np.dtype(dtype).type(0)})[key]
        assert got.tobytes() == np.array(scalar, dtype).tobytes()
    sharding = named(mesh((2, 4)))
    for target in (jax.ShapeDtypeStruct((), np.int32, sharding=sharding),
                   jax.device_put(np.zeros((), np.int32), sharding)):
        got = tensorstash.restore(step, target={"step": target, "lr": 0.0})
        assert_jax_array(got["step"], np.array(5, np.int32), sharding, type(target).__name__)
        assert int(got["step"] + 1) == 6 and got["lr"] == 0.5
    got = tensorstash.restore(step, target={"step": jax.ShapeDtypeStruct((), np.float32)})
    assert_jax_array(got["step"], np.array(5, np.float32),
                     jax.sharding.SingleDeviceSharding(jax.devices()[0]), "no sharding")


def test_scalar_leaves_refuse_array_targets_they_cannot_fill_naming_the_leaf(step):
    """A scalar fills no array target but a 0-d one (as an array fills no target of another
    rank), and takes the casts a NumPy scalar target takes: the same errors, naming the leaf.
    (Before, every such target got the scalar back, silently.)"""
    import re
    tensorstash.save(step, _SCALARS)
    for key, target in [("step", np.zeros((3,), np.int32)), ("step", np.zeros((1,), np.int64)),
                        ("lr", np.zeros((2, 2), np.float32)),
                        ("step", jax.ShapeDtypeStruct((3,), np.int32)),
                        ("flag", jax.ShapeDtypeStruct((1, 1), np.bool_,
                                                      sharding=named(mesh((2, 4)))))]:
        with pytest.raises(ValueError, match=rf"'{key}'.*{re.escape(str(target.shape))}"):
            tensorstash.restore(step, target={key: target})
    for key, dtype, error in [("lr", np.int32, ValueError), ("lr", np.bool_, ValueError),
                              ("big", np.int32, ValueError), ("neg", np.uint8, ValueError),
                              ("step", np.complex64, ValueError), ("lr", np.uint64, ValueError),
                              ("name", np.int32, TypeError), ("name", np.uint8, TypeError)]:
        for target in (np.zeros((), dtype), jax.ShapeDtypeStruct((), dtype),
                       np.dtype(dtype).type(0)):
            with pytest.raises(error, match=f"'{key}'"):
                tensorstash.restore(step, target={key: target})


_X64_OFF_SCALARS = r'''
import sys
import jax, numpy as np
import tensorstash
assert not jax.config.jax_enable_x64
step = sys.argv[1]
tensorstash.save(step, {"step": 5, "big": 2**40})
got = tensorstash.restore(step, target={"step": jax.ShapeDtypeStruct((), np.int64)})["step"]
assert isinstance(got, jax.Array) and got.dtype == np.int32, (type(got), got.dtype)
assert np.asarray(got).dtype == np.int32 and int(got + 1) == 6, np.asarray(got)
try:
    tensorstash.restore(step, target={"big": jax.ShapeDtypeStruct((), np.int64)})
except ValueError as e:
    assert "'big'" in str(e) and "int32" in str(e), str(e)
else:
    raise AssertionError("2**40 into JAX's 32-bit int restored")
print("ok")
'''


def test_scalar_leaves_into_64_bit_jax_targets_with_x64_off_get_jaxs_narrow_types(tmp_path):
    """With JAX's 64-bit types off, a 0-d int64 target of a saved int is a 0-d int32 jax.Array
    (as jax.device_put gives), and an int that int32 cannot hold is a ValueError naming the leaf
    and the type, never a wrapped value."""
    _run_jax_x64_off(tmp_path, _X64_OFF_SCALARS, str(tmp_path / "root" / "0000000001"))
