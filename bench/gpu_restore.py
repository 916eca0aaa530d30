#!/usr/bin/env python3
"""Restores onto one GPU, in one process, next to the raw speeds they are bounded by (issue 17,
part 6): how fast the bytes come from the page cache, and how fast JAX moves host memory onto
the GPU, from pageable memory (what a restore hands it) and from pinned memory.

    python bench/gpu_restore.py [--size-mib 1024] [--runs 5] [--dir /tmp/tensorstash-gpu-restore]
                                [--out gpu_restore.json]

Needs JAX with a GPU (JAX_PLATFORMS is set to "cuda"; --cpu runs it on the CPU, as a check of
the script); bench/run.py --platform gpu runs the scenarios of both tools there. Saves
(tensorstash, no fsync) a "large" state (8 float32 arrays of size/8) and the "many-small" arrays
of bench/scenarios.py, then times, with a warm page cache, medians of --runs in this process
(so that JAX's first allocations on the GPU are not counted, unlike bench/run.py's fresh
processes):
  - raw: a read of the large state's data files into one held buffer; jax.device_put of a host
    array of the same bytes onto the GPU from pageable memory, and from JAX's pinned host memory;
    what filling pinned host memory costs, the process's first time (new memory pinned) and again
    (what a pool of pinned read buffers reused from one restore to the next would pay);
  - tensorstash.restore onto the GPU (a target of ShapeDtypeStruct on it), with batches of 512
    (the default), 128 and 32 MiB handed to JAX, with the host memory each took (peak RSS
    growth).
Every restore's first run is compared bit for bit with the saved arrays.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_common  # noqa: E402  (sets JAX_PLATFORMS before JAX is imported)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import scenarios as S  # noqa: E402
import tensorstash  # noqa: E402
from tensorstash import _options  # noqa: E402

MiB = 1 << 20
_libc = ctypes.CDLL("libc.so.6")


def rss_peak_growth(fn):
    """(fn's result, peak RSS growth in bytes during fn)."""
    _libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

    def kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    base = kib("VmRSS")
    out = fn()
    return out, (kib("VmHWM") - base) * 1024


def timed(fn, runs):
    seconds, growth = [], []
    for _ in range(runs):
        def one():
            t0 = time.perf_counter()
            out = fn()
            jax.block_until_ready(out)
            return time.perf_counter() - t0
        s, g = rss_peak_growth(one)
        seconds.append(s)
        growth.append(g)
    return {"median_s": statistics.median(seconds), "runs_s": seconds, "peak_rss_growth": max(growth)}


def main() -> int:
    p = gpu_common.arguments(__doc__, "/tmp/tensorstash-gpu-restore", 5)
    p.add_argument("--size-mib", type=int, default=1024)
    args = p.parse_args()
    dev = gpu_common.first_device(args, "gpu_restore")
    if dev is None:
        return 2
    shutil.rmtree(args.dir, ignore_errors=True)
    rows = args.size_mib * MiB // 4 // 8192 // 8
    states = {
        "large": [S.Leaf(f"w{i}", (rows, 8192), "float32", (None, None), 1 + i) for i in range(8)],
        "many-small": S.small_arrays(args.size_mib / 1024),
    }
    one = jax.sharding.SingleDeviceSharding(dev)
    results = {"device": dev.device_kind, "jax": jax.__version__,
               "tensorstash": tensorstash.__version__, "runs": args.runs, "rows": []}

    def row(name, nbytes, r):
        r.update(name=name, bytes=nbytes, gb_s=nbytes / r["median_s"] / 1e9)
        results["rows"].append(r)
        print(f"{name:<52} {r['median_s'] * 1e3:9.1f} ms {r['gb_s']:7.2f} GB/s   host peak "
              f"+{r.get('peak_rss_growth', 0) / MiB:7.0f} MiB", flush=True)

    data = {}
    for state, leaves in states.items():
        data[state] = {leaf.path: S.block(leaf, (0,) * len(leaf.shape), leaf.shape)
                       for leaf in leaves}
        tensorstash.save(os.path.join(args.dir, state), data[state], sync=False)

    # Raw: the large state's bytes from the page cache, and onto the GPU from host memory.
    nbytes = sum(x.nbytes for x in data["large"].values())
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(args.dir, "large"))
             for f in fs if f.endswith(".dat")]
    held = np.empty(sum(os.path.getsize(f) for f in files), np.uint8)

    def read_files():
        view, off = memoryview(held), 0
        for name in files:
            with open(name, "rb", buffering=0) as f:
                while n := f.readinto(view[off:off + (8 << 20)]):
                    off += n
    read_files()
    row("raw read of the files (held buffer)", held.nbytes, timed(read_files, args.runs))
    host = np.concatenate([x.reshape(-1) for x in data["large"].values()])
    row("raw device_put, pageable host memory", host.nbytes,
        timed(lambda: jax.device_put(host, one), args.runs))
    try:
        # What a restore that read into pinned buffers would pay for them: the process's first
        # copy into pinned host memory (JAX pins new memory), then the same copy into memory JAX
        # has pinned already. Nothing before this point has used pinned memory.
        to_pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        row("host memory into pinned host memory, first time", host.nbytes,
            timed(lambda: jax.device_put(host, to_pinned), 1))
        row("host memory into pinned host memory, again", host.nbytes,
            timed(lambda: jax.device_put(host, to_pinned), args.runs))
        pinned = jax.device_put(host, to_pinned)
        jax.block_until_ready(pinned)
        row("raw device_put, pinned host memory", host.nbytes,
            timed(lambda: jax.device_put(pinned, one), args.runs))
        del pinned
    except Exception as e:  # noqa: BLE001 - a JAX without pinned_host: reported, not fatal
        print(f"pinned host memory: {type(e).__name__}: {e}", flush=True)

    for state, leaves in states.items():
        path = os.path.join(args.dir, state)
        target = {leaf.path: jax.ShapeDtypeStruct(leaf.shape, S.np_dtype(leaf.dtype), sharding=one)
                  for leaf in leaves}
        nbytes = sum(x.nbytes for x in data[state].values())
        for batch in (512, 128, 32):
            _options.HOST_BATCH_BYTES = batch * MiB
            out = tensorstash.restore(path, target)
            for key, want in data[state].items():
                if not np.array_equal(np.asarray(out[key]).view(np.uint8), want.view(np.uint8)):
                    raise AssertionError(f"{state}, batches of {batch} MiB: {key} differs")
            del out
            row(f"{state}: restore, batches of {batch} MiB", nbytes,
                timed(lambda: tensorstash.restore(path, target), args.runs))
    return gpu_common.finish(args, results)


if __name__ == "__main__":
    sys.exit(main())
