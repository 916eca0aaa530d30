"""tensorstash.save: a pytree through the engine's writers (native, or Orbax's format)."""

from __future__ import annotations

import base64
import json
import logging
import os
from typing import Any

from . import _adapters, _ext, _gc, _identity, _options, _paths, _tree


def default_coordinator() -> Any:
    """The coordinator of the framework that runs several processes (JAX's distributed
    runtime, say), asked of the registered adapters in order; None in a single process."""
    return _adapters.default_coordinator()


def arrays_to_save(tree: Any, coordinator: Any, *, trust_immutable: bool = False,
                   leaves_out: list | None = None) -> tuple[list[tuple], str]:
    """The arrays of `tree` as the engine saves them, and the tree around them.

    Returns ([(array path, dtype name, shape, shards, stable)], tree JSON), with shards as
    _ext.Writer.add_array takes them, from the leaf's framework adapter (_adapters.py): this
    process's shards of each jax.Array (views of the device buffers on CPU, one copy from other
    devices), and for NumPy arrays the whole array as a shard of which this process is one
    replica, in native byte order (big-endian arrays are converted: the format stores
    little-endian). The shards refer to the caller's memory (or to copies) and must stay
    unchanged until the engine has read them.

    `stable` is true where nothing else can change the shards' memory, so that an async save
    may write them in the background without copying them first: for a jax.Array whose
    buffers are not in host memory, as its shards are then host copies made for this save
    (tjax.in_host_memory). A jax.Array in host memory is not stable although JAX arrays are
    immutable: its memory may be a NumPy array's, which the caller may change once save()
    returns (XLA's CPU client adopts the buffer of an aligned NumPy array given to
    jax.device_put instead of copying it), unless `trust_immutable`: then every leaf whose
    framework forbids changing it (the adapter's immutable(), true for jax.Arrays) is stable,
    as JAX's rules (and Orbax) take it to be. Raises TypeError for unsupported leaves and
    abstract arrays (jax.ShapeDtypeStruct), ValueError for text that is not valid Unicode and
    trees nested too deeply. `leaves_out`, when given, receives the (array path, leaf) of
    each array, in the same order.
    """
    process_index = coordinator.process_index() if coordinator is not None else 0
    process_count = coordinator.process_count() if coordinator is not None else 1
    with _gc.paused():
        return _arrays_to_save(tree, process_index, process_count, trust_immutable, leaves_out)


def _arrays_to_save(tree: Any, process_index: int, process_count: int,
                    trust_immutable: bool, leaves_out: list | None) -> tuple[list[tuple], str]:
    """arrays_to_save's work, done with the garbage collector paused."""
    leaves: list[tuple[str, Any]] = []
    node = _tree.encode(tree, lambda p, x: leaves.append((p, x)))
    if leaves_out is not None:
        leaves_out.extend(leaves)
    adapters = []
    by_adapter: dict[int, list[int]] = {}  # the leaves of each adapter, by index
    for i, (array_path, x) in enumerate(leaves):
        adapter = _adapters.adapter_for(x)
        adapter.check_savable(x, array_path)
        adapters.append(adapter)
        by_adapter.setdefault(id(adapter), []).append(i)
    # Every leaf's copy to the host is started before the first is waited for, so that the
    # copies out of accelerator memory run side by side rather than one after another.
    started = [x for _, x in leaves]
    for mine in by_adapter.values():
        start = getattr(adapters[mine[0]], "start_save", None)
        if start is not None:
            for i, handle in zip(mine, start([started[i] for i in mine]), strict=True):
                started[i] = handle
    arrays = []
    for (array_path, x), adapter, handle in zip(leaves, adapters, started):
        try:
            dtype = _adapters.dtype_name(adapter, x)
        except TypeError as e:
            raise TypeError(f"cannot save the array at {array_path!r}: {e}") from None
        shape, shards, stable = adapter.save_shards(handle, process_index, process_count)
        if trust_immutable and not stable:
            immutable = getattr(adapter, "immutable", None)
            stable = immutable is not None and immutable(x)
        arrays.append((array_path, dtype, tuple(shape), shards, stable))
    return arrays, _tree.dumps(node)


def save(path: str | os.PathLike, tree: Any, *, overwrite: bool = False, codec: str | None = None,
         zstd_level: int = _options.ZSTD_LEVEL, chunk_bytes: int = _options.CHUNK_BYTES,
         data_file_bytes: int = _options.DATA_FILE_BYTES,
         max_inflight_bytes: int = _options.MAX_INFLIGHT_BYTES, io_threads: int = 0,
         sync: bool = True, coordinator: Any = None, format: str = "native",
         orbax_item: str | None = None, base: str | os.PathLike | None = None,
         record_digests: bool = False) -> dict:
    """Saves `tree` as the checkpoint step folder `path` (e.g. ".../ckpts/0000001000").

    `format="orbax"` writes an Orbax checkpoint instead (OCDBT + zarr3, what orbax-checkpoint
    0.12 writes by default), which `orbax.checkpoint.StandardCheckpointer().restore(path, ...)`
    restores; with `orbax_item="default"` the folder is laid out as a step of an Orbax
    CheckpointManager with that item. Orbax format: in a job of several processes each
    writes its own shards into its own OCDBT database and the first publishes the checkpoint
    (as Orbax writes them; the folder must be on a store that can rename); chunks are zstd
    (`zstd_level`), one per shard of each jax.Array and one per NumPy array; `chunk_bytes`,
    `data_file_bytes` and `max_inflight_bytes` do not apply; Python scalars are stored as Orbax
    stores them (0-d int64/float64/bool), and str leaves as its StringHandler does (in
    `_strings.json`; NotImplementedError where the leaf's name holds '/' or '~', which Orbax
    reads as a JSON pointer); bytes leaves raise NotImplementedError; dict keys may hold '/'
    (Haiku's "mlp/~/linear_0"), kept in the parameter name as Orbax keeps it, must not be empty
    nor collide once joined with '.' (Orbax's parameter names); keys that are not str are
    named by str(key), as Orbax names them (restored by Orbax as those strings).
    Returns raw_bytes, chunks and seconds.

    Leaves may be jax.Array (any sharding; each process writes its own shards, replicated data
    once; typed PRNG keys, jax.random.key of any implementation, are stored as their key data
    and the implementation's name, docs/format.md 4.2, and in the Orbax format as Orbax stores
    them), np.ndarray (big-endian ones are stored by value, in the format's little-endian
    order) and NumPy scalars, bool, int (any number of digits), float, str and bytes, and the
    arrays of any adapter registered with tensorstash.register_adapter. The tree may be nested
    up to 512 levels below its root (docs/format.md, section 10). In a job with several
    processes every process calls save with the same tree; NumPy arrays are taken to be the
    same in every process and are written once, the work split across processes. Without
    `coordinator`, the first registered adapter's default_coordinator() that is not None is
    the job's (JAX's distributed runtime when it runs several processes).

    A jax.Array in accelerator memory is first copied into JAX's pinned host memory (every
    leaf's copy started before the first is waited for), and written from there: far faster
    than copies into pageable memory, but JAX keeps the pinned memory it allocated for later
    copies, so the process holds about its largest save's bytes of it once it has saved.
    Environment variable TENSORSTASH_SAVE_VIA_PINNED_HOST=0 (read at import) copies into
    pageable memory instead.

    Incremental saves (docs/format.md, 6.1): with `base`, a committed step in the same folder as
    `path` (e.g. ".../ckpts/0000000900"), every chunk whose bytes (XXH3-128 digest), dtype,
    chunk box and codec equal that step's is not written again: the new step refers to where
    its bytes lie (in `base`'s files, or in those `base` itself refers to), and depends on those
    steps from then on: deleting one by hand makes the new step unreadable (OSError naming the
    missing file and its step). Only a base saved with digests (`record_digests=True`, or
    itself saved with a base) has chunks to match; `base` implies `record_digests`. Such steps
    are format version 2 (index 2.0), which tensorstash before incremental steps refuses.
    A jax.Array that this process saved into `base` (in this session, one of its last four
    such saves) and saves again, the same array (or the same device buffers) still alive and not
    deleted, is taken as unchanged without hashing its bytes, as long as `base` is still the
    step that save committed. This applies to arrays off the host; on CPU devices a jax.Array's
    memory may be a NumPy array's, which may have changed, so those are hashed, as NumPy
    arrays always are.

    Returns the engine's statistics for this process (raw_bytes, stored_bytes, chunks,
    data_files, referenced_chunks, referenced_bytes, unhashed_chunks: of those referenced, how
    many without hashing, commit_id, seconds). Raises FileExistsError when the step is already complete and not
    `overwrite`, TypeError for unsupported leaves, ValueError for a tree nested more deeply
    and for text (keys, strings, the path) that is not valid Unicode, OSError for storage
    errors. On error nothing new is visible at `path`.
    """
    root, step = _paths.split(path)
    if format == "orbax":
        return _save_orbax(root, step, tree, overwrite=overwrite, codec=codec,
                           zstd_level=zstd_level, io_threads=io_threads, sync=sync,
                           coordinator=coordinator, item=orbax_item)
    if format != "native":
        raise ValueError(f"unknown format {format!r}; use 'native' or 'orbax'")
    if orbax_item is not None:
        raise ValueError("orbax_item applies to format='orbax' only")
    _options.check_codec(codec)
    base_step = ""
    if base is not None:
        base_root, base_step = _paths.split(base)
        if not _same_root(base_root, root):
            raise ValueError(f"base {os.fspath(base)!r} must be a step in the same folder as "
                             f"{os.fspath(path)!r}")
    made = coordinator is None
    if made:
        coordinator = default_coordinator()
    leaves: list[tuple[str, Any]] = []
    arrays, tree_json = arrays_to_save(tree, coordinator, leaves_out=leaves)
    # The identity shortcut (_identity.py): arrays this process saved into `base` from the
    # same buffers, still alive, are not hashed again (if base still holds what it saved).
    base_commit_id, unchanged = "", set()
    if base is not None:
        recalled = _identity.recalled(_step_key(base_root, base_step))
        if recalled is not None:
            base_commit_id = recalled[0]
            unchanged = set(recalled[1].unchanged(leaves, arrays))
    writer = _ext.Writer(root, step, target_chunk_bytes=chunk_bytes,
                         target_data_file_bytes=data_file_bytes,
                         max_inflight_bytes=max_inflight_bytes, io_threads=io_threads, sync=sync,
                         overwrite=overwrite, coordinator=coordinator, base=base_step,
                         record_digests=record_digests, base_commit_id=base_commit_id)
    for array_path, dtype, shape, shards, _stable in arrays:
        writer.add_array(array_path, dtype, shape, shards, codec=codec or "none",
                         zstd_level=zstd_level, same_as_base=array_path in unchanged)
    writer.set_tree(tree_json)
    stats = writer.commit()
    if stats.get("commit_id"):
        _identity.remember(_step_key(root, step), stats["commit_id"],
                           _identity.SavedArrays(leaves, arrays))
    if made:
        _close_coordinator(coordinator)
    return stats


def materialize(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False,
                sync: bool = True) -> None:
    """Copies the native step `src` into a self-contained step `dst`, as `tensorstash convert
    --materialize` does: an incremental step's chunks that lie in the steps it depends on are
    copied in (docs/format.md 6.1), so that `dst` restores without them. Every array keeps its
    codec and chunk size, and the step's metadata, metrics and per-process state are copied;
    every chunk's CRC is checked on the way. `dst` may be in another folder or store.

    Raises FileNotFoundError when `src` is missing, OSError naming the chunk, or the file and
    the step it lies in, for damaged or missing data (nothing is written then), FileExistsError
    when `dst` is a complete step and not `overwrite`. On error nothing new is visible at `dst`.
    """
    _ext.materialize(_paths.abspath(src), _paths.abspath(dst), overwrite=overwrite, sync=sync)


def _step_key(root: str, step: str) -> str:
    """One name for a step folder however its root was spelled (relative or absolute)."""
    return _paths.abspath(root or ".") + "\0" + step


def _same_root(a: str, b: str) -> bool:
    """Whether two roots (as _paths.split gives them) are one folder: equal URLs, or local
    paths of the same directory."""
    if a == b:
        return True
    if "://" in a or "://" in b:
        return False
    try:
        return os.path.samefile(a or ".", b or ".")
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _close_coordinator(coordinator: Any) -> None:
    """Lets a coordinator this save made for itself drop what it left in the job's store
    (TorchCoordinator.close: the keys of the save), once every process has committed. A
    failure there leaves keys behind but the step is committed, so it is logged, not raised."""
    close = getattr(coordinator, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception as e:  # noqa: BLE001 - the save itself succeeded
        logging.getLogger("tensorstash").warning(
            "tensorstash: the coordinator's keys of this save stay in the store: %s", e)


def _orbax_name(array_path: str) -> str:
    """Orbax's parameter name of the leaf at `array_path`: its keys joined by '.'."""
    return ".".join(k.replace("~1", "/").replace("~0", "~") for k in array_path.split("/"))


def _save_orbax(root: str, step: str, tree: Any, *, overwrite: bool, codec: str | None,
                zstd_level: int, io_threads: int, sync: bool, coordinator: Any,
                item: str | None, json_items: tuple = ()) -> dict:
    """save(format="orbax"): the tree through _ext.OrbaxWriter. `json_items`: (item name,
    file name, JSON text) of JSON items committed beside `item` (the manager's metrics)."""
    if codec not in (None, "zstd"):
        raise ValueError(f"the Orbax format stores zstd chunks; codec {codec!r} is not available")
    made = coordinator is None
    if made:
        coordinator = default_coordinator()
    if coordinator is not None and coordinator.process_count() <= 1:
        coordinator = None
    # Orbax stores a PRNG key array as its key data at the leaf's own name (not the native
    # format's marked dict node), the implementation in its array metadata (random_key_impl).
    key_impls: dict[str, str] = {}

    def key_data(where: str, x: Any) -> Any:
        if not _tree.is_key_array(x):
            return x
        impl, data = _tree.key_parts(x)
        key_impls[where] = impl
        return data

    tree = _tree.map_target(tree, key_data)
    arrays, tree_json = arrays_to_save(tree, coordinator)
    writer = _ext.OrbaxWriter(root, step, item=item or "", overwrite=overwrite, sync=sync,
                              io_threads=io_threads, zstd_level=zstd_level,
                              json_items=[list(j) for j in json_items], coordinator=coordinator)
    shardings = {}
    leaves: dict[str, Any] = {}
    _tree.encode(tree, leaves.__setitem__)
    for array_path, dtype, shape, shards, _stable in arrays:
        value_type = "np.ndarray"
        x = leaves[array_path]
        serialized = _adapters.adapter_for(x).orbax_sharding(x)
        if serialized is not None:
            value_type = "jax.Array"
            name = base64.urlsafe_b64encode(_orbax_name(array_path).encode()).decode("ascii")
            shardings[name] = serialized
        impl = key_impls.get(array_path, "")
        if impl and value_type != "jax.Array":
            raise NotImplementedError(
                f"format='orbax' writes the PRNG key array at {array_path!r} only on a "
                "NamedSharding or SingleDeviceSharding (Orbax records a key's implementation "
                "for jax.Array leaves only)")
        writer.add_array(array_path, dtype, shape, shards, value_type=value_type,
                         random_key_impl=impl)
    if shardings:
        writer.add_file("_sharding", json.dumps(shardings))
    writer.set_tree(tree_json)
    stats = writer.commit()
    if made and coordinator is not None:
        _close_coordinator(coordinator)
    return stats
