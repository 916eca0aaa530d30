"""Save/restore of NumPy trees and Python scalars; metadata; errors; partial restores; casts."""

from __future__ import annotations

import collections
import dataclasses
import gc
import math
import os
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
import pytest

import tensorstash
from tshelpers import (ALL_DTYPES, assert_same_array, assert_same_tree, data_files, flip_byte,
                       pattern, random_array, read_index, record_read_stats)

SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (4, 5), (2, 3, 5), (3, 1, 2, 2)]


class Point(NamedTuple):
    x: object
    y: object


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    kernel: object
    bias: object
    name: str = dataclasses.field(default="dense", metadata=dict(static=True))


# --- round trips without a target ---------------------------------------------------------------

@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_every_dtype_and_shape(step, dt):
    rng = np.random.default_rng(ALL_DTYPES.index(dt))
    tree = {f"s{i}": random_array(rng, shape, dt) for i, shape in enumerate(SHAPES)}
    # Non-contiguous and read-only inputs are saved by value too.
    big = random_array(rng, (6, 8), dt)
    tree["strided"] = big[::2, 1::3]
    tree["transposed"] = big.T
    ro = random_array(rng, (5,), dt)
    ro.flags.writeable = False
    tree["readonly"] = ro
    tensorstash.save(step, tree)
    got = tensorstash.restore(step)
    want = {k: np.array(v, order="C") for k, v in tree.items()}
    assert_same_tree(got, want)
    meta = tensorstash.metadata(step)
    for k, v in want.items():
        m = meta[k]
        assert isinstance(m, tensorstash.ArrayMetadata)
        assert (m.path, m.shape, m.dtype, m.codec) == (k, v.shape, v.dtype, "none")
        assert m.nbytes == v.nbytes == m.stored_bytes


def test_nested_containers_and_keys(step):
    rng = np.random.default_rng(1)
    a = lambda *s: random_array(rng, s, np.float32)  # noqa: E731
    tree = {
        "params": {"dense": [a(3, 2), (a(2), None)], "empty_list": [], "empty_tuple": (),
                   "empty_dict": {}, "none": None},
        "slash/key": {"a~b": a(1), "~/": a(2, 2), "~01": a(3)},
        "ünïcødé ключ 键 🔑": a(2),
        "": {"": a(4)},
        7: a(1),
        -3: {0: a(2)},
        "tuple_of_lists": ([a(1)], [[a(2)], []]),
        "order": {"z": a(1), "a": a(1), "m": a(1)},
    }
    tensorstash.save(step, tree)
    got = tensorstash.restore(step)
    # Everything comes back as it was, int keys as ints (docs/format.md 4.2, "typed_dict").
    assert_same_tree(got, tree)
    assert list(got) == list(tree) and list(got[-3]) == [0]
    # Array paths are JSON-Pointer escaped joins of the keys.
    paths = {e["path"] for e in read_index(step)}
    assert {"params/dense/0", "params/dense/1/0", "slash~1key/a~0b", "slash~1key/~0~1",
            "slash~1key/~001", "ünïcødé ключ 键 🔑", "/", "7", "-3/0", "tuple_of_lists/1/0/0",
            "order/z"} <= paths
    meta = tensorstash.metadata(step)
    assert meta["slash/key"]["~/"].path == "slash~1key/~0~1"
    assert meta["params"]["dense"][1][1] is None
    assert meta["params"]["empty_dict"] == {} and meta["params"]["empty_tuple"] == ()


def test_root_leaf_and_non_dict_roots(tmp_path):
    root = tmp_path / "r"
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    for i, tree in enumerate([arr, [arr, 1], (None,), 3.5, "text", None, {}]):
        path = str(root / f"{i:010d}")
        tensorstash.save(path, tree)
        assert_same_tree(tensorstash.restore(path), tree)


def test_python_and_numpy_scalars(step):
    nan_neg = -float("nan")
    tree = {
        "b": [True, False], "i": [0, -1, 2**63, -(2**200) - 12345, 10**400],
        "f": [0.1, -0.0, 1e300, 5e-324, float("inf"), float("-inf"), float("nan"), 1e20, -2.5],
        "s": ["", "adamw", "ünï\u0000code\n\"'"], "by": [b"", b"\x00\xff\x10hi", bytes(range(256))],
        "np": {"f32": np.float32(1.5), "i64": np.int64(-7), "u8": np.uint8(255),
               "bool": np.bool_(True), "bf16": ml_dtypes.bfloat16(-3.25), "c64": np.complex64(1 - 2j),
               "f8": ml_dtypes.float8_e4m3fn(0.5)},
    }
    tensorstash.save(step, tree)
    got = tensorstash.restore(step)
    # NumPy scalars come back as 0-d arrays, Python scalars as themselves.
    want = dict(tree)
    want["np"] = {k: np.asarray(v) for k, v in tree["np"].items()}
    assert_same_tree(got, want)
    # NaN keeps its sign (docs/format.md 4.3).
    tensorstash.save(step, {"x": nan_neg}, overwrite=True)
    x = tensorstash.restore(step)["x"]
    assert math.isnan(x) and math.copysign(1.0, x) == -1.0
    # With NumPy scalar targets they come back as NumPy scalars.
    target = {"np": tree["np"]}
    step2 = step + "-np"
    tensorstash.save(step2, {"np": tree["np"]})
    got = tensorstash.restore(step2, target=target)
    assert_same_tree(got, target)


def test_reader_tree_is_the_tree_json_parsed(step):
    """Reader.tree() builds in C++ the objects json.loads makes of Reader.tree_json(), which the
    restore used to parse: every node kind, keys needing escapes, text and floats that JSON
    spells specially."""
    import json

    from tensorstash import _restore
    tree = {"a/b~c": [1, -(2**70), 0.1, -0.0, float("nan"), float("-inf"), 5e-324, True, None],
            "s": ("", "ünï\u0000code\n\"'", b"\x00\xff"), "": {"x": np.arange(3)}, "e": {}, "l": []}
    tensorstash.save(step, tree)
    reader = _restore._open(step, True, 1 << 20, 1)
    try:
        assert reader.tree() == json.loads(reader.tree_json())
    finally:
        reader.close()


def test_scalar_targets_convert(step):
    tensorstash.save(step, {"i": 3, "f": 2.0, "b": True, "arr0": np.array(4.5, np.float64),
                            "iarr": np.array(7, np.int32)})
    # (A float into an int is refused, as for arrays: tests/python/test_hostile_user.py.)
    got = tensorstash.restore(step, target={"i": 0.0, "f": np.float32(0), "b": 0, "arr0": 0.0,
                                            "iarr": 0})
    assert_same_tree(got, {"i": 3.0, "f": np.float32(2.0), "b": 1, "arr0": 4.5, "iarr": 7})
    with pytest.raises(TypeError, match="'i'"):
        tensorstash.restore(step, target={"i": "x"})
    with pytest.raises(TypeError, match="'arr0'"):
        tensorstash.restore(step, target={"arr0": b""})


# --- targets give their structure --------------------------------------------------------------

def test_target_structure_namedtuple_dataclass_dicts(step):
    rng = np.random.default_rng(2)
    a = lambda *s: random_array(rng, s, np.float32)  # noqa: E731
    layer = Layer(kernel=a(3, 4), bias=None, name="custom")
    tree = {"pt": Point(a(2), [a(3), 4]), "layer": layer,
            "od": collections.OrderedDict([("b", a(1)), ("a", a(2))]),
            "dd": collections.defaultdict(list, {"k": a(3)}), 5: a(2)}
    tensorstash.save(step, tree)

    plain = tensorstash.restore(step)
    assert type(plain["pt"]) is dict and list(plain["pt"]) == ["x", "y"]
    assert_same_array(plain["pt"]["x"], tree["pt"].x)
    assert set(plain["layer"]) == {"kernel", "bias"} and plain["layer"]["bias"] is None
    assert type(plain["od"]) is dict and list(plain["od"]) == ["b", "a"]
    assert 5 in plain  # (int keys come back as ints)

    # (jax.tree_util cannot sort a dict of int and str keys: map the values one by one.)
    zeros = lambda t: jax.tree_util.tree_map(np.zeros_like, t)  # noqa: E731
    target = {k: zeros(v) for k, v in tree.items()}
    assert type(target["dd"]) is collections.defaultdict
    got = tensorstash.restore(step, target=target)
    assert type(got["pt"]) is Point and type(got["pt"].y) is list
    assert type(got["layer"]) is Layer and got["layer"].name == "custom" and got["layer"].bias is None
    assert type(got["od"]) is collections.OrderedDict and list(got["od"]) == ["b", "a"]
    assert type(got["dd"]) is collections.defaultdict and got["dd"].default_factory is list
    assert 5 in got
    for k in tree:
        got_leaves, want_leaves = jax.tree_util.tree_leaves(got[k]), jax.tree_util.tree_leaves(tree[k])
        assert len(got_leaves) == len(want_leaves)
        for g, w in zip(got_leaves, want_leaves):
            if isinstance(w, np.ndarray):
                assert_same_array(g, w)
            else:
                # A scalar leaf into its target, np.zeros_like(4): a 0-d array of that dtype.
                assert type(g) is np.ndarray and g.shape == () and g == w, (k, g, w)


def test_registered_with_keys_node(step):
    class Box:
        def __init__(self, inner, outer):
            self.inner, self.outer = inner, outer

    jax.tree_util.register_pytree_with_keys(
        Box,
        lambda b: (((jax.tree_util.GetAttrKey("inner"), b.inner),
                    (jax.tree_util.GetAttrKey("outer"), b.outer)), None),
        lambda aux, children: Box(*children))
    x, y = np.arange(3.0), np.arange(4, dtype=np.int8)
    tensorstash.save(step, {"box": Box(x, {"y": y})})
    assert_same_tree(tensorstash.restore(step), {"box": {"inner": x, "outer": {"y": y}}})
    got = tensorstash.restore(step, target={"box": Box(np.zeros(3), {"y": np.zeros(4, np.int8)})})
    assert isinstance(got["box"], Box)
    assert_same_array(got["box"].inner, x)
    assert_same_array(got["box"].outer["y"], y)


# --- metadata -----------------------------------------------------------------------------------

def test_metadata_reads_no_array_data(step):
    w = pattern((1000, 1000), np.float32)
    tree = {"w": w, "step": 12, "name": "run", "z": np.zeros((0, 5), np.int8),
            "s": np.array(3, np.uint16)}
    tensorstash.save(step, tree, chunk_bytes=1 << 20)
    # Overwrite every data byte: metadata never looks at them, restore checks them.
    for f in data_files(step):
        size = os.path.getsize(f)
        with open(f, "r+b") as fh:
            fh.write(b"\xa5" * size)
    meta = tensorstash.metadata(step)
    assert meta["step"] == 12 and meta["name"] == "run"
    m = meta["w"]
    assert m.shape == (1000, 1000) and m.dtype == np.float32 and m.codec == "none"
    assert len(m.chunk_shape) == 2 and math.prod(m.chunk_shape) * 4 <= 1 << 20
    assert m.num_chunks == math.prod(-(-n // c) for n, c in zip(m.shape, m.chunk_shape)) > 1
    assert m.stored_bytes == m.nbytes == 4_000_000
    assert (meta["z"].shape, meta["z"].num_chunks, meta["z"].stored_bytes) == ((0, 5), 0, 0)
    assert (meta["s"].shape, meta["s"].chunk_shape, meta["s"].num_chunks) == ((), (), 1)
    with pytest.raises(OSError, match="'?w'?"):
        tensorstash.restore(step)


def test_metadata_with_missing_data_files(step):
    tensorstash.save(step, {"w": np.ones((64, 64), np.float32), "n": 1})
    (f,) = data_files(step)
    os.remove(f)
    # Opening a step checks that its data files exist (docs/format.md section 7), so metadata,
    # which opens it too, refuses it like restore does, naming the file.
    for fn in (tensorstash.restore, tensorstash.metadata):
        with pytest.raises(OSError, match=os.path.basename(f)):
            fn(step)


# --- codecs and options -------------------------------------------------------------------------

def test_zstd(step):
    rng = np.random.default_rng(3)
    compressible = np.repeat(np.arange(1000, dtype=np.float32), 64).reshape(640, 100)
    noise = random_array(rng, (300, 7), np.complex64)
    tree = {"c": compressible, "n": noise, "e": np.zeros((0,), np.int32), "s": np.float64(2.5)}
    stats = tensorstash.save(step, tree, codec="zstd", zstd_level=5, chunk_bytes=64 << 10)
    assert stats["raw_bytes"] == compressible.nbytes + noise.nbytes + 8
    assert stats["stored_bytes"] < stats["raw_bytes"]
    meta = tensorstash.metadata(step)
    assert meta["c"].codec == "zstd" and meta["c"].stored_bytes < compressible.nbytes // 10
    assert meta["c"].num_chunks > 1
    assert_same_tree(tensorstash.restore(step), {**tree, "s": np.asarray(tree["s"])})
    with pytest.raises(ValueError, match="codec"):
        tensorstash.save(step + "x", tree, codec="lz4")


def test_small_chunks_and_files(step):
    x = pattern((37, 53), np.int32)
    y = pattern((5, 1000), np.float64, seed=4)
    stats = tensorstash.save(step, {"x": x, "y": y}, chunk_bytes=512, data_file_bytes=4096,
                             io_threads=3, max_inflight_bytes=4096, sync=False)
    assert stats["chunks"] > 20 and stats["data_files"] > 1
    assert len(data_files(step)) == stats["data_files"]
    got = tensorstash.restore(step, max_inflight_bytes=1024, io_threads=2)
    assert_same_tree(got, {"x": x, "y": y})


# --- overwrite, missing and incomplete steps, corruption -----------------------------------------

def test_overwrite(step):
    old = {"a": np.arange(10, dtype=np.int64), "v": 1}
    new = {"b": np.ones((3, 3), np.float16), "v": 2}
    tensorstash.save(step, old)
    with pytest.raises(FileExistsError):
        tensorstash.save(step, new)
    assert_same_tree(tensorstash.restore(step), old)
    tensorstash.save(step, new, overwrite=True)
    assert_same_tree(tensorstash.restore(step), new)
    # No temporaries or replaced steps are left behind.
    assert os.listdir(os.path.dirname(step)) == [os.path.basename(step)]


def test_missing_and_incomplete_steps(tmp_path, step):
    with pytest.raises(FileNotFoundError):
        tensorstash.restore(str(tmp_path / "nowhere" / "0000000001"))
    with pytest.raises(FileNotFoundError):
        tensorstash.metadata(str(tmp_path / "nowhere" / "0000000001"))
    tensorstash.save(step, {"a": np.ones(3)})
    with pytest.raises(FileNotFoundError):
        tensorstash.restore(os.path.join(os.path.dirname(step), "0000000002"))
    os.remove(os.path.join(step, "COMMIT"))
    with pytest.raises(ValueError):
        tensorstash.restore(step)
    with pytest.raises(ValueError):
        tensorstash.metadata(step)
    # A new save over an incomplete step is allowed and gives a complete one.
    tensorstash.save(step, {"a": np.zeros(2)})
    assert_same_tree(tensorstash.restore(step), {"a": np.zeros(2)})


def test_corrupt_chunk_names_the_array(step):
    tree = {"good": pattern((100,), np.float32), "layers": {"w/0": pattern((64, 32), np.int16)}}
    tensorstash.save(step, tree, chunk_bytes=1024)
    flip_byte(step, "layers/w~10", chunk_pos=2)
    with pytest.raises(OSError, match="layers/w~10"):
        tensorstash.restore(step)
    # Without checksums the damaged bytes come through, and the rest is right.
    got = tensorstash.restore(step, verify_checksums=False)
    assert_same_array(got["good"], tree["good"])
    assert bits_differ(got["layers"]["w/0"], tree["layers"]["w/0"]) == 1


def bits_differ(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.count_nonzero(a.reshape(-1).view(np.uint8) != b.reshape(-1).view(np.uint8)))


def test_truncated_data_file(step):
    tensorstash.save(step, {"a": pattern((1000,), np.int64)})
    (f,) = data_files(step)
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 1)
    with pytest.raises(OSError):
        tensorstash.restore(step)


# --- save-side errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad, where", [
    (object(), "opt/state/1"),
    ({1, 2}, "opt/state/1"),
    (np.array(["text"]), "opt/state/1"),
    (np.array([object()]), "opt/state/1"),
    (np.zeros(2, np.float128) if hasattr(np, "float128") else np.zeros(2, np.str_), "opt/state/1"),
])
def test_unsupported_leaf_names_the_path(step, bad, where):
    with pytest.raises(TypeError, match=where):
        tensorstash.save(step, {"ok": np.ones(2), "opt": {"state": [np.ones(1), bad]}})
    gc.collect()
    assert not os.path.exists(step)
    # The failed save leaves nothing in the way of the next one.
    tensorstash.save(step, {"ok": np.ones(2)})
    assert_same_tree(tensorstash.restore(step), {"ok": np.ones(2)})


def test_unsupported_dict_keys_and_abstract_leaves(step):
    with pytest.raises(TypeError, match="a/b"):
        tensorstash.save(step, {"a": {"b": {frozenset([1]): np.ones(1)}}})
    with pytest.raises(TypeError, match="float64"):
        tensorstash.save(step, {np.float64(1): np.ones(1)})
    with pytest.raises(TypeError):
        tensorstash.save(step, {(1, object()): np.ones(1)})
    with pytest.raises(TypeError, match="abs"):
        tensorstash.save(step, {"abs": jax.ShapeDtypeStruct((2,), np.float32)})
    # An int key and its decimal string collide.
    with pytest.raises((ValueError, TypeError)):
        tensorstash.save(step, {1: np.ones(1), "1": np.ones(1)})
    assert not os.path.exists(step)


# --- targets: missing leaves, subsets, casts, shapes --------------------------------------------

def test_target_leaf_missing(step):
    tensorstash.save(step, {"params": {"w": np.ones(3)}, "none": None})
    with pytest.raises(KeyError, match="params/b"):
        tensorstash.restore(step, target={"params": {"w": np.zeros(3), "b": np.zeros(1)}})
    with pytest.raises(KeyError, match="none"):
        tensorstash.restore(step, target={"none": np.zeros(1)})
    # None in the target stays None, whatever the checkpoint holds there.
    got = tensorstash.restore(step, target={"params": {"w": None}})
    assert got == {"params": {"w": None}}


def test_partial_restore_reads_only_the_subtree(step, monkeypatch):
    a = pattern((40, 30), np.float32, seed=1)
    opt = pattern((512, 512), np.float32, seed=2)  # 1 MiB, stored between a and z
    z = pattern((17,), np.int64, seed=3)
    tensorstash.save(step, {"params": {"a": a}, "opt": {"mu": opt}, "zz": z},
                     chunk_bytes=64 << 10)
    meta = tensorstash.metadata(step)
    # Damage every chunk of opt/mu: a restore that reads it fails (checksums are on).
    for i in range(meta["opt"]["mu"].num_chunks):
        flip_byte(step, "opt/mu", chunk_pos=i)
    with pytest.raises(OSError, match="opt/mu"):
        tensorstash.restore(step)
    stats = record_read_stats(tensorstash, monkeypatch.setattr)
    got = tensorstash.restore(step, target={"params": {"a": np.zeros_like(a)}, "zz": z})
    assert_same_tree(got, {"params": {"a": a}, "zz": z})
    read = sum(s["bytes_read"] + s["mapped_bytes"] for s in stats)  # read or mapped
    wanted = meta["params"]["a"].stored_bytes + meta["zz"].stored_bytes
    assert wanted <= read < wanted + (64 << 10), (read, wanted)


def test_extra_arrays_are_skipped(step):
    tree = {"a": np.arange(5), "b": {"c": np.ones((2, 2)), "d": "x"}, "e": [1, 2]}
    tensorstash.save(step, tree)
    got = tensorstash.restore(step, target={"b": {"c": np.zeros((2, 2))}})
    assert_same_tree(got, {"b": {"c": np.ones((2, 2))}})


@pytest.mark.parametrize("src, dst", [
    ("float32", "bfloat16"), ("float32", "float16"), ("float64", "float32"),
    ("float32", "float8_e4m3fn"), ("float32", "float8_e5m2"), ("bfloat16", "float32"),
    ("float16", "float64"), ("complex64", "complex128"), ("complex128", "complex64"),
])
def test_float_casts_match_numpy(step, src, dst):
    rng = np.random.default_rng(5)
    sdt, ddt = np.dtype(getattr(ml_dtypes, src, src)), np.dtype(getattr(ml_dtypes, dst, dst))
    if sdt.kind == "c":
        x = (rng.standard_normal((33, 9)) * 1e3 + 1j * rng.standard_normal((33, 9))).astype(sdt)
    else:
        x = (rng.standard_normal((33, 9)) * np.float64(rng.choice([1e-6, 1, 300, 1e5], (33, 9))))
        with np.errstate(all="ignore"):
            x = x.astype(sdt)
        x.reshape(-1)[:4] = [np.inf, -np.inf, 0.0, -0.0]
        x.reshape(-1)[4] = np.nan
    tensorstash.save(step, {"x": x})
    got = tensorstash.restore(step, target={"x": np.zeros(x.shape, ddt)})["x"]
    with np.errstate(all="ignore"):
        want = x.astype(ddt)
    assert got.dtype == ddt
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert_same_array(np.where(nan, 0, got).astype(ddt), np.where(nan, 0, want).astype(ddt))


def test_integer_casts(step):
    x = np.array([-2**31, -1, 0, 1, 2**31 - 1], np.int32)
    tensorstash.save(step, {"x": x, "b": np.array([True, False]), "u": np.array([300], np.uint16)})
    got = tensorstash.restore(step, target={"x": np.zeros(5, np.int64), "b": np.zeros(2, np.int32),
                                            "u": np.zeros(1, np.float32)})
    assert_same_tree(got, {"x": x.astype(np.int64), "b": np.array([1, 0], np.int32),
                           "u": np.array([300], np.float32)})
    with pytest.raises(ValueError, match="'?u'?"):  # 300 does not fit in uint8
        tensorstash.restore(step, target={"u": np.zeros(1, np.uint8)})
    tensorstash.save(step + "f", {"f": np.ones(2, np.float32)})
    with pytest.raises((NotImplementedError, ValueError, TypeError), match="float32"):
        tensorstash.restore(step + "f", target={"f": np.zeros(2, np.int32)})  # float -> int: no


def test_target_shapes(step):
    x = pattern((4, 6), np.int16)
    tensorstash.save(step, {"x": x, "s": np.array(2.0, np.float32)})
    big = tensorstash.restore(step, target={"x": np.empty((5, 9), np.int16)})["x"]
    want = np.zeros((5, 9), np.int16)
    want[:4, :6] = x
    assert_same_array(big, want)
    with pytest.raises(ValueError, match="truncate"):
        tensorstash.restore(step, target={"x": np.empty((3, 6), np.int16)})
    with pytest.raises(ValueError):
        tensorstash.restore(step, target={"x": np.empty((4, 7, 1), np.int16)})  # rank
    small = tensorstash.restore(step, target={"x": np.empty((3, 2), np.int16)}, truncate=True)["x"]
    assert_same_array(small, x[:3, :2])
    mixed = tensorstash.restore(step, target={"x": np.empty((2, 8), np.int32)}, truncate=True)["x"]
    want = np.zeros((2, 8), np.int32)
    want[:, :6] = x[:2]
    assert_same_array(mixed, want)
    # Zero-size targets read nothing.
    empty = tensorstash.restore(step, target={"x": np.empty((0, 6), np.int16)}, truncate=True)["x"]
    assert empty.shape == (0, 6)


def test_paths_accepted(tmp_path):
    import pathlib
    p = pathlib.Path(tmp_path) / "root" / "0000000007"
    tensorstash.save(p, {"a": np.ones(2)})
    assert_same_tree(tensorstash.restore(p), {"a": np.ones(2)})
    with pytest.raises(ValueError):
        tensorstash.save(str(p) + "/x.tmp-0123456789abcdef", {"a": np.ones(2)})
