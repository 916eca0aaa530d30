"""zarr interop: tensorstash's zarr reader/writer (through tests/tools/zarr_tool) against the real
libraries, compared bit for bit.

- TensorStore (zarr3 and zarr drivers), zarr-python (v2 with blosc: the "seed layout" of a zarr
  group per step with a write_completed attribute; v3 sharded) and Orbax write; zarr_tool reads.
- zarr_tool writes zarr3 (sharded the way Orbax does, and unsharded) and zarr v2; TensorStore and
  zarr-python read.

Needs tensorstore, zarr (3.x), numcodecs, numpy, ml_dtypes, and orbax-checkpoint + jax for the
Orbax case; a missing package fails the module (never a skip). zarr_tool is found at
$TS_ZARR_TOOL or <repo>/build/tests/zarr_tool.
"""

from __future__ import annotations

import json
import os
import subprocess

import ml_dtypes
import numcodecs
import numpy as np
import pytest
import tensorstore as ts
import zarr

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TOOL = os.environ.get("TS_ZARR_TOOL", os.path.join(REPO, "build", "tests", "zarr_tool"))

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
          "float8_e4m3fn", "float8_e5m2"]


def np_dtype(name: str) -> np.dtype:
    if hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def random_array(name: str, shape, seed: int = 0) -> np.ndarray:
    """Random bits (every float pattern, NaNs included) of dtype `name`; bool as 0/1."""
    rng = np.random.default_rng(seed)
    dt = np_dtype(name)
    n = int(np.prod(shape, dtype=np.int64))
    if name == "bool":
        return (rng.integers(0, 2, size=n) == 1).reshape(shape)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def tool(*args: str) -> subprocess.CompletedProcess:
    if not os.path.exists(TOOL):
        pytest.fail(f"zarr_tool not built at {TOOL} (cmake --build build --target zarr_tool)")
    return subprocess.run([TOOL, *args], capture_output=True, text=True, check=False)


def tool_read(root: str, prefix: str, tmp_path) -> tuple[dict, bytes]:
    out = os.path.join(str(tmp_path), "out.raw")
    r = tool("read", root, prefix, out)
    assert r.returncode == 0, r.stderr
    with open(out, "rb") as f:
        return json.loads(r.stdout), f.read()


def assert_tool_reads(root: str, prefix: str, expected: np.ndarray, dtype_name: str, tmp_path,
                      **meta):
    info, data = tool_read(root, prefix, tmp_path)
    assert info["dtype"] == dtype_name
    assert info["shape"] == list(expected.shape)
    for key, value in meta.items():
        assert info[key] == value, (key, info)
    assert data == np.ascontiguousarray(expected).tobytes()  # native = little-endian here


def ts_write(path: str, driver: str, metadata: dict, array: np.ndarray, region=None):
    store = ts.open({"driver": driver, "kvstore": {"driver": "file", "path": path},
                     "metadata": metadata, "create": True, "delete_existing": True}).result()
    if region is None:
        store.write(array).result()
    else:
        store[region].write(array).result()
    return store


def ts_read(path: str, driver: str) -> np.ndarray:
    return ts.open({"driver": driver, "kvstore": {"driver": "file", "path": path},
                    "open": True}).result().read().result()


def zarr3_meta(dtype, shape, chunks, codecs, fill=None, encoding=None):
    if fill is None:
        fill = False if dtype == "bool" else [0, 0] if dtype.startswith("complex") else 0
    meta = {"data_type": dtype, "shape": list(shape),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "codecs": codecs, "fill_value": fill}
    if encoding is not None:
        meta["chunk_key_encoding"] = encoding
    return meta


def sharding(inner, codecs, index_location="end"):
    return {"name": "sharding_indexed",
            "configuration": {"chunk_shape": list(inner), "codecs": codecs,
                              "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                               {"name": "crc32c"}],
                              "index_location": index_location}}


BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
ZSTD = {"name": "zstd", "configuration": {"level": 3, "checksum": False}}


# ---- TensorStore writes, zarr_tool reads ----

@pytest.mark.parametrize("dtype", DTYPES)
def test_tensorstore_zarr3_sharded_every_dtype(dtype, tmp_path):
    shape, shard, inner = (5, 7, 3), (4, 4, 2), (2, 4, 1)
    arr = random_array(dtype, shape, seed=len(dtype))
    root = str(tmp_path / "ck")
    ts_write(os.path.join(root, "params.w"), "zarr3",
             zarr3_meta(dtype, shape, shard, [sharding(inner, [BYTES, ZSTD])]), arr)
    assert_tool_reads(root, "params.w", arr, dtype, tmp_path, zarr_format=3, sharded=True,
                      chunk_shape=list(shard), inner_chunk_shape=list(inner))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int64", "complex128", "uint8"])
@pytest.mark.parametrize("codec", [
    [BYTES],
    [BYTES, {"name": "gzip", "configuration": {"level": 5}}],
    [BYTES, {"name": "blosc", "configuration": {"cname": "lz4", "clevel": 5, "shuffle": "shuffle",
                                                 "typesize": 2, "blocksize": 0}}],
    [BYTES, {"name": "blosc", "configuration": {"cname": "zstd", "clevel": 3,
                                                 "shuffle": "bitshuffle", "typesize": 4,
                                                 "blocksize": 0}}],
    [{"name": "transpose", "configuration": {"order": [1, 0]}},
     {"name": "bytes", "configuration": {"endian": "big"}}, ZSTD, {"name": "crc32c"}],
], ids=["raw", "gzip", "blosc_lz4", "blosc_zstd_bitshuffle", "transpose_big_crc"])
def test_tensorstore_zarr3_unsharded(dtype, codec, tmp_path):
    arr = random_array(dtype, (9, 11), seed=3)
    root = str(tmp_path / "ck")
    ts_write(os.path.join(root, "a"), "zarr3", zarr3_meta(dtype, (9, 11), (4, 3), codec), arr)
    assert_tool_reads(root, "a", arr, dtype, tmp_path, sharded=False)


def test_tensorstore_zarr3_missing_chunks_read_fill_value(tmp_path):
    root = str(tmp_path / "ck")
    arr = np.full((10, 10), np.nan, dtype=np.float32)
    part = random_array("float32", (3, 4), seed=5)
    arr[2:5, 6:10] = part
    # Sharded, inner chunks (2, 2): only the inner chunks meeting [2:5, 6:10] are written.
    ts_write(os.path.join(root, "s"), "zarr3",
             zarr3_meta("float32", (10, 10), (8, 8), [sharding((2, 2), [BYTES, ZSTD], "start")],
                        "NaN"), part, region=np.s_[2:5, 6:10])
    assert_tool_reads(root, "s", arr, "float32", tmp_path)
    ts_write(os.path.join(root, "p"), "zarr3",
             zarr3_meta("float32", (10, 10), (3, 3), [BYTES, ZSTD], "NaN",
                        {"name": "v2", "configuration": {"separator": "."}}), part,
             region=np.s_[2:5, 6:10])
    assert not os.path.exists(os.path.join(root, "p", "0.0"))
    assert_tool_reads(root, "p", arr, "float32", tmp_path)
    ints = np.full((7,), -3, dtype=np.int16)
    ints[1] = 42
    ts_write(os.path.join(root, "i"), "zarr3", zarr3_meta("int16", (7,), (2,), [BYTES], -3),
             ints[1:2], region=np.s_[1:2])
    assert_tool_reads(root, "i", ints, "int16", tmp_path)


def test_tensorstore_zarr3_scalar_and_empty(tmp_path):
    root = str(tmp_path / "ck")
    scalar = np.array(1234567, dtype=np.int32)
    ts_write(os.path.join(root, "step"), "zarr3",
             zarr3_meta("int32", (), (), [sharding((), [BYTES, ZSTD])]), scalar)
    assert_tool_reads(root, "step", scalar, "int32", tmp_path)
    empty = np.zeros((0, 4), dtype=np.float32)
    ts_write(os.path.join(root, "empty"), "zarr3", zarr3_meta("float32", (0, 4), (1, 4), [BYTES]),
             empty)
    assert_tool_reads(root, "empty", empty, "float32", tmp_path)


@pytest.mark.parametrize("dtype", ["<f4", ">i4", "<u8", "<f2", "|b1", "|i1", "<c8", ">c16",
                                   "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("compressor", [
    None, {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": -1},
    {"id": "zstd", "level": 1}, {"id": "zlib", "level": 4}, {"id": "gzip", "level": 4}],
    ids=["raw", "blosc", "zstd", "zlib", "gzip"])
def test_tensorstore_zarr2(dtype, compressor, tmp_path):
    name = {"<f4": "float32", ">i4": "int32", "<u8": "uint64", "<f2": "float16", "|b1": "bool",
            "|i1": "int8", "<c8": "complex64", ">c16": "complex128", "bfloat16": "bfloat16",
            "float8_e4m3fn": "float8_e4m3fn"}[dtype]
    arr = random_array(name, (6, 5), seed=9)
    root = str(tmp_path / "ck")
    for order, sep in (("C", "."), ("F", "/")):
        prefix = f"a{order}"
        ts_write(os.path.join(root, prefix), "zarr",
                 {"dtype": dtype, "shape": [6, 5], "chunks": [4, 2], "order": order,
                  "compressor": compressor, "dimension_separator": sep}, arr)
        assert_tool_reads(root, prefix, arr, name, tmp_path, zarr_format=2)


def test_zarr_python_seed_layout_v2_blosc(tmp_path):
    """A zarr v2 group per step, arrays named by pytree path, blosc, write_completed."""
    step = str(tmp_path / "0000000100")
    root = zarr.open_group(step, mode="w-", zarr_format=2)
    tree = {"['params']['w']": random_array("float32", (8, 6), 1),
            "['params']['b']": random_array("float64", (6,), 2),
            "['opt_state'][0]['count']": np.array(7, dtype=np.int32),
            "['params']['emb']": random_array("float16", (10, 3), 3)}
    for path, arr in tree.items():
        chunks = tuple(max(1, s // 2) for s in arr.shape)
        dst = root.create_array(path, shape=arr.shape, chunks=chunks, dtype=arr.dtype,
                                compressors=numcodecs.Blosc(cname="lz4", clevel=5,
                                                            shuffle=numcodecs.Blosc.SHUFFLE))
        dst[...] = arr
    root.attrs["write_completed"] = True
    assert json.load(open(os.path.join(step, ".zattrs")))["write_completed"] is True
    for path, arr in tree.items():
        with open(os.path.join(step, path, ".zarray")) as f:
            assert json.load(f)["compressor"]["id"] == "blosc"
        assert_tool_reads(step, path, arr, str(np_dtype(arr.dtype.name)), tmp_path, zarr_format=2)


def test_zarr_python_v3_sharded(tmp_path):
    path = str(tmp_path / "z3")
    arr = random_array("int32", (9, 10), 4)
    z = zarr.create_array(path, shape=arr.shape, chunks=(2, 5), shards=(4, 10), dtype=arr.dtype,
                          zarr_format=3)
    z[...] = arr
    assert_tool_reads(str(tmp_path), "z3", arr, "int32", tmp_path, sharded=True,
                      chunk_shape=[4, 10], inner_chunk_shape=[2, 5])


def test_orbax_checkpoints(tmp_path):
    """What Orbax 0.12 writes without OCDBT: a zarr folder per parameter, zarr3 or v2."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    tree = {"w": random_array("float32", (16, 12), 6),
            "b": jnp.asarray(random_array("float32", (12,), 7)).astype(jnp.bfloat16),
            "step": np.int64(12345)}
    for zarr3 in (True, False):
        directory = str(tmp_path / f"orbax_{zarr3}")
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=zarr3)
        ocp.Checkpointer(handler).save(directory, args=ocp.args.PyTreeSave(tree))
        for name, value in tree.items():
            arr = np.asarray(value)
            assert_tool_reads(directory, name, arr, str(arr.dtype), tmp_path,
                              zarr_format=3 if zarr3 else 2)


def test_orbax_ocdbt_keys(tmp_path):
    """Orbax's default (OCDBT + zarr3): the arrays are keys `w/zarr.json`, `w/c/0/0` inside the
    OCDBT database. TensorStore copies those keys into a folder and zarr_tool reads them."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import orbax.checkpoint as ocp
    tree = {"w": random_array("float32", (16, 12), 8), "v": random_array("int8", (5,), 9)}
    directory = str(tmp_path / "orbax_ocdbt")
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)
    ocp.Checkpointer(handler).save(directory, args=ocp.args.PyTreeSave(tree))
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{directory}/"}).result()
    keys = [k.decode() for k in kv.list().result()]
    assert "w/zarr.json" in keys, keys
    flat = tmp_path / "flat"
    for key in keys:
        target = flat / key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(kv.read(key).result().value)
    for name, arr in tree.items():
        assert_tool_reads(str(flat), name, arr, str(arr.dtype), tmp_path, zarr_format=3,
                          sharded=True)


# ---- zarr_tool writes, TensorStore / zarr-python read ----

def tool_write(root, prefix, arr: np.ndarray, dtype_name: str, tmp_path, *flags: str):
    src = os.path.join(str(tmp_path), "in.raw")
    with open(src, "wb") as f:
        f.write(np.ascontiguousarray(arr).tobytes())
    shape = ",".join(str(s) for s in arr.shape)
    r = tool("write", root, prefix, src, "--dtype", dtype_name, "--shape", shape, *flags)
    assert r.returncode == 0, r.stderr


def assert_same_bits(got: np.ndarray, want: np.ndarray):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_tool_zarr3_sharded_read_by_tensorstore(dtype, tmp_path):
    root = str(tmp_path / "ck")
    cases = [((13, 7), ["--chunks", "8,4"]),  # Orbax: one inner chunk per shard
             ((13, 7), ["--chunks", "8,4", "--inner", "2,2"]),
             ((3, 4, 5), ["--chunks", "2,4,5", "--inner", "1,2,5", "--compressor", "blosc"]),
             ((11,), ["--chunks", "4", "--compressor", "gzip", "--level", "9"]),
             ((), []),
             ((0, 3), [])]
    for i, (shape, flags) in enumerate(cases):
        arr = random_array(dtype, shape, seed=i)
        prefix = f"params.p{i}"
        tool_write(root, prefix, arr, dtype, tmp_path, *flags)
        meta = json.load(open(os.path.join(root, prefix, "zarr.json")))
        assert meta["codecs"][0]["name"] == "sharding_indexed"
        assert_same_bits(ts_read(os.path.join(root, prefix), "zarr3"), arr)
        # And through zarr_tool itself.
        assert_tool_reads(root, prefix, arr, dtype, tmp_path)


def test_tool_zarr3_unsharded_and_partial_chunks(tmp_path):
    root = str(tmp_path / "ck")
    arr = random_array("float32", (9, 9), 1)
    arr[0:4, 0:4] = 0  # a chunk equal to the fill value: left out, reads as 0
    for compressor in ("none", "zstd", "gzip", "blosc"):
        prefix = f"u_{compressor}"
        tool_write(root, prefix, arr, "float32", tmp_path, "--unsharded", "--chunks", "4,4",
                   "--compressor", compressor)
        assert not os.path.exists(os.path.join(root, prefix, "c", "0", "0"))
        assert_same_bits(ts_read(os.path.join(root, prefix), "zarr3"), arr)
        # zarr-python agrees too.
        assert_same_bits(zarr.open_array(os.path.join(root, prefix), mode="r")[...], arr)


@pytest.mark.parametrize("compressor", ["blosc", "zstd", "gzip", "none"])
def test_tool_zarr2_read_by_tensorstore_and_zarr_python(compressor, tmp_path):
    root = str(tmp_path / "ck")
    for dtype in ("float32", "int16", "bfloat16", "complex64", "bool", "uint64"):
        arr = random_array(dtype, (7, 5), 2)
        prefix = f"v2_{dtype}"
        tool_write(root, prefix, arr, dtype, tmp_path, "--format", "2", "--chunks", "3,5",
                   "--compressor", compressor, "--separator", "/" if dtype == "int16" else ".")
        assert_same_bits(ts_read(os.path.join(root, prefix), "zarr"), arr)
        if dtype != "bfloat16":  # zarr-python has no bfloat16 v2 dtype
            got = zarr.open_array(os.path.join(root, prefix), mode="r", zarr_format=2)[...]
            assert_same_bits(got, arr)
