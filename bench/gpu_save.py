#!/usr/bin/env python3
"""Saves from one GPU, in one process, both tools side by side, and where tensorstash's time
goes (issue 17, part 6): the copies out of GPU memory, then the writing.

    python bench/gpu_save.py [--scale 1.0] [--runs 3] [--dir /tmp/tensorstash-gpu-save]
                             [--out gpu_save.json]

Needs JAX with a GPU (JAX_PLATFORMS is set to "cuda"; --cpu runs it on the CPU, as a check of
the script). For the "stacked" scenario's two trees (bench/scenarios.py: 24 layers, per layer
and stacked on a layer axis) made on the GPU afresh before each run (a jax.Array keeps its
host copy once made, so a second save of the same array would not copy it again), medians of
--runs of:
  - raw: jax.device_get of the whole tree (JAX starts every leaf's copy, then waits);
  - raw: jax.device_put of the tree into pinned host memory, alone and then taken as NumPy;
  - tensorstash's copies alone (tensorstash._save.arrays_to_save) and tensorstash.save with
    fsync: with one leaf's copy after another (before start_save), with every leaf's copy
    started before the first is taken (copy_to_host_async), and with copies into pinned host
    memory (_options.SAVE_VIA_PINNED_HOST);
  - Orbax's save with fsync (its defaults).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_common  # noqa: E402  (sets JAX_PLATFORMS before JAX is imported)

import jax  # noqa: E402

import scenarios as S  # noqa: E402
import worker as W  # noqa: E402
import numpy as np  # noqa: E402
from tensorstash import _options, _save  # noqa: E402
from tensorstash import jax as tjax  # noqa: E402


def main() -> int:
    p = gpu_common.arguments(__doc__, "/tmp/tensorstash-gpu-save", 3)
    p.add_argument("--scale", type=float, default=1.0)
    args = p.parse_args()
    dev = gpu_common.first_device(args, "gpu_save")
    if dev is None:
        return 2
    stacked = S.make_scenarios(args.scale)["stacked"]
    tools = {"tensorstash": W.Tensorstash(), "orbax": W.Orbax()}
    start_save = tjax.JaxAdapter.start_save
    pinned_default = _options.SAVE_VIA_PINNED_HOST
    results = {"device": dev.device_kind, "jax": jax.__version__, "runs": args.runs, "rows": []}

    def timed(name, nbytes, fn, how="async"):
        seconds = []
        for _ in range(args.runs):
            shutil.rmtree(args.dir, ignore_errors=True)
            tree = W.make_tree(leaves, "2x4")
            tjax.JaxAdapter.start_save = None if how == "sequential" else start_save
            _options.SAVE_VIA_PINNED_HOST = how == "pinned"
            try:
                t0 = time.perf_counter()
                jax.block_until_ready(fn(tree))
                seconds.append(time.perf_counter() - t0)
            finally:
                tjax.JaxAdapter.start_save = start_save
                _options.SAVE_VIA_PINNED_HOST = pinned_default
            del tree
        r = {"name": name, "bytes": nbytes, "median_s": statistics.median(seconds),
             "runs_s": seconds}
        results["rows"].append(r)
        print(f"{name:<66} {r['median_s'] * 1e3:9.1f} ms {nbytes / r['median_s'] / 1e9:7.2f} GB/s",
              flush=True)

    def to_pinned(tree):
        return jax.tree.map(
            lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), tree)

    hows = {"sequential": "copies in turn", "async": "copy_to_host_async",
            "pinned": "via pinned host"}
    for state, leaves in stacked.trees.items():
        n = S.nbytes(leaves)
        timed(f"{state}: raw jax.device_get of the tree", n, jax.device_get)
        timed(f"{state}: raw device_put to pinned host memory", n, to_pinned)
        timed(f"{state}: raw device_put to pinned host + np.asarray", n,
              lambda t: jax.tree.map(np.asarray, to_pinned(t)))
        for how, said in hows.items():
            timed(f"{state}: tensorstash copies, {said}", n,
                  lambda t: _save.arrays_to_save(t, None)[0], how)
            timed(f"{state}: tensorstash save (fsync), {said}", n,
                  lambda t: tools["tensorstash"].save(os.path.join(args.dir, "ts"), t, True), how)
        timed(f"{state}: orbax save (fsync)", n,
              lambda t: tools["orbax"].save(os.path.join(args.dir, "orbax"), t, True))
    return gpu_common.finish(args, results)


if __name__ == "__main__":
    sys.exit(main())
