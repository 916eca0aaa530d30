#!/usr/bin/env python3
"""The scaling benchmark: how tensorstash's and Orbax's save and restore times grow with the
number of arrays and with the bytes, and what each array costs by itself (bench/README.md,
"scaling").

    python bench/scaling.py [--runs 3] [--warmup 1] [--tools tensorstash,orbax]
                            [--series arrays,bytes,fixed-cost]
                            [--dir /tmp/tensorstash-bench-scaling]
                            [--out bench/results] [--orbax-cap-s 120] [--quick] [--keep]
    python bench/scaling.py --report bench/results/scaling.json   # redraws the .md and .png

Three series of points, each point measured for each tool:

  arrays      1,000 .. 100,000 float32 arrays (1-D, a multiple of 8 elements) adding up to
              256 MiB, each sharded over the 8 devices: save, then restore onto the same sharding.
  bytes       256 MiB .. 8 GiB in 64 float32 arrays of rows x 8192 (scenarios.big_arrays),
              sharded over the 2x4 mesh: save, then restore onto the same mesh.
  fixed-cost  1,000 .. 100,000 tiny arrays (16 float32 each) saved once from one device
              (untimed), restored onto that one device and onto all 8 (sharded): the fixed cost
              of an array, reported in microseconds per array.

--quick (a smoke run): arrays (10, 100) at 16 MiB, bytes (16, 32 MiB), fixed-cost
(10, 100); 1 run, no warm-up. Its files are named scaling-quick.* so as not to replace the
full results.

Every save and every restore runs in a fresh worker process (this script with --worker; JAX on
8 CPU devices), which uses bench/worker.py's run_save / run_restore: only the tool's call is
timed (a save until it returns durable, after removing the previous checkpoint and a sync; a
restore until jax.block_until_ready, after a sync and a read of every file of the checkpoint
into the page cache). Runs 0..warmup-1 are warm-ups; the first run's restores are verified bit
for bit (scenarios.block). The tools take turns in an order rotating run by run; each run goes
through every point of the selected series.

Orbax gets a time cap per call (--orbax-cap-s): past it its worker exits and the point is
recorded as capped, and that operation (and, for a save, the restores that need it) is not
tried again at that point. tensorstash gets no cap; a tensorstash worker that fails or runs past
--timeout stops the benchmark. While a worker runs the harness watches MemAvailable: below
--min-available-mib it kills the worker and records the point as failed (out of memory), so
that a point too large for the machine does not bring the machine down.

Writes <out>/scaling.json (every run, medians, machine, versions), scaling.md (the tables) and
scaling.png (log-log chart).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import report  # noqa: E402
import run as R  # noqa: E402  (harness helpers; imports no JAX)
import scenarios as S  # noqa: E402

MiB, GiB = S.MiB, S.GiB
SERIES = ("arrays", "bytes", "fixed-cost")
FULL = {"arrays": (1000, 3000, 10000, 30000, 100000),
        "bytes": (256 * MiB, 1 * GiB, 4 * GiB, 8 * GiB),
        "fixed-cost": (1000, 10000, 100000)}
QUICK = {"arrays": (10, 100), "bytes": (16 * MiB, 32 * MiB), "fixed-cost": (10, 100)}
ARRAYS_TOTAL = {"full": 256 * MiB, "quick": 16 * MiB}  # the "arrays" series' fixed total
BYTES_COUNT = 64  # the "bytes" series' fixed array count
TINY = 16  # float32 elements of a fixed-cost array
SHARDED_8 = (("a", "b"),)  # a 1-D array's rows over all 8 devices of a 2x4 mesh (or the 1 of "1")

# Worker exit statuses the harness tells apart from a failure.
EXIT_CAPPED = 3
CAPPED_LINE = "SCALING_CAPPED"
RESULT_LINE = "SCALING_RESULT "


def log(msg: str) -> None:
    print(msg, flush=True)


# --- the points (pure Python: the harness plans with them, the workers build from them) --------

LABELS = {"save": "save", "restore": "restore", "setup": "save (untimed setup, once)",
          "restore_1": "restore onto 1 device", "restore_8": "restore onto 8 devices"}


def series_ops(series: str, nbytes: int) -> dict[str, S.Op]:
    """The operations of a point of `series`, in the order they run. Layout "1" is device 0
    alone (a 1x1 mesh, made by the worker); raw_bytes is what the point moves (bench/worker.py
    sizes its preparations by it)."""
    if series == "fixed-cost":
        ops = (S.Op("setup", "save", "main", layout="1", raw_bytes=nbytes),
               S.Op("restore_1", "restore", "main", layout="1", raw_bytes=nbytes),
               S.Op("restore_8", "restore", "main", layout="2x4", raw_bytes=nbytes))
    else:
        ops = (S.Op("save", "save", "main", raw_bytes=nbytes),
               S.Op("restore", "restore", "main", raw_bytes=nbytes))
    return {op.name: op for op in ops}


def point_leaves(series: str, x: int, arrays_total: int) -> list[S.Leaf]:
    """The arrays of the point `x` of `series` (x: an array count, or total bytes for
    "bytes"). Their values are scenarios.block's (a function of seed and index)."""
    if series == "arrays":
        elements = max(8, 8 * round(arrays_total / 4 / x / 8))
        return [S.Leaf(f"a{i:06d}", (elements,), "float32", SHARDED_8, 1_000_000 + i)
                for i in range(x)]
    if series == "bytes":
        # big_arrays makes rows x 8192 float32 arrays of 128 MiB at scale 1.0.
        return S.big_arrays("w", BYTES_COUNT, x / BYTES_COUNT / (128 * MiB), 1)
    if series == "fixed-cost":
        return [S.Leaf(f"t{i:06d}", (TINY,), "float32", SHARDED_8, 2_000_000 + i)
                for i in range(x)]
    raise ValueError(f"unknown series {series!r}; choose from {', '.join(SERIES)}")


def fmt_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number at 1 or more."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def point_name(series: str, x: int) -> str:
    return f"{series}-{x}"


def x_label(series: str, x: int) -> str:
    return fmt_bytes(x) if series == "bytes" else f"{x:,} arrays"


# --- the worker (a fresh process per save or restore) ------------------------------------------

class CappedTool:
    """A tool of bench/worker.py whose save and restore calls may each take at most `cap_s`
    seconds: past it the process prints CAPPED_LINE and exits with EXIT_CAPPED, whatever the
    call is doing (a timer thread; the tools' IO and compression release the GIL). None: no
    cap."""

    def __init__(self, tool, cap_s: float | None):
        self.tool, self.cap_s = tool, cap_s
        self.name, self.cap = tool.name, tool.cap

    def _limited(self, what: str, fn, *args):
        if self.cap_s is None:
            return fn(*args)

        def expire():
            print(f"{CAPPED_LINE} {self.name} {what} ran past {self.cap_s} s", flush=True)
            os._exit(EXIT_CAPPED)

        timer = threading.Timer(self.cap_s, expire)
        timer.daemon = True
        timer.start()
        try:
            return fn(*args)
        finally:
            timer.cancel()

    def save(self, path: str, tree, sync: bool) -> None:
        self._limited("save", self.tool.save, path, tree, sync)

    def restore(self, path: str, target, partial: bool):
        return self._limited("restore", self.tool.restore, path, target, partial)


def worker_main(job: dict) -> None:
    """Runs one operation of one point for one tool and prints RESULT_LINE + its JSON."""
    import numpy as np

    import worker as W  # sets XLA_FLAGS (8 CPU devices) before it imports JAX

    import jax
    from jax.sharding import Mesh
    # Layout "1": device 0 alone, as a 1x1 mesh over the same axis names, so that worker.py's
    # shardings, targets and checks serve it like the 8-device meshes.
    W._meshes["1"] = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), S.AXES)

    leaves = point_leaves(job["series"], job["x"], job["arrays_total"])
    ops = series_ops(job["series"], S.nbytes(leaves))
    scenario = S.Scenario(point_name(job["series"], job["x"]), "", {"main": leaves},
                          tuple(ops.values()))
    op = ops[job["op"]]
    tool = W.TOOLS[job["tool"]]()
    os.makedirs(job["dir"], exist_ok=True)
    W.warm_up(tool, job)
    capped = CappedTool(tool, job["cap_s"])
    if op.kind == "save":
        result = W.run_save(capped, job, scenario, op, {})
    else:
        result = W.run_restore(capped, job, scenario, op)
    print(RESULT_LINE + json.dumps(result), flush=True)


# --- the harness ---------------------------------------------------------------------------------

def mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def last_error(stderr: str) -> str:
    """The line of a worker's stderr that says what went wrong (an exception's last line)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1][:400] if lines else "(nothing on stderr)"


class Scaling:
    """Runs the points and keeps every attempt: attempts[(series, x, op, tool)] = [result]."""

    def __init__(self, args):
        self.args = args
        self.attempts: dict = {}
        self.stopped: dict = {}  # (series, x, op, tool) -> "capped" | "failed": not tried again
        self.saved_in_run: dict = {}  # (series, x, tool) -> the last run whose save succeeded

    def call(self, tool: str, series: str, x: int, op: str, run: int, verify: bool) -> dict:
        """One worker process. Returns its result, or {"capped": ...} / {"failed": ...} for
        Orbax; a tensorstash worker that does not succeed raises HarnessError."""
        a = self.args
        job = {"tool": tool, "series": series, "x": x, "op": op, "run": run, "verify": verify,
               "dir": a.dir, "arrays_total": a.arrays_total,
               "cap_s": a.orbax_cap_s if tool == "orbax" else None}
        cmd = [a.python, os.path.abspath(__file__), "--worker", json.dumps(job)]
        what = f"{tool} {op} of {series} {x_label(series, x)} (run {run})"
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            p = subprocess.Popen(cmd, env=R.worker_env(), stdout=out, stderr=err, text=True,
                                 cwd=REPO)
            deadline = time.monotonic() + a.timeout
            reason = None
            while True:
                try:
                    rc = p.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    pass
                avail = mem_available()
                if avail < a.min_available_mib * MiB:
                    worker_rss = rss(p.pid)
                    reason = (f"out of memory: MemAvailable was {avail / GiB:.2f} GiB (below "
                              f"--min-available-mib {a.min_available_mib}) with the worker at "
                              f"{(worker_rss or 0) / GiB:.1f} GiB RSS; the harness killed it")
                elif time.monotonic() > deadline:
                    reason = f"ran past --timeout {a.timeout:.0f} s; the harness killed it"
                if reason:
                    p.kill()
                    rc = p.wait()
                    break
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        results = [line for line in stdout.splitlines() if line.startswith(RESULT_LINE)]
        if reason is None and rc == 0 and results:
            return json.loads(results[-1][len(RESULT_LINE):])
        if reason is None and rc == EXIT_CAPPED and CAPPED_LINE in stdout:
            return {"capped": True, "cap_s": a.orbax_cap_s}
        if reason is None:
            oom = " (SIGKILL: the kernel's OOM killer?)" if rc == -9 else ""
            reason = f"exit status {rc}{oom}: {last_error(stderr)}"
        if tool == "tensorstash":
            raise R.HarnessError(f"{what} failed: {reason}\n{stderr[-6000:]}")
        return {"failed": reason, "stderr_tail": stderr[-3000:]}

    def measure(self, tool: str, series: str, x: int, op: str, run: int, counted: bool,
                verify: bool) -> None:
        key = (series, x, op, tool)
        if key in self.stopped:
            return
        saved = self.saved_in_run.get((series, x, tool))
        if series == "fixed-cost" and op != "setup" and saved is None:
            return  # its checkpoint was not made (capped or failed): summarize() says why
        if op == "restore" and saved != run:
            return  # likewise for this run's save
        t0 = time.perf_counter()
        result = self.call(tool, series, x, op, run, verify)
        result.update(run=run, counted=counted)
        self.attempts.setdefault(key, []).append(result)
        if result.get("capped"):
            self.stopped[key] = "capped"
            shown = f"> {self.args.orbax_cap_s:g} s (capped)"
        elif "failed" in result:
            self.stopped[key] = "failed"
            shown = f"failed: {result['failed']}"
        else:
            if op in ("save", "setup"):
                self.saved_in_run[(series, x, tool)] = run
            shown = f"{result['seconds']:.3f} s" + (", verified" if result.get("verified") else "")
        log(f"    {tool:<11} {op:<9} {shown}   [{time.perf_counter() - t0:.1f} s with start-up]")

    def run_point(self, series: str, x: int, run: int, counted: bool, verify: bool) -> None:
        tools = R.rotate(list(self.args.tools), run)
        ops = list(series_ops(series, 0))
        if series == "fixed-cost":
            for tool in tools:
                if (series, x, tool) not in self.saved_in_run:
                    self.measure(tool, series, x, "setup", run, False, False)
            ops.remove("setup")
            for op in ops:
                for tool in tools:
                    self.measure(tool, series, x, op, run, counted, verify)
            return  # its checkpoints stay for the next runs (removed with --dir at the end)
        for op in ops:
            for tool in tools:
                self.measure(tool, series, x, op, run, counted, verify)
        shutil.rmtree(os.path.join(self.args.dir, point_name(series, x)), ignore_errors=True)

    def run(self) -> None:
        a = self.args
        total = a.warmup + a.runs
        for run in range(total):
            counted = run >= a.warmup
            log(f"run {run + 1}/{total}" + ("" if counted else " (warm-up)") +
                (" (verifying)" if run == 0 else ""))
            for series in a.series:
                for x in a.sizes[series]:
                    leaves = point_leaves(series, x, a.arrays_total)
                    log(f"  {series} {x_label(series, x)}: {len(leaves):,} arrays of "
                        f"{fmt_bytes(leaves[0].nbytes)}, {fmt_bytes(S.nbytes(leaves))}")
                    self.run_point(series, x, run, counted, run == 0)


# --- results -------------------------------------------------------------------------------------

def summarize(bench: Scaling, meta: dict) -> dict:
    """Per point, operation and tool: the status (ok, capped, failed, skipped), the median
    over the counted runs, µs per array and GB/s; per point and operation the ratio Orbax
    median / tensorstash median."""
    a = bench.args
    points = []
    for series in a.series:
        for x in a.sizes[series]:
            leaves = point_leaves(series, x, a.arrays_total)
            count, nbytes = len(leaves), S.nbytes(leaves)
            ops = series_ops(series, nbytes)
            point = {"series": series, "x": x, "arrays": count, "bytes": nbytes,
                     "array_shape": list(leaves[0].shape), "array_bytes": leaves[0].nbytes,
                     "ops": {}}
            for name, op in ops.items():
                entry = {"label": LABELS[name], "layout": op.layout}
                for tool in a.tools:
                    entry[tool] = summarize_op(bench, series, x, name, tool, count, nbytes)
                ts, ob = (entry.get(t, {}).get("seconds") for t in ("tensorstash", "orbax"))
                entry["ratio"] = ob / ts if ts and ob else None
                point["ops"][name] = entry
            points.append(point)
    return {"meta": meta, "points": points}


def summarize_op(bench: Scaling, series: str, x: int, op: str, tool: str, count: int,
                 nbytes: int) -> dict:
    tries = bench.attempts.get((series, x, op, tool), [])
    e: dict = {"runs": [{k: v for k, v in r.items() if k != "stderr_tail"} for r in tries]}
    capped = [r for r in tries if r.get("capped")]
    failed = [r for r in tries if "failed" in r]
    seconds = [r["seconds"] for r in tries if r.get("counted") and r.get("seconds") is not None]
    if op == "setup":  # untimed: its one run, for reference
        seconds = [r["seconds"] for r in tries if r.get("seconds") is not None]
    if capped:
        e.update(status="capped", cap_s=capped[0]["cap_s"])
    elif failed:
        e.update(status="failed", reason=failed[0]["failed"], stderr_tail=failed[0]["stderr_tail"])
    elif seconds:
        e["status"] = "ok"
    else:
        before = "setup" if series == "fixed-cost" else "save"
        prior = summarize_op(bench, series, x, before, tool, count, nbytes)["status"] \
            if op != before else None
        reasons = {"capped": "its save was capped", "failed": "its save failed"}
        e.update(status="skipped", reason=reasons.get(prior, "not run"))
    if e["status"] == "ok" or (seconds and e["status"] != "capped"):
        med = statistics.median(seconds)
        e.update(seconds=med, min=min(seconds), max=max(seconds), counted_runs=len(seconds),
                 us_per_array=med / count * 1e6, gb_per_s=nbytes / med / 1e9)
    e["verified"] = any(r.get("verified") for r in tries)
    mems = [r["memory"]["growth"] for r in tries if r.get("counted") and "memory" in r]
    if mems:
        e["peak_memory_growth"] = max(mems)
    return e


# The table of each series: its operations in column order, and the cells each one gets.
TABLE_OPS = {"arrays": ("save", "restore"), "bytes": ("save", "restore"),
             "fixed-cost": ("restore_1", "restore_8", "setup")}
NAMES = {"tensorstash": "tensorstash", "orbax": "Orbax"}


def _columns(series: str, op: str) -> tuple[str, ...]:
    if op == "setup":
        return ("time",)
    return ("time", "µs/array") if series == "fixed-cost" else ("time", "µs/array", "GB/s")


def _cells(e: dict, columns: tuple[str, ...]) -> list[str]:
    """The table cells of one summarized operation of one tool."""
    if e["status"] == "capped":
        time_cell = f"> {e['cap_s']:g} s (capped)"
    elif e["status"] == "skipped":
        time_cell = f"skipped ({e['reason']})"
    elif "seconds" not in e:
        time_cell = "failed (see below)"
    else:
        time_cell = report._time(e["seconds"]) + (
            " (failed later, see below)" if e["status"] == "failed" else "")
        values = {"time": time_cell, "µs/array": f"{e['us_per_array']:,.1f}",
                  "GB/s": f"{e['gb_per_s']:.2f}"}
        return [values[c] for c in columns]
    return [time_cell] + [""] * (len(columns) - 1)


def write_markdown(results: dict, path: str) -> None:
    meta = results["meta"]
    a, m, v = meta["args"], meta["machine"], meta["versions"]
    lines = [
        "# Scaling: tensorstash vs Orbax + TensorStore", "",
        f"{meta['date']}, `{meta['command']}` ({meta['seconds'] / 60:.0f} min). Medians of "
        f"{a['runs']} counted run(s) after {a['warmup']} warm-up run(s), the tools alternating "
        "run by run; each save and each restore in a fresh process; only the tool's call timed "
        "(restores until `jax.block_until_ready`, from a warm page cache). Ratio = Orbax time / "
        "tensorstash time (above 1: tensorstash is faster). µs/array = time / number of arrays; "
        "GB/s = bytes / time (10^9 bytes).", "",
        f"- Orbax (`PyTreeCheckpointer`, its defaults) is stopped after {a['orbax_cap_s']:g} s "
        "per call: such a point shows \"capped\" and is not tried again in later runs.",
        f"- Machine: {m['cores']} cores ({m['cpu']}), {m['memory']} memory, Linux {m['kernel']}; "
        f"storage {m['filesystem']}; load average {' '.join(meta['load_average_start'])} at the "
        f"start, {' '.join(meta.get('load_average_end', []))} at the end (a shared machine: "
        "single runs are noisy).",
        f"- Versions: tensorstash {v.get('tensorstash')} ({v.get('tensorstash_commit', '?')}), "
        f"orbax-checkpoint {v.get('orbax-checkpoint')}, tensorstore {v.get('tensorstore')}, "
        f"jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, numpy {v.get('numpy')}, Python "
        f"{m['python']}.",
    ]
    if meta.get("error"):
        lines += ["", f"**The run stopped early**: {meta['error'].splitlines()[0]}"]
    titles = {"arrays": f"arrays: a fixed total of {fmt_bytes(a['arrays_total'])} (float32, "
                        "1-D, each sharded over the 8 devices)",
              "bytes": f"bytes: {BYTES_COUNT} float32 arrays of rows x 8192 (2x4 mesh)",
              "fixed-cost": f"fixed cost per array: {TINY} float32 each, saved from one device"}
    notes = []
    for series in a["series"]:
        ops = TABLE_OPS[series]
        head = ["arrays"] if series == "fixed-cost" else \
            ["arrays" if series == "arrays" else "total", "array size"]
        header = head + ["tool"]
        for op in ops:
            header += [f"{LABELS[op]}" if c == "time" else c for c in _columns(series, op)]
        lines += ["", f"## {titles[series]}", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)]
        for p in (p for p in results["points"] if p["series"] == series):
            first = [f"{p['arrays']:,}" if series != "bytes" else fmt_bytes(p["bytes"])]
            if series != "fixed-cost":
                first.append(fmt_bytes(p["array_bytes"]))
            for tool in a["tools"]:
                row = first + [NAMES[tool]]
                for op in ops:
                    e = p["ops"][op][tool]
                    row += _cells(e, _columns(series, op))
                    if e["status"] == "failed":
                        notes.append(f"- {NAMES[tool]}, {series} {x_label(series, p['x'])}, "
                                     f"{LABELS[op]}: {e['reason']}")
                lines.append("| " + " | ".join(row) + " |")
            if len(a["tools"]) == 2 and any(p["ops"][op]["ratio"] for op in ops):
                row = first + ["Orbax / tensorstash"]
                for op in ops:
                    ratio = p["ops"][op]["ratio"]
                    row += [report._ratio(ratio) if ratio else ""] + \
                        [""] * (len(_columns(series, op)) - 1)
                lines.append("| " + " | ".join(row) + " |")
    if notes:
        lines += ["", "## Failures", ""] + notes
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


COLORS = {"tensorstash": "#264653", "orbax": "#e9a23b"}


def write_chart(results: dict, path: str) -> None:
    """Log-log panels: time against the number of arrays, time against the bytes, µs per array
    of the fixed-cost restores. A capped point is drawn at the cap with an open triangle."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    meta = results["meta"]
    series_list = meta["args"]["series"]
    fig, axes = plt.subplots(1, len(series_list), figsize=(max(6 * len(series_list), 9), 5),
                             squeeze=False)
    for ax, series in zip(axes[0], series_list):
        points = [p for p in results["points"] if p["series"] == series]
        fixed = series == "fixed-cost"
        ops = ("restore_1", "restore_8") if fixed else ("save", "restore")
        styles = dict(zip(ops, (("-", "o"), ("--", "s"))))
        for tool in meta["args"]["tools"]:
            for op in ops:
                xs, ys, cx, cy = [], [], [], []
                for p in points:
                    e = p["ops"][op].get(tool, {})
                    xv = p["bytes"] / GiB if series == "bytes" else p["arrays"]
                    scale = 1e6 / p["arrays"] if fixed else 1.0
                    if e.get("seconds") is not None and e.get("status") != "capped":
                        xs.append(xv)
                        ys.append(e["seconds"] * scale)
                    elif e.get("status") == "capped":
                        cx.append(xv)
                        cy.append(e["cap_s"] * scale)
                label = f"{NAMES[tool]} {LABELS[op]}"
                if xs:
                    ax.plot(xs, ys, styles[op][0], marker=styles[op][1], color=COLORS[tool],
                            label=label)
                if cx:
                    ax.plot(cx, cy, linestyle="none", marker="^", markerfacecolor="none",
                            markersize=10, color=COLORS[tool],
                            label=f"{label}: capped (drawn at the cap)")
                    if xs and xs[-1] < cx[0]:  # the trend towards the first capped point
                        ax.plot([xs[-1], cx[0]], [ys[-1], cy[0]], ":", color=COLORS[tool])
        ax.set_xscale("log")
        ax.set_yscale("log")
        # Ticks at the points on x; on y at 1, 2, 5 x 10^k as plain numbers (0.05, not 5x10^-2).
        ax.set_xticks([p["bytes"] / GiB if series == "bytes" else p["arrays"] for p in points],
                      [fmt_bytes(p["bytes"]) if series == "bytes" else f"{p['arrays']:,}"
                       for p in points])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.6g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if series == "arrays":
            ax.set_xlabel(f"arrays (total {fmt_bytes(meta['args']['arrays_total'])})")
            ax.set_ylabel("seconds")
            ax.set_title("Time against the number of arrays")
        elif series == "bytes":
            ax.set_xlabel(f"total bytes ({BYTES_COUNT} arrays)")
            ax.set_ylabel("seconds")
            ax.set_title("Time against the bytes")
        else:
            ax.set_xlabel(f"arrays ({TINY} float32 each)")
            ax.set_ylabel("µs per array")
            ax.set_title("Fixed cost per array (restore)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no results", transform=ax.transAxes, ha="center")
    v = meta["versions"]
    fig.suptitle(f"tensorstash {v.get('tensorstash')} vs orbax-checkpoint "
                 f"{v.get('orbax-checkpoint')} / tensorstore {v.get('tensorstore')}: medians of "
                 f"{meta['args']['runs']} run(s), {meta['machine']['cores']} cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_reports(results: dict, json_path: str) -> None:
    base = json_path[:-len(".json")]
    write_markdown(results, base + ".md")
    write_chart(results, base + ".png")


# --- main ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=None,
                   help="counted runs (default 3; 1 with --quick)")
    p.add_argument("--warmup", type=int, default=None,
                   help="uncounted runs first (default 1; 0 with --quick)")
    p.add_argument("--tools", default=",".join(R.TOOLS), help="default tensorstash,orbax")
    p.add_argument("--series", default=",".join(SERIES), help="default arrays,bytes,fixed-cost")
    p.add_argument("--dir", default="/tmp/tensorstash-bench-scaling",
                   help="storage folder for the checkpoints (emptied first, removed after "
                        "unless --keep)")
    p.add_argument("--out", default=os.path.join(HERE, "results"),
                   help="folder for scaling.json, .md, .png (default bench/results)")
    p.add_argument("--orbax-cap-s", type=float, default=120.0,
                   help="seconds an Orbax save or restore may take before the point is capped "
                        "(default 120)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds a worker process may take in all; a tensorstash worker past it "
                        "stops the benchmark (default 3600)")
    p.add_argument("--min-available-mib", type=int, default=1024,
                   help="kill a worker when MemAvailable falls below this (default 1024)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: small points, 1 run, no warm-up; writes scaling-quick.*")
    p.add_argument("--keep", action="store_true", help="keep --dir afterwards")
    p.add_argument("--python", default=sys.executable, help="interpreter of the worker processes")
    p.add_argument("--report", metavar="JSON",
                   help="only rewrite the .md and .png of these results")
    args = p.parse_args(argv)
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    if not args.tools or any(t not in R.TOOLS for t in args.tools):
        p.error(f"--tools: choose from {', '.join(R.TOOLS)}")
    args.series = [s.strip() for s in args.series.split(",") if s.strip()]
    if not args.series or any(s not in SERIES for s in args.series):
        p.error(f"--series: choose from {', '.join(SERIES)}")
    args.runs = args.runs if args.runs is not None else (1 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    if args.runs < 1 or args.warmup < 0 or args.orbax_cap_s <= 0 or args.timeout <= 0:
        p.error("--runs >= 1, --warmup >= 0, --orbax-cap-s > 0, --timeout > 0")
    args.sizes = QUICK if args.quick else FULL
    args.arrays_total = ARRAYS_TOTAL["quick" if args.quick else "full"]
    args.dir = os.path.abspath(args.dir)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            write_reports(json.load(f), args.report)
        return 0
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir, exist_ok=True)
    biggest = max(S.nbytes(point_leaves(s, x, args.arrays_total))
                  for s in args.series for x in args.sizes[s])
    need = biggest * (len(args.tools) + 1) + 2 * GiB  # one point's checkpoints + headroom
    free = shutil.disk_usage(args.dir).free
    if free < need:
        log(f"scaling: {args.dir} has {free / GiB:.1f} GiB free; the largest point needs about "
            f"{need / GiB:.1f} GiB")
        return 2
    started = time.time()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["bench/scaling.py"] + (sys.argv[1:] if argv is None else argv)),
            "args": {"runs": args.runs, "warmup": args.warmup, "tools": args.tools,
                     "series": args.series, "sizes": {s: args.sizes[s] for s in args.series},
                     "arrays_total": args.arrays_total, "orbax_cap_s": args.orbax_cap_s,
                     "quick": args.quick, "dir": args.dir},
            "machine": R.machine_facts(args.dir), "versions": R.versions(args.python),
            "load_average_start": R._read("/proc/loadavg").split()[:3]}
    log(f"scaling: series {', '.join(args.series)}; tools {', '.join(args.tools)}; "
        f"{args.warmup} warm-up + {args.runs} run(s); Orbax capped at {args.orbax_cap_s:g} s "
        f"per call; checkpoints in {args.dir}")
    bench = Scaling(args)
    status = 0
    try:
        bench.run()
    except R.HarnessError as e:
        meta["error"] = str(e)
        print(f"scaling: FAILED: {e}", file=sys.stderr)
        status = 1
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    meta["load_average_end"] = R._read("/proc/loadavg").split()[:3]
    meta["seconds"] = round(time.time() - started, 1)
    results = summarize(bench, meta)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "scaling-quick.json" if args.quick else "scaling.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    write_reports(results, json_path)
    md = json_path[:-len(".json")] + ".md"
    log(f"\nwrote {json_path}, .md, .png in {meta['seconds']:.0f} s\n")
    with open(md) as f:
        log(f.read())
    return status


if __name__ == "__main__":
    if "--worker" in sys.argv:
        try:
            worker_main(json.loads(sys.argv[sys.argv.index("--worker") + 1]))
        except BaseException:  # noqa: BLE001 - reported to the harness through stderr
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        os._exit(0)  # no slow teardown of JAX and the tools' thread pools
    sys.exit(main())
