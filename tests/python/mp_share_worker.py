"""One process of a shared-reads restore (issue 42; run by test_multiprocess_share.py).

    python mp_share_worker.py --phase restore --step PATH --nproc N --pid I --port P --layout MODE

MODE: "replicated" (every process restores the whole step as NumPy), "reshard" (each process
its own rows of "w" over the job's devices, in blocks that cut the stored chunks unevenly, and
"b" replicated), "corrupt" (replicated; process 0 serves its chunks with a byte flipped),
"kill" (replicated; process 1 SIGKILLs itself once its first read has landed), "default"
(replicated, share_reads left at its default: on for an s3:// step). Every process
but a killed one checks its arrays bit for bit, and writes restore()'s stats to
share-<MODE>-<pid>.json in the working folder before leaving the job.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import mp_worker


def run(args) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import tensorstash
    from tensorstash import _options, _restore
    from tshelpers import assert_same_array, pattern

    values = {"w": pattern((16, 24), np.float32, seed=1), "b": pattern((10, 6), np.int32, seed=2)}
    # Short, so that a dead process costs seconds (the default is half an hour).
    mode = args.layout
    _options.COORDINATION_TIMEOUT_S = 4.0 if mode == "kill" else 8.0
    if mode == "corrupt" and args.pid == 0:
        _restore._CORRUPT_SHARED_FOR_TESTING = True
    progress = None
    if mode == "kill" and args.pid == 1:
        def progress(done, total):  # noqa: ARG001 - the first call: a read has landed
            os.kill(os.getpid(), signal.SIGKILL)
    stats: dict = {}
    if mode == "reshard":
        mesh = Mesh(np.array(jax.devices()), ("x",))
        target = {"w": jax.ShapeDtypeStruct((16, 24), np.float32,
                                            sharding=NamedSharding(mesh, P("x", None))),
                  "b": jax.ShapeDtypeStruct((10, 6), np.int32, sharding=NamedSharding(mesh, P()))}
        got = tensorstash.restore(args.step, target=target, share_reads=True, stats=stats)
        for k, a in got.items():
            for s in a.addressable_shards:
                assert_same_array(np.asarray(s.data), values[k][s.index], f"{k} {s.index}")
    else:
        share = {} if mode == "default" else {"share_reads": True}
        got = tensorstash.restore(args.step, stats=stats, progress=progress, **share)
        for k in values:
            assert_same_array(got[k], values[k], k)
    assert stats["shared"], stats
    with open(f"share-{mode}-{args.pid}.json", "w") as f:
        json.dump(stats, f)
    print(f"process {args.pid}: {json.dumps(stats)}", flush=True)
    if mode == "kill":
        # Not jax.distributed.shutdown: it would wait for the dead process.
        sys.stdout.flush()
        os._exit(0)


def main() -> int:
    args = mp_worker.parse_args()
    return mp_worker.run_in_job(args, run, distributed=True)


if __name__ == "__main__":
    sys.exit(main())
