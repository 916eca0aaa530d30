"""One process of a multi-tier training job (run by cluster.py, for the tests and the demo).

    python worker.py --pid I --nproc 4 --port P --persistent DIR --local-dir DIR --out DIR
                     --last-step N [--local-interval 2] [--persistent-interval 10]
                     [--hold-at-end] [--kill-before-local-save] [--kill-during-local-save]

A small model (two dense layers and a 2 MiB table) on a mesh of 2 data-parallel slices x 4
model shards (8 CPU devices, 2 per process: processes 0-1 are slice 0, 2-3 slice 1) trains with SGD on batches drawn
from a data iterator whose position is per-process state. The job resumes from the manager's
latest step (its params and each process's iterator state), trains until --last-step, saving on
the manager's intervals, and writes out/process-<I>.json: the step it resumed from, the restore
statistics per tier, and the loss of every step it ran. The loss of a step depends on the
params and on the iterator position, so losses equal to an uninterrupted run's mean both were
restored right.

--hold-at-end: after the last step, print "READY" and wait to be killed (a node that is lost).
--kill-before-local-save / --kill-during-local-save: SIGKILL this process right before the local
save of the last step, or while it is in flight (its background write under way).
--flip-local-byte: damage this node's newest local data file before resuming.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--persistent", required=True)
    ap.add_argument("--local-dir", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--last-step", type=int, required=True)
    ap.add_argument("--local-interval", type=int, default=2)
    ap.add_argument("--persistent-interval", type=int, default=10)
    ap.add_argument("--local-max-to-keep", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--hold-at-end", action="store_true")
    ap.add_argument("--kill-before-local-save", action="store_true",
                    help="SIGKILL this process right before the local save of the last step")
    ap.add_argument("--kill-during-local-save", action="store_true",
                    help="SIGKILL this process while the local save of the last step is in flight")
    ap.add_argument("--stall", action="store_true",
                    help="join the JAX job but never open the manager (a process that is stuck)")
    ap.add_argument("--flip-local-byte", action="store_true",
                    help="before resuming, flip one byte of this node's newest local data file")
    return ap.parse_args()


def batch(position: int, rows: int = 16, width: int = 32):
    """The batch at iterator position `position` (the same in every process)."""
    import numpy as np

    rng = np.random.default_rng(position)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    y = rng.standard_normal((rows, 8)).astype(np.float32)
    return x, y


def flip_newest_local_byte(local_dir: str) -> str | None:
    """Flips a byte in the middle of the newest data file of this node's local tier."""
    newest = None
    for folder, _dirs, files in os.walk(local_dir):
        for name in files:
            if name.endswith(".dat"):
                path = os.path.join(folder, name)
                if newest is None or path > newest:
                    newest = path
    if newest is None:
        return None
    with open(newest, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0x5A]))
    return newest


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import tensorstash

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    shardings = {"w1": NamedSharding(mesh, P(None, "model")),
                 "w2": NamedSharding(mesh, P("model", None)),
                 "b": NamedSharding(mesh, P()),
                 "emb": NamedSharding(mesh, P(None, "model"))}
    shapes = {"w1": (32, 64), "w2": (64, 8), "b": (8,), "emb": (1024, 512)}
    batch_sharding = NamedSharding(mesh, P("data", None))

    def init_params():
        rng = np.random.default_rng(0)
        host = {k: (rng.standard_normal(s) * 0.1).astype(np.float32) for k, s in shapes.items()}
        return {k: jax.make_array_from_callback(shapes[k], shardings[k], lambda i, v=v: v[i])
                for k, v in host.items()}

    @jax.jit
    def train_step(params, x, y):
        def loss_fn(p):
            h = jnp.tanh(x @ p["w1"])
            # The embedding table only decays: 2 MiB of state that every step changes.
            return jnp.mean((h @ p["w2"] + p["b"] - y) ** 2) + 1e-3 * jnp.mean(p["emb"] ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return {k: params[k] - 0.05 * grads[k] for k in params}, loss

    result = {"pid": args.pid, "losses": {}, "resumed_from": None, "restore": None}
    if args.stall:
        time.sleep(3600)
    if args.flip_local_byte and args.local_dir:
        result["flipped"] = flip_newest_local_byte(args.local_dir)
    mgr = tensorstash.CheckpointManager(
        args.persistent, save_interval_steps=args.persistent_interval, max_to_keep=2,
        local_dir=args.local_dir, local_save_interval_steps=args.local_interval,
        local_max_to_keep=args.local_max_to_keep, coordination_timeout=args.timeout,
        local_server_address="127.0.0.1")
    start = mgr.latest_step()
    if start is None:
        params = init_params()
        iterator = {"process": args.pid, "position": 0}
        start = 0
    else:
        abstract = {k: jax.ShapeDtypeStruct(shapes[k], np.float32, sharding=shardings[k])
                    for k in shapes}
        params = mgr.restore(start, target=abstract)
        iterator = mgr.per_process(start)
        if iterator["process"] != args.pid or iterator["position"] != start:
            raise AssertionError(f"process {args.pid} resumed step {start} with the iterator "
                                 f"state {iterator}: not its own, or not of that step")
        stats = mgr.last_restore_stats
        result["resumed_from"] = start
        result["restore"] = {"bytes_from": stats.bytes_from, "seconds_from": stats.seconds_from,
                             "failures": list(stats.failures), "seconds": stats.seconds}
    for step in range(start + 1, args.last_step + 1):
        x_host, y_host = batch(iterator["position"])
        x = jax.make_array_from_callback(x_host.shape, batch_sharding, lambda i: x_host[i])
        y = jax.make_array_from_callback(y_host.shape, batch_sharding, lambda i: y_host[i])
        params, loss = train_step(params, x, y)
        iterator = {"process": args.pid, "position": iterator["position"] + 1}
        result["losses"][step] = float(loss)
        if args.kill_before_local_save and step == args.last_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.kill_during_local_save and step == args.last_step:
            # The save's background write is under way when the signal lands.
            mgr.save(step, params, per_process=iterator, force=True)
            os.kill(os.getpid(), signal.SIGKILL)
        mgr.save(step, params, per_process=iterator)
    mgr.wait_until_finished()
    result["local_steps"] = mgr.local_steps()
    if args.hold_at_end:
        write_result(args, result)
        print("READY", flush=True)
        while True:
            time.sleep(60)
    mgr.close()
    return result


def write_result(args, result: dict) -> None:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"process-{args.pid}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def main() -> int:
    args = parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // args.nproc}"
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                               num_processes=args.nproc, process_id=args.pid,
                               initialization_timeout=int(args.timeout))
    try:
        result = run(args)
        write_result(args, result)
        ok = True
    except BaseException as e:  # noqa: BLE001 - report anything, then fail
        traceback.print_exc()
        write_result(args, {"pid": args.pid, "error": f"{type(e).__name__}: {e}"})
        ok = False
    sys.stdout.flush()
    sys.stderr.flush()
    if ok:
        # Stay up until every process is done (the coordination service lives in process 0).
        try:
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    # Without waiting for the others on failure: a failed peer must not keep this one up.
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
