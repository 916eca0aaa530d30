"""Pytrees to and from the node schema of tree.json (docs/format.md, "tree.json").

Containers: dicts (keys kept in order; int keys become their decimal string), lists, tuples,
namedtuples (stored as dicts of their fields), None, and, when JAX is installed, any other
registered pytree node (stored as a dict keyed by its children's key names, e.g. dataclass
fields). Leaves: arrays (JAX, NumPy, NumPy scalars), bool, int, float, str, bytes.

Array paths join the keys from the root, escaped as in JSON Pointer ('~' -> '~0', '/' -> '~1');
list and tuple positions are decimal.
"""

from __future__ import annotations

import base64
import collections
import math
from typing import Any, Callable, Iterator

import numpy as np

try:
    import jax
except ImportError:  # JAX is optional
    jax = None


def escape_key(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def join_path(parent: str | None, segment: str) -> str:
    return segment if parent is None else f"{parent}/{segment}"


def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def is_array(x: Any) -> bool:
    if isinstance(x, (np.ndarray, np.generic)):
        return True
    return jax is not None and isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def _key_name(key: Any) -> str:
    """The name of one jax.tree_util key-path entry."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def custom_children(node: Any) -> tuple[list[tuple[str, Any]], Any] | None:
    """For a registered JAX pytree node that is not a builtin container: its (name, child) pairs
    and a one-level treedef to rebuild it. None for anything that is not such a node."""
    if jax is None:
        return None
    pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if treedef.num_nodes == 1:  # `node` itself is a leaf
        return None
    return [(_key_name(path[0]), child) for path, child in pairs], treedef


def dict_items(d: dict, path: str | None) -> Iterator[tuple[str, Any]]:
    for key, value in d.items():
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            where = path if path is not None else "the root"
            raise TypeError(f"dict key {key!r} at {where!r} is not a str or int")
        yield str(key), value


def encode(tree: Any, on_array: Callable[[str, Any], None]) -> dict:
    """Turns `tree` into a tree node (JSON-able dict). Calls on_array(path, leaf) for every array
    leaf; array leaves are numbered in call order."""
    counter = [0]

    def walk(x: Any, path: str | None) -> dict:
        where = path if path is not None else ""
        if x is None:
            return {"kind": "none"}
        if is_array(x):
            on_array(where, x)
            counter[0] += 1
            return {"kind": "array", "array": counter[0] - 1}
        if isinstance(x, bool):
            return {"kind": "bool", "value": x}
        if isinstance(x, int):
            return {"kind": "int", "value": str(x)}
        if isinstance(x, float):
            # repr drops the sign of a NaN; the format keeps it ("-nan").
            text = "-nan" if math.isnan(x) and math.copysign(1.0, x) < 0 else repr(x)
            return {"kind": "float", "value": text}
        if isinstance(x, str):
            return {"kind": "string", "value": x}
        if isinstance(x, (bytes, bytearray, memoryview)):
            return {"kind": "bytes", "base64": base64.b64encode(bytes(x)).decode("ascii")}
        if isinstance(x, dict):
            return {"kind": "dict", "entries": [[k, walk(v, join_path(path, escape_key(k)))]
                                                for k, v in dict_items(x, path)]}
        if is_namedtuple(x):
            return {"kind": "dict", "entries": [[f, walk(getattr(x, f), join_path(path, escape_key(f)))]
                                                for f in type(x)._fields]}
        if isinstance(x, (list, tuple)):
            return {"kind": "list" if isinstance(x, list) else "tuple",
                    "items": [walk(v, join_path(path, str(i))) for i, v in enumerate(x)]}
        custom = custom_children(x)
        if custom is not None:
            return {"kind": "dict", "entries": [[k, walk(v, join_path(path, escape_key(k)))]
                                                for k, v in custom[0]]}
        raise TypeError(f"cannot save a leaf of type {type(x).__name__} at {where!r}: supported "
                        "leaves are arrays, bool, int, float, str and bytes")

    return walk(tree, None)


def decode(node: dict, on_array: Callable[[str, int], Any]) -> Any:
    """Rebuilds plain containers from a tree node; array leaves become on_array(path, id)."""

    def walk(n: dict, path: str | None) -> Any:
        kind = n["kind"]
        if kind == "none":
            return None
        if kind == "dict":
            return {k: walk(v, join_path(path, escape_key(k))) for k, v in n["entries"]}
        if kind in ("list", "tuple"):
            items = [walk(v, join_path(path, str(i))) for i, v in enumerate(n["items"])]
            return items if kind == "list" else tuple(items)
        if kind == "array":
            return on_array(path if path is not None else "", n["array"])
        return scalar_value(n)

    return walk(node, None)


def scalar_value(n: dict) -> Any:
    kind = n["kind"]
    if kind == "int":
        return int(n["value"])
    if kind == "float":
        return float(n["value"])
    if kind == "bool":
        return bool(n["value"])
    if kind == "string":
        return n["value"]
    if kind == "bytes":
        return base64.b64decode(n["base64"])
    raise ValueError(f"unexpected tree node kind {kind!r}")


def index_leaves(node: dict) -> dict[str, dict]:
    """Path -> leaf node (arrays, scalars and None) of a saved tree node."""
    out: dict[str, dict] = {}

    def walk(n: dict, path: str | None) -> None:
        if n["kind"] == "dict":
            for k, v in n["entries"]:
                walk(v, join_path(path, escape_key(k)))
        elif n["kind"] in ("list", "tuple"):
            for i, v in enumerate(n["items"]):
                walk(v, join_path(path, str(i)))
        else:
            out[path if path is not None else ""] = n

    walk(node, None)
    return out


def map_target(target: Any, leaf_fn: Callable[[str, Any], Any]) -> Any:
    """Rebuilds `target`'s structure, replacing every leaf (anything that is not a container;
    None stays None) by leaf_fn(path, leaf)."""

    def walk(x: Any, path: str | None) -> Any:
        where = path if path is not None else ""
        if x is None:
            return None
        if is_array(x) or isinstance(x, (bool, int, float, str, bytes)):
            return leaf_fn(where, x)
        if isinstance(x, dict):
            out = {k: walk(v, join_path(path, escape_key(sk))) for (sk, v), k in
                   zip(dict_items(x, path), x.keys())}
            if type(x) is dict:
                return out
            if isinstance(x, collections.defaultdict):
                return type(x)(x.default_factory, out)
            return type(x)(out)
        if is_namedtuple(x):
            return type(x)(*[walk(getattr(x, f), join_path(path, escape_key(f)))
                             for f in type(x)._fields])
        if isinstance(x, (list, tuple)):
            items = [walk(v, join_path(path, str(i))) for i, v in enumerate(x)]
            return items if isinstance(x, list) else type(x)(items)
        custom = custom_children(x)
        if custom is not None:
            pairs, treedef = custom
            return jax.tree_util.tree_unflatten(
                treedef, [walk(v, join_path(path, escape_key(k))) for k, v in pairs])
        return leaf_fn(where, x)

    return walk(target, None)
