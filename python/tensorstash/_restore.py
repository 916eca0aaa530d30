"""tensorstash.restore and tensorstash.metadata: a step (any format the engine reads) into
NumPy arrays, jax.Arrays or scalars, planned by the engine in one call (Reader.restore_to_host,
engine/host_restore.h): this module turns the target into boxes and the boxes into leaves."""

from __future__ import annotations

import base64
import bisect
import contextlib
import dataclasses
import json
import logging
import math
import os
import threading
import time
from typing import Any

import numpy as np

from . import _adapters, _ext, _gc, _options, _paths, _progress, _tree
from . import numpy as tnp


@dataclasses.dataclass(frozen=True)
class ArrayMetadata:
    """What a checkpoint stores about one array (from its metadata only).

    `saved_sharding`: the description of the sharding the array was saved with, as recorded
    (a dict in the schema of Orbax's `_sharding` entries: "sharding_type", and for a
    NamedSharding "shape" (the mesh's), "axis_names", "axis_types", "partition_spec" and,
    unless they are 0..n-1, the device ids in "device_mesh"), or None: a NumPy array, a
    sharding that no NamedSharding describes, or a checkpoint written before tensorstash
    recorded shardings. `sharding`: that sharding on this process's devices (a
    jax.sharding.NamedSharding, or a SingleDeviceSharding), or None when there is none or
    this job's devices cannot hold it (tensorstash.jax.sharding_from_record says when they
    can). As a restore target, an ArrayMetadata with a `sharding` restores as a jax.Array on
    it; one without, as a NumPy array."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...]
    num_chunks: int
    stored_bytes: int
    codec: str
    sharding: Any = dataclasses.field(default=None, compare=False)
    saved_sharding: dict | None = dataclasses.field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _saved_sharding(text: str | None) -> tuple[dict | None, Any]:
    """(the recorded description, the sharding on this process's devices) of a leaf's
    recorded sharding JSON text; (None, None) without one, or without JAX."""
    if text is None:
        return None, None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(doc, dict):
        return None, None
    try:
        from . import jax as tjax
    except ImportError:  # JAX is optional: the description without a sharding
        return doc, None
    return doc, tjax.sharding_from_text(text)


def _leaf_target(target: Any) -> Any:
    """A restore's target leaf as the adapters take it: an ArrayMetadata with a sharding
    becomes a jax.ShapeDtypeStruct on it (the restore as saved); any other leaf is itself."""
    if isinstance(target, ArrayMetadata) and target.sharding is not None:
        import jax
        return jax.ShapeDtypeStruct(target.shape, target.dtype, sharding=target.sharding)
    return target


_log = logging.getLogger("tensorstash")

# URL schemes of object stores: where share_reads=None shares (several processes reading the
# same bytes there pay N times the traffic of a shared link; a local disk does not).
_OBJECT_STORE_SCHEMES = ("s3://", "gs://")
# Shared restores started, by process index: part of each one's coordinator keys, so that the
# processes of a job, which restore the same steps in the same order, agree on them.
_share_counts: dict[int, int] = {}
_share_lock = threading.Lock()


def _share_setup(path: Any, share_reads: bool | None, coordinator: Any) -> tuple | None:
    """(coordinator, key prefix) of a restore of `path` that shares its reads, or None: sharing
    off, one process, or (share_reads=None) a path that is not an object-store URL."""
    if share_reads is not None and not isinstance(share_reads, bool):
        raise TypeError(f"share_reads must be True, False or None, not {share_reads!r}")
    if share_reads is False:
        return None
    if coordinator is None:
        coordinator = _adapters.default_coordinator()
    if coordinator is None or coordinator.process_count() <= 1:
        return None
    if share_reads is None and not os.fspath(path).startswith(_OBJECT_STORE_SCHEMES):
        return None
    with _share_lock:
        count = _share_counts[coordinator.process_index()] = (
            _share_counts.get(coordinator.process_index(), 0) + 1)
    return coordinator, f"tensorstash/share/{_paths.split(os.fspath(path))[1]}/{count}/"


def _open_shared(path, share: tuple, verify_checksums: bool, max_inflight_bytes: int,
                 io_threads: int) -> _ext.Reader:
    root, step = _paths.split(path)
    coordinator, prefix = share
    return _ext.Reader.shared(root, step, coordinator, key_prefix=prefix,
                              timeout_s=_options.COORDINATION_TIMEOUT_S,
                              verify_checksums=verify_checksums,
                              max_inflight_bytes=max_inflight_bytes, io_threads=io_threads)


def _open(path, verify_checksums: bool, max_inflight_bytes: int, io_threads: int,
          mmap: bool = True) -> _ext.Reader:
    """The reader of step folder `path`. Close it (contextlib.closing) once done: its open
    files would keep the space of a deleted step until the garbage collector ran."""
    root, step = _paths.split(path)
    return _ext.Reader(root, step, verify_checksums=verify_checksums,
                       max_inflight_bytes=max_inflight_bytes, io_threads=io_threads,
                       map_spans=mmap)


def _orbax_json_file(reader: _ext.Reader, name: str) -> Any:
    """The JSON document of Orbax's own file `name` in the checkpoint's folder, or None where
    there is none or it is not JSON (what it records is then not known: restore as without it)."""
    try:
        return json.loads(reader.read_file(name))
    except (OSError, ValueError, RecursionError):
        return None


def _orbax_key_impls(reader: _ext.Reader, infos: dict[str, dict]) -> dict[str, str]:
    """{array path: PRNG implementation} of the arrays an Orbax checkpoint holds as typed PRNG
    keys: Orbax stores their key data and records the implementation in the ext_metadata
    ("random_key_impl") of `array_metadatas/process_0` in the item folder, read through the
    checkpoint's store (any URL); {} where there is no such file (checkpoints of older Orbax, or
    without jax.Array leaves)."""
    doc = _orbax_json_file(reader, "array_metadatas/process_0")
    impls = {}
    for entry in doc.get("array_metadatas", []) if isinstance(doc, dict) else []:
        meta = entry.get("array_metadata") if isinstance(entry, dict) else None
        ext = meta.get("ext_metadata") if isinstance(meta, dict) else None
        impl = ext.get("random_key_impl") if isinstance(ext, dict) else None
        if isinstance(impl, str) and isinstance(meta.get("param_name"), str):
            impls[meta["param_name"]] = impl
    if not impls:
        return {}
    from ._save import _orbax_name
    return {p: impls[_orbax_name(p)] for p in infos if _orbax_name(p) in impls}


def _orbax_shardings(reader: _ext.Reader, infos: dict[str, dict]) -> dict[str, str]:
    """{array path: the JSON text of its sharding} from the `_sharding` file of an Orbax
    checkpoint's item folder ({base64url of the parameter name: JSON text}, what Orbax writes
    for jax.Array leaves), read through the checkpoint's store (any URL); {} where there is no
    such file or it is malformed."""
    doc = _orbax_json_file(reader, "_sharding")
    if not isinstance(doc, dict):
        return {}
    from ._save import _orbax_name
    out = {}
    for p in infos:
        name = base64.urlsafe_b64encode(_orbax_name(p).encode()).decode("ascii")
        text = doc.get(name)
        if isinstance(text, str):
            out[p] = text
    return out


def _with_orbax_shardings(node: dict, shardings: dict[str, str]) -> dict:
    """`node` (changed in place) with each array leaf at a path of `shardings` carrying its
    "sharding" text, as the native format's leaves carry theirs."""
    for p, leaf in _tree.index_leaves(node).items():
        if leaf.get("kind") == "array" and p in shardings:
            leaf["sharding"] = shardings[p]
    return node


def _tree_with_keys(reader: _ext.Reader, infos: dict[str, dict]) -> dict:
    """The step's tree with its PRNG key leaves marked (_tree.mark_keys): the native format's
    key nodes, and the arrays an Orbax checkpoint records as keys. The array leaves of an
    Orbax checkpoint carry the shardings of its `_sharding` file."""
    node = reader.tree()
    if reader.format.startswith("orbax"):
        shardings = _orbax_shardings(reader, infos)
        if shardings:
            node = _with_orbax_shardings(node, shardings)
    orbax = _orbax_key_impls(reader, infos) if reader.format.startswith("orbax") else {}
    if orbax or any(p == _tree.KEY_DATA or p.endswith("/" + _tree.KEY_DATA) for p in infos):
        node = _tree.mark_keys(node, orbax)
    return node


def _key_parts(ckpt: str, path: str, impl: str, info: dict) -> tuple[Any, tuple[int, ...]]:
    """(key dtype, key shape) of the PRNG key leaf at `path` whose data is `info` (the reader's
    entry of its key data); ValueError naming the leaf when JAX lacks the implementation or the
    data's trailing dimensions are not the implementation's."""
    from . import jax as tjax
    where = f"{path!r} in {ckpt}"
    dtype = tjax.key_dtype(impl, where)
    trailing = tjax.key_data_shape(impl)
    shape = tuple(info["shape"])
    if info["dtype"] != "uint32" or shape[len(shape) - len(trailing):] != trailing:
        raise ValueError(f"{where} holds PRNG keys of implementation {impl!r} whose key data "
                         f"({info['dtype']}, shape {shape}) does not end in that "
                         f"implementation's uint32 dimensions {trailing}")
    return dtype, shape[:len(shape) - len(trailing)]


def metadata(path: str | os.PathLike) -> Any:
    """The saved tree with each array replaced by its ArrayMetadata (and scalars by their
    values), as plain dicts, lists and tuples. Reads no array data (Orbax scalars excepted:
    they are 0-d arrays). Any format restore() reads. An array of typed PRNG keys is described
    by the key shape and the key dtype (key<fry>, ...), with its data's chunks and bytes, so
    that restore(path, target=metadata(path)) restores it as keys.

    Each array's ArrayMetadata carries the sharding it was saved with: `saved_sharding`, the
    description the step records (native steps saved by this version, and Orbax checkpoints'
    `_sharding`, on any store), and `sharding`, that sharding on this job's devices, or None
    when it has none or they cannot hold it (ArrayMetadata says when). As the target of
    restore(), an array with a `sharding` restores as a jax.Array on it (as Orbax's
    restore(path) does), one without as a NumPy array."""
    with contextlib.closing(_open(path, True, 1 << 20, 1)) as reader:
        infos = {a["path"]: a for a in reader.arrays()}
        node = _tree_with_keys(reader, infos)
    ckpt = os.fspath(path)

    # The recorded sharding of each array leaf, by array id.
    recorded = {leaf["array"]: leaf.get("sharding")
                for leaf in _tree.index_leaves(node).values()
                if leaf.get("kind") in ("array", "prng_key")}

    def describe(array_path: str, array_id: int) -> ArrayMetadata:
        a = infos[array_path]
        saved, sharding = _saved_sharding(recorded.get(array_id))
        return ArrayMetadata(path=array_path, shape=tuple(a["shape"]),
                             dtype=tnp.dtype_from_name(a["dtype"]),
                             chunk_shape=tuple(a["chunk_shape"]), num_chunks=a["num_chunks"],
                             stored_bytes=a["stored_bytes"], codec=a["codec"],
                             sharding=sharding, saved_sharding=saved)

    def describe_key(key_path: str, n: dict) -> ArrayMetadata:
        a = infos[n["data_path"]]
        dtype, shape = _key_parts(ckpt, key_path, n["impl"], a)
        saved, sharding = _saved_sharding(n.get("sharding"))
        if sharding is not None:  # the key data's, less the implementation's dimensions
            from . import jax as tjax
            sharding = tjax.key_sharding(sharding, len(shape))
        return ArrayMetadata(path=key_path, shape=shape, dtype=dtype,
                             chunk_shape=tuple(a["chunk_shape"])[:len(shape)],
                             num_chunks=a["num_chunks"], stored_bytes=a["stored_bytes"],
                             codec=a["codec"], sharding=sharding, saved_sharding=saved)

    return _tree.decode(node, describe, describe_key)


# The casts of scalars, by kind (_scalar_kind): the kinds of target each kind of value goes into.
_SCALAR_CASTS = {"b": "bif", "i": "bif", "f": "f", "c": "c"}


def _shown(value: Any) -> str:
    """A scalar for an error message: "the float 2.7" (repr fails for ints of more than
    sys.get_int_max_str_digits() digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 1000:
        return f"an int of {value.bit_length()} bits"
    return f"the {type(value).__name__} {value!r}"


def _scalar_kind(x: Any) -> str:
    """The kind of a scalar for _SCALAR_CASTS: "b" (bool), "i" (int), "f" (float), "c"
    (complex), after a NumPy scalar's dtype; "str" or "bytes" for text."""
    if isinstance(x, np.generic):
        return tnp.dtype_kind(x.dtype)
    for kind, types in (("b", bool), ("i", int), ("f", float), ("c", complex), ("str", str),
                        ("bytes", bytes)):
        if isinstance(x, types):
            return kind
    raise TypeError(f"not a scalar: {type(x).__name__}")  # pragma: no cover - callers check


def _cast_scalar(value: Any, target: Any, path: str, ckpt: str) -> Any:
    """`value` (the scalar leaf at `path` of checkpoint `ckpt`, or a 0-d stored array's
    .item()) as the type of the scalar `target`, by the casts restore makes for arrays
    (array/convert.h): ints and bools into ints, bools and floats, each value exactly
    (ValueError where it does not fit); floats into floats; complex into complex; other casts,
    floats into ints among them, are ValueError (TypeError between text and numbers). Errors
    name the leaf."""
    have, want = _scalar_kind(value), _scalar_kind(target)
    held = f"{path!r} in {ckpt} holds {_shown(value)}"
    if have in ("str", "bytes") or want in ("str", "bytes"):
        if have != want:
            raise TypeError(f"{path!r} in {ckpt} holds a {type(value).__name__}, the target a "
                            f"{type(target).__name__}")
        return value
    if want not in _SCALAR_CASTS[have]:
        raise ValueError(f"{held}, which the target's {type(target).__name__} cannot take: "
                         "restore converts ints and bools into ints, bools and floats, and "
                         "floats into floats only, as it does arrays")
    if type(value) is type(target):
        return value
    try:
        with np.errstate(over="ignore"):  # a float too large for a float16 becomes inf
            return type(target)(value)
    except OverflowError:
        raise ValueError(f"{held}, out of the range of the target's "
                         f"{type(target).__name__}") from None


class _Plan:
    """The boxes a restore reads, and what becomes of them: each array leaf asks for one or more
    boxes (one per device, or one for the whole array), and is built once all of them are in."""

    def __init__(self, ckpt: str, infos: dict[str, dict], truncate: bool = False,
                 into: bool = False):
        self.ckpt = ckpt
        self.infos = infos
        self.truncate = truncate
        # An in-place load: boxes the adapter gives the target's own memory for are read
        # straight into it (add_into).
        self.into = into
        self.requests: list[tuple] = []  # (path, origin, shape, dtype name), for the engine
        # (path, origin, shape, dtype name, destination): read straight into the targets.
        self.into_requests: list[tuple] = []
        # (start, end) addresses of the destinations of into_requests, sorted: a target whose
        # memory overlaps another's (tied weights) is restored and copied, last one winning.
        self._into_spans: list[tuple[int, int]] = []
        self.owners: list[tuple[_Leaf, Any]] = []  # per request: its leaf and box key
        self.values: dict[str, Any] = {}
        # Leaf path -> the path its value is kept under in `values` (PRNG keys: their data's).
        self.aliases: dict[str, str] = {}

    def check_shape(self, path: str, shape: tuple[int, ...]) -> None:
        stored = tuple(self.infos[path]["shape"])
        if len(shape) != len(stored):
            raise ValueError(f"array {path!r} in {self.ckpt} has shape {stored}; the target's "
                             f"shape {shape} has a different rank")
        if not self.truncate and any(t < s for t, s in zip(shape, stored)):
            raise ValueError(f"array {path!r} in {self.ckpt} has shape {stored}, larger than the "
                             f"target's {shape}; pass truncate=True to read only the target's part")

    def add(self, path: str, dtype: np.dtype, boxes: dict[Any, tuple], build,
            together: tuple | None = None) -> None:
        """Asks for `boxes` ({key: (origin, shape)}) of array `path` as `dtype` (native order);
        build({key: array}) makes the leaf once they are read. `together`: (adapter, target,
        shape) of an adapter with build_many, which builds the leaves of a batch at once."""
        leaf = _Leaf(path, dtype, boxes, build, together)
        name = tnp.dtype_name(dtype)
        for key, (origin, shape) in boxes.items():
            self.requests.append((path, origin, shape, name))
            self.owners.append((leaf, key))
        if not boxes:  # nothing of it on this process's devices
            self.values[path] = build({})

    def add_into(self, path: str, dtype: np.dtype, boxes: dict[Any, tuple],
                 dests: dict[Any, np.ndarray], value: Any) -> bool:
        """Asks for `boxes` of array `path` as `dtype` read straight into `dests` ({key:
        writable uint8 array of the box's bytes}: the target's memory); the leaf's value is then
        `value`. False (nothing planned) where a destination overlaps one planned before."""
        spans = []
        for key in boxes:
            dest = dests[key]
            start = dest.__array_interface__["data"][0]
            spans.append((start, start + dest.nbytes))
        for lo, hi in spans:
            at = bisect.bisect_left(self._into_spans, (lo, hi))
            if (at < len(self._into_spans) and self._into_spans[at][0] < hi) or (
                    at > 0 and self._into_spans[at - 1][1] > lo):
                return False
        for span in spans:
            bisect.insort(self._into_spans, span)
        name = tnp.dtype_name(dtype)
        for key, (origin, shape) in boxes.items():
            self.into_requests.append((path, origin, shape, name, dests[key]))
        self.values[path] = value
        return True

    def add_whole(self, paths: list[str]) -> None:
        """add() of each array in `paths` whole, in its stored dtype, as a NumPy array: the
        restore without a target, in one loop (for 4,000 arrays a third of add()'s time)."""
        requests, owners, infos = self.requests, self.owners, self.infos
        for path in paths:
            info = infos[path]
            shape = tuple(info["shape"])
            origin = (0,) * len(shape)
            leaf = _Leaf(path, tnp.dtype_from_name(info["dtype"]), {None: (origin, shape)},
                         _whole_array)
            requests.append((path, origin, shape, info["dtype"]))
            owners.append((leaf, None))

    def run(self, reader: _ext.Reader, progress: Any, desc: str, mmap: bool) -> int:
        """Reads every box and builds every leaf; returns the stored bytes read or mapped."""
        reporter = _progress.Reporter(progress, desc)

        def on_batch(items: list[tuple[int, np.ndarray]]) -> None:
            by_adapter: dict[int, list[_Leaf]] = {}  # leaves to build in one call
            for index, data in items:
                leaf, key = self.owners[index]
                self.owners[index] = None  # nothing but the leaf keeps the buffer
                if not leaf.receive(key, data):
                    continue
                if leaf.together is not None:
                    by_adapter.setdefault(id(leaf.together[0]), []).append(leaf)
                else:
                    self.values[leaf.path] = leaf.finish()
            for leaves in by_adapter.values():
                built = leaves[0].together[0].build_many([leaf.take() for leaf in leaves])
                for leaf, value in zip(leaves, built):
                    self.values[leaf.path] = value

        # A shared reader agrees with the other processes here (nothing for other readers).
        into = self.into_requests
        reader.share(self.requests + [r[:4] for r in into] if into else self.requests)
        callback = reporter.callback()
        # Progress: the boxes read in place first, then the others (each distinct box once, as
        # the engine counts them).
        into_bytes = sum(r[4].nbytes for r in into)
        rest_bytes = sum(math.prod(shape) * tnp.dtype_from_name(name).itemsize
                         for _, origin, shape, name in {(p, tuple(o), tuple(s), n)
                                                        for p, o, s, n in self.requests})
        nbytes = 0
        try:
            if into:
                def into_progress(done: int, total: int) -> None:
                    callback(into_bytes * done // total if total else into_bytes,
                             into_bytes + rest_bytes)

                stats = reader.read_many(into, progress=into_progress if callback else None)
                nbytes += stats["bytes_read"]
            if self.requests or not into:
                def rest_progress(done: int, total: int) -> None:
                    callback(into_bytes + done, into_bytes + total)

                stats = reader.restore_to_host(
                    self.requests, on_batch, map=mmap, batch_bytes=_options.HOST_BATCH_BYTES,
                    progress=(rest_progress if into else callback) if callback else None)
                nbytes += stats["bytes_read"] + stats["mapped_bytes"]
        finally:
            reporter.close()
        return nbytes


def _whole_array(buffers: dict) -> np.ndarray:
    return buffers[None]


class _Leaf:
    """One array leaf of a restore: its boxes as they arrive, then the leaf built from them."""

    __slots__ = ("path", "dtype", "boxes", "build", "together", "buffers")

    def __init__(self, path: str, dtype: np.dtype, boxes: dict[Any, tuple], build,
                 together: tuple | None = None):
        self.path, self.dtype, self.boxes, self.build = path, dtype, boxes, build
        self.together = together
        self.buffers: dict[Any, np.ndarray] = {}

    def receive(self, key: Any, data: np.ndarray) -> bool:
        """Takes the bytes of box `key`; whether every box is in."""
        self.buffers[key] = data.view(self.dtype).reshape(self.boxes[key][1])
        return len(self.buffers) == len(self.boxes)

    def finish(self) -> Any:
        buffers, self.buffers = self.buffers, {}  # the host buffers go once the leaf is built
        return self.build(buffers)

    def take(self) -> tuple:
        """(target, shape, buffers) for the adapter's build_many; the leaf lets go of them."""
        buffers, self.buffers = self.buffers, {}
        _, target, shape = self.together
        return target, shape, buffers


def _scalar_into_array(value: Any, target: Any, path: str, ckpt: str) -> Any:
    """The scalar leaf `value` at `path` of checkpoint `ckpt` as the array target `target`
    asks for: a 0-d array of the target's kind (NumPy, or a jax.Array on its sharding) and
    dtype, the value cast as a NumPy scalar target of that dtype casts it (_cast_scalar, with
    its errors). A scalar fills no shape but (), as an array fills no target of another rank:
    ValueError naming the leaf for any other. (It returned the scalar itself, whatever the
    target: issue 36 item 10.)"""
    shape = tuple(target.shape)
    if shape != ():
        raise ValueError(f"{path!r} in {ckpt} holds {_shown(value)}, a scalar; the target's "
                         f"shape {shape} is not 0-d (a scalar restores into a 0-d array or a "
                         "scalar target)")
    adapter = _adapters.adapter_for(target)
    dtype = _adapters.restore_dtype(adapter, target)
    tnp.dtype_name(dtype)  # TypeError for a dtype the engine does not have
    data = np.array(_cast_scalar(value, dtype.type(0), path, ckpt), dtype)
    return adapter.build(target, (), {key: data for key in adapter.restore_boxes(target, ())})


def _plan_target(plan: _Plan, leaves: dict[str, dict], path: str, target: Any) -> None:
    """Plans the restore of target leaf `target` at `path` (errors name the leaf)."""
    target = _leaf_target(target)
    stored = leaves.get(path)
    key_target = _tree.is_key_target(target)
    array_target = key_target or (hasattr(target, "shape") and hasattr(target, "dtype"))
    if stored is None or stored["kind"] == "none":
        # What the checkpoint holds as None (an Equinox model saved filtered: its activation
        # functions and int fields) or does not hold at all and that the target holds as an
        # object no checkpoint could store (a function) is the target's: passed through. A
        # value a checkpoint could hold (an array, a scalar, a string) where it holds nothing
        # is a KeyError, so that a misspelt path is never answered by the target's own value.
        storable = array_target or isinstance(target, (bool, int, float, complex, str, bytes,
                                                       np.generic))
        if stored is not None and not array_target or not storable:
            plan.values[path] = target
            return
        raise KeyError(f"{path!r} is not in checkpoint {plan.ckpt}")
    if key_target or stored["kind"] == "prng_key":
        _plan_key(plan, stored, path, target, key_target)
        return
    scalar_target = isinstance(target, (bool, int, float, str, bytes, np.generic))
    if not scalar_target and not (hasattr(target, "shape") and hasattr(target, "dtype")):
        raise TypeError(f"the target's leaf {path!r} is of type {type(target).__name__}; "
                        "target leaves are arrays (np.ndarray, jax.Array, "
                        "jax.ShapeDtypeStruct), NumPy scalars, bool, int, float, str or bytes")
    if stored["kind"] != "array":
        value = _tree.scalar_value(stored)
        plan.values[path] = (_cast_scalar(value, target, path, plan.ckpt) if scalar_target
                             else _scalar_into_array(value, target, path, plan.ckpt))
        return
    if isinstance(target, (str, bytes)):
        raise TypeError(f"{path!r} in {plan.ckpt} holds an array, the target a {type(target).__name__}")
    if isinstance(target, (bool, int, float)):
        plan.check_shape(path, ())
        dtype = tnp.dtype_from_name(plan.infos[path]["dtype"])
        ckpt = plan.ckpt
        plan.add(path, dtype, {None: ((), ())},
                 lambda buffers: _cast_scalar(buffers[None].item(), target, path, ckpt))
        return
    shape = tuple(target.shape)
    adapter = _adapters.adapter_for(target)
    dtype = _adapters.restore_dtype(adapter, target)
    plan.check_shape(path, shape)
    tnp.dtype_name(dtype)  # TypeError for a dtype the engine does not have
    boxes = adapter.restore_boxes(target, shape)
    if plan.into and boxes:
        dests = _adapters.restore_into(adapter, target, shape, boxes)
        if dests is not None and plan.add_into(path, dtype, boxes, dests, target):
            return
    together = (adapter, target, shape) if hasattr(adapter, "build_many") else None
    plan.add(path, dtype, boxes, lambda buffers: adapter.build(target, shape, buffers), together)


def _stored_kind(plan: _Plan, stored: dict, path: str) -> str:
    """What the leaf at `path` holds, for an error message."""
    if stored["kind"] == "array":
        info = plan.infos[path]
        return f"a {info['dtype']} array of shape {tuple(info['shape'])}"
    if stored["kind"] == "prng_key":
        return f"PRNG keys of implementation {stored['impl']!r}"
    return f"a {stored['kind']}"


def _plan_key(plan: _Plan, stored: dict, path: str, target: Any, key_target: bool) -> None:
    """Plans the restore of a PRNG key leaf: its key data read onto the target's sharding with
    the trailing dimensions unsharded, then wrapped as keys of the stored implementation.
    ValueError naming the leaf when only one of the stored leaf and the target is keys, or
    their implementations differ."""
    ckpt = plan.ckpt
    target_dtype = getattr(target, "dtype", type(target).__name__)
    if stored["kind"] != "prng_key":
        raise ValueError(f"{path!r} in {ckpt} holds {_stored_kind(plan, stored, path)}, not "
                         f"PRNG keys; the target's leaf is a key array ({target_dtype})")
    impl = stored["impl"]
    if not key_target:
        raise ValueError(f"{path!r} in {ckpt} holds PRNG keys of implementation {impl!r}; the "
                         f"target's leaf is not a key array ({target_dtype}): give a key "
                         f"target, e.g. jax.random.key(0, impl={impl!r}) of the same shape, "
                         "or a jax.ShapeDtypeStruct of its dtype")
    from . import jax as tjax
    data_path = stored["data_path"]
    _, stored_shape = _key_parts(ckpt, path, impl, plan.infos[data_path])
    target_shape = tuple(target.shape)
    if len(target_shape) != len(stored_shape) or (
            not plan.truncate and any(t < s for t, s in zip(target_shape, stored_shape))):
        raise ValueError(f"the PRNG key array {path!r} in {ckpt} has shape {stored_shape}; the "
                         f"target's shape {target_shape} "
                         + ("has a different rank" if len(target_shape) != len(stored_shape)
                            else "is smaller; pass truncate=True to read only its part"))
    want = tjax.key_impl(target)
    if want != impl:
        raise ValueError(f"{path!r} in {ckpt} holds PRNG keys of implementation {impl!r}; the "
                         f"target's keys are {want!r} ({target_dtype})")
    try:
        data_target = tjax.key_data_target(target, impl)
    except TypeError as e:
        raise TypeError(f"the target's leaf {path!r}: {e}") from None
    shape = tuple(data_target.shape)
    plan.check_shape(data_path, shape)
    adapter = _adapters.adapter_for(data_target)
    dtype = _adapters.restore_dtype(adapter, data_target)
    plan.aliases[path] = data_path
    plan.add(data_path, dtype, adapter.restore_boxes(data_target, shape),
             lambda buffers: tjax.wrap_key(adapter.build(data_target, shape, buffers), impl))


def _wrapped_key(plan: _Plan, path: str, n: dict) -> Any:
    """The PRNG keys of key leaf `n` at `path` from its data restored whole (NumPy), on the
    default device."""
    from . import jax as tjax
    _key_parts(plan.ckpt, path, n["impl"], plan.infos[n["data_path"]])
    return tjax.wrap_key(plan.values[n["data_path"]], n["impl"])


def restore(path: str | os.PathLike, target: Any = None, *, truncate: bool = False,
            verify_checksums: bool = True, max_inflight_bytes: int = _options.MAX_INFLIGHT_BYTES,
            io_threads: int = 0, progress: Any = None, mmap: bool = True,
            subtree: str | None = None, share_reads: bool | None = None,
            coordinator: Any = None, stats: dict | None = None) -> Any:
    """Restores the checkpoint step folder `path`: a tensorstash step, or an Orbax checkpoint
    (OCDBT or per-parameter zarr folders, zarr3 or zarr2; an Orbax CheckpointManager step opens
    its item) or a zarr-group checkpoint, detected from the folder's files
    (docs/foreign_formats.md, "Orbax checkpoints"). Orbax sequences come back as lists and its
    custom nodes as dicts without a target; a target gives them their types.

    Without `target`: the saved tree as plain dicts, lists and tuples, arrays as NumPy arrays of
    the saved shapes and dtypes (unchanged by the shardings a step records: without a target
    nothing is placed on devices). With `target` (a pytree of jax.ShapeDtypeStruct with
    .sharding, jax.Array, np.ndarray, metadata()'s ArrayMetadata, or scalars): the target's
    structure, each array with the target's
    shape, dtype (a cast when it differs; in the target's byte order) and sharding, each device
    reading just its own block; target=metadata(path) restores as saved: each array whose
    `.sharding` is known on its saved sharding, the others as NumPy arrays. A JAX target's dtype is what jax.device_put makes of it: with
    JAX's 64-bit types off (jax_enable_x64), float64, int64, uint64 and complex128 restore as
    float32, int32, uint32 and complex64 (a value the narrower type cannot hold is a ValueError
    naming the leaf, where jax.device_put would wrap it). Only the target's arrays are read. A
    target shape larger than the stored one is zero-filled; a smaller one is a ValueError unless
    `truncate`. Scalar targets (bool, int, float, NumPy scalars) take the casts arrays take: ints
    and bools into ints, bools and floats, each value exactly; floats into floats; complex into
    complex; any other (a float into an int, say) is a ValueError naming the leaf. A saved
    scalar (bool, int, float) restored into a 0-d array target is a 0-d array of the target's
    kind and dtype, by the same casts; an array target of any other shape is a ValueError
    naming the leaf. Typed PRNG key arrays (native steps, and Orbax checkpoints that record the
    implementation) restore as keys of their implementation: on the default device without a
    target, on the target's sharding for a key target (a key jax.Array or ShapeDtypeStruct, or
    metadata()'s ArrayMetadata); a key target for a leaf that is not keys, a target that is not
    keys for one that is, or another implementation, is a ValueError naming the leaf.

    Dict keys come back as they were saved: str, and int, bool, float, bytes, None and tuples
    of those (a step of an older tensorstash has its int keys as decimal strings). A target
    leaf that is not an array (a function, an int, any object: what an Equinox model made with
    eqx.filter_eval_shape holds besides its arrays) where the checkpoint holds None or nothing
    is passed through as it is; None in the target stays None.

    `subtree`: restore only the node at this path (keys and positions joined by '/', a '/' in a
    key written "~1" and a '~' "~0", as in array paths) as the root; `target` is then that
    subtree's. KeyError naming the path when the checkpoint has no such node.

    `progress`: None shows a tqdm bar on stderr when tqdm is installed, stderr is a terminal and
    the restore fills more than 1 GiB; True always shows one (a plain line without tqdm); False
    never; a callable is called as progress(done_bytes, total_bytes), in bytes of the restored
    arrays, from the engine's reading threads, at most about ten times a second and finally
    with done_bytes == total_bytes.

    `mmap`: host buffers whose stored chunks allow it (tensorstash format, uncompressed, the
    stored dtype, whole chunks; a buffer that is one run of bytes of a data file, as a whole
    array saved in row shards or one device's shard is, whatever its size, sharing one mapping
    with its neighbours; other buffers when their chunks are of at least 16 KiB and
    page-aligned) are mapped copy-on-write
    from the data files instead of read into fresh memory, their checksums checked all the same:
    much faster, and pages of the page cache rather than new memory. The arrays stay valid
    whatever happens to the checkpoint afterwards, except if its files were truncated in place
    (tensorstash never does; their pages would then fault). Chunks cut into pieces for another
    layout are likewise copied out of a mapping of the data file rather than out of a staging
    copy, when uncompressed. False reads everything. A restore uses at most a quarter of the
    kernel mapping entries the process has left (vm.max_map_count) and reads the rest; a mapping
    shared by many small arrays stays mapped while any of them is alive. Boxes
    read (not mapped) under 4 MiB share blocks of up to 32 MiB with their neighbours, one
    allocation for thousands of small arrays; a block goes back to the system once none of the
    arrays in it is alive.

    `share_reads`: when several processes of a job restore a native step, each stored chunk
    that several of them need is read from storage by one of them and sent to the others over
    the job's peer transport (authenticated HTTP, each chunk's CRC-32C checked where it lands;
    docs/shared_reads.md). True: on; False: off; None (default): on for object-store URLs
    (s3://, gs://) when the job has more than one process. Every process of the job must then
    restore the same steps in the same order. A chunk that does not arrive (a process that died
    or stalled, within the coordination timeout) or arrives damaged is read from storage by the
    process itself, with a warning naming the process. `coordinator`: the job's (default: the
    framework's, as for save). Other formats than tensorstash's read as without sharing.

    `stats`: a dict that is filled with what the restore took on this process: bytes (stored
    bytes read or received), seconds, storage_bytes, storage_seconds, peer_bytes, peer_seconds,
    shared (whether reads were shared), fallbacks (one line per chunk read from storage after
    its peer failed).

    The step's files are closed before restore returns or raises (restored arrays that are
    mapped from them remain valid).

    Raises FileNotFoundError for a missing step, ValueError for an incomplete step, a shape
    mismatch or a cast it does not make, KeyError naming the path of a target leaf the
    checkpoint lacks, TypeError naming a target leaf that is neither an array nor a scalar,
    OSError when stored bytes are corrupt (CRC-32C mismatch, truncated files); an exception
    raised by a `progress` callable once the reads are over.
    """
    return _restore(path, target, truncate=truncate, verify_checksums=verify_checksums,
                    max_inflight_bytes=max_inflight_bytes, io_threads=io_threads,
                    progress=progress, mmap=mmap, subtree=subtree, share_reads=share_reads,
                    coordinator=coordinator, stats=stats)[0]


def restore_in_place(path: str | os.PathLike, target: Any, *, truncate: bool = False,
                     verify_checksums: bool = True,
                     max_inflight_bytes: int = _options.MAX_INFLIGHT_BYTES, io_threads: int = 0,
                     progress: Any = None, mmap: bool = True, subtree: str | None = None,
                     share_reads: bool | None = None, coordinator: Any = None,
                     stats: dict | None = None) -> Any:
    """restore(path, target, ...) for an in-place load (tensorstash.torch.load): each target
    leaf whose adapter gives its memory (restore_into) is read straight into it and is its own
    leaf in the tree returned; the others as restore() makes them. Every error of planning
    (KeyError, ValueError, TypeError) is raised before anything is read, so the targets are
    then unchanged; a read error (OSError: a damaged chunk) may leave some of them partly
    overwritten."""
    return _restore(path, target, truncate=truncate, verify_checksums=verify_checksums,
                    max_inflight_bytes=max_inflight_bytes, io_threads=io_threads,
                    progress=progress, mmap=mmap, subtree=subtree, share_reads=share_reads,
                    coordinator=coordinator, stats=stats, into=True)[0]


def _subtree(node: dict, subtree: str, ckpt: str) -> tuple[dict, str]:
    """(the node at path `subtree` of the step's tree `node`, its path as array paths spell
    it). `subtree` joins keys and positions with '/' (a key holding '/' escaped as "~1", '~' as
    "~0", as in array paths); "" is the root. KeyError naming the path when the tree has no
    node there."""
    if not isinstance(subtree, str):
        raise TypeError(f"subtree must be a str of '/'-joined keys, not {type(subtree).__name__}")
    if subtree == "":
        return node, ""
    here: str | None = None
    for segment in subtree.split("/"):
        children = _tree.node_children(node)
        found = None if children is None else next(
            (child for name, child in children if name == segment), None)
        here = segment if here is None else f"{here}/{segment}"
        if found is None:
            raise KeyError(f"subtree {subtree!r} is not in checkpoint {ckpt}: it has no "
                           f"{here!r}")
        node = found
    return node, subtree


def _restore(path: str | os.PathLike, target: Any, *, truncate: bool, verify_checksums: bool,
             max_inflight_bytes: int, io_threads: int, progress: Any,
             mmap: bool = True, reader: Any = None, subtree: str | None = None,
             share_reads: bool | None = None, coordinator: Any = None,
             stats: dict | None = None, into: bool = False) -> tuple[Any, int]:
    """restore(), returning (the restored tree, the stored bytes read or mapped). `reader`: an
    open reader of the step to use instead of opening `path` (the caller closes it; it decides
    the sharing, and share_reads is then not looked at). `into`: an in-place load: the target
    leaves whose adapter gives their memory (restore_into) are read into it, and are their own
    value in the tree returned."""
    ckpt = os.fspath(path)
    desc = f"restoring {_paths.split(ckpt)[1]}"
    _progress.check(progress)
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"stats must be a dict to fill or None, not {type(stats).__name__}")
    started = time.perf_counter()
    # Closed on return, error or not: an open file would keep a deleted step's space.
    owned = reader is None
    if owned:
        share = _share_setup(path, share_reads, coordinator)
        reader = (_open(path, verify_checksums, max_inflight_bytes, io_threads, mmap)
                  if share is None else
                  _open_shared(path, share, verify_checksums, max_inflight_bytes, io_threads))
    with contextlib.closing(reader) if owned else contextlib.nullcontext(reader), _gc.paused():
        tree, nbytes = _restore_with(reader, ckpt, desc, target, truncate, progress, mmap,
                                     subtree, into)
        _share_report(reader, nbytes, time.perf_counter() - started, stats)
    return tree, nbytes


def _share_report(reader: _ext.Reader, nbytes: int, seconds: float, stats: dict | None) -> None:
    """Ends a shared reader's serving, warns of chunks that came from storage after their peer
    failed, and fills `stats` (restore's)."""
    shared = reader.finish_share() if not reader.closed else None
    if shared is not None:
        if shared["fallbacks"]:
            _log.warning("tensorstash: %d chunk(s) read from storage after their peer failed: %s",
                         len(shared["fallbacks"]), "; ".join(shared["fallbacks"][:5]))
        if shared["finish_error"]:
            _log.warning("tensorstash: %s", shared["finish_error"])
    if stats is None:
        return
    stats.clear()
    stats.update(bytes=nbytes, seconds=seconds, shared=bool(shared and shared["active"]),
                 storage_bytes=nbytes, storage_seconds=seconds, peer_bytes=0, peer_seconds=0.0,
                 fallbacks=[])
    if shared is not None and shared["active"]:
        stats.update(bytes=shared["storage_bytes"] + shared["peer_bytes"],
                     storage_bytes=shared["storage_bytes"],
                     storage_seconds=shared["storage_seconds"], peer_bytes=shared["peer_bytes"],
                     peer_seconds=shared["peer_seconds"], fallbacks=list(shared["fallbacks"]))


def _restore_with(reader: _ext.Reader, ckpt: str, desc: str, target: Any, truncate: bool,
                  progress: Any, mmap: bool, subtree: str | None,
                  into: bool = False) -> tuple[Any, int]:
    """_restore's work with the reader open: (the restored tree, the stored bytes read or
    mapped)."""
    infos = {a["path"]: a for a in reader.arrays()}
    node = _tree_with_keys(reader, infos)
    prefix = None
    if subtree is not None:
        node, prefix = _subtree(node, subtree, ckpt)

    def full(p: str) -> str:
        """The array path in the step of path `p` below the restored root."""
        if not prefix:
            return p
        return prefix if p == "" else f"{prefix}/{p}"

    plan = _Plan(ckpt, infos, truncate, into and target is not None)
    if target is None:
        # The saved tree, each array whole, in its stored dtype.
        paths: list[str] = []
        # (A PRNG key node's data_path is already the step's path of its data.)
        _tree.decode(node, lambda array_path, _id: paths.append(full(array_path)),
                     lambda _p, n: paths.append(n["data_path"]))
        plan.add_whole(paths)
        nbytes = plan.run(reader, progress, desc, mmap)
        return _tree.decode(node, lambda p, _id: plan.values[full(p)],
                            lambda p, n: _wrapped_key(plan, p, n)), nbytes
    leaves = {full(p): n for p, n in _tree.index_leaves(node).items()}
    _tree.map_target(target, lambda p, t: _plan_target(plan, leaves, full(p), t))
    nbytes = plan.run(reader, progress, desc, mmap)
    aliases = plan.aliases
    return _tree.map_target(
        target, lambda p, _: plan.values[aliases.get(full(p), full(p))]), nbytes

