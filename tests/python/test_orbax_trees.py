"""Trees as Orbax users have them (issue 38, parts 5 and 6), with the real libraries: Haiku
params (keys with '/'), dicts of int and tuple keys, optimizer state dicts, string leaves,
subtree restores, Equinox models as targets, optax and Flax Linen state, grain iterator state;
Orbax on the other side of the interop tests."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import tensorstash
from tshelpers import assert_same_tree


def as_numpy(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def assert_same_values(got, want):
    """Same structure (jax.tree_util's view) and leaves equal as NumPy arrays or scalars."""
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def, f"{got_def} != {want_def}"
    for g, w in zip(got_leaves, want_leaves):
        if isinstance(w, (jax.Array, np.ndarray)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
            assert np.asarray(g).dtype == np.asarray(w).dtype
        else:
            assert g == w and type(g) is type(w), f"{g!r} != {w!r}"


# --- part 6: keys, subtrees, targets with other leaves -----------------------------------------

def test_int_tuple_and_other_keys_round_trip(step):
    rng = np.random.default_rng(0)
    a = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    tree = {
        0: a(2), 1: {"w": a(3)}, -5: 7,
        "t": {(1, "a"): a(2), ("x", (2, None)): "nested", (): a(1)},
        "s": {True: 1, None: "none", 2.5: a(1), b"k": 3},
    }
    tensorstash.save(step, tree)
    got = tensorstash.restore(step)
    assert_same_tree(got, tree)
    # Array paths use the keys' texts (str(key), Orbax's names): unchanged for int keys.
    meta = tensorstash.metadata(step)
    assert meta[1]["w"].path == "1/w"
    assert meta["t"][(1, "a")].path == "t/(1, 'a')"
    # A target with the same keys restores them, in the target's own dict.
    target = {0: np.zeros(2, np.float32), "t": {(1, "a"): np.zeros(2, np.float32)}}
    got = tensorstash.restore(step, target)
    assert_same_tree(got, {0: tree[0], "t": {(1, "a"): tree["t"][(1, "a")]}})
    # Two keys of the same text would be one path.
    with pytest.raises(ValueError, match="both named '1'"):
        tensorstash.save(step + "x", {1: a(1), "1": a(1)})


def test_torch_like_optimizer_state_dict(step):
    # optimizer.state_dict() of a PyTorch optimizer: int keys, None, tuples, bools.
    rng = np.random.default_rng(1)
    state = {
        "state": {0: {"step": np.array(3.0, np.float32), "exp_avg": rng.random(4),
                      "exp_avg_sq": rng.random(4)},
                  1: {"step": np.array(3.0, np.float32), "exp_avg": rng.random((2, 2)),
                      "exp_avg_sq": rng.random((2, 2))}},
        "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08,
                          "weight_decay": 0, "amsgrad": False, "foreach": None,
                          "maximize": False, "params": [0, 1]}],
    }
    tensorstash.save(step, state)
    got = tensorstash.restore(step)
    assert_same_tree(got, state)
    assert list(got["state"]) == [0, 1]
    # The subtree of one parameter's state, by its int key's text.
    one = tensorstash.restore(step, subtree="state/1")
    assert_same_tree(one, state["state"][1])


def test_subtree(tmp_path, step):
    rng = np.random.default_rng(2)
    tree = {"params": {"dense": {"kernel": rng.random((3, 2)), "bias": rng.random(2)},
                       "a/b": {"w": rng.random(1)}},
            "opt": {"mu": rng.random(5)}, "step": 12, "rng": jax.random.key(3)}
    tensorstash.save(step, tree)
    got = tensorstash.restore(step, subtree="params")
    assert_same_tree(got, tree["params"])
    # With a target of the subtree's shape: only those arrays are asked for.
    target = {"dense": {"kernel": np.zeros((3, 2), np.float32)}}
    got = tensorstash.restore(step, target, subtree="params")
    assert_same_tree(got, {"dense": {"kernel": tree["params"]["dense"]["kernel"]
                                     .astype(np.float32)}})
    # Deeper, a leaf, a key with '/' (escaped as in array paths), and a PRNG key leaf.
    assert_same_tree(tensorstash.restore(step, subtree="params/dense/bias"),
                     tree["params"]["dense"]["bias"])
    assert_same_tree(tensorstash.restore(step, subtree="params/a~1b"), tree["params"]["a/b"])
    assert tensorstash.restore(step, subtree="step") == 12
    key = tensorstash.restore(step, subtree="rng")
    assert jax.random.key_impl(key) == jax.random.key_impl(tree["rng"])
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(tree["rng"]))
    with pytest.raises(KeyError, match="params/nope"):
        tensorstash.restore(step, subtree="params/nope")
    with pytest.raises(KeyError, match="kernel"):
        tensorstash.restore(step, {"kernel": np.zeros(1)}, subtree="params")
    # Through the manager.
    mgr = tensorstash.CheckpointManager(str(tmp_path / "run"))
    mgr.save(5, tree)
    mgr.wait_until_finished()
    assert_same_tree(mgr.restore(5, subtree="opt"), tree["opt"])
    assert_same_tree(mgr.restore(target={"mu": np.zeros(5)}, subtree="opt"), tree["opt"])
    mgr.close()


def test_equinox_model_from_filter_eval_shape_as_target(step):
    eqx = pytest.importorskip("equinox")

    def make(key):
        return {"mlp": eqx.nn.MLP(4, 2, 8, 2, activation=jax.nn.gelu, key=key),
                "drop": eqx.nn.Dropout(0.25)}

    model = make(jax.random.key(0))
    tensorstash.save(step, eqx.filter(model, eqx.is_array))
    target = eqx.filter_eval_shape(make, jax.random.key(1))
    got = tensorstash.restore(step, target)
    assert isinstance(got["mlp"], eqx.nn.MLP)
    assert got["mlp"].activation is jax.nn.gelu  # passed through from the target
    assert got["drop"].p == 0.25
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(got["mlp"](x), model["mlp"](x))
    # An array the checkpoint lacks is still a KeyError naming it.
    bigger = eqx.filter_eval_shape(lambda k: {"mlp": eqx.nn.MLP(4, 2, 8, 3, key=k)},
                                   jax.random.key(1))
    with pytest.raises(KeyError, match="mlp/layers/3/weight"):
        tensorstash.restore(step, bigger)
    # A non-array leaf where the checkpoint holds an array stays an error.
    with pytest.raises(TypeError, match="'mlp/layers/0/weight'"):
        tensorstash.restore(step, {"mlp": {"layers": [{"weight": object()}]}})


def test_optax_state_namedtuples_and_empty_tuples(step):
    optax = pytest.importorskip("optax")
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = tx.init(params)
    updates, opt_state = tx.update(jax.tree_util.tree_map(jnp.ones_like, params), opt_state,
                                   params)
    tensorstash.save(step, {"opt": opt_state})
    got = tensorstash.restore(step, {"opt": jax.tree_util.tree_map(jnp.zeros_like, opt_state)})
    assert_same_values(got["opt"], opt_state)
    assert type(got["opt"][1][0]).__name__ == "ScaleByAdamState"
    # Without a target: namedtuples as dicts of their fields, empty ones as empty dicts.
    plain = tensorstash.restore(step)
    np.testing.assert_array_equal(plain["opt"][1][0]["mu"]["w"], opt_state[1][0].mu["w"])


def test_flax_linen_params_and_optax(step):
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))

    params = MLP().init(jax.random.key(0), jnp.ones((1, 4)))
    tx = optax.adam(1e-2)
    state = {"params": params, "opt_state": tx.init(params), "step": 7}
    tensorstash.save(step, state)
    target = jax.tree_util.tree_map(jnp.zeros_like, state)
    target["step"] = 0
    got = tensorstash.restore(step, target)
    assert_same_values(got, state)
    assert got["step"] == 7
    got_params = tensorstash.restore(step, target["params"], subtree="params")
    assert_same_values(got_params, params)


def test_grain_iterator_state_as_leaf_and_per_process(tmp_path):
    grain = pytest.importorskip("grain")
    ds = grain.MapDataset.range(20).shuffle(seed=3).to_iter_dataset()
    it = iter(ds)
    seen = [next(it) for _ in range(5)]
    state = it.get_state()
    mgr = tensorstash.CheckpointManager(str(tmp_path / "run"))
    mgr.save(1, {"w": np.ones(2), "data": state}, per_process={"data": state})
    mgr.wait_until_finished()
    from_leaf = mgr.restore(1)["data"]
    from_process = mgr.per_process(1)["data"]
    mgr.close()
    fresh = iter(ds)
    want = [next(fresh) for _ in range(10)]
    assert want[:5] == seen
    for restored in (from_leaf, from_process):
        assert restored == state
        again = iter(ds)
        again.set_state(restored)
        assert [next(again) for _ in range(5)] == want[5:]


# --- part 5: Orbax export of Haiku trees and strings; Orbax's Haiku checkpoints ----------------

def haiku_params():
    hk = pytest.importorskip("haiku")

    def forward(x):
        return hk.nets.MLP([8, 2])(x)

    f = hk.transform(forward)
    params = f.init(jax.random.key(0), jnp.ones((1, 4)))
    assert "mlp/~/linear_0" in params
    return f, params


def test_haiku_params_native_and_orbax(tmp_path):
    f, params = haiku_params()
    x = jnp.ones((1, 4))
    native = str(tmp_path / "native")
    tensorstash.save(native, params)
    got = tensorstash.restore(native, jax.tree_util.tree_map(jnp.zeros_like, params))
    assert_same_values(got, params)
    np.testing.assert_array_equal(f.apply(got, None, x), f.apply(params, None, x))
    assert tensorstash.metadata(native)["mlp/~/linear_0"]["w"].path == "mlp~1~0~1linear_0/w"

    # Ours in Orbax's format, restored by Orbax (and by us).
    ours = str(tmp_path / "ours")
    tensorstash.save(ours, params, format="orbax")
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    by_orbax = ocp.StandardCheckpointer().restore(ours, target)
    assert_same_values(by_orbax, params)
    assert_same_values(tensorstash.restore(ours, target), params)

    # Orbax's, restored by us, with and without a target.
    theirs = str(tmp_path / "theirs")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(theirs, params)
    ckptr.wait_until_finished()
    assert_same_values(tensorstash.restore(theirs, target), params)
    plain = tensorstash.restore(theirs)
    np.testing.assert_array_equal(plain["mlp/~/linear_1"]["b"], params["mlp/~/linear_1"]["b"])
    assert_same_values(tensorstash.restore(theirs, subtree="mlp~1~0~1linear_0"),
                       as_numpy(params["mlp/~/linear_0"]))


def test_string_leaves_in_orbax_format(tmp_path):
    path = str(tmp_path / "ckpt")
    tree = {"w": np.arange(3.0), "cfg": {"optimizer": "adamw", "name": "ünï"}, "step": 3}
    tensorstash.save(path, tree, format="orbax")
    with open(os.path.join(path, "_strings.json")) as f:
        assert json.load(f) == {"cfg.optimizer": "adamw", "cfg.name": "ünï"}
    by_orbax = ocp.PyTreeCheckpointer().restore(path)
    assert by_orbax["cfg"] == tree["cfg"]
    np.testing.assert_array_equal(by_orbax["w"], tree["w"])
    got = tensorstash.restore(path)
    assert got["cfg"] == tree["cfg"] and got["step"] == 3
    # Orbax's own string leaves, read by us.
    theirs = str(tmp_path / "theirs")
    ocp.PyTreeCheckpointer().save(theirs, {"cfg": {"optimizer": "sgd"}, "w": np.ones(2)})
    assert tensorstash.restore(theirs)["cfg"] == {"optimizer": "sgd"}


def test_int_and_tuple_keys_in_orbax_format_are_named_as_orbax_names_them(tmp_path):
    path = str(tmp_path / "ckpt")
    tree = {"ik": {0: np.zeros(1), 1: np.ones(2)}, "tk": {(1, "a"): np.arange(2)}}
    tensorstash.save(path, tree, format="orbax")
    theirs = str(tmp_path / "theirs")
    ocp.PyTreeCheckpointer().save(theirs, tree)
    want = ocp.PyTreeCheckpointer().restore(theirs)
    got = ocp.PyTreeCheckpointer().restore(path)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert set(got["tk"]) == {"(1, 'a')"}
