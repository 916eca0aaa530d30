"""One process of a multi-process tensorstash test (run by test_multiprocess.py).

    python mp_worker.py --phase save|restore --step PATH --nproc N --pid I --port P --layout L

Every process builds the same deterministic global arrays on a mesh over all of the job's
devices (8 in all, jax.devices() across processes), then either saves them (every process calls
tensorstash.save; the package coordinates through jax.distributed) or restores them onto the
layout's shardings and checks each addressable shard bit for bit. Exits 0 when all is well,
1 with a traceback otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Callable


def parse_args(*, step_help: str | None = None, layout_default: str | None = None,
               options: tuple[str, ...] = ()):
    """The command line of a worker (the one mp_launch.run_job gives it), with the further
    required options `options` (strings, e.g. "--root"); --layout is required unless it has a
    default."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "restore"], required=True)
    ap.add_argument("--step", required=True, help=step_help)
    for option in options:
        ap.add_argument(option, required=True)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--layout", required=layout_default is None, default=layout_default)
    return ap.parse_args()


def run_in_job(args, run: Callable, *, distributed: bool) -> int:
    """Runs run(args) as process args.pid of args.nproc, each with 8 // nproc CPU devices, inside
    a jax.distributed job (coordinator on 127.0.0.1:args.port) when `distributed`. Prints the
    traceback of a failure and a last line "process I/N: OK|FAILED"; returns the exit status."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // args.nproc}"
    import jax
    if distributed:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                                   num_processes=args.nproc, process_id=args.pid,
                                   initialization_timeout=60)
    try:
        run(args)
        ok = True
    except BaseException:  # noqa: BLE001 - report anything, then fail
        traceback.print_exc()
        sys.stdout.flush()
        ok = False
    if distributed:
        # Stay up until every process is done (the coordination service lives in process 0).
        try:
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            ok = False
    print(f"process {args.pid}/{args.nproc}: {'OK' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


def main() -> int:
    args = parse_args()
    return run_in_job(args, run, distributed=args.nproc > 1)


def run(args) -> None:
    import jax
    import ml_dtypes
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import tensorstash
    from tshelpers import assert_same_array, pattern

    assert jax.process_count() == args.nproc and jax.process_index() == args.pid
    assert jax.device_count() == 8, jax.devices()

    arrays = {  # name: (shape, dtype)
        "w": ((16, 24), np.float32),
        "emb": ((40, 8), ml_dtypes.bfloat16),
        "r": ((6, 5), np.int32),
        "z": ((0, 8), np.float32),
        "s": ((), np.float32),
        "odd": ((12, 6), np.uint8),
    }
    values = {k: pattern(shape, dt, seed=i) for i, (k, (shape, dt)) in enumerate(arrays.items())}
    host = pattern((7, 3), np.int16, seed=99)

    devices = jax.devices()
    layouts = {
        # Saving: 2 x 4 over the devices in order.
        "A": (Mesh(np.array(devices).reshape(2, 4), ("x", "y")),
              {"w": P("x", "y"), "emb": P(("x", "y")), "r": P(), "z": P(None, "y"), "s": P(),
               "odd": P("y", "x")}),
        # Restoring: 4 x 2 over the devices reversed, other axes and replication.
        "B": (Mesh(np.array(devices[::-1]).reshape(4, 2), ("x", "y")),
              {"w": P("y", "x"), "emb": P(None, "x"), "r": P("y"), "z": P("x"), "s": P(),
               "odd": P("y", None)}),
        # Restoring: one axis of 8, interleaved devices.
        "C": (Mesh(np.array(devices[1::2] + devices[::2]), ("x",)),
              {"w": P(None, "x"), "emb": P("x"), "r": P(), "z": P(None, "x"), "s": P(),
               "odd": P(None, None)}),
    }
    mesh, specs = layouts[args.layout]
    shardings = {k: NamedSharding(mesh, specs[k]) for k in arrays}

    if args.phase == "save":
        tree = {"params": {k: jax.make_array_from_callback(
                    values[k].shape, shardings[k], lambda idx, k=k: values[k][idx]) for k in arrays},
                "host": host, "step": 1234, "name": f"saved by {args.nproc}"}
        stats = tensorstash.save(args.step, tree, chunk_bytes=256)
        assert stats["raw_bytes"] > 0 or args.nproc > 1, stats
        print(f"process {args.pid}: saved {json.dumps(stats)}", flush=True)
        return

    # Restore: every process reads its own blocks only.
    target = {"params": {k: jax.ShapeDtypeStruct(values[k].shape, values[k].dtype,
                                                 sharding=shardings[k]) for k in arrays},
              "host": np.zeros(host.shape, host.dtype), "step": 0, "name": ""}
    t0 = time.time()
    got = tensorstash.restore(args.step, target=target)
    for k in arrays:
        a = got["params"][k]
        assert isinstance(a, jax.Array), (k, type(a))
        assert a.sharding == shardings[k], (k, a.sharding, shardings[k])
        assert a.dtype == values[k].dtype and a.shape == values[k].shape, k
        expected = shardings[k].addressable_devices_indices_map(a.shape)
        assert {s.device for s in a.addressable_shards} == set(expected), k
        for s in a.addressable_shards:
            want = values[k][expected[s.device]]
            assert_same_array(np.asarray(s.data), np.ascontiguousarray(want).reshape(want.shape),
                              f"{k} on {s.device}")
    assert_same_array(got["host"], host, "host")
    assert got["step"] == 1234 and got["name"].startswith("saved by "), got
    # Without a target, every process can read the whole checkpoint as NumPy.
    plain = tensorstash.restore(args.step)
    for k in arrays:
        assert_same_array(plain["params"][k], values[k], f"plain {k}")
    print(f"process {args.pid}: restored in {time.time() - t0:.2f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
