"""An existing Orbax run, through tensorstash.CheckpointManager (issue 38, part 4).

orbax-checkpoint's own CheckpointManager is on the other side of every test: it writes steps
(plain names, step_prefix with fixed-length names, ocp.args.Composite of a StandardSave and a
JsonSave, with metrics) that the manager lists and restores; the manager writes steps with
format="orbax" (async and not, max_to_keep, best-N, preemption) that Orbax lists and restores,
Orbax then goes on saving there and the manager lists again. A root of one format opened as the
other is an error, and no LOCK (nor any other file) is left in an Orbax root.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import orbax.checkpoint as ocp
import pytest

import tensorstash
from tshelpers import assert_same_array


def state(step: int) -> dict:
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) * (step + 1),
            "opt": {"count": np.array(step, dtype=np.int32),
                    "mu": np.full((5,), step, dtype=np.float64)}}


def assert_state(got, step: int) -> None:
    want = state(step)
    assert set(got) == {"w", "opt"}
    assert_same_array(np.asarray(got["w"]), want["w"], "w")
    assert_same_array(np.asarray(got["opt"]["count"]), want["opt"]["count"], "count")
    assert_same_array(np.asarray(got["opt"]["mu"]), want["opt"]["mu"], "mu")


def orbax_save(root, steps, **options) -> None:
    with ocp.CheckpointManager(str(root),
                               options=ocp.CheckpointManagerOptions(**options)) as mgr:
        for s in steps:
            mgr.save(s, args=ocp.args.StandardSave(state(s)))
        mgr.wait_until_finished()


def entries(root) -> list[str]:
    return sorted(os.listdir(root))


def test_lists_and_restores_an_orbax_run(tmp_path):
    root = tmp_path / "run"
    orbax_save(root, [1, 2, 3], max_to_keep=2)
    # What a crashed Orbax save leaves: a temporary folder, never a step.
    os.makedirs(root / "4.orbax-checkpoint-tmp-1234" / "default")
    before = entries(root)
    with tensorstash.CheckpointManager(root) as mgr:
        assert mgr.format == "orbax"
        assert mgr.all_steps() == [2, 3]
        assert mgr.latest_step() == 3
        assert_state(mgr.restore(), 3)
        assert mgr.last_restore_stats.step == 3 and mgr.last_restore_stats.bytes > 0
        assert_state(mgr.restore(2), 2)
        target = {"w": np.zeros((3, 4), np.float64),
                  "opt": {"count": np.zeros((), np.int64), "mu": np.zeros(5, np.float32)}}
        got = mgr.restore(2, target=target)
        assert got["w"].dtype == np.float64
        np.testing.assert_array_equal(got["w"], state(2)["w"].astype(np.float64))
        with pytest.raises(FileNotFoundError, match="step 1 is not a complete step"):
            mgr.restore(1)
        assert mgr.metrics(3) is None and mgr.metadata(3) is None
    # No LOCK, nothing new in the root.
    assert entries(root) == before


def test_step_prefix_and_fixed_length(tmp_path):
    root = tmp_path / "run"
    orbax_save(root, [5, 12], step_prefix="step", step_format_fixed_length=4)
    assert entries(root) == ["step_0005", "step_0012"]
    with tensorstash.CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [5, 12]
        assert_state(mgr.restore(5), 5)
        # Going on saving names the steps as the run does, and Orbax lists them.
        mgr.save(20, state(20), force=True)
    assert "step_0020" in entries(root)
    options = ocp.CheckpointManagerOptions(step_prefix="step", step_format_fixed_length=4)
    with ocp.CheckpointManager(str(root), options=options) as mgr:
        assert list(mgr.all_steps()) == [5, 12, 20]
        restored = mgr.restore(20, args=ocp.args.StandardRestore(state(0)))
        assert_state(restored, 20)
    # Explicit naming options, the same as Orbax's.
    with tensorstash.CheckpointManager(root, step_prefix="step", step_format_fixed_length=4,
                                       format="orbax") as mgr:
        assert mgr.all_steps() == [5, 12, 20]
    with tensorstash.CheckpointManager(root, step_prefix="other", format="orbax") as mgr:
        assert mgr.all_steps() == []


def test_composite_steps_restore_as_a_dict_of_items(tmp_path):
    root = tmp_path / "run"
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min",
                                           max_to_keep=3)
    with ocp.CheckpointManager(str(root), options=options, item_names=("state", "extra")) as mgr:
        for s in (1, 2):
            mgr.save(s, args=ocp.args.Composite(state=ocp.args.StandardSave(state(s)),
                                                extra=ocp.args.JsonSave({"epoch": s,
                                                                         "name": "run"})),
                     metrics={"loss": 10.0 - s})
        mgr.wait_until_finished()
    with tensorstash.CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [1, 2]
        got = mgr.restore(2)
        assert set(got) == {"state", "extra"}  # the metrics item is the manager's, not an item
        assert_state(got["state"], 2)
        assert got["extra"] == {"epoch": 2, "name": "run"}
        assert mgr.metrics(1) == {"loss": 9.0}
        # A target for some items, by item name.
        got = mgr.restore(1, target={"state": {"w": np.zeros((3, 4), np.float64),
                                               "opt": state(0)["opt"]}})
        assert got["state"]["w"].dtype == np.float64
        assert got["extra"]["epoch"] == 1
        with pytest.raises(ValueError, match="items"):
            mgr.restore(1, target={"nope": {}})


@pytest.mark.parametrize("async_save", [True, False])
def test_we_write_orbax_steps_that_orbax_lists_restores_and_continues(tmp_path, async_save):
    root = tmp_path / "run"
    saved = []
    with tensorstash.CheckpointManager(root, format="orbax", max_to_keep=2,
                                       async_save=async_save,
                                       on_save=lambda s: saved.append(s.step)) as mgr:
        for s in range(4):
            x = state(s)
            assert mgr.save(s, x)
            x["w"][...] = -1  # the caller's arrays may change once save returns
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]
        with pytest.raises(FileExistsError):
            mgr.save(3, state(3))
    assert saved == [0, 1, 2, 3]
    assert entries(root) == ["2", "3"]  # no LOCK, no leftovers
    with ocp.CheckpointManager(str(root),
                               options=ocp.CheckpointManagerOptions(max_to_keep=3)) as mgr:
        assert list(mgr.all_steps()) == [2, 3]
        assert_state(mgr.restore(3, args=ocp.args.StandardRestore(state(0))), 3)
        mgr.save(4, args=ocp.args.StandardSave(state(4)))
        mgr.save(5, args=ocp.args.StandardSave(state(5)))
        mgr.wait_until_finished()
    # A later manager detects the format and continues the run.
    with tensorstash.CheckpointManager(root, max_to_keep=2) as mgr:
        assert mgr.format == "orbax"
        assert mgr.all_steps() == [3, 4, 5]
        assert_state(mgr.restore(), 5)
        mgr.save(6, state(6))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [5, 6]
    with ocp.CheckpointManager(str(root)) as mgr:
        assert list(mgr.all_steps()) == [5, 6]
        assert_state(mgr.restore(6, args=ocp.args.StandardRestore(state(0))), 6)


def test_best_n_by_metric_and_orbax_reads_the_metrics(tmp_path):
    root = tmp_path / "run"
    losses = {0: 5.0, 1: 1.0, 2: 4.0, 3: 2.0, 4: 3.0}
    with tensorstash.CheckpointManager(root, format="orbax", max_to_keep=2,
                                       best_metric="loss", best_mode="min") as mgr:
        for s, loss in losses.items():
            mgr.save(s, state(s), metrics={"loss": loss})
        mgr.wait_until_finished()
        # The two best (1, 3) and the newest (4), as for native steps.
        assert mgr.all_steps() == [1, 3, 4]
        assert mgr.metrics(3) == {"loss": 2.0}
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min",
                                           max_to_keep=2)
    with ocp.CheckpointManager(str(root), options=options) as mgr:
        assert list(mgr.all_steps()) == [1, 3, 4]
        assert mgr.best_step() == 1
        assert_state(mgr.restore(1, args=ocp.args.StandardRestore(state(0))), 1)


def test_native_and_orbax_roots_are_not_mixed_up(tmp_path):
    native = tmp_path / "native"
    with tensorstash.CheckpointManager(native) as mgr:
        assert mgr.format == "native"
        mgr.save(1, state(1))
    with pytest.raises(ValueError, match="holds native steps"):
        tensorstash.CheckpointManager(native, format="orbax")
    orbax = tmp_path / "orbax"
    orbax_save(orbax, [1])
    before = entries(orbax)
    with pytest.raises(ValueError, match="holds orbax steps"):
        tensorstash.CheckpointManager(orbax, format="native")
    assert entries(orbax) == before  # the refused manager left no LOCK
    # A LOCK that an earlier tensorstash left in an Orbax root does not make it native.
    (orbax / "LOCK").write_bytes(b"")
    with tensorstash.CheckpointManager(orbax) as mgr:
        assert mgr.format == "orbax" and mgr.all_steps() == [1]
    os.remove(orbax / "LOCK")
    with pytest.raises(ValueError, match="unknown format"):
        tensorstash.CheckpointManager(orbax, format="zarr")
    with pytest.raises(ValueError, match="step_prefix"):
        tensorstash.CheckpointManager(native, step_prefix="step")
    # Both kinds of step in one root: an error naming both.
    os.rename(native / "0000000001", orbax / "0000000001")
    with pytest.raises(ValueError, match="holds both"):
        tensorstash.CheckpointManager(orbax)


def test_one_manager_per_orbax_root_in_a_process(tmp_path):
    root = tmp_path / "run"
    orbax_save(root, [1])
    mgr = tensorstash.CheckpointManager(root)
    with pytest.raises(ValueError, match="locked by another manager"):
        tensorstash.CheckpointManager(root)
    mgr.close()
    with tensorstash.CheckpointManager(root) as again:
        assert again.all_steps() == [1]
    assert entries(root) == ["1"]


def test_preemption_saves_an_orbax_step(tmp_path):
    root = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    with tensorstash.CheckpointManager(root, format="orbax", handle_sigterm=True,
                                       save_interval_steps=10) as mgr:
        assert not mgr.should_save(3) and mgr.should_save(10)
        assert not mgr.reached_preemption(3)
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.reached_preemption(3)
        assert mgr.save(3, state(3), force=True)
    assert signal.getsignal(signal.SIGTERM) is before  # restored by close()
    with ocp.CheckpointManager(str(root)) as mgr:
        assert list(mgr.all_steps()) == [3]


def test_orbax_steps_refuse_what_they_cannot_hold(tmp_path):
    with tensorstash.CheckpointManager(tmp_path / "run", format="orbax") as mgr:
        with pytest.raises(NotImplementedError, match="per_process"):
            mgr.save(1, state(1), per_process={"it": 1})
        with pytest.raises(FileNotFoundError, match="no complete checkpoint step"):
            mgr.restore()
        assert mgr.all_steps() == []
    with pytest.raises(ValueError, match="codec"):
        tensorstash.CheckpointManager(tmp_path / "run2", format="orbax", codec="none")


def test_sharded_jax_arrays_saved_async_while_the_caller_deletes_them(tmp_path):
    import jax

    from tshelpers import global_array, mesh, named

    root = tmp_path / "run"
    sharding = named(mesh((4, 2)), "a", "b")
    values = np.arange(64, dtype=np.float32).reshape(8, 8)
    with tensorstash.CheckpointManager(root, format="orbax") as mgr:
        x = global_array(values, sharding)
        mgr.save(7, {"x": x, "key": jax.random.key(3)})
        x.delete()  # the background save holds its own copy
        mgr.wait_until_finished()
        got = mgr.restore(7, target={"x": jax.ShapeDtypeStruct((8, 8), np.float32,
                                                               sharding=sharding),
                                     "key": jax.random.key(0)})
        assert got["x"].sharding == sharding
        assert_same_array(np.asarray(got["x"]), values, "x")
        assert jax.numpy.array_equal(jax.random.key_data(got["key"]),
                                     jax.random.key_data(jax.random.key(3)))
    with ocp.CheckpointManager(str(root)) as mgr:
        restored = mgr.restore(7, args=ocp.args.StandardRestore(
            {"x": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=sharding),
             "key": jax.random.key(0)}))
        assert_same_array(np.asarray(restored["x"]), values, "x")


def test_the_readme_example_switches_an_nnx_loop_from_orbax(tmp_path):
    """README "Coming from Orbax": examples/from_orbax/nnx_switch.py trains an NNX model with
    Orbax's manager, switches to tensorstash's on the same root mid-run, and has Orbax restore
    the last step; it raises on any difference and prints PASS."""
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "from_orbax",
                          "nnx_switch.py")
    p = subprocess.run([sys.executable, script, "--root", str(tmp_path / "run"), "--steps", "4"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[-1] == "PASS", p.stdout
    assert any("found orbax steps [0, 2]" in line and "resuming from 2" in line
               for line in lines), p.stdout
