"""A 2-process JAX job saves in Orbax's format (issue 38, part 5): each process writes its own
OCDBT database (ocdbt.process_<p>/), process 0 merges them and publishes the checkpoint; then
this process (8 CPU devices) restores it with orbax-checkpoint itself onto another sharding,
with tensorstash, and checks it with `tensorstash verify` (the CLI at $TENSORSTASH_CLI or
<repo>/build/tensorstash). The job runs mp_orbax_worker.py through mp_launch.
"""

from __future__ import annotations

import json
import os
import subprocess

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mp_launch
import tensorstash
from mp_orbax_worker import (ARRAYS, KEY_COUNT, MANAGER_KEEP, MANAGER_STEPS,
                             manager_tree_values, tree_values)
from tshelpers import assert_jax_array, cli_path

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_orbax_worker.py")
# The workers import the tensorstash this test imported, and this folder's helpers.
WORKER_PYTHONPATH = os.pathsep.join([os.path.dirname(os.path.dirname(tensorstash.__file__)),
                                     HERE])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoint folder a 2-process job saved in Orbax's format."""
    work = tmp_path_factory.mktemp("orbax2")
    path = str(work / "ckpt")
    output = mp_launch.run_job(WORKER, "save", path, 2, "A", str(work), timeout_s=150,
                               pythonpath=WORKER_PYTHONPATH)
    # Each process prints its save's statistics: "process <p>: saved {...}".
    stats = {}
    for line in output.splitlines():
        if line.startswith("process ") and ": saved " in line:
            head, _, body = line.partition(": saved ")
            stats[int(head.split()[1])] = json.loads(body)
    assert set(stats) == {0, 1}, output
    # The second save, without overwrite=True, failed in both processes.
    assert output.count(": refused: ") == 2, output
    return path, stats


def restore_layout():
    """Another sharding than the save's: 4 x 2 over the devices reversed, other specs."""
    mesh = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("p", "q"))
    specs = {"w": P("q", "p"), "emb": P(None, "p"), "r": P("q"), "odd": P("p"), "s": P()}
    return mesh, {k: NamedSharding(mesh, specs[k]) for k in ARRAYS}


def expected_keys():
    return jax.random.split(jax.random.key(7), KEY_COUNT), jax.random.key(3)


def assert_same_keys(got, want, what: str) -> None:
    assert isinstance(got, jax.Array) and jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key), \
        f"{what}: {got!r} is not a key array"
    assert str(jax.random.key_impl(got)) == str(jax.random.key_impl(want)), what
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)),
                                  np.asarray(jax.random.key_data(want)), err_msg=what)


def target_tree():
    """The target of the restores: every array on restore_layout()'s shardings; keys
    (concrete, as Orbax takes a key target) sharded over "p"."""
    mesh, shardings = restore_layout()
    arrays, slash, host = tree_values()
    keys, one = expected_keys()
    return {
        "params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
                   for k, v in arrays.items()},
        "mlp/~/linear_0": {"w": jax.ShapeDtypeStruct(slash.shape, slash.dtype,
                                                     sharding=NamedSharding(mesh, P("q")))},
        "host": np.zeros(host.shape, host.dtype),
        "step": 0,
        "name": "",
        "rngs": {"keys": jax.device_put(keys, NamedSharding(mesh, P("p"))),
                 "one": jax.device_put(one, NamedSharding(mesh, P()))},
    }


def check_restored(got, what: str) -> None:
    mesh, shardings = restore_layout()
    arrays, slash, host = tree_values()
    for k, v in arrays.items():
        assert_jax_array(got["params"][k], v, shardings[k], f"{what} {k}")
    assert_jax_array(got["mlp/~/linear_0"]["w"], slash, NamedSharding(mesh, P("q")),
                     f"{what} mlp/~/linear_0")
    np.testing.assert_array_equal(np.asarray(got["host"]), host, err_msg=what)
    assert int(got["step"]) == 1234 and got["name"] == "saved by 2", what
    keys, one = expected_keys()
    assert_same_keys(got["rngs"]["keys"], keys, f"{what} rngs.keys")
    assert got["rngs"]["keys"].sharding == NamedSharding(mesh, P("p")), what
    assert_same_keys(got["rngs"]["one"], one, f"{what} rngs.one")


def test_each_process_wrote_its_own_database(saved):
    saved, stats = saved
    # Each wrote the chunks it owns: process 1 holds the second row of the mesh alone.
    assert stats[0]["chunks"] > 0 and stats[1]["chunks"] > 0, stats
    names = set(os.listdir(saved))
    assert {"ocdbt.process_0", "ocdbt.process_1", "manifest.ocdbt", "d", "_METADATA",
            "_CHECKPOINT_METADATA", "_sharding", "_strings.json"} <= names, names
    for p in (0, 1):
        sub = os.path.join(saved, f"ocdbt.process_{p}")
        assert "manifest.ocdbt" in os.listdir(sub)
        data = os.listdir(os.path.join(sub, "d"))
        # Both wrote chunks (a B+tree node file and at least one data file).
        assert len(data) >= 2, (p, data)
    # Nothing else was left beside the checkpoint (no temporary folder).
    assert [n for n in os.listdir(os.path.dirname(saved)) if "tmp" in n] == []
    with open(os.path.join(saved, "_strings.json")) as f:
        assert json.load(f) == {"name": "saved by 2"}


def test_orbax_restores_it_onto_another_sharding(saved):
    saved, _ = saved
    # PyTreeCheckpointer (StandardCheckpointer takes no str target) with restore_args built
    # from the target, as Orbax's docs do it.
    target = target_tree()
    ckptr = ocp.PyTreeCheckpointer()
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    check_restored(ckptr.restore(saved, args=ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args)), "PyTreeCheckpointer")
    ckptr.close()
    # (Without a target Orbax would want the saving job's devices: ids 2048.. of process 1.)


def test_tensorstash_restores_it(saved):
    saved, _ = saved
    check_restored(tensorstash.restore(saved, target=target_tree()), "tensorstash")
    plain = tensorstash.restore(saved)
    arrays, slash, _ = tree_values()
    np.testing.assert_array_equal(np.asarray(plain["params"]["w"]), arrays["w"])
    np.testing.assert_array_equal(np.asarray(plain["mlp/~/linear_0"]["w"]), slash)


def test_verify_passes(saved):
    saved, _ = saved
    result = subprocess.run([cli_path(), "verify", saved], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_manager_of_orbax_steps_runs_in_every_process(tmp_path):
    """CheckpointManager(root, format="orbax") in a 2-process job: async saves from both
    processes, retention by process 0 seen by both, a SIGTERM to one process seen by both in
    reached_preemption(); Orbax's own manager lists and restores what it wrote, and a later
    tensorstash manager continues the run."""
    root = str(tmp_path / "run")
    output = mp_launch.run_job(WORKER, "save", root, 2, "manager", str(tmp_path),
                               timeout_s=150, pythonpath=WORKER_PYTHONPATH)
    kept = list(MANAGER_STEPS[-MANAGER_KEEP:])
    for p in (0, 1):
        assert f"process {p}: steps {json.dumps(kept)}" in output, output
    assert sorted(os.listdir(root)) == [str(s) for s in kept]
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("p", "q"))
    want = manager_tree_values(kept[-1])
    # Another layout than the save's: w (16, 24) and odd (12, 6) over 4 x 2, r (6, 5) replicated.
    specs = {"w": P("p", "q"), "odd": P("p"), "r": P()}
    shardings = {k: NamedSharding(mesh, specs[k]) for k in want}
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
                         for k, v in want.items()}}
    with ocp.CheckpointManager(root) as theirs:
        assert list(theirs.all_steps()) == kept
        got = theirs.restore(kept[-1], args=ocp.args.StandardRestore(target))
    for k, v in want.items():
        assert_jax_array(got["params"][k], v, shardings[k], f"Orbax's restore of {k}")
    with tensorstash.CheckpointManager(root, max_to_keep=MANAGER_KEEP) as ours:
        assert ours.format == "orbax" and ours.all_steps() == kept
        assert ours.metrics(kept[-1]) == {"loss": 10.0 - kept[-1]}
        got = ours.restore(kept[-1], target=target)
        for k, v in want.items():
            assert_jax_array(got["params"][k], v, shardings[k], f"tensorstash's restore of {k}")
        ours.save(kept[-1] + 1, {"params": {k: np.asarray(v) for k, v in want.items()}})
        ours.wait_until_finished()
        assert ours.all_steps() == [kept[-1], kept[-1] + 1]
