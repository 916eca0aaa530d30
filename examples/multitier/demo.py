"""The multi-tier demo (`make demo`, part 3): a node lost, the job resumed from its peers' RAM.

A JAX job of 4 processes (2 data-parallel slices x 2 processes, 2 CPU devices each) trains with
a local save into each node's RAM tier every 2 steps and a persistent save every 10. Each
process runs on its own simulated node (its own mount namespace, its node's RAM tier mounted at
the same path: cluster.py). At step 14 slice 1 is killed with SIGKILL and its nodes' RAM is
gone with it; the rest of the job dies too. All four processes are restarted with the process
order reversed (process 0 on the node process 3 ran on, ...), two of them on fresh nodes. They
resume from step 14, the newest step, held only in RAM, by the surviving nodes, reading 0 bytes
from persistent storage, and every loss afterwards must equal an uninterrupted run's, bit for
bit. Prints the bytes and seconds each process read from each tier.

    python examples/multitier/demo.py --out DIR    (as root: mount namespaces need it)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402

INTERVALS = ["--local-interval", "2", "--persistent-interval", "10"]
LAST_STEP = 24
KILL_AT = 14


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("multitier demo: needs root (each simulated node is a mount namespace)")
        return 1
    shutil.rmtree(args.out, ignore_errors=True)
    started = time.monotonic()

    print(f"-- uninterrupted run: 4 processes, steps 1-{LAST_STEP}")
    reference = Cluster(os.path.join(args.out, "reference"))
    expected = reference.start([0, 1, 2, 3], ["--last-step", str(LAST_STEP), *INTERVALS]).wait()
    expected = expected[0]["losses"]

    cluster = Cluster(os.path.join(args.out, "job"))
    print(f"-- the job: steps 1-{KILL_AT}, local saves every 2 steps, persistent every 10")
    job = cluster.start([0, 1, 2, 3], ["--last-step", str(KILL_AT), "--hold-at-end",
                                       *INTERVALS])
    job.wait_ready()
    print(f"-- SIGKILL slice 1 (processes 2 and 3) at step {KILL_AT}; their nodes' RAM is gone")
    job.kill([2, 3])
    cluster.lose_node(2)
    cluster.lose_node(3)
    job.kill()  # the job cannot go on without them
    print("   persistent steps:", sorted(n for n in os.listdir(cluster.persistent)
                                         if n.isdigit()))
    print("-- restart all four in reverse order: process i on node 3-i (nodes 2, 3 fresh)")
    results = cluster.start([3, 2, 1, 0], ["--last-step", str(LAST_STEP), *INTERVALS]).wait()

    ok = True
    print(f"   {'process':>7} {'resumed':>7}  {'local':>18}  {'peer':>18}  {'persistent':>18}"
          f"  {'restore':>7}")
    for pid, r in sorted(results.items()):
        b, s = r["restore"]["bytes_from"], r["restore"]["seconds_from"]
        tiers = "  ".join(f"{b[t] / 2**20:8.2f} MiB {s[t]:6.3f} s"
                          for t in ("local", "peer", "persistent"))
        print(f"   {pid:>7} {r['resumed_from']:>7}  {tiers}  {r['restore']['seconds']:6.3f} s")
        ok &= r["resumed_from"] == KILL_AT and b["persistent"] == 0
        for step, loss in r["losses"].items():
            if loss != expected[step]:
                print(f"   process {pid} step {step}: loss {loss!r} != {expected[step]!r}")
                ok = False
    steps = len(results[0]["losses"])
    print(f"-- losses of steps {KILL_AT + 1}-{LAST_STEP} ({steps} per process) "
          f"{'equal' if ok else 'DIFFER from'} the uninterrupted run's, bit for bit")
    print(f"multitier demo: {'PASS' if ok else 'FAIL'} in {time.monotonic() - started:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
