"""JAX adapter: shards of a jax.Array for the engine, per-device boxes of a sharding, assembly of
restored buffers into a jax.Array, and a Coordinator backed by JAX's distributed runtime."""

from __future__ import annotations

import collections
import functools
import itertools
import json
import math
from typing import Any

import jax
import numpy as np

from . import _options
from . import numpy as tnp


def box_of_index(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(origin, shape) of the block that a device index (a tuple of slices) selects."""
    origin, extent = [], []
    for dim, s in zip(shape, index):
        start, stop, step = s.indices(dim)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        origin.append(start)
        extent.append(max(0, stop - start))
    return tuple(origin), tuple(extent)


@functools.lru_cache(maxsize=4096)
def _shard_table(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict:
    """{device: ((origin, shape), replica count)} for this process's devices under `sharding`:
    each device's block, and how many devices (in all processes) hold that block. Computed once
    per sharding and shape (the leaves of a model repeat a few of each): a profile of saving
    4,000 arrays on 8 CPU devices spent 64,000 box_of_index calls, two per shard, doing it per
    array. Holds this process's devices only, so that its size does not grow with the job."""
    boxes = {device: box_of_index(index, shape)
             for device, index in sharding.devices_indices_map(shape).items()}
    counts = collections.Counter(boxes.values())
    return {device: (boxes[device], counts[boxes[device]])
            for device in sharding.addressable_devices}


def shards_of(array: jax.Array) -> list[tuple]:
    """This process's shards of `array` as the engine takes them:
    (origin, shape, uint8 view of the data, replica_id, num_replicas)."""
    table = _shard_table(array.sharding, tuple(array.shape))
    out = []
    for shard in array.addressable_shards:
        (origin, extent), count = table[shard.device]
        # A view of the device buffer on CPU (in_host_memory); one copy from a GPU.
        data = np.asarray(shard.data)
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        out.append((origin, extent, tnp.byte_view(data), int(shard.replica_id), count))
    return out


# Memory kinds of host memory on accelerators (jax.Array.sharding.memory_kind).
_HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def in_host_memory(array: jax.Array) -> bool:
    """Whether `array`'s buffers are host memory, and shards_of() therefore views of them rather
    than copies. That memory may also be a NumPy array's, which can change under the views:
    XLA's CPU client adopts the buffer of an aligned NumPy array given to jax.device_put
    instead of copying it (dlpack imports likewise), and nothing tells such a buffer apart."""
    return _sharding_in_host_memory(array.sharding)


@functools.lru_cache(maxsize=4096)
def _sharding_in_host_memory(sharding: jax.sharding.Sharding) -> bool:
    # Once per sharding: a save asks for every leaf twice (start_save, save_shards).
    if getattr(sharding, "memory_kind", None) in _HOST_MEMORY_KINDS:
        return True
    return any(device.platform == "cpu" for device in sharding.addressable_devices)


@functools.lru_cache(maxsize=4096)
def _device_blocks(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple:
    """((device, (origin, shape)) for each addressable device under `sharding`), computed once
    per sharding and shape: the leaves of a model repeat a few of each."""
    return tuple((device, box_of_index(index, shape))
                 for device, index in sharding.addressable_devices_indices_map(shape).items())


def distinct_boxes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[tuple, tuple]:
    """The distinct blocks the addressable devices hold under `sharding`, each as
    {(origin, shape): (origin, shape)}: a block held by several devices (replicas) is read once."""
    return {box: box for _, box in _device_blocks(sharding, shape)}


def _fast_batched_put():
    """JAX's own batched placement of per-device host buffers (what jax.device_put and
    jax.make_array_from_callback end in), or None where this JAX lacks it. Private to JAX, so
    checked once and replaced by the public make_array_from_callback when it moves: that costs
    about 2x as much per array (4,000 arrays on 8 devices: 214 ms against 93 ms)."""
    try:
        from jax._src import core as jax_core
        from jax._src.interpreters import pxla
        put, shaped = pxla.batched_device_put, jax_core.ShapedArray
    except (ImportError, AttributeError):
        return None

    def batched_put(shape, dtype, sharding, xs, devices):
        return put(shaped(shape, dtype), sharding, xs, devices)
    return batched_put


_batched_put = _fast_batched_put()


def assemble(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding,
             buffers: dict[tuple, np.ndarray]) -> jax.Array:
    """A jax.Array from one host buffer per distinct block of `sharding`, keyed by the block's
    (origin, shape) as JaxAdapter.restore_boxes asks for them: one call hands every device its
    block. Devices that hold the same block (replicas) get the same host buffer, as
    jax.device_put gives them; CPU devices adopt an aligned buffer rather than copy it."""
    global _batched_put
    blocks = _device_blocks(sharding, shape)
    if _batched_put is not None:
        try:
            return _batched_put(shape, dtype, sharding, [buffers[box] for _, box in blocks],
                                [device for device, _ in blocks])
        except TypeError:  # JAX changed the private signature: the public way from now on
            _batched_put = None
    return jax.make_array_from_callback(shape, sharding,
                                        lambda index: buffers[box_of_index(index, shape)])


def restore_dtype(dtype: Any) -> np.dtype:
    """The dtype of a jax.Array restored for a target of `dtype`: what jax.device_put makes of a
    NumPy array of that dtype (jax.dtypes.canonicalize_dtype), in native byte order. With 64-bit
    types off (jax_enable_x64, JAX's default) that narrows float64, int64, uint64 and complex128
    to float32, int32, uint32 and complex64; an array whose type claimed the wide dtype over
    narrow buffers failed at its first use in XLA (RuntimeProgramInputMismatch, issue 36 item
    7). Asked per restore, not cached: the setting can change while a process runs."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype).newbyteorder("=")))


class _HostCopy:
    """A copy of a device array in host memory that start_save made for one save."""

    def __init__(self, array: jax.Array):
        self.array = array


class JaxAdapter:
    """Leaves that are jax.Array (any sharding: each process saves its own shards, and restores
    each device's block) and jax.ShapeDtypeStruct targets. See _adapters.py for the protocol."""

    def owns(self, x: Any) -> bool:
        return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))

    def check_savable(self, x: Any, path: str) -> None:
        if isinstance(x, jax.ShapeDtypeStruct):
            raise TypeError(f"cannot save the abstract array at {path!r} (a ShapeDtypeStruct)")

    def dtype_name(self, x: Any) -> str:
        return tnp.dtype_name(x.dtype)  # JAX's dtypes are NumPy's (and ml_dtypes')

    def start_save(self, xs: list) -> list:
        # The leaves in host memory need no copy (their shards are views). The others are
        # copied into pinned host memory in one batched jax.device_put, or have every shard's
        # copy into pageable memory started (shards_of() then waits for each).
        out = list(xs)
        off_host = [i for i, x in enumerate(xs) if not in_host_memory(x)]
        if not off_host:
            return out
        if _options.SAVE_VIA_PINNED_HOST:
            try:
                copies = jax.device_put(
                    [xs[i] for i in off_host],
                    [xs[i].sharding.with_memory_kind("pinned_host") for i in off_host])
            except (ValueError, RuntimeError, NotImplementedError):
                pass  # no pinned host memory on this platform: pageable copies below
            else:
                for i, copy in zip(off_host, copies):
                    out[i] = _HostCopy(copy)
                return out
        for i in off_host:
            for shard in xs[i].addressable_shards:
                shard.data.copy_to_host_async()
        return out

    def immutable(self, x: Any) -> bool:
        return True  # jax.Arrays are immutable; see in_host_memory for the exception

    def identity(self, x: Any) -> Any:
        """What names `x`'s buffers (incremental saves' identity shortcut, _identity.py): its
        shape, dtype, sharding and each addressable shard's device and buffer address; None
        for a deleted (donated) array."""
        if x.is_deleted():
            return None
        buffers = tuple((s.device.id, s.data.unsafe_buffer_pointer())
                        for s in x.addressable_shards)
        return (tuple(x.shape), str(x.dtype), x.sharding, buffers)

    def save_shards(self, x: Any, process_index: int, process_count: int):
        if isinstance(x, _HostCopy):  # a copy made for this save: nothing else changes it
            return tuple(x.array.shape), shards_of(x.array), True
        return tuple(x.shape), shards_of(x), not in_host_memory(x)

    def restore_boxes(self, target: Any, shape: tuple[int, ...]) -> dict[Any, tuple]:
        return distinct_boxes(self._sharding(target), shape)

    def restore_dtype(self, target: Any) -> np.dtype:
        """The dtype the engine reads `target`'s leaf in, and the leaf's: restore_dtype()."""
        return restore_dtype(target.dtype)

    def build(self, target: Any, shape: tuple[int, ...], buffers: dict[Any, np.ndarray]):
        return self.build_many([(target, shape, buffers)])[0]

    def build_many(self, items: list[tuple]) -> list[jax.Array]:
        """The leaves of one batch, each placed on its devices in one call from the buffers of
        its distinct blocks (assemble). Every block is read straight into its own buffer, which
        a CPU device adopts: no copy, where reading small arrays whole and letting
        jax.device_put split them copied every byte again (profile of 4,000 arrays on 8 CPU
        devices: device_put took 370 ms of a 675 ms restore, placing per-device buffers 93 ms).
        Returns once the devices hold their data, so that the host buffers can go."""
        out = [assemble(shape, restore_dtype(target.dtype), self._sharding(target), buffers)
               for target, shape, buffers in items]
        jax.block_until_ready(out)
        return out

    def orbax_sharding(self, x: Any) -> str | None:
        return orbax_sharding(x.sharding)

    def sharding_record(self, x: Any) -> dict | None:
        """What a checkpoint records of `x`'s sharding (sharding_record), or None."""
        return sharding_record(x.sharding) if isinstance(x, jax.Array) else None

    def default_coordinator(self) -> JaxCoordinator | None:
        return default_coordinator()

    @staticmethod
    def _sharding(target: Any) -> jax.sharding.Sharding:
        sharding = getattr(target, "sharding", None)
        return sharding if sharding is not None else jax.sharding.SingleDeviceSharding(
            jax.devices()[0])


def orbax_sharding(sharding: Any) -> str | None:
    """The JSON Orbax keeps in `_sharding` for a NamedSharding or SingleDeviceSharding (None
    for other shardings, whose arrays are then recorded as NumPy arrays)."""
    doc = sharding_record(sharding, compact=False)
    return None if doc is None else json.dumps(doc)


@functools.lru_cache(maxsize=4096)
def sharding_record(sharding: Any, compact: bool = True) -> dict | None:
    """The description of `sharding` that a checkpoint records (docs/format.md 4.2, the
    "sharding" of an array leaf), in the schema Orbax writes to `_sharding`, so that one parser
    (sharding_from_record) reads both: for a NamedSharding the mesh shape, axis names, axis
    types, partition spec and the mesh's device ids in row-major order ("device_mesh"); for a
    SingleDeviceSharding the device (its str, as Orbax writes it, and its id). None for any
    other sharding (GSPMD, positional, ...): no NamedSharding is known for it, and a restore
    as saved then gives the default. `compact` leaves the device ids out when they are 0..n-1 in
    row-major order (what a reader assumes without them): the native format records it per
    leaf, and a model has thousands of leaves on one mesh. Computed once per sharding; the
    caller must not change the dict."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        ids = [int(d.id) for d in mesh.devices.flat]
        doc = {"sharding_type": "NamedSharding", "shape": [int(n) for n in mesh.devices.shape],
               "axis_names": [str(a) for a in mesh.axis_names],
               "axis_types": [str(t) for t in mesh.axis_types], "partition_spec": spec}
        if not compact or ids != list(range(len(ids))):
            doc["device_mesh"] = {"mesh": np.vectorize(lambda d: {"id": int(d.id)},
                                                       otypes=[object])(mesh.devices).tolist()}
        return doc
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        device = next(iter(sharding.device_set))
        doc = {"sharding_type": "SingleDeviceSharding", "device_str": str(device)}
        if compact:
            doc["device_id"] = int(device.id)
        return doc
    return None


def _mesh_ids(mesh: Any) -> list[int] | None:
    """The device ids of a recorded "device_mesh" ({"mesh": nested lists of {"id": n}}), in
    row-major order; None when it is malformed."""
    out: list[int] = []
    stack = [mesh.get("mesh") if isinstance(mesh, dict) else None]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(reversed(x))
        elif isinstance(x, dict) and isinstance(x.get("id"), int):
            out.append(x["id"])
        else:
            return None
    return out


@functools.lru_cache(maxsize=1024)
def _sharding_from_text(text: str) -> Any:
    try:
        return sharding_from_record(json.loads(text))
    except (ValueError, TypeError, KeyError, RecursionError, OverflowError):
        return None


def sharding_from_text(text: str | None) -> Any:
    """sharding_from_record of a record's JSON text (None for None or malformed text), cached:
    the leaves of a model share a few shardings."""
    return None if text is None else _sharding_from_text(text)


def sharding_from_record(doc: Any) -> Any:
    """The sharding a recorded description (sharding_record's, or Orbax's `_sharding` entry)
    stands for on this process's devices, or None when they cannot hold it.

    NamedSharding: when every recorded device id is a device of this job (jax.devices(), all
    processes'), the mesh of those devices in the recorded order; else, when the job has as
    many devices as the mesh, the mesh of jax.devices() in their order (ids of another
    platform or host); else None. SingleDeviceSharding: the device of the recorded id (or,
    for Orbax's record, of the recorded name) when this job has it, else None. Any other or a
    malformed record: None."""
    if not isinstance(doc, dict):
        return None
    kind = doc.get("sharding_type")
    by_id = {d.id: d for d in jax.devices()}
    if kind == "SingleDeviceSharding":
        device = by_id.get(doc.get("device_id")) if isinstance(doc.get("device_id"), int) else None
        if device is None and isinstance(doc.get("device_str"), str):
            # Orbax's record names the device (JAX 0.10 renamed TFRT_CPU_<n> to cpu:<n>).
            names = {str(d).replace("TFRT_CPU_", "cpu:"): d for d in jax.devices()}
            device = names.get(doc["device_str"].replace("TFRT_CPU_", "cpu:"))
        return None if device is None else jax.sharding.SingleDeviceSharding(device)
    if kind != "NamedSharding":
        return None
    shape = doc.get("shape")
    names = doc.get("axis_names")
    spec = doc.get("partition_spec")
    if (not isinstance(shape, list) or not all(isinstance(n, int) and n > 0 for n in shape)
            or not isinstance(names, list) or len(names) != len(shape)
            or not isinstance(spec, list)):
        return None
    size = math.prod(shape)
    if size > max(len(by_id), jax.device_count()):
        return None  # more devices than this job has (or a hostile record's absurd mesh)
    ids = _mesh_ids(doc["device_mesh"]) if "device_mesh" in doc else list(range(size))
    if ids is None or len(ids) != size:
        return None
    if all(i in by_id for i in ids):
        devices = [by_id[i] for i in ids]
    elif jax.device_count() == size:
        devices = list(jax.devices())
    else:
        return None
    kwargs = {}
    types = doc.get("axis_types")
    if isinstance(types, list) and len(types) == len(shape):
        known = {str(t): t for t in jax.sharding.AxisType}
        known.update({str(t).rsplit(".", 1)[-1]: t for t in jax.sharding.AxisType})
        if all(t in known for t in types):
            kwargs["axis_types"] = tuple(known[t] for t in types)
    try:
        mesh = jax.sharding.Mesh(np.array(devices, dtype=object).reshape(shape),
                                 tuple(names), **kwargs)
        parts = [tuple(p) if isinstance(p, list) else p for p in spec]
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*parts))
    except (ValueError, TypeError):
        return None


_save_counter = itertools.count()


class JaxCoordinator:
    """A Coordinator over jax.distributed's key-value store and barriers.

    Every process must create one per collective operation, in the same order: the keys of
    each instance carry a sequence number so that operations never reuse each other's keys.
    """

    def __init__(self) -> None:
        from jax._src import distributed

        self._client = distributed.global_state.client
        if self._client is None:
            raise RuntimeError("jax.distributed.initialize() has not been called")
        self._prefix = f"tensorstash/{next(_save_counter)}/"

    def process_index(self) -> int:
        return jax.process_index()

    def process_count(self) -> int:
        return jax.process_count()

    def barrier(self, name: str, timeout_ms: int) -> None:
        self._client.wait_at_barrier(self._prefix + name, int(timeout_ms))

    def key_value_set(self, key: str, value: str) -> None:
        self._client.key_value_set(self._prefix + key, value)

    def key_value_get(self, key: str, timeout_ms: int) -> str:
        return self._client.blocking_key_value_get(self._prefix + key, int(timeout_ms))

    def key_value_try_get(self, key: str) -> str | None:
        """The value of `key`, or None when no process has set it yet, without waiting."""
        try:
            return self._client.key_value_try_get(self._prefix + key)
        except RuntimeError as e:  # jax.errors.JaxRuntimeError, "NOT_FOUND: ..."
            if str(e).startswith("NOT_FOUND"):
                return None
            raise


def default_coordinator() -> JaxCoordinator | None:
    """A JaxCoordinator when the job has several processes, else None (single process)."""
    return JaxCoordinator() if jax.process_count() > 1 else None


# Typed PRNG keys (jax.random.key; dtype key<fry>, key<rbg>, ...). The engine stores a key array
# as its key data (jax.random.key_data: uint32, with the implementation's trailing dimensions)
# and the implementation's name beside it (_tree.py, "PRNG keys"); these helpers map between the
# two. The implementations are named as jax.random.key(impl=...) takes them.
KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def is_key(x: Any) -> bool:
    """Whether `x` (an array, a target, or an ArrayMetadata) has a typed PRNG key dtype."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


@functools.lru_cache(maxsize=None)
def _key_abstract(impl: str) -> jax.ShapeDtypeStruct:
    """The ShapeDtypeStruct of one key of implementation `impl` (no device work)."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl))


@functools.lru_cache(maxsize=None)
def _impl_names() -> dict:
    """{key dtype: implementation name} of the implementations JAX has."""
    out = {}
    for impl in KEY_IMPLS:
        try:
            out[_key_abstract(impl).dtype] = impl
        except (ValueError, TypeError, KeyError):  # not in this JAX
            continue
    return out


def key_impl(x: Any) -> str:
    """The implementation name of key array or key-typed target `x` ("threefry2x32", ...)."""
    name = _impl_names().get(x.dtype)
    if name is None:  # an implementation registered outside KEY_IMPLS: its own name
        impl = getattr(x.dtype, "_impl", None)
        name = getattr(impl, "name", None) or str(x.dtype)
    return name


def key_dtype(impl: str, where: str) -> Any:
    """The key dtype of implementation `impl`; ValueError naming `where` for a name this JAX
    does not have."""
    try:
        return _key_abstract(impl).dtype
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{where} holds PRNG keys of implementation {impl!r}, which this JAX "
                         f"does not have ({e})") from None


def key_data_shape(impl: str) -> tuple[int, ...]:
    """The trailing dimensions one key of `impl` adds to its key data ((2,) for threefry2x32)."""
    return tuple(jax.eval_shape(jax.random.key_data, _key_abstract(impl)).shape)


def key_data(x: jax.Array) -> jax.Array:
    """The key data of key array `x` (uint32, trailing dimensions unsharded, on x's devices)."""
    return jax.random.key_data(x)


def key_data_target(target: Any, impl: str) -> Any:
    """The target of a key target's key data: a ShapeDtypeStruct of the data's shape (the
    target's plus the trailing dimensions), uint32, on the target's sharding with the trailing
    dimensions unsharded. A target with no sharding (an ArrayMetadata) restores onto the default
    device, as a ShapeDtypeStruct without one does. TypeError for a sharding other than
    NamedSharding or SingleDeviceSharding on a ShapeDtypeStruct (a jax.Array target maps any)."""
    trailing = key_data_shape(impl)
    shape = tuple(target.shape) + trailing
    sharding = getattr(target, "sharding", None) if isinstance(
        target, (jax.Array, jax.ShapeDtypeStruct)) else None
    if isinstance(target, jax.Array):
        sharding = jax.random.key_data(target).sharding
    elif isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec),
                                              memory_kind=sharding.memory_kind)
    elif sharding is not None and not isinstance(sharding, jax.sharding.SingleDeviceSharding):
        raise TypeError(f"a key target's sharding must be a NamedSharding or a "
                        f"SingleDeviceSharding (or the target a jax.Array), not "
                        f"{type(sharding).__name__}")
    return jax.ShapeDtypeStruct(shape, np.dtype("uint32"), sharding=sharding)


def key_sharding(sharding: Any, ndim: int) -> Any:
    """The sharding of a key array of rank `ndim` whose key data has `sharding`: a
    NamedSharding's partition spec less the implementation's trailing dimensions (which are
    never sharded); any other sharding as it is."""
    if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.spec) > ndim:
        spec = jax.sharding.PartitionSpec(*tuple(sharding.spec)[:ndim])
        return jax.sharding.NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
    return sharding


def wrap_key(data: Any, impl: str) -> jax.Array:
    """Key array of implementation `impl` over key data `data` (a jax.Array keeps its
    sharding, less the trailing dimensions; a NumPy array goes to the default device)."""
    return jax.random.wrap_key_data(data, impl=impl)
