"""Reading Orbax checkpoints (and zarr-group checkpoints) with tensorstash.restore / metadata and
the CLI's inspect / verify: the format is detected, nothing to configure.

Every checkpoint here is written by the real libraries (orbax-checkpoint, TensorStore underneath
it, zarr-python), never by hand: OCDBT + zarr3 (Orbax's default), OCDBT + zarr2, one zarr folder
per parameter (use_ocdbt=False, zarr3 and zarr2), CheckpointManager roots with one or several
items, async and sync saves, custom chunk sizes, and zarr v2 groups named by keystr paths (the
seed layout, docs/foreign_formats.md). Restores are compared bit for bit with what was saved,
onto other meshes than the one that saved, and as NumPy without a target. Damaged checkpoints
must give OSError / ValueError naming what is wrong, and `tensorstash verify` a non-zero exit.

The CLI is $TENSORSTASH_CLI or <repo>/build/tensorstash (cmake --build build --target
tensorstash_cli); a missing CLI fails those tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import tensorstash
from tshelpers import (cli_path, assert_jax_array, assert_restored_numpy, assert_same_array, global_array,
                       mesh, named, pattern)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

DTYPES = ["float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64", "bool", "complex64"]

LAYOUTS = {  # name -> PyTreeCheckpointHandler options
    "ocdbt-zarr3": dict(use_ocdbt=True, use_zarr3=True),
    "ocdbt-zarr2": dict(use_ocdbt=True, use_zarr3=False),
    "folders-zarr3": dict(use_ocdbt=False, use_zarr3=True),
    "folders-zarr2": dict(use_ocdbt=False, use_zarr3=False),
}
FORMAT_OF = {"ocdbt-zarr3": "orbax-ocdbt", "ocdbt-zarr2": "orbax-ocdbt",
             "folders-zarr3": "orbax-zarr-folders", "folders-zarr2": "orbax-zarr-folders"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:  # a flax-like custom pytree node
    w: jax.Array
    b: jax.Array


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def cli() -> str:
    return cli_path()


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([cli(), *map(str, args)], capture_output=True, text=True)


def numpy_tree() -> dict:
    """Every dtype, odd shapes, 0-d arrays, nested lists/tuples/None/dicts and scalars."""
    arrays = {name: pattern((3, 5, 7) if i % 2 else (13,), np_dtype(name), seed=i)
              for i, name in enumerate(DTYPES)}
    return {
        "arrays": arrays,
        "zero_d": np.array(2.5, np.float32),
        "nested": [pattern((2, 3), np.int32, 7), None,
                   (pattern((1, 1, 1, 9), np.float64, 8), {"deep": pattern((4,), np.uint8, 9)})],
        "scalars": {"f": 0.125, "i": -7, "big": 2**40 + 3, "s": "héllo", "np32": np.float32(1.5), "flag": True},
        "empty": {"d": {}, "l": []},
    }


def save_orbax(path: str, tree, layout: str, save_args=None) -> None:
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**LAYOUTS[layout]))
    ckptr.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args))
    ckptr.close()


def sorted_like(tree):
    """`tree` with dict keys in the order Orbax's _METADATA lists them (sorted)."""
    if isinstance(tree, dict):
        return {k: sorted_like(tree[k]) for k in sorted(tree)}
    if isinstance(tree, (list, tuple)):
        return type(tree)(sorted_like(v) for v in tree)
    return tree


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_dtype_and_shape_restores_as_numpy(tmp_path, layout):
    tree = numpy_tree()
    path = str(tmp_path / "ckpt")
    save_orbax(path, tree, layout)
    got = tensorstash.restore(path)
    assert_restored_numpy(got, sorted_like(tree))

    meta = tensorstash.metadata(path)
    for name in DTYPES:
        m = meta["arrays"][name]
        assert isinstance(m, tensorstash.ArrayMetadata)
        assert m.dtype == np_dtype(name) and m.shape == tree["arrays"][name].shape
        assert m.path == f"arrays/{name}" and m.stored_bytes > 0
        assert m.codec.startswith("zarr3" if "zarr3" in layout else "zarr2")
    assert meta["scalars"] == {"big": 2**40 + 3, "f": 0.125, "i": -7, "flag": True, "np32": 1.5, "s": "héllo"}
    assert meta["nested"][1] is None

    reader = tensorstash._restore._open(path, True, 1 << 20, 1)
    assert reader.format == FORMAT_OF[layout]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_numpy_targets_cast_and_pad(tmp_path, layout):
    tree = {"a": pattern((6, 10), np.float32, 1), "n": 3, "t": (pattern((5,), np.int16, 2), None)}
    path = str(tmp_path / "ckpt")
    save_orbax(path, tree, layout)
    target = {"a": np.zeros((8, 10), np.float64), "n": 0, "t": (np.zeros((5,), np.int16), None)}
    got = tensorstash.restore(path, target)
    want = np.zeros((8, 10), np.float64)
    want[:6] = tree["a"]
    assert_same_array(got["a"], want)
    assert got["n"] == 3 and isinstance(got["t"], tuple) and got["t"][1] is None
    assert_same_array(got["t"][0], tree["t"][0])
    with pytest.raises(ValueError, match="larger than the target"):
        tensorstash.restore(path, {"a": np.zeros((4, 10), np.float32)})
    part = tensorstash.restore(path, {"a": np.zeros((4, 10), np.float32)}, truncate=True)
    assert_same_array(part["a"], tree["a"][:4])
    with pytest.raises(KeyError, match="missing"):
        tensorstash.restore(path, {"missing": np.zeros(3, np.float32)})


def sharded_state():
    m = mesh((2, 4), ("x", "y"))
    w = pattern((16, 24), np.float32, 3)
    e = pattern((10, 7), ml_dtypes.bfloat16, 4)  # shards of uneven shapes over y
    i = pattern((8, 4, 6), np.int32, 5)
    state = {
        "layers": [Layer(w=global_array(w, named(m, "x", "y")), b=global_array(e, named(m, "x"))),
                   Layer(w=global_array(i, named(m, None, "y")),
                         b=global_array(np.arange(4, dtype=np.int64), named(m)))],
        "step": global_array(np.array(42, np.int32), named(m)),
    }
    values = {"layers": [Layer(w=w, b=e), Layer(w=i, b=np.arange(4, dtype=np.int64))],
              "step": np.array(42, np.int32)}
    return state, values


def other_shardings(values):
    """Targets on meshes and specs unlike the saving ones (a 4x2 and a 1-d 8 mesh, 3 devices)."""
    m42 = mesh((4, 2), ("p", "q"))
    m8 = mesh((8,), ("r",))
    m3 = mesh((3,), ("s",), devices=jax.devices()[5:8])
    return {
        "layers": [Layer(w=named(m42, "q", "p"), b=named(m8, None, None)),
                   Layer(w=named(m42, "p", None, "q"), b=named(m3))],
        "step": named(m8),
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("chunk_byte_size", [None, 512])
def test_sharded_jax_arrays_onto_other_meshes(tmp_path, layout, chunk_byte_size):
    state, values = sharded_state()
    path = str(tmp_path / "ckpt")
    save_args = None
    if chunk_byte_size is not None:  # many small chunks instead of one per shard
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk_byte_size), state)
    save_orbax(path, state, layout, save_args)
    shardings = other_shardings(values)
    target = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                          values, shardings)
    got = tensorstash.restore(path, target)
    assert isinstance(got["layers"][0], Layer)
    flat_got = jax.tree_util.tree_leaves_with_path(got)
    flat_want = jax.tree_util.tree_leaves(values)
    flat_s = jax.tree_util.tree_leaves(shardings)
    for (p, g), w, s in zip(flat_got, flat_want, flat_s):
        assert_jax_array(g, np.asarray(w), s, jax.tree_util.keystr(p))
    if chunk_byte_size is not None:
        meta = tensorstash.metadata(path)
        assert meta["layers"][0]["w"].num_chunks > 1


def test_standard_checkpointer_async_and_sync(tmp_path):
    state, values = sharded_state()
    for name, ckptr in [("async", ocp.StandardCheckpointer()),
                        ("sync", ocp.Checkpointer(ocp.StandardCheckpointHandler()))]:
        path = str(tmp_path / name)
        ckptr.save(path, state)
        if hasattr(ckptr, "wait_until_finished"):
            ckptr.wait_until_finished()
        ckptr.close()
        got = tensorstash.restore(path)  # as NumPy
        assert_same_array(got["layers"][0]["w"], values["layers"][0].w)
        assert_same_array(got["layers"][1]["w"], values["layers"][1].w)
        assert_same_array(got["step"], values["step"])


@pytest.mark.parametrize("async_save", [True, False])
def test_checkpoint_manager_steps_and_items(tmp_path, async_save):
    state, values = sharded_state()
    root = str(tmp_path / "mgr")
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=async_save)
    with ocp.CheckpointManager(root, options=options) as mgr:
        for step in (1, 2, 3):
            bumped = jax.tree.map(lambda x, step=step: x + step, state)
            mgr.save(step, args=ocp.args.StandardSave(bumped))
        mgr.wait_until_finished()
    target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                         sharding=named(mesh((8,), ("r",)))),
                          values)
    for step in (1, 2, 3):
        for path in (os.path.join(root, str(step)), os.path.join(root, str(step), "default")):
            got = tensorstash.restore(path, target)
            want = np.asarray(values["layers"][0].w) + step
            assert_jax_array(got["layers"][0].w, want, named(mesh((8,), ("r",))), path)

    listing = run_cli("ls", root)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split()[:2] for line in listing.stdout.splitlines()[1:]]
    assert rows == [["1", "orbax-ocdbt"], ["2", "orbax-ocdbt"], ["3", "orbax-ocdbt"]], listing.stdout
    result = run_cli("inspect", os.path.join(root, "3"))
    assert result.returncode == 0 and "format orbax-ocdbt (3/default)" in result.stdout, result.stdout

    # Several items: the step folder names them; each item folder opens.
    multi = str(tmp_path / "multi")
    with ocp.CheckpointManager(multi, options=options) as mgr:
        mgr.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            extra=ocp.args.StandardSave({"x": np.arange(3)})))
        mgr.wait_until_finished()
    with pytest.raises(ValueError, match="several items"):
        tensorstash.restore(os.path.join(multi, "5"))
    assert_same_array(tensorstash.restore(os.path.join(multi, "5", "extra"))["x"], np.arange(3))
    got = tensorstash.restore(os.path.join(multi, "5", "state"))
    assert_same_array(got["layers"][1]["b"], values["layers"][1].b)


def write_seed(path: str, tree, completed: bool = True) -> None:
    """The seed layout: a zarr v2 group, one blosc array per leaf named by its keystr path, and
    `write_completed` in the group's attributes as the commit mark (written last)."""
    import numcodecs
    import zarr
    root = zarr.open_group(path, mode="w-", zarr_format=2)
    for p, leaf in jax.tree_util.tree_leaves_with_path(tree):
        leaf = np.asarray(leaf)
        chunks = tuple(max(1, (s + 1) // 2) for s in leaf.shape)
        arr = root.create_array(jax.tree_util.keystr(p), shape=leaf.shape, dtype=leaf.dtype,
                                chunks=chunks, compressors=numcodecs.Blosc(cname="lz4"))
        arr[...] = leaf
    if completed:
        root.attrs["write_completed"] = True


def test_seed_zarr_group_layout(tmp_path):
    values = {"params": {"w": pattern((6, 8), np.float32, 1), "b": pattern((9,), np.int64, 2)},
              "opt": [pattern((3, 3), np.float64, 3), {"mu": pattern((5,), np.uint8, 4)}],
              "layer": Layer(w=pattern((2, 2), np.int16, 5), b=pattern((), np.float32, 6))}
    path = str(tmp_path / "0000000100")
    write_seed(path, values)
    got = tensorstash.restore(path)
    assert_same_array(got["params"]["w"], values["params"]["w"])
    assert_same_array(got["params"]["b"], values["params"]["b"])
    assert_same_array(got["opt"][0], values["opt"][0])
    assert_same_array(got["opt"][1]["mu"], values["opt"][1]["mu"])
    assert_same_array(got["layer"]["w"], values["layer"].w)
    assert_same_array(got["layer"]["b"], values["layer"].b)
    assert tensorstash._restore._open(path, True, 1 << 20, 1).format == "zarr-group"

    m = mesh((2, 2), ("x", "y"))
    target = {"params": {"w": jax.ShapeDtypeStruct((6, 8), jnp.float32, sharding=named(m, "y", "x")),
                         "b": np.zeros(9, np.int64)}}
    got = tensorstash.restore(path, target)
    assert_jax_array(got["params"]["w"], values["params"]["w"], named(m, "y", "x"))

    result = run_cli("verify", path)
    assert result.returncode == 0 and result.stdout.startswith("OK: "), result.stdout + result.stderr

    incomplete = str(tmp_path / "0000000200")
    write_seed(incomplete, values, completed=False)
    listing = run_cli("ls", str(tmp_path)).stdout.splitlines()
    assert [line.split()[:2] for line in listing[1:]] == [["0000000100", "zarr-group"],
                                                          ["0000000200", "incomplete"]], listing
    with pytest.raises(ValueError, match="write_completed"):
        tensorstash.restore(incomplete)
    result = run_cli("verify", incomplete)
    assert result.returncode == 2 and "write_completed" in result.stderr


def test_cli_inspect_and_verify(tmp_path):
    tree = numpy_tree()
    for layout in LAYOUTS:
        path = str(tmp_path / layout)
        save_orbax(path, tree, layout)
        result = run_cli("inspect", path)
        assert result.returncode == 0, result.stderr
        assert f"format {FORMAT_OF[layout]}" in result.stdout
        assert any(line.split()[:2] == ["arrays/bfloat16", "bfloat16"]
                   for line in result.stdout.splitlines()), result.stdout
        doc = json.loads(run_cli("inspect", "--json", path).stdout)
        assert doc["format"] == FORMAT_OF[layout]
        paths = {a["path"]: a for a in doc["arrays"]}
        assert paths["arrays/int16"]["shape"] == [3, 5, 7]
        assert paths["nested/2/1/deep"]["dtype"] == "uint8"
        result = run_cli("verify", path)
        assert result.returncode == 0 and result.stdout.startswith("OK: "), result.stdout


# --- Damage --------------------------------------------------------------------------------------

def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def data_files(path: str) -> list[str]:
    out = []
    for d, _, names in os.walk(path):
        if os.path.basename(d) == "d":
            out += [os.path.join(d, n) for n in names]
    return sorted(out)


def big_tree():
    return {"w": pattern((64, 64), np.float32, 1), "v": pattern((1000,), np.int32, 2)}


def test_flipped_bytes_in_ocdbt_data_files(tmp_path):
    """Each data file damaged in turn (its first byte: a node's magic or a value's zstd frame).
    Orbax merges the per-process databases into the top-level one, whose tree reaches the
    processes' values but not their own B+tree nodes: damage to those leaves restores intact
    (nothing damaged is read), and verify reports it when it is part of a process's latest
    version. Node files of older versions of a process's database are unreachable garbage: no
    reader (TensorStore included) reads them."""
    clean = str(tmp_path / "clean")
    save_orbax(clean, big_tree(), "ocdbt-zarr3")
    files = [os.path.relpath(f, clean) for f in data_files(clean)]
    assert len(files) >= 2
    restore_failed = named_chunk = 0
    for i, rel in enumerate(files):
        path = str(tmp_path / f"bad{i}")
        shutil.copytree(clean, path)
        flip(os.path.join(path, rel), 0)
        result = run_cli("verify", path)
        try:
            got = tensorstash.restore(path)
        except OSError as e:
            assert "OCDBT" in str(e) or "chunk" in str(e), str(e)
            restore_failed += 1
            assert result.returncode != 0, (rel, result.stdout)
        else:
            assert_same_array(got["w"], big_tree()["w"])
            assert_same_array(got["v"], big_tree()["v"])
        named_chunk += any(line.startswith(("BAD  w chunk", "BAD  v chunk"))
                           for line in result.stdout.splitlines())
    assert restore_failed >= 2, "the top-level node file and a value file must both be read"
    assert named_chunk >= 1, "no damaged value file was reported as a bad chunk of an array"


def test_flipped_byte_in_zarr_folder_chunk(tmp_path):
    path = str(tmp_path / "ckpt")
    save_orbax(path, big_tree(), "folders-zarr3")
    flip(os.path.join(path, "w", "c", "0", "0"), 0)
    with pytest.raises(OSError, match="w/c/0/0"):
        tensorstash.restore(path)
    assert_same_array(tensorstash.restore(path, {"v": np.zeros(1000, np.int32)})["v"],
                      big_tree()["v"])
    result = run_cli("verify", path)
    assert result.returncode == 1
    assert "BAD  w chunk [0, 0]" in result.stdout and "FAILED: 1 of" in result.stdout


def test_truncated_manifest(tmp_path):
    path = str(tmp_path / "ckpt")
    save_orbax(path, big_tree(), "ocdbt-zarr3")
    manifest = os.path.join(path, "manifest.ocdbt")
    with open(manifest, "r+b") as f:
        f.truncate(os.path.getsize(manifest) // 2)
    with pytest.raises(OSError, match="manifest.ocdbt"):
        tensorstash.restore(path)
    result = run_cli("verify", path)
    assert result.returncode == 2 and "manifest.ocdbt" in result.stderr


def test_broken_metadata_json(tmp_path):
    path = str(tmp_path / "ckpt")
    save_orbax(path, big_tree(), "ocdbt-zarr3")
    with open(os.path.join(path, "_METADATA"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, "_METADATA")) - 5)
    with pytest.raises(OSError, match="_METADATA"):
        tensorstash.restore(path)
    with pytest.raises(OSError, match="_METADATA"):
        tensorstash.metadata(path)
    result = run_cli("inspect", path)
    assert result.returncode == 2 and "_METADATA" in result.stderr


def test_missing_parameter_folder(tmp_path):
    path = str(tmp_path / "ckpt")
    save_orbax(path, big_tree(), "folders-zarr2")
    shutil.rmtree(os.path.join(path, "v"))
    with pytest.raises(OSError, match="'v'"):
        tensorstash.restore(path)


def test_unfinished_orbax_folders(tmp_path):
    path = str(tmp_path / "ckpt.orbax-checkpoint-tmp-1234")
    save_orbax(str(tmp_path / "ckpt"), big_tree(), "ocdbt-zarr3")
    shutil.copytree(str(tmp_path / "ckpt"), path)
    with pytest.raises(ValueError, match="temporary folder of an Orbax save"):
        tensorstash.restore(path)
    os.remove(os.path.join(tmp_path, "ckpt", "_METADATA"))
    with pytest.raises(ValueError, match="without _METADATA"):
        tensorstash.restore(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("edit, error, match", [
    (lambda m: m["tree_metadata"]["('w',)"]["key_metadata"][0].update(key_type=1), OSError,
     "sequence key 'w' is not an index"),
    (lambda m: m["tree_metadata"]["('w',)"]["key_metadata"][0].update(key_type=7), OSError,
     "unknown key_type 7"),
    (lambda m: m["tree_metadata"]["('w',)"]["key_metadata"].append({"key": "x", "key_type": 2}),
     OSError, "param 'w.x'|'w.x'"),
    (lambda m: m["tree_metadata"]["('w',)"]["value_metadata"].update(value_type="MyType"),
     NotImplementedError, "value type 'MyType'"),
    (lambda m: m.pop("tree_metadata"), OSError, "no \"tree_metadata\""),
    (lambda m: m["tree_metadata"]["('w',)"].pop("value_metadata"), OSError, "value_metadata"),
])
def test_hostile_metadata_edits(tmp_path, edit, error, match):
    """A real _METADATA, edited: each inconsistency is a clear error naming what, never a crash."""
    path = str(tmp_path / "ckpt")
    save_orbax(path, big_tree(), "ocdbt-zarr3")
    meta_path = os.path.join(path, "_METADATA")
    with open(meta_path) as f:
        meta = json.load(f)
    edit(meta)
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(error, match=match):
        tensorstash.restore(path)
    assert run_cli("verify", path).returncode == 2
