"""JAX adapter: shards of a jax.Array for the engine, per-device boxes of a sharding, assembly of
restored buffers into a jax.Array, and a Coordinator backed by JAX's distributed runtime."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jax
import numpy as np

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


def _index_key(index: tuple, shape: tuple[int, ...]) -> tuple:
    return box_of_index(index, shape)


def shards_of(array: jax.Array) -> list[tuple]:
    """This process's shards of `array` as the engine takes them:
    (origin, shape, uint8 view of the data, replica_id, num_replicas)."""
    shape = tuple(array.shape)
    # How many devices (in all processes) hold each block: the replica count of a shard.
    counts: dict[tuple, int] = {}
    for index in array.sharding.devices_indices_map(shape).values():
        key = _index_key(index, shape)
        counts[key] = counts.get(key, 0) + 1
    out = []
    for shard in array.addressable_shards:
        origin, extent = box_of_index(shard.index, shape)
        # A view of the device buffer on CPU (in_host_memory); one copy from a GPU.
        data = np.asarray(shard.data)
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        out.append((origin, extent, tnp.byte_view(data), int(shard.replica_id),
                    counts[(origin, extent)]))
    return out


# Memory kinds of host memory on accelerators (jax.Array.sharding.memory_kind).
_HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def in_host_memory(array: jax.Array) -> bool:
    """Whether `array`'s buffers are host memory, and shards_of() therefore views of them rather
    than copies. That memory may also be a NumPy array's, which can change under the views:
    XLA's CPU client adopts the buffer of an aligned NumPy array given to jax.device_put
    instead of copying it (dlpack imports likewise), and nothing tells such a buffer apart."""
    sharding = array.sharding
    if getattr(sharding, "memory_kind", None) in _HOST_MEMORY_KINDS:
        return True
    return any(device.platform == "cpu" for device in sharding.addressable_devices)


def device_boxes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[Any, tuple]:
    """(origin, shape) of the block each addressable device holds under `sharding`."""
    return {device: box_of_index(index, shape)
            for device, index in sharding.addressable_devices_indices_map(shape).items()}


def assemble(shape: tuple[int, ...], sharding: jax.sharding.Sharding,
             buffers: dict[Any, np.ndarray]) -> jax.Array:
    """A jax.Array from one host buffer per addressable device.

    Waits until the devices hold their copies, so that the host buffers can be freed as soon as
    this returns: device_put is asynchronous, and under load a restore would otherwise hold the
    host buffers of several batches at once (breaking the host-memory bound)."""
    arrays = [jax.device_put(buffers[device], device) for device in buffers]
    jax.block_until_ready(arrays)
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


# Arrays under this size are read whole into one host buffer and placed with one device_put for
# all of a batch (device_put copies each device's part out of it: cheaper than a call per device
# at this size); larger ones are read device by device into buffers the devices can adopt
# without a copy, or mapped. At 4 MiB the copies of strided parts cost more than the calls
# they save (bench: stacked and partial restores on 2x4 took 1.5-1.8x as long).
_WHOLE_BELOW = 1 << 20


class JaxAdapter:
    """Leaves that are jax.Array (any sharding: each process saves its own shards, and restores
    each device's block) and jax.ShapeDtypeStruct targets. See _adapters.py for the protocol."""

    def owns(self, x: Any) -> bool:
        return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))

    def check_savable(self, x: Any, path: str) -> None:
        if isinstance(x, jax.ShapeDtypeStruct):
            raise TypeError(f"cannot save the abstract array at {path!r} (a ShapeDtypeStruct)")

    def save_shards(self, x: jax.Array, process_index: int, process_count: int):
        return tuple(x.shape), shards_of(x), not in_host_memory(x)

    def restore_boxes(self, target: Any, shape: tuple[int, ...]) -> dict[Any, tuple]:
        sharding = self._sharding(target)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(target.dtype).itemsize
        if nbytes < _WHOLE_BELOW and sharding.is_fully_addressable:
            return {None: ((0,) * len(shape), shape)}  # one host array, split by device_put
        return device_boxes(sharding, shape)

    def build(self, target: Any, shape: tuple[int, ...], buffers: dict[Any, np.ndarray]):
        return self.build_many([(target, shape, buffers)])[0]

    def build_many(self, items: list[tuple]) -> list[jax.Array]:
        """The leaves of one batch: the small ones (read whole) in one device_put call, which
        costs a third of placing them shard by shard (profile of 4,000 arrays on 8 CPU
        devices: 32,000 device_put calls took 3.0 s of a 4.6 s restore); the others assembled
        from their per-device buffers. Returns once the devices hold their copies, so that
        the host buffers can go."""
        out: list[Any] = [None] * len(items)
        whole = [i for i, (_, _, buffers) in enumerate(items) if None in buffers]
        if whole:
            put = jax.device_put([items[i][2][None] for i in whole],
                                 [self._sharding(items[i][0]) for i in whole])
            jax.block_until_ready(put)
            for i, array in zip(whole, put):
                out[i] = array
        for i, (target, shape, buffers) in enumerate(items):
            if out[i] is None:
                out[i] = assemble(shape, self._sharding(target), buffers)
        return out

    def orbax_sharding(self, x: Any) -> str | None:
        return orbax_sharding(x.sharding)

    @staticmethod
    def _sharding(target: Any) -> jax.sharding.Sharding:
        sharding = getattr(target, "sharding", None)
        return sharding if sharding is not None else jax.sharding.SingleDeviceSharding(
            jax.devices()[0])


def orbax_sharding(sharding: Any) -> str | None:
    """The JSON Orbax keeps in `_sharding` for a NamedSharding or SingleDeviceSharding (None
    for other shardings, whose arrays are then recorded as NumPy arrays)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        doc = {"sharding_type": "NamedSharding", "shape": [int(n) for n in mesh.devices.shape],
               "axis_names": list(mesh.axis_names),
               "axis_types": [str(t) for t in mesh.axis_types], "partition_spec": spec,
               "device_mesh": {"mesh": np.vectorize(lambda d: {"id": d.id}, otypes=[object])(
                   mesh.devices).tolist()}}
        return json.dumps(doc)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        device = next(iter(sharding.device_set))
        return json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": str(device)})
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


def default_coordinator() -> JaxCoordinator | None:
    """A JaxCoordinator when the job has several processes, else None (single process)."""
    return JaxCoordinator() if jax.process_count() > 1 else None
