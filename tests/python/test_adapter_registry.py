"""Framework adapters registered, not listed (issue 37, part 5): tensorstash.register_adapter,
the entry point group "tensorstash.adapters" (loaded once, at the first lookup; a broken entry
point warns and is left out), dtypes named by the adapter (a framework whose dtypes are not
NumPy's), and the default coordinator asked of the adapters."""

from __future__ import annotations

import ast
import importlib
import pathlib
import sys
import warnings

import numpy as np
import pytest

import tensorstash
from tensorstash import _adapters, _save
from tensorstash import jax as tjax
from tensorstash import numpy as tnp
from tshelpers import assert_same_array

PACKAGE = pathlib.Path(tensorstash.__file__).parent


def builtin_types() -> list[type]:
    """The types of the built-in adapters after the registered ones: torch's when torch has
    been imported (by the torch tests of the same run), then JAX's."""
    if "torch" in sys.modules:
        from tensorstash import torch as ttorch
        return [ttorch.TorchAdapter, tjax.JaxAdapter]
    return [tjax.JaxAdapter]


class ToyDType:
    """A made-up framework's dtype: not a NumPy dtype (np.dtype() refuses it), as torch's are
    not."""

    def __init__(self, name: str, numpy_name: str):
        self.name, self.numpy_name = name, numpy_name

    def __repr__(self) -> str:
        return f"toy.{self.name}"


F32, F64, BF16 = ToyDType("f32", "float32"), ToyDType("f64", "float64"), ToyDType("bf16", "bfloat16")


class ToyArray:
    """A made-up framework's array: a NumPy array in a box, with the framework's own dtype."""

    def __init__(self, data, dtype: ToyDType):
        self.data = np.asarray(data, tnp.dtype_from_name(dtype.numpy_name))
        self.dtype = dtype
        self.shape = self.data.shape


class ToyAdapter:
    """A whole framework front: the required methods, and dtype_name to map the framework's
    dtypes to the engine's names (restore_dtype left to its default)."""

    def __init__(self):
        self.built = 0

    def owns(self, x):
        return isinstance(x, ToyArray)

    def check_savable(self, x, path):
        pass

    def dtype_name(self, x):
        return x.dtype.numpy_name

    def save_shards(self, x, process_index, process_count):
        a = np.ascontiguousarray(x.data)
        return a.shape, [((0,) * a.ndim, a.shape, a.reshape(-1).view(np.uint8), 0, 1)], False

    def restore_boxes(self, target, shape):
        return {None: ((0,) * len(shape), shape)}

    def build(self, target, shape, buffers):
        self.built += 1
        return ToyArray(buffers[None], target.dtype)

    def orbax_sharding(self, x):
        return None


# What the entry points of the tests load to: a class, an instance and a factory.
TOY_ADAPTER = ToyAdapter()
factory_calls = []


def make_toy_adapter():
    factory_calls.append(1)
    return ToyAdapter()


NOT_AN_ADAPTER = 42


class RecordingCoordinator:
    """A one-process coordinator (the protocol of tensorstash.jax.JaxCoordinator) that records
    which of its methods were called."""

    def __init__(self):
        self.calls: list[str] = []
        self.kv: dict[str, str] = {}

    def process_index(self) -> int:
        self.calls.append("process_index")
        return 0

    def process_count(self) -> int:
        self.calls.append("process_count")
        return 1

    def barrier(self, name: str, timeout_ms: int) -> None:
        self.calls.append("barrier")

    def key_value_set(self, key: str, value: str) -> None:
        self.calls.append("key_value_set")
        self.kv[key] = value

    def key_value_get(self, key: str, timeout_ms: int) -> str:
        self.calls.append("key_value_get")
        return self.kv[key]


class CoordinatingAdapter(ToyAdapter):
    """An adapter whose framework runs several processes: default_coordinator() is its
    runtime's coordinator (None: it runs one)."""

    def __init__(self, coordinator):
        super().__init__()
        self.coordinator = coordinator

    def owns(self, x):
        return False

    def default_coordinator(self):
        return self.coordinator


@pytest.fixture(autouse=True)
def fresh_registry():
    """Each test starts with no adapter registered and the entry points not yet loaded, and
    leaves the registry so (the next lookup loads JAX's adapter again)."""
    _adapters._reset()
    factory_calls.clear()
    yield
    _adapters._reset()


def install_entry_points(tmp_path, monkeypatch, lines: list[str]) -> None:
    """A distribution on sys.path whose entry points of group "tensorstash.adapters" are
    `lines` ("name = module:attr")."""
    info = tmp_path / "site" / "toyadapters-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyadapters\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[tensorstash.adapters]\n" + "\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))  # (and invalidates import caches)
    importlib.invalidate_caches()


def save_and_restore_toys(step: str) -> dict:
    value = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    tensorstash.save(step, {"w": ToyArray(value, F32), "b": ToyArray([1.5, -2.25], BF16),
                            "n": np.int64(3)})
    meta = tensorstash.metadata(step)
    assert (meta["w"].dtype, meta["w"].shape) == (np.dtype(np.float32), (3, 4))
    assert meta["b"].dtype == tnp.dtype_from_name("bfloat16")
    target = {"w": ToyArray(np.zeros((3, 4)), F64), "b": ToyArray(np.zeros(2), BF16),
              "n": np.int64(0)}
    got = tensorstash.restore(step, target=target)
    assert isinstance(got["w"], ToyArray) and got["w"].dtype is F64  # read as float64
    assert_same_array(got["w"].data, value.astype(np.float64))
    assert isinstance(got["b"], ToyArray) and got["b"].dtype is BF16
    assert got["b"].data.tolist() == [1.5, -2.25]
    assert got["n"] == 3
    plain = tensorstash.restore(step)  # without a target: NumPy, as stored
    assert_same_array(plain["w"], value)
    return got


def test_a_registered_adapter_saves_and_restores_its_arrays(tmp_path):
    with pytest.raises(TypeError, match="ToyArray"):  # unknown before it is registered
        tensorstash.save(str(tmp_path / "0000000001"), {"w": ToyArray([1.0], F32)})
    adapter = tensorstash.register_adapter(ToyAdapter())
    assert _adapters.owner(ToyArray([1.0], F32)) is adapter
    save_and_restore_toys(str(tmp_path / "0000000002"))
    assert adapter.built == 2


def test_an_unknown_dtype_of_an_adapter_names_the_leaf(tmp_path):
    class Refusing(ToyAdapter):
        def dtype_name(self, x):
            raise TypeError(f"dtype {x.dtype!r} cannot be stored")

    tensorstash.register_adapter(Refusing())
    with pytest.raises(TypeError, match=r"'w'.*toy\.f32"):
        tensorstash.save(str(tmp_path / "0000000001"), {"w": ToyArray([1.0], F32)})


def test_registration_order_first_wins_and_numpy_is_last():
    x = ToyArray([1.0], F32)
    a, b, c = ToyAdapter(), ToyAdapter(), ToyAdapter()
    tensorstash.register_adapter(a)
    tensorstash.register_adapter(b)  # first=True: asked before a
    assert _adapters.owner(x) is b
    tensorstash.register_adapter(c, first=False)  # after a and b (and JAX's), before NumPy's
    order = _adapters.registered()
    assert order[:2] == [b, a] and order[-2] is c and order[-1] is _adapters.NUMPY
    tensorstash.register_adapter(a)  # again: moved to the front, not listed twice
    assert _adapters.owner(x) is a and _adapters.registered().count(a) == 1
    assert _adapters.owner(np.zeros(2)) is _adapters.NUMPY


def test_jax_adapter_is_registered_the_same_way_after_explicit_ones():
    import jax.numpy as jnp

    mine = tensorstash.register_adapter(ToyAdapter())  # before the first lookup
    order = _adapters.registered()
    assert [type(a) for a in order] == [ToyAdapter, *builtin_types(), tnp.NumpyAdapter]
    assert order[0] is mine
    assert isinstance(_adapters.owner(jnp.zeros(3)), tjax.JaxAdapter)


@pytest.mark.parametrize("bad, message", [
    (ToyAdapter, "not the class ToyAdapter"),
    (object(), "has no owns, check_savable, save_shards, restore_boxes, build, orbax_sharding"),
])
def test_register_adapter_refuses_what_is_not_an_adapter(bad, message):
    with pytest.raises(TypeError, match=message):
        tensorstash.register_adapter(bad)
    assert _adapters.registered()[0] is not bad


@pytest.mark.parametrize("attr", ["ToyAdapter", "TOY_ADAPTER", "make_toy_adapter"])
def test_an_entry_point_adapter_is_loaded_once_at_the_first_lookup(tmp_path, monkeypatch, attr):
    install_entry_points(tmp_path, monkeypatch, [f"toy = {__name__}:{attr}"])
    assert _adapters._discovered is None  # lazily: nothing loaded before a lookup
    got = save_and_restore_toys(str(tmp_path / "0000000001"))
    toys = [a for a in _adapters.registered() if isinstance(a, ToyAdapter)]
    assert len(toys) == 1 and toys[0].built >= 1
    if attr == "TOY_ADAPTER":
        assert toys[0] is TOY_ADAPTER
    if attr == "make_toy_adapter":
        assert len(factory_calls) == 1  # once, whatever the number of lookups since
    # Entry points come after explicit registrations, before JAX's adapter and NumPy's.
    assert [type(a) for a in _adapters.registered()] == [
        ToyAdapter, *builtin_types(), tnp.NumpyAdapter]
    assert isinstance(got["w"], ToyArray)


def test_an_explicit_registration_outranks_an_entry_point(tmp_path, monkeypatch):
    install_entry_points(tmp_path, monkeypatch, [f"toy = {__name__}:TOY_ADAPTER"])
    mine = tensorstash.register_adapter(ToyAdapter())
    assert _adapters.owner(ToyArray([1.0], F32)) is mine
    assert TOY_ADAPTER in _adapters.registered()


def test_a_broken_entry_point_warns_naming_it_and_the_others_work(tmp_path, monkeypatch):
    install_entry_points(tmp_path, monkeypatch, [
        "absent = tensorstash_no_such_module:Adapter",
        f"bogus = {__name__}:NOT_AN_ADAPTER",
        f"toy = {__name__}:make_toy_adapter",
    ])
    with pytest.warns(RuntimeWarning) as caught:
        assert isinstance(_adapters.owner(ToyArray([1.0], F32)), ToyAdapter)
    messages = sorted(str(w.message) for w in caught if "entry point" in str(w.message))
    assert len(messages) == 2, messages
    assert "'absent'" in messages[0] and "tensorstash_no_such_module" in messages[0]
    assert "'bogus'" in messages[1] and "has no owns" in messages[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # loaded once: no second warning
        save_and_restore_toys(str(tmp_path / "0000000001"))
    assert len(factory_calls) == 1


def test_reset_forgets_and_the_next_lookup_loads_again(tmp_path, monkeypatch):
    install_entry_points(tmp_path, monkeypatch, [f"toy = {__name__}:make_toy_adapter"])
    _adapters.registered()
    assert len(factory_calls) == 1
    _adapters._reset()
    assert _adapters.ADAPTERS == [_adapters.NUMPY]
    _adapters.registered()
    assert len(factory_calls) == 2


def test_a_lookup_loads_into_a_list_put_in_place_of_adapters(monkeypatch):
    # (test_package_layout swaps _adapters.ADAPTERS for a list of its own, maybe before the
    # first lookup: the built-ins must be in it, and in the original list once it is back.)
    import jax.numpy as jnp

    mine = ToyAdapter()
    with monkeypatch.context() as m:
        m.setattr(_adapters, "ADAPTERS", [mine, *_adapters.ADAPTERS])
        assert _adapters.owner(ToyArray([1.0], F32)) is mine
        assert isinstance(_adapters.owner(jnp.zeros(2)), tjax.JaxAdapter)
    assert _adapters.owner(ToyArray([1.0], F32)) is None
    assert isinstance(_adapters.owner(jnp.zeros(2)), tjax.JaxAdapter)


def test_the_default_coordinator_comes_from_the_adapters(tmp_path):
    assert _save.default_coordinator() is None  # one process: JAX's and NumPy's give none
    first, second = RecordingCoordinator(), RecordingCoordinator()
    tensorstash.register_adapter(CoordinatingAdapter(second))
    tensorstash.register_adapter(CoordinatingAdapter(None))  # asked first, gives none
    assert _save.default_coordinator() is second
    tensorstash.register_adapter(CoordinatingAdapter(first))
    assert _save.default_coordinator() is first  # the first one that is not None

    step = str(tmp_path / "0000000001")
    tensorstash.save(step, {"x": np.arange(5)})  # no coordinator given: the adapters'
    assert "process_count" in first.calls and second.calls == []
    assert_same_array(tensorstash.restore(step)["x"], np.arange(5))


def test_the_manager_takes_the_adapters_default_coordinator(tmp_path):
    coordinator = RecordingCoordinator()
    tensorstash.register_adapter(CoordinatingAdapter(coordinator))
    manager = tensorstash.CheckpointManager(str(tmp_path / "run"))
    try:
        manager.save(1, {"x": np.arange(3)})
        manager.wait_until_finished()
    finally:
        manager.close()
    assert "process_index" in coordinator.calls


def test_the_save_path_imports_no_framework():
    # The coordinator is the adapters' now: _save.py names no framework module.
    tree = ast.parse((PACKAGE / "_save.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.update([node.module or ""] + [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert imported and not {"jax", "numpy", "torch"} & imported, imported


def test_dead_helpers_are_gone():
    assert not hasattr(sys.modules["tensorstash._tree"], "join_path")  # no caller was left
