"""The Python package as a skin over the engine (issue 14, part 5): no import cycles among its
modules, defaults taken from the engine once, and framework adapters as the one place where a
leaf type is handled."""

from __future__ import annotations

import ast
import inspect
import pathlib

import numpy as np
import pytest

import tensorstash
from tensorstash import _adapters, _ext
from tshelpers import assert_same_array

PACKAGE = pathlib.Path(tensorstash.__file__).parent


def package_imports() -> dict[str, set[str]]:
    """{module: the package's modules it imports at its top level} (imports inside functions
    are left out: they run late, when every module is loaded)."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    graph = {}
    for name in modules:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        found = set()
        for node in tree.body:  # top level only
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.Try):  # an optional import guarded by try
                for inner in node.body:
                    if isinstance(inner, ast.ImportFrom) and inner.level == 1 and inner.module:
                        found.add(inner.module.split(".")[0])
        graph[name] = found & modules
    return graph


def test_no_module_of_the_package_imports_another_in_a_circle():
    graph = package_imports()
    assert "manager" in graph and "_restore" in graph["manager"]  # the graph is real
    visiting, done = [], set()

    def visit(name):
        if name in done:
            return
        assert name not in visiting, f"import cycle: {' -> '.join(visiting + [name])}"
        visiting.append(name)
        for other in sorted(graph[name]):
            visit(other)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_init_only_re_exports():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    # The rest lives in the modules; __getattr__ imports tensorstash.torch on first use only.
    assert defined == ["__getattr__", "store_schemes"], defined


@pytest.mark.parametrize("function, parameter, key", [
    (tensorstash.save, "max_inflight_bytes", "max_inflight_bytes"),
    (tensorstash.save, "chunk_bytes", "chunk_bytes"),
    (tensorstash.save, "data_file_bytes", "data_file_bytes"),
    (tensorstash.save, "zstd_level", "zstd_level"),
    (tensorstash.restore, "max_inflight_bytes", "read_max_inflight_bytes"),
    (tensorstash.CheckpointManager, "max_inflight_bytes", "max_inflight_bytes"),
    (tensorstash.CheckpointManager, "chunk_bytes", "chunk_bytes"),
    (tensorstash.CheckpointManager, "zstd_level", "zstd_level"),
    (tensorstash.CheckpointManager, "coordination_timeout", "coordination_timeout_s"),
])
def test_defaults_come_from_the_engine(function, parameter, key):
    assert inspect.signature(function).parameters[parameter].default == _ext.defaults()[key]


def test_no_default_is_written_twice_in_python():
    for path in PACKAGE.glob("*.py"):
        text = path.read_text()
        for literal in ("256 << 20", "8 << 20", "512 << 20"):
            assert literal not in text, f"{path.name} writes {literal}: take it from _options"


class Boxed:
    """A toy framework's array: a NumPy array in a box."""

    def __init__(self, data):
        self.data = np.asarray(data)
        self.shape, self.dtype = self.data.shape, self.data.dtype


class BoxedAdapter:
    """A whole framework front in a few lines: the protocol of _adapters.py."""

    def __init__(self):
        self.built = 0

    def owns(self, x):
        return isinstance(x, Boxed)

    def check_savable(self, x, path):
        pass

    def save_shards(self, x, process_index, process_count):
        a = np.ascontiguousarray(x.data)
        return a.shape, [((0,) * a.ndim, a.shape, a.reshape(-1).view(np.uint8), 0, 1)], False

    def restore_boxes(self, target, shape):
        # Two "devices", each holding half of the rows.
        half = shape[0] // 2
        return {"d0": ((0, 0), (half, shape[1])), "d1": ((half, 0), (shape[0] - half, shape[1]))}

    def build(self, target, shape, buffers):
        self.built += 1
        return Boxed(np.concatenate([buffers["d0"], buffers["d1"]]))

    def orbax_sharding(self, x):
        return None


def test_a_new_framework_is_one_adapter(tmp_path, monkeypatch):
    adapter = BoxedAdapter()
    monkeypatch.setattr(_adapters, "ADAPTERS", [adapter, *_adapters.ADAPTERS])
    value = np.arange(48, dtype=np.float32).reshape(8, 6)
    step = str(tmp_path / "0000000001")
    tensorstash.save(step, {"w": Boxed(value), "n": np.int64(3)})
    got = tensorstash.restore(step, target={"w": Boxed(np.zeros((8, 6), np.float32)),
                                            "n": np.int64(0)})
    assert isinstance(got["w"], Boxed) and adapter.built == 1
    assert_same_array(got["w"].data, value)
    assert got["n"] == 3
