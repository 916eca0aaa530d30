"""CheckpointManager: the checkpoints of one training run, as a training loop uses them.

    mgr = tensorstash.CheckpointManager(root, max_to_keep=3, save_interval_steps=100)
    mgr.save(step, state, metadata={"config": cfg}, per_process={"data_iter": it.state()})
    step = mgr.latest_step()          # newest complete step, or None
    state = mgr.restore(step, target=abstract_state)
    mgr.wait_until_finished(); mgr.close()

Each step is a folder `<root>/<step, 10 digits>` holding the state's arrays and, committed with
them, metadata.json (the `metadata` of save, JSON), metrics.json (`metrics`) and
process/<index> (each process's `per_process` value: its JSON text, or for bytes the marker
b"\\0bytes\\n" followed by the bytes). The engine (C++) does the saving, retention, locking and,
with a local tier, the orchestration of the tiers (tensorstash._ext.Manager over
tiers/multi_tier_manager.h: which tier is due, the latest step, the restore's holders and the
write-back); this module puts pytrees, statistics and logging around it.

A root of Orbax steps (written by orbax.checkpoint.CheckpointManager, or with format="orbax")
gets _OrbaxRunManager instead, the same interface over Orbax's step names and items
(_orbax_steps.py), the Orbax writer and the engine's retention policy.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import inspect
import itertools
import json
import logging
import operator
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
import weakref
from typing import Any, Callable

import numpy as np

from . import _adapters, _ext, _identity, _options, _orbax_steps, _paths, _tree
from . import numpy as _tnp
from ._progress import format_bytes as _format_bytes
from . import _restore as _restore_module
from ._restore import _restore, _share_setup, restore as _restore_signature
from ._save import _save_orbax
from ._save import (_close_coordinator, arrays_to_save as _arrays_to_save,
                    default_coordinator as _default_coordinator)

# Marks a per-process value saved as bytes (JSON text never contains a NUL character).
_BYTES_MARKER = b"\0bytes\n"


@dataclasses.dataclass(frozen=True)
class SaveStats:
    """What one save of this process took.

    blocking_s: how long save() kept the caller (flattening the tree, copying the arrays to
    host memory, and for a synchronous save the whole write); total_s: from the call of save()
    until the step was committed. raw_bytes: array bytes this process wrote, stored_bytes: the
    bytes it wrote to data files (after the codec)."""

    step: int
    async_save: bool
    raw_bytes: int
    stored_bytes: int
    blocking_s: float
    total_s: float
    # Incremental saves: chunks recorded as references to earlier steps, and of those the
    # chunks of arrays saved again from the same buffers, referenced without hashing them.
    referenced_chunks: int = 0
    unhashed_chunks: int = 0

    @property
    def gbps(self) -> float:
        """Raw bytes per second of the whole save, in GB/s (10^9 bytes)."""
        return self.raw_bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class RestoreStats:
    """What one restore by this process took: `bytes` read from storage in `seconds`.

    bytes_from / seconds_from: the bytes of the restored boxes each tier gave ("local": this
    node's RAM tier, "peer": other processes' RAM tiers, "persistent": the root) and the time
    spent reading from it. `failures`: the holders that failed to give a chunk (corrupt,
    missing, unreachable), each with its error; the chunk came from the next holder."""

    step: int
    bytes: int
    seconds: float
    bytes_from: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds_from: dict[str, float] = dataclasses.field(default_factory=dict)
    failures: tuple[str, ...] = ()
    # A restore that shared its reads (share_reads): restore()'s `stats` of this process
    # (storage_bytes, storage_seconds, peer_bytes, peer_seconds, fallbacks, ...); else None.
    shared: dict | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


# Steps are folder names of 10 digits (docs/format.md).
_MAX_STEP = 10**10 - 1


def _check_step(step: Any) -> int:
    """`step` as an int: an int (or a NumPy/JAX integer scalar) from 0 to 9,999,999,999.
    ValueError for anything else, bools and floats included (save(6.7) must not save step 6)."""
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise ValueError(f"a step must be an int, not {type(step).__name__} ({step!r})")
    value = operator.index(step)
    if not 0 <= value <= _MAX_STEP:
        raise ValueError(f"step {value} is out of range: steps are ints from 0 to {_MAX_STEP} "
                         f"(10-digit folder names)")
    return value


def _is_data_error(e: BaseException) -> bool:
    """Whether a failed restore says the step's bytes are bad (corrupt, missing), so that an
    older step may restore instead: not a timeout, a permission or a caller's error."""
    return isinstance(e, OSError) and not isinstance(e, (TimeoutError, PermissionError))


def _coordinator_address() -> str | None:
    """"host:port" of the job's coordinator: JAX's, else the store of torch.distributed's
    default process group (when torch has been imported; never importing it)."""
    try:
        from jax._src import distributed

        address = distributed.global_state.coordinator_address
    except Exception:  # noqa: BLE001 - JAX absent or not initialised
        address = None
    if not address and "torch" in sys.modules:
        try:
            from . import torch as ttorch

            address = ttorch.coordinator_address()
        except Exception:  # noqa: BLE001 - torch.distributed absent or not initialised
            address = None
    return address or None


def _coordinator_is_local() -> bool:
    """Whether the job's coordinator is on this host's loopback (a job on one host)."""
    address = _coordinator_address() or ""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _default_server_address() -> str:
    """The address of this host that the job's coordinator sees: the source address of a route
    to the JAX coordinator or torch.distributed's store (no packet is sent); 127.0.0.1 when
    there is none."""
    address = _coordinator_address()
    if not address:
        return "127.0.0.1"
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _as_stored(target: Any, arrays: list[dict]) -> bool:
    """Whether a restore into `target` gives every array of the step (`arrays`, the reader's)
    whole and as stored: its shape and dtype (no cast, no part of the tree, no truncation), so
    that the host buffers it filled may be saved again as this node's copy."""
    if target is None:
        return True
    infos = {a["path"]: a for a in arrays}
    seen: set[str] = set()
    ok = [True]

    def visit(path: str, leaf: Any) -> None:
        info = infos.get(path)
        if info is None:
            return  # a scalar of the tree
        seen.add(path)
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) or isinstance(leaf, np.generic):
            ok[0] = False
            return
        adapter = _adapters.adapter_for(leaf)
        stored = _tnp.dtype_from_name(info["dtype"])
        if (tuple(leaf.shape) != tuple(info["shape"])
                or _adapters.restore_dtype(adapter, leaf) != stored):
            ok[0] = False

    _tree.map_target(target, visit)
    return ok[0] and seen == set(infos)


def _encode_per_process(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _BYTES_MARKER + bytes(value)
    try:
        return json.dumps(value).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise TypeError(f"per_process must be bytes or JSON-serialisable: {e}") from None


def _decode_per_process(data: bytes) -> Any:
    if data.startswith(_BYTES_MARKER):
        return data[len(_BYTES_MARKER):]
    return json.loads(data.decode("utf-8"))


class CheckpointManager:
    """The steps of one training run under the folder `root` (created if missing).

    Saves run in the background by default (`async_save`): save() returns once the arrays
    are copied to host memory (NumPy arrays and jax.Arrays in host memory, e.g. on CPU devices,
    which may share memory with a NumPy array; jax.Arrays on other devices are copied to host
    once and written from that copy), so that the caller may change any array as soon as
    save() returns; at most one save is in flight, and the error of a background save
    is raised by the next save(), wait_until_finished() or close(). A step is listed only once
    it is complete; leftovers of crashed saves are removed when the manager opens.

    Retention: `max_to_keep` newest steps (None: all), besides every step divisible by
    `keep_period`; with `best_metric`, the `max_to_keep` best steps by that metric of save's
    `metrics` (`best_mode` "min" or "max") plus the newest. should_save(step) is true every
    `save_interval_steps` steps. `handle_sigterm` makes a SIGTERM set reached_preemption()
    instead of killing the process (until close()). `max_staging_bytes` caps the host memory of
    an async save's copies (None: a quarter of physical memory; above the cap save() blocks
    longer); that memory is kept for the next save until close(), so that a save's copy goes
    into memory already mapped.

    `copy_host_jax_arrays=False` makes an async save write jax.Arrays in host memory (on CPU
    devices, or in a host memory kind) from their buffers in the background, as Orbax does,
    instead of copying them before save() returns: save() then blocks for little more than
    flattening the tree. JAX arrays are immutable, and the manager holds a view of each buffer
    until it is written, so deleting the array or donating it to a jitted step meanwhile is
    safe (JAX does not donate a buffer that something views; the step gets a new one). What it
    gives up: a jax.Array whose memory is a NumPy array's (jax.device_put of an aligned NumPy
    array onto a CPU device adopts that memory, unless may_alias=False) is saved as that NumPy
    array is when written, so the caller must not change such NumPy arrays until the step is
    committed. NumPy leaves are always copied. `codec`, `zstd_level`, `chunk_bytes`, `data_file_bytes`, `max_inflight_bytes`,
    `io_threads` and `sync` are as for tensorstash.save.

    In a job of several processes every process opens a manager on the same root with the same
    options and calls save/reached_preemption for the same steps in the same order;
    `coordinator` defaults to the JAX distributed runtime's (tensorstash.jax) when the job has
    several JAX processes.

    on_save(SaveStats) is called after each commit (for async saves on the background thread;
    it must not call save, wait_until_finished or close), on_restore(RestoreStats) after each
    restore; both are also logged at INFO to `logger` (default: logging.getLogger("tensorstash")).
    An exception raised by a callback is logged, not raised.

    The node-local tier (docs/multitier.md): with `local_dir` (a folder on a tmpfs such as
    /dev/shm, the same path on every node), every `local_save_interval_steps` steps each
    process also saves all of its shards (every replica) with its per_process value and the
    metadata into `local_dir`, keeping `local_max_to_keep` steps there (a save that would not
    fit in the folder's free space is skipped with a warning). latest_step() and restore() then
    become collective: every process calls them, in the same order; latest_step() is the newest
    step that the persistent tier or the processes' local tiers together can restore, and
    restore() reads each chunk from the cheapest holder with an intact copy (this node, another
    process's node over HTTP, persistent storage), heals this node's copy afterwards, and
    reports the bytes per tier in last_restore_stats.bytes_from. With several processes each
    serves its local tier on `local_server_address` (default: this host's address towards the
    JAX coordinator; port `local_server_port`, 0: any) to requests carrying a secret handed out
    through the coordinator. Each collective wait (of a save, of the manager, of the local tier)
    is bounded by `coordination_timeout` seconds (default 30 min, the engine's); a process that
    does not arrive is named in a TimeoutError.

    `incremental=True` (native steps; docs/format.md 6.1): each save is made against the newest
    listed step below it, so that a chunk that did not change since is recorded as a reference
    to where its bytes already lie rather than written again (the frozen part of a LoRA-like
    state costs a hash per chunk and no write). Retention still decides what all_steps() lists;
    a dropped step that a listed step refers to stays on storage, unlisted (retired_steps()),
    and is deleted once none does, in this session or a later one. With local_dir the
    persistent tier saves incrementally; the local tier does not. When the base cannot be
    opened (removed or damaged by hand), the save is made in full, with a warning naming the
    base (a one-off save(base=...) fails instead). A jax.Array saved again
    from the same buffers as the previous save (the same array, or one over the same device
    buffers, the earlier one still alive and not deleted) is unchanged without hashing it
    (SaveStats.unhashed_chunks), when that save committed and is the new one's base; for
    jax.Arrays in host memory only with copy_host_jax_arrays=False, which then also asks that
    a NumPy array whose memory such an array adopted never change while the array lives.

    `share_reads` (True, False, or None: on for s3:// and gs:// roots when the job has more than
    one process): restore() reads each stored chunk that several processes need once, by one of
    them, which sends it to the others over the peer transport (tensorstash.restore's
    share_reads, docs/shared_reads.md); a restore call's own share_reads wins.
    last_restore_stats.shared then holds this process's bytes and seconds from storage and from
    peers. Not with local_dir (the multi-tier restore reads as before) nor for Orbax steps.

    `format`: the format of the root's steps. "auto" (the default) takes what the root holds:
    Orbax steps (written by orbax.checkpoint.CheckpointManager, or by this manager with
    format="orbax") make it a manager of Orbax steps, anything else (an empty root included) of
    native steps. "orbax" on an empty root starts a run of Orbax steps. A root of one format
    opened as the other is a ValueError. With Orbax steps (local folders, one process):
    the steps are listed and restored as Orbax lists them (`[<step_prefix>_]<step>` folders,
    zero-padded to `step_format_fixed_length` digits when set; by default as the steps already
    there are named; temporary folders are not steps); a step of one item restores as that
    item's tree, a step of several items (ocp.args.Composite) as a dict of them by name (array
    trees as trees, JSON items as their values; `target` is then a dict of targets by item
    name); save() writes Orbax steps of the one item "default" (StandardSave), with `metrics`
    as Orbax's "metrics" item, that orbax.checkpoint.CheckpointManager lists and restores;
    retention, best_metric, async_save, handle_sigterm and on_save/on_restore are as for native
    steps. No lock is taken on storage (Orbax takes none, and leaves nothing a LOCK file would
    guard): a second manager of the same root in this process is refused, one in another
    process is not detected. metadata() is the step's Orbax custom_metadata; save's `metadata`
    and `per_process` and local_dir are not available there. In a job of several processes
    every process calls save() (each writes the chunks it owns, as save(format="orbax") does),
    process 0 applies retention and the others wait for it within `coordination_timeout`, and
    with handle_sigterm reached_preemption() is True in every process once any got a SIGTERM.
    An Orbax root on a store URL (gs://, s3://) is detected, listed and restored from, but
    save() there is a NotImplementedError.

    Raises ValueError when another manager holds the root's lock (until it is closed or its
    process ends) or for bad options. A context manager: close() on exit.
    """

    def __new__(cls, root: str | os.PathLike, *args: Any, format: str = "auto",
                **kwargs: Any) -> CheckpointManager:
        # The class that manages the root's format (checked before anything is written there):
        # this one for native steps, _OrbaxRunManager for a root of Orbax steps.
        if cls is not CheckpointManager:
            return super().__new__(cls)
        found = _root_format(root, format)
        manager = super().__new__(_OrbaxRunManager if found == "orbax" else cls)
        # __init__ uses it rather than looking again: on a store URL each look is a listing of
        # the root and of every step folder in it.
        manager._found_format = found
        return manager

    def __init__(self, root: str | os.PathLike, *, max_to_keep: int | None = None,
                 keep_period: int | None = None, save_interval_steps: int = 1,
                 best_metric: str | None = None, best_mode: str = "min", async_save: bool = True,
                 handle_sigterm: bool = False, max_staging_bytes: int | None = None,
                 copy_host_jax_arrays: bool = True, codec: str | None = None, zstd_level: int = _options.ZSTD_LEVEL,
                 chunk_bytes: int = _options.CHUNK_BYTES,
                 data_file_bytes: int = _options.DATA_FILE_BYTES,
                 max_inflight_bytes: int = _options.MAX_INFLIGHT_BYTES,
                 io_threads: int = 0, sync: bool = True, coordinator: Any = None,
                 on_save: Callable[[SaveStats], Any] | None = None,
                 on_restore: Callable[[RestoreStats], Any] | None = None,
                 logger: logging.Logger | None = None, local_dir: str | os.PathLike | None = None,
                 local_save_interval_steps: int = 1, local_max_to_keep: int = 1,
                 local_server_address: str | None = None, local_server_port: int = 0,
                 coordination_timeout: float = _options.COORDINATION_TIMEOUT_S,
                 format: str = "auto", step_prefix: str | None = None,
                 step_format_fixed_length: int | None = None, incremental: bool = False,
                 share_reads: bool | None = None):
        _options.check_codec(codec)
        if share_reads is not None and not isinstance(share_reads, bool):
            raise TypeError(f"share_reads must be True, False or None, not {share_reads!r}")
        self.share_reads = share_reads
        self._coordination_timeout = coordination_timeout
        found = getattr(self, "_found_format", None) or _root_format(root, format)
        if found != "native":  # a subclass's (__new__ picks the class)
            raise ValueError(f"{root} holds Orbax steps: {type(self).__name__} manages native "
                             "steps only")
        if step_prefix is not None or step_format_fixed_length is not None:
            raise ValueError("step_prefix and step_format_fixed_length name Orbax steps; "
                             "native steps are 10-digit folders")
        _check_counts(max_to_keep=max_to_keep, keep_period=keep_period,
                      save_interval_steps=save_interval_steps,
                      max_staging_bytes=max_staging_bytes,
                      local_save_interval_steps=local_save_interval_steps,
                      local_max_to_keep=local_max_to_keep)
        if not coordination_timeout > 0:
            raise ValueError(f"coordination_timeout must be > 0, not {coordination_timeout!r}")
        _check_best(best_metric, max_to_keep)
        self.root = _paths.abspath(root)
        self.format = "native"
        self.async_save = bool(async_save)
        self.copy_host_jax_arrays = bool(copy_host_jax_arrays)
        self.codec = codec or "none"
        self.zstd_level = zstd_level
        self.logger = logger if logger is not None else logging.getLogger("tensorstash")
        self.on_save = on_save
        self.on_restore = on_restore
        self.last_save_stats: SaveStats | None = None
        self.last_restore_stats: RestoreStats | None = None
        # A coordinator the manager took itself is closed with it (TorchCoordinator: the keys
        # of every save leave torch.distributed's store then).
        self._own_coordinator = coordinator is None
        self._coordinator = coordinator if coordinator is not None else _default_coordinator()
        self._process_index = (self._coordinator.process_index()
                               if self._coordinator is not None else 0)
        # Seconds save() spent before handing a step to the engine, by step: the part of the
        # blocking time that the engine does not see (read by the commit callback).
        self._pre_engine_s: dict[int, float] = {}
        self._closed = False
        # The callback refers to the manager weakly, so that dropping the manager frees it.
        this = weakref.ref(self)

        def on_commit(stats: dict) -> None:
            manager = this()
            if manager is not None:
                manager._committed(stats)

        local: dict[str, Any] = {}
        if local_dir is not None:
            several = self._coordinator is not None and self._coordinator.process_count() > 1
            bind = local_server_address or _default_server_address()
            if (several and local_server_address is None and bind.startswith("127.")
                    and not _coordinator_is_local()):
                self.logger.warning(
                    "tensorstash: the local tier's server listens on %s: processes on other "
                    "hosts cannot reach it (no route to a JAX coordinator was found); pass "
                    "local_server_address", bind)
            logger = self.logger
            local = dict(local_dir=os.path.abspath(os.fspath(local_dir)),
                         local_save_interval_steps=local_save_interval_steps,
                         local_max_to_keep=local_max_to_keep, local_server_address=bind,
                         local_server_port=local_server_port,
                         warn=lambda text: logger.warning("tensorstash: %s", text))
        # With local_dir the engine's MultiTierManager: both tiers, one coordination_timeout.
        self._ext = _ext.Manager(
            self.root, max_to_keep=max_to_keep or 0, keep_period=keep_period or 0,
            save_interval_steps=save_interval_steps, best_metric=best_metric or "",
            best_mode=best_mode, max_staging_bytes=max_staging_bytes or 0,
            handle_sigterm=handle_sigterm, coordinator=self._coordinator, on_commit=on_commit,
            target_chunk_bytes=chunk_bytes, target_data_file_bytes=data_file_bytes,
            max_inflight_bytes=max_inflight_bytes, io_threads=io_threads, sync=sync,
            coordination_timeout_s=coordination_timeout, incremental=bool(incremental), **local)
        self._multi = local_dir is not None
        self.incremental = bool(incremental)
        # The step of the last persistent save handed to the engine and the arrays it read
        # (incremental saves' identity shortcut).
        self._last_saved: tuple[int, _identity.SavedArrays] | None = None
        # What the last multi-tier restore of a step read besides the arrays, by step.
        self._restored_from_tiers: dict[int, _ext.TieredRestore] = {}
        self._last_latest: int | None = None  # what latest_step() last found, with local_dir
        # Steps that did not restore whole -> the older step restored instead (restore()).
        self._redirected: dict[int, int] = {}
        # Closed at interpreter exit at the latest (waiting for a save in flight), while the
        # background thread can still take the GIL.
        self._finalizer = weakref.finalize(self, _close_quietly, self._ext)
        for step, why in self.damaged_steps().items():
            self.logger.warning("tensorstash: step %d in %s is damaged and not listed (the latest "
                                "step is the newest one that opens): %s", step, self.root, why)

    # --- saving -----------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, metadata: Any = None, per_process: Any = None,
             metrics: dict[str, float] | None = None, force: bool = False) -> bool:
        """Saves `state` (a pytree, as for tensorstash.save) as `step`, with `metadata` (JSON),
        this process's `per_process` value (JSON or bytes, at most 64 MiB) and `metrics`
        (name -> float, for best_metric), all committed together.

        Returns False, saving nothing, when the step is not due (should_save) and not `force`.
        Otherwise returns True: with async_save once the arrays are copied to host memory
        (they may change right afterwards; the write and commit go on in the background), else
        once the step is committed. Raises the error of an earlier background save (saving
        nothing), FileExistsError when the step is already complete, TypeError for unsupported
        leaves or values that are not JSON, ValueError for a step that is not an int from 0 to
        9,999,999,999 (a float or a bool included), bad metrics or a closed manager.
        """
        started = time.perf_counter()
        self._check_open()
        step = _check_step(step)
        if not force and not self._ext.should_save(step):
            return False
        leaves: list[tuple[str, Any]] = []
        arrays, tree_json = _arrays_to_save(state, self._coordinator,
                                            trust_immutable=not self.copy_host_jax_arrays,
                                            leaves_out=leaves)
        # The identity shortcut (_identity.py): the arrays of the last save handed to the
        # engine that are the same buffers now; the engine keeps the promise only when that
        # step committed and is this save's base.
        same_as_base: list[str] = []
        same_as_step = None
        if self.incremental and self._last_saved is not None:
            same_as_step, saved = self._last_saved
            same_as_base = saved.unchanged(leaves, arrays)
        try:
            metadata_json = "" if metadata is None else json.dumps(metadata)
        except (TypeError, ValueError) as e:
            raise TypeError(f"metadata must be JSON-serialisable: {e}") from None
        process_state = None if per_process is None else _encode_per_process(per_process)
        metrics_dict = {}
        for name, value in (metrics or {}).items():
            name = str(name)
            _tree.check_text(name, f"the metric name {name!r}")
            metrics_dict[name] = float(value)
        # The engine saves on the due tiers (the local one first; its failure is a warning when
        # the persistent save, which is collective, goes on).
        persistent_due = force or self._ext.persistent_due(step)
        if persistent_due:
            self._pre_engine_s[step] = time.perf_counter() - started
        try:
            self._ext.save(step, arrays, tree_json=tree_json, metadata_json=metadata_json,
                           process_state=process_state, metrics=metrics_dict, codec=self.codec,
                           zstd_level=self.zstd_level, async_save=self.async_save, force=force,
                           same_as_base=same_as_base, same_as_step=same_as_step)
        except BaseException:
            self._pre_engine_s.pop(step, None)
            raise
        if self.incremental and persistent_due:
            self._last_saved = (step, _identity.SavedArrays(leaves, arrays))
        return True

    def _committed(self, engine: dict) -> None:
        """The engine's commit callback (any thread, with the GIL): stats, log, on_save."""
        try:
            step = engine["step"]
            before = self._pre_engine_s.pop(step, 0.0)
            stats = SaveStats(step=step, async_save=bool(engine["async"]),
                              raw_bytes=engine["raw_bytes"], stored_bytes=engine["stored_bytes"],
                              blocking_s=before + engine["blocking_seconds"],
                              total_s=before + engine["total_seconds"],
                              referenced_chunks=engine.get("referenced_chunks", 0),
                              unhashed_chunks=engine.get("unhashed_chunks", 0))
            self.last_save_stats = stats
            if engine.get("base_unreadable"):
                self.logger.warning("tensorstash: step %d of %s was saved in full, not "
                                    "incrementally: %s", step, self.root,
                                    engine["base_unreadable"])
            self.logger.info("saved step %d: %s in %.2f s (%.2f GB/s), blocked %.0f ms", step,
                             _format_bytes(stats.raw_bytes), stats.total_s, stats.gbps,
                             stats.blocking_s * 1e3)
            if self.on_save is not None:
                self.on_save(stats)
        except Exception:  # noqa: BLE001 - a callback must not break the save
            self.logger.exception("tensorstash: the on_save callback of step %s failed",
                                  engine.get("step"))

    def should_save(self, step: int) -> bool:
        """Whether `step` is due under save_interval_steps (or, with a local tier,
        local_save_interval_steps)."""
        return self._ext.should_save(_check_step(step))

    def reached_preemption(self, step: int) -> bool:
        """True once a SIGTERM arrived (handle_sigterm): save `step` and stop. With several
        processes this is collective (all call it for the same steps) and true in all of them
        once any one was signalled."""
        return self._ext.reached_preemption(_check_step(step))

    def wait_until_finished(self) -> None:
        """Waits for the save in flight; raises its error, if it failed (once)."""
        self._check_open()
        self._ext.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight (raising its error, if any), restores the SIGTERM
        handler and releases the root's lock. Later calls do nothing; the step queries and
        restores still work, saves raise ValueError. With the torch.distributed coordinator the
        manager took itself, close() is collective: it waits (up to a minute) for every
        process's close() and then deletes the keys its saves left in the process group's
        store (a wait that times out is logged and leaves them); on leaving a `with` block by
        an exception it does not wait."""
        self._close(drop_coordinator_keys=True)

    def _close(self, drop_coordinator_keys: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self._ext.close()
        if drop_coordinator_keys and self._own_coordinator:
            _close_coordinator(self._coordinator)  # collective: every process closes

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        # After an error the other processes may never close theirs: nobody waits for them.
        self._close(drop_coordinator_keys=exc_type is None)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the checkpoint manager of {self.root} is closed")

    # --- steps ------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Complete steps of the persistent tier, ascending (a save in flight is listed once
        committed)."""
        return list(self._ext.all_steps())

    def local_steps(self) -> list[int]:
        """Steps this node's local tier holds a committed part of (any process's), ascending;
        empty without local_dir. Not collective."""
        return self._ext.local_steps() if self._multi else []

    def latest_step(self) -> int | None:
        """The newest complete step, or None when there is none. With local_dir: the newest
        step that the persistent tier or the local tiers of all processes together can restore
        (collective: every process calls it)."""
        if not self._multi:
            return self._ext.latest_step()
        self._last_latest = self._ext.tiered_latest_step()
        return self._last_latest

    def damaged_steps(self) -> dict[int, str]:
        """Steps that have a COMMIT but do not open (a damaged COMMIT, tree.json or index), found
        when the manager opened, each with the reason; logged as a warning then. They are not
        listed, never deleted by retention, and left on storage for inspection. Process 0 only
        (empty elsewhere)."""
        return dict(self._ext.damaged_steps())

    def retired_steps(self) -> list[int]:
        """With incremental=True: steps retention dropped that stay on storage, unlisted,
        because a listed step refers to their data; each is deleted once no listed step does.
        Ascending; process 0 only (empty elsewhere)."""
        return list(self._ext.retired_steps())

    def step_path(self, step: int) -> str:
        """The folder of `step` (whether or not it exists)."""
        step_dir = _ext.Manager.step_dir(_check_step(step))
        if _ext.has_url_scheme(self.root):
            return f"{self.root.rstrip('/')}/{step_dir}"
        return os.path.join(self.root, step_dir)

    # --- restoring --------------------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None, **kwargs) -> Any:
        """Restores `step` (None: the latest complete one), as tensorstash.restore(
        step_path(step), target, **kwargs) does, and reports RestoreStats (on_restore, log).

        The latest step (None, or the step latest_step() last returned) falls back: when it does
        not restore whole (a chunk whose every copy is corrupt or missing: an OSError other than
        TimeoutError or PermissionError), the newest older step that does is restored instead,
        in every process alike, with a warning naming the step skipped and why;
        last_restore_stats.step says which step was restored, and latest_step(),
        per_process() and metadata() then answer for it. (A single process, or a job with
        local_dir; a job of several processes without local_dir raises.) An explicit older step
        never falls back. Raises FileNotFoundError naming the root when there is no complete
        step (or no such step), and the errors of tensorstash.restore."""
        asked = None if step is None else _check_step(step)
        step = self._step_or_latest(step, collective=True)
        started = time.perf_counter()
        # tensorstash.restore's arguments, with its defaults (TypeError for unknown ones).
        args = inspect.signature(_restore_signature).bind(self.step_path(step), target, **kwargs)
        args.apply_defaults()
        if "share_reads" not in kwargs:  # the manager's setting, unless the call gives one
            args.arguments["share_reads"] = self.share_reads
        share_stats = args.arguments["stats"] if args.arguments["stats"] is not None else {}
        args.arguments["stats"] = share_stats
        if self._multi:
            fallback = asked is None or asked == self._last_latest
            return self._restore_tiered(step, target, args, started, fallback)
        # Without a local tier a restore is not collective (a process may restore alone), so
        # only a single process can decide alone to fall back.
        single = self._coordinator is None or self._coordinator.process_count() == 1
        candidates = [step]
        if single and (asked is None or asked == self._ext.latest_step()):
            candidates = [s for s in reversed(self.all_steps()) if s <= step] or [step]

        def attempt(candidate: int):
            args.arguments["path"] = self.step_path(candidate)
            kwargs = args.arguments
            share = _share_setup(self.step_path(candidate), kwargs["share_reads"],
                                 kwargs["coordinator"] or self._coordinator)
            if share is not None:
                share = (*share, self._coordination_timeout)
            # Through the store the manager opened, not by reopening the root's path.
            with contextlib.closing(self._ext.open_step(
                    candidate, verify_checksums=kwargs["verify_checksums"],
                    max_inflight_bytes=kwargs["max_inflight_bytes"],
                    io_threads=kwargs["io_threads"], map_spans=kwargs["mmap"],
                    share=share)) as reader:
                return _restore(*args.args, reader=reader, **args.kwargs), None

        step, (tree, nbytes), _ = self._first_that_restores(
            step, candidates, attempt, lambda _candidate, _handle, word: [word])
        stats = RestoreStats(step=step, bytes=nbytes, seconds=time.perf_counter() - started,
                             bytes_from={"local": 0, "peer": 0, "persistent": nbytes},
                             seconds_from={"local": 0.0, "peer": 0.0,
                                           "persistent": time.perf_counter() - started},
                             shared=dict(share_stats) if share_stats.get("shared") else None)
        self._restored(stats)
        return tree

    def _first_that_restores(self, asked: int, candidates: list[int], attempt: Callable,
                             agree: Callable) -> tuple[int, Any, Any]:
        """Restores the first of `candidates` (newest first) that every process restores whole:
        attempt(step) -> (result, handle) reads it in this process; agree(step, handle, word)
        -> every process's word (collective: "" when that process read everything), so that
        all of them give up, or all try the next step, together. Only a failure that says the
        step's bytes are bad (_is_data_error) in every process that failed moves on, with a
        warning naming the step and why; any other is raised in every process (this process's
        own error, else an OSError naming the processes that failed). Returns (step, result,
        handle)."""
        for i, candidate in enumerate(candidates):
            result, handle, error, word = None, None, None, ""
            try:
                result, handle = attempt(candidate)
            except Exception as e:  # noqa: BLE001 - every process must hear of it (below)
                error = e
                word = f"{'data' if _is_data_error(e) else 'other'}:{type(e).__name__}: {e}"
            failed = {p: w for p, w in enumerate(agree(candidate, handle, word)) if w}
            if not failed:
                return candidate, result, handle
            why = "; ".join(f"process {p}: {w.split(':', 1)[1]}" for p, w in failed.items())
            if i + 1 == len(candidates) or not all(w.startswith("data:")
                                                   for w in failed.values()):
                if error is not None:
                    raise error
                raise OSError(f"restoring step {candidate} from {self.root} failed in other "
                              f"processes: {why}")
            self._skipped(asked, candidate, why, candidates[i + 1])
        raise AssertionError("unreachable: the last candidate returns or raises")

    def _skipped(self, asked: int, step: int, why: str, instead: int) -> None:
        """Logs that `step` did not restore whole, and records what `asked` now means."""
        self.logger.warning("tensorstash: step %d in %s does not restore whole (%s); trying "
                            "step %d, the next older one", step, self.root, why, instead)
        self._redirected[asked] = instead
        self._last_latest = instead

    def _restore_tiered(self, step: int, target: Any, args: Any, started: float,
                        fallback: bool) -> Any:
        """restore() with a local tier (collective), through the engine's MultiTierManager:
        open_restore picks each chunk's cheapest intact holder of the chosen save; then every
        process says how its read ended (finish_restore), so that no process drops or rewrites a
        holding (its write-back, its next local save) while another still reads it, and so that
        all of them give up, or all try the next older step (`fallback`), together; then the
        engine heals this node's copy from the host buffers it restored into (never a copy back
        from the devices) and removes the holdings of abandoned saves."""
        kwargs = dict(args.arguments)
        kwargs.pop("path"), kwargs.pop("target")
        candidates = [step]
        if fallback:
            candidates = [s for s in reversed(self._ext.restorable_steps()) if s <= step] or [step]
        as_stored = {}  # by TieredRestore: whether its host buffers are the arrays as stored
        wrote_back = [False]

        def attempt(candidate: int):
            opened = self._ext.open_restore(candidate, verify_checksums=kwargs["verify_checksums"],
                                            max_inflight_bytes=kwargs["max_inflight_bytes"],
                                            io_threads=kwargs["io_threads"])
            with contextlib.closing(opened.reader) as reader:
                tree, _ = _restore(self.step_path(candidate), target, reader=reader, **kwargs)
                as_stored[id(opened)] = _as_stored(target, reader.arrays())
                return (tree, reader.tier_stats()), opened

        def agree(_candidate: int, opened: Any, word: str) -> list[str]:
            words, wrote_back[0] = self._ext.finish_restore(
                opened, word, as_stored=as_stored.get(id(opened), False), codec=self.codec,
                zstd_level=self.zstd_level)
            return words

        step, (tree, tier), restore = self._first_that_restores(step, candidates, attempt, agree)
        for problem in tier["open_errors"] + tier["failures"]:
            self.logger.warning("tensorstash: restoring step %d: %s", step, problem)
        self._restored_from_tiers[step] = restore
        if ((tier["local_failed"] or tier["bytes"]["peer"] or tier["bytes"]["persistent"])
                and not wrote_back[0]):
            if not kwargs["verify_checksums"]:
                # The bytes were not checked: written back with fresh CRCs they would pass for
                # good ones in the next restore, which prefers this node's copy.
                self.logger.info("tensorstash: step %d restored without checksum verification: "
                                 "this node's copy is not rewritten", step)
            elif not as_stored.get(id(restore), False):
                self.logger.info("tensorstash: step %d restored into other dtypes, shapes or a "
                                 "part of the arrays: this node's copy is not rewritten", step)
        stats = RestoreStats(step=step, bytes=sum(tier["bytes"].values()),
                             seconds=time.perf_counter() - started,
                             bytes_from=dict(tier["bytes"]), seconds_from=dict(tier["seconds"]),
                             failures=tuple(tier["failures"]))
        self._restored(stats)
        return tree

    def _restored(self, stats: RestoreStats) -> None:
        step = stats.step
        self.last_restore_stats = stats
        self.logger.info("restored step %d: %s in %.2f s (%.2f GB/s)%s", step,
                         _format_bytes(stats.bytes), stats.seconds, stats.gbps,
                         "".join(f", {t} {_format_bytes(n)}" for t, n in stats.bytes_from.items()
                                 if n and len(stats.bytes_from) > 1))
        if self.on_restore is not None:
            try:
                self.on_restore(stats)
            except Exception:  # noqa: BLE001
                self.logger.exception("tensorstash: the on_restore callback of step %d failed",
                                      step)

    def metadata(self, step: int | None = None) -> Any:
        """The `metadata` saved with `step` (None: the latest), or None when it had none.
        FileNotFoundError when there is no such complete step, OSError when the file is
        damaged."""
        extras = self._restored_extras(step)
        data = extras.metadata if extras is not None else self._read_file(step,
                                                                          _ext.METADATA_FILE)
        return None if data is None else json.loads(data.decode("utf-8"))

    def metrics(self, step: int | None = None) -> dict[str, float] | None:
        """The `metrics` saved with `step` (None: the latest), or None when it had none."""
        data = self._read_file(step, _ext.METRICS_FILE)
        return None if data is None else json.loads(data.decode("utf-8"))

    def per_process(self, step: int | None = None, process_index: int | None = None) -> Any:
        """The `per_process` value that process `process_index` (default: this one) saved with
        `step` (None: the latest): bytes as bytes, anything else as its JSON round trip; None
        when it saved none."""
        index = self._process_index if process_index is None else int(process_index)
        extras = self._restored_extras(step) if index == self._process_index else None
        if extras is not None:
            data = extras.per_process
        else:
            data = self._read_file(step, _ext.process_state_file_name(index))
        return None if data is None else _decode_per_process(data)

    def _restored_extras(self, step: int | None) -> Any:
        """What the last multi-tier restore of `step` read besides the arrays, or None."""
        if not self._multi:
            return None
        return self._restored_from_tiers.get(self._step_or_latest(step))

    def _step_or_latest(self, step: int | None, collective: bool = False) -> int:
        """`step`, or the latest step. With a local tier the latest is collective
        (latest_step()) only for `collective` callers (restore, which every process calls);
        the others (metadata, per_process, ...) take the one the last latest_step() found, else
        the persistent tier's; for them a step that did not restore whole means the step that
        restore() took instead."""
        if step is not None:
            step = _check_step(step)
            return step if collective else self._redirected.get(step, step)
        if self._multi and not collective:
            latest = self._last_latest if self._last_latest is not None else \
                self._ext.latest_step()
        else:
            latest = self.latest_step()
        if latest is None:
            raise FileNotFoundError(f"no complete checkpoint step in {self.root}")
        return latest if collective else self._redirected.get(latest, latest)

    def _read_file(self, step: int | None, name: str) -> bytes | None:
        step = self._step_or_latest(step)
        # FileNotFoundError if the step is absent; closed at once, not when garbage collected.
        # Read through the store the manager opened, not by reopening the root's path.
        with contextlib.closing(self._ext.open_step(step)) as reader:
            try:
                return reader.read_file(name)
            except FileNotFoundError:  # the step has no such file
                return None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"CheckpointManager({self.root!r}, {state})"


def _close_quietly(manager: _ext.Manager) -> None:
    """Closes a manager that was not closed; its error (a failed background save) is logged."""
    try:
        manager.close()
    except Exception:  # noqa: BLE001 - nobody is left to raise it to
        logging.getLogger("tensorstash").exception("tensorstash: closing an unclosed manager")


# The signature of CheckpointManager(...) is its __init__'s (not __new__'s, which only picks the
# class of the root's format).
CheckpointManager.__signature__ = inspect.Signature(
    list(inspect.signature(CheckpointManager.__init__).parameters.values())[1:])


def _check_counts(**values: Any) -> None:
    """ValueError naming the first of the manager's count options that is set and is not a
    positive int (both managers, native and Orbax steps, check theirs here)."""
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, not {value!r}")


def _check_best(best_metric: str | None, max_to_keep: int | None) -> None:
    if best_metric is not None and max_to_keep is None:
        raise ValueError("best_metric needs max_to_keep (how many of the best steps to keep)")


def _root_format(root: str | os.PathLike, format: str) -> str:
    """The format of the steps a manager of `root` handles: "native" or "orbax", from `format`
    ("auto", "native", "orbax") and what the root holds (_orbax_steps.detect_format). ValueError
    for an unknown format or a root of the other format, never an empty listing."""
    if format not in ("auto", "native", "orbax"):
        raise ValueError(f"unknown format {format!r}; use 'auto', 'native' or 'orbax'")
    text = _paths.abspath(root)
    # On a store URL too: an Orbax root on gs:// must not look like an empty native one.
    found = _orbax_steps.detect_format(text)
    if format != "auto" and found is not None and found != format:
        raise ValueError(f"{text} holds {found} steps, not {format} ones: open it with "
                         f"format={found!r} or format='auto'")
    return found or ("orbax" if format == "orbax" else "native")


# Roots of Orbax steps that a manager of this process has open (_OrbaxRunManager's lock).
_OPEN_ORBAX_ROOTS: set[str] = set()
_OPEN_ORBAX_ROOTS_LOCK = threading.Lock()


# Sequence numbers of the coordinated operations of _OrbaxRunManager (saves, preemption
# checks): the same in every process, which calls them in the same order.
_ORBAX_MANAGER_OPS = itertools.count()


def _next_orbax_manager_op() -> str:
    return f"tensorstash-orbax-manager/{next(_ORBAX_MANAGER_OPS)}"


def _release_orbax_root(root: str) -> None:
    with _OPEN_ORBAX_ROOTS_LOCK:
        _OPEN_ORBAX_ROOTS.discard(root)


def _detached_copy(x: Any) -> Any:
    """A leaf that a background save may read while the caller goes on: NumPy arrays copied,
    jax.Arrays copied on their devices (the caller may delete or donate the original), other
    leaves as they are."""
    if isinstance(x, np.ndarray):
        return np.array(x, copy=True)
    if type(x).__module__.startswith("jax") and hasattr(x, "copy"):
        return x.copy()
    return x


class _OrbaxRunManager(CheckpointManager):
    """CheckpointManager of a root of Orbax steps (format="orbax", or detected): the naming and
    listing policy of _orbax_steps, the Orbax writer of save(format="orbax") with the manager's
    metrics as a JSON item, the engine's retention policy (_ext.steps_to_delete) and one
    background thread for async saves. CheckpointManager's docstring says what differs."""

    def __init__(self, root: str | os.PathLike, *, max_to_keep: int | None = None,
                 keep_period: int | None = None, save_interval_steps: int = 1,
                 best_metric: str | None = None, best_mode: str = "min", async_save: bool = True,
                 handle_sigterm: bool = False, max_staging_bytes: int | None = None,
                 copy_host_jax_arrays: bool = True, codec: str | None = None,
                 zstd_level: int = _options.ZSTD_LEVEL, chunk_bytes: int = _options.CHUNK_BYTES,
                 data_file_bytes: int = _options.DATA_FILE_BYTES,
                 max_inflight_bytes: int = _options.MAX_INFLIGHT_BYTES,
                 io_threads: int = 0, sync: bool = True, coordinator: Any = None,
                 on_save: Callable[[SaveStats], Any] | None = None,
                 on_restore: Callable[[RestoreStats], Any] | None = None,
                 logger: logging.Logger | None = None, local_dir: str | os.PathLike | None = None,
                 local_save_interval_steps: int = 1, local_max_to_keep: int = 1,
                 local_server_address: str | None = None, local_server_port: int = 0,
                 coordination_timeout: float = _options.COORDINATION_TIMEOUT_S,
                 format: str = "auto", step_prefix: str | None = None,
                 step_format_fixed_length: int | None = None, incremental: bool = False,
                 share_reads: bool | None = None):
        if incremental:
            raise NotImplementedError("incremental steps are native steps: not available for a "
                                      "root of Orbax steps")
        # (Orbax steps read as without sharing: share_reads is accepted and has no effect.)
        del max_staging_bytes, copy_host_jax_arrays, chunk_bytes, data_file_bytes
        del local_save_interval_steps, local_max_to_keep, local_server_address
        del local_server_port, format, share_reads
        if not coordination_timeout > 0:
            raise ValueError(f"coordination_timeout must be > 0, not {coordination_timeout!r}")
        _check_counts(max_to_keep=max_to_keep, keep_period=keep_period,
                      save_interval_steps=save_interval_steps,
                      step_format_fixed_length=step_format_fixed_length)
        _check_best(best_metric, max_to_keep)
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {best_mode!r}")
        if codec not in (None, "zstd"):
            raise ValueError(f"Orbax steps store zstd chunks; codec {codec!r} is not available")
        if local_dir is not None:
            raise NotImplementedError("local_dir is not available for a root of Orbax steps")
        if coordinator is None:
            coordinator = _default_coordinator()
        # Several processes: each writes what it owns (save(format="orbax")'s multi-process
        # writer), process 0 applies retention and tells the others, and reached_preemption()
        # is agreed on. One process: no coordination at all.
        self._coordinator = (coordinator if coordinator is not None
                             and coordinator.process_count() > 1 else None)
        self._process_index = (self._coordinator.process_index()
                               if self._coordinator is not None else 0)
        self._timeout_ms = int(coordination_timeout * 1000)
        if step_prefix is not None and (not step_prefix or "/" in step_prefix):
            raise ValueError(f"step_prefix must be a non-empty folder name, not {step_prefix!r}")
        self.root = _paths.abspath(root)
        self.format = "orbax"
        self.async_save = bool(async_save)
        self.codec = "zstd"
        self.zstd_level = zstd_level
        self.logger = logger if logger is not None else logging.getLogger("tensorstash")
        self.on_save = on_save
        self.on_restore = on_restore
        self.last_save_stats: SaveStats | None = None
        self.last_restore_stats: RestoreStats | None = None
        self._closed = False
        self._max_to_keep = max_to_keep or 0
        self._keep_period = keep_period or 0
        self._interval = save_interval_steps
        self._best_metric = best_metric
        self._best_mode = best_mode
        self._io_threads = io_threads
        self._sync = sync
        del max_inflight_bytes  # the Orbax writer's own default
        with _OPEN_ORBAX_ROOTS_LOCK:
            if self.root in _OPEN_ORBAX_ROOTS:
                raise ValueError(f"{self.root} is locked by another manager in this process")
            _OPEN_ORBAX_ROOTS.add(self.root)
        self._finalizer = weakref.finalize(self, _release_orbax_root, self.root)
        # On a store URL the steps are listed and restored; saving needs folder renames and
        # removals that this manager does with os calls (a follow-up: through the store).
        self._url = _ext.has_url_scheme(self.root)
        if not self._url:
            os.makedirs(self.root, exist_ok=True)
        if step_prefix is not None or step_format_fixed_length is not None:
            self._names = _orbax_steps.StepNames(step_prefix, step_format_fixed_length)
        else:
            self._names = _orbax_steps.infer_names(self.root)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "tensorstash-orbax-save")
        self._inflight: concurrent.futures.Future | None = None
        self._preempted = threading.Event()
        self._old_sigterm = None
        self._handle_sigterm = bool(handle_sigterm)
        if handle_sigterm:
            self._old_sigterm = signal.signal(signal.SIGTERM,
                                              lambda *_: self._preempted.set())

    # --- saving -----------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, metadata: Any = None, per_process: Any = None,
             metrics: dict[str, float] | None = None, force: bool = False) -> bool:
        started = time.perf_counter()
        self._check_open()
        step = _check_step(step)
        if not force and not self.should_save(step):
            return False
        if self._url:
            raise NotImplementedError(
                f"saving Orbax steps to {self.root} is not available: a manager of Orbax steps "
                "on a store URL lists and restores them only. Save Orbax steps to a local "
                "folder, or native steps (format='native') to a new URL root")
        if metadata is not None or per_process is not None:
            raise NotImplementedError("Orbax steps hold no `metadata` or `per_process` of "
                                      "tensorstash's; save them as items of a native root")
        metrics_dict = {}
        for name, value in (metrics or {}).items():
            name = str(name)
            _tree.check_text(name, f"the metric name {name!r}")
            metrics_dict[name] = float(value)
        self.wait_until_finished()  # at most one save in flight; raises its error
        if step in self._steps():
            raise FileExistsError(f"step {step} of {self.root} is already complete")
        json_items = ()
        if metrics_dict:
            json_items = ((_orbax_steps.METRICS_ITEM, _orbax_steps.METRICS_ITEM,
                           json.dumps(metrics_dict)),)
        # Keys of this save's coordination, taken here (the caller's thread): every process
        # calls save() in the same order, a background thread would not take them in order.
        op = _next_orbax_manager_op()
        if self.async_save:
            state = _tree.map_target(state, lambda _path, x: _detached_copy(x))
            blocking = time.perf_counter() - started
            self._inflight = self._pool.submit(self._write, step, state, json_items, started,
                                               blocking, op)
        else:
            self._write(step, state, json_items, started, None, op)
        return True

    def _write(self, step: int, state: Any, json_items: tuple, started: float,
               blocking: float | None, op: str) -> None:
        """Writes and commits `step` (the background thread's job for an async save), then
        applies retention and reports the stats."""
        name = self._names.name(step)
        engine = _save_orbax(self.root, name, state, overwrite=False, codec=None,
                             zstd_level=self.zstd_level, io_threads=self._io_threads,
                             sync=self._sync, coordinator=self._coordinator,
                             item=_orbax_steps.DEFAULT_ITEM, json_items=json_items)
        total = time.perf_counter() - started
        stored = 0
        for folder, _dirs, files in os.walk(os.path.join(self.root, name)):
            stored += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
        self._retain(op)
        stats = SaveStats(step=step, async_save=blocking is not None,
                          raw_bytes=int(engine["raw_bytes"]), stored_bytes=stored,
                          blocking_s=total if blocking is None else blocking, total_s=total)
        self.last_save_stats = stats
        self.logger.info("saved step %d: %s in %.2f s (%.2f GB/s), blocked %.0f ms", step,
                         _format_bytes(stats.raw_bytes), stats.total_s, stats.gbps,
                         stats.blocking_s * 1e3)
        if self.on_save is not None:
            try:
                self.on_save(stats)
            except Exception:  # noqa: BLE001 - a callback must not break the save
                self.logger.exception("tensorstash: the on_save callback of step %d failed",
                                      step)

    def _retain(self, op: str) -> None:
        """Retention after a committed save: by this process alone, or with several processes
        by process 0, which tells the others its outcome so that each save() returns (or raises)
        with the same steps listed in every process."""
        if self._coordinator is None:
            self._apply_retention()
            return
        key = f"{op}/retained"
        if self._process_index == 0:
            try:
                self._apply_retention()
            except BaseException as e:
                self._coordinator.key_value_set(key, f"{type(e).__name__}: {e}")
                raise
            self._coordinator.key_value_set(key, "ok")
            return
        outcome = self._coordinator.key_value_get(key, self._timeout_ms)
        if outcome != "ok":
            raise RuntimeError(f"process 0 could not apply retention to {self.root}: {outcome}")

    def _apply_retention(self) -> None:
        """Deletes the steps that the engine's retention policy drops: each renamed to a
        temporary name first (which neither Orbax nor this manager lists), then removed, so
        that a crash halfway never leaves a partial step listed."""
        if not self._max_to_keep:
            return
        steps = self._steps()
        metrics = {}
        if self._best_metric is not None:
            for step, path in steps.items():
                value = (_orbax_steps.read_metrics(path) or {}).get(self._best_metric)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metrics[step] = float(value)
        doomed = _ext.steps_to_delete(set(steps), metrics, max_to_keep=self._max_to_keep,
                                      keep_period=self._keep_period,
                                      by_metric=self._best_metric is not None,
                                      best_mode=self._best_mode)
        for step in doomed:
            path = steps[step]
            aside = f"{path}{_orbax_steps.TMP_MARKER}-deleted-{uuid.uuid4().hex[:16]}"
            os.rename(path, aside)
            shutil.rmtree(aside)

    def should_save(self, step: int) -> bool:
        return _check_step(step) % self._interval == 0

    def reached_preemption(self, step: int) -> bool:
        _check_step(step)
        mine = self._preempted.is_set()
        if self._coordinator is None or not self._handle_sigterm:
            return mine
        # Every process answers the same: True when a SIGTERM reached any of them.
        key = f"{_next_orbax_manager_op()}/preempted/"
        self._coordinator.key_value_set(f"{key}{self._process_index}", "1" if mine else "0")
        return any(self._coordinator.key_value_get(f"{key}{p}", self._timeout_ms) == "1"
                   for p in range(self._coordinator.process_count()))

    def wait_until_finished(self) -> None:
        self._check_open()
        self._wait()

    def _wait(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()

    def _close(self, drop_coordinator_keys: bool) -> None:
        # close() and __exit__ both come here, as for native roots. Dropping a torch
        # coordinator's keys is left to the native manager: Orbax-format torch jobs do not exist yet.
        if self._closed:
            return
        self._closed = True
        try:
            self._wait()
        finally:
            self._pool.shutdown(wait=True)
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None
            self._finalizer()

    # --- steps ------------------------------------------------------------------------------

    def _steps(self) -> dict[int, str]:
        return _orbax_steps.list_steps(self.root, self._names)

    def all_steps(self) -> list[int]:
        return sorted(self._steps())

    def local_steps(self) -> list[int]:
        return []

    def latest_step(self) -> int | None:
        return max(self._steps(), default=None)

    def damaged_steps(self) -> dict[int, str]:
        return {}

    def retired_steps(self) -> list[int]:
        return []

    def step_path(self, step: int) -> str:
        step = _check_step(step)
        return self._steps().get(step) or _orbax_steps.join(self.root, self._names.name(step))

    def _existing_step(self, step: int | None) -> tuple[int, str]:
        steps = self._steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no complete checkpoint step in {self.root}")
            step = max(steps)
        step = _check_step(step)
        if step not in steps:
            raise FileNotFoundError(f"step {step} is not a complete step of {self.root} "
                                    f"(steps: {sorted(steps)})")
        return step, steps[step]

    # --- restoring --------------------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None, **kwargs) -> Any:
        """Restores `step` (None: the latest): the tree of a step of one item, a dict of items
        by name for a step of several (the "metrics" item left out); `target` for several
        items is a dict of targets by item name. No fallback to an older step."""
        started = time.perf_counter()
        step, step_dir = self._existing_step(step)
        found = {n: kind for n, kind in _orbax_steps.items(step_dir).items()
                 if n != _orbax_steps.METRICS_ITEM}
        nbytes = [0]

        def restore_item(path: str, item_target: Any) -> Any:
            args = inspect.signature(_restore_signature).bind(path, item_target, **kwargs)
            args.apply_defaults()
            tree, _ = _restore(*args.args, **args.kwargs)
            # The bytes of the arrays restored (what the reader counts differs by format).
            _tree.map_target(tree, lambda _p, x: nbytes.__setitem__(
                0, nbytes[0] + int(getattr(x, "nbytes", 0))))
            return tree

        if not found:  # the step folder is itself the checkpoint (no items)
            tree = restore_item(step_dir, target)
        elif len(found) == 1:
            (name, kind), = found.items()
            item_dir = _orbax_steps.join(step_dir, name)
            tree = (_orbax_steps.read_json_item(item_dir) if kind == "json"
                    else restore_item(item_dir, target))
        else:
            if target is not None and not (isinstance(target, dict)
                                           and set(target) <= set(found)):
                raise ValueError(f"step {step} of {self.root} holds the items {sorted(found)}: "
                                 "the target is a dict of targets by item name")
            tree = {}
            for name, kind in found.items():
                item_dir = _orbax_steps.join(step_dir, name)
                tree[name] = (_orbax_steps.read_json_item(item_dir) if kind == "json"
                              else restore_item(item_dir, (target or {}).get(name)))
        seconds = time.perf_counter() - started
        self._restored(RestoreStats(step=step, bytes=nbytes[0], seconds=seconds,
                                    bytes_from={"local": 0, "peer": 0, "persistent": nbytes[0]},
                                    seconds_from={"local": 0.0, "peer": 0.0,
                                                  "persistent": seconds}))
        return tree

    def metadata(self, step: int | None = None) -> Any:
        """The step's Orbax custom_metadata, or None when it has none."""
        _, step_dir = self._existing_step(step)
        custom = _orbax_steps.checkpoint_metadata(step_dir).get("custom_metadata")
        return custom or None

    def metrics(self, step: int | None = None) -> dict[str, float] | None:
        _, step_dir = self._existing_step(step)
        return _orbax_steps.read_metrics(step_dir)

    def per_process(self, step: int | None = None, process_index: int | None = None) -> Any:
        self._existing_step(step)
        return None
