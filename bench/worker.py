"""One benchmark process: a list of operations of one scenario for one tool (run by bench/run.py).

    python bench/worker.py '{"tool": "orbax", "scenario": "large", "ops": ["restore"], ...}'

Starts JAX on 8 CPU devices (on the first GPU where bench/run.py --platform gpu sets
JAX_PLATFORMS=cuda: every mesh is then that one device), imports only its tool, makes the
scenario's arrays (or restore targets), does a tiny save and restore to warm the tool up, then
runs the operations, timing only the tool's calls, and prints one line "BENCH_RESULT {json}"
(with "_devices": what the meshes are made of). Every restore it is asked to verify is compared
with the arrays' defining function (scenarios.block), shard by shard, bit for bit; any
difference is an error (exit status 1) that names the array and the device.

Peak host memory of each operation: the process's RSS high-water mark (VmHWM, reset through
/proc/self/clear_refs just before the operation, after freed memory has been handed back with
malloc_trim) minus its RSS at that moment. In a process that runs one restore only (the
harness's default) nothing earlier can blur it.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import shutil
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # bench/run.py sets "cuda" for --platform gpu

import numpy as np  # noqa: E402

import scenarios as S  # noqa: E402

import jax  # noqa: E402  (after XLA_FLAGS)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


class VerificationError(AssertionError):
    pass


# --- memory ---------------------------------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


_libc = ctypes.CDLL("libc.so.6")


class Memory:
    """Peak RSS growth over a region: VmHWM after minus VmRSS before (HWM reset at start)."""

    def __enter__(self):
        gc.collect()
        _libc.malloc_trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.method = "VmHWM (reset)"
        except OSError:
            self.method = "VmHWM (not reset: an upper bound)"
        self.base = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        self.peak = _status_kib("VmHWM") * 1024
        return False

    def report(self) -> dict:
        return {"base": self.base, "peak": self.peak, "growth": self.peak - self.base,
                "method": self.method}


# --- arrays ---------------------------------------------------------------------------------

_meshes: dict[str, Mesh] = {}


def mesh(layout: str) -> Mesh:
    """The layout's mesh over the 8 CPU devices; on an accelerator, a 1x1 mesh of the first one
    whatever the layout (one GPU: every leaf whole on it, so that the specs still apply)."""
    if layout not in _meshes:
        devices = jax.devices()
        if devices[0].platform != "cpu":
            _meshes[layout] = Mesh(np.array(devices[:1]).reshape(1, 1), S.AXES)
        elif len(devices) < 8:
            raise RuntimeError(f"8 devices needed, JAX has {len(devices)} (XLA_FLAGS?)")
        else:
            _meshes[layout] = Mesh(np.array(devices[:8]).reshape(S.MESHES[layout]), S.AXES)
    return _meshes[layout]


def devices_used() -> str:
    """What the meshes are made of, for the report: "8 CPU devices", "1 GPU (NVIDIA H200)"."""
    devices = jax.devices()
    if devices[0].platform == "cpu":
        return f"{min(8, len(devices))} CPU devices"
    return f"1 {devices[0].platform.upper()} ({devices[0].device_kind})"


def sharding_of(leaf: S.Leaf, layout: str, replicated: bool) -> NamedSharding:
    if replicated:
        return NamedSharding(mesh(layout), P())
    return NamedSharding(mesh(layout), P(*leaf.spec))


def box(index: tuple, shape: tuple) -> tuple[tuple, tuple]:
    origin, extent = [], []
    for dim, s in zip(shape, index):
        start, stop, _ = s.indices(dim)
        origin.append(start)
        extent.append(stop - start)
    return tuple(origin), tuple(extent)


def nest(items) -> dict:
    """[(path "a/b/c", value)] -> nested dicts."""
    root: dict = {}
    for path, value in items:
        node = root
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return root


def get(tree: dict, path: str):
    for part in path.split("/"):
        if not isinstance(tree, dict) or part not in tree:
            raise VerificationError(f"restored tree lacks {path!r}")
        tree = tree[part]
    return tree


def count_leaves(tree) -> int:
    if isinstance(tree, dict):
        return sum(count_leaves(v) for v in tree.values())
    return 1


def make_tree(leaves, layout: str):
    def make(leaf):
        sharding = sharding_of(leaf, layout, False)
        return jax.make_array_from_callback(
            leaf.shape, sharding, lambda index: S.block(leaf, *box(index, leaf.shape)))
    tree = nest((leaf.path, make(leaf)) for leaf in leaves)
    jax.block_until_ready(tree)
    return tree


def target_tree(leaves, op: S.Op):
    return nest((leaf.path, jax.ShapeDtypeStruct(leaf.shape, S.np_dtype(leaf.dtype),
                                                 sharding=sharding_of(leaf, op.layout, op.replicated)))
                for leaf in leaves)


def selected(leaves, op: S.Op):
    if op.subset is None:
        return list(leaves)
    return [leaf for leaf in leaves if leaf.path.split("/")[0] == op.subset]


def unique_bytes(tree) -> int:
    """Bytes of the distinct device buffers that hold the restored arrays."""
    seen = {}
    for x in jax.tree_util.tree_leaves(tree):
        for shard in x.addressable_shards:
            seen[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return sum(seen.values())


def host_bytes(tree) -> int:
    """Bytes of the NumPy arrays of a restore into host memory."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def same_bytes(got: np.ndarray, expected: np.ndarray, where: str) -> None:
    if got.shape != expected.shape or not np.array_equal(
            got.reshape(-1).view(np.uint8), expected.reshape(-1).view(np.uint8)):
        bad = np.flatnonzero(got.reshape(-1).view(np.uint8) != expected.reshape(-1).view(np.uint8)) \
            if got.shape == expected.shape else []
        raise VerificationError(
            f"{where} differs from the saved data ({len(bad)} bytes differ, first at byte "
            f"{bad[0] if len(bad) else '?'})")


def verify(tree, leaves, op: S.Op, tool: str) -> None:
    """Every restored array equals the saved one bit for bit, with the target's sharding (or,
    restored into NumPy, whole)."""
    if count_leaves(tree) != len(leaves):
        raise VerificationError(f"{tool}: restored {count_leaves(tree)} arrays, expected {len(leaves)}")
    for leaf in leaves:
        x = get(tree, leaf.path)
        where = f"{tool} {op.name}: array {leaf.path!r}"
        if op.numpy:
            if not isinstance(x, np.ndarray):
                raise VerificationError(f"{where} restored as {type(x).__name__}, not a NumPy array")
            if np.dtype(x.dtype) != S.np_dtype(leaf.dtype):
                raise VerificationError(f"{where}: dtype {x.dtype}, expected {leaf.dtype}")
            same_bytes(x, S.block(leaf, (0,) * len(leaf.shape), leaf.shape), where)
            continue
        if not isinstance(x, jax.Array):
            raise VerificationError(f"{where} restored as {type(x).__name__}, not a jax.Array")
        if tuple(x.shape) != leaf.shape or np.dtype(x.dtype) != S.np_dtype(leaf.dtype):
            raise VerificationError(f"{where}: {x.shape} {x.dtype}, expected {leaf.shape} {leaf.dtype}")
        want = sharding_of(leaf, op.layout, op.replicated)
        if not x.sharding.is_equivalent_to(want, len(leaf.shape)):
            raise VerificationError(f"{where}: sharding {x.sharding}, expected {want}")
        for shard in x.addressable_shards:
            origin, extent = box(shard.index, leaf.shape)
            same_bytes(np.asarray(shard.data), S.block(leaf, origin, extent),
                       f"{where}: device {shard.device} block at {origin} of shape {extent}")


# --- tools ----------------------------------------------------------------------------------

class Tensorstash:
    name = "tensorstash"

    def __init__(self):
        import inspect

        import tensorstash
        self.ts = tensorstash
        # The byte cap of a restore (its default): the memory target is restored bytes + cap.
        self.cap = inspect.signature(tensorstash.restore).parameters["max_inflight_bytes"].default

    def save(self, path: str, tree, sync: bool) -> None:
        self.ts.save(path, tree, sync=sync)

    def restore(self, path: str, target, partial: bool):
        return self.ts.restore(path, target=target)

    def restore_numpy(self, path: str, leaves):
        return self.ts.restore(path)  # without a target: the saved tree, NumPy arrays

    def manager(self, root: str, no_copy: bool = False):
        return _TsManager(self.ts.CheckpointManager(root, max_to_keep=2, async_save=True,
                                                    copy_host_jax_arrays=not no_copy))


class _TsManager:
    def __init__(self, m):
        self.m = m

    def save(self, step, tree):
        self.m.save(step, tree)

    def wait(self):
        self.m.wait_until_finished()

    def restore(self, step, target):
        return self.m.restore(step, target=target)

    def close(self):
        self.m.close()


class Orbax:
    """Orbax with its defaults for the installed version: PyTreeCheckpointer (OCDBT, its
    default compression) for saves and restores, CheckpointManager (async) for async saves.
    Without fsync: TensorStore's file_io_sync=false added to Orbax's default context."""

    name = "orbax"

    def __init__(self):
        import orbax.checkpoint as ocp
        from orbax.checkpoint._src.serialization import tensorstore_utils as tsu
        self.ocp, self.tsu = ocp, tsu
        self.cap = None
        self.ckptr = ocp.PyTreeCheckpointer()

    def _file_io_sync(self, sync: bool) -> None:
        for context in (self.tsu._BASE_TS_CONTEXT, self.tsu._DEFAULT_OCDBT_TS_CONTEXT):
            if sync:
                context.pop("file_io_sync", None)
            else:
                context["file_io_sync"] = False

    def save(self, path: str, tree, sync: bool) -> None:
        self._file_io_sync(sync)
        try:
            self.ckptr.save(path, args=self.ocp.args.PyTreeSave(tree))
        finally:
            self._file_io_sync(True)

    def restore(self, path: str, target, partial: bool):
        ocp = self.ocp
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        return self.ckptr.restore(path, args=ocp.args.PyTreeRestore(
            item=target, restore_args=restore_args, partial_restore=partial))

    def restore_numpy(self, path: str, leaves):
        ocp = self.ocp
        restore_args = nest((leaf.path, ocp.RestoreArgs(restore_type=np.ndarray)) for leaf in leaves)
        return self.ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))

    def manager(self, root: str, no_copy: bool = False):
        # Orbax never copies jax.Arrays on CPU before its save() returns: no_copy is its only way.
        ocp = self.ocp
        return _OrbaxManager(ocp, ocp.CheckpointManager(
            root, options=ocp.CheckpointManagerOptions(max_to_keep=2)))


class _OrbaxManager:
    def __init__(self, ocp, m):
        self.ocp, self.m = ocp, m

    def save(self, step, tree):
        self.m.save(step, args=self.ocp.args.StandardSave(tree))

    def wait(self):
        self.m.wait_until_finished()

    def restore(self, step, target):
        return self.m.restore(step, args=self.ocp.args.StandardRestore(target))

    def close(self):
        self.m.close()


TOOLS = {"tensorstash": Tensorstash, "orbax": Orbax}


# --- operations -----------------------------------------------------------------------------

def ckpt_path(job: dict, scenario: S.Scenario, tree: str) -> str:
    name = scenario.reads_from[0] if scenario.reads_from else scenario.name
    return os.path.join(job["dir"], name, scenario.reads_tool or job["tool"], tree)


def remove(path: str) -> None:
    if os.path.lexists(path):
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def warm_up(tool, job: dict) -> None:
    """A tiny save and restore, so that first-call costs stay out of the timed region."""
    leaf = S.Leaf("w", (64, 128), "float32", ("a", "b"), 7)
    path = os.path.join(job["dir"], "_warmup", f"{tool.name}-{os.getpid()}")
    remove(path)
    tool.save(path, make_tree([leaf], "2x4"), True)
    op = S.Op("warmup", "restore", "main")
    out = tool.restore(path, target_tree([leaf], op), False)
    jax.block_until_ready(out)
    verify(out, [leaf], op, tool.name)
    del out
    remove(path)


def run_save(tool, job, scenario, op, trees) -> dict:
    leaves = scenario.trees[op.tree]
    key = (op.tree, op.layout)
    if key not in trees:
        trees[key] = make_tree(leaves, op.layout)
    tree = trees[key]
    path = ckpt_path(job, scenario, op.tree)
    marker = path + ".saved"
    remove(marker)
    remove(path)
    os.sync()  # nothing of earlier runs left to write back during the timed save
    S.prime_free_memory(os.path.dirname(path), op.raw_bytes)  # see prime_free_memory
    with Memory() as mem:
        t0 = time.perf_counter()
        tool.save(path, tree, op.sync)
        seconds = time.perf_counter() - t0
    with open(marker, "w") as f:
        json.dump({"run": job["run"], "op": op.name}, f)
    return {"seconds": seconds, "memory": mem.report()}


def run_restore(tool, job, scenario, op) -> dict:
    leaves = selected(scenario.trees[op.tree], op)
    path = ckpt_path(job, scenario, op.tree)
    if not os.path.exists(path + ".saved"):
        raise RuntimeError(f"no checkpoint at {path} (its save has not run)")
    target = None if op.numpy else target_tree(leaves, op)
    if op.prelude is not None:
        run_prelude(tool, job, scenario, op.prelude)
    # No writeback of the saves before (some without fsync) may compete with the timed restore.
    os.sync()
    if op.cold:
        if not S.drop_page_cache():
            return {"seconds": None, "cold": "not permitted"}
    else:
        S.warm_page_cache(path)  # the same start for every tool (see warm_page_cache)
    # Room for the restored arrays and a copy of them (per device when replicated).
    S.prime_free_memory(os.path.dirname(path), op.raw_bytes * (8 if op.replicated else 2))
    with Memory() as mem:
        t0 = time.perf_counter()
        if op.numpy:
            out = tool.restore_numpy(path, leaves)
        else:
            out = tool.restore(path, target, op.subset is not None)
            jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
    restored = host_bytes(out) if op.numpy else unique_bytes(out)
    result = {"seconds": seconds, "memory": dict(mem.report(), restored_bytes=restored)}
    if tool.cap is not None:
        result["cap"] = tool.cap
    if job["verify"]:
        verify(out, leaves, op, tool.name)
        result["verified"] = True
    del out
    return result


def run_prelude(tool, job, scenario, tree_name: str) -> None:
    """The untimed work a restore late in a job follows: save the tree `tree_name` (on 2x4) and
    restore it, in this process, then remove that checkpoint."""
    leaves = scenario.trees[tree_name]
    path = ckpt_path(job, scenario, tree_name)
    remove(path)
    tree = make_tree(leaves, "2x4")
    tool.save(path, tree, True)
    out = tool.restore(path, target_tree(leaves, S.Op("prelude", "restore", tree_name)), False)
    jax.block_until_ready(out)
    del out, tree
    remove(path)


def run_async(tool, job, scenario, op, trees) -> dict:
    leaves = scenario.trees[op.tree]
    key = (op.tree, op.layout)
    if key not in trees:
        trees[key] = make_tree(leaves, op.layout)
    tree = trees[key]
    root = ckpt_path(job, scenario, op.tree)
    remove(root)
    manager = tool.manager(root, no_copy=op.no_copy)
    try:
        manager.save(1, tree)  # warm-up: the manager's first save, same state
        manager.wait()
        os.sync()
        S.prime_free_memory(os.path.dirname(root), 2 * op.raw_bytes)  # the save's copy + cache
        t0 = time.perf_counter()
        manager.save(2, tree)
        t1 = time.perf_counter()
        manager.wait()
        t2 = time.perf_counter()
        result = {"seconds": t2 - t0, "blocking": t1 - t0, "commit": t2 - t0}
        if job["verify"]:
            out = manager.restore(2, target_tree(leaves, op))
            jax.block_until_ready(out)
            verify(out, leaves, op, tool.name)
            result["verified"] = True
            del out
    finally:
        manager.close()
    remove(root)
    return result


def main() -> None:
    job = json.loads(sys.argv[1])
    scenario = S.make_scenarios(job["scale"])[job["scenario"]]
    ops = {op.name: op for op in scenario.ops}
    tool = TOOLS[job["tool"]]()
    os.makedirs(job["dir"], exist_ok=True)
    warm_up(tool, job)
    trees: dict = {}
    results = {}
    for name in job["ops"]:
        if name.startswith("setup:"):  # an untimed save of another scenario's checkpoint
            src = S.make_scenarios(job["scale"])[name.split(":", 1)[1]]
            run_save(tool, job, src, src.ops[0], trees)
            continue
        op = ops[name]
        if op.kind == "save":
            results[name] = run_save(tool, job, scenario, op, trees)
        elif op.kind == "restore":
            results[name] = run_restore(tool, job, scenario, op)
        elif op.kind == "async":
            results[name] = run_async(tool, job, scenario, op, trees)
        else:
            raise ValueError(op.kind)
    results["_devices"] = devices_used()
    print("BENCH_RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - reported to the harness, which fails loudly
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # (no slow interpreter teardown of JAX and the tools' thread pools)
