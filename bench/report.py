"""The benchmark's Markdown table and PNG chart, from the results of bench/run.py.

    python bench/report.py bench/results/latest.json     # rewrites latest.md and latest.png
"""

from __future__ import annotations

import json
import os
import sys

MiB, GiB = 1 << 20, 1 << 30


def _time(seconds, nbytes=None) -> str:
    if seconds is None:
        return "n/a"
    t = f"{seconds * 1e3:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"
    if seconds < 0.1:
        t = f"{seconds * 1e3:.1f} ms"
    if nbytes:
        t += f" ({nbytes / seconds / 1e9:.2f} GB/s)"
    return t


def _bytes(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def _ratio(r) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def _pct(f) -> str:
    return "n/a" if f is None else f"{100 * f:.0f}%"


def write_markdown(results: dict, path: str) -> None:
    meta = results["meta"]
    a, m, v = meta["args"], meta["machine"], meta["versions"]
    lines = [
        "# tensorstash vs Orbax + TensorStore: latest benchmark",
        "",
        f"{meta['date']}, `bench/run.py --scale {a['scale']} --runs {a['runs']} --warmup {a['warmup']}"
        f" --isolation {a['isolation']}` ({meta['seconds'] / 60:.0f} min"
        + (f"; stopped early: {meta['partial']}" if meta.get("partial") else "") +
        f"). Medians of {a['runs']} "
        f"counted runs after {a['warmup']} warm-up run(s), tools alternating run by run; ratio = "
        f"Orbax time / tensorstash time (above 1: tensorstash is faster); \"of raw\" = the time of "
        f"a plain sequential write (+fsync where the save syncs) or read of one file of the same "
        f"bytes on the same filesystem / the tool's time; \"into fresh memory\": the raw read "
        f"into memory mapped inside the timed region, whose page faults count as a restore's "
        f"destinations' do.",
        "",
        f"- Machine: {m['cores']} cores ({m['cpu']}), {m['memory']} memory, Linux {m['kernel']}; "
        f"storage {m['filesystem']}; load average {' '.join(meta['load_average_start'])} at the "
        f"start, {' '.join(meta.get('load_average_end', []))} at the end (a shared machine: "
        f"other jobs ran during the benchmark, so single runs are noisy).",
        f"- Versions: tensorstash {v.get('tensorstash')} ({v.get('tensorstash_commit', '?')}), "
        f"orbax-checkpoint {v.get('orbax-checkpoint')}, tensorstore {v.get('tensorstore')}, "
        f"jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, numpy {v.get('numpy')}, ml_dtypes "
        f"{v.get('ml_dtypes')}, Python {m['python']}.",
        "- Orbax: `PyTreeCheckpointer` (its defaults: OCDBT, compression) for saves and restores, "
        "`CheckpointManager` (async) for the async scenario; without fsync = TensorStore's "
        "`file_io_sync: false`. tensorstash: `save`/`restore` and `CheckpointManager` with their "
        "defaults. " + (f"Devices: {meta.get('devices')}, every mesh 1x1." if meta["args"].get(
            "platform") == "gpu" else "8 CPU devices (`--xla_force_host_platform_device_count=8`)."),
        f"- Cold cache (`echo 3 > /proc/sys/vm/drop_caches`): {meta['drop_caches']}.",
        "",
        "| scenario | operation | bytes | tensorstash | Orbax | ratio | tensorstash of raw | "
        "Orbax of raw | raw, same bytes | of raw into fresh memory: tensorstash, Orbax (raw) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        nb = r["bytes"] if not r["op"].endswith(".blocking") else None
        raw = "" if r["raw"] is None else f"{_time(r['raw'], r['bytes'])} {r['raw_kind']}"
        fresh = ""
        if r.get("raw_fresh") is not None:
            fresh = (f"{_pct(r['tensorstash_of_raw_fresh'])}, {_pct(r['orbax_of_raw_fresh'])} "
                     f"({_time(r['raw_fresh'], r['bytes'])})")
        note = f" ({r['note']})" if r.get("note") else ""
        lines.append(f"| {r['scenario']} | {r['label']}{note} | {_bytes(r['bytes'])} | "
                     f"{_time(r['tensorstash'], nb)} | {_time(r['orbax'], nb)} | "
                     f"{_ratio(r['ratio'])} | {_pct(r['tensorstash_of_raw'])} | "
                     f"{_pct(r['orbax_of_raw'])} | {raw} | {fresh} |")
    derived = []
    st = results["scenarios"].get("stacked")
    if st:
        d = st["derived"]
        derived.append("- stacked / unstacked restore time: tensorstash "
                       f"{_ratio(d.get('tensorstash.restore_stacked/unstacked'))}, Orbax "
                       f"{_ratio(d.get('orbax.restore_stacked/unstacked'))}; save: tensorstash "
                       f"{_ratio(d.get('tensorstash.save_stacked/unstacked'))}, Orbax "
                       f"{_ratio(d.get('orbax.save_stacked/unstacked'))}.")
    pa = results["scenarios"].get("partial")
    if pa:
        d = pa["derived"]
        derived.append(f"- partial: params-only restore time / full restore time: tensorstash "
                       f"{_pct(d.get('tensorstash.params/all'))}, Orbax {_pct(d.get('orbax.params/all'))}"
                       f" (the params are {_pct(d['byte_share'])} of the bytes).")
    if derived:
        lines += ["", "## Derived", ""] + derived
    mem_lines = []
    for name, sc in results["scenarios"].items():
        for op_name, op in sc["ops"].items():
            ts, ob = op.get("tensorstash", {}).get("memory"), op.get("orbax", {}).get("memory")
            if ts and "limit" in ts or ob and "restored_bytes" in (ob or {}):
                restored = (ts or ob)["restored_bytes"]
                lines_ts = "n/a" if not ts else _bytes(ts["peak_growth"])
                limit = "n/a" if not ts else _bytes(ts["limit"])
                within = "n/a" if not ts else ("yes" if ts["within"] else "**no**")
                mem_lines.append(f"| {name} | {op['label']} | {_bytes(restored)} | {lines_ts} | "
                                 f"{limit} | {within} | {_bytes(ob['peak_growth']) if ob else 'n/a'} |")
    if mem_lines:
        cap = next((op["tensorstash"]["memory"]["cap"] for sc in results["scenarios"].values()
                    for op in sc["ops"].values() if op.get("tensorstash", {}).get("memory", {}).get("cap")), None)
        lines += ["", "## Peak host memory on restore",
                  "",
                  "Growth of the restoring process's peak RSS (VmHWM, reset just before) over its "
                  "RSS just before the restore ("
                  + ("a fresh process per restore" if meta["args"]["isolation"] == "op" else
                     "one process per tool and scenario, freed memory trimmed before")
                  + "), worst counted run; restored bytes = the "
                  "distinct device buffers of the result (CPU devices live in host memory); limit = "
                  f"restored + tensorstash's byte cap ({_bytes(cap)}) + 10%.",
                  "",
                  "| scenario | restore | restored | tensorstash growth | limit | within | Orbax growth |",
                  "|---|---|---|---|---|---|---|"] + mem_lines
    if results.get("targets"):
        lines += ["", "## The issue's targets", "", "| target | measured | goal | met |",
                  "|---|---|---|---|"]
        for t in results["targets"]:
            val = "n/a" if t["value"] is None else f"{t['value']:.2f}"
            met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['target']} | {val} | {t['goal']} | {met} |")
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def write_chart(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"]]
    labels = [f"{r['scenario']}: {r['label']}" for r in rows]
    ratios = [r["ratio"] if r["ratio"] is not None else 0.0 for r in rows]
    n = len(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 0.42 * n + 2.2), sharey=True,
                                   gridspec_kw={"width_ratios": [3, 2]})
    y = list(range(n))[::-1]
    colors = ["#2a9d8f" if r >= 1 else "#e76f51" for r in ratios]
    ax1.barh(y, ratios, color=colors)
    ax1.axvline(1.0, color="black", linewidth=1)
    for yi, r, row in zip(y, ratios, rows):
        ax1.text(r, yi, f" {r:.2f}x" if row["ratio"] is not None else " n/a", va="center", fontsize=8)
    ax1.set_yticks(y)
    ax1.set_yticklabels(labels, fontsize=8)
    ax1.set_xlabel("Orbax time / tensorstash time (right of 1: tensorstash faster)")
    top = max(ratios + [1.0])
    if top > 8:  # wide spread: a log axis keeps the small ratios readable
        ax1.set_xscale("log")
        ax1.set_xlim(min([r for r in ratios if r > 0] + [1.0]) / 1.5, top * 2)
    else:
        ax1.set_xlim(0, top * 1.2)
    ax1.set_title("Ratio, medians")
    h = 0.38
    ts = [r["tensorstash_of_raw"] or 0 for r in rows]
    ob = [r["orbax_of_raw"] or 0 for r in rows]
    ax2.barh([v + h / 2 for v in y], [100 * x for x in ts], height=h, label="tensorstash",
             color="#264653")
    ax2.barh([v - h / 2 for v in y], [100 * x for x in ob], height=h, label="Orbax",
             color="#e9c46a")
    ax2.axvline(100, color="black", linewidth=1)
    ax2.axvline(70, color="grey", linewidth=1, linestyle="--")
    ax2.set_xlabel("% of the raw file speed for the same bytes (dashed: the 70% target)")
    ax2.set_title("Fraction of raw storage speed")
    ax2.legend(loc="lower right", fontsize=8)
    meta = results["meta"]
    m, v = meta["machine"], meta["versions"]
    fig.suptitle(f"tensorstash {v.get('tensorstash')} vs orbax-checkpoint {v.get('orbax-checkpoint')} "
                 f"/ tensorstore {v.get('tensorstore')}: scale {meta['args']['scale']}, "
                 f"{meta['args']['runs']} runs, {m['cores']} cores, "
                 f"{' '.join(m['filesystem'].split()[:3])}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv) -> int:
    src = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "results", "latest.json")
    with open(src) as f:
        results = json.load(f)
    out = os.path.dirname(os.path.abspath(src))
    write_markdown(results, os.path.join(out, "latest.md"))
    write_chart(results, os.path.join(out, "latest.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
