"""One process of a multi-process save in Orbax's format (run by test_multiprocess_orbax.py
through mp_launch.run_job, hence mp_worker.py's command line; only --phase save).

    python mp_orbax_worker.py --phase save --step PATH --nproc N --pid I --port P --layout A
    python mp_orbax_worker.py --phase save --step ROOT ... --layout manager

--layout manager runs a CheckpointManager(ROOT, format="orbax") instead (run_manager below).

Every process builds the same deterministic tree (tree_values(): arrays sharded over all 8
devices of the job, a replicated one, a NumPy array, a key holding '/', a string, an int, and
typed PRNG keys, sharded and replicated) and calls tensorstash.save(..., format="orbax") (the
package coordinates through jax.distributed), then again without and with overwrite=True.
Exits 0 when all is well, 1 with a traceback.
"""

from __future__ import annotations

import json
import sys

from mp_worker import parse_args, run_in_job

# name: (shape, dtype name, partition spec on the 2 x 4 mesh ("x", "y") of the save)
ARRAYS = {
    "w": ((16, 24), "float32", ("x", "y")),
    "emb": ((40, 8), "bfloat16", (("x", "y"),)),
    "r": ((6, 5), "int32", ()),             # replicated on every device of both processes
    "odd": ((12, 6), "uint8", ("y", "x")),  # each process holds every row block, half the columns
    "s": ((), "float32", ()),
}
KEY_COUNT = 8  # PRNG keys sharded over "x"


def tree_values():
    """The plain values of the saved tree (NumPy arrays, the same in every process):
    (arrays by name, the '/' key's array, the host array, the key data of the sharded keys)."""
    import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy
    import numpy as np

    from tshelpers import pattern
    arrays = {k: pattern(shape, np.dtype(dt), seed=i)
              for i, (k, (shape, dt, _)) in enumerate(ARRAYS.items())}
    return arrays, pattern((8, 4), np.float32, seed=50), pattern((7, 3), np.int16, seed=99)


MANAGER_STEPS = (1, 2, 3, 4)
MANAGER_KEEP = 2          # max_to_keep of the manager run
PREEMPTED_AT = 3          # process 1 gets a SIGTERM before this step


def manager_tree_values(step: int):
    """The NumPy values of the state the manager run saves at `step`."""
    arrays, _, _ = tree_values()
    return {k: (v + step if v.dtype.kind in "fiu" else v) for k, v in arrays.items()
            if k in ("w", "r", "odd")}


def main() -> int:
    args = parse_args(layout_default="A")
    return run_in_job(args, run_manager if args.layout == "manager" else run,
                      distributed=args.nproc > 1)


def run_manager(args) -> None:
    """Every process runs one CheckpointManager(ROOT, format="orbax") (async saves, retention
    of MANAGER_KEEP steps, metrics, handle_sigterm) over MANAGER_STEPS; process 1 alone gets a
    SIGTERM before step PREEMPTED_AT, and every process must see reached_preemption() then."""
    import os
    import signal

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import tensorstash

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    mgr = tensorstash.CheckpointManager(args.step, format="orbax", max_to_keep=MANAGER_KEEP,
                                        async_save=True, handle_sigterm=True)
    for step in MANAGER_STEPS:
        if step == PREEMPTED_AT and args.pid == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        preempted = mgr.reached_preemption(step)
        assert preempted == (step >= PREEMPTED_AT), (step, preempted)
        state = {"params": {k: jax.make_array_from_callback(
            v.shape, NamedSharding(mesh, P(*ARRAYS[k][2])), lambda idx, v=v: v[idx])
            for k, v in manager_tree_values(step).items()}}
        assert mgr.save(step, state, metrics={"loss": 10.0 - step})
    mgr.wait_until_finished()
    print(f"process {args.pid}: steps {json.dumps(mgr.all_steps())}", flush=True)
    mgr.close()


def run(args) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import tensorstash

    assert jax.process_count() == args.nproc and jax.process_index() == args.pid
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    arrays, slash, host = tree_values()

    def global_array(values, spec):
        sharding = NamedSharding(mesh, P(*spec))
        return jax.make_array_from_callback(values.shape, sharding, lambda idx: values[idx])

    key_data = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(7), KEY_COUNT)))
    tree = {
        "params": {k: global_array(arrays[k], spec) for k, (_, _, spec) in ARRAYS.items()},
        "mlp/~/linear_0": {"w": global_array(slash, ("x",))},
        "host": host,
        "step": 1234,
        "name": f"saved by {args.nproc}",
        "rngs": {"keys": jax.random.wrap_key_data(global_array(key_data, ("x",))),
                 "one": jax.random.wrap_key_data(
                     global_array(np.asarray(jax.random.key_data(jax.random.key(3))), ()))},
    }
    tensorstash.save(args.step, tree, format="orbax")
    # Again: every process refuses the complete checkpoint (process 0 finds it and tells the
    # others), and with overwrite=True every process saves it anew.
    try:
        tensorstash.save(args.step, tree, format="orbax")
    except FileExistsError as e:
        print(f"process {args.pid}: refused: {e}", flush=True)
    else:
        raise AssertionError("a second save without overwrite=True succeeded")
    stats = tensorstash.save(args.step, tree, format="orbax", overwrite=True)
    print(f"process {args.pid}: saved {json.dumps(stats)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
