"""The node-local tier of CheckpointManager (docs/multitier.md): frequent saves into each node's
RAM, which step can be restored from which holders, and the collective steps that decide it.

Each process saves its own shards (every replica it has) as a *holding*: a step folder
`<local_dir>/p<index>-of-<count>/<step>` written by the engine with WriterOptions::holding, its
per-process value as process/0 and the step's metadata beside the arrays, all committed
together. The folder names the process that saved it, so that after a restart in another
order `per_process` still finds the value of the process with this process's index.

At restore time every process publishes what its node holds (through the coordinator's
key-value store) and every process computes the same answer from the same holdings
(restorable_steps): a step can be restored when the persistent tier has it, or when every
chunk of every array and every process's folder is held by some process. Each process then
reads its boxes chunk by chunk from the cheapest holder (Reader.tiered: its own node, then the
peers' servers, then persistent storage), every chunk's CRC checked.
"""

from __future__ import annotations

import base64
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import struct
import time
from typing import Any, Iterable

from . import _ext

# A holding's folder: the process that saved it and the job's process count then.
_FOLDER = re.compile(r"^p(\d+)-of-(\d+)$")

# How many other processes' per-process values each holding carries besides its own (the next
# ones in process order), so that a value outlives the node of the process that saved it.
VALUE_REPLICAS = 3


def value_ring(index: int, count: int) -> list[int]:
    """The processes whose per-process values the holding of process `index` carries."""
    return [(index + d) % count for d in range(min(count, VALUE_REPLICAS + 1))]


_VALUES_MAGIC = b"tensorstash per-process values 2\n"


def new_save_id() -> str:
    """An id for one local save of the job (drawn by process 0): its time first, so that of two
    saves of one step number (a step saved again after a rollback) the later sorts last."""
    return f"{time.time_ns():020d}-{secrets.token_hex(6)}"


def pack_values(save_id: str, values: dict[int, bytes | None]) -> bytes:
    """What a holding's process/0 holds: the magic line, the save's id (u32 length, then its
    bytes), the count of values (u32), then per value its process index (u32), a presence
    flag (u8) and its length (u64), then its bytes."""
    sid = save_id.encode("ascii")
    out = [_VALUES_MAGIC, struct.pack("<I", len(sid)), sid, struct.pack("<I", len(values))]
    for index, value in sorted(values.items()):
        out.append(struct.pack("<IBQ", index, value is not None, len(value or b"")))
        out.append(value or b"")
    return b"".join(out)


def unpack_values(data: bytes, where: str) -> tuple[str, dict[int, bytes | None]]:
    """The inverse of pack_values: (save id, values); OSError naming `where` for anything else
    (the file's CRC was checked, so this is a foreign or older file, not damage)."""
    try:
        if not data.startswith(_VALUES_MAGIC):
            raise ValueError("no magic")
        pos = len(_VALUES_MAGIC)
        (length,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + length > len(data):
            raise ValueError("truncated")
        save_id = data[pos:pos + length].decode("ascii")
        pos += length
        (n,) = struct.unpack_from("<I", data, pos)
        pos += 4
        values: dict[int, bytes | None] = {}
        for _ in range(n):
            index, present, size = struct.unpack_from("<IBQ", data, pos)
            pos += struct.calcsize("<IBQ")
            if pos + size > len(data):
                raise ValueError("truncated")
            values[index] = data[pos:pos + size] if present else None
            pos += size
        return save_id, values
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise OSError(f"the per-process values of {where} are malformed: {e}") from None


def holding_folder(process_index: int, process_count: int) -> str:
    return f"p{process_index}-of-{process_count}"


def parse_holding_folder(name: str) -> tuple[int, int] | None:
    """(process index, process count) of a holding folder's name, or None."""
    m = _FOLDER.match(name)
    if m is None:
        return None
    index, count = int(m.group(1)), int(m.group(2))
    return (index, count) if 0 <= index < count else None


@dataclasses.dataclass(frozen=True)
class Holding:
    """One committed local step on one node, as its process publishes it."""

    holder: int                    # the process (now) whose node holds it
    folder: str                    # "p<saved by>-of-<count>"
    step: int
    digest: str                    # of the arrays' paths, dtypes, shapes and chunk grids
    num_chunks: dict[str, int]     # array path -> chunks the array has
    chunks: dict[str, list[int]]   # array path -> chunks this holding stores
    save_id: str = ""              # which save of the step (new_save_id)
    values: list[int] = dataclasses.field(default_factory=list)  # per-process values carried

    @property
    def saved_by(self) -> tuple[int, int]:
        return parse_holding_folder(self.folder)

    @property
    def save(self) -> tuple[int, str, str, int]:
        """What identifies one save: holdings of one step from different saves never mix."""
        return (self.step, self.save_id, self.digest, self.saved_by[1])

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(doc: dict) -> Holding:
        return Holding(holder=int(doc["holder"]), folder=str(doc["folder"]),
                       step=int(doc["step"]), digest=str(doc["digest"]),
                       num_chunks={k: int(v) for k, v in doc["num_chunks"].items()},
                       chunks={k: [int(c) for c in v] for k, v in doc["chunks"].items()},
                       save_id=str(doc["save_id"]), values=[int(v) for v in doc["values"]])


def restorable_saves(holdings: Iterable[Holding]) -> dict[int, tuple]:
    """For each step that the holdings alone can restore, the save (Holding.save) to restore:
    its holdings together store every chunk of every array and carry the per-process value of
    every process of the job that saved it. A whole slice (one holding with everything) is not
    needed; any mix of holders will do. Holdings of different saves of a step (different ids,
    arrays or job sizes) never mix; of two complete saves of a step the later one wins."""
    by_save: dict[tuple, list[Holding]] = {}
    for h in holdings:
        if h.saved_by is not None:
            by_save.setdefault(h.save, []).append(h)
    chosen: dict[int, tuple] = {}
    for save, group in sorted(by_save.items()):
        step, _id, _digest, count = save
        if set().union(*(h.values for h in group)) < set(range(count)):
            continue  # some process's per-process value is held by nobody
        complete = True
        for path, n in group[0].num_chunks.items():
            held: set[int] = set()
            for h in group:
                held.update(h.chunks.get(path, ()))
            if len(held.intersection(range(n))) != n:
                complete = False
                break
        if complete:
            chosen[step] = save  # sorted: a later save of the step replaces an earlier one
    return chosen


def restorable_from_holdings(holdings: Iterable[Holding]) -> set[int]:
    """The steps that the holdings alone can restore (restorable_saves)."""
    return set(restorable_saves(holdings))


def restorable_steps(holdings: Iterable[Holding], persistent_steps: Iterable[int]) -> list[int]:
    """Every step that can be restored whole, from any tiers, ascending."""
    return sorted(set(persistent_steps) | restorable_from_holdings(holdings))


def describe_local_holdings(local_dir: str, holder: int) -> list[Holding]:
    """The committed holdings on this node (every process folder under local_dir), each opened
    to list its chunks. Folders that do not open (a crash left them half-written) are skipped:
    they are no holders."""
    out = []
    try:
        folders = sorted(os.listdir(local_dir))
    except FileNotFoundError:
        return out
    for folder in folders:
        if parse_holding_folder(folder) is None:
            continue
        try:
            names = sorted(os.listdir(os.path.join(local_dir, folder)))
        except OSError:
            continue
        for name in names:
            if not (len(name) == 10 and name.isdigit()):
                continue
            if not os.path.exists(os.path.join(local_dir, folder, name, "COMMIT")):
                continue
            try:
                reader = _ext.Reader.tiered([("local", local_dir, f"{folder}/{name}", "")])
            except (OSError, ValueError):
                continue
            try:
                arrays = reader.arrays()
                chunks = reader.held_chunks(0)
                save_id, values = unpack_values(
                    reader.read_file(_ext.process_state_file_name(0)), f"{folder}/{name}")
            except (OSError, ValueError):
                continue  # damaged or foreign: no holder
            finally:
                reader.close()
            out.append(Holding(holder=holder, folder=folder, step=int(name),
                               digest=_digest(arrays),
                               num_chunks={a["path"]: int(a["num_chunks"]) for a in arrays},
                               chunks={p: list(c) for p, c in chunks.items()},
                               save_id=save_id, values=sorted(values)))
    return out


def _digest(arrays: list[dict]) -> str:
    doc = sorted((a["path"], a["dtype"], list(a["shape"]), list(a["cell_shape"]),
                  list(a["chunk_shape"])) for a in arrays)
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]


class Collective:
    """The control plane of the local tier: values exchanged through the coordinator's
    key-value store, each wait bounded by `timeout_s`. Every process makes the same calls in
    the same order (the keys carry a sequence number). Without a coordinator (one process)
    each exchange returns this process's value alone."""

    def __init__(self, coordinator: Any, timeout_s: float):
        self.coordinator = coordinator
        self.timeout_s = float(timeout_s)
        self.index = coordinator.process_index() if coordinator is not None else 0
        self.count = coordinator.process_count() if coordinator is not None else 1
        self._sequence = 0

    def _key(self, name: str) -> str:
        return f"local-tier/{self._sequence}/{name}"

    def _collect(self, name: str, sources: list[int], what: str) -> dict[int, str]:
        """The values processes `sources` published under `name` in this exchange; one shared
        deadline: after the first missing process the others are only polled, and the
        TimeoutError names every missing one."""
        out: dict[int, str] = {}
        missing = []
        for p in sources:
            wait_ms = int(self.timeout_s * 1000) if not missing else 1
            try:
                out[p] = self.coordinator.key_value_get(self._key(f"{name}/{p}"), wait_ms)
            except Exception:  # noqa: BLE001 - the runtime's timeout error types differ
                missing.append(p)
        if missing:
            names = ", ".join(str(p) for p in missing)
            raise TimeoutError(
                f"tensorstash: process{'es' if len(missing) > 1 else ''} {names} of "
                f"{self.count} did not arrive at '{name}' ({what}) within {self.timeout_s:g} s "
                "(coordination_timeout): a process that was not restarted, or that is stuck")
        return out

    def _publish(self, name: str, value: str) -> None:
        self.coordinator.key_value_set(self._key(f"{name}/{self.index}"), value)

    def all_gather(self, name: str, value: str) -> list[str]:
        """Every process's `value`, by process index. TimeoutError naming the processes that
        did not publish theirs within the timeout."""
        self._sequence += 1
        if self.coordinator is None:
            return [value]
        self._publish(name, value)
        others = self._collect(name, [p for p in range(self.count) if p != self.index],
                               "every process")
        return [value if p == self.index else others[p] for p in range(self.count)]

    def broadcast(self, name: str, value: str | None) -> str:
        """Process 0's `value`, in every process."""
        self._sequence += 1
        if self.coordinator is None or self.index == 0:
            if self.coordinator is not None:
                self._publish(name, value or "")
            return value or ""
        return self._collect(name, [0], "process 0's value")[0]

    def exchange_ring(self, name: str, value: bytes | None) -> dict[int, bytes | None]:
        """Publishes this process's per-process value and returns those of value_ring(index):
        its own and the next processes'. TimeoutError naming a process that did not publish."""
        self._sequence += 1
        if self.coordinator is None:
            return {self.index: value}
        self._publish(name, "-" if value is None else
                      "+" + base64.b64encode(value).decode("ascii"))
        texts = self._collect(name, value_ring(self.index, self.count)[1:], "per-process values")
        out: dict[int, bytes | None] = {self.index: value}
        for p, text in texts.items():
            out[p] = None if text == "-" else base64.b64decode(text[1:])
        return out

    def barrier(self, name: str) -> None:
        """all_gather of nothing: returns once every process arrived."""
        self.all_gather(name, "")


def _coordinator_address() -> str | None:
    try:
        from jax._src import distributed

        return distributed.global_state.coordinator_address
    except Exception:  # noqa: BLE001 - JAX absent or not initialised
        return None


def _coordinator_is_local() -> bool:
    """Whether the JAX coordinator is on this host's loopback (a job on one host)."""
    address = _coordinator_address() or ""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def default_server_address() -> str:
    """The address of this host that the job's coordinator sees: the source address of a route
    to the JAX coordinator (no packet is sent); 127.0.0.1 when there is none."""
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


def _unlocked(folder: str) -> bool:
    """Whether no live manager holds the folder's lock (its process is gone)."""
    path = os.path.join(folder, "LOCK")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclasses.dataclass
class RestoredExtras:
    """What a multi-tier restore read besides the arrays, kept for per_process and metadata."""

    per_process: bytes | None
    metadata: bytes | None
    ring_values: dict[int, bytes | None] = dataclasses.field(default_factory=dict)
    save_id: str = ""


class LocalTier:
    """This process's part of the node-local tier: its holding manager (an engine Manager over
    `<local_dir>/p<index>-of-<count>` that writes holdings), its peer server, and the collective
    steps of latest_step and restore."""

    def __init__(self, local_dir: str, *, coordinator: Any, save_interval_steps: int,
                 max_to_keep: int, address: str | None, port: int, timeout_s: float,
                 engine_options: dict, logger: Any):
        self.dir = os.path.abspath(os.fspath(local_dir))
        _make_private_folder(self.dir)
        self.logger = logger
        self.collective = Collective(coordinator, timeout_s)
        self.index, self.count = self.collective.index, self.collective.count
        self.folder = holding_folder(self.index, self.count)
        # Holdings are rewritten in place by a write-back (overwrite), never synced: the tier
        # is RAM, and a node that loses power loses it whatever was synced.
        self._manager_args = dict(max_to_keep=max_to_keep,
                                  save_interval_steps=save_interval_steps, holding=True,
                                  overwrite=True, sync=False, **engine_options)
        self.manager = self._open_manager()
        self.server = None
        try:
            self.secret = ""
            if self.count > 1:
                self.secret = self.collective.broadcast(
                    "secret", secrets.token_hex(32) if self.index == 0 else None)
                bind = address or default_server_address()
                if address is None and bind.startswith("127.") and not _coordinator_is_local():
                    self.logger.warning(
                        "tensorstash: the local tier's server listens on %s: processes on "
                        "other hosts cannot reach it (no route to a JAX coordinator was found); "
                        "pass local_server_address", bind)
                self.server = _ext.PeerServer(self.dir, address=bind, port=port,
                                              secret=self.secret)
            self.urls = self.collective.all_gather("server",
                                                   self.server.url if self.server else "")
        except BaseException:
            self.close()
            raise
        self.extras: dict[int, RestoredExtras] = {}

    def _open_manager(self) -> Any:
        return _ext.Manager(os.path.join(self.dir, self.folder), **self._manager_args)

    # --- saving -----------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return self.manager.should_save(step)

    def save(self, step: int, arrays: list, *, tree_json: str, metadata_json: str,
             process_state: bytes | None, metrics: dict, codec: str, zstd_level: int,
             async_save: bool) -> bool:
        """Saves this process's holding of `step`, with the per-process values of value_ring
        and the save's id (exchanged through the coordinator: every process calls this for the
        same steps), unless the tier lacks the room (a warning then, and False)."""
        save_id = self.collective.broadcast(f"save-{step}",
                                            new_save_id() if self.index == 0 else None)
        values = self.collective.exchange_ring(f"values-{step}", process_state)
        return self.save_holding(step, arrays, tree_json=tree_json, metadata_json=metadata_json,
                                 save_id=save_id, values=values, metrics=metrics, codec=codec,
                                 zstd_level=zstd_level, async_save=async_save)

    def save_holding(self, step: int, arrays: list, *, tree_json: str, metadata_json: str,
                     save_id: str, values: dict[int, bytes | None], metrics: dict, codec: str,
                     zstd_level: int, async_save: bool) -> bool:
        # The previous local save first (it may still be writing): the free space counts it.
        self.manager.wait_until_finished()
        self._drop_stale_folders()
        needed = _holding_bytes(arrays)
        free = shutil.disk_usage(self.dir).free
        # What the writer needs, plus room for the step it replaces until retention drops it.
        if free < needed + (64 << 20):
            self.logger.warning(
                "tensorstash: local save of step %d skipped: %s needs %d bytes, %d are free "
                "(a save would fill the node's memory)", step, self.dir, needed, free)
            return False
        self.manager.save(step, arrays, tree_json=tree_json, metadata_json=metadata_json,
                          process_state=pack_values(save_id, values), metrics=metrics,
                          codec=codec, zstd_level=zstd_level, async_save=async_save)
        return True

    def _own_committed_steps(self) -> list[int]:
        return _committed_steps(os.path.join(self.dir, self.folder))

    def _drop_stale_folders(self) -> None:
        """Holdings in other process folders on this node whose process is gone (an earlier run,
        or a process now elsewhere) are kept for restores until this process has committed a
        newer step of its own; then their older steps go, so that the tier stays bounded."""
        own = self._own_committed_steps()
        if not own:
            return
        for name in os.listdir(self.dir):
            folder = os.path.join(self.dir, name)
            if name == self.folder or parse_holding_folder(name) is None:
                continue
            if not _unlocked(folder):
                continue
            for entry in os.listdir(folder):
                keep = len(entry) == 10 and entry.isdigit() and int(entry) >= own[-1]
                if entry != "LOCK" and not keep:
                    shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)

    def forget_after_restore(self, step: int, save: tuple | None) -> None:
        """After restoring `step` (of local save `save`, or from persistent storage): the
        holdings on this node of later steps, and of other saves of this step, belong to a
        run that was abandoned; they are removed, so that they neither mix into a later restore
        nor keep retention from dropping the steps of this run. The holding manager is reopened
        to see the folder as it now is."""
        stale = [h for h in describe_local_holdings(self.dir, self.index)
                 if h.step > step or (h.step == step and save is not None and h.save != save)]
        if not stale:
            return
        self.manager.close()
        try:
            for h in stale:
                shutil.rmtree(os.path.join(self.dir, h.folder, _ext.Manager.step_dir(h.step)),
                              ignore_errors=True)
        finally:
            self.manager = self._open_manager()

    def wait_until_finished(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.manager.close()
        finally:
            if getattr(self, "server", None) is not None:
                self.server.close()

    # --- which steps exist --------------------------------------------------------------------

    def local_steps(self) -> list[int]:
        """Steps this node holds (any process folder), ascending. Not collective."""
        return sorted({h.step for h in describe_local_holdings(self.dir, self.index)})

    def gather(self, persistent_steps: list[int]) -> tuple[list[Holding], list[int]]:
        """Collective: every process's holdings, and process 0's persistent steps."""
        mine = describe_local_holdings(self.dir, self.index)
        docs = self.collective.all_gather("holdings", json.dumps([h.to_json() for h in mine]))
        holdings = [Holding.from_json(d) for doc in docs for d in json.loads(doc)]
        persistent = json.loads(self.collective.broadcast(
            "persistent", json.dumps(persistent_steps) if self.index == 0 else None))
        return holdings, [int(s) for s in persistent]

    # --- restoring ----------------------------------------------------------------------------

    def holders(self, step: int, save: tuple | None, holdings: list[Holding],
                persistent: list[int], persistent_root: str) -> list[tuple[str, str, str, str]]:
        """The holders of `step` for Reader.tiered, cheapest first: this node's holdings of the
        chosen save, the peers' (starting after this process, so that requests spread), then
        persistent storage."""
        step_dir = _ext.Manager.step_dir(step)
        of_save = [h for h in holdings if save is not None and h.save == save]
        out = [("local", self.dir, f"{h.folder}/{step_dir}", "")
               for h in of_save if h.holder == self.index]
        for offset in range(1, self.count):
            p = (self.index + offset) % self.count
            out += [("peer", self.urls[p], f"{h.folder}/{step_dir}", self.secret)
                    for h in of_save if h.holder == p]
        if step in persistent:
            out.append(("persistent", persistent_root, step_dir, ""))
        return out

    def read_extras(self, reader: Any, step: int, save: tuple | None, holdings: list[Holding],
                    persistent: list[int], persistent_root: str) -> RestoredExtras:
        """The step's metadata, and the per-process values of value_ring(this index) (its own
        first), CRC-checked: from the holdings of the chosen save that carry them (this node's
        first), else this process's value from the persistent step. OSError when this
        process's value is held but none of its holders gives it."""
        metadata = _read_optional(reader, _ext.METADATA_FILE)
        step_dir = _ext.Manager.step_dir(step)
        wanted = set(value_ring(self.index, self.count))
        values: dict[int, bytes | None] = {}
        errors = []
        candidates = [h for h in holdings if save is not None and h.save == save
                      and wanted & set(h.values)]
        candidates.sort(key=lambda h: (self.index not in h.values, h.holder != self.index))
        for h in candidates:
            if wanted <= values.keys():
                break
            if h.holder == self.index:
                holder = ("local", self.dir, f"{h.folder}/{step_dir}", "")
            else:
                holder = ("peer", self.urls[h.holder], f"{h.folder}/{step_dir}", self.secret)
            try:
                single = _ext.Reader.tiered([holder])
                try:
                    data = single.read_file(_ext.process_state_file_name(0))
                finally:
                    single.close()
                _, found = unpack_values(data, f"{holder[1]}/{holder[2]}")
            except (OSError, ValueError, ConnectionError) as e:
                errors.append(f"{holder[1]}/{holder[2]}: {e}")
                continue
            for index, value in found.items():
                if index in wanted:
                    values.setdefault(index, value)
        if self.index not in values and step in persistent:
            persistent_reader = _ext.Reader(persistent_root, step_dir)
            try:
                values[self.index] = _read_optional(
                    persistent_reader, _ext.process_state_file_name(self.index))
            finally:
                persistent_reader.close()
        if self.index not in values and save is not None:
            raise OSError(f"tensorstash: the per-process value of process {self.index} saved "
                          f"with step {step} could not be read from any holder: "
                          + "; ".join(errors or ["none carries it"]))
        return RestoredExtras(per_process=values.get(self.index), metadata=metadata,
                              ring_values=values, save_id=save[1] if save else "")


def _committed_steps(folder: str) -> list[int]:
    """The committed step folders in `folder`, ascending."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(int(n) for n in names if len(n) == 10 and n.isdigit()
                  and os.path.exists(os.path.join(folder, n, "COMMIT")))


def _make_private_folder(path: str) -> None:
    """Creates `path` (mode 0700) if missing, and refuses one that another user owns or can
    write: its holdings are published to the job's processes and restored from, so nobody
    else may plant steps there."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.geteuid():
        raise PermissionError(f"local_dir {path} belongs to user {info.st_uid}, not to this "
                              f"process's user {os.geteuid()}")
    if info.st_mode & 0o022:
        os.chmod(path, info.st_mode & ~0o077)


def _read_optional(reader: Any, name: str) -> bytes | None:
    try:
        return reader.read_file(name)
    except FileNotFoundError:
        return None


def _holding_bytes(arrays: list) -> int:
    """The bytes of the distinct boxes among a save's shards (what a holding stores)."""
    seen = set()
    total = 0
    for path, _dtype, _shape, shards, _stable in arrays:
        for origin, extent, data, _replica, _n in shards:
            key = (path, tuple(origin), tuple(extent))
            if key not in seen:
                seen.add(key)
                total += data.nbytes
    return total
