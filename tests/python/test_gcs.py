"""tensorstash on Google Cloud Storage ("gs://bucket/prefix/..."), end to end against a local
gcp-storage-emulator behind the enforcing proxy (tests/gcs/gcs_servers.py, gcs_proxy.py): the
Python API, the manager, the CLI, credentials, faults and hostile answers injected by the proxy,
objects replaced behind the engine's back, bytes of data files flipped on the wire (the proxy)
and in the server's storage (an emulator that keeps its objects in files), a writer SIGKILLed
mid-save, racing writers, Orbax in place, the multi-tier manager, configure_gcs.

The emulator ignores preconditions and generations; the proxy adds them back, as real GCS has
them. Nothing here talks to real GCS. The emulator is single-threaded Python: arrays are small.

    cd /work/main && .venv/bin/python -m pytest tests/python/test_gcs.py -q -x -p no:cacheprovider
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time
import urllib.parse

import ml_dtypes
import numpy as np
import pytest

import tensorstash
from tshelpers import assert_same_tree, cli_path, pattern

HERE = os.path.dirname(os.path.abspath(__file__))

from gcs_fixtures import NO_METADATA_SERVER, gcs_servers, server  # noqa: E402,F401



class Gcs:
    def __init__(self, srv, prefix: str):
        self.srv = srv
        self.bucket = srv.bucket
        self.prefix = prefix
        self.url = f"gs://{srv.bucket}/{prefix}"

    def step(self, name: str = "0000000001") -> str:
        return f"{self.url}/{name}"

    def keys(self, prefix: str | None = None) -> list[str]:
        """Every object name under `prefix` (default: this test's prefix + '/'), paged."""
        prefix = self.prefix + "/" if prefix is None else prefix
        out, token = [], None
        while True:
            q = {"prefix": prefix}
            if token:
                q["pageToken"] = token
            url = (f"{self.srv.endpoint}/storage/v1/b/{self.bucket}/o?"
                   + urllib.parse.urlencode(q))
            # The emulator is single-threaded: a listing waits behind any upload it is parsing
            # (a 40 MiB multipart body takes it seconds on a loaded machine).
            code, _, body = gcs_servers.http("GET", url, timeout=120)
            assert code == 200, (url, code, body[:300])
            r = json.loads(body)
            out += [o["name"] for o in r.get("items", [])]
            token = r.get("nextPageToken")
            if not token:
                return sorted(out)

    def object_url(self, name: str) -> str:
        return (f"{self.srv.endpoint}/storage/v1/b/{self.bucket}/o/"
                + urllib.parse.quote(name, safe=""))

    def read(self, name: str) -> bytes:
        code, _, body = gcs_servers.http("GET", self.object_url(name) + "?alt=media")
        assert code == 200, (name, code, body[:300])
        return body

    def replace(self, name: str, data: bytes) -> None:
        """Writes `data` over `name` (no precondition): a new generation."""
        url = (f"{self.srv.endpoint}/upload/storage/v1/b/{self.bucket}/o?uploadType=media&name="
               + urllib.parse.quote(name, safe=""))
        code, _, body = gcs_servers.http("POST", url, data,
                                         {"Content-Type": "application/octet-stream"})
        assert code == 200, (name, code, body[:300])

    def env(self) -> dict[str, str]:
        return dict(os.environ)


@pytest.fixture
def gcs(server, monkeypatch, request):
    """STORAGE_EMULATOR_HOST = the enforcing proxy (every other Google variable removed), the
    proxy's faults off, and a fresh prefix for the test. The metadata server, which the
    credential chain asks last, is a closed port of 127.0.0.1: never metadata.google.internal."""
    for var in list(os.environ):
        if var.startswith(("GOOGLE_", "STORAGE_", "GCLOUD_", "CLOUDSDK_", "GCE_")):
            monkeypatch.delenv(var)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
    monkeypatch.setenv("GCE_METADATA_HOST", NO_METADATA_SERVER)
    server.proxy_control("config", p_429=0, p_503=0, p_reset=0, p_reset_after=0, fail_next="",
                         hostile="")
    name = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:50]
    yield Gcs(server, f"{name}-{secrets.token_hex(4)}")
    server.proxy_control("config", p_429=0, p_503=0, p_reset=0, p_reset_after=0, fail_next="",
                         hostile="")


def run_cli(gcs: Gcs, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([cli_path(), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=gcs.env())


def small_tree(seed: int = 0) -> dict:
    return {
        "params": {"w": pattern((37, 19), np.float32, seed=seed),
                   "b": pattern((19,), ml_dtypes.bfloat16, seed=seed + 1),
                   "f8": pattern((5, 3), ml_dtypes.float8_e4m3fn, seed=seed + 2)},
        "opt": [pattern((7,), np.int64, seed=seed + 3), pattern((2, 2), np.complex64, seed=seed + 4),
                pattern((9,), np.bool_, seed=seed + 5)],
        "zero_d": np.array(2.5, np.float64),
        "step": 1234,
        "lr": 0.125,
    }


# --- save, restore, metadata -----------------------------------------------------------------------

def test_save_restore_and_metadata_on_gcs_are_bit_exact(gcs):
    tree = small_tree(seed=11)
    path = gcs.step()
    tensorstash.save(path, tree)
    assert any("/0000000001/" in k for k in gcs.keys()), gcs.keys()  # it went to the bucket
    # The record pins every object to its GCS generation number (docs/format.md, 13.1).
    record = json.loads(gcs.read(f"{gcs.prefix}/0000000001/COMMIT"))
    assert record["objects"], record
    for name, obj in record["objects"].items():
        live = json.loads(gcs_servers.http(
            "GET", gcs.object_url(f"{gcs.prefix}/0000000001/{record['attempt']}/{name}"))[2])
        assert obj["generation"] == str(live["generation"]) and obj["generation"].isdigit(), \
            (name, obj, live.get("generation"))
        assert obj["size"] == int(live["size"]), (name, obj, live.get("size"))
    assert_same_tree(tensorstash.restore(path), tree)
    assert_same_tree(tensorstash.restore(path, mmap=False), tree)
    meta = tensorstash.metadata(path)
    for key in ("w", "b", "f8"):
        want = tree["params"][key]
        assert meta["params"][key].shape == want.shape, (key, meta["params"][key])
        assert meta["params"][key].dtype == want.dtype, (key, meta["params"][key])
    assert meta["zero_d"].shape == () and meta["zero_d"].dtype == np.float64
    assert meta["step"] == 1234 and meta["lr"] == 0.125
    with pytest.raises(FileNotFoundError):
        tensorstash.restore(gcs.step("0000000002"))
    with pytest.raises(FileExistsError):
        tensorstash.save(path, small_tree(seed=12))
    assert_same_tree(tensorstash.restore(path), tree)


def test_data_files_go_up_in_one_request_each_not_composed(gcs):
    # 72 MiB in chunks of 8 MiB: the data files stay below the 32 MiB part size, so each goes up
    # as one upload; none is composed from parts, and none is left half-written.
    tree = {f"a{i}": pattern((6 << 20,), np.float32, seed=i) for i in range(3)}
    path = gcs.step()
    tensorstash.save(path, tree)
    record = json.loads(gcs.read(f"{gcs.prefix}/0000000001/COMMIT"))
    data = [name for name in record["objects"] if "/data/" in name]
    assert len(data) >= 3, record["objects"]
    for name in data:
        live = json.loads(gcs_servers.http(
            "GET", gcs.object_url(f"{gcs.prefix}/0000000001/{record['attempt']}/{name}"))[2])
        assert int(live["size"]) < 32 << 20, (name, live["size"])
        assert "componentCount" not in live, (name, live)
    assert [k for k in gcs.keys() if ".tensorstash-uploads" in k] == []
    assert_same_tree(tensorstash.restore(path), tree)


# --- the manager ---------------------------------------------------------------------------------

def test_manager_on_gcs_keeps_the_newest_and_deletes_the_rest(gcs):
    def state(step):
        return {"w": pattern((64, 33), np.float32, seed=step), "count": step}

    with tensorstash.CheckpointManager(gcs.url, max_to_keep=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step), metadata={"step": step})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]
    with tensorstash.CheckpointManager(gcs.url, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [2, 3] and mgr.latest_step() == 3
        assert_same_tree(mgr.restore(3), state(3))
        assert_same_tree(mgr.restore(2), state(2))
        assert mgr.metadata(3) == {"step": 3}
    assert gcs.keys(f"{gcs.prefix}/0000000001") == [], "step 1's objects are still there"
    for step in (2, 3):
        assert gcs.keys(f"{gcs.prefix}/{step:010d}/"), f"step {step} has no objects"


# --- the command-line tool -----------------------------------------------------------------------

def test_cli_ls_inspect_verify_and_convert_from_gcs(gcs, tmp_path):
    tree = {"w": pattern((40, 24), np.float32, seed=3), "b": pattern((24,), ml_dtypes.bfloat16, seed=4),
            "i": pattern((5, 5), np.int16, seed=5)}
    path = gcs.step("0000000007")
    tensorstash.save(path, tree)

    r = run_cli(gcs, "ls", gcs.url)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "0000000007" in ln]
    assert len(lines) == 1 and "complete" in lines[0], r.stdout

    r = run_cli(gcs, "inspect", path)
    assert r.returncode == 0, r.stderr
    assert path in r.stdout, r.stdout
    for name, dtype in (("w", "float32"), ("b", "bfloat16"), ("i", "int16")):
        assert re.search(rf"^{name}\s+{dtype}\s", r.stdout, re.M), r.stdout

    r = run_cli(gcs, "verify", path)
    assert r.returncode == 0 and r.stdout.startswith("OK") and "3 arrays" in r.stdout, \
        r.stdout + r.stderr

    orbax_dst = tmp_path / "orbax" / "0000000007"
    r = run_cli(gcs, "convert", path, orbax_dst)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (orbax_dst / "_METADATA").exists(), list(orbax_dst.iterdir())
    assert_same_tree(tensorstash.restore(str(orbax_dst)), tree)

    # And back up: a local step converted onto gs://.
    up = gcs.step("0000000009")
    r = run_cli(gcs, "convert", "--to", "native", orbax_dst, up)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_same_tree(tensorstash.restore(up), tree)

    r = run_cli(gcs, "verify", gcs.step("0000000008"))
    assert r.returncode == 2, r.stdout + r.stderr


# --- credentials, endpoints ----------------------------------------------------------------------

def test_no_credentials_is_a_permission_error_saying_where_it_looked(gcs, monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    try:
        # The proxy's endpoint, but no credential: nothing is sent.
        tensorstash.configure_gcs(endpoint=gcs.srv.endpoint)
        for call in (lambda: tensorstash.save(gcs.step(), small_tree()),
                     lambda: tensorstash.restore(gcs.step()),
                     lambda: tensorstash.metadata(gcs.step())):
            with pytest.raises(PermissionError) as raised:
                call()
            msg = str(raised.value)
            assert "no Google Cloud credentials" in msg, msg
            assert "STORAGE_EMULATOR_HOST" in msg and "GOOGLE_APPLICATION_CREDENTIALS" in msg, msg
            assert "token" in msg, msg
    finally:
        tensorstash.configure_gcs()
    assert gcs.keys(gcs.prefix) == []


def test_a_token_the_server_does_not_know_is_a_permission_error(gcs, monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    try:
        tensorstash.configure_gcs(endpoint=gcs.srv.auth_endpoint, token="not-a-token")
        with pytest.raises(PermissionError) as raised:
            tensorstash.save(gcs.step(), small_tree())
        assert "credentials" in str(raised.value), str(raised.value)
    finally:
        tensorstash.configure_gcs()
    assert gcs.keys(gcs.prefix) == []


def test_the_raw_emulator_is_refused_writes_with_a_clear_error(gcs, monkeypatch):
    # gcp-storage-emulator ignores ifGenerationMatch: a create-only commit would not be one.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.srv.raw_endpoint)
    with pytest.raises(Exception) as raised:
        tensorstash.save(gcs.step(), small_tree())
    msg = str(raised.value)
    assert "ignores" in msg and "ifGenerationMatch" in msg, msg
    assert gcs.srv.raw_endpoint.split("://")[-1] in msg, msg
    assert [k for k in gcs.keys() if "tensorstash-probe" not in k] == []


def test_storage_emulator_host_without_a_scheme_gives_the_endpoint(gcs, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.srv.endpoint.split("://", 1)[1])
    tree = small_tree(2)
    tensorstash.save(gcs.step(), tree)
    assert gcs.keys(), "nothing reached the emulator"
    assert_same_tree(tensorstash.restore(gcs.step()), tree)
    r = run_cli(gcs, "verify", gcs.step())
    assert r.returncode == 0, r.stdout + r.stderr


def test_configure_gcs_with_a_prefix_gives_two_prefixes_different_settings(gcs, monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    a, b, c = f"{gcs.url}/a", f"{gcs.url}/b", f"{gcs.url}/c"
    try:
        # Default: no endpoint other than Google's is known, so b needs settings of its own.
        tensorstash.configure_gcs(endpoint=gcs.srv.endpoint, anonymous=True, prefix=a)
        tensorstash.configure_gcs(endpoint=gcs.srv.raw_endpoint, anonymous=True, prefix=c + "/")
        tensorstash.save(f"{a}/0000000001", small_tree(6))
        assert_same_tree(tensorstash.restore(f"{a}/0000000001"), small_tree(6))
        # "gs://bucket/x/a" does not cover "gs://bucket/x/ab": Google's endpoint, no credentials.
        with pytest.raises(PermissionError):
            tensorstash.save(f"{gcs.url}/ab/0000000001", small_tree(5))
        with pytest.raises(PermissionError):
            tensorstash.save(f"{b}/0000000001", small_tree(5))
        # c: the raw emulator, refused writes.
        with pytest.raises(Exception, match="ignores"):
            tensorstash.save(f"{c}/0000000001", small_tree(7))
        with pytest.raises(ValueError, match="gs://"):
            tensorstash.configure_gcs(endpoint=gcs.srv.endpoint, prefix="s3://elsewhere")
        with pytest.raises(ValueError):
            tensorstash.configure_gcs(token="t", anonymous=True)
    finally:
        for prefix in (a, c + "/"):
            tensorstash.configure_gcs(prefix=prefix)
        tensorstash.configure_gcs()
    keys = gcs.keys()
    assert any(k.startswith(f"{gcs.prefix}/a/0000000001/") for k in keys), keys
    assert [k for k in keys if not k.startswith(f"{gcs.prefix}/a/")
            and "tensorstash-probe" not in k] == [], keys


# --- faults and hostile answers --------------------------------------------------------------------

def test_save_and_restore_through_429s_503s_and_resets_are_bit_exact(gcs):
    tree = {"big": pattern((512, 1024), np.float32, seed=21),  # 2 MiB
            "mid": pattern((300, 500), ml_dtypes.bfloat16, seed=22),
            "small": pattern((1000,), np.int64, seed=23), "n": 7}
    srv = gcs.srv
    srv.proxy_control("reset_stats")
    # Each kind at least once, at the start, then at random.
    srv.proxy_control("config", fail_next="429,503,reset,reset_after", p_429=0.05, p_503=0.05,
                      p_reset=0.03, p_reset_after=0.03, seed=5)
    tensorstash.save(gcs.step(), tree, data_file_bytes=1 << 20)
    srv.proxy_control("config", fail_next="503,reset,429")
    assert_same_tree(tensorstash.restore(gcs.step(), mmap=False), tree)
    assert_same_tree(tensorstash.restore(gcs.step()), tree)
    stats = srv.proxy_control("stats")
    srv.proxy_control("config", p_429=0, p_503=0, p_reset=0, p_reset_after=0, fail_next="")
    print(f"gcs proxy: {stats}")
    for kind in ("429", "503", "reset", "reset_after"):
        assert stats[f"injected_{kind}"] >= 1, stats
    assert_same_tree(tensorstash.restore(gcs.step()), tree)
    r = run_cli(gcs, "verify", gcs.step())
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("mode", ["flip", "truncate", "ignore_range", "shift_range"])
def test_hostile_reads_are_errors_or_correct_never_wrong_bytes(gcs, mode):
    tree = {"x": pattern((256, 300), np.float32, seed=41), "y": pattern((999,), np.int32, seed=42)}
    tensorstash.save(gcs.step(), tree)
    gcs.srv.proxy_control("reset_stats")
    # A few truncated bodies are retried into correct bytes (all of them: ConnectionError after
    # 8 attempts, ~20 s); the other modes on every read.
    gcs.srv.proxy_control("config", hostile=mode, hostile_count=3 if mode == "truncate" else -1)
    outcomes = []
    try:
        for kw in ({}, {"mmap": False}):
            try:
                got = tensorstash.restore(gcs.step(), **kw)
            except Exception as e:  # an error is fine; which one is checked below
                outcomes.append(f"{type(e).__name__}: {e}")
                # Wrong bytes are data loss, never "not found" or a permission problem.
                assert not isinstance(e, (FileNotFoundError, PermissionError)), outcomes
            else:
                assert_same_tree(got, tree)  # correct bytes, or it fails here
                outcomes.append("correct")
        served = gcs.srv.proxy_control("stats")["hostile_served"]
    finally:
        gcs.srv.proxy_control("config", hostile="")
    print(mode, outcomes)
    assert served >= 1, f"the proxy served no {mode} answer"
    if mode == "truncate":
        assert outcomes == ["correct", "correct"], outcomes
    if mode == "flip":
        # Every media read is flipped, the commit record's first: DataLoss (OSError), never a
        # restore. (Flipped data files are caught by their CRC-32C; test_hostile_storage.py.)
        assert all(o.startswith("OSError: ") for o in outcomes), outcomes
    assert_same_tree(tensorstash.restore(gcs.step()), tree)


def test_data_object_replaced_after_commit_is_an_error_naming_it(gcs):
    tree = {"x": pattern((300, 200), np.float32, seed=31), "y": pattern((999,), np.int32, seed=32)}
    path = gcs.step()
    tensorstash.save(path, tree)
    data_keys = [k for k in gcs.keys() if re.search(r"/state/data/[^/]+\.dat$", k)]
    assert data_keys, gcs.keys()
    key = data_keys[0]
    old = gcs.read(key)
    gcs.replace(key, bytes(b ^ 0x5A for b in old))  # same size, a new generation
    for kw in ({}, {"mmap": False}):
        with pytest.raises(Exception) as raised:
            got = tensorstash.restore(path, **kw)
            same = all(np.array_equal(got[k], tree[k]) for k in tree)
            pytest.fail(f"restore({kw}) returned {'the old' if same else 'wrong'} data after "
                        f"{key} was replaced")
        msg = str(raised.value)
        assert key in msg or f"state/data/{key.rsplit('/', 1)[1]}" in msg, msg
    r = run_cli(gcs, "verify", path)
    assert r.returncode != 0, r.stdout + r.stderr
    assert key.rsplit("/", 1)[1] in r.stdout + r.stderr


# --- damaged data files: a flipped byte is DataLoss naming the array, chunk and file ------------

# Several chunks per array and several data files per step, so that a damaged file is one of many.
DAMAGE_SAVE = dict(chunk_bytes=16 << 10, data_file_bytes=64 << 10)
CRC_ERROR = re.compile(r"CRC-32C mismatch in chunk \[[0-9, ]+\] of array '([^']+)' "
                       r"\(file '([^']+)', offset [0-9]+")


def damage_tree() -> dict:
    return {"x": pattern((256, 300), np.float32, seed=61), "y": pattern((999,), np.int32, seed=62),
            "z": pattern((64, 128), ml_dtypes.bfloat16, seed=63)}


def assert_crc_error_names(msg: str, tree: dict, damaged: str) -> None:
    """`msg` is a checksum error naming an array of `tree`, a chunk and the file `damaged` (an
    object name; the message names it from the step down)."""
    m = CRC_ERROR.search(msg)
    assert m, msg
    assert m.group(1) in tree, (m.group(1), msg)
    assert damaged.endswith("/" + m.group(2).split("/", 1)[1]), (damaged, msg)
    assert m.group(2).rsplit("/", 1)[1] == damaged.rsplit("/", 1)[1], (damaged, msg)


def restore_fails(path: str, tree: dict, **kw) -> str:
    """The message of the OSError restore(path) raises; fails the test on wrong or right bytes."""
    with pytest.raises(OSError) as raised:
        got = tensorstash.restore(path, **kw)
        same = all(np.array_equal(got[k], tree[k]) for k in tree)
        pytest.fail(f"restore({kw}) returned {'the saved' if same else 'WRONG'} data from a "
                    "damaged data file")
    assert not isinstance(raised.value, (FileNotFoundError, PermissionError)), raised.value
    return str(raised.value)


@pytest.mark.parametrize("skip", [0, 2])
def test_a_byte_flipped_in_a_data_file_on_the_wire_is_data_loss_naming_it(gcs, skip):
    """The proxy flips one byte of one read of a data object (the first such read, or the
    third: hostile_skip), headers as for the true bytes."""
    tree = damage_tree()
    tensorstash.save(gcs.step(), tree, **DAMAGE_SAVE)
    data = [k for k in gcs.keys() if "/state/data/" in k]
    assert len(data) > skip, data
    flip = dict(hostile="flip", hostile_match=r"/state/data/[^/]+$", hostile_skip=skip,
                hostile_count=1)
    for kw in ({}, {"mmap": False}):
        gcs.srv.proxy_control("reset_stats")
        gcs.srv.proxy_control("config", **flip)
        msg = restore_fails(gcs.step(), tree, **kw)
        flipped = gcs.srv.proxy_control("stats")["hostile_objects"]
        assert list(flipped.values()) == [1] and next(iter(flipped)) in data, (flipped, data)
        assert_crc_error_names(msg, tree, next(iter(flipped)))
    gcs.srv.proxy_control("reset_stats")
    gcs.srv.proxy_control("config", **flip)
    r = run_cli(gcs, "verify", gcs.step())
    flipped = gcs.srv.proxy_control("stats")["hostile_objects"]
    assert r.returncode != 0 and len(flipped) == 1, (r.returncode, r.stdout + r.stderr, flipped)
    assert next(iter(flipped)).rsplit("/", 1)[1] in r.stdout + r.stderr, (flipped, r.stdout,
                                                                          r.stderr)
    gcs.srv.proxy_control("config", hostile="")
    assert_same_tree(tensorstash.restore(gcs.step()), tree)


def test_a_byte_flipped_in_a_stored_data_object_is_data_loss_naming_it(gcs, tmp_path, monkeypatch):
    """Bit rot in the server's storage: an emulator that keeps its objects in files, one byte of
    a data object flipped there. The object keeps its generation and the checksums recorded at
    upload, so only tensorstash's own chunk checksums can catch it."""
    srv = gcs_servers.start(str(tmp_path / "on-disk"), on_disk=True)
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", srv.endpoint)
        here = Gcs(srv, gcs.prefix)
        tree = damage_tree()
        tensorstash.save(here.step(), tree, **DAMAGE_SAVE)
        data = [k for k in here.keys() if "/state/data/" in k]
        damaged = data[len(data) // 2]
        before = json.loads(gcs_servers.http("GET", here.object_url(damaged))[2])
        stored = srv.stored_path(damaged)
        with open(stored, "r+b") as f:
            blob = bytearray(f.read())
            assert bytes(blob) == here.read(damaged)  # the emulator serves this file
            blob[len(blob) // 3] ^= 0x10
            f.seek(0)
            f.write(blob)
        after = json.loads(gcs_servers.http("GET", here.object_url(damaged))[2])
        assert after["generation"] == before["generation"], (before, after)
        for kw in ({}, {"mmap": False}):
            assert_crc_error_names(restore_fails(here.step(), tree, **kw), tree, damaged)
        r = run_cli(here, "verify", here.step())
        assert r.returncode != 0, r.stdout + r.stderr
        assert damaged.rsplit("/", 1)[1] in r.stdout + r.stderr, r.stdout + r.stderr
    finally:
        srv.stop()


def test_a_data_object_rewritten_through_the_raw_emulator_is_data_loss_naming_it(gcs):
    """The same bytes damaged, written back through the emulator's own endpoint (not the
    proxy): a new generation, so the read pinned to the recorded one fails before any checksum."""
    tree = damage_tree()
    tensorstash.save(gcs.step(), tree, **DAMAGE_SAVE)
    data = [k for k in gcs.keys() if "/state/data/" in k]
    damaged = data[0]
    blob = bytearray(gcs.read(damaged))
    blob[len(blob) // 3] ^= 0x10
    url = (f"{gcs.srv.raw_endpoint}/upload/storage/v1/b/{gcs.bucket}/o?uploadType=media&name="
           + urllib.parse.quote(damaged, safe=""))
    code, _, body = gcs_servers.http("POST", url, bytes(blob),
                                     {"Content-Type": "application/octet-stream"})
    assert code == 200, (code, body[:300])
    for kw in ({}, {"mmap": False}):
        msg = restore_fails(gcs.step(), tree, **kw)
        assert damaged in msg or f"state/data/{damaged.rsplit('/', 1)[1]}" in msg, msg
    r = run_cli(gcs, "verify", gcs.step())
    assert r.returncode != 0, r.stdout + r.stderr
    assert damaged.rsplit("/", 1)[1] in r.stdout + r.stderr, r.stdout + r.stderr


# --- SIGKILL, gc, racing writers -----------------------------------------------------------------

def test_gc_after_saves_killed_mid_upload_removes_uploads_and_keeps_the_step(gcs):
    tree = small_tree(4)
    tensorstash.save(gcs.step("0000000001"), tree)
    # 40 MiB in one chunk, so in one data file: more than one 32 MiB part, so composed from
    # hidden parts (smaller chunks would go into files of one part each, one upload each).
    script = textwrap.dedent(f"""
        import numpy as np, tensorstash
        big = {{"x": np.ones((10 << 20,), np.float32)}}
        print("ready", flush=True)
        while True:
            tensorstash.save({gcs.step("0000000001")!r}, big, overwrite=True,
                             chunk_bytes=1 << 30, data_file_bytes=1 << 30)
    """)
    saw_parts = False
    for delay in (1.0, 2.5):
        proc = subprocess.Popen([sys.executable, "-c", script], env=gcs.env(),
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            deadline = time.monotonic() + delay + 20
            time.sleep(delay)
            # Kill it once it has parts up, if it gets there in time.
            while time.monotonic() < deadline and proc.poll() is None:
                if any(".tensorstash-uploads/" in k for k in gcs.keys()):
                    saw_parts = True
                    break
                time.sleep(0.2)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.returncode
    assert saw_parts, "no killed save had uploaded a part: nothing tests gc of uploads"
    before = tensorstash.restore(gcs.step("0000000001"))
    r = run_cli(gcs, "gc", "--min-age", "0", gcs.url, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gc removed" in r.stdout, r.stdout
    assert any(line.startswith(("removed ", "aborted ")) for line in r.stdout.splitlines()), \
        r.stdout
    keys = gcs.keys()
    assert [k for k in keys if ".tensorstash-uploads" in k] == [], keys
    attempts = {k.split("/")[2] for k in gcs.keys(f"{gcs.prefix}/0000000001/") if k.count("/") > 2}
    assert len(attempts) == 1, (attempts, r.stdout, keys)
    assert_same_tree(tensorstash.restore(gcs.step("0000000001")), before)
    assert run_cli(gcs, "verify", gcs.step("0000000001")).returncode == 0


RACE_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorstash
    sys.path.insert(0, sys.argv[3])
    from tshelpers import pattern

    url, me = sys.argv[1], int(sys.argv[2])
    tree = {"a": pattern((64, 256), np.float32, seed=me), "who": me}
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        tensorstash.save(url, tree)
    except Exception as e:
        print("ERR", type(e).__name__, str(e).replace("\\n", " "), flush=True)
    else:
        print("OK", flush=True)
""")


def test_four_writers_racing_for_one_step_one_wins(gcs):
    url = gcs.step("0000000005")
    procs = [subprocess.Popen([sys.executable, "-c", RACE_CHILD, url, str(i), HERE], env=gcs.env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    results = {}
    try:
        for i, p in enumerate(procs):
            line = p.stdout.readline()
            assert line == "ready\n", (i, line, p.stderr.read() if p.poll() is not None else "")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, (i, p.returncode, err)
            results[i] = out.strip()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    winners = [i for i, r in results.items() if r == "OK"]
    assert len(winners) == 1, results
    for i, r in results.items():
        if i not in winners:
            assert r.startswith("ERR FileExistsError"), (i, r)
    got = tensorstash.restore(url)
    assert got["who"] == winners[0], (got["who"], results)
    assert_same_tree(got, {"a": pattern((64, 256), np.float32, seed=winners[0]), "who": winners[0]})


# --- Orbax, the multi-tier manager ----------------------------------------------------------------

def test_an_orbax_checkpoint_on_gcs_is_written_in_place_and_never_replaced(gcs):
    tree = small_tree(5)
    tensorstash.save(gcs.step(), tree, format="orbax")
    assert f"{gcs.prefix}/0000000001/commit_success.txt" in gcs.keys()
    assert_same_tree(tensorstash.restore(gcs.step()), tree)
    with pytest.raises(FileExistsError):
        tensorstash.save(gcs.step(), small_tree(6), format="orbax")
    with pytest.raises(ValueError, match="cannot replace it in place"):
        tensorstash.save(gcs.step(), small_tree(6), format="orbax", overwrite=True)
    assert_same_tree(tensorstash.restore(gcs.step()), tree)


def test_a_multi_tier_manager_keeps_its_persistent_steps_on_gcs(gcs, tmp_path):
    trees = {step: small_tree(step) for step in (1, 2, 3, 4)}
    kw = dict(save_interval_steps=2, local_save_interval_steps=1)
    with tensorstash.CheckpointManager(gcs.url, local_dir=tmp_path / "ram", **kw) as mgr:
        for step, tree in trees.items():
            mgr.save(step, tree)
        mgr.wait_until_finished()
    persistent = sorted({k.split("/")[1] for k in gcs.keys() if k.endswith("/COMMIT")})
    assert persistent == ["0000000002", "0000000004"], persistent
    with tensorstash.CheckpointManager(gcs.url, local_dir=tmp_path / "other-node", **kw) as mgr:
        assert mgr.latest_step() == 4
        assert_same_tree(mgr.restore(4), trees[4])
