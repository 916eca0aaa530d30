"""Incremental saves (docs/format.md, 6.1): tensorstash.save(path, tree, base=older_step)
references the chunks that did not change instead of writing them again."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tensorstash

CHUNK = 64 << 10


def lora_like(rng: np.random.Generator, adapter_seed: int) -> dict:
    """A frozen base model (most bytes) and small adapters that change every step."""
    frozen = np.random.default_rng(0)
    adapters = np.random.default_rng(adapter_seed)
    return {
        "base": {f"layer{i}": {"w": frozen.standard_normal((256, 256), dtype=np.float32),
                               "b": frozen.standard_normal((256,), dtype=np.float32)}
                 for i in range(4)},
        "lora": {f"layer{i}": {"a": adapters.standard_normal((256, 8), dtype=np.float32),
                               "b": adapters.standard_normal((8, 256), dtype=np.float32)}
                 for i in range(4)},
        "step": np.int64(adapter_seed),
    }


def own_data_bytes(step_dir: str) -> int:
    data = os.path.join(step_dir, "state", "data")
    return sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data))


def assert_trees_equal(got, want):
    if isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            assert_trees_equal(got[k], want[k])
    else:
        assert np.asarray(got).dtype == np.asarray(want).dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_lora_like_state_saved_against_a_base_writes_only_changed_chunks(tmp_path):
    rng = np.random.default_rng(1)
    first, second = lora_like(rng, 1), lora_like(rng, 2)
    s1, s2 = str(tmp_path / "0000000001"), str(tmp_path / "0000000002")
    full = tensorstash.save(s1, first, chunk_bytes=CHUNK, record_digests=True, sync=False)
    assert full["referenced_chunks"] == 0
    stats = tensorstash.save(s2, second, chunk_bytes=CHUNK, base=s1, sync=False)
    frozen_bytes = 4 * (256 * 256 + 256) * 4
    assert stats["referenced_bytes"] == frozen_bytes
    assert stats["raw_bytes"] == 4 * 2 * 256 * 8 * 4 + 8  # the adapters and the step counter
    assert own_data_bytes(s2) < own_data_bytes(s1) * 0.2
    assert_trees_equal(tensorstash.restore(s2), second)
    assert_trees_equal(tensorstash.restore(s1), first)


def test_missing_base_file_is_a_clear_error_naming_it(tmp_path):
    rng = np.random.default_rng(1)
    s1, s2 = str(tmp_path / "0000000001"), str(tmp_path / "0000000002")
    tensorstash.save(s1, lora_like(rng, 1), chunk_bytes=CHUNK, record_digests=True, sync=False)
    tensorstash.save(s2, lora_like(rng, 2), chunk_bytes=CHUNK, base=s1, sync=False)
    os.remove(os.path.join(s1, "state", "data", "0-0.dat"))
    with pytest.raises(OSError) as e:
        tensorstash.restore(s2)
    assert "state/data/0-0.dat" in str(e.value)
    assert "0000000001" in str(e.value)


def test_base_must_be_a_step_of_the_same_folder(tmp_path):
    rng = np.random.default_rng(1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    s1 = str(tmp_path / "a" / "0000000001")
    tensorstash.save(s1, lora_like(rng, 1), record_digests=True, sync=False)
    with pytest.raises(ValueError, match="same folder"):
        tensorstash.save(str(tmp_path / "b" / "0000000002"), lora_like(rng, 2), base=s1)
    with pytest.raises(FileNotFoundError):
        tensorstash.save(str(tmp_path / "a" / "0000000002"), lora_like(rng, 2),
                         base=str(tmp_path / "a" / "0000000000"))


def test_steps_without_digests_stay_format_1(tmp_path):
    s1 = str(tmp_path / "0000000001")
    tensorstash.save(s1, {"x": np.arange(10)}, sync=False)
    with open(os.path.join(s1, "state", "index"), "rb") as f:
        assert f.read(12)[8:12] == b"\x01\x00\x00\x00"


def test_inspect_shows_what_a_step_depends_on_and_verify_follows_references(tmp_path):
    import json
    import subprocess

    from tshelpers import cli_path

    rng = np.random.default_rng(1)
    s1, s2 = str(tmp_path / "0000000001"), str(tmp_path / "0000000002")
    tensorstash.save(s1, lora_like(rng, 1), chunk_bytes=CHUNK, record_digests=True, sync=False)
    tensorstash.save(s2, lora_like(rng, 2), chunk_bytes=CHUNK, base=s1, sync=False)
    shown = subprocess.run([cli_path(), "inspect", "--json", s2], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["depends_on"] == ["0000000001"]
    assert doc["borrowed_bytes"] == 4 * (256 * 256 + 256) * 4
    text = subprocess.run([cli_path(), "inspect", s2], capture_output=True, text=True).stdout
    assert "of step(s) 0000000001" in text
    assert subprocess.run([cli_path(), "verify", s2], capture_output=True).returncode == 0
    # A bit flipped in the base's file: verify of the new step names that file.
    data = os.path.join(s1, "state", "data", "0-0.dat")
    with open(data, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    bad = subprocess.run([cli_path(), "verify", s2], capture_output=True, text=True)
    assert bad.returncode != 0
    assert "0000000001/state/data/0-0.dat" in bad.stdout + bad.stderr


def test_manager_retention_never_deletes_a_step_a_kept_step_depends_on(tmp_path):
    # One-off incremental saves into a managed root: retention drops the base from the listing
    # but leaves its folder, because the kept incremental step reads its chunks there.
    rng = np.random.default_rng(3)
    trees = [lora_like(rng, seed) for seed in (1, 2, 3, 4)]
    root = str(tmp_path)
    tensorstash.save(os.path.join(root, "0000000001"), trees[0], chunk_bytes=CHUNK,
                     record_digests=True, sync=False)
    tensorstash.save(os.path.join(root, "0000000002"), trees[1], chunk_bytes=CHUNK,
                     base=os.path.join(root, "0000000001"), sync=False)
    mgr = tensorstash.CheckpointManager(root, max_to_keep=2)
    mgr.save(3, trees[2])
    mgr.wait_until_finished()
    assert mgr.all_steps() == [2, 3]
    assert os.path.isdir(os.path.join(root, "0000000001")), "the base of kept step 2 was deleted"
    assert_trees_equal(tensorstash.restore(os.path.join(root, "0000000002")), trees[1])
    mgr.save(4, trees[3])  # step 2 is dropped now: nothing kept depends on it, so it goes
    mgr.wait_until_finished()
    assert mgr.all_steps() == [3, 4]
    assert not os.path.exists(os.path.join(root, "0000000002"))
    assert_trees_equal(tensorstash.restore(os.path.join(root, "0000000003")), trees[2])
    mgr.close()


# --- CheckpointManager(incremental=True) ------------------------------------------------------

def step_dir(root, step: int) -> str:
    return os.path.join(str(root), f"{step:010d}")


def depends_on(root, step: int) -> list[str]:
    import json

    with open(os.path.join(step_dir(root, step), "COMMIT")) as f:
        return json.load(f).get("depends_on", [])


@pytest.mark.parametrize("async_save", [True, False])
def test_incremental_manager_writes_only_what_changed_and_retires_bases_kept_steps_need(
        tmp_path, async_save):
    rng = np.random.default_rng(5)
    trees = {step: lora_like(rng, step) for step in range(1, 6)}
    saved: list[tensorstash.SaveStats] = []
    with tensorstash.CheckpointManager(tmp_path, max_to_keep=2, incremental=True,
                                       chunk_bytes=CHUNK, sync=False, async_save=async_save,
                                       on_save=saved.append) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, trees[step])
        mgr.wait_until_finished()
        # Step 1 was written whole; steps 2 and 3 wrote the adapters (and the step counter).
        adapters = 4 * 2 * 256 * 8 * 4 + 8
        assert [s.raw_bytes for s in saved][1:] == [adapters, adapters]
        assert saved[0].raw_bytes > 10 * adapters
        assert own_data_bytes(step_dir(tmp_path, 3)) < own_data_bytes(step_dir(tmp_path, 1)) * 0.2
        # Step 3 was saved against step 2, and refers straight to step 1 for the frozen model.
        assert depends_on(tmp_path, 2) == ["0000000001"]
        assert depends_on(tmp_path, 3) == ["0000000001"]
        assert mgr.all_steps() == [2, 3]
        assert mgr.retired_steps() == [1]
        for step in (2, 3):
            assert_trees_equal(mgr.restore(step), trees[step])
    # A later session: step 1 stays unlisted (and is never a base) while a kept step needs it.
    with tensorstash.CheckpointManager(tmp_path, max_to_keep=2, incremental=True,
                                       chunk_bytes=CHUNK, sync=False) as mgr:
        assert mgr.all_steps() == [2, 3]
        assert mgr.retired_steps() == [1]
        mgr.save(4, trees[4])
        mgr.wait_until_finished()
        assert not os.path.exists(step_dir(tmp_path, 2))  # dropped, needed by nobody
        assert mgr.retired_steps() == [1]
        for step in (3, 4):
            assert_trees_equal(mgr.restore(step), trees[step])
    # A session that saves full steps: once no kept step refers to step 1, it is deleted.
    with tensorstash.CheckpointManager(tmp_path, max_to_keep=1, sync=False) as mgr:
        mgr.save(5, trees[5])
        mgr.wait_until_finished()
        assert mgr.all_steps() == [5]
        assert mgr.retired_steps() == []
    assert sorted(os.listdir(tmp_path)) == ["0000000005", "LOCK"]
    assert_trees_equal(tensorstash.restore(step_dir(tmp_path, 5)), trees[5])


def test_overwriting_a_step_other_steps_refer_to_is_refused_naming_them(tmp_path):
    rng = np.random.default_rng(6)
    first, second = lora_like(rng, 1), lora_like(rng, 2)
    with tensorstash.CheckpointManager(tmp_path, incremental=True, chunk_bytes=CHUNK,
                                       sync=False) as mgr:
        mgr.save(1, first)
        mgr.save(2, second)
    with pytest.raises(ValueError, match="0000000002") as e:
        tensorstash.save(step_dir(tmp_path, 1), second, overwrite=True, chunk_bytes=CHUNK)
    assert "cannot be overwritten" in str(e.value)
    assert_trees_equal(tensorstash.restore(step_dir(tmp_path, 2)), second)
    assert_trees_equal(tensorstash.restore(step_dir(tmp_path, 1)), first)
    # The newest step, which nothing refers to, may be replaced.
    tensorstash.save(step_dir(tmp_path, 2), first, overwrite=True, chunk_bytes=CHUNK)
    assert_trees_equal(tensorstash.restore(step_dir(tmp_path, 2)), first)


def test_gc_removes_a_retired_step_only_once_nothing_refers_to_it(tmp_path):
    import subprocess

    from tshelpers import cli_path

    rng = np.random.default_rng(7)
    trees = {step: lora_like(rng, step) for step in (1, 2, 3)}
    with tensorstash.CheckpointManager(tmp_path, max_to_keep=2, incremental=True,
                                       chunk_bytes=CHUNK, sync=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, trees[step])
    listing = subprocess.run([cli_path(), "ls", str(tmp_path)], capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    assert any(line.startswith("0000000001") and "retired" in line
               for line in listing.stdout.splitlines()), listing.stdout
    gc = subprocess.run([cli_path(), "gc", "--min-age", "0", str(tmp_path)], capture_output=True,
                        text=True)
    assert gc.returncode == 0, gc.stderr
    assert os.path.isdir(step_dir(tmp_path, 1)), "gc removed the base of kept steps"
    for step in (2, 3):
        assert_trees_equal(tensorstash.restore(step_dir(tmp_path, step)), trees[step])
    # The steps that referred to it are deleted (by hand here): gc removes step 1 too.
    import shutil

    for step in (3, 2):
        os.remove(os.path.join(step_dir(tmp_path, step), "COMMIT"))
        shutil.rmtree(step_dir(tmp_path, step))
    gc = subprocess.run([cli_path(), "gc", "--min-age", "0", str(tmp_path)], capture_output=True,
                        text=True)
    assert gc.returncode == 0, gc.stderr
    assert not os.path.exists(step_dir(tmp_path, 1))
    assert "0000000001" in gc.stdout


def test_ls_shows_owned_and_borrowed_bytes_and_materialize_makes_a_self_contained_copy(tmp_path):
    import json
    import shutil
    import subprocess

    from tshelpers import cli_path

    rng = np.random.default_rng(8)
    trees = {step: lora_like(rng, step) for step in (1, 2)}
    root = tmp_path / "run"
    with tensorstash.CheckpointManager(root, incremental=True, chunk_bytes=CHUNK,
                                       sync=False) as mgr:
        for step in (1, 2):
            mgr.save(step, trees[step], metadata={"step": step}, metrics={"loss": 1.0 / step})
    listing = subprocess.run([cli_path(), "ls", str(root)], capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line for line in listing.stdout.splitlines()[1:]}
    assert "OWNED" in listing.stdout.splitlines()[0] and "BORROWED" in listing.stdout.splitlines()[0]
    # Step 2 borrows the frozen model (4 x (256 x 256 + 256) float32 = 1.0 MiB) from step 1.
    assert rows["0000000002"].split()[-1] == "0000000001", rows["0000000002"]
    assert "1.00 MiB" in rows["0000000002"], rows["0000000002"]
    assert rows["0000000001"].split()[-1] == "-", rows["0000000001"]

    copy = str(tmp_path / "elsewhere" / "0000000002")
    done = subprocess.run([cli_path(), "convert", "--materialize", step_dir(root, 2), copy],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    shown = json.loads(subprocess.run([cli_path(), "inspect", "--json", copy],
                                      capture_output=True, text=True).stdout)
    assert shown["depends_on"] == [] and shown["borrowed_bytes"] == 0
    shutil.rmtree(root)  # the bases are gone: the copy restores alone
    assert_trees_equal(tensorstash.restore(copy), trees[2])
    assert subprocess.run([cli_path(), "verify", copy], capture_output=True).returncode == 0
    with tensorstash.CheckpointManager(tmp_path / "elsewhere") as mgr:
        assert mgr.all_steps() == [2]
        assert mgr.metadata(2) == {"step": 2}
    # Only a tensorstash step can be materialized, and only as one.
    bad = subprocess.run([cli_path(), "convert", "--materialize", "--to", "orbax", copy,
                          str(tmp_path / "x")], capture_output=True, text=True)
    assert bad.returncode != 0 and "--materialize" in bad.stderr


def jax_lora_like(adapter_seed: int, frozen=None) -> dict:
    """lora_like as jax.Arrays, the frozen part `frozen` (jax.Arrays of an earlier state) when
    given, else made afresh (new buffers, equal values)."""
    import jax.numpy as jnp
    tree = lora_like(np.random.default_rng(0), adapter_seed)
    if frozen is None:
        # + 0 makes buffers of XLA's own, not adopted from the NumPy arrays.
        frozen = {k: {n: jnp.asarray(v) + 0 for n, v in layer.items()}
                  for k, layer in tree["base"].items()}
    return {"base": frozen,
            "lora": {k: {n: jnp.asarray(v) for n, v in layer.items()}
                     for k, layer in tree["lora"].items()},
            "step": tree["step"]}


FROZEN_CHUNKS = 4 * (4 + 1)  # each layer: w of 256 KiB in 64 KiB chunks, and b


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_references_jax_arrays_saved_again_from_the_same_buffers_without_hashing(
        tmp_path, async_save):
    saved: list[tensorstash.SaveStats] = []
    first = jax_lora_like(1)
    trees = {1: first, 2: jax_lora_like(2, first["base"]), 3: jax_lora_like(3)}
    with tensorstash.CheckpointManager(tmp_path, incremental=True, chunk_bytes=CHUNK, sync=False,
                                       async_save=async_save, copy_host_jax_arrays=False,
                                       on_save=saved.append) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, trees[step])
        mgr.wait_until_finished()
        by_step = {s.step: s for s in saved}
        assert by_step[1].referenced_chunks == 0
        # Step 2: the same frozen jax.Arrays as step 1's, referenced without hashing.
        assert by_step[2].unhashed_chunks == FROZEN_CHUNKS
        assert by_step[2].referenced_chunks == FROZEN_CHUNKS
        # Step 3: equal values in other buffers: found equal by hashing.
        assert by_step[3].unhashed_chunks == 0
        assert by_step[3].referenced_chunks == FROZEN_CHUNKS
        for step in (1, 2, 3):
            assert_trees_equal(mgr.restore(step), trees[step])


def test_manager_hashes_when_the_base_is_not_the_save_the_arrays_were_recorded_for(tmp_path):
    saved: list[tensorstash.SaveStats] = []
    first = jax_lora_like(1)
    with tensorstash.CheckpointManager(tmp_path, incremental=True, chunk_bytes=CHUNK, sync=False,
                                       async_save=False, copy_host_jax_arrays=False,
                                       on_save=saved.append) as mgr:
        mgr.save(1, first)
        mgr.save(3, jax_lora_like(3, first["base"]))
        # Step 2's base is step 1, not step 3 (the save its arrays were last seen in).
        mgr.save(2, jax_lora_like(2, first["base"]))
        assert [(s.step, s.unhashed_chunks) for s in saved] == [(1, 0), (3, FROZEN_CHUNKS), (2, 0)]
        assert saved[2].referenced_chunks == FROZEN_CHUNKS


def test_manager_hashes_host_jax_arrays_that_may_share_memory_with_numpy(tmp_path):
    # By default a jax.Array on a CPU device may be a NumPy array's memory, changed since.
    import jax
    saved: list[tensorstash.SaveStats] = []
    frozen_np = np.arange(CHUNK // 4 * 2, dtype=np.float32)
    frozen = jax.device_put(frozen_np)
    with tensorstash.CheckpointManager(tmp_path, incremental=True, chunk_bytes=CHUNK, sync=False,
                                       async_save=False, on_save=saved.append) as mgr:
        mgr.save(1, {"frozen": frozen, "n": np.arange(3)})
        frozen_np[0] = -1.0  # may show through `frozen` (XLA's CPU client adopts the memory)
        mgr.save(2, {"frozen": frozen, "n": np.arange(3)})
        assert saved[1].unhashed_chunks == 0
        np.testing.assert_array_equal(mgr.restore(2)["frozen"], np.asarray(frozen))


def test_an_array_freed_since_is_hashed_even_if_a_new_one_has_its_buffer(tmp_path):
    import gc
    import jax.numpy as jnp
    saved: list[tensorstash.SaveStats] = []
    with tensorstash.CheckpointManager(tmp_path, incremental=True, chunk_bytes=CHUNK, sync=False,
                                       async_save=False, copy_host_jax_arrays=False,
                                       on_save=saved.append) as mgr:
        old = jnp.zeros(CHUNK // 4, jnp.float32) + 1
        mgr.save(1, {"w": old})
        del old
        gc.collect()
        new = jnp.zeros(CHUNK // 4, jnp.float32) + 2  # may reuse the freed buffer
        mgr.save(2, {"w": new})
        assert saved[1].unhashed_chunks == 0
        assert saved[1].referenced_chunks == 0
        np.testing.assert_array_equal(mgr.restore(2)["w"], np.full(CHUNK // 4, 2, np.float32))
        # A deleted (e.g. donated) array's buffers are gone too.
        kept = jnp.zeros(CHUNK // 4, jnp.float32) + 3
        mgr.save(3, {"w": kept})
        same = kept + 0
        kept.delete()
        mgr.save(4, {"w": same})
        assert saved[3].unhashed_chunks == 0
        assert saved[3].referenced_chunks == 1  # equal bytes, found by hashing


def test_materialize_makes_a_self_contained_copy_keeping_codecs_and_files(tmp_path):
    import shutil
    rng = np.random.default_rng(9)
    trees = {step: lora_like(rng, step) for step in (1, 2)}
    root = tmp_path / "run"
    with tensorstash.CheckpointManager(root, incremental=True, chunk_bytes=CHUNK, sync=False,
                                       codec="zstd") as mgr:
        for step in (1, 2):
            mgr.save(step, trees[step], metadata={"step": step}, per_process={"pos": step})
    copy = str(tmp_path / "elsewhere" / "0000000002")
    tensorstash.materialize(step_dir(root, 2), copy)
    with pytest.raises(FileExistsError):
        tensorstash.materialize(step_dir(root, 2), copy)
    tensorstash.materialize(step_dir(root, 2), copy, overwrite=True)
    meta = tensorstash.metadata(copy)
    shutil.rmtree(root)  # the bases are gone: the copy restores alone
    assert_trees_equal(tensorstash.restore(copy), trees[2])
    with tensorstash.CheckpointManager(tmp_path / "elsewhere") as mgr:
        assert mgr.metadata(2) == {"step": 2}
        assert mgr.per_process(2) == {"pos": 2}
    assert meta is not None
    with pytest.raises(FileNotFoundError):
        tensorstash.materialize(step_dir(root, 2), str(tmp_path / "x" / "0000000002"))


def test_materialize_of_a_step_whose_base_file_is_gone_fails_naming_it(tmp_path):
    rng = np.random.default_rng(10)
    root = tmp_path / "run"
    with tensorstash.CheckpointManager(root, incremental=True, chunk_bytes=CHUNK,
                                       sync=False) as mgr:
        for step in (1, 2):
            mgr.save(step, lora_like(rng, step))
    data = os.path.join(step_dir(root, 1), "state", "data")
    for name in os.listdir(data):
        os.remove(os.path.join(data, name))
    dst = str(tmp_path / "copy" / "0000000002")
    with pytest.raises(OSError, match="0000000001"):
        tensorstash.materialize(step_dir(root, 2), dst)
    assert not os.path.exists(os.path.join(dst, "COMMIT"))


@pytest.mark.parametrize("damage", ["data file removed", "COMMIT unreadable"])
def test_manager_saves_in_full_with_a_warning_when_its_base_cannot_be_opened(
        tmp_path, caplog, damage):
    import logging
    rng = np.random.default_rng(11)
    trees = {step: lora_like(rng, step) for step in (1, 2, 3)}
    saved: list[tensorstash.SaveStats] = []
    with tensorstash.CheckpointManager(tmp_path, incremental=True, chunk_bytes=CHUNK, sync=False,
                                       on_save=saved.append) as mgr:
        mgr.save(1, trees[1])
        mgr.wait_until_finished()
        if damage == "data file removed":
            data = os.path.join(step_dir(tmp_path, 1), "state", "data")
            os.remove(os.path.join(data, sorted(os.listdir(data))[0]))
        else:
            with open(os.path.join(step_dir(tmp_path, 1), "COMMIT"), "w") as f:
                f.write("{not json")
        with caplog.at_level(logging.WARNING, logger="tensorstash"):
            mgr.save(2, trees[2])
            mgr.wait_until_finished()
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("saved in full" in m and "0000000001" in m for m in warned), warned
        assert saved[-1].referenced_chunks == 0
        assert depends_on(tmp_path, 2) == []
        assert_trees_equal(mgr.restore(2), trees[2])
        mgr.save(3, trees[3])  # against step 2 again
        mgr.wait_until_finished()
        assert depends_on(tmp_path, 3) == ["0000000002"]
        assert_trees_equal(mgr.restore(3), trees[3])
    # A one-off save against such a base fails, naming it.
    with pytest.raises(OSError, match="0000000001"):
        tensorstash.save(step_dir(tmp_path, 4), trees[3], base=step_dir(tmp_path, 1))


def test_one_off_save_against_a_base_this_process_saved_skips_hashing_its_arrays(
        tmp_path, monkeypatch):
    # On CPU devices jax.Arrays are host memory, never trusted by a one-off save; as if they
    # were off the host (where nothing but JAX can change their buffers):
    from tensorstash import jax as tjax
    shards_of = tjax.JaxAdapter.save_shards
    monkeypatch.setattr(tjax.JaxAdapter, "save_shards",
                        lambda self, x, *a: (*shards_of(self, x, *a)[:2], True))
    first = jax_lora_like(1)
    second = jax_lora_like(2, first["base"])
    s1, s2, s3 = (str(tmp_path / f"000000000{i}") for i in (1, 2, 3))
    tensorstash.save(s1, first, chunk_bytes=CHUNK, record_digests=True, sync=False)
    stats = tensorstash.save(s2, second, chunk_bytes=CHUNK, base=s1, sync=False)
    assert stats["unhashed_chunks"] == FROZEN_CHUNKS
    assert stats["referenced_chunks"] == FROZEN_CHUNKS
    assert_trees_equal(tensorstash.restore(s2), second)
    # Step 1 saved again from other arrays (equal values): the record is of that save now.
    __import__("shutil").rmtree(s2)
    tensorstash.save(s1, jax_lora_like(3), chunk_bytes=CHUNK, record_digests=True, sync=False,
                     overwrite=True)
    stats = tensorstash.save(s3, second, chunk_bytes=CHUNK, base=s1, sync=False)
    assert stats["unhashed_chunks"] == 0
    assert stats["referenced_chunks"] == FROZEN_CHUNKS  # equal bytes, found by hashing
    # A base written by someone else (not recorded here) is hashed.
    other = str(tmp_path / "other")
    os.makedirs(other)
    tensorstash.save(os.path.join(other, "0000000001"), first, chunk_bytes=CHUNK,
                     record_digests=True, sync=False)
    __import__("shutil").copytree(s1, os.path.join(other, "0000000002"))
    stats = tensorstash.save(os.path.join(other, "0000000003"), second, chunk_bytes=CHUNK,
                             base=os.path.join(other, "0000000002"), sync=False)
    assert stats["unhashed_chunks"] == 0
    assert stats["referenced_chunks"] == FROZEN_CHUNKS
