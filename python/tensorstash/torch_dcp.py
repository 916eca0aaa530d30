"""DCP's storage interfaces over tensorstash steps: tensorstash.torch.StorageWriter(path) and
StorageReader(path), for torch.distributed.checkpoint's save, async_save and load.

The writer writes a native step at `path` itself (any store URL): every rank writes its plan's
chunks through the phased writer (_ext.Writer.write_part), and DCP's coordinator commits once
with every rank's part, with the tree tensorstash.save would write for the same state dict.
The reader describes each tensor to DCP as ONE chunk, so that DCP's resharding planner does
work linear in the tensors, and reads the boxes the load plan asks for in one restore_to_host.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import os
import uuid
import warnings
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import (LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                          StorageReader as _DcpStorageReader,
                                          StorageWriter as _DcpStorageWriter)
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _ext, _paths, _restore, _tree
from . import torch as ttorch

# A non-tensor value the tree cannot hold is stored as {PICKLED: torch.save(value)'s bytes}.
PICKLED = "dcp.torch_save"

# How long a rank waits for another's part of a save (the coordinator, in finish()).
_PART_TIMEOUT_MS = 30 * 60 * 1000


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _plain(x: Any) -> bool:
    """Whether the step's tree stores `x` as it is (not as pickled bytes)."""
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return True
    if isinstance(x, (list, tuple)):
        return all(_plain(v) for v in x)
    if isinstance(x, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in x.items())
    return False


def _torch_saved(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unflatten(flat: dict[str, Any], mappings: dict[str, tuple]) -> dict:
    """The nested state dict of DCP's flattened `flat` (fqn -> value) and planner mappings
    (fqn -> object path; list indices are ints): lists where the path has int steps into
    a list the caller had, as DCP's own unflatten_state_dict builds them."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
    if not mappings:
        return dict(flat)
    return unflatten_state_dict(flat, mappings)


class StorageWriter(_DcpStorageWriter):
    """Writes a DCP save as the tensorstash step at `path` (e.g. "s3://bucket/run/0000001000"):
    few data files, a CRC-32C on every chunk, one atomic commit. `tensorstash inspect`, `verify`
    and `ls` read it, and tensorstash.restore / tensorstash.torch.load restore it.

    Tensors are stored by their flattened state-dict name's object path (the tree
    tensorstash.save writes for the same state dict); non-tensor values DCP saves as bytes are
    stored as tree values when they are plain (None, bool, int, float, str, bytes, and lists,
    tuples and dicts of them), else as {PICKLED: the bytes of torch.save of the value}, which
    StorageReader gives back to DCP as they are. Dict keys that are ints come back as str
    (DCP's flattened names carry str(key), and the planner keeps no other), so a raw
    optimizer.state_dict()'s state is keyed "0", "1", ... where tensorstash.save keeps 0, 1.
    Errors raise from DCP's save, wrapped in its CheckpointException (FileExistsError when the
    step is complete already and not `overwrite`, OSError for storage errors); on error
    nothing new is visible at `path`. The parts of ranks other than DCP's coordinator travel
    through torch.distributed's store (under "tensorstash/dcp/<nonce>/"), so that a rank with
    an empty plan (no WriteResult to carry it) still hands its part over; the coordinator rank
    deletes the save's keys from the store once it holds every part."""

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False,
                 codec: str = "none") -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.overwrite = overwrite
        self.codec = codec
        self._reset()

    def _reset(self) -> None:
        self._is_coordinator = False
        self._writer: Any = None
        self._coord: Any = None
        self._tree_json: str | None = None
        self._part: bytes | None = None
        self._info: dict | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._reset()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Each rank learns its index among the plans, their count, and the save's nonce (the
        # prefix of its coordinator's keys, so that saves never share keys).
        nonce = uuid.uuid4().hex
        n = len(plans)
        return [dataclasses.replace(p, storage_data={"nonce": nonce, "index": i, "count": n})
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        info = plan.storage_data
        if not isinstance(info, dict) or "nonce" not in info:
            raise RuntimeError("tensorstash StorageWriter: the plan lacks what "
                               "prepare_global_plan gives it (a planner that drops storage_data?)")
        self._info = info
        count = info["count"]
        coord = None
        if count > 1:
            coord = ttorch.TorchCoordinator(prefix=f"dcp/{info['nonce']}", index=info["index"],
                                            count=count)
        self._coord = coord

        # The state dict's tree, as tensorstash.save encodes it: array paths by fqn.
        flat = dict(planner.state_dict)
        mappings = dict(getattr(planner, "mappings", None) or {})
        for fqn, value in flat.items():
            if not isinstance(value, torch.Tensor) and not _plain(value):
                flat[fqn] = {PICKLED: _torch_saved(value)}
        fqns_by_id: dict[int, list[str]] = {}
        for fqn, value in flat.items():
            if isinstance(value, torch.Tensor):
                fqns_by_id.setdefault(id(value), []).append(fqn)
        order: list[tuple[str, str]] = []  # (array path, fqn), in the tree's order

        def on_array(array_path: str, leaf: Any) -> None:
            order.append((array_path, fqns_by_id[id(leaf)].pop(0)))

        node = _tree.encode(_unflatten(flat, mappings), on_array)
        self._tree_json = _tree.dumps(node)

        shards: dict[str, list] = {}
        meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                size = len(data.getbuffer()) if isinstance(data, io.BytesIO) else 0
                results.append(WriteResult(index=item.index, size_in_bytes=size,
                                           storage_data=None))
                continue
            fqn = item.index.fqn
            td = item.tensor_data
            t = planner.resolve_data(item).detach()
            if t.device.type != "cpu":
                t = t.cpu()
            data = ttorch._bytes_of(t)
            shards.setdefault(fqn, []).append(
                (tuple(td.chunk.offsets), tuple(td.chunk.sizes), data, 0, 1))
            meta[fqn] = (ttorch.dtype_name(td.properties.dtype, fqn), tuple(td.size))
            results.append(WriteResult(index=item.index, size_in_bytes=data.nbytes,
                                       storage_data=None))

        root, step = _paths.split(self.path)
        writer = _ext.Writer(root, step, overwrite=self.overwrite, coordinator=coord)
        for array_path, fqn in order:
            t = flat[fqn]
            local = ttorch._local_of(t) if ttorch.is_dtensor(t) else t
            dtype, shape = meta.get(fqn, (ttorch.dtype_name(local.dtype, fqn), tuple(t.shape)))
            writer.add_array(array_path, dtype, shape, shards.get(fqn, []), codec=self.codec)
        writer.set_tree(self._tree_json)
        part = writer.write_part()
        if coord is not None and not self._is_coordinator:
            coord.key_value_set(f"part/{info['index']}", base64.b64encode(part).decode("ascii"))
        self._writer = writer
        self._part = part
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._writer is None or self._info is None:
            raise RuntimeError("tensorstash StorageWriter: finish() before write_data()")
        parts = [self._part]
        me = self._info["index"]
        for i in range(self._info["count"]):
            if i != me:
                text = self._coord.key_value_get(f"part/{i}", _PART_TIMEOUT_MS)
                parts.append(base64.b64decode(text))
        if self._coord is not None:
            # Every rank handed its part over after its last exchange of this save, so no rank
            # reads the save's keys any more: drop them (the parts are the bulk of them).
            self._coord.drop_keys()
        self._writer.commit_parts(parts)
        self._writer = None

    def storage_meta(self) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta
        return StorageMeta(checkpoint_id=self.path)


@dataclasses.dataclass(frozen=True)
class _Pickled:
    """A value StorageWriter stored as torch.save's bytes ({PICKLED: data})."""
    data: bytes


class StorageReader(_DcpStorageReader):
    """Reads the tensorstash step at `path` (any store URL; a step of tensorstash.save or of
    StorageWriter, or any format tensorstash.restore reads) for DCP's load. The flattened
    names are those DCP gives the same state dict; each tensor is one chunk to DCP, and the
    engine reads only the chunks each requested box needs."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self._arrays: dict[str, tuple[str, str]] = {}  # fqn -> (array path, stored dtype)
        self._values: dict[str, Any] = {}  # fqn -> non-tensor value

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with contextlib.closing(_restore._open(self.path, True, 1 << 20, 1)) as reader:
            infos = {a["path"]: a for a in reader.arrays()}
        tree = _restore.metadata(self.path)
        stand_in: dict[int, str] = {}

        # Meta tensors stand in for the arrays, so that DCP's flatten walks the tree as it
        # walks a state dict of tensors (it enters lists of tensors, not other lists).
        def swap(x: Any) -> Any:
            if isinstance(x, _restore.ArrayMetadata):
                dtype = ttorch.torch_dtype(infos[x.path]["dtype"])
                t = torch.empty(x.shape, dtype=dtype, device="meta")
                stand_in[id(t)] = x.path
                return t
            if isinstance(x, dict):
                if len(x) == 1 and isinstance(x.get(PICKLED), bytes):
                    return _Pickled(x[PICKLED])  # one value to DCP, not a dict to walk
                return {k: swap(v) for k, v in x.items()}
            if isinstance(x, list):
                return [swap(v) for v in x]
            if isinstance(x, tuple) and not hasattr(x, "_fields"):
                return tuple(swap(v) for v in x)
            return x

        flat, mappings = flatten_state_dict(swap(tree))
        sd_meta: dict[str, Any] = {}
        self._arrays, self._values = {}, {}
        for fqn, value in flat.items():
            if isinstance(value, torch.Tensor) and id(value) in stand_in:
                array_path = stand_in[id(value)]
                shape = tuple(value.shape)
                self._arrays[fqn] = (array_path, infos[array_path]["dtype"])
                sd_meta[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=value.dtype), size=torch.Size(shape),
                    chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)),
                                                 sizes=torch.Size(shape))])
            else:
                self._values[fqn] = value
                sd_meta[fqn] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=sd_meta, planner_data=mappings)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        if not self._arrays and not self._values:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        requests, items = [], []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                if fqn not in self._values:
                    raise KeyError(f"{self.path}: no value {fqn!r} in the step")
                value = self._values[fqn]
                data = value.data if isinstance(value, _Pickled) else _torch_saved(value)
                planner.load_bytes(item, io.BytesIO(data))
                continue
            if fqn not in self._arrays:
                raise KeyError(f"{self.path}: no tensor {fqn!r} in the step")
            array_path, dtype = self._arrays[fqn]
            requests.append((array_path, tuple(item.storage_offsets), tuple(item.lengths), dtype))
            items.append(item)
        if requests:
            def on_batch(batch: list[tuple[int, np.ndarray]]) -> None:
                for k, buf in batch:
                    item = items[k]
                    dtype = ttorch.torch_dtype(requests[k][3])
                    with warnings.catch_warnings():  # mapped boxes are read-only; we only copy
                        warnings.simplefilter("ignore", UserWarning)
                        src = ttorch._from_buffer(buf, dtype, tuple(item.lengths))
                    dst = planner.resolve_tensor(item).detach()
                    dst.copy_(src)
                    planner.commit_tensor(item, dst)

            with contextlib.closing(_restore._open(self.path, True, 64 << 20, 0)) as reader:
                reader.restore_to_host(requests, on_batch)
        return _done(None)
