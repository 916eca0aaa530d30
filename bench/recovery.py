#!/usr/bin/env python3
"""The recovery benchmark of the node-local ("multi-tier") tier of tensorstash.CheckpointManager
(issue 15; bench/README.md, "recovery").

    python bench/recovery.py [--size-mib 512] [--runs 5] [--warmup 1]
                             [--dir /tmp/tensorstash-bench-recovery]
                             [--local-dir /dev/shm/tensorstash-bench-recovery]
                             [--out bench/results] [--skip-orbax] [--keep]
                             [--emergency-timeout 600]

On the CPU (no GPU needed), in one process but for Orbax's emergency manager's run (below). The state: 8 float32 arrays of --size-mib / 8 each
(rows x 1024, random values). A CheckpointManager with local_dir on a tmpfs (--local-dir) saves
it as step 1 to both tiers (the persistent root under --dir). Then, each measurement repeated
--warmup + --runs times (the warm-ups not counted; medians of the counted runs), the
participants in an order that rotates run by run:

restores (the time until every array is in host memory; "x raw" = time / raw RAM read):
  raw           the baseline: the holding's data files (<local>/p0-of-1/0000000001/**/*.dat,
                on the tmpfs) read with readinto into preallocated, pre-touched NumPy buffers
  raw-fresh     the same into buffers allocated in the timed region (their page faults count,
                as a restore's do; for reference)
  local         tensorstash from the local tier only: Reader.tiered([("local", ...)]) and
                _restore(target=None) through it (open, read, CRC checks, close)
  peer          from a peer only: a PeerServer on 127.0.0.1 serving the local tier's folder,
                read over loopback HTTP by Reader.tiered([("peer", url, ..., secret)])
  raw-http      the transport's own speed, the peer's baseline: the holding's data files
                fetched from the same server by one curl process (one connection, to
                /dev/null, no CRC), if the curl program is installed
  persistent    from the persistent tier only, page cache warm (its files read once before
                each run, untimed) and cold (sync + echo 3 > /proc/sys/vm/drop_caches first,
                where permitted; the cold runs come after all warm ones: after a drop, mapped
                reads of tmpfs files fault page by page, several times slower here)
  manager       CheckpointManager.restore(1): the real call, which picks the tiers itself
                (every byte should come from "local"; its bytes_from is recorded)
  plain         tensorstash.restore() of the persistent step without a tiered reader (what a
                manager without local_dir does; mmap), warm; and of the local holding's folder
                (the plain reader on the tmpfs): for reference
  orbax-*       Orbax (PyTreeCheckpointer, its defaults) restoring the same NumPy state from
                persistent storage under --dir, warm and cold; Orbax's p2p emergency
                CheckpointManager restoring its local checkpoint (on the same tmpfs) into
                jax.Arrays on 8 CPU devices, next to tensorstash's local tier restoring into the
                same target
saves (how long save() keeps the caller, with async_save and only the local tier due):
  np.copy       a plain np.copy of the state's arrays (the bytes a save must copy at least),
                and np.copyto into preallocated, pre-touched arrays (the memcpy alone)
  local save    CheckpointManager.save(step, state) with save_interval_steps far away, so that
                only the local tier is due; "committed" = until wait_until_finished() returns
  (jax)         the same with the state as jax.Arrays on the 8 CPU devices, and Orbax's p2p
                emergency CheckpointManager saving to its local tier

Orbax's emergency CheckpointManager (orbax.checkpoint.experimental.emergency) is probed on a
small state in this process: in one process it never writes or reads its local tier (the
probe's findings are in the results; bench/README.md). It is then run with two processes
(this script again, --emergency-worker; jax.distributed over 127.0.0.1, 4 CPU devices each,
the replica axis across the processes): process 1 saves the local tier (the save() times are
recorded), then every restore reads it and broadcasts it to process 0 ("orbax-emergency-*";
per run the slower process's time). Every restore of the warm-up runs and of the
first counted run is checked against the state, bit for bit. Writes <out>/recovery.json (every
run, medians, machine, versions, findings) and <out>/recovery.md; removes --dir and --local-dir
afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import inspect
import json
import os
import platform
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import time
import traceback

# JAX (for the Orbax parts) on the CPU with 8 devices (4 in each of the two processes of the
# emergency manager's run, --emergency-worker); set before anything imports JAX.
_WORKER = "--emergency-worker" in sys.argv
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 if _WORKER else 8}"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tensorstash  # noqa: E402
from tensorstash import _ext, _options  # noqa: E402
from tensorstash._restore import _restore  # noqa: E402

from run import _read  # noqa: E402  (bench/ is the script's folder, first on sys.path)
from scenarios import drop_page_cache  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
NUM_ARRAYS = 8
COLS = 1024
STEP = 1
BLOCK = 8 << 20
GOALS = {"local": 1.3, "peer": 2.0}  # issue 15: restore time at most this times the raw read
# The order of the runs: warm restores, cold restores (they drop the page cache), saves.
PHASES = ("restore", "restore-cold", "save")


def log(msg: str) -> None:
    print(msg, flush=True)


class BenchError(RuntimeError):
    pass


# --- helpers --------------------------------------------------------------------------------

def make_state(size_mib: int) -> dict[str, np.ndarray]:
    rows = size_mib * (1 << 20) // NUM_ARRAYS // (COLS * 4)
    if rows < 8 or rows % 8:
        raise BenchError(f"--size-mib {size_mib}: use a multiple of 8 of at least 8")
    rng = np.random.default_rng(15)
    return {f"w{i}": rng.random((rows, COLS), dtype=np.float32) for i in range(NUM_ARRAYS)}


def same(restored, state: dict[str, np.ndarray], what: str) -> None:
    """Bit-for-bit check of a restored tree (NumPy or jax.Arrays) against the state."""
    if sorted(restored) != sorted(state):
        raise BenchError(f"{what}: restored keys {sorted(restored)} != {sorted(state)}")
    for k, want in state.items():
        got = np.asarray(restored[k])
        if got.shape != want.shape or got.dtype != want.dtype or \
                not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            raise BenchError(f"{what}: array {k!r} differs from the saved state")


def files_under(folder: str, suffix: str = "") -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.join(root, n) for n in names if n.endswith(suffix)]
    return sorted(out)


def warm(folder: str) -> None:
    """Reads every file under `folder` once (into the page cache)."""
    buf = bytearray(BLOCK)
    for path in files_under(folder):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def read_into(path: str, buf: np.ndarray) -> None:
    mv = memoryview(buf)
    off = 0
    with open(path, "rb", buffering=0) as f:
        while off < len(mv):
            n = f.readinto(mv[off:])
            if not n:
                raise BenchError(f"{path} ended early")
            off += n


def ts_restore(holders: list, target=None):
    """Opens a tiered reader over `holders`, restores the whole tree through it, closes it.
    Returns (tree, tier_stats)."""
    reader = _ext.Reader.tiered(holders)
    try:
        tree, _ = _restore("recovery-bench", target, truncate=False, verify_checksums=True,
                           max_inflight_bytes=_options.MAX_INFLIGHT_BYTES, io_threads=0,
                           progress=False, mmap=True, reader=reader)
        return tree, reader.tier_stats()
    finally:
        reader.close()


def fmt_s(s: float | None) -> str:
    if s is None:
        return "n/a"
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.2f} s"


def fmt_bytes(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def filesystem(path: str) -> str:
    try:
        out = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "-T", path],
                             capture_output=True, text=True, timeout=10).stdout.splitlines()
        return " ".join(out[0].split()) if out else "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def machine_facts(args) -> dict:
    meminfo = {line.split(":")[0]: line.split(":")[1].strip()
               for line in _read("/proc/meminfo").splitlines() if ":" in line}
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu_count": os.cpu_count(), "cpu": cpu, "memory": meminfo.get("MemTotal", "?"),
            "kernel": platform.release(), "python": platform.python_version(),
            "local_dir_fs": f"{args.local_dir}: {filesystem(args.local_dir)}",
            "dir_fs": f"{args.dir}: {filesystem(args.dir)}"}


def versions() -> dict:
    out = {}
    for name in ("tensorstash", "orbax-checkpoint", "tensorstore", "jax", "jaxlib", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no",
                                "--", "src", "python"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        out["tensorstash_commit"] = commit + (" (+ local changes)" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    out["tensorstash_module"] = os.path.dirname(tensorstash.__file__)
    return out


# --- the participants -----------------------------------------------------------------------

class Case:
    """One measured operation: fn(verify) -> seconds, or (seconds, extras dict)."""

    def __init__(self, name: str, group: str, label: str, fn, nbytes: int, phase: str):
        self.name, self.group, self.label, self.fn, self.nbytes = name, group, label, fn, nbytes
        self.phase = phase
        self.warmup: list[float] = []
        self.runs: list[float] = []
        self.extras: list[dict] = []
        self.skipped: str | None = None

    def median(self) -> float | None:
        return statistics.median(self.runs) if self.runs else None

    def to_json(self) -> dict:
        med = self.median()
        out = {"group": self.group, "label": self.label, "bytes": self.nbytes,
               "warmup_s": self.warmup, "runs_s": self.runs, "median_s": med,
               "min_s": min(self.runs) if self.runs else None,
               "max_s": max(self.runs) if self.runs else None,
               "gbps": self.nbytes / med / 1e9 if med else None}
        if self.extras:
            out["extras"] = self.extras
        if self.skipped:
            out["skipped"] = self.skipped
        return out


class Bench:
    def __init__(self, args):
        self.args = args
        self.cases: dict[str, Case] = {}
        self.findings: dict = {}
        self.cold = False
        self.closers: list = []

    def add(self, name, group, label, fn, nbytes, phase: str | None = None) -> Case:
        """phase: when its runs happen (PHASES); by default its group's."""
        case = Case(name, group, label, fn, nbytes, phase or group)
        self.cases[name] = case
        return case

    # --- setup --------------------------------------------------------------------------------

    def setup(self) -> None:
        a = self.args
        self.state = make_state(a.size_mib)
        self.nbytes = sum(x.nbytes for x in self.state.values())
        self.local = os.path.join(a.local_dir, "tensorstash")
        self.root = os.path.join(a.dir, "tensorstash")
        log(f"state: {NUM_ARRAYS} float32 arrays of {self.state['w0'].shape}, "
            f"{fmt_bytes(self.nbytes)}")

        # Step 1 in both tiers. save_interval_steps far away: later saves (the save stalls)
        # are due in the local tier only.
        self.mgr = tensorstash.CheckpointManager(
            self.root, local_dir=self.local, local_save_interval_steps=1, local_max_to_keep=1,
            save_interval_steps=10 ** 9, async_save=True)
        self.closers.append(self.mgr.close)
        self.mgr.save(STEP, self.state, force=True)
        self.mgr.wait_until_finished()
        if self.mgr.all_steps() != [STEP] or self.mgr.local_steps() != [STEP]:
            raise BenchError(f"step {STEP} should be in both tiers: persistent "
                             f"{self.mgr.all_steps()}, local {self.mgr.local_steps()}")
        step_dir = _ext.Manager.step_dir(STEP)
        self.holding = f"p0-of-1/{step_dir}"
        self.holding_path = os.path.join(self.local, self.holding)
        self.persistent_path = os.path.join(self.root, step_dir)
        self.dat_files = files_under(self.holding_path, ".dat")
        sizes = [os.path.getsize(p) for p in self.dat_files]
        self.dat_bytes = sum(sizes)
        if not self.dat_files or self.dat_bytes < self.nbytes:
            raise BenchError(f"{self.holding_path}: data files {self.dat_files} hold "
                             f"{self.dat_bytes} bytes, fewer than the state's {self.nbytes}")
        # The raw read's and np.copyto's buffers: allocated and touched once, untimed.
        self.raw_buffers = [np.ones(n, np.uint8) for n in sizes]
        self.copy_buffers = [np.ones_like(v) for v in self.state.values()]

        self.secret = secrets.token_hex(16)
        self.server = _ext.PeerServer(self.local, address="127.0.0.1", port=0,
                                      secret=self.secret)
        self.closers.append(self.server.close)
        # Whether drop_caches may be written (checked without dropping anything: a drop makes
        # later mapped reads of the tmpfs fault page by page, so the cold runs come last).
        self.cold = os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)
        log(f"holding: {len(self.dat_files)} data file(s), {fmt_bytes(self.dat_bytes)}; "
            f"peer server {self.server.url}; drop_caches "
            f"{'permitted' if self.cold else 'not permitted'}")

        n = self.nbytes
        self.add("raw", "restore", "raw RAM read (readinto, preallocated buffers)",
                 self.raw_read, self.dat_bytes)
        self.add("raw-fresh", "restore", "raw RAM read into fresh buffers", self.raw_read_fresh,
                 self.dat_bytes)
        self.add("local", "restore", "tensorstash, local tier only", self.restore_local, n)
        self.add("peer", "restore", "tensorstash, peer only (HTTP over 127.0.0.1)",
                 self.restore_peer, n)
        if shutil.which("curl"):
            self.add("raw-http", "restore", "raw HTTP transfer of the same files (curl, "
                     "127.0.0.1, to /dev/null)", self.raw_http, self.dat_bytes)
        else:
            log("no curl program: the raw-http baseline is left out")
        self.add("persistent-warm", "restore", "tensorstash, persistent tier only (warm cache)",
                 self.restore_persistent_warm, n)
        cold = self.add("persistent-cold", "restore",
                        "tensorstash, persistent tier only (cold cache)",
                        self.restore_persistent_cold, n, phase="restore-cold")
        self.add("manager", "restore", "tensorstash CheckpointManager.restore (picks the tiers)",
                 self.restore_manager, n)
        self.add("plain-warm", "restore",
                 "tensorstash.restore of the persistent step, no tiered reader (warm)",
                 self.restore_plain, n)
        self.add("local-plain", "restore",
                 "tensorstash.restore of the local holding's folder, no tiered reader",
                 self.restore_local_plain, n)
        self.add("np-copy", "save", "np.copy of the state (fresh arrays)", self.np_copy, n)
        self.add("np-copyto", "save", "np.copyto into preallocated arrays (memcpy only)",
                 self.np_copyto, n)
        self.add("local-save", "save", "tensorstash save(), only the local tier due",
                 self.local_save, n)
        if not self.cold:
            cold.skipped = "drop_caches not permitted"
        self.next_step = STEP + 1

        if not self.args.skip_orbax:
            try:
                self.setup_orbax()
            except Exception as e:  # noqa: BLE001 - the tensorstash part still runs
                self.findings["orbax_error"] = f"{type(e).__name__}: {e}"
                log(f"Orbax unavailable, its parts skipped: {e}\n{traceback.format_exc()}")

    def setup_orbax(self) -> None:
        import jax
        from absl import logging as absl_logging
        import orbax.checkpoint as ocp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        absl_logging.set_verbosity(absl_logging.ERROR)
        self.jax, self.ocp = jax, ocp
        a = self.args
        devices = jax.devices()
        if len(devices) != 8:
            raise BenchError(f"expected 8 CPU devices, got {devices}")
        # A 2x4 mesh whose first axis is the replica axis (Orbax's emergency managers'
        # replica_axis_index=0); the rows split over all 8 devices.
        self.mesh = Mesh(np.array(devices).reshape(2, 4), ("replica", "model"))
        sharding = NamedSharding(self.mesh, P(("replica", "model"), None))
        self.abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                         for k, v in self.state.items()}

        # The emergency CheckpointManager, on a small state: what it does in one process.
        self.findings["orbax_emergency"] = self.probe_emergency()

        # Orbax restoring the same NumPy state from persistent storage (its defaults, as in
        # bench/worker.py).
        self.orbax_path = os.path.join(a.dir, "orbax", "1")
        self.ckptr = ocp.PyTreeCheckpointer()
        self.ckptr.save(self.orbax_path, args=ocp.args.PyTreeSave(self.state))
        n = self.nbytes
        self.add("orbax-persistent-warm", "restore",
                 "Orbax PyTreeCheckpointer, persistent (warm cache)",
                 self.orbax_restore_warm, n)
        cold = self.add("orbax-persistent-cold", "restore",
                        "Orbax PyTreeCheckpointer, persistent (cold cache)",
                        self.orbax_restore_cold, n, phase="restore-cold")
        if not self.cold:
            cold.skipped = "drop_caches not permitted"

        # Orbax's p2p emergency CheckpointManager: local tier on the same tmpfs, no persistent
        # directory (its local restore is what is measured); jax.Arrays on the 8 devices.
        from orbax.checkpoint.experimental.emergency.p2p import args as p2p_args
        from orbax.checkpoint.experimental.emergency.p2p import checkpoint_manager as p2p
        from orbax.checkpoint.experimental.emergency.p2p import options as p2p_options

        self.p2p_args = p2p_args
        self.jax_state = {k: jax.device_put(v, sharding) for k, v in self.state.items()}
        jax.block_until_ready(self.jax_state)
        p2p_local = os.path.join(a.local_dir, "orbax-p2p")
        os.makedirs(p2p_local, exist_ok=True)
        options = p2p_options.CheckpointManagerOptions(
            local=p2p_options.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=1))
        self.p2p = p2p.CheckpointManager(self.mesh, self.abstract, p2p_local, None,
                                         options=options)
        self.closers.insert(0, self.p2p.close)
        self.p2p.save(STEP, args=p2p_args.Composite(state=ocp.args.PyTreeSave(self.jax_state)))
        self.p2p.wait_until_finished()
        self.p2p.reload()
        local_steps = list(self.p2p._local_manager.all_steps())
        if STEP not in local_steps:
            raise BenchError(f"Orbax p2p manager: step {STEP} not in its local tier "
                             f"({local_steps})")
        self.findings["orbax_p2p"] = {
            "class": "orbax.checkpoint.experimental.emergency.p2p.CheckpointManager",
            "local_dir_files": len(files_under(p2p_local)),
            "local_dir_bytes": sum(os.path.getsize(p) for p in files_under(p2p_local)),
            "note": "runs in one process on CPU devices; its restore of a step this process "
                    "holds reads its local directory (_restore_from_local_or_p2p); its peer "
                    "fetch needs another process holding the step, so only its local restore "
                    "is timed",
            "save_note": "its save() blocks for the device-to-host transfer only "
                         "(replica_slices.transfer_arrays_to_host: copy_to_host_async, then "
                         "np.asarray), which for jax.Arrays on CPU devices is a view of the "
                         "device buffer, not a copy; the bytes are read in the background"}
        self.p2p_step = STEP + 1
        self.add("orbax-p2p-local", "restore",
                 "Orbax p2p emergency manager, local tier -> jax.Arrays (8 CPU devices)",
                 self.orbax_p2p_restore, n)
        self.add("local-jax", "restore",
                 "tensorstash, local tier only -> jax.Arrays (same target)",
                 self.restore_local_jax, n)
        self.add("local-save-jax", "save",
                 "tensorstash save() of jax.Arrays, only the local tier due",
                 self.local_save_jax, n)
        self.add("orbax-p2p-save", "save",
                 "Orbax p2p emergency manager save() of jax.Arrays (local tier)",
                 self.orbax_p2p_save, n)

    def probe_emergency(self) -> dict:
        """Runs orbax.checkpoint.experimental.emergency.CheckpointManager in this process on a
        small state and records what it does: which inner manager it builds, whether it writes
        its local directory, and which path restore() takes."""
        jax, ocp = self.jax, self.ocp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from orbax.checkpoint.experimental.emergency import checkpoint_manager as em

        out: dict = {"class": "orbax.checkpoint.experimental.emergency.CheckpointManager",
                     "source": inspect.getsourcefile(em)}
        base = os.path.join(self.args.dir, "orbax-emergency")
        for shape in ((2, 4), (1, 8)):
            key = f"mesh_{shape[0]}x{shape[1]}"
            r: dict = {}
            out[key] = r
            local = os.path.join(self.args.local_dir, f"orbax-emergency-{key}")
            persistent = os.path.join(base, key)
            for d in (local, persistent):
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
            mesh = Mesh(np.array(jax.devices()).reshape(shape), ("replica", "model"))
            # Sharded over "model", replicated over the replica axis: the data-parallel layout
            # the manager is made for (it restores one replica and broadcasts it).
            sharding = NamedSharding(mesh, P("model", None))
            small = {f"w{i}": jax.device_put(np.full((64, 256), i, np.float32), sharding)
                     for i in range(2)}
            abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                        for k, v in small.items()}
            options = em.CheckpointManagerOptions(
                local=em.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=1),
                persistent=em.PersistentCheckpointOptions(save_interval_steps=1000))
            try:
                mgr = em.CheckpointManager(local, persistent, mesh, abstract, options=options)
                inner = mgr._checkpoint_manager
                r["inner_manager"] = f"{type(inner).__module__}.{type(inner).__name__}"
                r["replica_count"] = mgr._slice_count
                r["in_primary_slice"] = mgr.in_primary_slice
                r["has_local_manager"] = hasattr(inner, "_local_checkpoint_manager")
                paths = []
                for name in ("_restore_from_local", "_restore_from_persistent"):
                    if hasattr(inner, name):
                        original = getattr(inner, name)

                        def traced(*a, _name=name, _original=original, **kw):
                            paths.append(_name)
                            return _original(*a, **kw)

                        setattr(inner, name, traced)
                args = lambda: ocp.args.Composite(state=ocp.args.PyTreeSave(small))  # noqa: E731
                r["save_step_1"] = bool(mgr.save(1, args=args()))
                mgr.wait_until_finished()
                r["save_step_2"] = bool(mgr.save(2, args=args()))
                mgr.wait_until_finished()
                r["local_dir_files_after_saves"] = len(files_under(local))
                r["persistent_steps"] = sorted(os.listdir(persistent))
                restored = mgr.restore(1)
                same(restored.state, {k: np.asarray(v) for k, v in small.items()},
                     f"Orbax emergency manager ({key})")
                r["restore_step_1"] = "ok"
                r["restore_path"] = paths or ["(the inner CheckpointManager's restore)"]
                mgr.close()
            except Exception as e:  # noqa: BLE001 - recorded, not raised
                r["error"] = f"{type(e).__name__}: {e}"
                r["traceback"] = traceback.format_exc()[-3000:]
            finally:
                for d in (local, persistent):
                    shutil.rmtree(d, ignore_errors=True)
            shown = {k: v for k, v in r.items() if k != "traceback"}
            log(f"Orbax emergency manager on a {key} mesh: {json.dumps(shown)}")
        two = out["mesh_2x4"]
        out["local_tier_used"] = bool(two.get("local_dir_files_after_saves")) or \
            "_restore_from_local" in two.get("restore_path", [])
        if out["local_tier_used"]:
            out["conclusion"] = ("Unexpected for this version: in one process it wrote or read "
                                 "its local tier (see the probe's facts).")
            return out
        out["conclusion"] = (
            "In one process it runs on CPU devices but never uses its local tier. With a replica "
            "axis of 2 (mesh 2x4) it builds _MultisliceCheckpointManager, and the only process "
            "holds devices of replica 0, the primary slice (in_primary_slice True); "
            "_MultisliceCheckpointManager.__init__ then creates only the persistent manager "
            "(`if self._in_primary_slice: ... self._persistent_checkpoint_manager = ...`, the "
            "local manager only in the `else` branch: local checkpoints are written by the "
            "processes of the non-primary replicas); save() saves persistently only (at the "
            "persistent interval, so step 2 is not saved at all although the local interval is "
            "1), the local directory stays empty, and restore() finds no replica with a local "
            "copy and goes through _restore_from_persistent. With a replica axis of 1 (mesh 1x8) "
            "CheckpointManager.__init__ `del local_directory` and wraps a plain persistent "
            "CheckpointManager. Its local tier needs at least 2 processes, one of them in no "
            "primary-slice replica.")
        return out

    # --- restores -----------------------------------------------------------------------------

    def raw_read(self, verify: bool) -> float:
        t0 = time.perf_counter()
        for path, buf in zip(self.dat_files, self.raw_buffers):
            read_into(path, buf)
        return time.perf_counter() - t0

    def raw_read_fresh(self, verify: bool) -> float:
        t0 = time.perf_counter()
        bufs = []
        for path, ref in zip(self.dat_files, self.raw_buffers):
            buf = np.empty(ref.size, np.uint8)
            read_into(path, buf)
            bufs.append(buf)
        dt = time.perf_counter() - t0
        del bufs
        return dt

    def raw_http(self, verify: bool) -> float:
        command = ["curl", "--silent", "--fail", "--header", f"X-Tensorstash-Secret: {self.secret}"]
        for path in self.dat_files:
            key = os.path.relpath(path, self.local)
            command += ["--output", "/dev/null", f"{self.server.url}/v1/object/{key}"]
        t0 = time.perf_counter()
        subprocess.run(command, check=True)
        return time.perf_counter() - t0

    def _timed_ts(self, holders: list, what: str, verify: bool, target=None):
        t0 = time.perf_counter()
        tree, stats = ts_restore(holders, target)
        if target is not None:
            self.jax.block_until_ready(tree)
        dt = time.perf_counter() - t0
        if verify:
            same(tree, self.state, what)
        del tree
        return dt, {"bytes_from": stats["bytes"], "seconds_from": stats["seconds"],
                    "failures": stats["failures"], "open_errors": stats["open_errors"]}

    def restore_local(self, verify: bool):
        return self._timed_ts([("local", self.local, self.holding, "")], "local", verify)

    def restore_peer(self, verify: bool):
        return self._timed_ts([("peer", self.server.url, self.holding, self.secret)], "peer",
                              verify)

    def restore_persistent_warm(self, verify: bool):
        warm(self.persistent_path)
        return self._timed_ts([("persistent", self.root, _ext.Manager.step_dir(STEP), "")],
                              "persistent (warm)", verify)

    def restore_persistent_cold(self, verify: bool):
        if not drop_page_cache():
            raise BenchError("drop_caches stopped being permitted")
        return self._timed_ts([("persistent", self.root, _ext.Manager.step_dir(STEP), "")],
                              "persistent (cold)", verify)

    def restore_manager(self, verify: bool):
        t0 = time.perf_counter()
        tree = self.mgr.restore(STEP)
        dt = time.perf_counter() - t0
        stats = self.mgr.last_restore_stats
        if verify:
            same(tree, self.state, "CheckpointManager.restore")
        del tree
        return dt, {"bytes_from": dict(stats.bytes_from), "seconds_from": dict(stats.seconds_from),
                    "failures": list(stats.failures)}

    def restore_plain(self, verify: bool):
        warm(self.persistent_path)
        t0 = time.perf_counter()
        tree = tensorstash.restore(self.persistent_path, progress=False)
        dt = time.perf_counter() - t0
        if verify:
            same(tree, self.state, "tensorstash.restore")
        del tree
        return dt

    def restore_local_plain(self, verify: bool):
        t0 = time.perf_counter()
        tree = tensorstash.restore(self.holding_path, progress=False)
        dt = time.perf_counter() - t0
        if verify:
            same(tree, self.state, "tensorstash.restore of the holding")
        del tree
        return dt

    def restore_local_jax(self, verify: bool):
        return self._timed_ts([("local", self.local, self.holding, "")], "local -> jax",
                              verify, target=self.abstract)

    def _orbax_restore(self, verify: bool, what: str) -> float:
        ocp = self.ocp
        restore_args = ocp.checkpoint_utils.construct_restore_args(self.state)
        t0 = time.perf_counter()
        tree = self.ckptr.restore(self.orbax_path, args=ocp.args.PyTreeRestore(
            item=self.state, restore_args=restore_args))
        dt = time.perf_counter() - t0
        if verify:
            same(tree, self.state, what)
        del tree
        return dt

    def orbax_restore_warm(self, verify: bool) -> float:
        warm(self.orbax_path)
        return self._orbax_restore(verify, "Orbax persistent (warm)")

    def orbax_restore_cold(self, verify: bool) -> float:
        if not drop_page_cache():
            raise BenchError("drop_caches stopped being permitted")
        return self._orbax_restore(verify, "Orbax persistent (cold)")

    def orbax_p2p_restore(self, verify: bool):
        ocp = self.ocp
        args = self.p2p_args.Composite(state=ocp.args.PyTreeRestore(item=self.abstract))
        from_local = STEP in self.p2p._local_manager.all_steps()
        t0 = time.perf_counter()
        out = self.p2p.restore(STEP, args=args)
        self.jax.block_until_ready(out.state)
        dt = time.perf_counter() - t0
        if verify:
            same(out.state, self.state, "Orbax p2p local")
        del out
        return dt, {"step_in_local_tier": from_local}

    # --- saves --------------------------------------------------------------------------------

    def np_copy(self, verify: bool) -> float:
        t0 = time.perf_counter()
        copies = [np.copy(v) for v in self.state.values()]
        dt = time.perf_counter() - t0
        del copies
        return dt

    def np_copyto(self, verify: bool) -> float:
        t0 = time.perf_counter()
        for dst, src in zip(self.copy_buffers, self.state.values()):
            np.copyto(dst, src)
        return time.perf_counter() - t0

    def _local_save(self, state) -> tuple[float, dict]:
        step, self.next_step = self.next_step, self.next_step + 1
        t0 = time.perf_counter()
        saved = self.mgr.save(step, state)
        blocked = time.perf_counter() - t0
        self.mgr.wait_until_finished()
        committed = time.perf_counter() - t0
        if not saved or step in self.mgr.all_steps() or step not in self.mgr.local_steps():
            raise BenchError(f"step {step} should have been saved to the local tier only "
                             f"(persistent {self.mgr.all_steps()}, "
                             f"local {self.mgr.local_steps()})")
        return blocked, {"step": step, "committed_s": committed}

    def local_save(self, verify: bool):
        return self._local_save(self.state)

    def local_save_jax(self, verify: bool):
        return self._local_save(self.jax_state)

    def orbax_p2p_save(self, verify: bool):
        ocp = self.ocp
        step, self.p2p_step = self.p2p_step, self.p2p_step + 1
        args = self.p2p_args.Composite(state=ocp.args.PyTreeSave(self.jax_state))
        t0 = time.perf_counter()
        saved = self.p2p.save(step, args=args)
        blocked = time.perf_counter() - t0
        self.p2p.wait_until_finished()
        committed = time.perf_counter() - t0
        if not saved:
            raise BenchError(f"the Orbax p2p manager did not save step {step}")
        return blocked, {"step": step, "committed_s": committed}

    # --- running ------------------------------------------------------------------------------

    def run(self) -> None:
        a = self.args
        total = a.warmup + a.runs
        for phase in PHASES:
            cases = [c for c in self.cases.values() if c.phase == phase and not c.skipped]
            if cases and phase == "restore-cold" and not drop_page_cache():
                self.cold = False
                for c in cases:
                    c.skipped = "drop_caches not permitted"
                continue
            for run in range(total if cases else 0):
                counted = run >= a.warmup
                verify = run <= a.warmup
                k = run % len(cases)
                order = cases[k:] + cases[:k]
                line = []
                for case in order:
                    gc.collect()
                    result = case.fn(verify)
                    seconds, extras = result if isinstance(result, tuple) else (result, None)
                    if counted:
                        case.runs.append(seconds)
                        if extras is not None:
                            case.extras.append(extras)
                    else:
                        case.warmup.append(seconds)
                    line.append(f"{case.name} {fmt_s(seconds)}")
                log(f"{phase} run {run + 1}/{total}{'' if counted else ' (warm-up)'}: "
                    + ", ".join(line))

    def add_emergency(self, em: dict) -> None:
        """The results of run_emergency as cases (their runs come from the two processes)."""
        self.findings["orbax_emergency_two_processes"] = em
        if "error" in em:
            log(f"Orbax emergency manager, two processes: failed: {em['error'][-2000:]}")
            return
        w = em["warmup"]
        for name, group, label, key in (
                ("orbax-emergency-local", "restore",
                 "Orbax emergency manager, 2 processes: local tier + broadcast -> jax.Arrays",
                 "restore_s"),
                ("orbax-emergency-save", "save",
                 "Orbax emergency manager save(), 2 processes, local tier due", "save_s")):
            case = self.add(name, group, label, None, self.nbytes)
            case.warmup, case.runs = em[key][:w], em[key][w:]
            if key == "save_s":
                case.extras = [{"committed_s": c} for c in em["committed_s"][w:]]
        log("Orbax emergency manager, two processes: restores "
            + ", ".join(fmt_s(x) for x in em["restore_s"]) + "; saves "
            + ", ".join(fmt_s(x) for x in em["save_s"]))

    def close(self) -> None:
        for close in self.closers:
            try:
                close()
            except Exception as e:  # noqa: BLE001
                log(f"closing: {e}")


# --- Orbax's emergency CheckpointManager, two processes -------------------------------------

def emergency_worker(args) -> None:
    """One of the two processes (jax.distributed over 127.0.0.1, 4 CPU devices each, gloo for
    the cross-process collectives) of the emergency manager's run: a 2x4 mesh whose replica
    axis spans the processes, the state sharded over "model" and replicated over "replica".
    Process 0 is the primary slice (persistent saves), process 1 saves the local tier (its own
    folder, as on its own node). Saves steps 2.. (local only) timing save(), then restores the
    last one, timing each restore; prints RECOVERY_RESULT {json}."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.emergency_port}",
                               num_processes=2, process_id=args.emergency_worker)
    from absl import flags, logging as absl_logging
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from orbax.checkpoint._src.multihost import multihost
    from orbax.checkpoint.experimental.emergency import checkpoint_manager as em

    absl_logging.set_verbosity(absl_logging.ERROR)
    flags.FLAGS.mark_as_parsed()  # the emergency restore reads an Orbax absl flag
    multihost.initialize_runtime_to_distributed_ids()  # what its restore needs
    multihost.initialize_distributed_to_device_ids()
    rank = jax.process_index()
    state = make_state(args.size_mib)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "model"))
    sharding = NamedSharding(mesh, P("model", None))
    jstate = {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
              for k, v in state.items()}
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                for k, v in state.items()}
    local = os.path.join(args.local_dir, "orbax-emergency-2p", f"p{rank}")
    persistent = os.path.join(args.dir, "orbax-emergency-2p")
    os.makedirs(local, exist_ok=True)
    os.makedirs(persistent, exist_ok=True)
    multihost_utils.sync_global_devices("recovery: folders")
    options = em.CheckpointManagerOptions(
        local=em.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=1),
        persistent=em.PersistentCheckpointOptions(save_interval_steps=10 ** 9))
    mgr = em.CheckpointManager(local, persistent, mesh, abstract, options=options)
    inner = mgr._checkpoint_manager
    paths: list[str] = []
    for name in ("_restore_from_local", "_restore_from_persistent"):
        original = getattr(inner, name)

        def traced(*a, _name=name, _original=original, **kw):
            paths.append(_name)
            return _original(*a, **kw)

        setattr(inner, name, traced)
    out = {"rank": rank, "in_primary_slice": mgr.in_primary_slice, "save_s": [],
           "committed_s": [], "restore_s": [], "restore_paths": []}
    save_args = ocp.args.Composite(state=ocp.args.PyTreeSave(jstate))
    # Step 1: the first save (Orbax saves it persistently too); then the timed local saves.
    mgr.save(1, args=save_args)
    mgr.wait_until_finished()
    total = args.warmup + args.runs
    step = 1
    for _ in range(total):
        step += 1
        multihost_utils.sync_global_devices(f"recovery: save {step}")
        t0 = time.perf_counter()
        saved = mgr.save(step, args=save_args)
        out["save_s"].append(time.perf_counter() - t0)
        mgr.wait_until_finished()
        out["committed_s"].append(time.perf_counter() - t0)
        if not saved:
            raise BenchError(f"the emergency manager did not save step {step}")
    out["local_files"] = len(files_under(local))
    out["persistent_steps"] = sorted(os.listdir(persistent))
    mgr.reload()
    for run in range(total):
        paths.clear()
        multihost_utils.sync_global_devices(f"recovery: restore {run}")
        gc.collect()
        t0 = time.perf_counter()
        restored = mgr.restore(step)
        jax.block_until_ready(restored.state)
        out["restore_s"].append(time.perf_counter() - t0)
        out["restore_paths"].append(list(paths))
        if run <= args.warmup:
            for k, arr in restored.state.items():
                for shard in arr.addressable_shards:
                    if not np.array_equal(np.asarray(shard.data), state[k][shard.index]):
                        raise BenchError(f"emergency restore: {k!r} differs on {shard.device}")
        del restored
    out["step"] = step
    mgr.close()
    print("RECOVERY_RESULT " + json.dumps(out), flush=True)


def run_emergency(args) -> dict:
    """Runs the two emergency_worker processes and combines their results: per run, the
    slower process's time (the job has restored once both have)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = [sys.executable, os.path.abspath(__file__), "--size-mib", str(args.size_mib),
            "--runs", str(args.runs), "--warmup", str(args.warmup), "--dir", args.dir,
            "--local-dir", args.local_dir, "--emergency-port", str(port)]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [subprocess.Popen(base + ["--emergency-worker", str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    results, errors = [], []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=args.emergency_timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            stdout, stderr = proc.communicate()
            errors.append(f"ran past {args.emergency_timeout} s")
        lines = [line for line in stdout.splitlines() if line.startswith("RECOVERY_RESULT ")]
        if proc.returncode != 0 or not lines:
            errors.append(f"worker exited {proc.returncode}: {stderr[-3000:]}")
        else:
            results.append(json.loads(lines[-1][len("RECOVERY_RESULT "):]))
    if errors or len(results) != 2:
        return {"error": "\n".join(errors)}
    w = args.warmup
    combined = {"processes": results,
                "restore_s": [max(a, b) for a, b in zip(results[0]["restore_s"],
                                                         results[1]["restore_s"])],
                "save_s": [max(a, b) for a, b in zip(results[0]["save_s"], results[1]["save_s"])],
                "committed_s": [max(a, b) for a, b in zip(results[0]["committed_s"],
                                                          results[1]["committed_s"])]}
    combined["warmup"] = w
    combined["local_tier_used"] = all(
        paths == ["_restore_from_local"] for r in results for paths in r["restore_paths"])
    return combined


# --- the results ----------------------------------------------------------------------------

def summarize(bench: Bench, meta: dict) -> dict:
    cases = {name: c.to_json() for name, c in bench.cases.items()}
    med = {name: c["median_s"] for name, c in cases.items()}
    raw = med.get("raw")
    for name, c in cases.items():
        if c["group"] == "restore" and raw and c["median_s"]:
            c["x_raw"] = c["median_s"] / raw
    copy, memcpy = med.get("np-copy"), med.get("np-copyto")
    for name, c in cases.items():
        if c["group"] == "save" and copy and c["median_s"]:
            c["x_np_copy"] = c["median_s"] / copy
        if c["group"] == "save" and memcpy and c["median_s"]:
            c["x_np_copyto"] = c["median_s"] / memcpy
        if c.get("extras") and "committed_s" in c["extras"][0]:
            c["committed_median_s"] = statistics.median(e["committed_s"] for e in c["extras"])
    goals = {}
    for name, limit in GOALS.items():
        x = cases.get(name, {}).get("x_raw")
        goals[name] = {"goal_x_raw": limit, "x_raw": x, "met": x is not None and x <= limit}

    def ratio(slow: str, fast: str):
        s, f = med.get(slow), med.get(fast)
        return {"numerator": slow, "denominator": fast,
                "ratio": s / f if s and f else None}

    ratios = {
        "ts_peer_over_raw_http": ratio("peer", "raw-http"),
        "orbax_persistent_warm_over_ts_local": ratio("orbax-persistent-warm", "local"),
        "orbax_persistent_warm_over_ts_peer": ratio("orbax-persistent-warm", "peer"),
        "orbax_persistent_cold_over_ts_local": ratio("orbax-persistent-cold", "local"),
        "orbax_persistent_cold_over_ts_peer": ratio("orbax-persistent-cold", "peer"),
        "orbax_persistent_warm_over_ts_persistent_warm": ratio("orbax-persistent-warm",
                                                               "persistent-warm"),
        "orbax_p2p_local_over_ts_local_jax": ratio("orbax-p2p-local", "local-jax"),
        "orbax_p2p_save_blocks_over_ts_save_blocks_jax": ratio("orbax-p2p-save",
                                                               "local-save-jax"),
        "orbax_emergency_local_over_ts_local": ratio("orbax-emergency-local", "local"),
        "orbax_emergency_local_over_ts_local_jax": ratio("orbax-emergency-local", "local-jax"),
        "orbax_emergency_local_over_ts_peer": ratio("orbax-emergency-local", "peer"),
        "orbax_emergency_save_blocks_over_ts_save_blocks_jax": ratio("orbax-emergency-save",
                                                                     "local-save-jax"),
    }
    manager_from = [e["bytes_from"] for e in cases.get("manager", {}).get("extras", [])]
    return {**meta, "cases": cases, "goals": goals, "ratios": ratios,
            "manager_bytes_from": manager_from, "findings": bench.findings}


def write_markdown(res: dict, path: str) -> None:
    cases = res["cases"]
    st = res["state"]
    m = res["machine"]
    v = res["versions"]
    a = res["args"]
    out = ["# The node-local tier: recovery benchmark", "",
           f"{res['date']}, `{res['command']}` ({res['elapsed_s']:.0f} s). Medians of "
           f"{a['runs']} counted runs after {a['warmup']} warm-up run(s), the participants in an "
           "order rotating run by run (warm restores, then cold ones, then saves), in one process "
           "on the CPU (the Orbax emergency manager's rows: two processes, run after the others). "
           "\"x raw\" = time / the raw RAM read's time (lower is better).", "",
           f"- State: {st['arrays']} float32 arrays of {tuple(st['shape'])}, "
           f"{fmt_bytes(st['bytes'])}; the local holding's data files: "
           f"{st['holding_data_files']} file(s), {fmt_bytes(st['holding_data_bytes'])}.",
           f"- Machine: {m['cpu_count']} cores ({m['cpu']}), {m['memory']} memory, Linux "
           f"{m['kernel']}; local tier {m['local_dir_fs']}; persistent {m['dir_fs']}; load "
           f"average {' '.join(res['load_average_start'])} at the start, "
           f"{' '.join(res['load_average_end'])} at the end (a shared machine: single runs are "
           "noisy).",
           f"- Versions: tensorstash {v.get('tensorstash')} ({v.get('tensorstash_commit', '?')}),"
           f" orbax-checkpoint {v.get('orbax-checkpoint')}, tensorstore {v.get('tensorstore')},"
           f" jax {v.get('jax')}, numpy {v.get('numpy')}, Python {m['python']}.",
           f"- Cold cache (`echo 3 > /proc/sys/vm/drop_caches`): {res['drop_caches']}.", "",
           "## Restores", "",
           "| restore | bytes | median | GB/s | x raw | min .. max |", "|---|---|---|---|---|---|"]
    for name, c in cases.items():
        if c["group"] != "restore":
            continue
        if c.get("skipped"):
            out.append(f"| {c['label']} | {fmt_bytes(c['bytes'])} | {c['skipped']} | | | |")
            continue
        x = c.get("x_raw")
        out.append(f"| {c['label']} | {fmt_bytes(c['bytes'])} | {fmt_s(c['median_s'])} | "
                   f"{c['gbps']:.2f} | {'' if x is None else f'{x:.2f}x'} | "
                   f"{fmt_s(c['min_s'])} .. {fmt_s(c['max_s'])} |")
    goals = []
    for name, g in res["goals"].items():
        got = "n/a" if g["x_raw"] is None else \
            f"{g['x_raw']:.2f}x, {'met' if g['met'] else 'NOT met'}"
        goals.append(f"{name} within {g['goal_x_raw']}x of the raw read: {got}")
    out += ["", "Goals (issue 15): " + "; ".join(goals) + "."]
    peer_http = res["ratios"].get("ts_peer_over_raw_http", {}).get("ratio")
    if peer_http is not None:
        out += ["", f"The peer restore takes {peer_http:.2f}x the raw HTTP transfer of the same "
                "bytes over the same server and connection (curl to /dev/null): the rest of the "
                "gap to a RAM read is the transport's."]
    if res["manager_bytes_from"]:
        tiers = res["manager_bytes_from"][0]
        out += ["", "CheckpointManager.restore read " + ", ".join(
            f"{t} {fmt_bytes(n)}" for t, n in tiers.items()) + " (first counted run)."]
    out += ["", "## Save stall (async_save, only the local tier due)", "",
            "| save | bytes | save() blocks | x np.copy | x np.copyto | until committed | "
            "min .. max |", "|---|---|---|---|---|---|---|"]
    for name, c in cases.items():
        if c["group"] != "save" or c.get("skipped"):
            continue
        x, y = c.get("x_np_copy"), c.get("x_np_copyto")
        committed = c.get("committed_median_s")
        out.append(f"| {c['label']} | {fmt_bytes(c['bytes'])} | {fmt_s(c['median_s'])} | "
                   f"{'' if x is None else f'{x:.2f}x'} | {'' if y is None else f'{y:.2f}x'} | "
                   f"{'' if committed is None else fmt_s(committed)} | "
                   f"{fmt_s(c['min_s'])} .. {fmt_s(c['max_s'])} |")
    rs = [(k, r) for k, r in res["ratios"].items() if r["ratio"] is not None]
    if rs:
        out += ["", "## Against Orbax", "", "| ratio | value |", "|---|---|"]
        for k, r in rs:
            num, den = cases[r["numerator"]]["label"], cases[r["denominator"]]["label"]
            out.append(f"| {num} / {den} | {r['ratio']:.2f}x |")
    f = res["findings"]
    em = f.get("orbax_emergency")
    if em:
        two = em.get("mesh_2x4", {})
        out += ["", "## Orbax's emergency CheckpointManager", "",
                f"`{em['class']}` on a small state, mesh 2x4 (replica axis 0): "
                + (f"error {two['error']}" if "error" in two else
                   f"inner manager `{two.get('inner_manager')}`, replicas "
                   f"{two.get('replica_count')}, in_primary_slice {two.get('in_primary_slice')},"
                   f" local manager {two.get('has_local_manager')}, save(1) "
                   f"{two.get('save_step_1')}, save(2) {two.get('save_step_2')}, files in the "
                   f"local directory {two.get('local_dir_files_after_saves')}, persistent steps "
                   f"{two.get('persistent_steps')}, restore via {two.get('restore_path')}.")
                + f" Local tier used: {em.get('local_tier_used')}.", "", em["conclusion"]]
    two = f.get("orbax_emergency_two_processes")
    if two:
        if "error" in two:
            out += ["", f"With two processes it failed: {two['error'][-1500:]}"]
        else:
            paths = sorted({p for r in two["processes"] for run in r["restore_paths"]
                            for p in run})
            out += ["", "With two processes (jax.distributed over 127.0.0.1, 4 CPU devices each, "
                    "gloo collectives; the replica axis across the processes) it runs: process 1 "
                    f"(in_primary_slice {two['processes'][1]['in_primary_slice']}) saves the local "
                    f"tier ({two['processes'][1]['local_files']} files), and every restore went "
                    f"through {', '.join(paths)} (local tier used in every run: "
                    f"{two['local_tier_used']}); its times are the \"Orbax emergency manager, 2 "
                    "processes\" rows above."]
    if f.get("orbax_p2p"):
        out += ["", f"`{f['orbax_p2p']['class']}`: {f['orbax_p2p']['note']}; "
                f"{f['orbax_p2p']['save_note']}."]
    if f.get("orbax_error"):
        out += ["", f"Orbax parts skipped: {f['orbax_error']}"]
    with open(path, "w") as fh:
        fh.write("\n".join(out) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=512, help="state size (default 512)")
    p.add_argument("--runs", type=int, default=5, help="counted runs (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted warm-up runs (default 1)")
    p.add_argument("--dir", default="/tmp/tensorstash-bench-recovery",
                   help="persistent storage folder (emptied first, removed after)")
    p.add_argument("--local-dir", default="/dev/shm/tensorstash-bench-recovery",
                   help="the local tier's folder, on a tmpfs (emptied first, removed after)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--skip-orbax", action="store_true", help="tensorstash only")
    p.add_argument("--keep", action="store_true", help="leave --dir and --local-dir")
    p.add_argument("--emergency-timeout", type=int, default=600,
                   help="seconds for the emergency manager's two-process run (default 600)")
    p.add_argument("--emergency-worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--emergency-port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.runs < 1 or args.warmup < 0:
        p.error("--runs must be >= 1 and --warmup >= 0")
    args.dir, args.local_dir = os.path.abspath(args.dir), os.path.abspath(args.local_dir)
    if args.emergency_worker is not None:
        emergency_worker(args)
        return 0
    for d in (args.dir, args.local_dir):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    need = 3 * args.size_mib << 20
    free = shutil.disk_usage(args.local_dir).free
    if free < need:
        raise SystemExit(f"recovery: {args.local_dir} has {free >> 20} MiB free, needs about "
                         f"{need >> 20} MiB (3x --size-mib)")
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    command = "python bench/recovery.py " + " ".join(sys.argv[1:])
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command.strip(),
            "args": {"size_mib": args.size_mib, "runs": args.runs, "warmup": args.warmup,
                     "dir": args.dir, "local_dir": args.local_dir,
                     "skip_orbax": args.skip_orbax},
            "machine": machine_facts(args), "versions": versions(),
            "load_average_start": _read("/proc/loadavg").split()[:3]}
    bench = Bench(args)
    try:
        bench.setup()
        meta["state"] = {"arrays": NUM_ARRAYS, "shape": list(bench.state["w0"].shape),
                         "dtype": "float32", "bytes": bench.nbytes,
                         "holding_data_files": len(bench.dat_files),
                         "holding_data_bytes": bench.dat_bytes}
        bench.run()
        meta["drop_caches"] = "permitted" if bench.cold else "not permitted"
        if not args.skip_orbax and "orbax_error" not in bench.findings:
            bench.add_emergency(run_emergency(args))
    finally:
        bench.close()
        if not args.keep:
            for d in (args.dir, args.local_dir):
                shutil.rmtree(d, ignore_errors=True)
    meta["load_average_end"] = _read("/proc/loadavg").split()[:3]
    meta["elapsed_s"] = time.perf_counter() - started
    res = summarize(bench, meta)
    with open(os.path.join(args.out, "recovery.json"), "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    write_markdown(res, os.path.join(args.out, "recovery.md"))
    log(f"wrote {os.path.join(args.out, 'recovery.json')} and recovery.md "
        f"({meta['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
