"""tensorstash on S3 with JAX: multi-process jax.distributed saves and restores onto other meshes
(a step and a CheckpointManager), restores onto NamedShardings, and Orbax checkpoints on S3
(written by tensorstash with format="orbax", and written by orbax-checkpoint to a local folder
then uploaded object by object) read as from files. Against a local SeaweedFS
(tests/s3/s3_servers.py); everything talks to 127.0.0.1 only.

    cd /work/main && .venv/bin/python -m pytest tests/python/test_s3_jax.py -q -x -p no:cacheprovider

This file is also the worker of its multi-process jobs: `python test_s3_jax.py --phase ...` runs
one process of a jax.distributed job (see _worker_main at the end).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mp_launch
import tensorstash
from mp_worker import parse_args, run_in_job
from s3_fixtures import aws_vars, list_keys, s3, server, unique_prefix  # noqa: F401 - fixtures
from tshelpers import (assert_jax_array, assert_restored_numpy, assert_same_array,
                       assert_same_tree, global_array, pattern)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CLI = os.environ.get("TENSORSTASH_CLI", os.path.join(REPO, "build", "tensorstash"))
JOB_TIMEOUT_S = 120  # for a whole multi-process job; a hang fails the test instead of blocking


# --- data and layouts shared by the tests and the workers ----------------------------------------

ARRAYS = {  # name: (shape, dtype) of the step's sharded arrays
    "w": ((16, 24), np.float32),
    "emb": ((40, 8), ml_dtypes.bfloat16),
    "r": ((6, 5), np.int32),
    "odd": ((12, 6), np.uint8),
    "s": ((), np.float32),
}
HOST = pattern((7, 3), np.int16, seed=99)  # a NumPy leaf next to the jax.Arrays
MGR_ARRAYS = {"w": ((16, 24), np.float32), "b": ((24,), np.float32), "e": ((40, 8), np.int32)}
MGR_STEPS = (1, 2, 3)


def step_values() -> dict:
    return {k: pattern(shape, dt, seed=i) for i, (k, (shape, dt)) in enumerate(ARRAYS.items())}


def mgr_values(step: int) -> dict:
    return {k: pattern(shape, dt, seed=step * 10 + i)
            for i, (k, (shape, dt)) in enumerate(MGR_ARRAYS.items())}


def layout(name: str, devices) -> tuple[dict, dict]:
    """(shardings of ARRAYS, shardings of MGR_ARRAYS) for a layout over 8 devices."""
    devices = list(devices)
    if name == "A":  # saving: 2 x 4 over the devices in order
        m = Mesh(np.array(devices).reshape(2, 4), ("x", "y"))
        specs = {"w": P("x", "y"), "emb": P(("x", "y")), "r": P(), "odd": P("y", "x"), "s": P()}
        mspecs = {"w": P("x", "y"), "b": P("y"), "e": P(("x", "y"))}
    elif name == "B":  # restoring: 4 x 2 over the devices reversed, other axes, replication
        m = Mesh(np.array(devices[::-1]).reshape(4, 2), ("x", "y"))
        specs = {"w": P("y", "x"), "emb": P(None, "x"), "r": P("y"), "odd": P("y", None), "s": P()}
        mspecs = {"w": P("y", "x"), "b": P(), "e": P(None, "x")}
    elif name == "C":  # restoring: one axis of 8, interleaved devices
        m = Mesh(np.array(devices[1::2] + devices[::2]), ("x",))
        specs = {"w": P(None, "x"), "emb": P("x"), "r": P(), "odd": P(None, None), "s": P()}
        mspecs = {"w": P("x", None), "b": P("x"), "e": P(None, "x")}
    else:
        raise ValueError(name)
    return ({k: NamedSharding(m, s) for k, s in specs.items()},
            {k: NamedSharding(m, s) for k, s in mspecs.items()})


def check_sharded(got, want: np.ndarray, sharding, what: str) -> None:
    """A jax.Array with `sharding`; every addressable shard holds its block of `want` bit for
    bit (tshelpers.assert_jax_array)."""
    assert_jax_array(got, want, sharding, what)


# --- fixtures -------------------------------------------------------------------------------------

def child_env(server, scratch: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and k not in ("XLA_FLAGS", "JAX_ENABLE_X64", "PYTHONPATH")}
    env.update(aws_vars(server, scratch))
    env.update(extra)
    return env


def run_cli(*args, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    if not os.access(CLI, os.X_OK):
        pytest.fail(f"{CLI} is missing (build the CLI or set TENSORSTASH_CLI)")
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


# --- multi-process jobs ---------------------------------------------------------------------------

def run_job(phase: str, step: str, root: str, nproc: int, layout_name: str, cwd: str,
            env: dict) -> str:
    """Runs `nproc` workers (this file) in a jax.distributed job with 8 CPU devices in all
    (mp_launch.run_job); fails when any fails or the job outlives JOB_TIMEOUT_S."""
    return mp_launch.run_job(os.path.abspath(__file__), phase, step, nproc, layout_name, cwd,
                             args=("--root", root), env=env, timeout_s=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def mp_saved(server, tmp_path_factory):
    """A step and a CheckpointManager (steps 1..3, max_to_keep=2) saved on S3 by a job of 2
    processes x 4 CPU devices (layout A)."""
    work = tmp_path_factory.mktemp("mp-save")
    prefix = unique_prefix("mp")
    url = f"s3://{server.bucket}/{prefix}"
    saved = {"prefix": prefix, "url": url, "step": f"{url}/0000000001", "root": f"{url}/mgr"}
    run_job("save", saved["step"], saved["root"], 2, "A", str(work),
            child_env(server, str(work)))
    return saved


# --- 1. several processes save one step and a manager together ------------------------------------

def test_two_processes_each_upload_their_shards_and_one_commit(server, mp_saved):
    prefix = mp_saved["prefix"]
    keys = list_keys(server, f"{prefix}/0000000001/")
    assert keys, "the step has no objects in the bucket"
    rel = [k[len(prefix) + len("/0000000001/"):] for k in keys]
    assert "COMMIT" in rel, rel
    body = server.client().get_object(Bucket=server.bucket, Key=f"{prefix}/0000000001/COMMIT")
    commit = json.loads(body["Body"].read())
    assert commit["process_count"] == 2, commit
    # The files of one save attempt (docs/format.md, "Steps on object stores"), named by COMMIT.
    attempts = {r.split("/")[0] for r in rel if r != "COMMIT"}
    assert len(attempts) == 1 and re.fullmatch(r"attempt-[0-9a-f]{16}", next(iter(attempts))), rel
    attempt = attempts.pop()
    assert attempt in json.dumps(commit), commit
    data = [r.split("/")[-1] for r in rel if r.startswith(f"{attempt}/state/data/")]
    writers = {int(name.split("-")[0]) for name in data}
    assert writers == {0, 1}, rel  # every process uploaded its own shards
    # Nothing but the two roots under the prefix, no temporaries or index parts left.
    tops = {k[len(prefix) + 1:].split("/")[0] for k in list_keys(server, prefix + "/")}
    assert tops == {"0000000001", "mgr"}, tops
    assert not [r for r in rel if "part" in r.split("/")[-1] or "tmp" in r], rel

    # The manager kept the newest two steps and deleted step 1's objects.
    assert list_keys(server, f"{prefix}/mgr/0000000001") == [], "step 1 is still in the bucket"
    for step in (2, 3):
        mkeys = list_keys(server, f"{prefix}/mgr/{step:010d}/")
        assert f"{prefix}/mgr/{step:010d}/COMMIT" in mkeys, mkeys
        mwriters = {int(k.split("/")[-1].split("-")[0]) for k in mkeys if "/state/data/" in k}
        assert mwriters == {0, 1}, mkeys


def test_four_processes_restore_onto_another_mesh(server, mp_saved, tmp_path):
    # A new job of another size (4 x 2 devices) restores the step and the manager's latest step
    # onto layout B and checks every addressable shard.
    run_job("restore", mp_saved["step"], mp_saved["root"], 4, "B", str(tmp_path),
            child_env(server, str(tmp_path)))


def test_same_two_processes_restore_onto_another_mesh(server, mp_saved, tmp_path):
    run_job("restore", mp_saved["step"], mp_saved["root"], 2, "C", str(tmp_path),
            child_env(server, str(tmp_path)))


# --- 3. restore onto a NamedSharding in this process (1 process, 8 devices) -----------------------

def test_restore_s3_step_onto_named_shardings_in_one_process(s3, mp_saved):
    values = step_values()
    for name in ("B", "C"):
        shardings, mshardings = layout(name, jax.devices())
        target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
                             for k, v in values.items()},
                  "host": np.zeros(HOST.shape, HOST.dtype), "step": 0, "name": ""}
        got = tensorstash.restore(mp_saved["step"], target=target)
        for k, v in values.items():
            check_sharded(got["params"][k], v, shardings[k], f"layout {name}: {k}")
        assert_same_array(got["host"], HOST, "host")
        assert got["step"] == 7 and got["name"] == "saved by 2 processes", got

        with tensorstash.CheckpointManager(mp_saved["root"], max_to_keep=2) as mgr:
            assert mgr.all_steps() == [2, 3]
            assert mgr.latest_step() == 3
            want = mgr_values(3)
            mtarget = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                          sharding=mshardings[k])
                                  for k, v in want.items()}, "step": 0}
            mgot = mgr.restore(3, target=mtarget)
            assert mgot["step"] == 3
            for k, v in want.items():
                check_sharded(mgot["params"][k], v, mshardings[k], f"manager layout {name}: {k}")
            assert mgr.metadata(3) == {"step": 3, "nproc": 2}

    plain = tensorstash.restore(mp_saved["step"])  # NumPy, as saved
    for k, v in values.items():
        assert_same_array(plain["params"][k], v, f"plain {k}")
    meta = tensorstash.metadata(mp_saved["step"])
    for k, v in values.items():
        m = meta["params"][k]
        assert m.shape == v.shape and m.dtype == v.dtype, (k, m)


# --- 2. Orbax checkpoints on S3: helpers --------------------------------------------------------

def orbax_state():
    """A state of jax.Arrays sharded over a 2 x 4 mesh, NumPy arrays and Python scalars; and its
    values as NumPy."""
    m = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    values = {
        "params": {"w": pattern((16, 24), np.float32, seed=31),
                   "e": pattern((10, 7), ml_dtypes.bfloat16, seed=32),
                   "i": pattern((8, 4, 6), np.int32, seed=33)},
        "opt": [pattern((13,), np.uint16, seed=34), pattern((3, 5), np.int64, seed=35)],
        "zero_d": np.array(2.5, np.float64),
    }
    shardings = {"w": NamedSharding(m, P("x", "y")), "e": NamedSharding(m, P("x")),
                 "i": NamedSharding(m, P(None, "y"))}
    state = {
        "params": {k: global_array(v, shardings[k]) for k, v in values["params"].items()},
        "opt": list(values["opt"]),
        "zero_d": values["zero_d"],
    }
    return state, values


def other_targets(values):
    m = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("p", "q"))
    shardings = {"w": NamedSharding(m, P("q", "p")), "e": NamedSharding(m, P("q", None)),
                 "i": NamedSharding(m, P("p"))}
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
              for k, v in values["params"].items()}
    return {"params": target}, shardings


def download(server, prefix: str, dst: str) -> list[str]:
    """Every object under prefix + '/' written to dst/<relative key>; returns the relative keys."""
    c = server.client()
    rels = []
    for key in list_keys(server, prefix + "/"):
        rel = key[len(prefix) + 1:]
        path = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(c.get_object(Bucket=server.bucket, Key=key)["Body"].read())
        rels.append(rel)
    return rels


def upload(server, src: str, prefix: str) -> list[str]:
    """Every file under src put at prefix/<relative path>; returns the relative keys."""
    c = server.client()
    rels = []
    for d, _, names in os.walk(src):
        for n in names:
            path = os.path.join(d, n)
            rel = os.path.relpath(path, src).replace(os.sep, "/")
            with open(path, "rb") as f:
                c.put_object(Bucket=server.bucket, Key=f"{prefix}/{rel}", Body=f.read())
            rels.append(rel)
    return sorted(rels)


# --- 2b. an Orbax checkpoint written by orbax-checkpoint, uploaded, read from S3 ------------------

def test_orbax_written_by_orbax_read_from_s3_as_from_files(server, s3, tmp_path):
    import orbax.checkpoint as ocp
    url, prefix = s3.url, s3.prefix
    state, values = orbax_state()

    local = str(tmp_path / "orbax" / "ckpt")
    ckptr = ocp.StandardCheckpointer()  # OCDBT + zarr3, Orbax's default
    ckptr.save(local, state)
    ckptr.wait_until_finished()
    ckptr.close()
    rels = upload(server, local, f"{prefix}/ckpt")
    assert "manifest.ocdbt" in rels and "_METADATA" in rels, rels
    assert any(r.startswith("d/") or "/d/" in r for r in rels), rels  # OCDBT data files

    path = f"{url}/ckpt"
    from_files = tensorstash.restore(local)
    from_s3 = tensorstash.restore(path)
    assert_restored_numpy(from_s3, values, key_order=False)
    assert_restored_numpy(from_files, values, key_order=False)
    target, shardings = other_targets(values)
    got = tensorstash.restore(path, target=target)
    for k, v in values["params"].items():
        check_sharded(got["params"][k], v, shardings[k], f"orbax-written {k}")
    meta = tensorstash.metadata(path)
    assert meta["params"]["e"].shape == (10, 7) and meta["params"]["e"].dtype == ml_dtypes.bfloat16

    env = child_env(server, str(tmp_path))
    r = run_cli("verify", path, env=env)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr

    # An Orbax CheckpointManager's root, uploaded: steps list and restore from S3 as from files.
    root = str(tmp_path / "orbax" / "mgr")
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(root, options=options) as mgr:
        for step in (1, 2):
            mgr.save(step, args=ocp.args.StandardSave(
                jax.tree.map(lambda x, step=step: x + step, state["params"])))
        mgr.wait_until_finished()
    upload(server, root, f"{prefix}/mgr")
    for step in (1, 2):
        for p in (f"{url}/mgr/{step}", f"{url}/mgr/{step}/default"):
            got = tensorstash.restore(p, target={k: v for k, v in target["params"].items()})
            for k, v in values["params"].items():
                check_sharded(got[k], (v + step).astype(v.dtype), shardings[k], f"{p} {k}")
    r = run_cli("ls", f"{url}/mgr", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split()[:2] for line in r.stdout.splitlines()[1:]]
    assert rows == [["1", "orbax-ocdbt"], ["2", "orbax-ocdbt"]], r.stdout


def test_orbax_keys_and_shardings_are_read_from_s3_as_from_files(server, s3, tmp_path):
    """What Orbax records beside the arrays (a typed PRNG key's implementation in
    array_metadatas/process_0, each array's sharding in _sharding) is read through the store:
    from S3, a key comes back as a key, and metadata() gives the saved shardings."""
    import orbax.checkpoint as ocp
    state, values = orbax_state()
    state = {"params": state["params"], "rng": jax.random.key(7, impl="rbg")}
    local = str(tmp_path / "orbax" / "keyed")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(local, state)
    ckptr.wait_until_finished()
    ckptr.close()
    rels = upload(server, local, f"{s3.prefix}/keyed")
    assert "_sharding" in rels and "array_metadatas/process_0" in rels, rels
    for where in (local, f"{s3.url}/keyed"):
        got = tensorstash.restore(where)
        assert jax.dtypes.issubdtype(got["rng"].dtype, jax.dtypes.prng_key), (where, got["rng"])
        assert str(jax.random.key_impl(got["rng"])) == str(jax.random.key_impl(state["rng"]))
        assert_same_array(np.asarray(jax.random.key_data(got["rng"])),
                          np.asarray(jax.random.key_data(state["rng"])), f"{where} rng")
        meta = tensorstash.metadata(where)
        for k in values["params"]:
            assert meta["params"][k].sharding == state["params"][k].sharding, (where, k)
        as_saved = tensorstash.restore(where, target=meta)
        for k, v in values["params"].items():
            check_sharded(as_saved["params"][k], v, state["params"][k].sharding, f"{where} {k}")


# --- 2a. tensorstash writes an Orbax checkpoint (format="orbax") to S3 ---------------------------

def test_orbax_format_saved_to_s3_restores_bit_exact(server, s3, tmp_path):
    url, prefix = s3.url, s3.prefix
    state, values = orbax_state()
    tree = dict(state, step=1234, lr=0.125)  # no str leaves: the Orbax writer refuses them
    want = dict(values, step=1234, lr=0.125)
    path = f"{url}/orbax_step"
    tensorstash.save(path, tree, format="orbax")

    rels = [k[len(prefix) + len("/orbax_step/"):] for k in list_keys(server, prefix + "/")]
    assert "_METADATA" in rels and "manifest.ocdbt" in rels, rels
    assert not [r for r in rels if "tmp" in r], rels

    assert_restored_numpy(tensorstash.restore(path), want, key_order=False)
    target, shardings = other_targets(values)
    got = tensorstash.restore(path, target=target)
    for k, v in values["params"].items():
        check_sharded(got["params"][k], v, shardings[k], f"orbax target {k}")
    meta = tensorstash.metadata(path)
    for k, v in values["params"].items():
        assert meta["params"][k].shape == v.shape and meta["params"][k].dtype == v.dtype, k

    # The CLI reads it from S3.
    env = child_env(server, str(tmp_path))
    r = run_cli("inspect", path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "format orbax-ocdbt" in r.stdout, r.stdout
    assert re.search(r"^params/e\s+bfloat16\s", r.stdout, re.M), r.stdout
    r = run_cli("inspect", "--json", path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["format"] == "orbax-ocdbt", doc
    arrays = {a["path"]: a for a in doc["arrays"]}
    assert arrays["params/i"]["shape"] == [8, 4, 6] and arrays["params/i"]["dtype"] == "int32"
    r = run_cli("verify", path, env=env)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr

    # What it wrote to the bucket is an Orbax checkpoint: Orbax restores a copy of the objects.
    import orbax.checkpoint as ocp
    local = str(tmp_path / "copy")
    download(server, f"{prefix}/orbax_step", local)
    ckptr = ocp.PyTreeCheckpointer()
    ogot = ckptr.restore(local)
    ckptr.close()
    for k, v in values["params"].items():
        assert_same_array(np.asarray(ogot["params"][k]), v, f"orbax restore {k}")
    assert_same_array(np.asarray(ogot["opt"][1]), values["opt"][1], "orbax restore opt/1")
    assert ogot["step"] == 1234 and ogot["lr"] == 0.125, ogot


# --- the worker -----------------------------------------------------------------------------------

def _worker_run(args) -> None:
    assert jax.process_count() == args.nproc and jax.process_index() == args.pid
    assert jax.device_count() == 8, jax.devices()
    values = step_values()
    shardings, mshardings = layout(args.layout, jax.devices())

    if args.phase == "save":
        tree = {"params": {k: global_array(v, shardings[k]) for k, v in values.items()},
                "host": HOST, "step": 7, "name": f"saved by {args.nproc} processes"}
        tensorstash.save(args.step, tree, chunk_bytes=256)
        with tensorstash.CheckpointManager(args.root, max_to_keep=2) as mgr:
            assert mgr.all_steps() == [], mgr.all_steps()
            for step in MGR_STEPS:
                state = {"params": {k: global_array(v, mshardings[k])
                                    for k, v in mgr_values(step).items()},
                         "step": step}
                assert mgr.save(step, state, metadata={"step": step, "nproc": args.nproc})
            mgr.wait_until_finished()
            assert mgr.all_steps() == [2, 3], mgr.all_steps()
        print(f"process {args.pid}: saved", flush=True)
        return

    # restore: onto this layout; every process checks its own shards
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
                         for k, v in values.items()},
              "host": np.zeros(HOST.shape, HOST.dtype), "step": 0, "name": ""}
    got = tensorstash.restore(args.step, target=target)
    for k, v in values.items():
        check_sharded(got["params"][k], v, shardings[k], k)
    assert_same_array(got["host"], HOST, "host")
    assert got["step"] == 7 and got["name"] == "saved by 2 processes", got
    plain = tensorstash.restore(args.step)
    for k, v in values.items():
        assert_same_array(plain["params"][k], v, f"plain {k}")

    with tensorstash.CheckpointManager(args.root, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [2, 3], mgr.all_steps()
        step = mgr.latest_step()
        assert step == 3, step
        want = mgr_values(step)
        mtarget = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=mshardings[k])
                              for k, v in want.items()}, "step": 0}
        mgot = mgr.restore(step, target=mtarget)
        assert mgot["step"] == 3, mgot["step"]
        for k, v in want.items():
            check_sharded(mgot["params"][k], v, mshardings[k], f"manager {k}")
        assert mgr.metadata(step) == {"step": 3, "nproc": 2}
        older = mgr.restore(2)  # NumPy
        assert_same_tree(older, {"params": mgr_values(2), "step": 2})
    print(f"process {args.pid}: restored", flush=True)


def _worker_main() -> int:
    args = parse_args(options=("--root",))
    return run_in_job(args, _worker_run, distributed=args.nproc > 1)


if __name__ == "__main__":
    sys.exit(_worker_main())
