#!/usr/bin/env python3
"""The benchmark of issue 5: tensorstash against Orbax + TensorStore, and against the raw speed
of the storage, scenario by scenario (see bench/README.md).

    python bench/run.py [--scale 1.0] [--runs 5] [--warmup 1] [--scenarios large,cold,...]
                        [--tools tensorstash,orbax] [--dir /tmp/tensorstash-bench]
                        [--out bench/results] [--isolation op|scenario]

Normally run by scripts/run_bench.sh (make bench), which prepares .venv-bench. Each run does,
for each scenario and in an order that rotates run by run among the tools and the raw file
test: the saves (one process per tool), then each restore (by default one fresh process per
tool and restore, so that its peak memory is its own), then the raw file writes and reads of
the same byte counts. JAX start-up, making the data and checking it happen outside the timed
calls. Run 0..warmup-1 are warm-ups (not counted); the warm-ups and the first counted run
verify every restored array bit for bit (--verify-all: every run), and any difference stops the
benchmark with an error. Writes: <out>/latest.json, latest.md, latest.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "worker.py")
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import report  # noqa: E402
import scenarios as S  # noqa: E402

TOOLS = ("tensorstash", "orbax")
RAW = "raw"
BLOCK = 8 << 20  # raw file IO in 8 MiB blocks


class HarnessError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(msg, flush=True)


# --- the raw storage speed ------------------------------------------------------------------

class RawFile:
    """Plain sequential write (optionally with fsync) and read of one file, in 8 MiB blocks,
    from and into one buffer as large as the data."""

    def __init__(self):
        self.buf = np.empty(0, np.uint8)

    def _buffer(self, n: int) -> memoryview:
        if self.buf.size < n:
            self.buf = np.empty(n, np.uint8)
            pattern = np.frombuffer(os.urandom(1 << 20), np.uint8)
            for off in range(0, n, pattern.size):
                end = min(n, off + pattern.size)
                self.buf[off:end] = pattern[:end - off]
        return memoryview(self.buf)[:n]

    def write(self, path: str, n: int, fsync: bool) -> float:
        data = self._buffer(n)
        if os.path.exists(path):
            os.remove(path)
        os.sync()  # as before each timed save: no writeback of earlier data during the write
        S.prime_free_memory(os.path.dirname(path), n)  # as before each timed save
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = 0
            while off < n:
                off += os.write(fd, data[off:off + BLOCK])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - t0

    def read(self, path: str, n: int, cold: bool, fresh: bool = False) -> float | None:
        """Seconds to read `n` bytes of `path` into the one prepared buffer, or with `fresh`
        into memory mapped inside the timed region (4 KiB pages, as a restore's destinations:
        its page faults count, as a restore's do). None where a cold read is not permitted."""
        if not os.path.exists(path) or os.path.getsize(path) < n:
            self.write(path, n, True)
        data = None if fresh else self._buffer(n)
        os.sync()  # as before each timed restore: no writeback competing with the read
        if cold and not S.drop_page_cache():
            return None
        if fresh:
            S.prime_free_memory(os.path.dirname(path), n)  # as before each timed restore
        t0 = time.perf_counter()
        fresh_memory = (mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if fresh
                        else None)
        try:
            if fresh_memory is not None:
                data = memoryview(fresh_memory)
            fd = os.open(path, os.O_RDONLY)
            try:
                off = 0
                while off < n:
                    got = os.readv(fd, [data[off:off + BLOCK]])
                    if got <= 0:
                        raise HarnessError(f"{path} ended early")
                    off += got
            finally:
                os.close(fd)
            return time.perf_counter() - t0
        finally:
            if fresh_memory is not None:
                data.release()
                fresh_memory.close()


# --- the tools' processes -------------------------------------------------------------------

def worker_env(platform: str = "cpu") -> dict:
    """The workers' environment: JAX on 8 CPU devices, or on the GPU ("gpu": JAX's CUDA
    plugin, every mesh the first GPU)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "PYTHONPATH", "JAX_ENABLE_X64", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cuda" if platform == "gpu" else "cpu"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def run_worker(args, tool: str, scenario: str, ops: list[str], run: int, verify: bool) -> dict:
    job = {"tool": tool, "scenario": scenario, "ops": ops, "scale": args.scale, "dir": args.dir,
           "run": run, "verify": verify}
    cmd = [args.python, WORKER, json.dumps(job)]
    try:
        p = subprocess.run(cmd, env=worker_env(args.platform), capture_output=True, text=True,
                           timeout=args.timeout, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        raise HarnessError(f"{tool} {scenario} {ops} (run {run}) ran past {args.timeout} s\n"
                           f"{(e.stderr or '')[-4000:]}") from None
    logs = os.path.join(args.dir, "logs")
    os.makedirs(logs, exist_ok=True)
    with open(os.path.join(logs, f"run{run}-{scenario}-{tool}-{'+'.join(ops)}.log".replace(":", "_")), "w") as f:
        f.write(p.stdout + "\n--- stderr ---\n" + p.stderr)
    lines = [line for line in p.stdout.splitlines() if line.startswith("BENCH_RESULT ")]
    if p.returncode != 0 or not lines:
        raise HarnessError(f"{tool} {scenario} {ops} (run {run}) failed with status "
                           f"{p.returncode}:\n{p.stderr[-6000:]}")
    return json.loads(lines[-1][len("BENCH_RESULT "):])


# --- facts ----------------------------------------------------------------------------------

def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def machine_facts(directory: str) -> dict:
    meminfo = {line.split(":")[0]: line.split(":")[1].strip() for line in _read("/proc/meminfo").splitlines()
               if ":" in line}
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    try:
        fs = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "-T", directory],
                            capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        fs = ""
    if not fs:
        fs = subprocess.run(["stat", "-f", "-c", "%T", directory], capture_output=True,
                            text=True).stdout.strip()
    total, used, free = shutil.disk_usage(directory)
    return {"cores": os.cpu_count(), "cpu": cpu, "memory": meminfo.get("MemTotal", "?"),
            "kernel": platform.release(), "os": platform.platform(),
            "filesystem": f"{directory}: {fs}", "disk_free_gib": round(free / (1 << 30), 1),
            "python": platform.python_version()}


def versions(python: str) -> dict:
    code = ("import importlib.metadata as m, json; out = {}\n"
            "for n in ['tensorstash', 'orbax-checkpoint', 'tensorstore', 'jax', 'jaxlib', 'numpy',"
            " 'ml_dtypes', 'safetensors', 'matplotlib']:\n"
            "    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: out[n] = None\n"
            "print(json.dumps(out))")
    out = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                    check=True).stdout)
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no",
                                "--", "src", "python", "CMakeLists.txt"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        out["tensorstash_commit"] = commit + (" (+ local changes)" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return out


# --- the runs -------------------------------------------------------------------------------

def rotate(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


def one_device(sc: S.Scenario) -> S.Scenario:
    """`sc` for one device (--platform gpu), where every mesh is 1x1: without the operations that
    would only repeat another there (restores onto another mesh or replicated), so that "reshard"
    keeps none."""
    layout = sc.ops[0].layout
    return dataclasses.replace(sc, ops=tuple(op for op in sc.ops
                                             if op.layout == layout and not op.replicated))


class Bench:
    def __init__(self, args):
        self.args = args
        self.scenarios = S.make_scenarios(args.scale)
        if args.platform == "gpu":
            self.scenarios = {name: one_device(sc) for name, sc in self.scenarios.items()}
        self.selected = [sc for sc in (self.scenarios[name] for name in args.scenarios) if sc.ops]
        self.raw = RawFile()
        # samples[scenario][op][participant] = [result of each counted run]
        self.samples: dict = {sc.name: {op.name: {p: [] for p in args.tools + [RAW]} for op in sc.ops}
                              for sc in self.selected}
        self.verified: dict = {sc.name: {op.name: {t: False for t in args.tools} for op in sc.ops}
                               for sc in self.selected}
        self.tensorstash_cap = None
        self.devices = None  # what the workers ran on ("8 CPU devices", "1 GPU (...)")

    def ckpt_marker(self, source: str, tool: str, tree: str) -> str:
        return os.path.join(self.args.dir, source, tool, tree + ".saved")

    def record(self, sc, op_name: str, participant: str, result: dict, counted: bool,
               verify: bool) -> None:
        if participant != RAW and verify and result.get("verified"):
            self.verified[sc.name][op_name][participant] = True
        kind = next(op.kind for op in sc.ops if op.name == op_name)
        if participant != RAW and verify and kind in ("restore", "async") \
                and not result.get("verified") and result.get("seconds") is not None:
            raise HarnessError(f"{participant} {sc.name} {op_name}: restore not verified")
        if counted:
            self.samples[sc.name][op_name][participant].append(result)

    def raw_op(self, sc, op) -> dict:
        path = os.path.join(self.args.dir, sc.name, "raw.bin")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if op.raw in ("write", "write_fsync"):
            return {"seconds": self.raw.write(path, op.raw_bytes, op.raw == "write_fsync")}
        cold = op.raw == "read_cold"
        seconds = self.raw.read(path, op.raw_bytes, cold)
        if seconds is None:
            return {"seconds": None, "cold": "not permitted"}
        return {"seconds": seconds, "fresh_seconds": self.raw.read(path, op.raw_bytes, cold, True)}

    def run_scenario(self, sc, run: int, counted: bool, verify: bool) -> None:
        args = self.args
        parts = rotate(args.tools + [RAW], run)
        writes = [op for op in sc.ops if op.kind in ("save", "async")]
        reads = [op for op in sc.ops if op.kind == "restore"]

        def setup_ops(tool):
            if sc.reads_tool is not None and tool != sc.reads_tool:
                return []  # every tool reads the reads_tool's checkpoint: that tool sets it up
            if sc.reads_from and not os.path.exists(self.ckpt_marker(sc.reads_from[0], tool,
                                                                       sc.reads_from[1])):
                return [f"setup:{sc.reads_from[0]}"]
            return []

        def worker(tool, ops):
            t0 = time.perf_counter()
            out = run_worker(args, tool, sc.name, ops, run, verify)
            self.devices = out.pop("_devices", self.devices)
            for name, result in out.items():
                if tool == "tensorstash" and "cap" in result:
                    self.tensorstash_cap = result["cap"]
                self.record(sc, name, tool, result, counted, verify)
            shown = ", ".join(f"{n} {_fmt(r.get('seconds'))}" for n, r in out.items())
            log(f"    {tool:<11} {shown}   [{time.perf_counter() - t0:.1f} s with start-up]")

        def raw(ops):
            shown = []
            for op in ops:
                result = self.raw_op(sc, op)
                self.record(sc, op.name, RAW, result, counted, verify)
                shown.append(f"{op.name} {_fmt(result.get('seconds'))}")
            if ops:
                log(f"    {'raw':<11} " + ", ".join(shown))

        if args.isolation == "scenario":
            if sc.reads_tool is not None and setup_ops(sc.reads_tool):  # before anyone reads it
                run_worker(args, sc.reads_tool, sc.name, setup_ops(sc.reads_tool), run, False)
            for p in parts:
                if p == RAW:
                    raw(writes + reads)
                else:
                    worker(p, setup_ops(p) + [op.name for op in writes + reads])
            return
        for p in parts:
            if p == RAW:
                raw(writes)
            elif writes:
                worker(p, [op.name for op in writes])
        setup_tools = args.tools + ([sc.reads_tool] if sc.reads_tool not in (None, *args.tools) else [])
        for tool in setup_tools:
            setup = setup_ops(tool)
            if setup:
                run_worker(args, tool, sc.name, setup, run, False)
        for op in reads:
            for p in parts:
                if p == RAW:
                    raw([op])
                else:
                    worker(p, [op.name])

    def cleanup_after(self, index: int) -> None:
        """Removes what the scenario at `index` wrote, unless a later selected scenario reads it;
        and what it read from others."""
        sc = self.selected[index]
        later = self.selected[index + 1:]
        if not any(s.reads_from and s.reads_from[0] == sc.name for s in later):
            shutil.rmtree(os.path.join(self.args.dir, sc.name), ignore_errors=True)
        if sc.reads_from and not any(s.reads_from == sc.reads_from for s in later) \
                and not any(s.name == sc.reads_from[0] for s in later):
            shutil.rmtree(os.path.join(self.args.dir, sc.reads_from[0]), ignore_errors=True)

    def run(self, on_run=None) -> dict:
        """Every run; returns the summary. on_run(summary so far) after each counted run."""
        args = self.args
        started = time.time()
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir, exist_ok=True)
        cold_permitted = S.drop_page_cache()
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "args": {"scale": args.scale, "runs": args.runs, "warmup": args.warmup,
                         "scenarios": args.scenarios, "tools": args.tools, "dir": args.dir,
                         "isolation": args.isolation, "platform": args.platform},
                "machine": machine_facts(args.dir), "versions": versions(args.python),
                "drop_caches": "permitted" if cold_permitted else "not permitted",
                "load_average_start": _read("/proc/loadavg").split()[:3]}
        total = args.warmup + args.runs
        for run in range(total):
            counted = run >= args.warmup
            verify = args.verify_all or run <= args.warmup
            log(f"run {run + 1}/{total}" + ("" if counted else " (warm-up)") +
                (" (verifying)" if verify else ""))
            for i, sc in enumerate(self.selected):
                log(f"  {sc.name}")
                self.run_scenario(sc, run, counted, verify)
                self.cleanup_after(i)
            if counted and on_run is not None and run + 1 < total:
                on_run(summarize(self, dict(meta, seconds=round(time.time() - started, 1),
                                            devices=self.devices,
                                            partial=f"{run + 1 - args.warmup} of {args.runs} runs")))
        meta["load_average_end"] = _read("/proc/loadavg").split()[:3]
        meta["devices"] = self.devices
        meta["seconds"] = round(time.time() - started, 1)
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
        return summarize(self, meta)


def _fmt(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds:.3f}s"


# --- summary --------------------------------------------------------------------------------

def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _div(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def summarize(bench: Bench, meta: dict) -> dict:
    args = bench.args
    cap = bench.tensorstash_cap or (256 << 20)
    out = {"meta": meta, "scenarios": {}, "rows": []}
    for sc in bench.selected:
        sco = {"description": sc.description,
               "arrays": {tree: len(leaves) for tree, leaves in sc.trees.items()},
               "bytes": {tree: S.nbytes(leaves) for tree, leaves in sc.trees.items()},
               "ops": {}}
        for op in sc.ops:
            samples = bench.samples[sc.name][op.name]
            entry = {"label": op.label, "kind": op.kind, "bytes": op.raw_bytes, "raw_kind": op.raw}
            metrics = ["seconds"] if op.kind != "async" else ["blocking", "commit"]
            for p in args.tools + [RAW]:
                runs = samples[p]
                e = {"runs": [r.get("seconds") for r in runs],
                     "seconds": _median([r.get("seconds") for r in runs])}
                if p == RAW and op.kind == "restore":
                    e["fresh_seconds"] = _median([r.get("fresh_seconds") for r in runs])
                    e["fresh_runs"] = [r.get("fresh_seconds") for r in runs]
                if p != RAW:
                    for m in metrics:
                        e[m] = _median([r.get(m) for r in runs])
                        e[m + "_runs"] = [r.get(m) for r in runs]
                if any(r.get("cold") == "not permitted" for r in runs):
                    e["note"] = "not permitted (drop_caches)"
                if p != RAW:
                    e["verified"] = bench.verified[sc.name][op.name][p]
                    mems = [r["memory"] for r in runs if "memory" in r]
                    if mems and op.kind == "restore":
                        worst = max(mems, key=lambda m: m["growth"])
                        restored = worst["restored_bytes"]
                        limit = restored + cap + restored // 10
                        e["memory"] = {"peak_growth": worst["growth"], "restored_bytes": restored,
                                       "limit": limit, "cap": cap,
                                       "within": worst["growth"] <= limit,
                                       "method": worst["method"]}
                    elif mems:
                        e["memory"] = {"peak_growth": max(m["growth"] for m in mems)}
                entry[p] = e
            sco["ops"][op.name] = entry
            for m in metrics:
                ts = entry.get("tensorstash", {}).get(m)
                ob = entry.get("orbax", {}).get(m)
                raw = entry[RAW]["seconds"] if (m != "blocking") else None
                label = op.label if op.kind != "async" else f"{op.label}: {'time save() blocks' if m == 'blocking' else 'time until committed'}"
                row = {"scenario": sc.name, "op": op.name if op.kind != "async" else f"{op.name}.{m}",
                       "label": label, "bytes": op.raw_bytes, "tensorstash": ts, "orbax": ob,
                       "ratio": _div(ob, ts), "raw": raw, "raw_kind": op.raw if raw is not None else None,
                       "tensorstash_of_raw": _div(raw, ts), "orbax_of_raw": _div(raw, ob)}
                fresh = entry[RAW].get("fresh_seconds")
                if fresh is not None:
                    row.update(raw_fresh=fresh, tensorstash_of_raw_fresh=_div(fresh, ts),
                               orbax_of_raw_fresh=_div(fresh, ob))
                if entry[RAW].get("note") or entry.get("tensorstash", {}).get("note"):
                    row["note"] = "not permitted (drop_caches)"
                out["rows"].append(row)
        sco["derived"] = derived(sc, sco["ops"], args.tools)
        out["scenarios"][sc.name] = sco
    out["targets"] = targets(out)
    return out


def derived(sc, ops: dict, tools) -> dict:
    d = {}
    med = lambda op, tool, m="seconds": ops.get(op, {}).get(tool, {}).get(m)  # noqa: E731
    if sc.name == "stacked":
        for tool in tools:
            d[f"{tool}.restore_stacked/unstacked"] = _div(med("restore_stacked", tool),
                                                          med("restore_unstacked", tool))
            d[f"{tool}.save_stacked/unstacked"] = _div(med("save_stacked", tool),
                                                       med("save_unstacked", tool))
    if sc.name == "partial":
        share = ops["restore_params"]["bytes"] / ops["restore_all"]["bytes"]
        d["byte_share"] = share
        for tool in tools:
            d[f"{tool}.params/all"] = _div(med("restore_params", tool), med("restore_all", tool))
    return d


def targets(out: dict) -> list[dict]:
    """The issue's targets, each with the measured value and whether it is met."""
    rows = {(r["scenario"], r["op"]): r for r in out["rows"]}
    res = []

    def add(name, value, goal, met):
        res.append({"target": name, "value": value, "goal": goal,
                    "met": None if value is None else bool(met(value))})

    for sc, ops, goal in (("large", ("save_fsync", "save_nofsync", "restore"), 2.0),
                          ("many-small", ("save", "restore"), 5.0),
                          ("reshard", ("restore_2x4", "restore_1x8", "restore_replicated"), 3.0)):
        for op in ops:
            r = rows.get((sc, op))
            if r:
                add(f"{sc} {op}: Orbax/tensorstash", r["ratio"], f">= {goal}", lambda v, g=goal: v >= g)
    st = out["scenarios"].get("stacked")
    if st:
        add("stacked restore / unstacked restore (tensorstash)",
            st["derived"].get("tensorstash.restore_stacked/unstacked"), "<= 1.1", lambda v: v <= 1.1)
    pa = out["scenarios"].get("partial")
    if pa:
        share = pa["derived"]["byte_share"]
        add("partial: params-only time / full time (tensorstash)",
            pa["derived"].get("tensorstash.params/all"), f"<= {share * 1.3:.3f} (byte share {share:.3f} + 30%)",
            lambda v: v <= share * 1.3)
    for op, goal in (("async_save.blocking", 1.0), ("async_save.commit", 2.0),
                     ("async_save_no_copy.blocking", 1.0), ("async_save_no_copy.commit", 2.0)):
        r = rows.get(("async", op))
        if r:
            what = "" if op.startswith("async_save.") else " (jax.Arrays not copied first)"
            add(f"async {op.split('.')[1]}{what}: Orbax/tensorstash", r["ratio"], f">= {goal}",
                lambda v, g=goal: v >= g)
    for op in ("save_fsync", "save_nofsync", "restore"):
        r = rows.get(("large", op))
        if r:
            add(f"large {op}: fraction of raw speed (tensorstash)", r["tensorstash_of_raw"], ">= 0.7",
                lambda v: v >= 0.7)
    for op, goal in (("restore", 0.5), ("restore_numpy", 0.8)):  # issue 17's goals
        r = rows.get(("many-small", op))
        if r:
            add(f"many-small {op}: fraction of raw speed (tensorstash)", r["tensorstash_of_raw"],
                f">= {goal}", lambda v, g=goal: v >= g)
    for sc_name, sc in out["scenarios"].items():
        for op_name, op in sc["ops"].items():
            mem = op.get("tensorstash", {}).get("memory")
            if mem and "limit" in mem:
                add(f"{sc_name} {op_name}: peak memory growth / (restored + cap + 10%) (tensorstash)",
                    mem["peak_growth"] / mem["limit"], "<= 1.0", lambda v: v <= 1.0)
    return res


# --- main -----------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0,
                   help="data size relative to the issue's (default 1.0; the smoke test uses 0.002)")
    p.add_argument("--runs", type=int, default=5, help="counted runs (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted runs first (default 1)")
    p.add_argument("--scenarios", default="all",
                   help=f"comma-separated, of {', '.join(S.SCENARIO_NAMES)} (default all)")
    p.add_argument("--tools", default=",".join(TOOLS), help="default tensorstash,orbax")
    p.add_argument("--dir", default="/tmp/tensorstash-bench",
                   help="storage folder for checkpoints and raw files (emptied first)")
    p.add_argument("--out", default=os.path.join(HERE, "results"),
                   help="folder for latest.json, latest.md, latest.png (default bench/results)")
    p.add_argument("--isolation", choices=("op", "scenario"), default="op",
                   help="op: a fresh process per restore (default; clean peak memory); "
                        "scenario: one process per tool and scenario (faster start-up)")
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: 8 CPU devices (default); gpu: the first GPU, every mesh 1x1 "
                        "(JAX with its CUDA plugin installed)")
    p.add_argument("--verify-all", action="store_true", help="verify every run's restores")
    p.add_argument("--keep", action="store_true", help="keep --dir afterwards")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    p.add_argument("--python", default=sys.executable, help="interpreter of the worker processes")
    args = p.parse_args(argv)
    args.scenarios = list(S.SCENARIO_NAMES) if args.scenarios == "all" else \
        [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in args.scenarios if s not in S.SCENARIO_NAMES]
    if bad:
        p.error(f"unknown scenarios {bad}; choose from {', '.join(S.SCENARIO_NAMES)}")
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    if not args.tools or any(t not in TOOLS for t in args.tools):
        p.error(f"--tools: choose from {', '.join(TOOLS)}")
    if args.runs < 1 or args.warmup < 0 or args.scale <= 0:
        p.error("--runs >= 1, --warmup >= 0, --scale > 0")
    args.dir = os.path.abspath(args.dir)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = Bench(args)

    def write(results: dict, chart: bool) -> None:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "latest.json"), "w") as f:
            json.dump(results, f, indent=1)
        report.write_markdown(results, os.path.join(args.out, "latest.md"))
        if chart:
            report.write_chart(results, os.path.join(args.out, "latest.png"))

    try:
        # The results so far after each counted run (meta "partial"), so that a benchmark
        # stopped early still leaves its medians.
        results = bench.run(on_run=lambda partial: write(partial, False))
    except HarnessError as e:
        print(f"bench: FAILED: {e}", file=sys.stderr)
        return 1
    write(results, True)
    log(f"\nwrote {args.out}/latest.json, latest.md, latest.png in {results['meta']['seconds']:.0f} s\n")
    with open(os.path.join(args.out, "latest.md")) as f:
        log(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
