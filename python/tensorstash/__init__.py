"""tensorstash: save and restore sharded pytrees of JAX and NumPy arrays.

    import tensorstash
    tensorstash.save("/ckpt/0000001000", state)              # any pytree of arrays and scalars
    state = tensorstash.restore("/ckpt/0000001000")           # as NumPy, as saved
    state = tensorstash.restore("/ckpt/0000001000", target=abstract_state)  # onto any sharding
    meta = tensorstash.metadata("/ckpt/0000001000")           # reads no array data

    mgr = tensorstash.CheckpointManager("/ckpt", max_to_keep=3)  # a series of steps (manager.py)
    mgr.save(step, state)                                     # returns once copied to host

The engine is C++ (the private module `_ext`); IO runs with the GIL released. Errors are the
usual exceptions: FileNotFoundError (no such step), FileExistsError (step already complete),
KeyError (a target leaf the checkpoint lacks), ValueError (bad shapes, an incomplete step),
TypeError (unsupported leaves), OSError (corrupt or unreadable data).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import math
import os
import sys
from typing import Any

import numpy as np

from . import _ext, _tree
from . import numpy as tnp

__version__ = "0.1.0"
__all__ = ["save", "restore", "metadata", "ArrayMetadata", "CheckpointManager", "SaveStats",
           "RestoreStats", "__version__"]

try:
    import jax as _jax
except ImportError:  # JAX is optional: NumPy-only use works without it
    _jax = None

# Host memory for restored buffers is handed to devices in batches of about this many bytes.
_DEVICE_BATCH_BYTES = 512 << 20
# restore(progress=None) shows a progress bar for restores of at least this many bytes.
_PROGRESS_MIN_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class ArrayMetadata:
    """What a checkpoint stores about one array (from its metadata only)."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...]
    num_chunks: int
    stored_bytes: int
    codec: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _abspath(path: str | os.PathLike) -> str:
    """The absolute form of a folder path, or a store URL ("memory://run") as it is. ValueError
    for a path that is not valid Unicode (undecodable bytes of a file name, which Python keeps
    as lone surrogates): the engine takes UTF-8 paths."""
    text = os.fspath(path)
    _tree.check_text(text, f"the path {text!r}", "tensorstash takes UTF-8 paths only")
    return text if _ext.has_url_scheme(text) else os.path.abspath(text)


def _split(path: str | os.PathLike) -> tuple[str, str]:
    """A step folder's path or URL -> (its root's path or URL, the step's name), as the engine
    splits it (kvstore/registry.h): the root is opened by URL, the step is a key in it."""
    text = os.fspath(path)
    _tree.check_text(text, f"the path {text!r}", "tensorstash takes UTF-8 paths only")
    return _ext.split_step_url(text)


def _is_jax_array(x: Any) -> bool:
    return _jax is not None and isinstance(x, _jax.Array)


def _default_coordinator():
    if _jax is None:
        return None
    from . import jax as tjax
    return tjax.default_coordinator()


def _check_codec(codec: str | None) -> None:
    if codec not in (None, "none", "zstd"):
        raise ValueError(f"unknown codec {codec!r}; use None or 'zstd'")


def _arrays_to_save(tree: Any, coordinator: Any) -> tuple[list[tuple], str]:
    """The arrays of `tree` as the engine saves them, and the tree around them.

    Returns ([(array path, dtype name, shape, shards, stable)], tree JSON), with shards as
    _ext.Writer.add_array takes them: this process's shards of each jax.Array (views of the
    device buffers on CPU, one copy from other devices), and for NumPy arrays the whole array
    as a shard of which this process is one replica, in native byte order (big-endian arrays
    are converted: the format stores little-endian). The shards refer to the caller's memory
    (or to copies) and must stay unchanged until the engine has read them.

    `stable` is true where nothing else can change the shards' memory, so that an async save
    may write them in the background without copying them first: for a jax.Array whose
    buffers are not in host memory, as its shards are then host copies made for this save
    (tjax.in_host_memory). A jax.Array in host memory is not stable although JAX arrays are
    immutable: its memory may be a NumPy array's, which the caller may change once save()
    returns (XLA's CPU client adopts the buffer of an aligned NumPy array given to
    jax.device_put instead of copying it). Raises TypeError for unsupported leaves and
    abstract arrays (jax.ShapeDtypeStruct), ValueError for text that is not valid Unicode and
    trees nested too deeply.
    """
    process_index = coordinator.process_index() if coordinator is not None else 0
    process_count = coordinator.process_count() if coordinator is not None else 1
    leaves: list[tuple[str, Any]] = []
    node = _tree.encode(tree, lambda p, x: leaves.append((p, x)))
    arrays = []
    for array_path, x in leaves:
        if _jax is not None and isinstance(x, _jax.ShapeDtypeStruct):
            raise TypeError(f"cannot save the abstract array at {array_path!r} (a ShapeDtypeStruct)")
        try:
            dtype = tnp.dtype_name(x.dtype)
        except TypeError as e:
            raise TypeError(f"cannot save the array at {array_path!r}: {e}") from None
        if _is_jax_array(x):
            from . import jax as tjax
            shape, shards, stable = tuple(x.shape), tjax.shards_of(x), not tjax.in_host_memory(x)
        else:
            a = tnp.native_contiguous(np.asarray(x))
            shape = a.shape
            # Every process holds the whole array: they share the writing as replicas.
            shards = [((0,) * a.ndim, shape, tnp.byte_view(a), process_index, process_count)]
            stable = False
        arrays.append((array_path, dtype, shape, shards, stable))
    return arrays, _tree.dumps(node)


def save(path: str | os.PathLike, tree: Any, *, overwrite: bool = False, codec: str | None = None,
         zstd_level: int = 3, chunk_bytes: int = 8 << 20, data_file_bytes: int = 1 << 30,
         max_inflight_bytes: int = 256 << 20, io_threads: int = 0, sync: bool = True,
         coordinator: Any = None, format: str = "native", orbax_item: str | None = None) -> dict:
    """Saves `tree` as the checkpoint step folder `path` (e.g. ".../ckpts/0000001000").

    `format="orbax"` writes an Orbax checkpoint instead (OCDBT + zarr3, what orbax-checkpoint
    0.12 writes by default), which `orbax.checkpoint.StandardCheckpointer().restore(path, ...)`
    restores; with `orbax_item="default"` the folder is laid out as a step of an Orbax
    CheckpointManager with that item. Orbax format: a single process only; chunks are zstd
    (`zstd_level`), one per shard of each jax.Array and one per NumPy array; `chunk_bytes`,
    `data_file_bytes` and `max_inflight_bytes` do not apply; Python scalars are stored as Orbax
    stores them (0-d int64/float64/bool); str and bytes leaves raise NotImplementedError; dict
    keys must not contain '/' nor collide once joined with '.' (Orbax's parameter names).
    Returns raw_bytes, chunks and seconds.

    Leaves may be jax.Array (any sharding; each process writes its own shards, replicated data
    once), np.ndarray (big-endian ones are stored by value, in the format's little-endian
    order) and NumPy scalars, bool, int (any number of digits), float, str and bytes. The tree
    may be nested up to 512 levels below its root (docs/format.md, section 10). In a job with
    several processes every process calls save with the same tree; NumPy arrays are taken to be
    the same in every process and are written once, the work split across processes.

    Returns the engine's statistics for this process (raw_bytes, stored_bytes, chunks,
    data_files, seconds). Raises FileExistsError when the step is already complete and not
    `overwrite`, TypeError for unsupported leaves, ValueError for a tree nested more deeply
    and for text (keys, strings, the path) that is not valid Unicode, OSError for storage
    errors. On error nothing new is visible at `path`.
    """
    root, step = _split(path)
    if format == "orbax":
        return _save_orbax(root, step, tree, overwrite=overwrite, codec=codec,
                           zstd_level=zstd_level, io_threads=io_threads, sync=sync,
                           coordinator=coordinator, item=orbax_item)
    if format != "native":
        raise ValueError(f"unknown format {format!r}; use 'native' or 'orbax'")
    if orbax_item is not None:
        raise ValueError("orbax_item applies to format='orbax' only")
    _check_codec(codec)
    if coordinator is None:
        coordinator = _default_coordinator()
    arrays, tree_json = _arrays_to_save(tree, coordinator)
    writer = _ext.Writer(root, step, target_chunk_bytes=chunk_bytes,
                         target_data_file_bytes=data_file_bytes,
                         max_inflight_bytes=max_inflight_bytes, io_threads=io_threads, sync=sync,
                         overwrite=overwrite, coordinator=coordinator)
    for array_path, dtype, shape, shards, _stable in arrays:
        writer.add_array(array_path, dtype, shape, shards, codec=codec or "none",
                         zstd_level=zstd_level)
    writer.set_tree(tree_json)
    return writer.commit()


def _orbax_name(array_path: str) -> str:
    """Orbax's parameter name of the leaf at `array_path`: its keys joined by '.'."""
    return ".".join(k.replace("~1", "/").replace("~0", "~") for k in array_path.split("/"))


def _orbax_sharding(sharding: Any) -> str | None:
    """The JSON Orbax keeps in `_sharding` for a NamedSharding or SingleDeviceSharding (None
    for other shardings, whose arrays are then recorded as NumPy arrays)."""
    if isinstance(sharding, _jax.sharding.NamedSharding):
        mesh = sharding.mesh
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        doc = {"sharding_type": "NamedSharding", "shape": [int(n) for n in mesh.devices.shape],
               "axis_names": list(mesh.axis_names),
               "axis_types": [str(t) for t in mesh.axis_types], "partition_spec": spec,
               "device_mesh": {"mesh": np.vectorize(lambda d: {"id": d.id}, otypes=[object])(
                   mesh.devices).tolist()}}
        return json.dumps(doc)
    if isinstance(sharding, _jax.sharding.SingleDeviceSharding):
        device = next(iter(sharding.device_set))
        return json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": str(device)})
    return None


def _save_orbax(root: str, step: str, tree: Any, *, overwrite: bool, codec: str | None,
                zstd_level: int, io_threads: int, sync: bool, coordinator: Any,
                item: str | None) -> dict:
    """save(format="orbax"): the tree through _ext.OrbaxWriter."""
    if codec not in (None, "zstd"):
        raise ValueError(f"the Orbax format stores zstd chunks; codec {codec!r} is not available")
    if coordinator is None:
        coordinator = _default_coordinator()
    if coordinator is not None and coordinator.process_count() > 1:
        raise NotImplementedError("format='orbax' writes from a single process only")
    arrays, tree_json = _arrays_to_save(tree, None)
    writer = _ext.OrbaxWriter(root, step, item=item or "", overwrite=overwrite, sync=sync,
                              io_threads=io_threads, zstd_level=zstd_level)
    shardings = {}
    leaves: dict[str, Any] = {}
    _tree.encode(tree, leaves.__setitem__)
    for array_path, dtype, shape, shards, _stable in arrays:
        value_type = "np.ndarray"
        x = leaves[array_path]
        if _is_jax_array(x):
            serialized = _orbax_sharding(x.sharding)
            if serialized is not None:
                value_type = "jax.Array"
                name = base64.urlsafe_b64encode(_orbax_name(array_path).encode()).decode("ascii")
                shardings[name] = serialized
        writer.add_array(array_path, dtype, shape, shards, value_type=value_type)
    if shardings:
        writer.add_file("_sharding", json.dumps(shardings))
    writer.set_tree(tree_json)
    return writer.commit()


def _open(path, verify_checksums: bool, max_inflight_bytes: int, io_threads: int,
          mmap: bool = True) -> _ext.Reader:
    """The reader of step folder `path`. Close it (contextlib.closing) once done: its open
    files would keep the space of a deleted step until the garbage collector ran."""
    root, step = _split(path)
    return _ext.Reader(root, step, verify_checksums=verify_checksums,
                       max_inflight_bytes=max_inflight_bytes, io_threads=io_threads,
                       map_spans=mmap)


def metadata(path: str | os.PathLike) -> Any:
    """The saved tree with each array replaced by its ArrayMetadata (and scalars by their
    values), as plain dicts, lists and tuples. Reads no array data (Orbax scalars excepted:
    they are 0-d arrays). Any format restore() reads."""
    with contextlib.closing(_open(path, True, 1 << 20, 1)) as reader:
        infos = {a["path"]: a for a in reader.arrays()}
        node = _tree.loads(reader.tree_json())

    def describe(array_path: str, _id: int) -> ArrayMetadata:
        a = infos[array_path]
        return ArrayMetadata(path=array_path, shape=tuple(a["shape"]),
                             dtype=tnp.dtype_from_name(a["dtype"]),
                             chunk_shape=tuple(a["chunk_shape"]), num_chunks=a["num_chunks"],
                             stored_bytes=a["stored_bytes"], codec=a["codec"])

    return _tree.decode(node, describe)


class _TextProgress:
    """A one-line progress display on stderr, for progress=True when tqdm is not installed."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.shown = total, desc, -1

    def update_to(self, done: int) -> None:
        percent = 100 * done // self.total if self.total else 100
        if percent != self.shown:
            self.shown = percent
            sys.stderr.write(f"\r{self.desc}: {percent:3d}% of {_format_bytes(self.total)}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.shown >= 0:
            sys.stderr.write("\n")
            sys.stderr.flush()


class _TqdmProgress:
    def __init__(self, tqdm, total: int, desc: str):
        self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                        file=sys.stderr)

    def update_to(self, done: int) -> None:
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class _CallbackProgress:
    def __init__(self, callback, total: int):
        self.callback, self.total = callback, total

    def update_to(self, done: int) -> None:
        self.callback(done, self.total)

    def close(self) -> None:
        pass


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - unreachable


def _progress_display(progress: Any, total: int, desc: str):
    """What shows a restore's progress: None (nothing), or an object with update_to(done) and
    close(). See restore() for the meaning of `progress`."""
    if progress is False:
        return None
    if progress is None or progress is True:
        if progress is None and (total < _PROGRESS_MIN_BYTES or not _stderr_is_tty()):
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return _TextProgress(total, desc) if progress else None
        return _TqdmProgress(tqdm, total, desc)
    if callable(progress):
        return _CallbackProgress(progress, total)
    raise TypeError(f"progress must be None, True, False or a callable, not {type(progress).__name__}")


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class _Reads:
    """The read_many calls of one restore: sums the bytes they read and reports their progress
    as one, in bytes of the destinations (the restored arrays)."""

    def __init__(self, reader: _ext.Reader, total: int, progress: Any, desc: str):
        self.reader = reader
        self.display = _progress_display(progress, total, desc)
        self.done = 0  # destination bytes of the finished calls
        self.bytes_read = 0  # stored bytes read from storage

    def read(self, requests: list[tuple]) -> None:
        if not requests:  # everything of this batch was mapped
            return
        size = sum(r[4].nbytes for r in requests)
        if self.display is None:
            stats = self.reader.read_many(requests)
        else:
            # The engine reports stored bytes of this call; scaled to its destination bytes.
            base, display = self.done, self.display
            stats = self.reader.read_many(requests, progress=lambda done, total: display.update_to(
                base + (size * done // total if total else size)))
        self.done += size
        self.bytes_read += stats["bytes_read"]

    def close(self) -> None:
        if self.display is not None:
            self.display.close()


# Boxes of at least this many bytes are mapped from the files where they can be (map_many).
_MAP_FROM_BYTES = 1 << 20


def _map_boxes(reader: _ext.Reader, path: str, info: dict, boxes: list[tuple], dtype: np.dtype,
               enabled: bool) -> list[np.ndarray | None]:
    """Each (origin, shape) box of array `path` as an array mapped copy-on-write from the data
    files (no copy, and no zeroing of fresh memory: the costliest part of a restore into host
    memory), or None where it must be read: a cast, a small box, compressed or unaligned chunks,
    a foreign format (CheckpointReader::MapMany)."""
    name = tnp.dtype_name(dtype)
    wanted = [i for i, (_, shape) in enumerate(boxes)
              if math.prod(shape) * dtype.itemsize >= _MAP_FROM_BYTES]
    out: list[np.ndarray | None] = [None] * len(boxes)
    if not enabled or name != info["dtype"] or info.get("codec") != "none" or not wanted:
        return out
    mapped = reader.map_many([(path, boxes[i][0], boxes[i][1], name) for i in wanted])
    for i, m in zip(wanted, mapped):
        if m is not None:
            out[i] = m.view(dtype).reshape(boxes[i][1])
    return out


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


class _Restore:
    """Plans the reads a target needs, runs them, and builds the leaves."""

    def __init__(self, reader: _ext.Reader, ckpt: str, truncate: bool, mmap: bool = True):
        self.reader = reader
        self.ckpt = ckpt
        self.truncate = truncate
        self.mmap = mmap
        self.mapped_bytes = 0  # bytes of the boxes mapped instead of read
        self.node = _tree.loads(reader.tree_json())
        self.leaves = _tree.index_leaves(self.node)
        self.infos = {a["path"]: a for a in reader.arrays()}
        self.values: dict[str, Any] = {}
        self.pending: list[tuple[str, list[tuple], Any]] = []  # (path, requests, finish)

    def _stored_array(self, path: str, shape: tuple[int, ...]) -> dict:
        info = self.infos[path]
        stored = tuple(info["shape"])
        if len(shape) != len(stored):
            raise ValueError(f"array {path!r} in {self.ckpt} has shape {stored}; the target's "
                             f"shape {shape} has a different rank")
        if not self.truncate and any(t < s for t, s in zip(shape, stored)):
            raise ValueError(f"array {path!r} in {self.ckpt} has shape {stored}, larger than the "
                             f"target's {shape}; pass truncate=True to read only the target's part")
        return info

    def plan(self, path: str, target: Any) -> None:
        stored = self.leaves.get(path)
        if stored is None or stored["kind"] == "none":
            raise KeyError(f"{path!r} is not in checkpoint {self.ckpt}")
        scalar_target = isinstance(target, (bool, int, float, str, bytes, np.generic))
        if not scalar_target and not (hasattr(target, "shape") and hasattr(target, "dtype")):
            raise TypeError(f"the target's leaf {path!r} is of type {type(target).__name__}; "
                            "target leaves are arrays (np.ndarray, jax.Array, "
                            "jax.ShapeDtypeStruct), NumPy scalars, bool, int, float, str or bytes")
        if stored["kind"] != "array":
            value = _tree.scalar_value(stored)
            self.values[path] = (_cast_scalar(value, target, path, self.ckpt) if scalar_target
                                 else value)
            return
        if isinstance(target, (str, bytes)):
            raise TypeError(f"{path!r} in {self.ckpt} holds an array, the target a {type(target).__name__}")
        if isinstance(target, (bool, int, float)):
            info = self._stored_array(path, ())
            out = np.empty((), tnp.dtype_from_name(info["dtype"]))
            self.pending.append((path, [(path, (), (), info["dtype"], tnp.byte_view(out))],
                                 lambda out=out, target=target, path=path, ckpt=self.ckpt:
                                 _cast_scalar(out.item(), target, path, ckpt)))
            return
        shape = tuple(target.shape)
        # Read in native byte order (what the engine writes); a big-endian target's array is
        # converted to its byte order once read.
        wanted = np.dtype(target.dtype)
        dtype = wanted.newbyteorder("=")
        self._stored_array(path, shape)
        name = tnp.dtype_name(dtype)
        sharding = getattr(target, "sharding", None)
        if _jax is not None and isinstance(target, (_jax.Array, _jax.ShapeDtypeStruct)):
            from . import jax as tjax
            if sharding is None:
                sharding = _jax.sharding.SingleDeviceSharding(_jax.devices()[0])
            boxes = tjax.device_boxes(sharding, shape)
            distinct = list(dict.fromkeys(boxes.values()))
            unique: dict[tuple, np.ndarray] = {}
            requests = []
            for box, mapped in zip(distinct, _map_boxes(self.reader, path, self.infos[path],
                                                        distinct, dtype, self.mmap)):
                if mapped is not None:
                    unique[box] = mapped
                    self.mapped_bytes += mapped.nbytes
                else:
                    unique[box] = tnp.empty_aligned(box[1], dtype)
                    requests.append((path, box[0], box[1], name, tnp.byte_view(unique[box])))
            finish = lambda shape=shape, sharding=sharding, boxes=boxes, unique=unique: tjax.assemble(
                shape, sharding, {d: unique[b] for d, b in boxes.items()})
            self.pending.append((path, requests, finish))
            return
        box = ((0,) * len(shape), shape)
        out = _map_boxes(self.reader, path, self.infos[path], [box], dtype, self.mmap)[0]
        if out is not None:
            self.mapped_bytes += out.nbytes
            requests = []
        else:
            out = tnp.empty_aligned(shape, dtype)
            requests = [(path, box[0], shape, name, tnp.byte_view(out))]
        if isinstance(target, np.generic):
            finish = lambda out=out: out[()]
        elif not wanted.isnative:
            finish = lambda out=out, wanted=wanted: out.astype(wanted)
        else:
            finish = lambda out=out: out
        self.pending.append((path, requests, finish))

    def total_bytes(self) -> int:
        return sum(r[4].nbytes for _, requests, _ in self.pending for r in requests)

    def run(self, reads: _Reads) -> None:
        # Reads go to the engine in batches, so that host buffers bound for devices are freed
        # as soon as each batch has been handed over; within a batch all reads run in parallel.
        # Each item leaves `pending` as it joins a batch, and the batch is emptied once done,
        # so that nothing else keeps a finished batch's host buffers (held by its requests and
        # its `finish` closure) alive until the whole restore is over.
        pending, self.pending = self.pending[::-1], []
        batch: list = []
        batch_bytes = 0
        while pending:
            batch.append(pending.pop())
            batch_bytes += sum(r[4].nbytes for r in batch[-1][1])
            if batch_bytes >= _DEVICE_BATCH_BYTES:
                self._run_batch(reads, batch)
                batch_bytes = 0
        self._run_batch(reads, batch)

    def _run_batch(self, reads: _Reads, batch: list) -> None:
        """Reads and finishes the items of `batch`, then empties it."""
        if not batch:
            return
        reads.read([r for _, requests, _ in batch for r in requests])
        while batch:
            path, _, finish = batch.pop()
            self.values[path] = finish()
            del finish


def restore(path: str | os.PathLike, target: Any = None, *, truncate: bool = False,
            verify_checksums: bool = True, max_inflight_bytes: int = 256 << 20,
            io_threads: int = 0, progress: Any = None, mmap: bool = True) -> Any:
    """Restores the checkpoint step folder `path`: a tensorstash step, or an Orbax checkpoint
    (OCDBT or per-parameter zarr folders, zarr3 or zarr2; an Orbax CheckpointManager step opens
    its item) or a zarr-group checkpoint, detected from the folder's files
    (docs/foreign_formats.md, "Orbax checkpoints"). Orbax sequences come back as lists and its
    custom nodes as dicts without a target; a target gives them their types.

    Without `target`: the saved tree as plain dicts, lists and tuples, arrays as NumPy arrays of
    the saved shapes and dtypes. With `target` (a pytree of jax.ShapeDtypeStruct with .sharding,
    jax.Array, np.ndarray, or scalars): the target's structure, each array with the target's
    shape, dtype (a cast when it differs; in the target's byte order) and sharding, each device
    reading just its own block. Only the target's arrays are read. A target shape larger than
    the stored one is zero-filled; a smaller one is a ValueError unless `truncate`. Scalar
    targets (bool, int, float, NumPy scalars) take the casts arrays take: ints and bools into
    ints, bools and floats, each value exactly; floats into floats; complex into complex; any
    other (a float into an int, say) is a ValueError naming the leaf.

    `progress`: None shows a tqdm bar on stderr when tqdm is installed, stderr is a terminal and
    the restore fills more than 1 GiB; True always shows one (a plain line without tqdm); False
    never; a callable is called as progress(done_bytes, total_bytes), in bytes of the restored
    arrays, from the engine's reading threads, at most about ten times a second and finally
    with done_bytes == total_bytes.

    `mmap`: host buffers of at least 1 MiB whose stored chunks allow it (tensorstash format,
    uncompressed, the stored dtype) are mapped copy-on-write from the data files instead of
    read into fresh memory, their checksums checked all the same: much faster, and pages of the
    page cache rather than new memory. The arrays stay valid whatever happens to the checkpoint
    afterwards, except if its files were truncated in place (tensorstash never does; their
    pages would then fault). Chunks cut into pieces for another layout are likewise copied out
    of a mapping of the data file rather than out of a staging copy, when uncompressed. False
    reads everything.

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
                    progress=progress, mmap=mmap)[0]


def _restore(path: str | os.PathLike, target: Any, *, truncate: bool, verify_checksums: bool,
             max_inflight_bytes: int, io_threads: int, progress: Any,
             mmap: bool = True) -> tuple[Any, int]:
    """restore(), returning (the restored tree, the stored bytes read)."""
    ckpt = os.fspath(path)
    desc = f"restoring {_split(ckpt)[1]}"
    # Closed on return, error or not: an open file would keep a deleted step's space.
    with contextlib.closing(_open(path, verify_checksums, max_inflight_bytes, io_threads,
                                  mmap)) as reader:
        if target is None:
            return _restore_as_saved(reader, progress, desc, mmap)
        plan = _Restore(reader, ckpt, truncate, mmap)
        _tree.map_target(target, plan.plan)
        reads = _Reads(reader, plan.total_bytes(), progress, desc)
        try:
            plan.run(reads)
        finally:
            reads.close()
    return _tree.map_target(target, lambda p, _: plan.values[p]), reads.bytes_read + plan.mapped_bytes


def _restore_as_saved(reader: _ext.Reader, progress: Any, desc: str,
                      mmap: bool) -> tuple[Any, int]:
    """_restore() without a target: the saved tree, its arrays as NumPy arrays."""
    infos = {a["path"]: a for a in reader.arrays()}
    requests = []
    mapped_bytes = 0

    def read_array(array_path: str, _id: int) -> np.ndarray:
        nonlocal mapped_bytes
        info = infos[array_path]
        shape, dtype = tuple(info["shape"]), tnp.dtype_from_name(info["dtype"])
        box = ((0,) * len(shape), shape)
        out = _map_boxes(reader, array_path, info, [box], dtype, mmap)[0]
        if out is not None:
            mapped_bytes += out.nbytes
            return out
        out = tnp.empty_aligned(shape, dtype)
        requests.append((array_path, box[0], shape, info["dtype"], tnp.byte_view(out)))
        return out

    tree = _tree.decode(_tree.loads(reader.tree_json()), read_array)
    reads = _Reads(reader, sum(r[4].nbytes for r in requests), progress, desc)
    try:
        reads.read(requests)
    finally:
        reads.close()
    return tree, reads.bytes_read + mapped_bytes


# Last: the manager builds on the functions above.
from .manager import CheckpointManager, RestoreStats, SaveStats  # noqa: E402
