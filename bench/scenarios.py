"""The scenarios of the benchmark (issue 5): their arrays, layouts and operations, and the data.

Pure Python and NumPy (no JAX), so that the harness process can plan a run without starting JAX;
bench/worker.py turns these descriptions into jax.Arrays on 8 CPU devices.

Every array's values are a function of (seed, flat element index) only (`block`), so a process
can make any block of any array without the rest of it: the saving process makes each device's
shard, and the restoring process checks each restored shard against the same function, bit for
bit. Floating-point values are finite (the top exponent bit is cleared), so no tool can be
excused for canonicalising NaNs.

Sizes follow the issue at --scale 1.0 and shrink with it: "large" and "reshard" by rows,
"many-small" by the number of arrays (each still 4 KiB..1 MiB), the transformer trees by
d_model (with sqrt(scale), so their bytes scale linearly).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
AXES = ("a", "b")  # every mesh is 2-D over the 8 devices
MESHES = {"2x4": (2, 4), "4x2": (4, 2), "8x1": (8, 1), "1x8": (1, 8)}


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array: its path in the tree ("layers/03/wq"), shape, dtype name, the PartitionSpec
    entries it is saved (and by default restored) with, and the seed of its values."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple
    seed: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np_dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Op:
    """One measured operation of a scenario.

    kind: "save" (a checkpointer's save, until durable/committed), "restore", or "async" (a
    checkpoint manager's async save: the time save() blocks, and the time until committed).
    tree: which tree of the scenario it saves or restores (its folder name too).
    layout: the mesh ("2x4", "8x1", "1x8") the arrays are saved from or restored onto;
    replicated: restore every array whole onto every device (P()).
    sync: save with fsync (both tools' default) or without.
    cold: restore after dropping the page cache.
    subset: restore only this top-level key of the tree (partial restore).
    numpy: restore every array whole into host memory as NumPy arrays (no target, no devices).
    no_copy: an async save by tensorstash's CheckpointManager(copy_host_jax_arrays=False), which
    writes jax.Arrays on CPU from their buffers as Orbax does, instead of copying them before
    save() returns (Orbax's op is the same either way).
    prelude: a tree of the scenario that the restoring process saves and restores first, untimed
    (a restore late in a job, after the process has done other work, not in a fresh process).
    raw: the plain-file operation it is compared with: "write", "write_fsync", "read",
    "read_cold"; raw_bytes: how many bytes that moves (the arrays' bytes the operation stores
    or reads).
    """

    name: str
    kind: str
    tree: str
    layout: str = "2x4"
    replicated: bool = False
    sync: bool = True
    cold: bool = False
    subset: str | None = None
    raw: str = "read"
    raw_bytes: int = 0
    label: str = ""
    numpy: bool = False
    no_copy: bool = False
    prelude: str | None = None


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    trees: dict  # tree name -> list[Leaf]
    ops: tuple  # of Op, in the order they run
    # (scenario, tree) whose checkpoint the restores read when this scenario saves none.
    reads_from: tuple | None = None
    # The tool whose checkpoint of `reads_from` every tool restores (None: each its own).
    reads_tool: str | None = None


# --- the machine ---------------------------------------------------------------------------

def drop_page_cache() -> bool:
    """Writes back dirty pages, then drops the page cache (for cold reads). False where the
    machine does not permit it (not root, or a read-only /proc/sys)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def evict_from_page_cache(path: str) -> bool:
    """Writes back, then evicts from the page cache, the file `path` or every file under folder
    `path` (posix_fadvise DONTNEED: permitted where drop_page_cache is not, e.g. in a container
    without root; pages another process has mapped stay). False where that failed."""
    paths = [path] if os.path.isfile(path) else [
        os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    try:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return True
    except OSError:
        return False


def make_cold(path: str) -> str:
    """Drops the page cache, or where that is not permitted evicts `path`'s files from it:
    "cold", "cold (fadvise)" or "warm" (neither worked)."""
    if drop_page_cache():
        return "cold"
    return "cold (fadvise)" if evict_from_page_cache(path) else "warm"


def warm_page_cache(folder: str) -> int:
    """Reads every file under `folder` once, so that a restore measured next finds the page
    cache warm whichever way the checkpoint was written: a buffered save leaves its bytes
    cached, a save that writes around the page cache (tensorstash's synced saves) does not.
    Returns the bytes read."""
    total = 0
    buf = bytearray(8 << 20)
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
    return total


_PRIME_CAP = 4 * GiB


def prime_free_memory(folder: str, nbytes: int) -> None:
    """Writes `nbytes` (at most 4 GiB) into a scratch file in `folder` and removes it, so that
    the memory the timed operation takes next (page cache for a write, buffers for a restore)
    comes from pages in use moments ago, for every participant alike.

    Why: on a virtual machine whose balloon driver reports free memory to the host (this
    benchmark's machines), memory left free for a few seconds goes back to the host, and the
    first touch of it afterwards costs the hypervisor's fault: 2-3 s per GiB here, against
    0.2 s for pages freed moments ago (`dd` of 1 GiB into the page cache: 1.9 s, 1.0 s, 0.19 s
    in a row, 2.8 s after 5 s idle). Which participant found hot pages depended on what it did
    just before: removing a previous buffered file (the raw write, Orbax's synced save) gave
    its pages back hot, a save that had written around the page cache (tensorstash with fsync)
    had none to give. Touching and unmapping anonymous memory does not do it (its huge pages
    are reported again at once); freed page-cache pages do. On bare metal this changes
    nothing but the time it takes."""
    size = min(int(nbytes), _PRIME_CAP)
    if size <= 0:
        return
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, ".prime")
    block = bytes(8 << 20)
    with open(path, "wb", buffering=0) as f:
        for offset in range(0, size, len(block)):
            f.write(block[:min(len(block), size - offset)])
    os.remove(path)  # dirty pages of a removed file are dropped, never written back


# --- values ---------------------------------------------------------------------------------

def np_dtype(name: str) -> np.dtype:
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


_FLOAT_TOP_EXPONENT_BIT = {4: 1 << 30, 2: 1 << 14}


def block(leaf: Leaf, origin: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """The values of `leaf` in the block at `origin` of `shape` (C order), as leaf.dtype.

    value(i) = mix(i * 2654435761 + seed * 0x9E3779B9) over uint32 (mix: x ^= x >> 15;
    x *= 0x85EBCA6B), i the flat index in the
    whole array, cut to the dtype's width; floats get their top exponent bit cleared (finite).
    """
    dtype = np_dtype(leaf.dtype)
    full = leaf.shape
    mult, seed = np.uint64(2654435761), (leaf.seed * 0x9E3779B9) & 0xFFFFFFFF
    if len(full) == 0:
        h = np.array(seed, np.uint32)
    else:
        # (sum_d i_d * stride_d) * mult + seed, mod 2^32, summed per axis then broadcast (one
        # pass over the block).
        h = None
        for d, (o, s) in enumerate(zip(origin, shape)):
            stride = np.uint64(math.prod(full[d + 1:]) % (1 << 32))
            axis = np.arange(o, o + s, dtype=np.uint64) * stride * mult
            if d == 0:
                axis += np.uint64(seed)
            axis = (axis & np.uint64(0xFFFFFFFF)).astype(np.uint32)
            axis = axis.reshape((s,) + (1,) * (len(shape) - d - 1))
            h = axis if h is None else np.add(h, axis)
        h = np.ascontiguousarray(np.broadcast_to(h, shape)) if h.shape != tuple(shape) else h
    h ^= h >> np.uint32(15)
    np.multiply(h, np.uint32(0x85EBCA6B), out=h)
    size = dtype.itemsize
    if size == 4:
        bits = h
    elif size == 2:
        bits = (h >> np.uint32(16)).astype(np.uint16)  # the high bits mix best
    elif size == 1:
        bits = (h >> np.uint32(24)).astype(np.uint8)
    else:
        raise ValueError(f"dtype {leaf.dtype} (itemsize {size}) is not used by the benchmark")
    if dtype.kind == "f" or leaf.dtype == "bfloat16":
        bits &= bits.dtype.type(~_FLOAT_TOP_EXPONENT_BIT[size] & ((1 << (8 * size)) - 1))
    return bits.view(dtype)


# --- trees ----------------------------------------------------------------------------------

def _rows(scale: float, full_rows: int = 4096) -> int:
    """Rows of a (rows, 8192) float32 array at `scale` (128 MiB at 1.0), a multiple of 8."""
    return max(8, 8 * round(full_rows * scale / 8))


def big_arrays(prefix: str, count: int, scale: float, seed0: int) -> list[Leaf]:
    rows = _rows(scale)
    return [Leaf(f"{prefix}{i}", (rows, 8192), "float32", ("a", "b"), seed0 + i) for i in range(count)]


_SMALL_DTYPES = ("float32", "bfloat16", "int32", "float16", "int8")
_SMALL_COUNT = 4000
_SMALL_TOTAL = GiB // 2


def _small_sizes(n: int) -> list[int]:
    """n sizes in bytes from 4 KiB to 1 MiB, skewed towards small so that 4,000 of them add up
    to about 0.5 GiB (as in the issue); the first n of one fixed sequence."""
    golden = (math.sqrt(5) - 1) / 2
    u = [((i + 1) * golden) % 1.0 for i in range(_SMALL_COUNT)]

    def sizes(p):
        return [4 * KiB * 256 ** (x ** p) for x in u]

    lo, hi = 1.0, 8.0  # bisection on the skew exponent p: mean(p) falls as p grows
    for _ in range(60):
        p = (lo + hi) / 2
        if sum(sizes(p)) > _SMALL_TOTAL:
            lo = p
        else:
            hi = p
    return [int(s) for s in sizes((lo + hi) / 2)[:n]]


def small_arrays(scale: float) -> list[Leaf]:
    n = max(40, round(_SMALL_COUNT * scale))
    leaves = []
    for i, size in enumerate(_small_sizes(n)):
        dtype = _SMALL_DTYPES[i % len(_SMALL_DTYPES)]
        itemsize = np_dtype(dtype).itemsize
        cols = 128
        rows = max(8, 8 * round(size / itemsize / cols / 8))
        # Sharded on rows over all 8 devices, as FSDP shards most parameters.
        leaves.append(Leaf(f"p{i:04d}", (rows, cols), dtype, (("a", "b"), None), 10_000 + i))
    return leaves


def _d_model(base: int, scale: float) -> int:
    return max(64, 64 * round(base * math.sqrt(scale) / 64))


def transformer(prefix: str, layers: int, d: int, stacked: bool, seed0: int) -> list[Leaf]:
    """A decoder's per-layer parameters: attention (wq, wk, wv, wo: d x d), MLP (w1: d x 4d,
    w2: 4d x d), two layer-norm scales; sharded FSDP x tensor-parallel on the 2x4 mesh. Stacked:
    one array per parameter with a leading layer axis (as jax.lax.scan over layers wants)."""
    params = [("wq", (d, d), ("a", "b")), ("wk", (d, d), ("a", "b")), ("wv", (d, d), ("a", "b")),
              ("wo", (d, d), ("b", "a")), ("w1", (d, 4 * d), ("a", "b")),
              ("w2", (4 * d, d), ("b", "a")), ("ln1", (d,), (None,)), ("ln2", (d,), (None,))]
    leaves = []
    if stacked:
        for j, (name, shape, spec) in enumerate(params):
            leaves.append(Leaf(f"{prefix}layers/{name}", (layers,) + shape, "float32",
                               (None,) + spec, seed0 + j))
    else:
        for layer in range(layers):
            for j, (name, shape, spec) in enumerate(params):
                leaves.append(Leaf(f"{prefix}layers/{layer:02d}/{name}", shape, "float32", spec,
                                   seed0 + 100 * layer + j))
    return leaves


def nbytes(leaves) -> int:
    return sum(leaf.nbytes for leaf in leaves)


# --- scenarios ------------------------------------------------------------------------------

def make_scenarios(scale: float) -> dict[str, Scenario]:
    out = {}

    large = big_arrays("w", 8, scale, 1)
    n = nbytes(large)
    out["large"] = Scenario(
        "large", "8 float32 arrays of 128 MiB sharded over a 2x4 mesh", {"main": large},
        (Op("save_fsync", "save", "main", sync=True, raw="write_fsync", raw_bytes=n,
            label="save (fsync)"),
         Op("save_nofsync", "save", "main", sync=False, raw="write", raw_bytes=n,
            label="save (no fsync)"),
         Op("restore", "restore", "main", raw="read", raw_bytes=n, label="restore (same mesh)")))

    small = small_arrays(scale)
    n = nbytes(small)
    out["many-small"] = Scenario(
        "many-small", f"{len(small)} arrays of 4 KiB..1 MiB, 5 dtypes, sharded over 8 devices",
        {"main": small},
        (Op("save", "save", "main", raw="write_fsync", raw_bytes=n, label="save (fsync)"),
         Op("restore", "restore", "main", raw="read", raw_bytes=n, label="restore"),
         Op("restore_numpy", "restore", "main", numpy=True, raw="read", raw_bytes=n,
            label="restore into NumPy")))

    d = _d_model(1024, scale)
    unstacked, stacked = transformer("", 24, d, False, 50_000), transformer("", 24, d, True, 50_000)
    n = nbytes(unstacked)
    out["stacked"] = Scenario(
        "stacked", f"24-layer transformer parameters, d_model {d}, per-layer vs stacked on a layer axis",
        {"unstacked": unstacked, "stacked": stacked},
        (Op("save_unstacked", "save", "unstacked", raw="write_fsync", raw_bytes=n,
            label="save unstacked (fsync)"),
         Op("save_stacked", "save", "stacked", raw="write_fsync", raw_bytes=n,
            label="save stacked (fsync)"),
         Op("restore_unstacked", "restore", "unstacked", raw="read", raw_bytes=n,
            label="restore unstacked"),
         Op("restore_stacked", "restore", "stacked", raw="read", raw_bytes=n,
            label="restore stacked"),
         # The mesh's axes swapped (4x2): every target block is a strided slice of stored chunks.
         Op("restore_stacked_swapped", "restore", "stacked", layout="4x2", raw="read",
            raw_bytes=n, label="restore stacked, mesh axes swapped"),
         Op("restore_stacked_swapped_cold", "restore", "stacked", layout="4x2", cold=True,
            raw="read_cold", raw_bytes=n, label="restore stacked, axes swapped, cold")))

    reshard = big_arrays("r", 4, scale, 100)
    reshard = [dataclasses.replace(leaf, spec=("a", "b")) for leaf in reshard]
    n = nbytes(reshard)
    out["reshard"] = Scenario(
        "reshard", "4 float32 arrays of 128 MiB saved on an 8x1 mesh, restored onto others",
        {"main": reshard},
        (Op("save_8x1", "save", "main", layout="8x1", raw="write_fsync", raw_bytes=n,
            label="save on 8x1 (fsync)"),
         Op("restore_2x4", "restore", "main", layout="2x4", raw="read", raw_bytes=n,
            label="restore onto 2x4"),
         Op("restore_1x8", "restore", "main", layout="1x8", raw="read", raw_bytes=n,
            label="restore onto 1x8"),
         Op("restore_replicated", "restore", "main", replicated=True, raw="read", raw_bytes=n,
            label="restore replicated (x8)")))

    dp = _d_model(512, scale)
    params = transformer("params/", 24, dp, False, 60_000)
    mu = transformer("mu/", 24, dp, False, 70_000)
    nu = transformer("nu/", 24, dp, False, 80_000)
    n_all, n_params = nbytes(params + mu + nu), nbytes(params)
    out["partial"] = Scenario(
        "partial", f"params + 2 optimizer moments (24 layers, d_model {dp}); restore all vs params only",
        {"main": params + mu + nu},
        (Op("save", "save", "main", raw="write_fsync", raw_bytes=n_all, label="save all (fsync)"),
         Op("restore_all", "restore", "main", raw="read", raw_bytes=n_all, label="restore all"),
         Op("restore_params", "restore", "main", subset="params", raw="read", raw_bytes=n_params,
            label="restore params only")))

    asyncs = big_arrays("w", 8, scale, 200)
    n = nbytes(asyncs)
    out["async"] = Scenario(
        "async", "the 'large' arrays saved by a checkpoint manager with async saves",
        {"main": asyncs},
        (Op("async_save", "async", "main", raw="write_fsync", raw_bytes=n, label="async save"),
         Op("async_save_no_copy", "async", "main", raw="write_fsync", raw_bytes=n,
            label="async save, jax.Arrays not copied first", no_copy=True)))

    n = nbytes(large)
    out["cold"] = Scenario(
        "cold", "restore of 'large' after dropping the page cache", {"main": large},
        (Op("restore_cold", "restore", "main", cold=True, raw="read_cold", raw_bytes=n,
            label="restore, cold cache"),),
        reads_from=("large", "main"))

    out["orbax-format"] = Scenario(
        "orbax-format", "the checkpoint Orbax saved in 'large' (OCDBT + zarr), restored by both",
        {"main": large},
        (Op("restore_orbax_ckpt", "restore", "main", raw="read", raw_bytes=n,
            label="restore an Orbax checkpoint"),),
        reads_from=("large", "main"), reads_tool="orbax")
    # Issue 38, part 7: the stacked restore of a job that has already saved and restored other
    # trees (allocator, thread pools and caches no longer fresh): saved on 8x1, restored onto the
    # mesh's axes swapped (4x2), after a many-small save and restore in the same process.
    late_stacked = transformer("", 24, d, True, 90_000)
    n = nbytes(late_stacked)
    out["late"] = Scenario(
        "late", f"stacked transformer (d_model {d}) saved on 8x1, restored onto 4x2 by a process "
        "that first saved and restored the many-small tree",
        {"stacked": late_stacked, "small": small},
        (Op("save_stacked_8x1", "save", "stacked", layout="8x1", raw="write_fsync", raw_bytes=n,
            label="save stacked on 8x1 (fsync)"),
         Op("restore_late", "restore", "stacked", layout="4x2", prelude="small", raw="read",
            raw_bytes=n, label="restore onto 4x2, late in a process")))
    return out


SCENARIO_NAMES = ("large", "many-small", "stacked", "reshard", "partial", "async", "cold",
                  "orbax-format", "late")
