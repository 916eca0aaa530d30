"""jax.Array checkpoints restored onto other meshes, shardings, dtypes and shapes (8 CPU
devices, see conftest.py)."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

import tensorstash
from tshelpers import (ALL_DTYPES, assert_jax_array, assert_same_array, assert_same_tree,
                       global_array, mesh, named, pattern)


def test_eight_devices():
    assert jax.device_count() == 8 and jax.process_count() == 1
    assert jax.config.jax_enable_x64


def roundtrip(step, values, save_sharding, target_sharding, *, target_kind="abstract",
              target_dtype=None, **restore_kwargs):
    x = global_array(values, save_sharding)
    tensorstash.save(step, {"x": x})
    dt = np.dtype(target_dtype or values.dtype)
    if target_kind == "abstract":
        target = jax.ShapeDtypeStruct(values.shape, dt, sharding=target_sharding)
    else:
        target = jax.device_put(np.zeros(values.shape, dt), target_sharding)
    got = tensorstash.restore(step, target={"x": target}, **restore_kwargs)["x"]
    return x, got


CASES = {
    # name: (shape, save mesh, save spec, target mesh, target spec)
    "8_to_2x4": ((16, 24), (8,), ("a",), (2, 4), ("a", "b")),
    "2x4_to_4x2": ((16, 24), (2, 4), ("a", "b"), (4, 2), ("a", "b")),
    "2x4_to_4x2_swapped": ((16, 24), (2, 4), ("a", "b"), (4, 2), ("b", "a")),
    "sharded_to_replicated": ((16, 24), (2, 4), ("a", "b"), (2, 4), ()),
    "replicated_to_sharded": ((16, 24), (8,), (), (2, 4), ("b", "a")),
    "partly_replicated": ((16, 24), (2, 4), (None, "a"), (8,), (None, "a")),
    "two_axes_one_dim": ((16, 24), (2, 4), (("a", "b"),), (4, 2), (None, ("b", "a"))),
    # Blocks that cut across the saved cells and chunks: 12 = 4 x 3 saved, 3 x 4 restored;
    # (10, 7) over 2 devices saved, restored over 5 and over 7 devices.
    "cells_3_to_blocks_4": ((12, 14), (4, 2), ("a", "b"), (3, 2), ("a", "b")),
    "10x7_2_to_5": ((10, 7), (2,), ("a",), (5,), ("a",)),
    "10x7_2_to_7": ((10, 7), (2, 1), ("a", "b"), (1, 7), ("a", "b")),
    "10x7_5_to_7x1": ((10, 7), (5, 1), ("a",), (7,), (None, "a")),
    "3d": ((4, 6, 8), (2, 2, 2), ("a", "b", "c"), (2, 4), ("b", None, "a")),
}


@pytest.mark.parametrize("target_kind", ["abstract", "array"])
@pytest.mark.parametrize("case", list(CASES))
def test_reshard(step, case, target_kind):
    shape, save_mesh, save_spec, target_mesh, target_spec = CASES[case]
    values = pattern(shape, np.float32, seed=len(case))
    ss = named(mesh(save_mesh), *save_spec)
    ts = named(mesh(target_mesh), *target_spec)
    x, got = roundtrip(step, values, ss, ts, target_kind=target_kind)
    assert_jax_array(got, values, ts, case)
    # Replicated blocks are stored once.
    assert tensorstash.metadata(step)["x"].stored_bytes == values.nbytes


def test_permuted_devices_and_single_device(step):
    values = pattern((8, 6), np.int32)
    devices = jax.devices()[::-1]
    ss = named(mesh((4, 2), devices=devices), "a", "b")
    x = global_array(values, ss)
    tensorstash.save(step, {"x": x, "one": jax.device_put(values[0], jax.devices()[3])})
    ts = named(mesh((2, 4), devices=jax.devices()[1::2] + jax.devices()[::2]), "b", "a")
    target = {"x": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=ts),
              "one": jax.ShapeDtypeStruct((6,), np.int32, sharding=SingleDeviceSharding(jax.devices()[5]))}
    got = tensorstash.restore(step, target=target)
    assert_jax_array(got["x"], values, ts)
    assert_jax_array(got["one"], values[0], SingleDeviceSharding(jax.devices()[5]))
    # A ShapeDtypeStruct without a sharding lands on the first device.
    got = tensorstash.restore(step, target={"one": jax.ShapeDtypeStruct((6,), np.int32)})
    assert_jax_array(got["one"], values[0], SingleDeviceSharding(jax.devices()[0]))
    # Without a target: NumPy.
    assert_same_tree(tensorstash.restore(step), {"x": values, "one": values[0]})


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_every_dtype_resharded(step, dt):
    values = pattern((8, 16), dt, seed=3)
    ss, ts = named(mesh((8,)), None, "a"), named(mesh((2, 4)), "b", "a")
    x, got = roundtrip(step, values, ss, ts)
    assert x.dtype == dt
    assert_jax_array(got, values, ts, str(dt))


def test_float32_to_bfloat16_on_a_sharding(step):
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((16, 8)) * 100).astype(np.float32)
    ss, ts = named(mesh((2, 4)), "a", "b"), named(mesh((4, 2)), "b", None)
    _, got = roundtrip(step, values, ss, ts, target_dtype=ml_dtypes.bfloat16)
    assert_jax_array(got, values.astype(ml_dtypes.bfloat16), ts)
    _, got = roundtrip(step + "b", values, ss, ts, target_kind="array", target_dtype=np.float64)
    assert_jax_array(got, values.astype(np.float64), ts)


def test_target_shapes_on_a_sharding(step):
    values = pattern((6, 10), np.int16)
    tensorstash.save(step, {"x": global_array(values, named(mesh((2, 2)), "a", "b"))})
    ts = named(mesh((4, 2)), "a", "b")
    got = tensorstash.restore(step, target={"x": jax.ShapeDtypeStruct((8, 12), np.int16, sharding=ts)})
    want = np.zeros((8, 12), np.int16)
    want[:6, :10] = values
    assert_jax_array(got["x"], want, ts)
    small = jax.ShapeDtypeStruct((4, 8), np.int16, sharding=ts)
    with pytest.raises(ValueError, match="truncate"):
        tensorstash.restore(step, target={"x": small})
    got = tensorstash.restore(step, target={"x": small}, truncate=True)
    assert_jax_array(got["x"], values[:4, :8], ts)


def test_mixed_tree_and_edge_shapes(step):
    m = mesh((2, 4))
    w = pattern((8, 4), np.float32)
    tree = {
        "params": {"w": global_array(w, named(m, "a", "b")),
                   "scalar": jax.device_put(np.float32(3.5), named(m)),
                   "empty": global_array(np.zeros((0, 8), ml_dtypes.bfloat16), named(m, None, "b"))},
        "host": pattern((5,), np.int64), "step": 100, "name": "adamw",
    }
    tensorstash.save(step, tree)
    ts = named(mesh((8,)), None, "a")
    target = {
        "params": {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=named(mesh((4,)), "a")),
                   "scalar": jax.ShapeDtypeStruct((), np.float32, sharding=named(mesh((8,)))),
                   "empty": jax.ShapeDtypeStruct((0, 8), ml_dtypes.bfloat16, sharding=ts)},
        "host": np.zeros(5, np.int64), "step": 0, "name": "",
    }
    got = tensorstash.restore(step, target=target)
    assert_jax_array(got["params"]["w"], w, named(mesh((4,)), "a"))
    assert_jax_array(got["params"]["scalar"], np.array(3.5, np.float32), named(mesh((8,))))
    assert_jax_array(got["params"]["empty"], np.zeros((0, 8), ml_dtypes.bfloat16), ts)
    assert_same_array(got["host"], tree["host"])
    assert got["step"] == 100 and got["name"] == "adamw"
    # Restoring a NumPy-saved array onto a sharding works the same way.
    rs = named(mesh((2, 4)))
    got = tensorstash.restore(step, target={"host": jax.ShapeDtypeStruct((5,), np.int64, sharding=rs)})
    assert_jax_array(got["host"], tree["host"], rs)


def test_save_of_abstract_array_is_refused(step):
    with pytest.raises(TypeError):
        tensorstash.save(step, {"x": jax.ShapeDtypeStruct((2,), np.float32)})


def test_device_copies_all_start_before_the_first_is_taken(step, monkeypatch):
    # On an accelerator each shard is copied out of device memory for a save; save() starts
    # every leaf's copy before it waits for the first, so that the copies run side by side.
    # CPU devices have no such copy: here the arrays are treated as off-host, and each shard's
    # copy_to_host_async and the shard's taking (np.asarray in shards_of) are recorded.
    from tensorstash import _options
    from tensorstash import jax as tjax
    monkeypatch.setattr(tjax, "in_host_memory", lambda array: False)
    monkeypatch.setattr(_options, "SAVE_VIA_PINNED_HOST", False)  # pageable copies
    events = []
    started = tjax.JaxAdapter.start_save
    taken = tjax.shards_of

    def record_start(self, xs):
        events.extend(("start", x.shape) for x in xs)
        return started(self, xs)

    def record_take(x):
        events.append(("take", x.shape))
        return taken(x)

    monkeypatch.setattr(tjax.JaxAdapter, "start_save", record_start)
    monkeypatch.setattr(tjax, "shards_of", record_take)
    copies = []
    array_type = type(jax.numpy.zeros(1))
    real_copy = array_type.copy_to_host_async
    monkeypatch.setattr(array_type, "copy_to_host_async",
                        lambda a: (copies.append(a.shape), real_copy(a))[1])
    s = named(mesh((2, 4)), "a", "b")
    tree = {"w": global_array(pattern((8, 16), np.float32, seed=1), s),
            "b": global_array(pattern((4, 8), np.int32, seed=2), s)}
    tensorstash.save(step, tree)
    kinds = [kind for kind, _ in events]
    assert kinds == ["start", "start", "take", "take"], events
    # One copy per shard: 8 devices, each leaf split 2 x 4.
    assert sorted(copies) == sorted([(4, 4)] * 8 + [(2, 2)] * 8)
    got = tensorstash.restore(step, target={k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)
                                            for k, v in tree.items()})
    for k in tree:
        assert_jax_array(got[k], np.asarray(tree[k]), s)


def test_device_copies_via_pinned_host_memory(step, monkeypatch):
    # With SAVE_VIA_PINNED_HOST (the default) a save copies each off-host leaf into JAX's pinned host memory
    # and writes from that copy, which it marks stable (made for this save: an async save need
    # not copy it again). CPU arrays are treated as off-host, as above.
    from tensorstash import _options, _save
    from tensorstash import jax as tjax
    monkeypatch.setattr(tjax, "in_host_memory", lambda array: False)
    monkeypatch.setattr(_options, "SAVE_VIA_PINNED_HOST", True)
    s = named(mesh((2, 4)), "a", None)
    values = pattern((8, 6), np.float32, seed=3)
    tree = {"w": global_array(values, s), "n": np.arange(5)}
    arrays, _ = _save.arrays_to_save(tree, None)
    by_path = {path: (shape, shards, stable) for path, _, shape, shards, stable in arrays}
    shape, shards, stable = by_path["w"]
    assert shape == (8, 6) and stable and len(shards) == 8
    for origin, extent, data, _, _ in shards:
        block = values[origin[0]:origin[0] + extent[0], origin[1]:origin[1] + extent[1]]
        assert bytes(data) == block.tobytes()
    tensorstash.save(step, tree)
    got = tensorstash.restore(step, target={"w": jax.ShapeDtypeStruct((8, 6), np.float32,
                                                                      sharding=s)})
    assert_jax_array(got["w"], values, s)


def test_async_save_from_pinned_host_copies(tmp_path, monkeypatch):
    # An async save writes in the background from the pinned host copies it made (marked
    # stable, so not copied again): they must outlive save()'s return and the caller's arrays.
    import gc

    from tensorstash import _options
    from tensorstash import jax as tjax
    monkeypatch.setattr(tjax, "in_host_memory", lambda array: False)
    monkeypatch.setattr(_options, "SAVE_VIA_PINNED_HOST", True)
    s = named(mesh((2, 4)), "a", "b")
    values = {f"w{i}": pattern((64, 96), np.float32, seed=10 + i) for i in range(4)}
    with tensorstash.CheckpointManager(str(tmp_path / "ckpts"), async_save=True) as mgr:
        mgr.save(7, {k: global_array(v, s) for k, v in values.items()})
        gc.collect()
        mgr.wait_until_finished()
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s) for k, v in values.items()}
        got = mgr.restore(7, target=target)
    for k, v in values.items():
        assert_jax_array(got[k], v, s)
