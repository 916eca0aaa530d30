"""One process of a multi-process CheckpointManager test (run by test_manager.py through
test_multiprocess.run_job, hence the same command line as mp_worker.py).

    python mp_manager_worker.py --phase save|restore --step ROOT --nproc N --pid I --port P --layout L

save: every process opens a manager on ROOT (max_to_keep=2; the coordinator is JAX's, by
default), saves steps 1..4 of a state sharded over all 8 devices of the job in the background,
each with its own per_process value (JSON in even processes, bytes in odd ones), asks
reached_preemption at every step (collective), and checks retention and its own items.
With --layout incremental the manager saves incrementally and "w" stays the same at every step:
steps 2-4 refer to step 1 for it, and retention retires step 1 instead of deleting it. "w" is
then the same jax.Array every step (copy_host_jax_arrays=False), so that each process refers to
its shards' chunks without hashing them (SaveStats.unhashed_chunks).
restore: a new job (a restart) opens managers on ROOT again, restores the latest step onto
another mesh, and reads back every process's per_process value. Exits 0 when all is well, 1
with a traceback otherwise.
"""

from __future__ import annotations

import sys

from mp_worker import parse_args, run_in_job

STEPS = (1, 2, 3, 4)


def main() -> int:
    args = parse_args(step_help="the manager's root", layout_default="")
    return run_in_job(args, run, distributed=True)


def per_process_value(pid: int, step: int):
    return {"pid": pid, "step": step, "pos": [step * 10 + pid]} if pid % 2 == 0 \
        else f"iterator {pid} at {step}".encode() + b"\0\xff"


def run(args) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import tensorstash
    from tshelpers import assert_same_array, pattern

    assert jax.process_count() == args.nproc and jax.device_count() == 8
    devices = jax.devices()
    shapes = {"w": ((16, 24), np.float32), "b": ((24,), np.float32), "e": ((40, 8), np.int32)}

    incremental = args.layout == "incremental"

    def values(step: int) -> dict:
        # Incremental: "w" is frozen (the same at every step).
        return {k: pattern(shape, dt, seed=(1 if incremental and k == "w" else step) * 10 + i)
                for i, (k, (shape, dt)) in enumerate(shapes.items())}

    root = args.step
    if args.phase == "save":
        mesh = Mesh(np.array(devices).reshape(2, 4), ("x", "y"))
        specs = {"w": P("x", "y"), "b": P("y"), "e": P(("x", "y"))}
        frozen = {}
        with tensorstash.CheckpointManager(root, max_to_keep=2, incremental=incremental,
                                           copy_host_jax_arrays=not incremental) as mgr:
            assert mgr.all_steps() == [], mgr.all_steps()
            for step in STEPS:
                params = {k: jax.make_array_from_callback(
                              v.shape, NamedSharding(mesh, specs[k]), lambda idx, v=v: v[idx])
                          for k, v in values(step).items()}
                if incremental:
                    params["w"] = frozen.setdefault("w", params["w"])
                state = {"params": params, "step": step}
                assert mgr.save(step, state, metadata={"step": step, "nproc": args.nproc},
                                per_process=per_process_value(args.pid, step),
                                metrics={"loss": 1.0 / step})
                assert not mgr.reached_preemption(step)
            mgr.wait_until_finished()
            assert mgr.all_steps() == [3, 4], mgr.all_steps()
            if incremental:  # process 0 runs retention
                assert mgr.retired_steps() == ([1] if args.pid == 0 else []), mgr.retired_steps()
            assert mgr.per_process(4) == per_process_value(args.pid, 4)
            last = mgr.last_save_stats
            assert last is not None and last.step == 4 and last.async_save, last
            if incremental:  # this process's chunks of "w", the only ones referenced
                assert 0 < last.unhashed_chunks == last.referenced_chunks, last
        print(f"process {args.pid}: saved {STEPS}, kept [3, 4]", flush=True)
        return

    # A restart: the latest step onto another mesh (4 x 2 over the devices reversed).
    mesh = Mesh(np.array(devices[::-1]).reshape(4, 2), ("x", "y"))
    specs = {"w": P("y", "x"), "b": P(), "e": P(None, "x")}
    with tensorstash.CheckpointManager(root, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [3, 4], mgr.all_steps()
        step = mgr.latest_step()
        assert step == 4
        want = values(step)
        target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                     sharding=NamedSharding(mesh, specs[k]))
                             for k, v in want.items()},
                  "step": 0}
        got = mgr.restore(step, target=target)
        assert got["step"] == 4
        for k, v in want.items():
            a = got["params"][k]
            assert a.sharding == NamedSharding(mesh, specs[k]), (k, a.sharding)
            index = a.sharding.addressable_devices_indices_map(v.shape)
            for shard in a.addressable_shards:
                block = v[index[shard.device]]
                assert_same_array(np.asarray(shard.data),
                                  np.ascontiguousarray(block).reshape(block.shape), k)
        assert mgr.metadata(step) == {"step": 4, "nproc": args.nproc}
        assert mgr.metrics(step) == {"loss": 0.25}
        assert mgr.per_process(step) == per_process_value(args.pid, step)
        for pid in range(args.nproc):
            assert mgr.per_process(step, pid) == per_process_value(pid, step), pid
            assert mgr.per_process(3, pid) == per_process_value(pid, 3), pid
        assert mgr.per_process(step, args.nproc) is None  # no such process
        assert mgr.last_restore_stats.bytes > 0
    print(f"process {args.pid}: restored step {step}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
