"""Host memory and GIL behaviour of save and restore, each measured in a fresh process
(tests/python/mem_worker.py) so that nothing else in the test run blurs the numbers.

The bound: the growth of peak RSS over a restore is at most the restored bytes + the engine's
byte cap (max_inflight_bytes, 16 MiB here) [+ the host batch for JAX targets] + an allowance of
10% + 32 MiB for interpreter and allocator noise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mem_worker.py")
MiB = 1 << 20
CAP = 16 * MiB


def run_worker(mode: str, step: str, cwd: str, **env_extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env.update({k: str(v) for k, v in env_extra.items()})
    try:
        p = subprocess.run([sys.executable, WORKER, mode, step], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mem_worker {mode} timed out\n{e.stdout}\n{e.stderr}", pytrace=False)
    if p.returncode != 0:
        pytest.fail(f"mem_worker {mode} failed ({p.returncode})\n{p.stdout}\n{p.stderr}",
                    pytrace=False)
    return json.loads(p.stdout.strip().splitlines()[-1])


def allowance(nbytes: int) -> int:
    return nbytes // 10 + 32 * MiB


def growth(r: dict) -> int:
    return r["peak"] - r["before"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoint (640 MiB) written by a fresh process; returns (step, that run's report)."""
    work = tmp_path_factory.mktemp("mem")
    step = str(work / "root" / "0000000001")
    return step, run_worker("save", step, str(work))


def test_save_memory(saved):
    _, r = saved
    assert r["stats"]["raw_bytes"] == r["held_bytes"] == 640 * MiB
    # The arrays to save are already in memory; saving adds at most the cap and the allowance.
    assert growth(r) <= CAP + allowance(r["held_bytes"]), (growth(r) / MiB, r)


def test_restore_memory_numpy(saved, tmp_path):
    step, _ = saved
    r = run_worker("numpy", step, str(tmp_path))
    assert r["correct"], r
    assert r["stats"]["direct_chunks"] > 0, r  # aligned with the chunks: read in place
    limit = r["restored_bytes"] + CAP + allowance(r["restored_bytes"])
    assert growth(r) <= limit, (f"grew {growth(r) / MiB:.1f} MiB for {r['restored_bytes'] / MiB} "
                                f"MiB restored (limit {limit / MiB:.1f})", r)


def test_restore_memory_mapped(saved, tmp_path):
    """The default restore maps "big" from the data files: nothing is read, and the memory it
    adds (page-cache pages mapped copy-on-write) stays within the same bound."""
    step, _ = saved
    r = run_worker("mapped", step, str(tmp_path))
    assert r["correct"], r
    assert r["read_calls"] == 0 and r["stats"]["bytes_read"] == 0, r  # mapped, not read
    assert r["stats"]["mapped_bytes"] == r["restored_bytes"], r
    limit = r["restored_bytes"] + CAP + allowance(r["restored_bytes"])
    assert growth(r) <= limit, (f"grew {growth(r) / MiB:.1f} MiB for {r['restored_bytes'] / MiB} "
                                f"MiB restored (limit {limit / MiB:.1f})", r)


def test_restore_memory_staged(saved, tmp_path):
    """Target rows shorter than the stored chunks' rows: every chunk goes through staging,
    whose bytes in flight stay within the cap."""
    step, _ = saved
    r = run_worker("staged", step, str(tmp_path), TS_IO_THREADS=4)
    assert r["correct"], r
    assert r["stats"]["staged_chunks"] > 0 and r["stats"]["direct_chunks"] == 0, r
    assert 0 < r["stats"]["peak_staging_bytes"] <= CAP, r
    limit = r["restored_bytes"] + CAP + allowance(r["restored_bytes"])
    assert growth(r) <= limit, (f"grew {growth(r) / MiB:.1f} MiB for {r['restored_bytes'] / MiB} "
                                f"MiB restored (limit {limit / MiB:.1f})", r)


def test_staging_memory_does_not_scale_with_io_threads(saved, tmp_path):
    """The cap bounds staging memory for any number of reader threads: the RSS growth of a
    staged restore with 8 threads is within a few MiB of that with 1 thread. (Staging buffers
    allocated with new[] on each reader thread land in per-thread malloc arenas, which keep
    them after they are freed: the growth is then about io_threads x the cap.)"""
    step, _ = saved
    one = run_worker("staged", step, str(tmp_path), TS_IO_THREADS=1)
    eight = run_worker("staged", step, str(tmp_path), TS_IO_THREADS=8)
    assert one["correct"] and eight["correct"]
    extra = growth(eight) - growth(one)
    assert extra <= 8 * MiB, (f"a staged restore with 8 reader threads grew {extra / MiB:.1f} MiB "
                              f"more than with 1 (cap {CAP / MiB:.0f} MiB)", one, eight)


def test_restore_memory_jax_frees_host_batches(saved, tmp_path):
    """Four 32 MiB arrays onto 8 CPU devices with a 32 MiB host batch: host buffers of a batch
    are freed once handed to the devices (on CPU the device copies are host memory too)."""
    step, _ = saved
    r = run_worker("jax", step, str(tmp_path), TS_IO_THREADS=2)
    assert r["correct"], r
    assert r["batches"] == 4, r
    batch = 32 * MiB
    limit = r["restored_bytes"] + batch + CAP + allowance(r["restored_bytes"])
    assert growth(r) <= limit, (f"grew {growth(r) / MiB:.1f} MiB for {r['restored_bytes'] / MiB} "
                                f"MiB restored (limit {limit / MiB:.1f})", r)


def test_gil_released_during_io(saved, tmp_path):
    """A Python thread keeps counting while a 512 MiB restore and save run in the main thread."""
    step, _ = saved
    r = run_worker("gil", step, str(tmp_path))
    for what in ("restore", "save"):
        expected = r["idle_rate"] * r[f"{what}_s"]  # counts if it had run as freely as when idle
        assert r[f"{what}_counts"] >= 0.1 * expected, (what, r)
