"""Memory and GIL measurements in a fresh process (run by test_memory.py).

    python mem_worker.py MODE STEP

Prints one JSON line with the measurements. Modes:
  save         builds the checkpoint: "big" (512 MiB float32) and "parts" (4 x 32 MiB)
  numpy        restores "big" into a NumPy target, reading it (mmap=False)
  mapped       restores "big" into a NumPy target, mapping it from the files (the default)
  staged       restores a truncated "big" (rows shorter than the chunks': staged reads)
  jax          restores "parts" onto 8 CPU devices, with the host batch set to 32 MiB
  gil          restores "big" while a Python thread counts, and saves it again likewise
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time

MiB = 1 << 20
CAP = 16 * MiB
IO_THREADS = int(os.environ.get("TS_IO_THREADS", "4"))  # fixed: the overhead depends on it
BIG = (8192, 16384)  # float32: 512 MiB
PART = (1024, 8192)  # float32: 32 MiB
NUM_PARTS = 4


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def start_measure() -> int:
    """Resets the peak RSS to the current RSS and returns the current RSS.

    The peak must be reset: a process started by fork + exec inherits the parent's peak RSS in
    ru_maxrss (Linux keeps the larger of the old and new images' high-water marks across
    exec), so a worker started from a big pytest process would report the parent's peak."""
    global _PEAK_RESET
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        _PEAK_RESET = True
    except OSError:
        _PEAK_RESET = False
    return rss_now()


_PEAK_RESET = False


def rss_peak() -> int:
    if _PEAK_RESET:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # an upper bound


def big_values():
    import numpy as np
    a = np.arange(BIG[0] * BIG[1], dtype=np.uint32)
    a *= np.uint32(2654435761)
    return a.view(np.float32).reshape(BIG)  # every bit pattern differs; NaNs included


def part_values(i):
    import numpy as np
    return np.full(PART, i + 0.5, np.float32) + np.arange(PART[1], dtype=np.float32)


def merged(calls):
    out = {}
    for c in calls:
        for k, v in c.items():
            out[k] = max(out.get(k, 0), v) if k.startswith("peak") else out.get(k, 0) + v
    return out


def main() -> None:
    mode, step = sys.argv[1], sys.argv[2]
    import numpy as np
    if mode == "jax":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax  # noqa: F401 - before the baseline
    import tensorstash
    result = {"mode": mode}

    if mode == "save":
        tree = {"big": big_values(), "parts": [part_values(i) for i in range(NUM_PARTS)]}
        before = start_measure()
        t0 = time.perf_counter()
        stats = tensorstash.save(step, tree, chunk_bytes=4 * MiB, max_inflight_bytes=CAP,
                                 io_threads=IO_THREADS, sync=False)
        result.update(seconds=time.perf_counter() - t0, before=before, peak=rss_peak(),
                      held_bytes=sum(a.nbytes for a in [tree["big"], *tree["parts"]]),
                      stats=stats)
    elif mode in ("numpy", "staged", "mapped"):
        shape = (BIG[0], BIG[1] - 384) if mode == "staged" else BIG
        # A target without memory of its own: restore allocates the result.
        target = {"big": np.broadcast_to(np.zeros((), np.float32), shape)}
        from tshelpers import record_read_stats
        calls = record_read_stats(tensorstash)
        before = start_measure()
        t0 = time.perf_counter()
        got = tensorstash.restore(step, target=target, truncate=True, max_inflight_bytes=CAP,
                                  io_threads=IO_THREADS, mmap=mode == "mapped")
        result.update(seconds=time.perf_counter() - t0, before=before, peak=rss_peak(),
                      restored_bytes=got["big"].nbytes, stats=merged(calls),
                      read_calls=merged(calls)["read_calls"])
        want = big_values()
        result["correct"] = bool(np.array_equal(got["big"].view(np.uint32),
                                                want[:, :shape[1]].view(np.uint32)))
    elif mode == "jax":
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        tensorstash._options.HOST_BATCH_BYTES = 32 * MiB
        sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P(None, "x"))
        target = {"parts": [jax.ShapeDtypeStruct(PART, np.float32, sharding=sharding)
                            for _ in range(NUM_PARTS)]}
        from tshelpers import record_read_stats
        calls = record_read_stats(tensorstash)
        before = start_measure()
        t0 = time.perf_counter()
        got = tensorstash.restore(step, target=target, max_inflight_bytes=CAP,
                                  io_threads=IO_THREADS)
        for a in got["parts"]:
            a.block_until_ready()
        result.update(seconds=time.perf_counter() - t0, before=before, peak=rss_peak(),
                      restored_bytes=sum(a.nbytes for a in got["parts"]),
                      batches=merged(calls)["read_calls"],
                      stats=merged(calls))
        result["correct"] = all(
            a.sharding == sharding and np.array_equal(np.asarray(a), part_values(i))
            for i, a in enumerate(got["parts"]))
    elif mode == "gil":
        count = [0]
        stop = threading.Event()

        def counter():
            while not stop.is_set():
                count[0] += 1

        thread = threading.Thread(target=counter, daemon=True)
        thread.start()
        time.sleep(0.05)

        def measure(fn):
            c0, t0 = count[0], time.perf_counter()
            fn()
            return count[0] - c0, time.perf_counter() - t0

        # The counter's pace while this thread only sleeps (it then has a core to itself).
        idle_counts, idle_s = measure(lambda: time.sleep(0.3))
        target = {"big": np.broadcast_to(np.zeros((), np.float32), BIG)}
        restored = {}
        restore_counts, restore_s = measure(lambda: restored.update(tensorstash.restore(
            step, target=target, io_threads=2)))
        save_counts, save_s = measure(lambda: tensorstash.save(
            step + "-again", restored, io_threads=2, sync=False))
        stop.set()
        thread.join()
        result.update(idle_rate=idle_counts / idle_s, restore_counts=restore_counts,
                      restore_s=restore_s, save_counts=save_counts, save_s=save_s)
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
