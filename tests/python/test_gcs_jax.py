"""tensorstash on Google Cloud Storage with JAX: a 2-process jax.distributed job saves a sharded
step and a CheckpointManager to gs://, and other jobs restore them onto other meshes (2
processes on another layout, 1 process restoring what 2 wrote); and Orbax checkpoints written
to gs:// by orbax-checkpoint itself (OCDBT and zarr folders, a single step and an Orbax
CheckpointManager root) restore, read and convert bit for bit.

Everything talks to the local gcp-storage-emulator behind the enforcing proxy
(tests/gcs/gcs_servers.py), on 127.0.0.1 only; nothing here reaches real GCS.

    cd /work/main && .venv/bin/python -m pytest tests/python/test_gcs_jax.py -q -x -p no:cacheprovider

The multi-process jobs run the worker of test_s3_jax.py (`python test_s3_jax.py --phase ...`),
which only sees URLs: the same job as on S3, with gs:// URLs.

How Orbax reaches the emulator: Orbax opens gs:// paths with etils.epath, which hands them to
fsspec's gcsfs (it honours STORAGE_EMULATOR_HOST; scripts/setup.sh installs it, with the fsspec
release it is made for, both pinned in scripts/constraints.txt), and writes the arrays with
TensorStore's GCS driver, which TENSORSTORE_GCS_HTTP_URL points at the same proxy. gcsfs is
asked for anonymous access and its plain file system: the default one first probes the bucket's
type over gRPC, which the emulator does not speak.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import urllib.parse

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mp_launch
import tensorstash
import test_s3_jax as job  # its worker and data (ARRAYS, layouts) are store-agnostic
from tshelpers import assert_restored_numpy, cli_path, assert_same_array, global_array, pattern

HERE = os.path.dirname(os.path.abspath(__file__))

from gcs_fixtures import NO_METADATA_SERVER, gcs_servers, server  # noqa: E402,F401

JOB_TIMEOUT_S = 150  # for a whole multi-process job; a hang fails the test instead of blocking
# The folder of the tensorstash this test imported, for the workers (mp_launch drops PYTHONPATH).
WORKER_PYTHONPATH = os.pathsep.join([os.path.dirname(os.path.dirname(tensorstash.__file__)),
                                     HERE])


def google_free_env(base: dict[str, str], scratch: str) -> dict[str, str]:
    """`base` less every Google variable, with an empty gcloud folder, so that no credential of
    the machine is found (the proxy's open listener needs none), and the GCE metadata server
    that Google's libraries and TensorStore look for when they find none pointed at a closed
    port of 127.0.0.1 (never at the link-local address they would try)."""
    env = {k: v for k, v in base.items()
           if not k.startswith(("GOOGLE_", "STORAGE_", "GCLOUD_", "CLOUDSDK_", "GCE_",
                                "TENSORSTORE_GCS_"))}
    gcloud = os.path.join(scratch, "gcloud")
    os.makedirs(gcloud, exist_ok=True)
    env["CLOUDSDK_CONFIG"] = gcloud
    env["NO_GCE_CHECK"] = "true"
    for var in ("GCE_METADATA_ROOT", "GCE_METADATA_HOST", "GCE_METADATA_IP"):
        env[var] = NO_METADATA_SERVER
    return env


def child_env(server, scratch: str) -> dict[str, str]:
    env = google_free_env(dict(os.environ), scratch)
    env["STORAGE_EMULATOR_HOST"] = server.endpoint
    return env


def list_keys(server, prefix: str) -> list[str]:
    """Every object name under `prefix`, sorted (paged through the proxy)."""
    out, token = [], None
    while True:
        q = {"prefix": prefix}
        if token:
            q["pageToken"] = token
        url = f"{server.endpoint}/storage/v1/b/{server.bucket}/o?" + urllib.parse.urlencode(q)
        code, _, body = gcs_servers.http("GET", url)
        assert code == 200, (url, code, body[:300])
        r = json.loads(body)
        out += [o["name"] for o in r.get("items", [])]
        token = r.get("nextPageToken")
        if not token:
            return sorted(out)


def read_object(server, name: str) -> bytes:
    url = (f"{server.endpoint}/storage/v1/b/{server.bucket}/o/"
           + urllib.parse.quote(name, safe="") + "?alt=media")
    code, _, body = gcs_servers.http("GET", url)
    assert code == 200, (name, code, body[:300])
    return body


def run_cli(*args, env, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([cli_path(), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def run_job(phase: str, step: str, root: str, nproc: int, layout_name: str, cwd: str,
            env: dict) -> str:
    """`nproc` workers of test_s3_jax.py in a jax.distributed job with 8 CPU devices in all."""
    return mp_launch.run_job(job.__file__, phase, step, nproc, layout_name, cwd,
                             args=("--root", root), env=env, timeout_s=JOB_TIMEOUT_S,
                             pythonpath=WORKER_PYTHONPATH)


# --- 1. a 2-process job saves to gs://, other jobs restore onto other meshes ----------------------

@pytest.fixture(scope="module")
def mp_saved(server, tmp_path_factory):
    """A step and a CheckpointManager (steps 1..3, max_to_keep=2) saved on gs:// by a job of 2
    processes x 4 CPU devices (layout A: a 2 x 4 mesh)."""
    work = tmp_path_factory.mktemp("mp-save")
    prefix = f"mp-{secrets.token_hex(4)}"
    url = f"gs://{server.bucket}/{prefix}"
    saved = {"prefix": prefix, "url": url, "step": f"{url}/0000000001", "root": f"{url}/mgr"}
    run_job("save", saved["step"], saved["root"], 2, "A", str(work),
            child_env(server, str(work)))
    return saved


def test_two_processes_each_upload_their_shards_and_one_commit(server, mp_saved):
    prefix = mp_saved["prefix"]
    keys = list_keys(server, f"{prefix}/0000000001/")
    rel = [k[len(prefix) + len("/0000000001/"):] for k in keys]
    assert "COMMIT" in rel, rel
    commit = json.loads(read_object(server, f"{prefix}/0000000001/COMMIT"))
    assert commit["process_count"] == 2, commit
    attempts = {r.split("/")[0] for r in rel if r != "COMMIT"}
    assert len(attempts) == 1 and re.fullmatch(r"attempt-[0-9a-f]{16}", next(iter(attempts))), rel
    attempt = attempts.pop()
    assert commit["attempt"] == attempt, commit
    data = [r.split("/")[-1] for r in rel if r.startswith(f"{attempt}/state/data/")]
    assert {int(name.split("-")[0]) for name in data} == {0, 1}, rel  # both processes wrote
    # The record pins every object to its live GCS generation.
    for name, obj in commit["objects"].items():
        url = (f"{server.endpoint}/storage/v1/b/{server.bucket}/o/"
               + urllib.parse.quote(f"{prefix}/0000000001/{attempt}/{name}", safe=""))
        live = json.loads(gcs_servers.http("GET", url)[2])
        assert obj["generation"] == str(live["generation"]), (name, obj, live)
    # No hidden parts or probes left under the prefix, only the two roots.
    everything = list_keys(server, prefix + "/")
    assert {k[len(prefix) + 1:].split("/")[0] for k in everything} == {"0000000001", "mgr"}, \
        everything
    assert not [k for k in everything if ".tensorstash-uploads" in k], everything

    # The manager kept the newest two steps, both written by both processes.
    assert list_keys(server, f"{prefix}/mgr/0000000001") == [], "step 1 is still in the bucket"
    for step in (2, 3):
        mkeys = list_keys(server, f"{prefix}/mgr/{step:010d}/")
        assert f"{prefix}/mgr/{step:010d}/COMMIT" in mkeys, mkeys
        assert {int(k.split("/")[-1].split("-")[0]) for k in mkeys if "/state/data/" in k} \
            == {0, 1}, mkeys


def test_two_processes_restore_onto_another_mesh(server, mp_saved, tmp_path):
    # Layout B: a 4 x 2 mesh over the devices reversed, other axes, replication. Each process
    # checks its own shards of the step and of the manager's latest step, bit for bit.
    out = run_job("restore", mp_saved["step"], mp_saved["root"], 2, "B", str(tmp_path),
                  child_env(server, str(tmp_path)))
    assert out.count("restored") >= 2, out


def test_one_process_restores_what_two_wrote_onto_another_mesh(server, mp_saved, tmp_path):
    # Layout C: one axis of 8 interleaved devices, all in one process.
    out = run_job("restore", mp_saved["step"], mp_saved["root"], 1, "C", str(tmp_path),
                  child_env(server, str(tmp_path)))
    assert "process 0: restored" in out, out


# --- 2. Orbax checkpoints written to gs:// by orbax-checkpoint ------------------------------------

@pytest.fixture
def orbax_gcs(server, monkeypatch, tmp_path):
    """This process set up as a GCS user of Orbax pointed at the proxy: STORAGE_EMULATOR_HOST
    (gcsfs, tensorstash), TENSORSTORE_GCS_HTTP_URL (TensorStore), anonymous gcsfs; no credential
    of the machine. Yields a fresh gs:// prefix."""
    try:
        import gcsfs.core  # Orbax's gs:// file operations go through it (etils.epath)
    except ImportError as e:
        pytest.fail(f"gcsfs is missing ({e}): scripts/setup.sh installs it", pytrace=False)
    import fsspec
    from etils.epath import backend as epath_backend
    for var in list(os.environ):
        if var.startswith(("GOOGLE_", "STORAGE_", "GCLOUD_", "CLOUDSDK_", "GCE_",
                           "TENSORSTORE_GCS_")):
            monkeypatch.delenv(var)
    for k, v in google_free_env({}, str(tmp_path)).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", server.endpoint)
    # gcsfs's default class first asks for the bucket's type over gRPC, which the emulator does
    # not speak (a minute of retries); its plain file system is what the emulator serves.
    previous = {p: fsspec.get_filesystem_class(p) for p in ("gs", "gcs")}
    for p in previous:
        fsspec.register_implementation(p, gcsfs.core.GCSFileSystem, clobber=True)
    monkeypatch.setitem(fsspec.config.conf, "gcs", {"token": "anon"})
    # No file system made for another endpoint or class: etils and fsspec cache them.
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    fsspec.AbstractFileSystem.clear_instance_cache()
    prefix = f"orbax-{secrets.token_hex(4)}"
    try:
        yield prefix
    finally:
        for p, cls in previous.items():
            fsspec.register_implementation(p, cls, clobber=True)
        epath_backend.fsspec_backend._get_filesystem.cache_clear()
        fsspec.AbstractFileSystem.clear_instance_cache()


def orbax_values() -> dict:
    return {
        "params": {"w": pattern((16, 24), np.float32, seed=51),
                   "e": pattern((10, 7), ml_dtypes.bfloat16, seed=52),
                   "i": pattern((8, 4, 6), np.int32, seed=53)},
        "opt": [pattern((13,), np.uint16, seed=54), pattern((3, 5), np.int64, seed=55)],
        "zero_d": np.array(2.5, np.float64),
    }


def orbax_state(values: dict) -> dict:
    """`values` with the params as jax.Arrays sharded over a 2 x 4 mesh."""
    m = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    shardings = {"w": NamedSharding(m, P("x", "y")), "e": NamedSharding(m, P("x")),
                 "i": NamedSharding(m, P(None, "y"))}
    return dict(values, params={k: global_array(v, shardings[k])
                                for k, v in values["params"].items()})


def other_targets(values: dict):
    m = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("p", "q"))
    shardings = {"w": NamedSharding(m, P("q", "p")), "e": NamedSharding(m, P("q", None)),
                 "i": NamedSharding(m, P("p"))}
    return ({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
             for k, v in values["params"].items()}, shardings)


@pytest.mark.parametrize("layout", ["ocdbt", "zarr-folders"])
def test_orbax_written_by_orbax_to_gcs_restores_bit_for_bit(server, orbax_gcs, tmp_path, layout):
    import orbax.checkpoint as ocp
    values = orbax_values()
    url = f"gs://{server.bucket}/{orbax_gcs}/ckpt"
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=layout == "ocdbt", use_zarr3=True)
    ckptr = ocp.Checkpointer(handler)
    ckptr.save(url, args=ocp.args.PyTreeSave(orbax_state(values)))
    ckptr.close()
    rels = [k[len(orbax_gcs) + len("/ckpt/"):] for k in list_keys(server, f"{orbax_gcs}/ckpt/")]
    assert "_METADATA" in rels and "commit_success.txt" in rels, rels
    if layout == "ocdbt":
        assert "manifest.ocdbt" in rels, rels
        assert any("/d/" in r or r.startswith("d/") for r in rels), rels
    else:
        assert "manifest.ocdbt" not in rels and any(r.startswith("params.w/") for r in rels), rels

    assert_restored_numpy(tensorstash.restore(url), values, key_order=False)
    assert_restored_numpy(tensorstash.restore(url, mmap=False), values, key_order=False)
    target, shardings = other_targets(values)
    got = tensorstash.restore(url, target={"params": target})
    for k, v in values["params"].items():
        job.check_sharded(got["params"][k], v, shardings[k], f"{layout} {k}")
    meta = tensorstash.metadata(url)
    for k, v in values["params"].items():
        assert meta["params"][k].shape == v.shape and meta["params"][k].dtype == v.dtype, (k, meta)
    # Orbax reads back what it wrote: the same bytes as tensorstash's.
    ockptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    ogot = ockptr.restore(url)
    ockptr.close()
    for k, v in values["params"].items():
        assert_same_array(np.asarray(ogot["params"][k]), v, f"orbax's own restore {k}")

    env = child_env(server, str(tmp_path))
    fmt = "orbax-ocdbt" if layout == "ocdbt" else "orbax-zarr-folders"
    r = run_cli("inspect", url, env=env)
    assert r.returncode == 0 and f"format {fmt}" in r.stdout, r.stdout + r.stderr
    r = run_cli("verify", url, env=env)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr
    local = tmp_path / "native" / "0000000001"
    r = run_cli("convert", url, local, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_restored_numpy(tensorstash.restore(str(local)), values, key_order=False)
    native = f"gs://{server.bucket}/{orbax_gcs}/native/0000000001"
    r = run_cli("convert", "--to", "native", url, native, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_restored_numpy(tensorstash.restore(native), values, key_order=False)


def test_an_orbax_manager_root_written_by_orbax_on_gcs_lists_and_restores(server, orbax_gcs,
                                                                          tmp_path):
    import orbax.checkpoint as ocp
    values = orbax_values()
    params = orbax_state(values)["params"]
    root = f"gs://{server.bucket}/{orbax_gcs}/mgr"
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, max_to_keep=2)
    with ocp.CheckpointManager(root, options=options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, args=ocp.args.StandardSave(
                jax.tree.map(lambda x, step=step: x + step, params)))
        mgr.wait_until_finished()
        assert list(mgr.all_steps()) == [2, 3]
    tops = {k[len(orbax_gcs) + len("/mgr/"):].split("/")[0]
            for k in list_keys(server, f"{orbax_gcs}/mgr/")}
    assert {"2", "3"} <= tops and "1" not in tops, tops

    target, shardings = other_targets(values)
    for step in (2, 3):
        for path in (f"{root}/{step}", f"{root}/{step}/default"):
            got = tensorstash.restore(path, target=target)
            for k, v in values["params"].items():
                job.check_sharded(got[k], (v + step).astype(v.dtype), shardings[k], f"{path} {k}")
    r = run_cli("ls", root, env=child_env(server, str(tmp_path)))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split()[:2] for line in r.stdout.splitlines()[1:]]
    assert rows == [["2", "orbax-ocdbt"], ["3", "orbax-ocdbt"]], r.stdout

    # tensorstash's manager finds the Orbax steps through the store (never an empty native
    # listing), restores them, and refuses to save there with an error that says so.
    with tensorstash.CheckpointManager(root) as mgr:
        assert mgr.format == "orbax"
        assert mgr.all_steps() == [2, 3] and mgr.latest_step() == 3
        got = mgr.restore(target=target)
        for k, v in values["params"].items():
            job.check_sharded(got[k], (v + 3).astype(v.dtype), shardings[k], f"manager {k}")
        assert mgr.metrics(2) is None
        with pytest.raises(NotImplementedError, match="saving Orbax steps to gs://"):
            mgr.save(4, params, force=True)
    with pytest.raises(ValueError, match="holds orbax steps"):
        tensorstash.CheckpointManager(root, format="native")
    assert {k[len(orbax_gcs) + len("/mgr/"):].split("/")[0]
            for k in list_keys(server, f"{orbax_gcs}/mgr/")} == tops  # nothing written
