"""Pytrees to and from the node schema of tree.json (docs/format.md, "tree.json").

Containers: dicts (keys kept in order; str keys, and ints, bools, floats, bytes, None and
tuples of those, which come back as they were: docs/format.md 4.2, "typed_dict"), lists, tuples,
namedtuples (stored as dicts of their fields), None, and, when JAX is installed, any other
registered pytree node (stored as a dict keyed by its children's key names, e.g. dataclass
fields). Leaves: arrays (JAX, NumPy, NumPy scalars), bool, int, float, str, bytes.

Array paths join the keys from the root, escaped as in JSON Pointer ('~' -> '~0', '/' -> '~1');
list and tuple positions are decimal.

PRNG keys: a jax.Array of typed PRNG keys (jax.random.key; dtype key<fry>, key<rbg>, ...) is
stored as a dict node of two entries, in this order: KEY_MARK, a string leaf naming the
implementation ("threefry2x32", "rbg", "unsafe_rbg"), and KEY_DATA, the array of its key data
(jax.random.key_data: uint32, the key shape plus the implementation's trailing dimensions). Its
data's array path is therefore "<leaf path>/key_data". A reader that knows nothing of keys (an
older tensorstash) sees that dict, the implementation and the raw uint32 data, and nothing it
could mistake for something else; a dict of the caller's with a KEY_MARK key is refused at save.
mark_keys() turns those dicts (and the Orbax arrays that Orbax recorded as keys) into leaves of
the in-memory kind "prng_key" that decode(), index_leaves() and the restore handle.

Shardings: an array leaf's node carries "sharding", the description of its sharding that its
adapter gives (_adapters.sharding_record; docs/format.md 4.2), when there is one. A step's tree
read back (_ext.Reader.tree) holds it as JSON text.

Trees may be nested MAX_DEPTH levels deep (docs/format.md, section 10), deeper than Python's
recursion limit lets a recursive walk go: every walk here keeps its own stack (_fold), tree
nodes too deep for the json module go to JSON text through _ext (dumps), and a step's tree
comes back as Python objects from the reader (_ext.Reader.tree), built in C++.
"""

from __future__ import annotations

import base64
import collections
import decimal
import json
import math
from typing import Any, Callable, Iterator

import numpy as np

from . import _adapters, _ext

try:
    import jax
except ImportError:  # JAX is optional
    jax = None


# The entries of a PRNG key's dict node (module docstring).
KEY_MARK = "__tensorstash_prng_key__"
KEY_DATA = "key_data"


def _jax_adapter_module():
    from . import jax as tjax  # (only imported with JAX installed)
    return tjax


def is_key_array(x: Any) -> bool:
    """Whether `x` is a jax.Array of typed PRNG keys (cheap for every other leaf: a key's dtype
    is not a NumPy dtype)."""
    return (jax is not None and isinstance(x, jax.Array) and not isinstance(x.dtype, np.dtype)
            and _jax_adapter_module().is_key(x))


# Whether a dtype that is not NumPy's (a torch dtype, a PRNG key type) is a PRNG key type:
# asked of JAX once per dtype, since the answer depends on the dtype alone (JAX's issubdtype
# was a sixth of a restore of 10,000 torch tensors).
_key_dtypes: dict[Any, bool] = {}


def is_key_target(x: Any) -> bool:
    """Whether target leaf `x` (jax.Array, jax.ShapeDtypeStruct, ArrayMetadata) asks for PRNG
    keys."""
    dtype = getattr(x, "dtype", None)
    if jax is None or dtype is None or isinstance(dtype, np.dtype):
        return False
    try:
        known = _key_dtypes.get(dtype)
    except TypeError:  # (an unhashable dtype)
        return _jax_adapter_module().is_key(x)
    if known is None:
        known = _key_dtypes[dtype] = _jax_adapter_module().is_key(x)
    return known


def key_parts(x: Any) -> tuple[str, Any]:
    """(implementation name, key data) of PRNG key array `x` (is_key_array)."""
    tjax = _jax_adapter_module()
    return tjax.key_impl(x), tjax.key_data(x)


def key_node_impl(n: dict) -> str | None:
    """The implementation of a stored PRNG key's dict node (module docstring), else None."""
    if n.get("kind") != "dict":
        return None
    entries = n["entries"]
    if (len(entries) != 2 or entries[0][0] != KEY_MARK or entries[1][0] != KEY_DATA
            or entries[0][1].get("kind") != "string" or entries[1][1].get("kind") != "array"):
        return None
    return entries[0][1]["value"]


def mark_keys(node: dict, orbax_keys: dict[str, str] | None = None) -> dict:
    """`node` (a step's tree, changed in place) with every PRNG key leaf as a node
    {"kind": "prng_key", "impl": name, "array": data's id, "data_path": data's array path}:
    the dict nodes of the native format, and the array leaves at the paths of `orbax_keys`
    ({array path: implementation}, what Orbax's array metadata records). Returns the root,
    which is replaced when it is itself a key."""
    orbax_keys = orbax_keys or {}

    def marked(n: dict, path: str | None) -> dict | None:
        impl = key_node_impl(n)
        if impl is not None:
            data_path = KEY_DATA if path is None else f"{path}/{KEY_DATA}"
            data = n["entries"][1][1]
            return {"kind": "prng_key", "impl": impl, "array": data["array"],
                    "data_path": data_path, "sharding": data.get("sharding")}
        if n.get("kind") == "array" and (path or "") in orbax_keys:
            return {"kind": "prng_key", "impl": orbax_keys[path or ""], "array": n["array"],
                    "data_path": path or "", "sharding": n.get("sharding")}
        return None

    root = marked(node, None)
    if root is not None:
        return root
    stack: list[tuple[dict, str | None]] = [(node, None)]  # (not _fold: nothing is built; depth is bounded by the reader)
    while stack:
        n, path = stack.pop()
        kind = n["kind"]
        if kind in ("dict", "typed_dict"):
            slots = [(e, 1, escape_key(e[0])) for e in n["entries"]]
        elif kind in ("list", "tuple"):
            slots = [(n["items"], i, str(i)) for i in range(len(n["items"]))]
        else:
            continue
        for holder, index, segment in slots:
            child = holder[index]
            child_path = segment if path is None else f"{path}/{segment}"
            key = marked(child, child_path)
            if key is not None:
                holder[index] = key
            else:
                stack.append((child, child_path))
    return node


def escape_key(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def is_array(x: Any) -> bool:
    """Whether `x` is an array leaf: one that a framework adapter owns (_adapters.py)."""
    return _adapters.owner(x) is not None


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


# The key types a dict may have besides str (tuples of any of these and str too): what Orbax
# and optimizer state dicts use, and what tree.json can record exactly.
_KEY_SCALARS = (bool, int, float, bytes, type(None))


def key_text(key: Any, where: str) -> str:
    """The text of dict key `key` (at `where`, for errors): what its path segment escapes and
    what Orbax names it by (str(key); an int's decimal digits). TypeError for a key of another
    type than str, int, bool, float, bytes, None or a tuple of those."""
    if isinstance(key, str):
        check_text(key, f"dict key {key!r} at {where!r}")
        return key
    if not is_plain_key(key):
        raise TypeError(f"dict key {key!r} at {where!r} is a {type(key).__name__}; dict keys "
                        "are str, int, bool, float, bytes, None or tuples of those")
    text = int_text(key) if isinstance(key, int) and not isinstance(key, bool) else str(key)
    check_text(text, f"dict key {text!r} at {where!r}")
    return text


def is_plain_key(key: Any) -> bool:
    """Whether `key` is a dict key tree.json records (key_text)."""
    if isinstance(key, tuple) and not is_namedtuple(key):
        return all(isinstance(k, str) or is_plain_key(k) for k in key)
    return isinstance(key, _KEY_SCALARS) and (type(key) in _KEY_SCALARS or isinstance(key, int))


def key_node(key: Any) -> dict:
    """The tree node of a dict key that is not a str (a "typed_dict" key)."""
    if isinstance(key, tuple):
        return {"kind": "tuple", "items": [key_node(k) for k in key]}
    if key is None:
        return {"kind": "none"}
    if isinstance(key, bool):
        return {"kind": "bool", "value": key}
    if isinstance(key, int):
        return {"kind": "int", "value": int_text(key)}
    if isinstance(key, float):
        return {"kind": "float", "value": "-nan" if math.isnan(key) and math.copysign(1.0, key) < 0
                else repr(key)}
    if isinstance(key, bytes):
        return {"kind": "bytes", "base64": base64.b64encode(key).decode("ascii")}
    return {"kind": "string", "value": key}


def key_value(n: dict) -> Any:
    """The dict key of a "typed_dict" key node (key_node's inverse)."""
    kind = n["kind"]
    if kind == "tuple":
        return tuple(key_value(k) for k in n["items"])
    if kind == "none":
        return None
    return scalar_value(n)


def dict_items(d: dict, path: str | None) -> Iterator[tuple[str, Any]]:
    """(key text, value) of each entry of `d`; ValueError when two keys have the same text
    (1 and "1"), which would be one path."""
    where = path if path is not None else "the root"
    seen: dict[str, Any] = {}
    for key, value in d.items():
        text = key_text(key, where)
        if text in seen:
            raise ValueError(f"dict keys {seen[text]!r} and {key!r} at {where!r} are both "
                             f"named {text!r}; a checkpoint's paths need them apart")
        seen[text] = key
        yield text, value


def typed_keys(d: dict) -> list | None:
    """The key nodes of dict `d` when any key is not a str (a "typed_dict"), else None."""
    if all(isinstance(k, str) for k in d):
        return None
    return [{"kind": "string", "value": k} if isinstance(k, str) else key_node(k) for k in d]


def check_text(text: str, what: str, why: str = "checkpoints store text as UTF-8") -> None:
    """ValueError naming `what` unless `text` has a UTF-8 encoding, which the engine needs
    (docs/format.md 4.3): a str holding a lone surrogate (e.g. "\\ud800") has none."""
    if text.isascii():  # (a flag of the str: no need to encode it)
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode text (it holds a lone surrogate); "
                         f"{why}") from None


def int_text(x: int) -> str:
    """The decimal text of any int. str() refuses ints of more than sys.get_int_max_str_digits()
    digits (4300 by default, a guard against slow conversions of untrusted text); the format
    allows any magnitude, and decimal converts without that limit."""
    x = int(x)  # an int subclass (IntEnum) may print otherwise
    try:
        return str(x)
    except ValueError:
        return str(decimal.Decimal(x))


def int_value(text: str) -> int:
    """The int of an int leaf's decimal text, of any length (see int_text)."""
    try:
        return int(text)
    except ValueError:
        return int(decimal.Decimal(text))


# The deepest tree the format allows: no node more than this many levels below the root.
MAX_DEPTH = _ext.MAX_TREE_DEPTH


def _fold(root: Any, expand: Callable[[Any, str | None], tuple], what: str) -> Any:
    """The value of the tree `root`, built bottom-up without recursion.

    expand(x, path) returns (None, value) for a leaf, and (children, build) for a container:
    children a list of (path segment, child), build(the children's values) its value. Nodes
    are expanded depth first, left to right (array leaves are numbered in that order). A node
    more than MAX_DEPTH levels below the root (or a container that holds itself) is a
    ValueError naming `what` and the path."""
    children, value = expand(root, None)
    if children is None:
        return value
    # One frame per container being built: [iterator over its children, their values so far,
    # build, path, depth]. A container's value joins its parent's values once all of its own
    # children have theirs.
    frames = [[iter(children), [], value, None, 0]]
    while frames:
        children, values, build, path, depth = frames[-1]
        for segment, child in children:
            child_path = segment if path is None else f"{path}/{segment}"
            grandchildren, value = expand(child, child_path)
            if grandchildren is None:
                values.append(value)
                continue
            if grandchildren and depth + 1 == MAX_DEPTH:
                too_deep = f"{child_path}/{grandchildren[0][0]}"
                raise ValueError(f"{what} is nested more than {MAX_DEPTH} levels deep, the "
                                 f"format's limit, at {too_deep!r}")
            frames.append([iter(grandchildren), [], value, child_path, depth + 1])
            break
        else:  # all children have their values
            frames.pop()
            value = build(values)
            if frames:
                frames[-1][1].append(value)
    return value


def dumps(node: dict) -> str:
    """The JSON text of a tree node. json.dumps recurses, and a tree of more than about 330
    levels exhausts Python's recursion; _ext.json_dumps (slower) takes those."""
    try:
        return json.dumps(node)
    except RecursionError:
        return _ext.json_dumps(node)


def encode(tree: Any, on_array: Callable[[str, Any], None]) -> dict:
    """Turns `tree` into a tree node (JSON-able dict). Calls on_array(path, leaf) for every array
    leaf; array leaves are numbered in call order. TypeError for unsupported leaves, ValueError
    for text that is not valid Unicode and trees nested deeper than MAX_DEPTH."""
    arrays = 0

    def expand(x: Any, path: str | None) -> tuple:
        nonlocal arrays
        where = path if path is not None else ""
        if x is None:
            return None, {"kind": "none"}
        if is_key_array(x):
            impl, data = key_parts(x)
            pairs = [(KEY_MARK, impl), (KEY_DATA, data)]
            return (pairs, lambda nodes: {"kind": "dict",
                                          "entries": [[k, n] for (k, _), n in zip(pairs, nodes)]})
        adapter = _adapters.owner(x)
        if adapter is not None:  # an array leaf
            on_array(where, x)
            arrays += 1
            sharding = _adapters.sharding_record(adapter, x)
            if sharding is None:
                return None, {"kind": "array", "array": arrays - 1}
            return None, {"kind": "array", "array": arrays - 1, "sharding": sharding}
        if isinstance(x, bool):
            return None, {"kind": "bool", "value": x}
        if isinstance(x, int):
            return None, {"kind": "int", "value": int_text(x)}
        if isinstance(x, float):
            # repr drops the sign of a NaN; the format keeps it ("-nan").
            text = "-nan" if math.isnan(x) and math.copysign(1.0, x) < 0 else repr(x)
            return None, {"kind": "float", "value": text}
        if isinstance(x, str):
            check_text(x, f"the string at {where!r}")
            return None, {"kind": "string", "value": x}
        if isinstance(x, (bytes, bytearray, memoryview)):
            return None, {"kind": "bytes", "base64": base64.b64encode(bytes(x)).decode("ascii")}
        keys = None
        if isinstance(x, dict):
            pairs = list(dict_items(x, path))
            keys = typed_keys(x)
        elif is_namedtuple(x):
            pairs = [(f, getattr(x, f)) for f in type(x)._fields]
        elif isinstance(x, (list, tuple)):
            kind = "list" if isinstance(x, list) else "tuple"
            return ([(str(i), v) for i, v in enumerate(x)],
                    lambda nodes: {"kind": kind, "items": nodes})
        elif (custom := custom_children(x)) is not None:
            pairs = custom[0]
        else:
            raise TypeError(f"cannot save a leaf of type {type(x).__name__} at {where!r}: "
                            "supported leaves are arrays, bool, int, float, str and bytes")
        if any(k == KEY_MARK for k, _ in pairs):
            raise ValueError(f"the key {KEY_MARK!r} at {where or 'the root'!r} is reserved: "
                             "checkpoints mark PRNG key arrays with it")
        if keys is not None:
            return ([(escape_key(k), v) for k, v in pairs],
                    lambda nodes: {"kind": "typed_dict", "keys": keys,
                                   "entries": [[k, n] for (k, _), n in zip(pairs, nodes)]})
        return ([(escape_key(k), v) for k, v in pairs],
                lambda nodes: {"kind": "dict",
                               "entries": [[k, n] for (k, _), n in zip(pairs, nodes)]})

    return _fold(tree, expand, "the tree")


def node_children(n: dict) -> list[tuple[str, dict]] | None:
    """(path segment, child node) of each child of a dict, list or tuple node; None for leaves."""
    kind = n["kind"]
    if kind in ("dict", "typed_dict"):
        return [(escape_key(k), v) for k, v in n["entries"]]
    if kind in ("list", "tuple"):
        return [(str(i), v) for i, v in enumerate(n["items"])]
    return None


def decode(node: dict, on_array: Callable[[str, int], Any],
           on_key: Callable[[str, dict], Any] | None = None) -> Any:
    """Rebuilds plain containers from a tree node; array leaves become on_array(path, id), and
    PRNG key leaves (mark_keys) on_key(path, key node), or without on_key
    on_array(the key data's path, its id)."""

    def expand(n: dict, path: str | None) -> tuple:
        kind = n["kind"]
        if kind == "array":
            return None, on_array(path if path is not None else "", n["array"])
        if kind == "prng_key":
            if on_key is not None:
                return None, on_key(path if path is not None else "", n)
            return None, on_array(n["data_path"], n["array"])
        if kind == "dict":
            return node_children(n), lambda values: dict(zip((k for k, _ in n["entries"]), values))
        if kind == "typed_dict":
            keys = [key_value(k) for k in n["keys"]]
            where = path or "the root"
            if len(set(keys)) != len(keys):
                raise ValueError(f"the dict at {where!r} has equal keys")
            # Each entry's text is its key's (paths use the text, the restored dict the key):
            # a file where they differ would give a key no path leads to.
            for (text, _), key in zip(n["entries"], keys):
                if key_text(key, where) != text:
                    raise ValueError(f"the dict at {where!r} names the entry of key {key!r} "
                                     f"{text!r}, not {key_text(key, where)!r}")
            return node_children(n), lambda values: dict(zip(keys, values))
        if kind in ("list", "tuple"):
            return node_children(n), list if kind == "list" else tuple
        return None, None if kind == "none" else scalar_value(n)

    return _fold(node, expand, "the tree")


def scalar_value(n: dict) -> Any:
    kind = n["kind"]
    if kind == "int":
        return int_value(n["value"])
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

    def expand(n: dict, path: str | None) -> tuple:
        children = node_children(n)
        if children is None:
            out[path if path is not None else ""] = n
        return children, lambda _: None

    _fold(node, expand, "the tree")
    return out


def map_target(target: Any, leaf_fn: Callable[[str, Any], Any]) -> Any:
    """Rebuilds `target`'s structure, replacing every leaf (anything that is not a container;
    None stays None) by leaf_fn(path, leaf), called depth first, left to right."""

    def expand(x: Any, path: str | None) -> tuple:
        where = path if path is not None else ""
        if x is None:
            return None, None
        if is_array(x) or isinstance(x, (bool, int, float, str, bytes)):
            return None, leaf_fn(where, x)
        if isinstance(x, dict):
            return ([(escape_key(text), v) for text, v in dict_items(x, path)],
                    lambda values: _same_dict(x, dict(zip(x.keys(), values))))
        if is_namedtuple(x):
            return ([(escape_key(f), getattr(x, f)) for f in type(x)._fields],
                    lambda values: type(x)(*values))
        if isinstance(x, (list, tuple)):
            return ([(str(i), v) for i, v in enumerate(x)],
                    list if isinstance(x, list) else type(x))
        custom = custom_children(x)
        if custom is not None:
            pairs, treedef = custom
            return ([(escape_key(k), v) for k, v in pairs],
                    lambda values: jax.tree_util.tree_unflatten(treedef, values))
        return None, leaf_fn(where, x)

    return _fold(target, expand, "the target")


def _same_dict(like: dict, items: dict) -> dict:
    """`items` as a dict of the type of `like` (a defaultdict keeps its default factory)."""
    if type(like) is dict:
        return items
    if isinstance(like, collections.defaultdict):
        return type(like)(like.default_factory, items)
    return type(like)(items)
