"""tensorstash writes Orbax checkpoints (OCDBT + zarr3) that orbax-checkpoint restores.

Everything is checked against the installed orbax-checkpoint (0.12.8) and TensorStore: trees of
every dtype Orbax stores, odd shapes, 0-d arrays and Python scalars, nested containers, written
from arrays sharded over one mesh and restored by Orbax onto another, bit for bit, through
StandardCheckpointer, PyTreeCheckpointer and CheckpointManager; and `tensorstash convert`
(native -> Orbax), found at $TENSORSTASH_CLI or <repo>/build/tensorstash.
"""

from __future__ import annotations

import json
import os
import subprocess

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import tensorstash
from tshelpers import (DTYPE_NAMES, assert_jax_array, assert_same_array, dtype, global_array,
                       mesh, named, pattern, random_array)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def abstract(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def leftovers(parent: str) -> list[str]:
    return sorted(n for n in os.listdir(parent) if "tmp" in n)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_every_dtype_sharded_restores_onto_another_mesh(tmp_path, name):
    dt = dtype(name)
    rng = np.random.default_rng(DTYPE_NAMES.index(name))
    save_mesh, load_mesh = mesh((4, 2), ("x", "y")), mesh((2, 4), ("p", "q"))
    values = {
        "w": random_array(rng, (16, 6), dt),       # sharded on both mesh axes
        "v": random_array(rng, (8, 5), dt),        # odd second dimension, sharded rows only
        "r": random_array(rng, (6, 7), dt),        # replicated
        "z": np.zeros((8, 4), dt),                 # all fill value: no chunk is stored
    }
    shardings = {"w": named(save_mesh, "x", "y"), "v": named(save_mesh, "x"),
                 "r": named(save_mesh), "z": named(save_mesh, "y", "x")}
    tree = {k: global_array(v, shardings[k]) for k, v in values.items()}
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, tree, format="orbax")
    assert leftovers(str(tmp_path)) == []

    targets = {"w": named(load_mesh, "q", "p"), "v": named(load_mesh, "p"),
               "r": named(load_mesh, "p"), "z": named(load_mesh)}
    target = {k: abstract(v, targets[k]) for k, v in values.items()}
    got = ocp.StandardCheckpointer().restore(path, target)
    for k, v in values.items():
        assert_jax_array(got[k], v, targets[k], f"{name} {k}")


def test_numpy_scalars_0d_and_python_scalars(tmp_path):
    tree = {
        "a": pattern((5, 3), np.float32),
        "i": np.arange(7, dtype=np.int16),
        "zero_d": np.array(2.5, dtype=np.float64),
        "np_scalar": np.float32(-3.0),
        "step": 1234567890123,
        "lr": 0.125,
        "neg": -7,
        "flag": True,
        "none": None,
        "empty": {"d": {}, "l": [], "t": ()},
    }
    path = str(tmp_path / "ckpt")
    stats = tensorstash.save(path, tree, format="orbax")
    assert stats["raw_bytes"] == 5 * 3 * 4 + 7 * 2 + 8 + 4

    got = ocp.PyTreeCheckpointer().restore(path)
    assert_same_array(got["a"], tree["a"], "a")
    assert_same_array(got["i"], tree["i"], "i")
    assert_same_array(np.asarray(got["zero_d"]), tree["zero_d"], "zero_d")
    assert_same_array(np.asarray(got["np_scalar"]), np.asarray(tree["np_scalar"]), "np_scalar")
    for k in ("step", "lr", "neg", "flag"):
        assert got[k] == tree[k] and type(got[k]) is type(tree[k]), (k, got[k])
    assert got["none"] is None
    assert got["empty"] == {"d": {}, "l": [], "t": ()}

    m = mesh((8,), ("x",))
    target = {"a": abstract(tree["a"], named(m)), "i": abstract(tree["i"], named(m)),
              "zero_d": abstract(tree["zero_d"], named(m)),
              "np_scalar": abstract(np.asarray(tree["np_scalar"]), named(m)),
              "step": 0, "lr": 0.0, "neg": 0, "flag": False, "none": None,
              "empty": {"d": {}, "l": [], "t": ()}}
    got = ocp.StandardCheckpointer().restore(path, target)
    assert_jax_array(got["a"], tree["a"], named(m), "a")
    assert_jax_array(got["zero_d"], tree["zero_d"], named(m), "zero_d")
    assert got["step"] == tree["step"] and got["flag"] is True and got["none"] is None


def test_nested_tree_without_target(tmp_path):
    m = mesh((4, 2), ("x", "y"))
    w = pattern((8, 4), np.float32, seed=1)
    tree = {"params": {"layers": [{"w": global_array(w, named(m, "x", "y")),
                                   "b": pattern((4,), np.float32, seed=2)},
                                  {"w": pattern((2, 2), np.int32, seed=3)}],
                       "pair": (pattern((3,), np.uint8, seed=4), 5)},
            "opt": {"mu": {"nested": {"deeper": pattern((1, 1, 1), np.float16, seed=5)}}}}
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, tree, format="orbax")
    got = ocp.PyTreeCheckpointer().restore(path)
    # No target: jax.Array leaves come back with the saved sharding (from `_sharding`), the
    # others as NumPy; Orbax rebuilds sequences as lists.
    layer0 = got["params"]["layers"][0]
    assert_jax_array(layer0["w"], w, named(m, "x", "y"), "w")
    assert_same_array(layer0["b"], pattern((4,), np.float32, seed=2), "b")
    assert_same_array(got["params"]["layers"][1]["w"], pattern((2, 2), np.int32, seed=3), "w1")
    assert_same_array(got["params"]["pair"][0], pattern((3,), np.uint8, seed=4), "pair0")
    assert got["params"]["pair"][1] == 5
    assert_same_array(got["opt"]["mu"]["nested"]["deeper"], pattern((1, 1, 1), np.float16, seed=5),
                      "deeper")
    with open(os.path.join(path, "_METADATA")) as f:
        meta = json.load(f)
    assert meta["use_ocdbt"] is True and meta["use_zarr3"] is True
    assert "('params', 'layers', '0', 'w')" in meta["tree_metadata"]


def test_checkpoint_manager_default_item(tmp_path):
    root = tmp_path / "run"
    save_mesh, load_mesh = mesh((8,), ("x",)), mesh((2, 2), ("a", "b"))
    values = {"w": pattern((16, 4), np.float32), "b": pattern((4,), dtype("bfloat16"))}
    for step in (10, 20):
        tree = {"w": global_array(values["w"] + step, named(save_mesh, "x")), "b": values["b"],
                "step": step}
        tensorstash.save(str(root / str(step)), tree, format="orbax", orbax_item="default")
    mgr = ocp.CheckpointManager(str(root))
    assert mgr.all_steps() == [10, 20]
    assert mgr.latest_step() == 20
    target = {"w": abstract(values["w"], named(load_mesh, "b", "a")),
              "b": abstract(values["b"], named(load_mesh, "a")), "step": 0}
    got = mgr.restore(20, args=ocp.args.StandardRestore(target))
    assert_jax_array(got["w"], values["w"] + 20, named(load_mesh, "b", "a"), "w")
    assert_jax_array(got["b"], values["b"], named(load_mesh, "a"), "b")
    assert got["step"] == 20


def test_existing_checkpoint_and_failures_leave_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, {"a": np.arange(4)}, format="orbax")
    with pytest.raises(FileExistsError):
        tensorstash.save(path, {"b": np.arange(3)}, format="orbax")
    assert ocp.PyTreeCheckpointer().restore(path).keys() == {"a"}
    tensorstash.save(path, {"b": np.arange(3)}, format="orbax", overwrite=True)
    assert ocp.PyTreeCheckpointer().restore(path).keys() == {"b"}

    bad = str(tmp_path / "bad")
    with pytest.raises(ValueError, match="same Orbax name"):
        tensorstash.save(bad, {"a.b": np.arange(2), "a": {"b": np.arange(2)}}, format="orbax")
    with pytest.raises(ValueError, match="empty key"):
        tensorstash.save(bad, {"": np.arange(2)}, format="orbax")
    # (Strings and keys with '/' are saved: tests/python/test_orbax_trees.py.)
    with pytest.raises(NotImplementedError, match="bytes"):
        tensorstash.save(bad, {"s": b"text", "a": np.arange(2)}, format="orbax")
    with pytest.raises(NotImplementedError, match=r"'a/b\.s'"):
        tensorstash.save(bad, {"a/b": {"s": "text"}, "a": np.arange(2)}, format="orbax")
    assert not os.path.exists(bad)
    assert leftovers(str(tmp_path)) == []


def cli() -> str:
    path = os.environ.get("TENSORSTASH_CLI", os.path.join(REPO, "build", "tensorstash"))
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: build it (cmake --build build --target tensorstash_cli) "
                    "or set TENSORSTASH_CLI")
    return path


def test_convert_native_to_orbax(tmp_path):
    m = mesh((4, 2), ("x", "y"))
    rng = np.random.default_rng(7)
    values = {name: random_array(rng, (9, 5), dtype(name)) for name in DTYPE_NAMES}
    tree = {"arrays": dict(values), "s": pattern((), np.int32), "step": 42, "lr": 0.5,
            "l": [pattern((4,), np.float64), pattern((4, 2), np.int8)]}
    src = str(tmp_path / "native" / "0000000042")
    # Small chunks: the conversion writes several zarr chunks per array.
    tensorstash.save(src, tree, chunk_bytes=64)
    dst = str(tmp_path / "orbax" / "42")
    result = subprocess.run([cli(), "convert", src, dst], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "converted" in result.stdout

    target = {"arrays": {k: abstract(v, named(m, "x")) if v.shape[0] % 4 == 0
                         else abstract(v, named(m, None, None)) for k, v in values.items()},
              "s": abstract(tree["s"], named(m)), "step": 0, "lr": 0.0,
              "l": [abstract(tree["l"][0], named(m, "y")), abstract(tree["l"][1], named(m, "x"))]}
    got = ocp.StandardCheckpointer().restore(dst, target)
    for k, v in values.items():
        assert_jax_array(got["arrays"][k], v, target["arrays"][k].sharding, k)
    assert_jax_array(got["s"], tree["s"], named(m), "s")
    assert got["step"] == 42 and got["lr"] == 0.5
    assert_jax_array(got["l"][0], tree["l"][0], named(m, "y"), "l0")
    assert_jax_array(got["l"][1], tree["l"][1], named(m, "x"), "l1")

    # An existing destination is refused, and kept, unless --overwrite.
    again = subprocess.run([cli(), "convert", src, dst], capture_output=True, text=True)
    assert again.returncode != 0 and "--overwrite" in again.stderr
    assert ocp.PyTreeCheckpointer().restore(dst)["step"] == 42
    again = subprocess.run([cli(), "convert", "--overwrite", src, dst], capture_output=True,
                           text=True)
    assert again.returncode == 0, again.stderr


def test_failed_convert_leaves_no_destination(tmp_path):
    from tshelpers import flip_byte
    src = str(tmp_path / "native" / "0000000001")
    tensorstash.save(src, {"a": pattern((64, 64), np.float32), "b": pattern((8,), np.int64)},
                     chunk_bytes=4096)
    flip_byte(src, "a", chunk_pos=3)
    dst = str(tmp_path / "orbax" / "1")
    result = subprocess.run([cli(), "convert", src, dst], capture_output=True, text=True)
    assert result.returncode != 0
    assert "error:" in result.stderr and "a" in result.stderr, result.stderr
    assert not os.path.exists(dst)
    assert not os.path.exists(tmp_path / "orbax") or leftovers(str(tmp_path / "orbax")) == []

    missing = subprocess.run([cli(), "convert", str(tmp_path / "nope"), dst], capture_output=True,
                             text=True)
    assert missing.returncode != 0 and "error:" in missing.stderr
    assert not os.path.exists(dst)


def test_convert_to_manager_item_and_native_copy(tmp_path):
    tree = {"w": pattern((6, 10), np.float32), "n": {"b": pattern((5,), np.int64)}, "step": 3}
    src = str(tmp_path / "native" / "0000000003")
    tensorstash.save(src, tree, chunk_bytes=40)
    root = tmp_path / "orbax_run"
    result = subprocess.run([cli(), "convert", "--item", "default", src, str(root / "3")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    mgr = ocp.CheckpointManager(str(root))
    assert mgr.all_steps() == [3]
    m = mesh((2,), ("x",))
    target = {"w": abstract(tree["w"], named(m, "x")), "n": {"b": abstract(tree["n"]["b"], named(m))},
              "step": 0}
    got = mgr.restore(3, args=ocp.args.StandardRestore(target))
    assert_jax_array(got["w"], tree["w"], named(m, "x"), "w")
    assert_jax_array(got["n"]["b"], tree["n"]["b"], named(m), "b")
    assert got["step"] == 3

    # --to native re-chunks a native step (the path Orbax -> native takes once it can read).
    copy = str(tmp_path / "copy" / "0000000003")
    result = subprocess.run([cli(), "convert", "--to", "native", src, copy], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    got = tensorstash.restore(copy)
    assert_same_array(got["w"], tree["w"], "w")
    assert_same_array(got["n"]["b"], tree["n"]["b"], "b")
    assert got["step"] == 3


def test_convert_an_orbax_checkpoint_to_native_and_back(tmp_path):
    """Orbax writes; convert makes a native step of it (restored bit for bit by tensorstash),
    and converting that back gives a checkpoint Orbax restores bit for bit."""
    m = mesh((2, 4))
    w = pattern((24, 40), np.float32, seed=21)
    tree = {"params": {"w": global_array(w, named(m, "a", "b")),
                       "b": pattern((7,), np.int32, seed=22)},
            "step": 12}
    src = str(tmp_path / "orbax")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(src, tree)
    checkpointer.wait_until_finished()
    native = str(tmp_path / "native")
    result = subprocess.run([cli(), "convert", src, native], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.path.exists(os.path.join(native, "COMMIT"))
    got = tensorstash.restore(native)
    assert_same_array(got["params"]["w"], w, "w")
    assert_same_array(got["params"]["b"], tree["params"]["b"], "b")
    assert got["step"] == 12
    back = str(tmp_path / "back")
    result = subprocess.run([cli(), "convert", native, back], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    m2 = mesh((4, 2))
    target = {"params": {"w": abstract(w, named(m2, "b", "a")),
                         "b": abstract(tree["params"]["b"], named(m2))},
              "step": 0}
    restored = ocp.StandardCheckpointer().restore(back, target)
    assert_jax_array(restored["params"]["w"], w, named(m2, "b", "a"), "w")
    assert_same_array(np.asarray(restored["params"]["b"]), tree["params"]["b"], "b")
    # A damaged source fails the conversion and leaves nothing behind.
    data = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(src, "d")) for f in fs]
    for path in data:
        with open(path, "r+b") as f:
            f.truncate(max(0, os.path.getsize(path) // 2))
    bad = str(tmp_path / "bad")
    result = subprocess.run([cli(), "convert", src, bad], capture_output=True, text=True)
    assert result.returncode != 0
    assert "error" in result.stderr
    assert not os.path.exists(bad)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int64", "bool", "complex64"])
def test_0d_and_empty_arrays(tmp_path, name):
    dt = dtype(name)
    m, m2 = mesh((8,), ("x",)), mesh((2, 2), ("a", "b"))
    zero_d = pattern((), dt, seed=9)
    tree = {"zero_d": global_array(zero_d, named(m)), "np_zero_d": pattern((), dt, seed=10),
            "empty": global_array(np.zeros((0, 3), dt), named(m)),
            "np_empty": np.zeros((4, 0, 2), dt), "one": pattern((1,), dt, seed=11)}
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, tree, format="orbax")
    target = {"zero_d": abstract(zero_d, named(m2)),
              "np_zero_d": abstract(tree["np_zero_d"], named(m2)),
              "empty": abstract(np.zeros((0, 3), dt), named(m2, None, None)),
              "np_empty": abstract(tree["np_empty"], named(m2, "a")),
              "one": abstract(tree["one"], named(m2))}
    got = ocp.StandardCheckpointer().restore(path, target)
    assert_jax_array(got["zero_d"], zero_d, named(m2), "zero_d")
    assert_jax_array(got["np_zero_d"], tree["np_zero_d"], named(m2), "np_zero_d")
    assert_jax_array(got["empty"], np.zeros((0, 3), dt), named(m2, None, None), "empty")
    assert_jax_array(got["np_empty"], tree["np_empty"], named(m2, "a"), "np_empty")
    assert_jax_array(got["one"], tree["one"], named(m2), "one")
    plain = ocp.PyTreeCheckpointer().restore(path)
    assert_same_array(np.asarray(plain["np_empty"]), tree["np_empty"], "np_empty")
