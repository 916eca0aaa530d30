"""The ml_dtypes types beyond float8_e4m3fn/e5m2: int2, int4, uint2, uint4, float4_e2m1fn,
float6_*, and the other float8 variants (issue 38, part 2).

Each round-trips bit for bit in the native format (NumPy arrays, and jax.Arrays sharded over the
8 CPU devices onto another mesh, with and without a target), through Orbax both ways (we write,
orbax-checkpoint restores; orbax-checkpoint writes, we restore) for the types TensorStore has,
casts on restore match ml_dtypes' astype, and metadata() and `tensorstash inspect` name them.
"""

from __future__ import annotations

import subprocess

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import tensorstash
from tshelpers import (assert_jax_array, assert_same_array, cli_path, global_array, mesh,
                       named)


# name -> bits that carry the value (the rest of the byte is zero, as ml_dtypes writes it)
NEW = {
    "int2": 2, "uint2": 2, "int4": 4, "uint4": 4, "float4_e2m1fn": 4,
    "float6_e2m3fn": 6, "float6_e3m2fn": 6, "float8_e3m4": 8, "float8_e4m3": 8,
    "float8_e4m3b11fnuz": 8, "float8_e4m3fnuz": 8, "float8_e5m2fnuz": 8, "float8_e8m0fnu": 8,
}
# XLA has no float6 arrays ("Invalid XLA PrimitiveType"); every other one is a jax dtype.
JAX_NAMES = [n for n in NEW if not n.startswith("float6")]
# TensorStore 0.1.86 has a zarr data type for these; not for uint2, uint4, float6_*, float8_e4m3.
TENSORSTORE_NAMES = ["int2", "int4", "float4_e2m1fn", "float8_e3m4", "float8_e4m3b11fnuz",
                     "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
NOT_IN_TENSORSTORE = [n for n in NEW if n not in TENSORSTORE_NAMES]
NEW_FLOATS = [n for n in NEW if n.startswith("float")]


def dt(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name))


def codes(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random valid codes of `name` (every bit pattern of its value bits: NaNs, infs, -0 and
    subnormals included), in canonical bytes."""
    rng = np.random.default_rng(seed + list(NEW).index(name))
    raw = rng.integers(0, 1 << NEW[name], size=shape, dtype=np.uint8)
    return raw.view(dt(name))


@pytest.mark.parametrize("name", list(NEW))
def test_native_numpy_roundtrip_and_metadata(tmp_path, name):
    tree = {"a": codes(name, (7, 5)), "s": codes(name, (), 1), "e": codes(name, (0, 3)),
            "z": {"b": codes(name, (300,), 2)}}
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, tree)
    got = tensorstash.restore(path)
    for k in ("a", "s", "e"):
        assert_same_array(got[k], tree[k], f"{name} {k}")
    assert_same_array(got["z"]["b"], tree["z"]["b"], f"{name} z/b")
    # With a target of the same dtype, and a partial restore of a part of a chunk.
    got = tensorstash.restore(path, target={"a": np.zeros((7, 5), dt(name))})
    assert_same_array(got["a"], tree["a"], f"{name} with target")
    meta = tensorstash.metadata(path)
    assert meta["a"].dtype == dt(name) and meta["a"].shape == (7, 5)
    assert meta["z"]["b"].stored_bytes >= 300  # one byte per element (no packing)
    shown = subprocess.run([cli_path(), "inspect", path], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert name in shown.stdout


@pytest.mark.parametrize("name", JAX_NAMES)
def test_native_sharded_jax_onto_another_mesh(tmp_path, name):
    values = codes(name, (16, 6))
    save_mesh, load_mesh = mesh((4, 2), ("x", "y")), mesh((2, 4), ("p", "q"))
    tree = {"w": global_array(values, named(save_mesh, "x", "y")),
            "r": global_array(values[:4], named(save_mesh))}
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, tree)
    got = tensorstash.restore(path)  # no target: NumPy arrays
    assert_same_array(got["w"], values, name)
    assert_same_array(got["r"], values[:4], name)
    target = {"w": jax.ShapeDtypeStruct((16, 6), dt(name), sharding=named(load_mesh, "q", "p")),
              "r": jax.ShapeDtypeStruct((4, 6), dt(name), sharding=named(load_mesh, "q"))}
    got = tensorstash.restore(path, target=target)
    assert_jax_array(got["w"], values, named(load_mesh, "q", "p"), name)
    assert_jax_array(got["r"], values[:4], named(load_mesh, "q"), name)


@pytest.mark.parametrize("name", TENSORSTORE_NAMES)
def test_orbax_restores_what_we_write(tmp_path, name):
    values = codes(name, (16, 6))
    save_mesh, load_mesh = mesh((4, 2), ("x", "y")), mesh((2, 4), ("p", "q"))
    tree = {"w": global_array(values, named(save_mesh, "x", "y")), "n": codes(name, (9,), 3)}
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, tree, format="orbax")
    target = {"w": jax.ShapeDtypeStruct((16, 6), dt(name), sharding=named(load_mesh, "q", "p")),
              "n": jax.ShapeDtypeStruct((9,), dt(name), sharding=named(load_mesh))}
    got = ocp.StandardCheckpointer().restore(path, target)
    assert_jax_array(got["w"], values, named(load_mesh, "q", "p"), name)
    assert_jax_array(got["n"], tree["n"], named(load_mesh), name)
    got = ocp.PyTreeCheckpointer().restore(path)  # no target: Orbax's own choice of arrays
    assert np.asarray(got["w"]).dtype == dt(name)
    assert_same_array(np.asarray(got["w"]), values, name)
    # And we read our own Orbax checkpoint back.
    assert_same_array(tensorstash.restore(path)["n"], tree["n"], name)


@pytest.mark.parametrize("zarr3", [True, False], ids=["zarr3", "zarr2"])
@pytest.mark.parametrize("name", TENSORSTORE_NAMES)
def test_we_restore_what_orbax_writes(tmp_path, name, zarr3):
    values = codes(name, (16, 6), 4)
    save_mesh, load_mesh = mesh((4, 2), ("x", "y")), mesh((8,), ("d",))
    tree = {"w": global_array(values, named(save_mesh, "x", "y")), "v": values[:3, :5]}
    path = str(tmp_path / "ckpt")
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=zarr3))
    ckptr.save(path, args=ocp.args.PyTreeSave(tree))
    got = tensorstash.restore(path)
    assert_same_array(got["w"], values, name)
    assert_same_array(got["v"], values[:3, :5], name)
    meta = tensorstash.metadata(path)
    assert meta["w"].dtype == dt(name)
    target = {"w": jax.ShapeDtypeStruct((16, 6), dt(name), sharding=named(load_mesh, "d")),
              "v": np.zeros((3, 5), dt(name))}
    got = tensorstash.restore(path, target=target)
    assert_jax_array(got["w"], values, named(load_mesh, "d"), name)
    assert_same_array(got["v"], values[:3, :5], name)


@pytest.mark.parametrize("name", NOT_IN_TENSORSTORE)
def test_orbax_format_refuses_types_tensorstore_lacks(tmp_path, name):
    with pytest.raises((NotImplementedError, ValueError, TypeError), match=name):
        tensorstash.save(str(tmp_path / "ckpt"), {"a": codes(name, (4,))}, format="orbax")


def reference_cast(x: np.ndarray, to: np.dtype) -> np.ndarray:
    """x.astype(to) as NumPy/ml_dtypes cast it. ml_dtypes registers no cast for a few pairs of its
    own types (float8_e8m0fnu -> float8_e4m3fn, uint2 -> int4); those go through float32 (exact
    for every value of these types) or int64, as ml_dtypes converts all the others."""
    with np.errstate(all="ignore"):
        try:
            return x.astype(to)
        except TypeError:
            return x.astype(np.float32 if "float" in x.dtype.name else np.int64).astype(to)


@pytest.mark.parametrize("name", NEW_FLOATS)
def test_float_casts_match_ml_dtypes(tmp_path, name):
    every = np.arange(1 << NEW[name], dtype=np.uint8).view(dt(name))
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, {"x": every})
    for target in ("float32", "float64", "bfloat16", "float16", "float8_e4m3fn"):
        tdt = np.dtype(getattr(ml_dtypes, target, target))
        got = tensorstash.restore(path, target={"x": np.zeros(every.shape, tdt)})["x"]
        assert_same_array(got, reference_cast(every, tdt), f"{name} -> {target}")

    rng = np.random.default_rng(7)
    with np.errstate(over="ignore"):  # 1e40 becomes inf in float32, on purpose
        x = (rng.standard_normal(2000) * rng.choice([1e-3, 1, 10, 300, 1e40], 2000)
             ).astype(np.float32)
    fin = every.astype(np.float32)
    fin = np.unique(np.abs(fin[np.isfinite(fin)]))
    mids = ((fin[:-1].astype(np.float64) + fin[1:]) / 2).astype(np.float32)  # ties
    x = np.concatenate([x, fin, -fin, mids, -mids, [np.inf, -np.inf, 0.0, -0.0, 1e-45, 3e38]]
                       ).astype(np.float32)
    tensorstash.save(path + "f", {"x": x, "i": np.arange(-20, 20, dtype=np.int32)})
    got = tensorstash.restore(path + "f", target={"x": np.zeros(x.shape, dt(name)),
                                                  "i": np.zeros(40, dt(name))})
    assert_same_array(got["x"], reference_cast(x, dt(name)), f"float32 -> {name}")
    assert_same_array(got["i"], reference_cast(np.arange(-20, 20, dtype=np.int32), dt(name)),
                      f"int32 -> {name}")
    with pytest.raises((NotImplementedError, ValueError, TypeError), match=name):
        tensorstash.restore(path, target={"x": np.zeros(every.shape, np.int32)})  # float -> int


@pytest.mark.parametrize("name", ["int2", "int4", "uint2", "uint4"])
def test_integer_casts(tmp_path, name):
    every = np.arange(1 << NEW[name], dtype=np.uint8).view(dt(name))
    # A stored byte with high bits set (another writer's) reads by its low bits, as ml_dtypes.
    dirty = (np.arange(1 << NEW[name], dtype=np.uint8) | np.uint8(0xF0 & ~((1 << NEW[name]) - 1)))
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, {"x": every, "d": dirty.view(dt(name))})
    targets = ["int8", "int64", "int16", "float32", "bfloat16", "float8_e4m3fnuz"]
    targets += ["int4"] if name in ("int2", "uint2") else []
    targets += ["uint8", "uint64"] if name.startswith("u") else []
    for target in targets:
        tdt = dt(target) if hasattr(ml_dtypes, target) else np.dtype(target)
        got = tensorstash.restore(path, target={"x": np.zeros(every.shape, tdt),
                                                "d": np.zeros(every.shape, tdt)})
        want = reference_cast(every, tdt)
        assert_same_array(got["x"], want, f"{name} -> {target}")
        assert_same_array(got["d"], want, f"{name} (high bits set) -> {target}")
    # Into a sub-byte type: in range exactly; out of range is an error naming the array.
    tensorstash.save(path + "w", {"x": np.array([-2, -1, 0, 1], np.int64),
                                  "big": np.array([0, 100], np.int32)})
    if name.startswith("int"):
        got = tensorstash.restore(path + "w", target={"x": np.zeros(4, dt(name))})["x"]
        assert_same_array(got, np.array([-2, -1, 0, 1]).astype(dt(name)), name)
    else:
        with pytest.raises(ValueError, match="'?x'?"):
            tensorstash.restore(path + "w", target={"x": np.zeros(4, dt(name))})
    with pytest.raises(ValueError, match="100"):
        tensorstash.restore(path + "w", target={"big": np.zeros(2, dt(name))})
