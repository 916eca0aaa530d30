"""Steps across frameworks (issue 39 part 5), in one process: a step saved from JAX (arrays
sharded over the 8 CPU devices of conftest) restores into torch tensors bit-exact for every
dtype both frameworks have, and a step saved from torch restores into jax.Arrays on a mesh;
the key mapping between nested trees and dotted state_dict names (tensorstash.torch.nest and
flatten)."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tensorstash
import tensorstash.torch as ttorch
from tensorstash.numpy import dtype_from_name

# The dtypes the issue names; each must be in both frameworks.
REQUIRED = {"bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
            "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
            "float8_e4m3fn", "float8_e5m2"}


def _jax_holds(name: str) -> bool:
    try:
        return jax.numpy.asarray(np.zeros(2, dtype_from_name(name))).dtype == dtype_from_name(name)
    except (TypeError, ValueError):
        return False


# Every dtype of the torch adapter that a jax.Array can hold too.
COMMON = sorted(name for name in ttorch.DTYPES.values() if _jax_holds(name))


def test_common_dtypes_hold_every_required_one():
    assert jax.config.jax_enable_x64 and jax.device_count() == 8
    assert REQUIRED <= set(COMMON), REQUIRED - set(COMMON)


def random_bits(name: str, shape=(8, 6), seed=0) -> np.ndarray:
    """Random bytes of dtype `name` (NaNs, infinities, -0.0 included); bool as 0/1."""
    dtype = np.dtype(dtype_from_name(name))
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def torch_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))


def test_jax_step_restores_into_torch_bit_exact(tmp_path, mesh):
    sharded = NamedSharding(mesh, P("a", "b"))
    source = {name: random_bits(name, seed=i) for i, name in enumerate(COMMON)}
    tree = {"model": {name: {"weight": jax.device_put(x, sharded)} for name, x in source.items()},
            "step": 7}
    assert all(len(a["weight"].addressable_shards) == 8 for a in tree["model"].values())
    step = str(tmp_path / "1")
    tensorstash.save(step, tree)

    target = {"model": {name: {"weight": torch.empty(8, 6, dtype=ttorch.torch_dtype(name))}
                        for name in COMMON}, "step": 0}
    back = tensorstash.restore(step, target=target)
    assert back["step"] == 7
    for name, x in source.items():
        t = back["model"][name]["weight"]
        assert isinstance(t, torch.Tensor) and t.dtype == ttorch.torch_dtype(name), name
        assert tuple(t.shape) == (8, 6), name
        assert torch_bytes(t) == x.tobytes(), name

    # In place, into tensors a model owns (the target is not replaced, its storage is filled).
    owned = {name: torch.zeros(8, 6, dtype=ttorch.torch_dtype(name)) for name in COMMON}
    state = {"model": {name: {"weight": owned[name]} for name in COMMON}, "step": 0}
    ttorch.load(step, state)
    assert state["step"] == 7
    for name, x in source.items():
        assert state["model"][name]["weight"] is owned[name]
        assert torch_bytes(owned[name]) == x.tobytes(), name


def test_torch_step_restores_into_jax_arrays_on_a_mesh(tmp_path, mesh):
    source = {name: torch.from_numpy(np.ascontiguousarray(random_bits(name, seed=10 + i)).view(
        np.uint8)).view(ttorch.torch_dtype(name)).reshape(8, 6)
        for i, name in enumerate(COMMON)}
    # Made from the bytes (torch.from_numpy takes no ml_dtypes arrays); check they survived.
    for name, t in source.items():
        assert torch_bytes(t) == random_bits(name, seed=10 + COMMON.index(name)).tobytes()
    step = str(tmp_path / "1")
    tensorstash.save(step, {"model": {f"{name}.weight": t for name, t in source.items()}})

    shardings = {name: NamedSharding(mesh, P(("a", "b")) if i % 2 else P(None, "b"))
                 for i, name in enumerate(COMMON)}
    target = {"model": {f"{name}.weight": jax.ShapeDtypeStruct(
        (8, 6), dtype_from_name(name), sharding=shardings[name]) for name in COMMON}}
    back = tensorstash.restore(step, target=target)
    for name, t in source.items():
        a = back["model"][f"{name}.weight"]
        assert isinstance(a, jax.Array), name
        assert a.dtype == np.dtype(dtype_from_name(name)), name
        assert a.sharding == shardings[name], name
        assert np.asarray(a).tobytes() == torch_bytes(t), name
        # Each device holds its own box, bit-exact.
        full = np.asarray(a)
        for shard in a.addressable_shards:
            assert np.asarray(shard.data).tobytes() == full[shard.index].tobytes(), name


def test_a_cast_across_frameworks(tmp_path, mesh):
    # bfloat16 saved from JAX, restored into a float32 torch tensor: the engine's cast.
    x = np.arange(48, dtype=np.float32).reshape(8, 6).astype(ml_dtypes.bfloat16)
    tensorstash.save(str(tmp_path / "1"),
                     {"w": jax.device_put(x, NamedSharding(mesh, P("a")))})
    back = tensorstash.restore(str(tmp_path / "1"), target={"w": torch.empty(8, 6)})
    assert back["w"].dtype == torch.float32
    assert torch.equal(back["w"], torch.arange(48, dtype=torch.float32).reshape(8, 6))


# --- the key mapping -------------------------------------------------------------------------


def flax_params(seed: int) -> dict:
    """A Flax-style tree of the parameters of torch.nn.Sequential(Linear(4, 3), ReLU(),
    Linear(3, 2)), in torch's layouts (weight is [out, in])."""
    rng = np.random.default_rng(seed)
    return {"0": {"weight": rng.standard_normal((3, 4), np.float32),
                  "bias": rng.standard_normal(3, np.float32)},
            "2": {"weight": rng.standard_normal((2, 3), np.float32),
                  "bias": rng.standard_normal(2, np.float32)}}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def test_a_flax_style_tree_restores_into_a_torch_model(tmp_path, mesh):
    params = flax_params(1)
    tree = {"model": jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P(*(["a"] if x.shape[0] % 4 == 0
                                                            else [None])))), params)}
    step = str(tmp_path / "1")
    tensorstash.save(step, tree)
    assert set(tensorstash.metadata(step)["model"]) == {"0", "2"}  # saved at model/0/weight

    model = make_model()
    sd = model.state_dict()
    # The dotted state dict does not match the nested paths...
    with pytest.raises(KeyError, match="0.weight"):
        tensorstash.restore(step, target={"model": sd})
    # ...its nested form does, and loading into it fills the model's own parameters.
    ttorch.load(step, {"model": ttorch.nest(sd)})
    for name, value in ttorch.flatten(params).items():
        assert np.array_equal(model.state_dict()[name].numpy(), value), name
    x = torch.ones(1, 4)
    expected = np.maximum(x.numpy() @ params["0"]["weight"].T + params["0"]["bias"], 0)
    expected = expected @ params["2"]["weight"].T + params["2"]["bias"]
    np.testing.assert_allclose(model(x).detach().numpy(), expected, rtol=1e-6)


def test_a_torch_state_dict_restores_into_a_flax_style_tree(tmp_path, mesh):
    model = make_model()
    step = str(tmp_path / "1")
    tensorstash.save(step, {"model": model.state_dict()})  # saved at model/0.weight
    assert set(tensorstash.metadata(step)["model"]) == {"0.weight", "0.bias", "2.weight",
                                                        "2.bias"}
    # A JAX target in nested form, flattened to the saved names, restored, nested back.
    sharding = NamedSharding(mesh, P())
    flax_target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                              sharding=sharding), flax_params(0))
    back = tensorstash.restore(step, target={"model": ttorch.flatten(flax_target)})
    nested = ttorch.nest(back["model"])
    assert jax.tree.structure(nested) == jax.tree.structure(flax_target)
    for name, t in model.state_dict().items():
        layer, leaf = name.split(".")
        assert isinstance(nested[layer][leaf], jax.Array)
        assert np.array_equal(np.asarray(nested[layer][leaf]), t.numpy()), name


def test_nest_and_flatten():
    t, u = torch.ones(2), torch.zeros(3)
    nested = {"model": {"0": {"weight": t, "bias": u}}, "step": 3}
    flat = {"model.0.weight": t, "model.0.bias": u, "step": 3}
    assert ttorch.flatten(nested) == flat
    assert ttorch.nest(flat) == nested
    assert ttorch.nest(flat)["model"]["0"]["weight"] is t  # leaves are shared, not copied
    # nest splits keys at every depth and merges what meets; flatten keeps dotted keys.
    assert ttorch.nest({"model": {"0.weight": t}, "model.0.bias": u}) == \
        {"model": {"0": {"weight": t, "bias": u}}}
    assert ttorch.flatten({"model": {"0.weight": t}}) == {"model.0.weight": t}
    # Lists and tuples flatten by position, int keys by number; nest keeps both as they are.
    optim = {"state": {0: {"exp_avg": t}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    assert ttorch.flatten(optim) == {"state.0.exp_avg": t, "param_groups.0.lr": 0.1,
                                     "param_groups.0.params.0": 0,
                                     "param_groups.0.params.1": 1}
    assert ttorch.nest(optim) == optim
    # Another separator; leaves that are not containers pass through.
    assert ttorch.flatten(nested, sep="/")["model/0/weight"] is t
    assert ttorch.nest({"a/b": 1}, sep="/") == {"a": {"b": 1}}
    assert ttorch.nest(5) == 5
    assert ttorch.flatten({"a": {}, "b": 1}) == {"b": 1}  # empty containers hold no leaf


@pytest.mark.parametrize("flat, match", [
    ({"a": 1, "a.b": 2}, "'a' is a leaf and the prefix of 'a.b'"),
    ({"a.b": 2, "a": 1}, "'a' is given twice"),
    ({"a.b": 1, "a": {"b": 2}}, "'a.b' is given twice"),
    ({"a..b": 1}, "'a..b' has an empty part"),
    ({".a": 1}, "'.a' has an empty part"),
])
def test_nest_refuses_names_that_collide(flat, match):
    with pytest.raises(ValueError, match=match):
        ttorch.nest(flat)


def test_flatten_refuses_names_that_collide():
    with pytest.raises(ValueError, match=r"\('a', 'b'\) and \('a\.b',\) both join to 'a\.b'"):
        ttorch.flatten({"a": {"b": 1}, "a.b": 2})
    with pytest.raises(TypeError, match=r"key \(1, 2\) under 'a' is not a str or an int"):
        ttorch.flatten({"a": {(1, 2): 1}})
