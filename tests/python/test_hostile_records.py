"""Hostile records beside the arrays (issue 38's review): what a checkpoint records for the
Python front to interpret (a sharding, Orbax's `_sharding`, `array_metadatas`,
`_CHECKPOINT_METADATA`, a metrics item, typed dict keys) may be absurd, malformed or point
outside the step; the front must never crash, run out of memory or read elsewhere, and a
restore target must not answer a misspelt path with its own value."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import tensorstash
from tensorstash import _tree
from tensorstash import jax as tjax


def sharded(values: np.ndarray):
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    return jax.device_put(values, NamedSharding(mesh, P("a", "b")))


@pytest.mark.parametrize("record", [
    # A mesh of 4e9 devices: never expanded into a list of ids.
    {"sharding_type": "NamedSharding", "shape": [4_000_000_000], "axis_names": ["x"],
     "partition_spec": []},
    # Beyond int64, and a product that wraps int64 around.
    {"sharding_type": "NamedSharding", "shape": [18446744073709551615], "axis_names": ["x"],
     "partition_spec": []},
    {"sharding_type": "NamedSharding", "shape": [4294967297, 4294967296],
     "axis_names": ["x", "y"], "partition_spec": []},
    {"sharding_type": "NamedSharding", "shape": [2, 4], "axis_names": ["a"],
     "partition_spec": ["a"]},
    {"sharding_type": "NamedSharding", "shape": [8], "axis_names": ["a"],
     "partition_spec": ["a"], "device_mesh": {"mesh": [{"id": "zero"}]}},
    {"sharding_type": "SingleDeviceSharding", "device_id": 10**40},
])
def test_absurd_sharding_records_give_none(record):
    assert tjax.sharding_from_text(json.dumps(record)) is None


def test_deeply_nested_sharding_text_gives_none():
    deep = "[" * 5000 + "]" * 5000
    assert tjax.sharding_from_text('{"sharding_type": "NamedSharding", "shape": ' + deep + "}") \
        is None


def test_hostile_orbax_side_files_are_ignored_not_fatal(tmp_path):
    """An Orbax checkpoint whose `_sharding` and `array_metadatas/process_0` are absurd, nested
    past Python's recursion limit or not JSON still restores (without the shardings and key
    implementations those files would have given)."""
    values = np.arange(64, dtype=np.float32).reshape(8, 8)
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, {"w": sharded(values)}, format="orbax")
    nested = "[" * 5000 + "]" * 5000
    absurd = json.dumps({"sharding_type": "NamedSharding", "shape": [4_000_000_000],
                         "axis_names": ["x"], "partition_spec": []})
    for sharding, arrays in ((nested, nested), ("{not json", b"\xff\xfe"),
                             (json.dumps({k: absurd for k in _sharding_keys(path)}), "[]")):
        with open(os.path.join(path, "_sharding"), "w") as f:
            f.write(sharding)
        with open(os.path.join(path, "array_metadatas", "process_0"), "wb") as f:
            f.write(arrays if isinstance(arrays, bytes) else arrays.encode())
        meta = tensorstash.metadata(path)
        assert meta["w"].shape == (8, 8) and meta["w"].sharding is None
        np.testing.assert_array_equal(np.asarray(tensorstash.restore(path)["w"]), values)


def _sharding_keys(path: str) -> list[str]:
    with open(os.path.join(path, "_sharding")) as f:
        return list(json.load(f))


def test_item_names_outside_the_step_are_refused(tmp_path):
    """_CHECKPOINT_METADATA names the items of an Orbax step; one that is not a folder of the
    step ("../5/default", an absolute path) is refused, never followed to another step's data."""
    root = tmp_path / "run"
    with tensorstash.CheckpointManager(root, format="orbax", async_save=False) as mgr:
        mgr.save(5, {"w": np.full((3,), 5.0, np.float32)})
        mgr.save(7, {"w": np.full((3,), 7.0, np.float32)})
        step7 = mgr.step_path(7)
    meta_path = os.path.join(step7, "_CHECKPOINT_METADATA")
    with open(meta_path) as f:
        meta = json.load(f)
    for name in ("../5/default", str(root / "5" / "default"), ".."):
        meta["item_handlers"] = {name: "orbax.checkpoint._src.handlers."
                                       "standard_checkpoint_handler.StandardCheckpointHandler"}
        with open(meta_path, "w") as f:
            json.dump(meta, f)
        with tensorstash.CheckpointManager(root) as mgr:
            with pytest.raises(ValueError, match="not a folder of the step"):
                mgr.restore(7)
    with open(meta_path, "w") as f:
        f.write("{garbled")
    with tensorstash.CheckpointManager(root) as mgr:
        with pytest.raises(ValueError, match="_CHECKPOINT_METADATA"):
            mgr.restore(7)


def test_a_garbled_metrics_item_does_not_stop_retention(tmp_path):
    """best-N retention reads every step's metrics; a step whose metrics item is garbled counts
    as one without the metric, and later saves go on committing and deleting."""
    root = tmp_path / "run"
    with tensorstash.CheckpointManager(root, format="orbax", async_save=False, max_to_keep=2,
                                       best_metric="loss", best_mode="min") as mgr:
        mgr.save(1, {"w": np.zeros(2, np.float32)}, metrics={"loss": 1.0})
        with open(os.path.join(mgr.step_path(1), "metrics", "metrics"), "w") as f:
            f.write("{garbled")
        for step, loss in ((2, 0.5), (3, 0.7), (4, 0.9)):
            mgr.save(step, {"w": np.full(2, step, np.float32)}, metrics={"loss": loss})
        mgr.wait_until_finished()
        steps = mgr.all_steps()
    # The best two by loss (2, 3) and the newest (4) are kept; 3 of the 4 saves at most remain
    # of those with a metric, whatever retention makes of step 1.
    assert {2, 3, 4} <= set(steps) and len(set(steps) - {1}) == 3, steps


def test_a_misspelt_scalar_target_leaf_is_a_key_error(tmp_path):
    """A target's leaves that the checkpoint does not hold pass through only when no checkpoint
    could hold them (a function); a scalar, a string or an array there is a KeyError, so that a
    misspelt path is not answered by the target's own value."""
    path = str(tmp_path / "ckpt")
    tensorstash.save(path, {"step": 3, "w": np.ones(2, np.float32), "act": None})
    for target in ({"stepp": 0}, {"step": 0, "name": "x"}, {"w2": np.zeros(2, np.float32)}):
        with pytest.raises(KeyError):
            tensorstash.restore(path, target=target)
    got = tensorstash.restore(path, target={"step": 0, "act": jax.nn.relu, "fn": jax.nn.gelu,
                                            "w": np.zeros(2, np.float32)})
    assert got["step"] == 3 and got["act"] is jax.nn.relu and got["fn"] is jax.nn.gelu
    # None in the checkpoint, a scalar in the target (an Equinox module's field saved filtered).
    assert tensorstash.restore(path, target={"act": 0.5})["act"] == 0.5


def test_typed_dict_entries_must_be_named_by_their_keys():
    node = {"kind": "typed_dict", "entries": [["a", {"kind": "none"}]],
            "keys": [{"kind": "int", "value": "1"}]}
    with pytest.raises(ValueError, match="names the entry of key 1"):
        _tree.decode(node, lambda path, i: None)
    good = {"kind": "typed_dict", "entries": [["1", {"kind": "none"}]],
            "keys": [{"kind": "int", "value": "1"}]}
    assert _tree.decode(good, lambda path, i: None) == {1: None}
