"""One process of the chaos test's multi-tier job (tests/python/test_chaos.py, started through
examples/multitier/cluster.py, each process in its own mount namespace on a simulated node).

    python chaos_worker.py --pid I --nproc N --port P --persistent DIR --local-dir DIR --out DIR
                           --last-step S [--local-interval 1] [--persistent-interval 3]

The model is tiny and its state after step s is a deterministic function of s (`expected(s)`,
plain NumPy): the jitted step only does element-wise integer and exactly representable float
arithmetic, so a sharded JAX run of any number of processes and the NumPy recurrence agree bit
for bit. The arrays live on a mesh of 2 slices ("data", replicated) x 4 model shards over the
job's 8 CPU devices (8 / N per process), so jobs of 2 and of 4 processes restore each other's
steps.

The job resumes from the manager's latest step and checks, before training on, that what it
restored is bit-identical to expected(step) for the step actually restored
(last_restore_stats.step), that its per-process value is the one it saved at that step
({"step", "pid", "nproc"}), or None only when the job that saved the restored step had no
process of its index, and that the metadata names that step. It writes that outcome to
out/restore-<I>.json and prints "RESUMED <step>" before it trains; then, before each save,
"STEP <step>"; at the end it checks the state again and writes out/process-<I>.json. A failed
check raises (exit 1, the reason in the log and in out/process-<I>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import numpy as np

SHAPES = {"w": (32, 64), "f": (64, 8), "t": (16, 64), "b": (8,)}
DTYPES = {"w": np.uint32, "f": np.float32, "t": np.int32, "b": np.int32}
MUL = np.uint32(1664525)
ADD = np.uint32(1013904223)


def initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(12345)
    return {
        "w": rng.integers(0, 2**32, SHAPES["w"], dtype=np.uint64).astype(np.uint32),
        "f": rng.integers(-1000, 1000, SHAPES["f"]).astype(np.float32),
        "t": rng.integers(-2**20, 2**20, SHAPES["t"]).astype(np.int32),
        "b": np.zeros(SHAPES["b"], np.int32),
    }


def step_numpy(state: dict[str, np.ndarray], s: int) -> dict[str, np.ndarray]:
    """The update of step s, the recurrence the jitted step computes."""
    with np.errstate(over="ignore"):
        w = state["w"] * MUL + (ADD + np.uint32(s))
    f = state["f"] + np.float32(s % 7 - 3)  # small integers: exact in float32
    t = state["t"] ^ (w[:16, :].view(np.int32) >> 3)
    b = state["b"] + np.int32(s)
    return {"w": w, "f": f, "t": t, "b": b}


_CACHE: dict[int, dict[str, np.ndarray]] = {0: initial()}


def expected(s: int) -> dict[str, np.ndarray]:
    """The committed state of step s (step 0: the initial state)."""
    if s not in _CACHE:
        known = max(k for k in _CACHE if k <= s)
        state = _CACHE[known]
        for k in range(known + 1, s + 1):
            state = step_numpy(state, k)
            _CACHE[k] = state
    return _CACHE[s]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--persistent", required=True)
    ap.add_argument("--local-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--last-step", type=int, required=True)
    ap.add_argument("--local-interval", type=int, default=1)
    ap.add_argument("--persistent-interval", type=int, default=3)
    ap.add_argument("--max-to-keep", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0)
    return ap.parse_args()


def write_json(args, name: str, value: dict) -> None:
    path = os.path.join(args.out, name)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import tensorstash

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    shardings = {"w": NamedSharding(mesh, P(None, "model")),
                 "f": NamedSharding(mesh, P("model", None)),
                 "t": NamedSharding(mesh, P(None, "model")),
                 "b": NamedSharding(mesh, P())}

    def place(host: dict[str, np.ndarray]) -> dict:
        return {k: jax.make_array_from_callback(SHAPES[k], shardings[k], lambda i, v=v: v[i])
                for k, v in host.items()}

    def check_state(params: dict, s: int, what: str) -> None:
        want = expected(s)
        for k in SHAPES:
            for shard in params[k].addressable_shards:
                got = np.asarray(shard.data)
                if not same_bits(got, want[k][shard.index]):
                    raise AssertionError(
                        f"process {args.pid}: {what}: array {k!r} shard {shard.index} on "
                        f"{shard.device} is not the state of step {s} (first values "
                        f"{got.ravel()[:4]} != {want[k][shard.index].ravel()[:4]})")

    @jax.jit
    def train_step(params, s):
        w = params["w"] * jnp.uint32(MUL) + (jnp.uint32(ADD) + s.astype(jnp.uint32))
        f = params["f"] + (s % 7 - 3).astype(jnp.float32)
        t = params["t"] ^ (jax.lax.bitcast_convert_type(w[:16, :], jnp.int32) >> 3)
        b = params["b"] + s.astype(jnp.int32)
        return {"w": w, "f": f, "t": t, "b": b}

    mgr = tensorstash.CheckpointManager(
        args.persistent, save_interval_steps=args.persistent_interval,
        max_to_keep=args.max_to_keep, local_dir=args.local_dir,
        local_save_interval_steps=args.local_interval, local_max_to_keep=1,
        coordination_timeout=args.timeout, local_server_address="127.0.0.1")
    print("OPENED", flush=True)
    result = {"pid": args.pid, "nproc": args.nproc, "latest": None, "resumed_from": 0}
    latest = mgr.latest_step()
    result["latest"] = latest
    print(f"LATEST {latest}", flush=True)
    if latest is None:
        params = place(expected(0))
        start = 0
        write_json(args, f"restore-{args.pid}.json", dict(result, checked=True))
    else:
        abstract = {k: jax.ShapeDtypeStruct(SHAPES[k], DTYPES[k], sharding=shardings[k])
                    for k in SHAPES}
        params = mgr.restore(latest, target=abstract)
        stats = mgr.last_restore_stats
        start = stats.step
        meta = mgr.metadata(start)
        value = mgr.per_process()
        info = dict(result, resumed_from=start, metadata=meta, value=value,
                    bytes_from=stats.bytes_from, failures=list(stats.failures), checked=False)
        write_json(args, f"restore-{args.pid}.json", info)
        check_state(params, start, f"restored step {start} (latest_step() said {latest})")
        if not isinstance(meta, dict) or meta.get("step") != start:
            raise AssertionError(f"process {args.pid}: restored step {start} with the "
                                 f"metadata {meta!r}")
        if value is None:
            if args.pid < meta["nproc"]:
                raise AssertionError(
                    f"process {args.pid}: restored step {start}, saved by a job of "
                    f"{meta['nproc']} processes, without this process's per-process value")
        elif value.get("step") != start or value.get("pid") != args.pid:
            raise AssertionError(f"process {args.pid}: restored step {start} with the "
                                 f"per-process value {value!r}: not its own, or not of that step")
        result.update(resumed_from=start, metadata=meta, value=value,
                      bytes_from=stats.bytes_from, failures=list(stats.failures))
        write_json(args, f"restore-{args.pid}.json", dict(result, checked=True))
    print(f"RESUMED {start}", flush=True)
    saved = []
    for s in range(start + 1, args.last_step + 1):
        params = train_step(params, jnp.int32(s))
        print(f"STEP {s}", flush=True)  # before its save: no step above it is committed
        if mgr.save(s, params, per_process={"step": s, "pid": args.pid, "nproc": args.nproc},
                    metadata={"step": s, "nproc": args.nproc}):
            saved.append(s)
    mgr.wait_until_finished()
    check_state(params, args.last_step, f"trained to step {args.last_step}")
    result["saved"] = saved
    result["local_steps"] = mgr.local_steps()
    mgr.close()
    return result


def main() -> int:
    args = parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // args.nproc}"
    os.environ.pop("JAX_ENABLE_X64", None)
    os.makedirs(args.out, exist_ok=True)
    import jax

    # The coordinator (in process 0) listens on the loopback interface only.
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                               coordinator_bind_address=f"127.0.0.1:{args.port}",
                               num_processes=args.nproc, process_id=args.pid,
                               initialization_timeout=int(args.timeout))
    try:
        result = run(args)
        write_json(args, f"process-{args.pid}.json", result)
        ok = True
    except BaseException as e:  # noqa: BLE001 - report anything, then fail
        traceback.print_exc()
        write_json(args, f"process-{args.pid}.json",
                   {"pid": args.pid, "error": f"{type(e).__name__}: {e}"})
        ok = False
    sys.stdout.flush()
    sys.stderr.flush()
    if ok:
        try:  # the coordination service lives in process 0: stay until every process is done
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
