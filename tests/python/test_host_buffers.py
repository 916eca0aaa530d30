"""The host memory restores read into (tensorstash.numpy.empty_aligned): from 4 MiB up it is
mapped by the engine for each buffer (page-aligned, never advised into transparent huge pages,
unmapped when the last array over it dies); smaller buffers come from NumPy, 64-byte aligned.
Either way JAX's CPU client adopts them as device buffers without a copy."""

from __future__ import annotations

import gc
import mmap

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import tensorstash
import tensorstash.numpy as tnp
from tshelpers import assert_same_array, mesh, pattern

MiB = 1 << 20


def mappings_over(address: int, nbytes: int = 1) -> list[dict]:
    """The /proc/self/smaps entries overlapping [address, address + nbytes): each one's range and
    VmFlags (NumPy's huge-page advice splits its allocations into several)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    found = []
    for i, line in enumerate(lines):
        head = line.split(maxsplit=1)[0]
        if "-" not in head or ":" in head:
            continue
        start, end = (int(x, 16) for x in head.split("-"))
        if start < address + nbytes and address < end:
            flags = next((f.split()[1:] for f in lines[i + 1:] if f.startswith("VmFlags:")), None)
            assert flags is not None, f"no VmFlags for the mapping at {start:#x}"
            found.append({"start": start, "end": end, "flags": flags})
    return found


def huge_page_advised(a: np.ndarray) -> bool:
    """Whether any of `a`'s memory is advised into transparent huge pages ("hg")."""
    return any("hg" in m["flags"] for m in mappings_over(a.ctypes.data, a.nbytes))


def test_large_buffers_are_mapped_page_aligned_and_not_huge_page_advised():
    a = tnp.empty_aligned((8, 256, 1024), np.float32)  # 8 MiB
    assert a.shape == (8, 256, 1024) and a.dtype == np.float32
    assert a.flags.writeable and a.flags.c_contiguous
    address = a.ctypes.data
    assert address % mmap.PAGESIZE == 0
    # One mapping, of its own, with no huge-page advice (NumPy advises its own allocations of
    # 4 MiB and more).
    assert len(mappings_over(address, a.nbytes)) == 1
    assert not huge_page_advised(a)
    a[...] = 1.5
    a[3, 7, 9] = 2.5
    assert float(a.sum(dtype=np.float64)) == 1.5 * a.size + 1.0


def test_large_buffer_lives_as_long_as_any_array_over_it():
    a = tnp.empty_aligned((4 * MiB,), ml_dtypes.bfloat16)  # 8 MiB
    address = a.ctypes.data
    view = a[1000:].view(np.uint16)
    del a
    gc.collect()
    assert mappings_over(address)  # the view still holds it
    view[:] = 7
    assert int(view[-1]) == 7
    del view
    gc.collect()
    # Freed: kept for reuse (util/staging_buffer.h) until given back, then unmapped. Had the
    # view still held it, it would not be among the kept ones and would stay mapped.
    assert tensorstash._ext.kept_freed_bytes() >= 8 * MiB
    tensorstash._ext.release_kept_buffers()
    assert tensorstash._ext.kept_freed_bytes() == 0
    assert not mappings_over(address)


def test_small_buffers_are_64_byte_aligned():
    for shape, dtype in (((3,), np.int8), ((1000, 3), np.float64), ((), np.complex64),
                         ((0, 5), np.float32), ((1023, 1024), np.float32)):
        a = tnp.empty_aligned(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.writeable
        if a.size:  # an empty array has no data to align
            assert a.ctypes.data % 64 == 0, (shape, dtype)


def test_host_buffer_sizes():
    assert tensorstash._ext.host_buffer(0).shape == (0,)
    b = tensorstash._ext.host_buffer(5 * MiB + 3)
    assert b.shape == (5 * MiB + 3,) and b.dtype == np.uint8 and b.flags.writeable
    b[-1] = 9
    assert int(b[-1]) == 9


def test_restores_read_into_engine_memory_and_jax_adopts_it(tmp_path):
    tree = {"w": pattern((2048, 1024), np.float32, seed=1),          # 8 MiB
            "b": pattern((1024, 2048), ml_dtypes.bfloat16, seed=2),  # 4 MiB
            "small": pattern((64, 64), np.float32, seed=3)}
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, tree)

    # NumPy targets, read (not mapped from the files): each large array is its own mapping.
    got = tensorstash.restore(path, mmap=False)
    for name in tree:
        assert_same_array(got[name], tree[name], name)
    for name in ("w", "b"):
        assert got[name].ctypes.data % mmap.PAGESIZE == 0, name
        assert not huge_page_advised(got[name]), name

    # JAX on a 2x4 mesh of CPU devices: "w" replicated (its one 8 MiB buffer is engine memory),
    # the blocks of "b" (512 KiB) and "small" are NumPy memory.
    m = mesh((2, 4), ("a", "b"))
    target = {"w": jax.ShapeDtypeStruct((2048, 1024), np.float32,
                                        sharding=NamedSharding(m, P())),
              "b": jax.ShapeDtypeStruct((1024, 2048), ml_dtypes.bfloat16,
                                        sharding=NamedSharding(m, P("a", "b"))),
              "small": jax.ShapeDtypeStruct((64, 64), np.float32,
                                            sharding=NamedSharding(m, P("a")))}
    out = tensorstash.restore(path, target=target, mmap=False)
    for name in tree:
        assert_same_array(np.asarray(out[name]), tree[name], name)
    for shard in out["w"].addressable_shards:
        pointer = shard.data.unsafe_buffer_pointer()
        # Page-aligned and in a mapping of its own: the device holds the engine's buffer itself,
        # not a copy in XLA's allocations.
        assert pointer % mmap.PAGESIZE == 0
        assert not any("hg" in m["flags"] for m in mappings_over(pointer, 8 * MiB))

