"""Typed PRNG key arrays (jax.random.key; issue 38 part 1): saved as their key data with the
implementation's name, restored as keys of the same implementation, with a key target on its
sharding, without a target, and with metadata() as the target; Orbax checkpoints that hold
keys restore as keys; hostile targets are ValueErrors naming the leaf."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import tensorstash

IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]


def mesh():
    return jax.make_mesh((4, 2), ("a", "b"))


def keys(impl: str, seed: int, sharded: bool) -> jax.Array:
    k = jax.random.split(jax.random.key(seed, impl=impl), 8)
    if sharded:
        k = jax.device_put(k, NamedSharding(mesh(), P("a")))
    return k


def assert_same_keys(got, want) -> None:
    assert isinstance(got, jax.Array)
    assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
    assert str(jax.random.key_impl(got)) == str(jax.random.key_impl(want))
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)),
                                  np.asarray(jax.random.key_data(want)))


def step(tmp_path, n: int = 1) -> str:
    return str(tmp_path / "run" / f"{n:010d}")


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_roundtrip_every_impl(tmp_path, impl, sharded):
    tree = {"rngs": {"default": {"key": keys(impl, 3, sharded),
                                 "count": np.array(7, np.uint32)}},
            "one": jax.random.key(11, impl=impl), "w": np.arange(6.0)}
    path = step(tmp_path)
    tensorstash.save(path, tree)

    # Without a target: keys of the same implementation on the default device.
    plain = tensorstash.restore(path)
    assert_same_keys(plain["rngs"]["default"]["key"], tree["rngs"]["default"]["key"])
    assert_same_keys(plain["one"], tree["one"])
    np.testing.assert_array_equal(plain["w"], tree["w"])
    assert set(plain["rngs"]["default"]) == {"key", "count"}

    # metadata() describes the leaf as keys, and is a target.
    meta = tensorstash.metadata(path)
    m = meta["rngs"]["default"]["key"]
    assert m.path == "rngs/default/key" and m.shape == (8,)
    assert m.dtype == tree["rngs"]["default"]["key"].dtype
    assert meta["one"].shape == () and meta["one"].dtype == tree["one"].dtype
    again = tensorstash.restore(path, target=meta)
    assert_same_keys(again["rngs"]["default"]["key"], tree["rngs"]["default"]["key"])
    assert_same_keys(again["one"], tree["one"])

    # With a target: on the target's sharding.
    restored = tensorstash.restore(path, target=tree)
    got = restored["rngs"]["default"]["key"]
    assert_same_keys(got, tree["rngs"]["default"]["key"])
    assert got.sharding == tree["rngs"]["default"]["key"].sharding
    # The restored keys work as keys, drawing what the saved ones draw.
    np.testing.assert_array_equal(np.asarray(jax.random.uniform(plain["one"], (3,))),
                                  np.asarray(jax.random.uniform(tree["one"], (3,))))


@pytest.mark.parametrize("impl", IMPLS)
def test_abstract_target_with_another_sharding(tmp_path, impl):
    saved = keys(impl, 5, sharded=True)
    path = step(tmp_path)
    tensorstash.save(path, {"k": saved})
    sharding = NamedSharding(mesh(), P("b"))
    target = {"k": jax.ShapeDtypeStruct((8,), saved.dtype, sharding=sharding)}
    got = tensorstash.restore(path, target=target)["k"]
    assert_same_keys(got, saved)
    assert got.sharding == sharding
    assert {s.data.shape for s in got.addressable_shards} == {(4,)}


def test_keys_as_a_custom_pytree_node_state(tmp_path):
    # The shape of an NNX state's RNG streams (flax is not installed here): a dataclass pytree
    # of a key and a counter, as nnx.Rngs holds them.
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Stream:
        key: jax.Array
        count: jax.Array

    state = {"dropout": Stream(jax.random.key(1), jax.numpy.array(3, jax.numpy.uint32)),
             "params": Stream(jax.random.key(2, impl="rbg"), jax.numpy.array(0, jax.numpy.uint32))}
    path = step(tmp_path)
    tensorstash.save(path, state)
    got = tensorstash.restore(path, target=state)
    assert isinstance(got["dropout"], Stream)
    assert_same_keys(got["dropout"].key, state["dropout"].key)
    assert_same_keys(got["params"].key, state["params"].key)
    assert int(got["dropout"].count) == 3


def test_manager_roundtrip(tmp_path):
    tree = {"key": keys("rbg", 9, sharded=True), "x": np.ones(4, np.float32)}
    with tensorstash.CheckpointManager(str(tmp_path / "mgr")) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        got = mgr.restore(1, target=tree)
    assert_same_keys(got["key"], tree["key"])
    assert got["key"].sharding == tree["key"].sharding


@pytest.mark.parametrize("impl", IMPLS)
def test_orbax_checkpoint_with_keys_restores_keys(tmp_path, impl):
    tree = {"k": keys(impl, 4, sharded=True), "one": jax.random.key(2, impl=impl),
            "x": jax.numpy.arange(4.0)}
    path = str(tmp_path / "orbax")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, tree)
    ckptr.wait_until_finished()
    ckptr.close()
    # Orbax recorded the implementation (what this test depends on).
    with open(os.path.join(path, "array_metadatas", "process_0")) as f:
        recorded = {e["array_metadata"]["param_name"]: e["array_metadata"]["ext_metadata"]
                    for e in json.load(f)["array_metadatas"]}
    assert recorded["k"] == {"random_key_impl": impl}

    plain = tensorstash.restore(path)
    assert_same_keys(plain["k"], tree["k"])
    assert_same_keys(plain["one"], tree["one"])
    np.testing.assert_array_equal(np.asarray(plain["x"]), np.arange(4.0))
    got = tensorstash.restore(path, target=tree)
    assert_same_keys(got["k"], tree["k"])
    assert got["k"].sharding == tree["k"].sharding
    meta = tensorstash.metadata(path)
    assert meta["k"].dtype == tree["k"].dtype and meta["k"].shape == (8,)
    assert_same_keys(tensorstash.restore(path, target=meta)["k"], tree["k"])


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_orbax_format_writes_keys_orbax_restores_as_keys(tmp_path, impl, sharded):
    tree = {"rngs": {"k": keys(impl, 6, sharded)}, "one": jax.random.key(3, impl=impl),
            "x": jax.numpy.arange(4.0)}
    path = step(tmp_path)
    tensorstash.save(path, tree, format="orbax")
    with open(os.path.join(path, "array_metadatas", "process_0")) as f:
        recorded = {e["array_metadata"]["param_name"]: e["array_metadata"]["ext_metadata"]
                    for e in json.load(f)["array_metadatas"]}
    assert recorded == {"rngs.k": {"random_key_impl": impl}, "one": {"random_key_impl": impl},
                        "x": None}
    ckptr = ocp.StandardCheckpointer()
    with_target = ckptr.restore(path, tree)
    without = ckptr.restore(path)
    ckptr.close()
    for got in (with_target, without):
        assert_same_keys(got["rngs"]["k"], tree["rngs"]["k"])
        assert got["rngs"]["k"].sharding == tree["rngs"]["k"].sharding
        assert_same_keys(got["one"], tree["one"])
    # And tensorstash reads its own Orbax output as keys.
    assert_same_keys(tensorstash.restore(path)["rngs"]["k"], tree["rngs"]["k"])
    got = tensorstash.restore(path, target=tree)["rngs"]["k"]
    assert_same_keys(got, tree["rngs"]["k"])
    assert got.sharding == tree["rngs"]["k"].sharding


def test_key_target_for_plain_array_and_back(tmp_path):
    path = step(tmp_path)
    tensorstash.save(path, {"k": jax.random.key(0), "w": np.zeros((8, 2), np.uint32),
                            "n": 3})
    with pytest.raises(ValueError, match=r"'w'.*not PRNG keys.*key array"):
        tensorstash.restore(path, target={"w": jax.random.split(jax.random.key(1), 8)})
    with pytest.raises(ValueError, match=r"'n'.*not PRNG keys"):
        tensorstash.restore(path, target={"n": jax.random.key(1)})
    with pytest.raises(ValueError, match=r"'k'.*holds PRNG keys.*not a key array"):
        tensorstash.restore(path, target={"k": np.zeros(2, np.uint32)})
    with pytest.raises(ValueError, match=r"'k'.*holds PRNG keys.*not a key array"):
        tensorstash.restore(path, target={"k": jax.ShapeDtypeStruct((), np.uint32)})
    with pytest.raises(ValueError, match=r"'k'.*'threefry2x32'.*'rbg'"):
        tensorstash.restore(path, target={"k": jax.random.key(1, impl="rbg")})
    with pytest.raises(ValueError, match=r"PRNG key array 'k'.*has shape \(\);.*\(3,\)"):
        tensorstash.restore(path, target={"k": jax.random.split(jax.random.key(1), 3)})


def test_reserved_key_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        tensorstash.save(step(tmp_path), {"a": {"__tensorstash_prng_key__": "rbg",
                                                "key_data": np.zeros(4, np.uint32)}})
    assert not os.path.exists(step(tmp_path))


def test_older_reader_view_is_the_data_and_the_name(tmp_path):
    # What a reader that knows nothing of keys finds: a dict of the implementation's name and
    # the uint32 key data (the engine's own view of the tree, before keys are marked).
    path = step(tmp_path)
    k = keys("threefry2x32", 1, sharded=False)
    tensorstash.save(path, {"k": k})
    root, name = os.path.split(path)
    with contextlib.closing(tensorstash._ext.Reader(root, name)) as reader:
        node = reader.tree()
        arrays = {a["path"]: a for a in reader.arrays()}
    entries = dict(node["entries"])["k"]["entries"]
    assert entries[0] == ["__tensorstash_prng_key__", {"kind": "string", "value": "threefry2x32"}]
    assert entries[1][0] == "key_data"
    assert arrays["k/key_data"]["dtype"] == "uint32"
    assert tuple(arrays["k/key_data"]["shape"]) == (8, 2)


def test_cli_inspect_names_the_key_arrays(tmp_path):
    cli = os.environ.get("TENSORSTASH_CLI", os.path.join(os.path.dirname(__file__), "..", "..",
                                                         "build", "tensorstash"))
    if not os.access(cli, os.X_OK):
        pytest.fail(f"{cli} is missing: build the tensorstash target, or set TENSORSTASH_CLI")
    path = step(tmp_path)
    tensorstash.save(path, {"rngs": {"k": keys("rbg", 1, sharded=True)}, "x": np.ones(2)})
    text = subprocess.run([cli, "inspect", path], capture_output=True, text=True, check=True).stdout
    assert "rngs/k/key_data" in text
    assert re.search(r"^PRNG key arrays .*\n  rngs/k  rbg$", text, re.M), text
    doc = json.loads(subprocess.run([cli, "inspect", "--json", path], capture_output=True,
                                    text=True, check=True).stdout)
    by_path = {a["path"]: a for a in doc["arrays"]}
    assert by_path["rngs/k/key_data"]["prng_key_impl"] == "rbg"
    assert "prng_key_impl" not in by_path["x"]
