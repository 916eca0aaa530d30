"""Restore as saved (issue 38 part 3): each jax.Array's sharding is recorded at save (mesh
shape, axis names, partition spec, device order), metadata() gives it as `.sharding` when this
process's devices can hold it, and restore(path, target=metadata(path)) places every array on
it; Orbax's `_sharding` is read and written the same way. 8 CPU devices (conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import tensorstash
from tshelpers import global_array, pattern

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def make_mesh(shape, names, order=None):
    devices = np.array(jax.devices() if order is None else [jax.devices()[i] for i in order])
    return jax.sharding.Mesh(devices.reshape(shape), names)


# name: (array shape, mesh shape, axis names, partition spec, device order)
CASES = {
    "8x1_rows": ((16, 6), (8, 1), ("data", "model"), P("data", None), None),
    "8x1_cols_on_model": ((16, 6), (8, 1), ("data", "model"), P(None, "model"), None),
    "2x4_both": ((16, 24), (2, 4), ("a", "b"), P("a", "b"), None),
    "2x4_tuple_of_axes": ((16, 24), (2, 4), ("a", "b"), P(("a", "b"), None), None),
    "2x4_tuple_swapped": ((16, 24), (2, 4), ("a", "b"), P(None, ("b", "a")), None),
    "2x4_replicated": ((16, 24), (2, 4), ("a", "b"), P(), None),
    "2x4_partly_replicated": ((4, 24), (2, 4), ("a", "b"), P(None, "b"), None),
    "2x4_reversed_devices": ((16, 24), (2, 4), ("a", "b"), P("a", "b"), [7, 6, 5, 4, 3, 2, 1, 0]),
    "3d_over_2x4": ((4, 8, 6), (2, 4), ("x", "y"), P("y", None, "x"), None),
}


def step(tmp_path, n: int = 1) -> str:
    return str(tmp_path / "run" / f"{n:010d}")


def assert_on(got, want_values, sharding):
    assert isinstance(got, jax.Array), type(got)
    assert got.sharding == sharding, (got.sharding, sharding)
    assert got.dtype == want_values.dtype and got.shape == want_values.shape
    np.testing.assert_array_equal(np.asarray(got), want_values)
    for shard in got.addressable_shards:  # each device holds its own block
        np.testing.assert_array_equal(np.asarray(shard.data), want_values[shard.index])


@pytest.mark.parametrize("name", sorted(CASES))
def test_restore_with_metadata_target_gives_the_saved_sharding(tmp_path, name):
    shape, mesh_shape, names, spec, order = CASES[name]
    sharding = NamedSharding(make_mesh(mesh_shape, names, order), spec)
    values = pattern(shape, np.float32, seed=3)
    tree = {"params": {"w": global_array(values, sharding)}, "count": np.arange(3)}
    path = step(tmp_path)
    tensorstash.save(path, tree)

    meta = tensorstash.metadata(path)
    m = meta["params"]["w"]
    assert m.sharding == sharding
    assert m.saved_sharding["sharding_type"] == "NamedSharding"
    assert m.saved_sharding["shape"] == list(mesh_shape)
    assert m.saved_sharding["axis_names"] == list(names)
    # The device order is recorded only where it is not 0..n-1.
    assert ("device_mesh" in m.saved_sharding) == (order is not None)
    # A NumPy array records no sharding, and restores as a NumPy array.
    assert meta["count"].sharding is None and meta["count"].saved_sharding is None

    got = tensorstash.restore(path, target=meta)
    assert_on(got["params"]["w"], values, sharding)
    assert isinstance(got["count"], np.ndarray)
    np.testing.assert_array_equal(got["count"], np.arange(3))

    # Without a target: what it gave before (NumPy arrays), unchanged.
    plain = tensorstash.restore(path)
    assert isinstance(plain["params"]["w"], np.ndarray)
    np.testing.assert_array_equal(plain["params"]["w"], values)


def test_device_order_is_kept(tmp_path):
    order = [3, 1, 2, 0, 7, 5, 6, 4]
    sharding = NamedSharding(make_mesh((2, 4), ("a", "b"), order), P("a", "b"))
    values = pattern((8, 8), np.int32)
    path = step(tmp_path)
    tensorstash.save(path, {"x": global_array(values, sharding)})
    m = tensorstash.metadata(path)["x"]
    assert [d.id for d in m.sharding.mesh.devices.flat] == order
    got = tensorstash.restore(path, target=tensorstash.metadata(path))["x"]
    assert_on(got, values, sharding)
    # Device 3 holds block (0, 0), as it did when saved.
    by_device = {s.device.id: s.index for s in got.addressable_shards}
    assert by_device[3] == (slice(0, 4), slice(0, 2))


def test_single_device_and_mixed_tree(tmp_path):
    dev = jax.devices()[5]
    single = jax.device_put(np.arange(10.0), SingleDeviceSharding(dev))
    sharding = NamedSharding(make_mesh((8,), ("d",)), P("d"))
    values = pattern((16, 2), np.int16)
    tree = {"single": single, "sharded": global_array(values, sharding), "n": 3, "s": "text"}
    path = step(tmp_path)
    tensorstash.save(path, tree)
    meta = tensorstash.metadata(path)
    assert meta["single"].sharding == SingleDeviceSharding(dev)
    got = tensorstash.restore(path, target=meta)
    assert_on(got["single"], np.arange(10.0), SingleDeviceSharding(dev))
    assert_on(got["sharded"], values, sharding)
    assert got["n"] == 3 and got["s"] == "text"


def test_prng_key_array_restores_on_its_saved_sharding(tmp_path):
    sharding = NamedSharding(make_mesh((2, 4), ("a", "b")), P("b"))
    keys = jax.device_put(jax.random.split(jax.random.key(7, impl="rbg"), 8), sharding)
    path = step(tmp_path)
    tensorstash.save(path, {"rng": keys})
    m = tensorstash.metadata(path)["rng"]
    assert m.shape == (8,) and m.sharding == sharding
    got = tensorstash.restore(path, target=tensorstash.metadata(path))["rng"]
    assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
    assert got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)),
                                  np.asarray(jax.random.key_data(keys)))


def test_manager_roundtrip_as_saved(tmp_path):
    sharding = NamedSharding(make_mesh((2, 4), ("a", "b")), P(("a", "b")))
    values = pattern((32,), np.float32)
    with tensorstash.CheckpointManager(str(tmp_path / "mgr")) as mgr:
        mgr.save(1, {"w": global_array(values, sharding)})
        mgr.wait_until_finished()
    meta = tensorstash.metadata(str(tmp_path / "mgr" / f"{1:010d}"))
    with tensorstash.CheckpointManager(str(tmp_path / "mgr")) as mgr:
        got = mgr.restore(1, target=meta)
    assert_on(got["w"], values, sharding)


def cli_path() -> str:
    cli = os.environ.get("TENSORSTASH_CLI", os.path.join(REPO, "build", "tensorstash"))
    if not os.access(cli, os.X_OK):
        pytest.fail(f"{cli} is missing: build the tensorstash target or set TENSORSTASH_CLI")
    return cli


def test_inspect_shows_the_sharding(tmp_path):
    cli = cli_path()
    sharding = NamedSharding(make_mesh((2, 4), ("a", "b"), [1, 0, 2, 3, 4, 5, 6, 7]),
                             P(("a", "b"), None))
    path = step(tmp_path)
    tensorstash.save(path, {"w": global_array(pattern((8, 3), np.float32), sharding),
                            "plain": np.zeros(2)})
    text = subprocess.run([cli, "inspect", path], capture_output=True, text=True, check=True)
    assert "NamedSharding mesh (2, 4) axes (a, b) spec ((a, b), None) devices [1, 0, 2" \
        in text.stdout, text.stdout
    doc = json.loads(subprocess.run([cli, "inspect", "--json", path], capture_output=True,
                                    text=True, check=True).stdout)
    arrays = {a["path"]: a for a in doc["arrays"]}
    assert arrays["w"]["sharding"]["partition_spec"] == [["a", "b"], None]
    assert arrays["w"]["sharding"]["axis_names"] == ["a", "b"]
    assert "sharding" not in arrays["plain"]


FEWER_DEVICES = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import tensorstash
    import jax
    assert jax.device_count() == 4
    path = sys.argv[1]
    meta = tensorstash.metadata(path)
    m = meta["w"]
    out = {"sharding": None if m.sharding is None else str(m.sharding),
           "saved": m.saved_sharding}
    got = tensorstash.restore(path, target=meta)
    out["target_meta"] = type(got["w"]).__name__
    plain = tensorstash.restore(path)
    out["plain_ok"] = bool(np.array_equal(plain["w"], np.arange(64.0).reshape(8, 8)))
    # The clear path: a mesh of this job's devices, from what was recorded.
    saved = m.saved_sharding
    mesh = jax.make_mesh((2, 2), tuple(saved["axis_names"]))
    spec = jax.sharding.PartitionSpec(*[tuple(p) if isinstance(p, list) else p
                                        for p in saved["partition_spec"]])
    target = jax.ShapeDtypeStruct(m.shape, m.dtype,
                                  sharding=jax.sharding.NamedSharding(mesh, spec))
    again = tensorstash.restore(path, target={"w": target})["w"]
    out["again_ok"] = bool(np.array_equal(np.asarray(again), np.arange(64.0).reshape(8, 8)))
    print(json.dumps(out))
""")


def test_fewer_devices_gives_no_sharding_and_a_clear_path(tmp_path):
    sharding = NamedSharding(make_mesh((2, 4), ("a", "b")), P("a", "b"))
    path = step(tmp_path)
    tensorstash.save(path, {"w": global_array(np.arange(64.0).reshape(8, 8), sharding)})
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        [f for f in env.get("XLA_FLAGS", "").split()
         if "xla_force_host_platform_device_count" not in f]
        + ["--xla_force_host_platform_device_count=4"])
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_ENABLE_X64"] = "1"
    result = subprocess.run([sys.executable, "-c", FEWER_DEVICES, path], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["sharding"] is None
    assert out["saved"]["shape"] == [2, 4] and out["saved"]["axis_names"] == ["a", "b"]
    assert out["target_meta"] == "ndarray"  # no sharding: the metadata target gives NumPy
    assert out["plain_ok"] and out["again_ok"]


def test_orbax_writes_we_read_the_sharding(tmp_path):
    sharding = NamedSharding(make_mesh((2, 4), ("a", "b"), [4, 5, 6, 7, 0, 1, 2, 3]),
                             P(None, ("a", "b")))
    values = pattern((4, 16), np.float32)
    other = NamedSharding(make_mesh((8, 1), ("x", "y")), P("y", "x"))
    tree = {"w": global_array(values, sharding), "v": global_array(values, other)}
    path = str(tmp_path / "orbax")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, tree)
    ckptr.wait_until_finished()
    ckptr.close()
    meta = tensorstash.metadata(path)
    assert meta["w"].sharding == sharding
    assert meta["v"].sharding == other
    got = tensorstash.restore(path, target=meta)
    assert_on(got["w"], values, sharding)
    assert_on(got["v"], values, other)
    # inspect reads the same `_sharding`.
    doc = json.loads(subprocess.run([cli_path(), "inspect", "--json", path], capture_output=True,
                                    text=True, check=True).stdout)
    arrays = {a["path"]: a for a in doc["arrays"]}
    assert arrays["w"]["sharding"]["partition_spec"] == [None, ["a", "b"]]
    assert arrays["v"]["sharding"]["axis_names"] == ["x", "y"]


def test_we_write_orbax_and_orbax_sees_the_sharding(tmp_path):
    sharding = NamedSharding(make_mesh((2, 4), ("a", "b"), [0, 2, 4, 6, 1, 3, 5, 7]),
                             P("b", "a"))
    values = pattern((8, 4), np.int32)
    path = str(tmp_path / "ours")
    tensorstash.save(path, {"w": global_array(values, sharding)}, format="orbax")
    # Orbax's own metadata and its restore without a target.
    ckptr = ocp.StandardCheckpointer()
    orbax_meta = ckptr.metadata(path)
    tree_meta = getattr(orbax_meta, "item_metadata", orbax_meta)
    assert tree_meta["w"].sharding.to_jax_sharding() == sharding
    restored = ckptr.restore(path)
    ckptr.close()
    assert restored["w"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(restored["w"]), values)
    # And ours of the same folder.
    assert tensorstash.metadata(path)["w"].sharding == sharding
    assert_on(tensorstash.restore(path, target=tensorstash.metadata(path))["w"], values,
              sharding)
