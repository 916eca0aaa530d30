#!/usr/bin/env python3
"""The incremental benchmark (issue 40 part 7; bench/README.md, "incremental"): saves of a state
that changes little between steps, through CheckpointManager(incremental=True), next to full
saves of the same state (a manager without incremental).

    python bench/incremental.py [--mib 256] [--runs 5] [--steps 50] [--dir /dev/shm/ts-incr]
                                [--scenarios lora,embedding,changing,restore,s3]
                                [--out bench/results/incremental.json]

One process, JAX on the CPU (one device). Scenarios:

  lora       a LoRA-like state of --mib MiB: 95% of the bytes frozen (8 matrices), the rest
             (adapters) new every step. "numpy": NumPy leaves (every frozen chunk hashed);
             "jax": jax.Array leaves, the frozen ones the same arrays every step, with
             copy_host_jax_arrays=False (the identity shortcut: no hashing). Full saves of the
             same state alongside.
  embedding  an embedding table of --mib MiB (rows of 256 float32) of which each step changes
             1% of the rows, drawn uniformly, at the default chunk size and at 256 KiB chunks.
  changing   every byte changes every step: what incremental saving costs when it saves
             nothing (hashing every chunk against the base), against full saves.
  restore    the LoRA-like state after --steps incremental steps: restore of the last step
             (its frozen chunks in the first step's files, its adapters in its own) against
             the restore of a full step of the same state.
  s3         the LoRA-like state (NumPy) on a local SeaweedFS (tests/s3/s3_servers.py) through
             a counting proxy (tests/s3/fault_proxy.py, no faults injected): requests and
             request-body bytes sent per save, incremental against full; and the save times
             without the proxy.

Each timed save is a synchronous manager save (async_save=False: the whole save, fsync
included), timed by SaveStats.total_s; "written" is the bytes of data files the step wrote
(SaveStats.stored_bytes). Figures are medians over --runs saves, each against the step before
(the first save of each series, a full one, is not counted). Restores are tensorstash.restore
into NumPy, timed around the call, medians of --runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

import numpy as np  # noqa: E402

MIB = 1 << 20


def log(msg: str) -> None:
    print(msg, flush=True)


def lora_state(total_bytes: int, step: int, frozen=None) -> dict:
    """95% frozen in 8 matrices, 5% adapters that depend on `step`; `frozen` reused if given."""
    frozen_bytes = int(total_bytes * 0.95)
    rows = max(1, frozen_bytes // 8 // (1024 * 4))
    if frozen is None:
        rng = np.random.default_rng(0)
        frozen = {f"layer{i}": rng.standard_normal((rows, 1024), dtype=np.float32)
                  for i in range(8)}
    adapter_rows = max(1, (total_bytes - frozen_bytes) // 16 // (1024 * 4))
    rng = np.random.default_rng(1000 + step)
    adapters = {f"layer{i}": rng.standard_normal((adapter_rows, 1024), dtype=np.float32)
                for i in range(16)}
    return {"frozen": frozen, "lora": adapters, "step": np.int64(step)}


def as_jax(tree: dict, frozen_jax=None) -> dict:
    import jax
    import jax.numpy as jnp
    if frozen_jax is None:
        frozen_jax = {k: jnp.asarray(v) + 0 for k, v in tree["frozen"].items()}
        jax.block_until_ready(frozen_jax)
    return {"frozen": frozen_jax, "lora": {k: jnp.asarray(v) for k, v in tree["lora"].items()},
            "step": tree["step"]}


def med(values):
    return statistics.median(values) if values else None


def series(root: str, make_state, runs: int, incremental: bool, **manager_kw) -> dict:
    """Saves runs + 1 steps (the first not counted); medians of time and bytes written."""
    import tensorstash
    shutil.rmtree(root, ignore_errors=True)
    stats: list = []
    with tensorstash.CheckpointManager(root, incremental=incremental, async_save=False,
                                       max_to_keep=3, on_save=stats.append,
                                       **manager_kw) as mgr:
        for step in range(runs + 1):
            mgr.save(step, make_state(step))
    counted = stats[1:]
    out = {"seconds": med([s.total_s for s in counted]),
           "written_bytes": med([s.stored_bytes for s in counted]),
           "referenced_chunks": med([s.referenced_chunks for s in counted]),
           "unhashed_chunks": med([s.unhashed_chunks for s in counted]),
           "runs": [{"seconds": s.total_s, "written_bytes": s.stored_bytes} for s in counted]}
    shutil.rmtree(root, ignore_errors=True)
    return out


def compare(name: str, root: str, make_state, runs: int, total: int, **kw) -> dict:
    full = series(root, make_state, runs, False, **kw)
    incr = series(root, make_state, runs, True, **kw)
    result = {"full": full, "incremental": incr,
              "time_ratio": incr["seconds"] / full["seconds"],
              "written_ratio": incr["written_bytes"] / max(1, full["written_bytes"])}
    log(f"{name:28s} full {full['seconds'] * 1e3:7.1f} ms {full['written_bytes'] / MIB:7.1f} MiB"
        f" | incremental {incr['seconds'] * 1e3:7.1f} ms {incr['written_bytes'] / MIB:7.1f} MiB"
        f" (time {result['time_ratio']:.1%}, written {result['written_ratio']:.1%},"
        f" unhashed chunks {incr['unhashed_chunks']})")
    return result


def scenario_lora(args) -> dict:
    total = args.mib * MIB
    base = lora_state(total, 0)
    frozen = base["frozen"]
    out = {"numpy": compare("lora (numpy leaves)", args.dir, lambda s: lora_state(total, s, frozen),
                            args.runs, total)}
    frozen_jax = as_jax(base)["frozen"]
    out["jax"] = compare("lora (jax, same arrays)", args.dir,
                         lambda s: as_jax(lora_state(total, s, frozen), frozen_jax), args.runs,
                         total, copy_host_jax_arrays=False)
    return out


def scenario_embedding(args) -> dict:
    total = args.mib * MIB
    rows = total // (256 * 4)
    table = np.random.default_rng(0).standard_normal((rows, 256), dtype=np.float32)

    def state(step):
        # Each step changes 1% of the rows (uniformly drawn) of the running table.
        if step > 0:
            rng = np.random.default_rng(step)
            touched = rng.choice(rows, size=max(1, rows // 100), replace=False)
            table[touched] += 0.01
        return {"embedding": table}

    out = {}
    for label, chunk in (("default chunks", None), ("256 KiB chunks", 256 << 10)):
        kw = {} if chunk is None else {"chunk_bytes": chunk}
        table[:] = np.random.default_rng(0).standard_normal((rows, 256), dtype=np.float32)
        full = series(args.dir, state, args.runs, False, **kw)
        table[:] = np.random.default_rng(0).standard_normal((rows, 256), dtype=np.float32)
        incr = series(args.dir, state, args.runs, True, **kw)
        r = {"full": full, "incremental": incr,
             "time_ratio": incr["seconds"] / full["seconds"],
             "written_ratio": incr["written_bytes"] / max(1, full["written_bytes"])}
        log(f"embedding 1% rows, {label:15s} full {full['seconds'] * 1e3:7.1f} ms | incremental "
            f"{incr['seconds'] * 1e3:7.1f} ms, written {r['written_ratio']:.1%}")
        out[label] = r
    return out


def scenario_changing(args) -> dict:
    total = args.mib * MIB

    def state(step):
        rng = np.random.default_rng(step)
        return {f"w{i}": rng.standard_normal((total // 8 // 4096, 1024), dtype=np.float32)
                for i in range(8)}
    # The states are made outside the timed save, so make them once per step and reuse.
    cache = {s: state(s) for s in range(args.runs + 1)}
    r = compare("everything changes", args.dir, cache.__getitem__, args.runs, total)
    r["overhead"] = r["time_ratio"] - 1
    return r


def scenario_restore(args) -> dict:
    import tensorstash
    total = args.mib * MIB
    frozen = lora_state(total, 0)["frozen"]
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    with tensorstash.CheckpointManager(root, incremental=True, async_save=False,
                                       max_to_keep=2, sync=False) as mgr:
        for step in range(args.steps + 1):
            mgr.save(step, lora_state(total, step, frozen))
        last = args.steps
        incr_path = mgr.step_path(last)
    full_path = os.path.join(root + "-full", "0000000001")
    shutil.rmtree(root + "-full", ignore_errors=True)
    tensorstash.save(full_path, lora_state(total, last, frozen), sync=False)
    times = {"incremental": [], "full": []}
    for i in range(args.runs + 1):
        for which, path in (("incremental", incr_path), ("full", full_path))[::1 if i % 2 else -1]:
            t = time.perf_counter()
            tree = tensorstash.restore(path)
            dt = time.perf_counter() - t
            if i == 0:
                want = lora_state(total, last, frozen)
                for k in want["frozen"]:
                    assert np.array_equal(tree["frozen"][k], want["frozen"][k]), k
                for k in want["lora"]:
                    assert np.array_equal(tree["lora"][k], want["lora"][k]), k
            else:
                times[which].append(dt)
            del tree
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(root + "-full", ignore_errors=True)
    r = {"steps": args.steps, "incremental_s": med(times["incremental"]),
         "full_s": med(times["full"]), "runs": times}
    r["ratio"] = r["incremental_s"] / r["full_s"]
    log(f"restore of step {args.steps} (incremental) {r['incremental_s'] * 1e3:.1f} ms vs a full "
        f"step's {r['full_s'] * 1e3:.1f} ms ({r['ratio']:.1%})")
    return r


def scenario_s3(args) -> dict:
    sys.path.insert(0, os.path.join(REPO, "tests", "s3"))
    import fault_proxy
    import s3_servers
    import tensorstash
    total = args.mib * MIB
    frozen = lora_state(total, 0)["frozen"]
    work = args.dir + "-s3"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    srv = s3_servers.start("seaweedfs", work)
    out = {}
    try:
        saved_env = {k: os.environ.get(k) for k in srv.env()}
        for mode in ("full", "incremental"):
            # Counted through the proxy: requests and request-body bytes per save.
            with fault_proxy.FaultProxy(srv.endpoint, p_503=0.0, p_reset=0.0) as fp:
                os.environ.update(srv.env())
                os.environ["AWS_ENDPOINT_URL"] = fp.endpoint
                tensorstash.configure_s3(endpoint=fp.endpoint)
                url = f"s3://{srv.bucket}/{mode}-counted"
                per_save = []
                with tensorstash.CheckpointManager(url, incremental=mode == "incremental",
                                                   async_save=False, max_to_keep=3) as mgr:
                    for step in range(args.runs + 1):
                        before = (fp.requests, fp.request_bytes)
                        mgr.save(step, lora_state(total, step, frozen))
                        per_save.append((fp.requests - before[0], fp.request_bytes - before[1]))
            counted = per_save[1:]
            tensorstash.configure_s3(endpoint=srv.endpoint)
            os.environ["AWS_ENDPOINT_URL"] = srv.endpoint
            timed = series(f"s3://{srv.bucket}/{mode}-timed",
                           lambda s: lora_state(total, s, frozen), args.runs,
                           mode == "incremental")
            out[mode] = {"requests": med([c[0] for c in counted]),
                         "request_bytes": med([c[1] for c in counted]),
                         "seconds": timed["seconds"], "written_bytes": timed["written_bytes"]}
            log(f"s3 lora {mode:11s} {out[mode]['requests']:5.0f} requests, "
                f"{out[mode]['request_bytes'] / MIB:7.1f} MiB sent, "
                f"{out[mode]['seconds'] * 1e3:7.1f} ms per save")
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    out["bytes_ratio"] = out["incremental"]["request_bytes"] / out["full"]["request_bytes"]
    out["time_ratio"] = out["incremental"]["seconds"] / out["full"]["seconds"]
    return out


SCENARIOS = {"lora": scenario_lora, "embedding": scenario_embedding,
             "changing": scenario_changing, "restore": scenario_restore, "s3": scenario_s3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="size of each state (default 256)")
    p.add_argument("--runs", type=int, default=5, help="counted saves/restores (default 5)")
    p.add_argument("--steps", type=int, default=50,
                   help="incremental steps before the restore (default 50)")
    p.add_argument("--dir", default="/dev/shm/tensorstash-bench-incremental")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--out", default=os.path.join(HERE, "results", "incremental.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results = {"mib": args.mib, "runs": args.runs, "steps": args.steps, "dir": args.dir,
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for name in args.scenarios.split(","):
        if name not in SCENARIOS:
            raise SystemExit(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
        results[name] = SCENARIOS[name](args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
