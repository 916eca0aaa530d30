"""PyTorch adapter: torch.Tensor and DTensor leaves, and a Coordinator over torch.distributed.

Registered by tensorstash._adapters once torch is imported (tensorstash never imports torch
itself). Tensors are saved by their bytes (every dtype of DTYPES, bit-exact), DTensors as the
boxes of their local shards, computed from their placements (Shard, Replicate, _StridedShard,
uneven shards); a restore makes new tensors like the target's (dtype, device, placements), and
load() copies a checkpoint into a state dict in place:

    tensorstash.save(path, {"model": model.state_dict(), "optim": opt.state_dict()})
    tensorstash.torch.load(path, {"model": model.state_dict(), "optim": opt.state_dict()})

With torch.distributed initialized and several processes, a save or a CheckpointManager takes
a TorchCoordinator over the default process group's store (no collectives).
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

from . import numpy as tnp

# torch dtype -> the engine's name (tensorstash.numpy.DTYPE_NAMES); the same byte layouts as
# the NumPy/ml_dtypes types of those names.
DTYPES: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.uint8: "uint8", torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64",
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
    torch.float64: "float64", torch.complex64: "complex64", torch.complex128: "complex128",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz", torch.float8_e5m2fnuz: "float8_e5m2fnuz",
    torch.float8_e8m0fnu: "float8_e8m0fnu",
}
_BY_NAME: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPES.items()}

# Why the dtypes torch has beyond DTYPES are refused (the engine has no type of their layout).
_REFUSED_WHY = {
    "complex32": "the engine has no complex type of two float16",
    "float4_e2m1fn_x2": "it packs two values per byte, so its shape is not the values'",
}


def dtype_name(dtype: torch.dtype, path: str | None = None) -> str:
    """The engine's name of torch dtype `dtype`; TypeError naming `path` (when given) for a
    dtype the engine does not store (complex32, float4_e2m1fn_x2, the bit and quantized types,
    the sub-byte integer shells)."""
    name = DTYPES.get(dtype)
    if name is None:
        short = str(dtype).removeprefix("torch.")
        why = _REFUSED_WHY.get(short, "the engine has no type of its layout")
        where = f" at {path!r}" if path is not None else ""
        raise TypeError(f"cannot store the torch.{short} tensor{where}: {why}; supported: "
                        f"{', '.join('torch.' + str(d).removeprefix('torch.') for d in DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of engine dtype name `name`; TypeError for one torch does not have."""
    dtype = _BY_NAME.get(name)
    if dtype is None:
        raise TypeError(f"torch has no dtype for the engine's {name!r}")
    return dtype


def _dtensor_class() -> Any:
    """torch's DTensor class, or None where torch.distributed.tensor was never imported (then
    no DTensor exists: looking it up costs no import)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(x: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(x, cls)


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 NumPy view of CPU tensor `t`'s elements in C order (a copy only when `t` is
    not contiguous). reshape(-1) first: a 0-d tensor cannot be viewed as another dtype."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _from_buffer(buffer: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor of `dtype` and `shape` over NumPy array `buffer`'s memory (no copy)."""
    flat = np.ascontiguousarray(buffer).reshape(-1).view(np.uint8)
    return torch.from_numpy(flat).view(dtype).reshape(shape)


# ---------------------------------------------------------------------------------------------
# DTensor layouts: which global indices this rank's local shard holds, per tensor dimension.


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """[(local start, global start, length)] of the consecutive stretches of `indices` (the
    global index of each local position, in local order)."""
    out: list[tuple[int, int, int]] = []
    for local, g in enumerate(indices):
        if out and out[-1][1] + out[-1][2] == g:
            start_local, start_global, n = out[-1]
            out[-1] = (start_local, start_global, n + 1)
        else:
            out.append((local, g, 1))
    return out


_layout_cache: dict[tuple, tuple] = {}
_layout_lock = threading.Lock()


def _dim_indices(mesh: Any, placements: tuple, dim: int, size: int) -> list[int]:
    """The global indices of tensor dimension `dim` (of `size`) that this rank holds under
    `placements`, in local order. Computed by torch itself (distribute_tensor of an arange
    with src_data_rank=None shards it locally, with no communication), so that uneven and
    strided layouts come out as torch lays them out: DTensor's own chunk list is wrong for
    _StridedShard (it reports rows 0-3 for the local rows 0, 1, 4, 5)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    mapped = []
    for p in placements:
        if isinstance(p, _StridedShard) and p.dim == dim:
            mapped.append(_StridedShard(0, split_factor=p.split_factor))
        elif isinstance(p, Shard) and not isinstance(p, _StridedShard) and p.dim == dim:
            mapped.append(Shard(0))
        else:
            mapped.append(Replicate())
    if all(isinstance(p, Replicate) for p in mapped):
        return list(range(size))
    device = getattr(mesh, "device_type", "cpu")
    arange = torch.arange(size, dtype=torch.int64, device=device)
    local = distribute_tensor(arange, mesh, mapped, src_data_rank=None).to_local()
    return [int(i) for i in local.cpu().tolist()]


def _layout(x: Any) -> tuple:
    """(boxes, replica id, replica count) of DTensor (or DTensor target) `x` on this rank:
    boxes [((origin, shape), local slices)], one per product of the stretches of global
    indices its local shard holds per dimension (one box unless a dimension is strided),
    empty boxes left out. Cached per mesh, placements and shape."""
    shape = tuple(int(n) for n in x.shape)
    mesh, placements = x.device_mesh, tuple(x.placements)
    key = (mesh, placements, shape)
    with _layout_lock:
        hit = _layout_cache.get(key)
    if hit is not None:
        return hit
    from torch.distributed.tensor import Replicate
    per_dim = [_runs(_dim_indices(mesh, placements, d, n)) for d, n in enumerate(shape)]
    boxes = []
    for combo in itertools.product(*per_dim):
        extent = tuple(n for _, _, n in combo)
        if shape and math.prod(extent) == 0:
            continue
        origin = tuple(g for _, g, _ in combo)
        slices = tuple(slice(lo, lo + n) for lo, _, n in combo)
        boxes.append(((origin, extent), slices))
    # Replicas: the mesh dimensions over which the placements replicate.
    coordinate = mesh.get_coordinate()
    replica_id, replica_count = 0, 1
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            size = mesh.size(mesh_dim)
            replica_id = replica_id * size + (coordinate[mesh_dim] if coordinate else 0)
            replica_count *= size
    out = (boxes, replica_id, replica_count)
    with _layout_lock:
        _layout_cache[key] = out
    return out


def _local_shape(x: Any) -> tuple[int, ...]:
    """The shape of the local shard of DTensor target `x` on this rank."""
    return tuple(int(n) for n in x.to_local().shape)


# ---------------------------------------------------------------------------------------------


def _local_of(x: Any) -> torch.Tensor:
    """The tensor holding this rank's data of `x`: a DTensor's local shard, else `x`."""
    return x.to_local() if is_dtensor(x) else x


class _HostCopy:
    """A pinned host copy of a device tensor's (local) data that start_save made for one save,
    complete once `done` has happened."""

    def __init__(self, leaf: Any, host: torch.Tensor, done: Any):
        self.leaf, self.host, self.done = leaf, host, done


class TorchAdapter:
    """Leaves that are torch.Tensor (nn.Parameter too) and DTensor; restore targets likewise.
    See tensorstash._adapters for the protocol."""

    def owns(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def check_savable(self, x: Any, path: str) -> None:
        if x.is_meta:
            raise TypeError(f"cannot save the tensor at {path!r}: it is on the meta device "
                            "(it has no data)")
        if x.layout != torch.strided:
            raise TypeError(f"cannot save the tensor at {path!r}: its layout {x.layout} is "
                            "not torch.strided (save t.to_dense())")
        if x.is_quantized:
            raise TypeError(f"cannot save the quantized tensor at {path!r} "
                            "(save t.dequantize() or t.int_repr())")
        dtype_name(x.dtype, path)
        if is_dtensor(x):
            from torch.distributed.tensor import Partial
            if any(isinstance(p, Partial) for p in x.placements):
                raise TypeError(f"cannot save the DTensor at {path!r}: its placements "
                                f"{tuple(x.placements)} hold partial values (reduce it "
                                "first: x.redistribute(placements=[Replicate()...]))")

    def dtype_name(self, x: Any) -> str:
        return dtype_name(x.dtype)

    def restore_dtype(self, target: Any) -> np.dtype:
        return tnp.dtype_from_name(dtype_name(target.dtype))

    def start_save(self, xs: list) -> list:
        """Starts the copies of every device (CUDA) tensor of one save into pinned host memory
        at once, queued on each device's current stream: after the work that computes the
        values (the values of the moment save() was called) and before any later work that
        changes them in place. save_shards waits for them (one event per device). Pinned
        memory comes from torch's caching host allocator, which reuses the blocks of earlier
        saves once their copies are dropped. CPU tensors are left as they are (their shards are
        views)."""
        out = list(xs)
        by_device: dict[Any, list[int]] = {}
        for i, x in enumerate(xs):
            local = _local_of(x)
            if local.device.type == "cuda":
                by_device.setdefault(local.device, []).append(i)
        for device, mine in by_device.items():
            with torch.cuda.device(device):
                copies = []
                for i in mine:
                    local = _local_of(xs[i]).detach()
                    host = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
                    host.copy_(local, non_blocking=True)
                    copies.append((i, host))
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(device))
            for i, host in copies:
                out[i] = _HostCopy(xs[i], host, done)
        return out

    def save_shards(self, x: Any, process_index: int, process_count: int):
        stable = False
        if isinstance(x, _HostCopy):  # a copy made for this save: nothing else changes it
            x.done.synchronize()
            x, local, stable = x.leaf, x.host, True
        else:
            local = _local_of(x)
            if local.device.type != "cpu":  # (a device tensor start_save did not copy)
                local, stable = local.cpu(), True
        shape = tuple(int(n) for n in x.shape)
        if not is_dtensor(x):
            # Every process holds the whole tensor: they share the writing as replicas.
            shards = [((0,) * len(shape), shape, _bytes_of(local), process_index, process_count)]
            return shape, shards, stable
        if math.prod(shape) == 0:  # nothing to write; every rank names the empty array
            return shape, [((0,) * len(shape), shape, np.empty(0, np.uint8), process_index,
                            process_count)], True
        boxes, replica_id, replica_count = _layout(x)
        shards = [(origin, extent, _bytes_of(local[slices]), replica_id, replica_count)
                  for (origin, extent), slices in boxes]
        return shape, shards, stable

    def restore_boxes(self, target: Any, shape: tuple[int, ...]) -> dict[Any, tuple]:
        if is_dtensor(target) and math.prod(shape) > 0:
            boxes, _, _ = _layout(target)
            return {box: box for box, _ in boxes}
        return {None: ((0,) * len(shape), shape)}

    def build(self, target: Any, shape: tuple[int, ...], buffers: dict[Any, Any]) -> Any:
        dtype = target.dtype
        if not is_dtensor(target):
            out = _from_buffer(buffers[None], dtype, shape)
            if target.device.type != "cpu":
                out = out.to(target.device)
            if isinstance(target, torch.nn.Parameter):
                out = torch.nn.Parameter(out, requires_grad=target.requires_grad)
            return out
        from torch.distributed.tensor import DTensor
        local_target = target.to_local()
        local_shape = tuple(int(n) for n in local_target.shape)
        if math.prod(shape) == 0:
            local = torch.empty(local_shape, dtype=dtype, device=local_target.device)
        else:
            boxes, _, _ = _layout(target)
            if len(boxes) == 1 and boxes[0][0][1] == local_shape:
                local = _from_buffer(buffers[boxes[0][0]], dtype, local_shape)
                if local_target.device.type != "cpu":
                    local = local.to(local_target.device)
            else:
                local = torch.empty(local_shape, dtype=dtype, device=local_target.device)
                for box, slices in boxes:
                    local[slices].copy_(_from_buffer(buffers[box], dtype, box[1]))
        return DTensor.from_local(local, target.device_mesh, tuple(target.placements),
                                  run_check=False, shape=target.shape, stride=target.stride())

    def restore_into(self, target: Any, shape: tuple[int, ...],
                     boxes: dict[Any, tuple]) -> dict[Any, np.ndarray] | None:
        """The target's own memory for its box, for an in-place load: a CPU tensor's, or a
        DTensor's local shard when it holds one box (its rows of a Shard placement, say), laid
        out contiguously; None for the others (CUDA, strided layouts, views with gaps): they
        are restored and then copied."""
        local = _local_of(target)
        if (local.device.type != "cpu" or not local.is_contiguous() or local.is_conj()
                or local.is_neg() or local.numel() == 0 or len(boxes) != 1):
            return None
        (key, (_, extent)), = boxes.items()
        if tuple(extent) != tuple(local.shape):
            return None
        return {key: local.detach().reshape(-1).view(torch.uint8).numpy()}

    def orbax_sharding(self, x: Any) -> None:
        return None  # recorded as NumPy arrays in Orbax's format

    def sharding_record(self, x: Any) -> dict | None:
        """The DTensor's mesh and placements (informative: a restore as saved gives NumPy
        arrays, as the record names no JAX sharding)."""
        if not is_dtensor(x):
            return None
        mesh = x.device_mesh
        names = getattr(mesh, "mesh_dim_names", None)
        return {"sharding_type": "DTensor", "shape": [int(n) for n in mesh.shape],
                "axis_names": list(names) if names else None,
                "placements": [str(p) for p in x.placements]}

    def default_coordinator(self) -> TorchCoordinator | None:
        return default_coordinator()


# ---------------------------------------------------------------------------------------------
# In-place loading.


def load(path: Any, state: Any, **restore_options: Any) -> Any:
    """Restores checkpoint `path` into `state` in place: every tensor (DTensor: its local
    shard) of `state` takes the checkpoint's values (cast to its dtype, on its device, under
    its placements); the other leaves of dicts and lists take the checkpoint's (an optimizer's
    param_groups). Returns `state`. Errors as tensorstash.restore with target=state (KeyError
    for a leaf the checkpoint lacks, ValueError for another shape), all raised before anything
    is read: `state` is then unchanged.

    CPU tensors laid out contiguously (a DTensor: its local shard, when it holds one box of the
    tensor, as under Shard and Replicate placements) are read straight into their own memory,
    each stored chunk with one read and no copy in between; the others (CUDA tensors, strided
    layouts) are restored into new memory and copied. So a read error (OSError: a damaged
    chunk, a file cut short) may leave some tensors partly overwritten: restore into new
    tensors (tensorstash.restore(path, target=state)) and copy them where that matters."""
    from ._restore import restore_in_place
    restored = restore_in_place(path, state, **restore_options)
    with torch.no_grad():
        _copy_into(state, restored)
    return state


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, dict):
        for k in dst:
            if _is_container(dst[k]) or isinstance(dst[k], torch.Tensor):
                _copy_into(dst[k], src[k])
            else:
                dst[k] = src[k]
    elif isinstance(dst, list):
        for i in range(len(dst)):
            if _is_container(dst[i]) or isinstance(dst[i], torch.Tensor):
                _copy_into(dst[i], src[i])
            else:
                dst[i] = src[i]
    elif isinstance(dst, tuple):
        for a, b in zip(dst, src):
            if _is_container(a) or isinstance(a, torch.Tensor):
                _copy_into(a, b)
    elif isinstance(dst, torch.Tensor):
        if src is dst:  # read in place
            return
        if is_dtensor(dst):
            dst.to_local().copy_(src.to_local())
        else:
            dst.copy_(src)


def _is_container(x: Any) -> bool:
    return isinstance(x, (dict, list, tuple))


# ---------------------------------------------------------------------------------------------
# torch.distributed as the coordinator.

_coordinator_counter = itertools.count()


class TorchCoordinator:
    """A Coordinator (the protocol of tensorstash.jax.JaxCoordinator) over the key-value store
    of torch.distributed's default process group.

    Waits poll the store (check(), never a blocking wait() holding the store's client), and
    barriers go through the store, never through collectives: a save may run in a background
    thread while the training thread issues collectives on the same group, and a collective
    from a second thread would desynchronize gloo or NCCL. Every process must create one per
    collective operation, in the same order: the keys of each instance carry a sequence number
    so that operations never reuse each other's keys. close() (collective) removes the
    instance's keys from the store once every process is done with them, so that a long job's
    saves do not pile keys up in the store."""

    def __init__(self, prefix: str | None = None, index: int | None = None,
                 count: int | None = None) -> None:
        # prefix/index/count: a coordinator of its own sequence and ranks (DCP's writer gives
        # one per save, named by its plan); by default the default group's ranks.
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed.init_process_group() has not been called")
        self._store = dist.distributed_c10d._get_default_store()
        self._index = dist.get_rank() if index is None else int(index)
        self._count = dist.get_world_size() if count is None else int(count)
        seq = next(_coordinator_counter) if prefix is None else prefix
        self._prefix = f"tensorstash/{seq}/"
        # The keys this process wrote (kv values, barrier counters): close() deletes them.
        self._keys: set[str] = set()
        self._keys_lock = threading.Lock()

    @property
    def prefix(self) -> str:
        """The prefix of every key this coordinator writes in the store."""
        return self._prefix

    def _wrote(self, *keys: str) -> None:
        with self._keys_lock:
            self._keys.update(keys)

    def process_index(self) -> int:
        return self._index

    def process_count(self) -> int:
        return self._count

    def _wait(self, key: str, timeout_ms: int, what: str) -> None:
        """Waits until `key` is set, polling with check(): a blocking store.wait() holds the
        process's store client for as long as it waits (probed: a set() from another thread
        of the process waited 5 s, the whole timeout, behind a wait() for that very key), so
        the main thread's exchanges of the next save would deadlock against the background
        thread's wait for the previous one until the timeout."""
        import torch.distributed as dist
        deadline = time.monotonic() + max(0, int(timeout_ms)) / 1000
        delay = 0.0005
        while True:
            try:
                if self._store.check([key]):
                    return
            except dist.DistStoreError as e:  # (how torch's stores report a timeout)
                raise TimeoutError(f"torch.distributed store: {what} {key!r}: {e}") from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"torch.distributed store: {what} {key!r} timed out after "
                                   f"{int(timeout_ms)} ms")
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.02)

    def barrier(self, name: str, timeout_ms: int) -> None:
        key = self._prefix + "barrier/" + name
        self._wrote(key, key + "/done")
        if self._store.add(key, 1) == self._count:
            self._store.set(key + "/done", b"1")
        self._wait(key + "/done", timeout_ms, "barrier")

    def key_value_set(self, key: str, value: str) -> None:
        full = self._prefix + "kv/" + key
        self._wrote(full)
        self._store.set(full, value.encode("utf-8", "surrogateescape"))

    def key_value_get(self, key: str, timeout_ms: int) -> str:
        full = self._prefix + "kv/" + key
        self._wait(full, timeout_ms, "waiting for key")
        return self._store.get(full).decode("utf-8", "surrogateescape")

    def key_value_try_get(self, key: str) -> str | None:
        """The value of `key`, or None when no process has set it yet, without waiting (one
        check(), and a get() only when the key is there)."""
        full = self._prefix + "kv/" + key
        if not self._store.check([full]):
            return None
        return self._store.get(full).decode("utf-8", "surrogateescape")

    def close(self, timeout_ms: int = 60_000) -> None:
        """Deletes this coordinator's keys from the store; collective: every process calls it
        once, after its last use of the coordinator. A key may be read by any process until
        all of them have finished the operation that wrote it, so each process deletes the
        keys it wrote only once every process has arrived here (then nobody reads them any
        more), and the last process to leave deletes the keys of this final meeting itself.
        TimeoutError (naming the key) when the others do not arrive within `timeout_ms`; the
        keys then stay."""
        arrived, done, left = (self._prefix + "close/" + k for k in ("arrived", "done", "left"))
        if self._store.add(arrived, 1) == self._count:
            self._store.set(done, b"1")
        self._wait(done, timeout_ms, "closing")
        with self._keys_lock:
            mine, self._keys = sorted(self._keys), set()
        for key in mine:
            self._store.delete_key(key)  # (False for a key another process deleted already)
        if self._store.add(left, 1) == self._count:
            for key in (arrived, done, left):
                self._store.delete_key(key)

    def drop_keys(self) -> int:
        """Deletes every key under this coordinator's prefix, whoever wrote it, for a caller
        that knows no process reads them any more (DCP's coordinator rank once it holds every
        rank's part: every rank finished its exchanges before handing its part over). Needs a
        store that lists its keys (TCPStore does); elsewhere deletes the keys this process
        wrote. Returns how many keys were deleted."""
        try:
            keys = [k for k in self._store.list_keys() if k.startswith(self._prefix)]
        except (RuntimeError, NotImplementedError, AttributeError):
            with self._keys_lock:
                keys = sorted(self._keys)
        with self._keys_lock:
            self._keys = set()
        return sum(1 for k in keys if self._store.delete_key(k))


def coordinator_address() -> str | None:
    """"host:port" of the TCPStore under torch.distributed's default process group (the rank 0
    host, which every process reaches), or None when torch.distributed is not initialized or
    its store is not a TCPStore. The manager's local tier picks the address its server
    listens on from it, as it does from JAX's coordinator."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # PrefixStores over the TCPStore
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host and port else None


def default_coordinator() -> TorchCoordinator | None:
    """A TorchCoordinator when torch.distributed is initialized with several processes, else
    None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return TorchCoordinator() if dist.get_world_size() > 1 else None


# ---------------------------------------------------------------------------------------------
# Nested trees and dotted state_dict names.
#
# A checkpoint's tree paths are its dict keys joined with '/': the torch state dict
# {"model": {"0.weight": t}} is saved at path "model/0.weight", the Flax-style tree
# {"model": {"0": {"weight": x}}} at "model/0/weight". A restore matches a target by those paths,
# so a tree saved in one form restores into a target of the same form; nest() and flatten()
# turn one form into the other (sharing the leaves, no copy).


def flatten(tree: Any, sep: str = ".") -> dict[str, Any]:
    """The flat dict of `tree`'s leaves named by their keys joined with `sep` (list and tuple
    positions as numbers, int keys as numbers): {"model": {"0": {"weight": x}}} ->
    {"model.0.weight": x}, the names tensorstash.export_safetensors gives. Leaves are
    everything but dicts, lists and tuples (empty ones are dropped); keys that already hold
    `sep` are kept as they are ({"model": {"0.weight": t}} -> {"model.0.weight": t}).
    ValueError naming both when two leaves join to the same name; TypeError for a key that
    is neither a str nor an int."""
    out: dict[str, Any] = {}
    origin: dict[str, tuple] = {}

    def walk(x: Any, keys: tuple) -> None:
        if isinstance(x, dict):
            items = x.items()
        elif isinstance(x, (list, tuple)):
            items = enumerate(x)
        else:
            name = sep.join(keys)
            if name in out:
                raise ValueError(f"flatten: {origin[name]!r} and {keys!r} both join to "
                                 f"{name!r}")
            out[name], origin[name] = x, keys
            return
        for k, v in items:
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"flatten: key {k!r} under {sep.join(keys)!r} is not a str "
                                f"or an int")
            walk(v, keys + (str(k),))

    walk(tree, ())
    return out


def nest(flat: Any, sep: str = ".") -> Any:
    """`flat` with every str key split at `sep` into nested dicts, at every depth of dicts:
    {"model.0.weight": t} and {"model": {"0.weight": t}} both -> {"model": {"0": {"weight": t}}},
    so nest(model.state_dict()) is a target for a tree saved from JAX/Flax, and
    tensorstash.torch.load(path, nest(sd)) fills the model's own tensors. Lists, tuples, int
    keys and leaves are kept as they are (an optimizer's state and param_groups). ValueError
    naming both when a name is a leaf and the prefix of another ("a" and "a.b") or appears
    twice, and for an empty part ("a..b", ".a")."""
    if not isinstance(flat, dict):
        return flat
    out: dict[Any, Any] = {}
    for key, value in flat.items():
        value = nest(value, sep)
        parts = key.split(sep) if isinstance(key, str) else [key]
        if any(p == "" for p in parts):
            raise ValueError(f"nest: {key!r} has an empty part between {sep!r}")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"nest: {sep.join(map(str, parts[:i + 1]))!r} is a leaf and "
                                 f"the prefix of {key!r}")
            node = child
        last = parts[-1]
        if last in node:
            if isinstance(node[last], dict) and isinstance(value, dict):
                _merge(node[last], value, key, sep)
                continue
            raise ValueError(f"nest: {key!r} is given twice, or is a leaf and the prefix of "
                             f"another name")
        node[last] = value
    return out


def _merge(dst: dict, src: dict, where: Any, sep: str) -> None:
    for k, v in src.items():
        if k in dst:
            if isinstance(dst[k], dict) and isinstance(v, dict):
                _merge(dst[k], v, f"{where}{sep}{k}", sep)
                continue
            raise ValueError(f"nest: {f'{where}{sep}{k}'!r} is given twice, or is a leaf and the "
                             f"prefix of another name")
        dst[k] = v


def __getattr__(name: str) -> Any:
    """StorageWriter and StorageReader (DCP's storage interfaces over tensorstash steps,
    torch_dcp.py): imported on first use, so that importing this module never imports
    torch.distributed.checkpoint."""
    if name in ("StorageWriter", "StorageReader"):
        from . import torch_dcp
        return getattr(torch_dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
