"""Restores that map large boxes copy-on-write from the data files (restore(mmap=True), the
default) instead of reading them into fresh memory."""

from __future__ import annotations

import gc
import os
import shutil

import jax
import numpy as np
import pytest

import tensorstash
from tshelpers import assert_jax_array, assert_same_array, global_array, mesh, named, pattern


def mapped_files(root: str) -> set[str]:
    """Files under `root` that this process has mapped now (from /proc/self/maps)."""
    root = os.path.realpath(root)
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().startswith(root):
                found.add(parts[5].strip())
    return found


def save_big(tmp_path, **kwargs) -> tuple[str, dict]:
    tree = {"w": pattern((1024, 512), np.float32, seed=3),   # 2 MiB: mapped
            "v": pattern((512, 1024), np.float64, seed=4),   # 4 MiB: mapped
            "small": pattern((16, 16), np.float32, seed=5)}  # read
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, tree, **kwargs)
    return path, tree


def test_large_arrays_are_mapped_from_the_files_and_equal_a_read(tmp_path):
    path, tree = save_big(tmp_path)
    mapped = tensorstash.restore(path)
    assert mapped_files(path), "no data file of the checkpoint is mapped"
    read = tensorstash.restore(path, mmap=False)
    for name, want in tree.items():
        assert_same_array(mapped[name], want, name)
        assert_same_array(read[name], want, name)
    del mapped
    gc.collect()
    assert not mapped_files(path), "the mappings outlive the arrays"


def test_mapped_arrays_are_private_and_outlive_the_checkpoint(tmp_path):
    path, tree = save_big(tmp_path)
    got = tensorstash.restore(path, target={"w": np.zeros((1024, 512), np.float32)})
    assert mapped_files(path)
    got["w"][:10] = -1  # copy-on-write: the checkpoint is untouched
    assert_same_array(tensorstash.restore(path, mmap=False)["w"], tree["w"], "w")
    shutil.rmtree(path)  # deleted (not truncated): the mapped pages stay readable
    assert np.all(got["w"][:10] == -1)
    assert np.array_equal(got["w"][10:], tree["w"][10:])


def test_sharded_jax_targets_map_each_device_box(tmp_path):
    m = mesh((2, 4))
    w = pattern((2048, 1024), np.float32, seed=8)  # 8 MiB: 1 MiB per device
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, {"w": global_array(w, named(m, "a", "b"))}, chunk_bytes=1 << 20)
    # Saved on 2x4 and restored on 2x4: every device box is one stored chunk.
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=named(m, "a", "b"))}
    got = tensorstash.restore(path, target)
    assert mapped_files(path)
    gc.collect()
    assert_jax_array(got["w"], w, named(m, "a", "b"), "w")
    # Another mesh: boxes that are not runs of whole chunks are read; the result is the same.
    other = named(mesh((4, 2)), "b", "a")
    got = tensorstash.restore(path, {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=other)})
    assert_jax_array(got["w"], w, other, "w")


@pytest.mark.parametrize("kwargs", [{"codec": "zstd"}, {}])
def test_compressed_or_cast_arrays_are_read(tmp_path, kwargs):
    path, tree = save_big(tmp_path, **kwargs)
    if kwargs:
        got = tensorstash.restore(path)
        want = tree["w"]
    else:  # a cast to float64 cannot be mapped
        got = tensorstash.restore(path, target={"w": np.zeros((1024, 512), np.float64)})
        want = tree["w"].astype(np.float64)
    assert not mapped_files(path)
    assert_same_array(got["w"], want, "w")


def test_a_corrupt_mapped_chunk_is_an_oserror_naming_the_array(tmp_path):
    path, _ = save_big(tmp_path)
    data = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".dat")]
    assert data
    for file in data:
        with open(file, "r+b") as f:
            size = os.path.getsize(file)
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(OSError, match="CRC-32C mismatch.*array '(w|v)'"):
        tensorstash.restore(path)
