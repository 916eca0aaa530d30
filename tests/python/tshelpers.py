"""Shared helpers of the tensorstash Python tests: dtypes, deterministic data, bit-exact
comparisons, and a reader of the on-disk index (docs/format.md section 6) to damage chosen
chunks."""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli_path() -> str:
    """The tensorstash command the tests run: $TENSORSTASH_CLI, or <repo>/build/tensorstash.
    Fails the test (never skips it) when it is missing."""
    import pytest  # here: the workers import this module without pytest's plugins

    path = os.environ.get("TENSORSTASH_CLI", os.path.join(REPO, "build", "tensorstash"))
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: build the tensorstash target, or set TENSORSTASH_CLI")
    return path


DTYPE_NAMES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2",
)


def dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


ALL_DTYPES = tuple(dtype(n) for n in DTYPE_NAMES)


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dt) -> np.ndarray:
    """An array of random bit patterns (NaNs with payloads, infs, subnormals included); bools
    are 0 or 1."""
    dt = np.dtype(dt)
    n = math.prod(shape)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def pattern(shape: tuple[int, ...], dt, seed: int = 0) -> np.ndarray:
    """Deterministic, position-dependent values (the same in every process) of dtype `dt`."""
    dt = np.dtype(dt)
    n = math.prod(shape)
    idx = np.arange(n, dtype=np.uint64)
    # A multiplicative hash of the flat index: every element differs from its neighbours.
    h = (idx + np.uint64(seed * 1_000_003 + 1)) * np.uint64(0x9E3779B97F4A7C15)
    h ^= h >> np.uint64(29)
    if dt == np.bool_:
        return (h & np.uint64(1)).astype(np.bool_).reshape(shape)
    if dt.kind in "iu":
        return h.view(np.uint8).reshape(n, 8)[:, :dt.itemsize].copy().view(dt).reshape(shape)
    # Floats: small integers and halves, exact in every float format (even float8).
    vals = ((h % np.uint64(31)).astype(np.int64) - 15).astype(np.float64) / 2
    if dt.kind == "c":
        vals = vals + 1j * (((h >> np.uint64(8)) % np.uint64(31)).astype(np.float64) - 15)
    return vals.astype(dt).reshape(shape)


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def assert_same_array(got: Any, want: np.ndarray, what: str = "") -> None:
    """`got` is an np.ndarray with `want`'s dtype, shape and bytes (NaN payloads included)."""
    assert isinstance(got, np.ndarray), f"{what}: {type(got).__name__} is not an np.ndarray"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if bits(got) != bits(want):
        g = np.ascontiguousarray(got).reshape(-1).view(np.uint8)
        w = np.ascontiguousarray(want).reshape(-1).view(np.uint8)
        bad = np.flatnonzero(g != w)
        raise AssertionError(f"{what}: {bad.size} of {w.size} bytes differ, first at byte {bad[0]}")


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_same_tree(got: Any, want: Any, path: str = "") -> None:
    """Structure and types identical (dict vs dict, tuple vs tuple, key order too), arrays bit
    for bit, scalars equal with their exact types (floats bit for bit, NaN sign included)."""
    where = path or "<root>"
    if isinstance(want, np.ndarray):
        assert_same_array(got, want, where)
        return
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got.keys()) == list(want.keys()), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same_tree(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_tree(g, w, f"{path}/{i}")
    elif isinstance(want, float):
        assert _float_bits(got) == _float_bits(want), f"{where}: {got!r} != {want!r} (bits)"
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def assert_restored_numpy(got: Any, want: Any, where: str = "", *, key_order: bool = True) -> None:
    """restore() of an Orbax checkpoint without a target: dicts stay dicts (their keys in want's
    order, or only the same keys unless `key_order`), tuples come back as lists (Orbax does not
    record the difference), arrays bit for bit, Python scalars as values (NumPy scalars as
    Python ones: Orbax saves them as "scalar" leaves too)."""
    if isinstance(want, dict):
        keys = list if key_order else sorted
        assert isinstance(got, dict) and keys(got) == keys(want), f"{where}: {got!r}"
        for k in want:
            assert_restored_numpy(got[k], want[k], f"{where}/{k}", key_order=key_order)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_restored_numpy(g, w, f"{where}/{i}", key_order=key_order)
    elif want is None:
        assert got is None, where
    elif isinstance(want, (int, float, str)):
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"
    elif isinstance(want, np.generic):
        assert type(got) is type(want.item()) and got == want.item(), f"{where}: {got!r}"
    else:
        assert_same_array(got, np.asarray(want), where)


# --- the on-disk index -------------------------------------------------------------------------

def read_tree_json(step: str) -> dict:
    with open(os.path.join(step, "state", "tree.json"), encoding="utf-8") as f:
        return json.load(f)


def read_index(step: str) -> list[dict]:
    """The index entries of a step: dicts with path (array), chunk, file (absolute), offset,
    length."""
    arrays = [a["path"] for a in read_tree_json(step)["arrays"]]
    with open(os.path.join(step, "state", "index"), "rb") as f:
        data = f.read()
    assert data[:8] == b"TSINDEX\0", "not an index"
    num_files, = struct.unpack_from("<I", data, 16)
    num_entries, = struct.unpack_from("<Q", data, 24)
    pos, files = 32, []
    for _ in range(num_files):
        n, = struct.unpack_from("<H", data, pos)
        files.append(data[pos + 2:pos + 2 + n].decode())
        pos += 2 + n + 8
    entries = []
    for _ in range(num_entries):
        array_id, file_id, chunk, offset, length, _crc = struct.unpack_from("<IIQQQI", data, pos)
        entries.append(dict(path=arrays[array_id], chunk=chunk,
                            file=os.path.join(step, "state", files[file_id]), offset=offset,
                            length=length))
        pos += 40
    return entries


def data_files(step: str) -> list[str]:
    folder = os.path.join(step, "state", "data")
    return sorted(os.path.join(folder, f) for f in os.listdir(folder))


def flip_byte(step: str, array_path: str, chunk_pos: int = 0, byte: int | None = None) -> dict:
    """Flips one byte (the middle one unless `byte`) of the `chunk_pos`-th stored chunk of
    `array_path`; returns that chunk's index entry."""
    entries = [e for e in read_index(step) if e["path"] == array_path]
    assert entries, f"no stored chunk of {array_path!r}"
    e = entries[chunk_pos]
    at = e["offset"] + (e["length"] // 2 if byte is None else byte)
    with open(e["file"], "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))
    return e


# --- JAX ----------------------------------------------------------------------------------------

def mesh(shape: tuple[int, ...], names: tuple[str, ...] = ("a", "b", "c"), devices=None):
    import jax
    devices = list(jax.devices() if devices is None else devices)
    n = math.prod(shape)
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), names[:len(shape)])


def named(m, *spec):
    import jax
    return jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec(*spec))


def global_array(values: np.ndarray, sharding):
    """A jax.Array with `sharding` holding `values` (each device gets its block)."""
    import jax
    return jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])


def assert_jax_array(got: Any, want: np.ndarray, sharding, what: str = "") -> None:
    """`got` is a jax.Array with `sharding`, `want`'s dtype and shape, and every addressable
    shard holds `want`'s block bit for bit."""
    import jax
    assert isinstance(got, jax.Array), f"{what}: {type(got).__name__} is not a jax.Array"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.sharding == sharding, f"{what}: sharding {got.sharding} != {sharding}"
    expected = sharding.addressable_devices_indices_map(want.shape)
    shards = got.addressable_shards
    assert {s.device for s in shards} == set(expected), f"{what}: devices differ"
    for s in shards:
        block = want[expected[s.device]]
        data = np.asarray(s.data)
        assert data.shape == block.shape, f"{what}: shard on {s.device}: {data.shape} != {block.shape}"
        assert_same_array(data, np.ascontiguousarray(block).reshape(block.shape),
                          f"{what} (shard on {s.device})")


def record_read_stats(tensorstash, setattr_fn=setattr):
    """Records the engine statistics of every restore_to_host call (one per restore) that
    tensorstash.restore makes: bytes_read, direct/staged chunks, peak staging, mapped_bytes,
    batches, read_calls.

    Wraps the readers that tensorstash._restore opens, so that each call's stats are appended to
    the returned list. `setattr_fn` lets pytest pass monkeypatch.setattr, which undoes the wrap
    afterwards."""
    calls = []
    module = tensorstash._restore
    real_open = module._open

    class Recorder:
        def __init__(self, reader):
            self._reader = reader

        def __getattr__(self, name):
            return getattr(self._reader, name)

        def restore_to_host(self, *args, **kwargs):
            stats = self._reader.restore_to_host(*args, **kwargs)
            calls.append(stats)
            return stats

    setattr_fn(module, "_open", lambda *a, **k: Recorder(real_open(*a, **k)))
    return calls
