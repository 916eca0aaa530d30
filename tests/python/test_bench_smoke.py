"""Smoke test of the benchmark harness (bench/, issue 5), so that it cannot rot: every scenario at
a tiny size, one run, tensorstash and Orbax, every restore checked bit for bit by the harness.

Needs orbax-checkpoint, tensorstore and matplotlib in the test environment (scripts/setup.sh
installs them into .venv); without them the test fails, it is never skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BENCH = os.path.join(REPO, "bench")
SCENARIOS = ("large", "many-small", "stacked", "reshard", "partial", "async", "cold",
             "orbax-format", "late")
TOOLS = ("tensorstash", "orbax")


def _require_peers() -> None:
    p = subprocess.run([sys.executable, "-c", "import orbax.checkpoint, tensorstore, matplotlib"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.fail("the benchmark's peers are not installed in this environment "
                    f"({sys.executable}): run scripts/setup.sh, which installs orbax-checkpoint, "
                    f"tensorstore, safetensors and matplotlib\n{p.stderr[-2000:]}", pytrace=False)


def run_script(script: str, *args: str, timeout: float) -> None:
    """Runs bench/<script> with `args`; fails the test when it fails or runs past `timeout`."""
    cmd = [sys.executable, os.path.join(BENCH, script), *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} ran past {timeout} s\n{e.stdout}\n{e.stderr}", pytrace=False)
    assert p.returncode == 0, f"{script} failed ({p.returncode})\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"


def run_harness(tmp_path, *args: str, timeout: float = 240) -> dict:
    _require_peers()
    out = tmp_path / "out"
    run_script("run.py", "--scale", "0.002", "--runs", "1", "--warmup", "0",
               "--dir", str(tmp_path / "data"), "--out", str(out), *args, timeout=timeout)
    with open(out / "latest.json") as f:
        results = json.load(f)
    assert (out / "latest.md").stat().st_size > 0
    assert (out / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "data").exists()  # the storage folder is cleaned up
    return results


def check(results: dict, scenarios) -> None:
    assert list(results["scenarios"]) == list(scenarios)
    cold_permitted = results["meta"]["drop_caches"] == "permitted"
    for name in scenarios:
        sc = results["scenarios"][name]
        assert sc["ops"], name
        for op_name, op in sc["ops"].items():
            metrics = ("blocking", "commit") if op["kind"] == "async" else ("seconds",)
            cold_refused = name == "cold" and not cold_permitted
            for tool in TOOLS:
                entry = op[tool]
                for m in metrics:
                    if cold_refused:
                        assert entry[m] is None and "not permitted" in entry.get("note", "")
                    else:
                        assert isinstance(entry[m], float) and entry[m] > 0, (name, op_name, tool, entry)
                if op["kind"] in ("restore", "async") and not cold_refused:
                    assert entry["verified"] is True, (name, op_name, tool)
                if op["kind"] == "restore" and not cold_refused:
                    mem = entry["memory"]
                    assert mem["restored_bytes"] >= op["bytes"] and mem["peak_growth"] > 0, mem
            if not cold_refused:
                assert op["raw"]["seconds"] > 0, (name, op_name)
    rows = results["rows"]
    assert {r["scenario"] for r in rows} == set(scenarios)
    for r in rows:
        if r.get("note"):
            continue
        assert r["ratio"] is not None and r["ratio"] > 0, r
    meta = results["meta"]
    assert meta["versions"]["orbax-checkpoint"] and meta["versions"]["tensorstore"]
    assert meta["machine"]["cores"] and meta["machine"]["filesystem"]


def test_bench_smoke_every_scenario(tmp_path):
    """All scenarios, both tools; one process per tool and scenario to stay quick."""
    results = run_harness(tmp_path, "--isolation", "scenario")
    check(results, SCENARIOS)


def test_bench_smoke_isolated_restores(tmp_path):
    """The default isolation (a fresh process per restore), on the scenarios that read another
    scenario's checkpoint and that restore onto other meshes."""
    results = run_harness(tmp_path, "--scenarios", "reshard,cold")
    check(results, ("reshard", "cold"))


def test_verification_catches_a_wrong_restore():
    """The harness's check compares every restored shard with the saved values, bit for bit."""
    sys.path.insert(0, BENCH)
    try:
        import scenarios as S
        import worker as W
    finally:
        sys.path.remove(BENCH)
    import jax

    leaf = S.Leaf("x/w", (16, 128), "bfloat16", ("a", "b"), 3)
    op = S.Op("restore", "restore", "main")
    good = W.make_tree([leaf], "2x4")
    W.verify(good, [leaf], op, "test")  # equal: no error
    values = np.asarray(good["x"]["w"]).copy()
    values.view(np.uint16)[5, 7] ^= 1  # one bit of one element
    bad = {"x": {"w": jax.device_put(values, W.sharding_of(leaf, "2x4", False))}}
    with pytest.raises(W.VerificationError, match="differs"):
        W.verify(bad, [leaf], op, "test")
    other_mesh = {"x": {"w": jax.device_put(np.asarray(good["x"]["w"]),
                                            W.sharding_of(leaf, "1x8", False))}}
    with pytest.raises(W.VerificationError, match="sharding"):
        W.verify(other_mesh, [leaf], op, "test")
    with pytest.raises(W.VerificationError, match="lacks|arrays"):
        W.verify({"x": {}}, [leaf], op, "test")
    # Restored into NumPy: whole arrays, compared bit for bit too.
    into_numpy = S.Op("restore_numpy", "restore", "main", numpy=True)
    W.verify({"x": {"w": np.asarray(good["x"]["w"])}}, [leaf], into_numpy, "test")
    with pytest.raises(W.VerificationError, match="differs"):
        W.verify({"x": {"w": values}}, [leaf], into_numpy, "test")
    with pytest.raises(W.VerificationError, match="not a NumPy array"):
        W.verify(good, [leaf], into_numpy, "test")


def test_scaling_quick(tmp_path):
    """bench/scaling.py --quick: every series and point for both tools, each restore verified
    bit for bit by the harness, the reports written, the storage folder removed."""
    _require_peers()
    out = tmp_path / "out"
    run_script("scaling.py", "--quick", "--dir", str(tmp_path / "data"), "--out", str(out),
               timeout=400)
    with open(out / "scaling-quick.json") as f:
        results = json.load(f)
    assert (out / "scaling-quick.md").stat().st_size > 0
    assert (out / "scaling-quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "data").exists()
    series = {point["series"] for point in results["points"]}
    assert series == {"arrays", "bytes", "fixed-cost"}
    restores = 0
    for point in results["points"]:
        assert point["ops"], point
        for op_name, op in point["ops"].items():
            for tool in TOOLS:
                e = op[tool]
                where = f"{point['series']} {point['x']} {op_name} {tool}"
                assert e["status"] == "ok", where
                assert e["seconds"] > 0 and e["us_per_array"] > 0, where
                if "restore" in op_name:
                    assert e["verified"], where
                    restores += 1
    assert restores >= 2 * 6  # both tools, every point's restores


@pytest.mark.parametrize("script,args,rows", [
    # gpu_save: 2 trees x (3 raw + 2 x 3 tensorstash + 1 Orbax) rows.
    ("gpu_save.py", ("--scale", "0.01"), 20),
    # gpu_restore: raw read + 2 device_puts + 2 fills of pinned memory (first, again)
    # + 2 states x 3 batch sizes (each restore verified).
    ("gpu_restore.py", ("--size-mib", "8"), 11),
])
def test_gpu_scripts_on_the_cpu(tmp_path, script, args, rows):
    """bench/gpu_save.py and bench/gpu_restore.py with --cpu (the GPU scripts checked where no
    GPU is): every row timed and written to --out, the storage folder removed."""
    _require_peers()
    out = tmp_path / "out.json"
    run_script(script, "--cpu", "--runs", "1", "--dir", str(tmp_path / "data"), "--out", str(out),
               *args, timeout=300)
    with open(out) as f:
        results = json.load(f)
    assert len(results["rows"]) == rows, [r["name"] for r in results["rows"]]
    assert all(r["median_s"] > 0 for r in results["rows"])
    assert not (tmp_path / "data").exists()


def test_incremental_quick(tmp_path):
    """bench/incremental.py at a tiny size: every local scenario runs, incremental saves write
    a fraction of full ones where little changed (the jax leaves without hashing), all of it
    where everything changed, and the storage folders are removed."""
    out = tmp_path / "incremental.json"
    run_script("incremental.py", "--mib", "4", "--runs", "1", "--steps", "3",
               "--scenarios", "lora,embedding,changing,restore", "--dir", str(tmp_path / "data"),
               "--out", str(out), timeout=300)
    with open(out) as f:
        results = json.load(f)
    for leaves in ("numpy", "jax"):
        lora = results["lora"][leaves]
        assert lora["incremental"]["written_bytes"] < 0.1 * lora["full"]["written_bytes"], leaves
    assert results["lora"]["jax"]["incremental"]["unhashed_chunks"] > 0
    assert results["lora"]["numpy"]["incremental"]["unhashed_chunks"] == 0
    changing = results["changing"]
    assert changing["incremental"]["written_bytes"] == changing["full"]["written_bytes"]
    assert set(results["embedding"]) == {"default chunks", "256 KiB chunks"}
    assert results["restore"]["incremental_s"] > 0 and results["restore"]["full_s"] > 0
    assert not os.path.exists(tmp_path / "data")
    assert not os.path.exists(str(tmp_path / "data") + "-full")
