#!/usr/bin/env python3
"""The s3 benchmark: tensorstash against TensorStore's own S3 driver (zarr3 + OCDBT, the format
Orbax writes), and against plain PUTs and GETs of the same bytes, on one local SeaweedFS
(bench/README.md, "s3").

    python bench/s3.py [--gib 1.0] [--runs 3] [--warmup 1] [--workdir /tmp/tensorstash-bench-s3]
                       [--out bench/results/s3.json] [--raw-object-mib 16] [--raw-threads 4]
                       [--raw-variants unsigned,signed,fresh] [--keep]

One process, JAX on 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set
before JAX is imported). The script starts SeaweedFS (`weed mini`, tests/s3/s3_servers.py) with
its data under --workdir on 127.0.0.1, and stops it at the end, also on an error, Ctrl-C or
SIGTERM, and (a watchdog process) when this process dies otherwise. The state is the main
benchmark's "large" scenario scaled to --gib: 8 float32 arrays of rows x 8192 (128 MiB each at
1 GiB), sharded over a 2x4 mesh (scenarios.big_arrays). Each run, in an order that rotates run
by run, every participant saves (PUTs) the state under its own prefix of the bucket, then
every participant restores (GETs) it:

  tensorstash  tensorstash.save("s3://bucket/...", state) and tensorstash.restore(url, target)
               onto the same 2x4 shardings (their defaults; settings from AWS_ENDPOINT_URL,
               AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY).
  tensorstore  TensorStore's s3 kvstore driver writing what Orbax writes: one OCDBT database
               (orbax tensorstore_utils: config, target_data_file_size, assume_config, read
               coalescing for remote storage, its context), one zarr3 array per leaf with one
               sharding_indexed chunk per device shard, zstd level 3 (Orbax's default
               compression); every shard written concurrently. The restore opens each array and
               reads each device's block concurrently, then device_put + make_array_from_single_
               device_arrays (as Orbax does). Without Orbax's Python layers (its per-process
               OCDBT sub-database and merge, its metadata files): a lower bound for Orbax.
  raw          plain PUTs and GETs of the same bytes (the state's shards copied into one
               buffer), --raw-object-mib objects from --raw-threads Python threads, each with
               one keep-alive http.client connection, signed with SigV4 and UNSIGNED-PAYLOAD
               (no hashing of the body on either side of the wire); GETs read with readinto
               into a preallocated, touched buffer. The ceiling "of raw" is reported against.
               For reference (--raw-variants, both by default): "signed" PUTs with an
               SHA-256-signed payload (what tensorstash and TensorStore send over plain HTTP),
               "fresh" GETs into a buffer allocated in the timed region (whose page faults
               count, as a restore's do).

tensorstash is imported from a copy of the installed package made at the start (in --workdir),
so that a rebuild of the installed extension during the run cannot crash the benchmark.

Timed: the call, from start until the save returns (every object answered) or until every
restored array is ready (jax.block_until_ready). Before each timed operation the server is
left to go idle (its CPU use below 5% over 0.25 s, at most 10 s). CPU: the benchmark process's
user + system time (resource.getrusage, all its threads: client side) and the server's
(utime + stime of the weed process from /proc/<pid>/stat), both over the timed region, per GiB
moved. Between runs every object is deleted and the volumes are vacuumed (untimed). The
restores of the first run (a warm-up when --warmup > 0) are compared bit for bit with the
saved state, untimed; a difference stops the benchmark.

Reports: medians over the counted runs, GiB/s, ratio = TensorStore median / tensorstash median
(above 1: tensorstash is faster), "of raw" = raw median / tool median, CPU-s per GiB. Writes the
JSON (every run, medians, machine, versions, the TensorStore specs) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import hmac
import http.client
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from urllib.parse import quote, urlsplit

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "s3"))

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import s3_servers  # noqa: E402  (tests/s3)
import scenarios as S  # noqa: E402
import worker as W  # noqa: E402  (imports JAX after XLA_FLAGS; make_tree, target_tree, verify)

import jax  # noqa: E402

GiB = 1 << 30
PARTICIPANTS = ("tensorstash", "tensorstore", "raw")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(msg, flush=True)


def rotate(items, k):
    k %= len(items)
    return list(items[k:]) + list(items[:k])


# --- the server's CPU ------------------------------------------------------------------------

def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of pid and of every process in its process group (the server runs as a
    session leader; weed mini is one process, its threads included in its own counters)."""
    total = 0
    pids = {pid} | set(s3_servers._group_members(pid))
    for p in pids:
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                data = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = data[data.rfind(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def self_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def settle(pid: int, idle_fraction: float = 0.05, window: float = 0.25, limit: float = 10.0) -> float:
    """Waits until the server has been (nearly) idle for `window` s, at most `limit` s; returns
    the wait."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        c0 = proc_cpu_seconds(pid)
        time.sleep(window)
        if proc_cpu_seconds(pid) - c0 <= idle_fraction * window:
            break
    return time.monotonic() - t0


class Timed:
    """Wall time, this process's CPU time and the server's CPU time over a region."""

    def __init__(self, server_pid: int):
        self.pid = server_pid

    def __enter__(self):
        self.c0, self.s0 = self_cpu_seconds(), proc_cpu_seconds(self.pid)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.client_cpu = self_cpu_seconds() - self.c0
        self.server_cpu = proc_cpu_seconds(self.pid) - self.s0
        return False

    def result(self) -> dict:
        return {"seconds": self.seconds, "client_cpu": self.client_cpu,
                "server_cpu": self.server_cpu}


# --- raw PUT / GET ---------------------------------------------------------------------------

def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


class SigV4:
    """AWS Signature V4 headers for a path-style request without a query (enough here)."""

    def __init__(self, access_key: str, secret_key: str, region: str):
        self.access_key, self.secret_key, self.region = access_key, secret_key, region

    def headers(self, method: str, host: str, path: str, payload_sha256: str) -> dict:
        amz_date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        day = amz_date[:8]
        h = {"host": host, "x-amz-content-sha256": payload_sha256, "x-amz-date": amz_date}
        signed = ";".join(sorted(h))
        canonical = "\n".join([method, path, "", "".join(f"{k}:{h[k]}\n" for k in sorted(h)),
                               signed, payload_sha256])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        key = _hmac(_hmac(_hmac(_hmac(("AWS4" + self.secret_key).encode(), day), self.region),
                          "s3"), "aws4_request")
        sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        del h["host"]  # http.client sends it
        h["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
                              f"SignedHeaders={signed}, Signature={sig}")
        return h


class RawS3:
    """Plain PUTs / GETs of one buffer's bytes as objects of `object_bytes`, from `threads`
    threads with one keep-alive connection each (http.client releases the GIL in send/recv)."""

    def __init__(self, srv, object_bytes: int, threads: int):
        self.srv = srv
        u = urlsplit(srv.endpoint)
        self.hostname, self.port, self.host = u.hostname, u.port, u.netloc
        self.signer = SigV4(srv.access_key, srv.secret_key, srv.region)
        self.object_bytes, self.threads = object_bytes, threads

    def _key(self, prefix: str, off: int) -> str:
        return f"/{self.srv.bucket}/{quote(prefix)}/{off:013d}"

    def _run(self, fn, n: int) -> None:
        offsets = iter(range(0, n, self.object_bytes))
        lock = threading.Lock()
        errors: list = []

        def work():
            conn = http.client.HTTPConnection(self.hostname, self.port, timeout=120)
            try:
                while not errors:
                    with lock:
                        off = next(offsets, None)
                    if off is None:
                        return
                    fn(conn, off)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
            finally:
                conn.close()

        threads = [threading.Thread(target=work) for _ in range(min(self.threads, max(1, n // self.object_bytes)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def put(self, prefix: str, buf: memoryview, signed: bool = False) -> None:
        def one(conn, off):
            part = buf[off:off + self.object_bytes]
            digest = hashlib.sha256(part).hexdigest() if signed else "UNSIGNED-PAYLOAD"
            path = self._key(prefix, off)
            h = self.signer.headers("PUT", self.host, path, digest)
            h["Content-Length"] = str(len(part))
            conn.request("PUT", path, body=part, headers=h)
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                raise RuntimeError(f"raw PUT {path}: HTTP {r.status} {body[:300]!r}")
        self._run(one, len(buf))

    def get(self, prefix: str, buf: memoryview) -> None:
        def one(conn, off):
            part = buf[off:off + self.object_bytes]
            path = self._key(prefix, off)
            conn.request("GET", path, headers=self.signer.headers("GET", self.host, path,
                                                                 "UNSIGNED-PAYLOAD"))
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"raw GET {path}: HTTP {r.status} {r.read()[:300]!r}")
            got = 0
            while got < len(part):
                k = r.readinto(part[got:])
                if not k:
                    break
                got += k
            if r.read() or got != len(part):
                raise RuntimeError(f"raw GET {path}: {got} bytes, expected {len(part)}")
        self._run(one, len(buf))


# --- TensorStore (what Orbax writes) ---------------------------------------------------------

# orbax/checkpoint/_src/serialization/tensorstore_utils.py (0.12.8): _DEFAULT_OCDBT_TS_CONTEXT
ORBAX_TS_CONTEXT = {"file_io_concurrency": {"limit": 128},
                    "cache_pool#ocdbt": {"total_bytes_limit": 100000000}}


def ocdbt_kvstore(srv, prefix: str, name: str, write: bool) -> dict:
    """Orbax's _build_ocdbt_kvstore_tspec with an s3 base instead of a file one."""
    base = {"driver": "s3", "bucket": srv.bucket, "path": prefix.rstrip("/") + "/",
            "endpoint": srv.endpoint, "aws_region": srv.region,
            "aws_credentials": {"type": "environment"}}
    kv = {"driver": "ocdbt", "base": base}
    if write:  # _add_ocdbt_write_options
        kv["target_data_file_size"] = 2 ** 31  # _DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE (not GCS)
        kv["config"] = {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100000000,
                        "manifest_kind": "single"}
        kv["assume_config"] = True
    kv["path"] = name
    kv["cache_pool"] = "cache_pool#ocdbt"
    # is_remote_storage(): true for an s3 base
    kv.update({"experimental_read_coalescing_threshold_bytes": 1000000,
               "experimental_read_coalescing_merged_bytes": 500000000000,
               "experimental_read_coalescing_interval": "1ms"})
    return kv


def zarr3_metadata(shape, chunk_shape, dtype: str) -> dict:
    """Orbax's _build_zarr3_metadata(use_compression=True)."""
    return {"shape": list(shape), "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": list(chunk_shape),
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                           {"name": "zstd", "configuration": {"level": 3}}],
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                 {"name": "crc32c"}],
                "index_location": "end"}}]}


class TensorStoreS3:
    def __init__(self, srv):
        import tensorstore as ts
        self.ts, self.srv = ts, srv

    def write_spec(self, prefix: str, name: str, arr) -> dict:
        shard_shape = arr.sharding.shard_shape(arr.shape)
        return {"driver": "zarr3", "kvstore": ocdbt_kvstore(self.srv, prefix, name, True),
                "recheck_cached_data": False, "recheck_cached_metadata": False,
                "store_data_equal_to_fill_value": True,
                "metadata": zarr3_metadata(arr.shape, shard_shape, np.dtype(arr.dtype).name)}

    def read_spec(self, prefix: str, name: str) -> dict:
        return {"driver": "zarr3", "kvstore": ocdbt_kvstore(self.srv, prefix, name, False),
                "recheck_cached_data": False, "recheck_cached_metadata": False,
                "fill_missing_data_reads": False}

    def save(self, prefix: str, tree: dict) -> None:
        ts = self.ts
        ctx = ts.Context(ORBAX_TS_CONTEXT)
        names = sorted(tree)
        opens = [ts.open(self.write_spec(prefix, n, tree[n]), create=True, open=True, context=ctx)
                 for n in names]
        writes = []
        for n, fut in zip(names, opens):
            t = fut.result()
            for shard in tree[n].addressable_shards:
                if shard.replica_id == 0:
                    writes.append(t[shard.index].write(np.asarray(shard.data)))
        for w in writes:
            w.result()

    def restore(self, prefix: str, target: dict) -> dict:
        ts = self.ts
        ctx = ts.Context(ORBAX_TS_CONTEXT)
        names = sorted(target)
        opens = [ts.open(self.read_spec(prefix, n), read=True, context=ctx) for n in names]
        reads = []
        for n, fut in zip(names, opens):
            t = fut.result()
            spec = target[n]
            idx = spec.sharding.addressable_devices_indices_map(spec.shape)
            reads.append([(d, t[i].read()) for d, i in idx.items()])
        out = {}
        for n, parts in zip(names, reads):
            spec = target[n]
            bufs = [jax.device_put(f.result(), d) for d, f in parts]
            out[n] = jax.make_array_from_single_device_arrays(spec.shape, spec.sharding, bufs)
        return out


# --- the benchmark ---------------------------------------------------------------------------

def versions() -> dict:
    out = {}
    for n in ("tensorstash", "tensorstore", "orbax-checkpoint", "jax", "jaxlib", "numpy", "botocore"):
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = None
    try:
        out["tensorstash_commit"] = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        out["seaweedfs"] = subprocess.run([s3_servers._exe("weed"), "version"], capture_output=True,
                                          text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        out["seaweedfs"] = None
    return out


def loadavg() -> list:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[:3]
    except OSError:
        return []


# Stops the server when the benchmark process ends in any way (a crash or SIGKILL included):
# it waits for EOF on its stdin, the write end of which only the benchmark holds.
_WATCHDOG = """
import os, shutil, sys
sys.path.insert(0, sys.argv[1])
import s3_servers
sys.stdin.buffer.read()
s3_servers.stop_pid(int(sys.argv[2]), "weed")
if sys.argv[3]:
    shutil.rmtree(sys.argv[3], ignore_errors=True)
"""


def start_watchdog(server_pid: int, remove_dir: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WATCHDOG, os.path.join(REPO, "tests", "s3"),
                             str(server_pid), remove_dir], stdin=subprocess.PIPE,
                            start_new_session=True)


def snapshot_tensorstash(into: str) -> dict:
    """Copies the installed tensorstash package into `into` and puts that copy first on
    sys.path, before anything imports it: on a shared machine the installed extension may be
    rebuilt in place while the benchmark runs (it is hard-linked to a build output), which
    crashes a process that has it mapped. Returns where it came from and the extension's hash."""
    import importlib.util
    spec = importlib.util.find_spec("tensorstash")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("tensorstash is not installed in this environment")
    src = list(spec.submodule_search_locations)[0]
    dst = os.path.join(into, "tensorstash")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, into)
    ext = sorted(f for f in os.listdir(dst) if f.startswith("_ext") and f.endswith(".so"))
    digest = None
    if ext:
        with open(os.path.join(dst, ext[0]), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return {"installed_at": src, "extension_sha256_16": digest}


def master_port(pid: int) -> int | None:
    for arg in s3_servers._cmdline(pid).split():
        if arg.startswith("-master.port="):
            return int(arg.split("=", 1)[1])
    return None


class Bench:
    def __init__(self, args, srv):
        self.args, self.srv = args, srv
        self.client = srv.client(read_timeout=120, max_attempts=3)
        self.leaves = S.big_arrays("w", 8, args.gib, 1)
        self.nbytes = S.nbytes(self.leaves)
        self.op = S.Op("restore", "restore", "main", layout="2x4")
        import tensorstash
        self.tensorstash = tensorstash
        self.tstore = TensorStoreS3(srv)
        self.raw = RawS3(srv, args.raw_object_mib << 20, args.raw_threads)
        self.samples: dict = {}
        self.runs: list = []

    def url(self, prefix: str) -> str:
        return f"s3://{self.srv.bucket}/{prefix}"

    def delete_prefix(self, prefix: str) -> int:
        n = 0
        token = None
        while True:
            kw = {"Bucket": self.srv.bucket, "Prefix": prefix + "/"}
            if token:
                kw["ContinuationToken"] = token
            page = self.client.list_objects_v2(**kw)
            keys = [o["Key"] for o in page.get("Contents", [])]
            for i in range(0, len(keys), 1000):
                self.client.delete_objects(Bucket=self.srv.bucket, Delete={
                    "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
            n += len(keys)
            if not page.get("IsTruncated"):
                return n
            token = page.get("NextContinuationToken")

    def vacuum(self) -> str:
        port = master_port(self.srv.pid)
        if port is None:
            return "no master port"
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/vol/vacuum?garbageThreshold=0.0001", timeout=120) as r:
                r.read()
            return "ok"
        except OSError as e:
            return f"failed: {e}"

    def timed(self, fn) -> tuple[dict, object]:
        gc.collect()
        waited = settle(self.srv.pid)
        with Timed(self.srv.pid) as t:
            out = fn()
        return dict(t.result(), settle_wait=round(waited, 3)), out

    def record(self, op: str, who: str, result: dict, counted: bool, run_rec: dict) -> None:
        run_rec.setdefault(op, {})[who] = result
        if counted:
            self.samples.setdefault(op, {}).setdefault(who, []).append(result)
        s = result["seconds"]
        log(f"    {op:<7} {who:<18} {s:7.3f} s  {self.nbytes / GiB / s:6.3f} GiB/s  "
            f"cpu client {result['client_cpu']:6.2f} s  server {result['server_cpu']:6.2f} s")

    def run(self, tree, raw_src, raw_dst, run: int, counted: bool, verify: bool) -> None:
        args = self.args
        rec: dict = {"run": run, "counted": counted}
        order = rotate(PARTICIPANTS, run)
        rec["order"] = order
        prefixes = {p: f"bench/run{run}/{p}" for p in PARTICIPANTS}
        prefixes["raw-signed"] = f"bench/run{run}/raw-signed"
        raw_variants = [v for v in args.raw_variants if v != "unsigned"]
        target = W.target_tree(self.leaves, self.op)

        for who in order:
            if who == "tensorstash":
                r, _ = self.timed(lambda: self.tensorstash.save(self.url(prefixes[who]), tree))
            elif who == "tensorstore":
                r, _ = self.timed(lambda: self.tstore.save(prefixes[who], tree))
            else:
                r, _ = self.timed(lambda: self.raw.put(prefixes["raw"], raw_src))
            self.record("save", who if who != "raw" else "raw PUT", r, counted, rec)
            if who == "raw" and "signed" in raw_variants:
                r, _ = self.timed(lambda: self.raw.put(prefixes["raw-signed"], raw_src, signed=True))
                self.record("save", "raw PUT (signed)", r, counted, rec)

        for who in order:
            if who == "tensorstash":
                r, out = self.timed(lambda: jax.block_until_ready(
                    self.tensorstash.restore(self.url(prefixes[who]), target=target)))
            elif who == "tensorstore":
                r, out = self.timed(lambda: jax.block_until_ready(
                    self.tstore.restore(prefixes[who], target)))
            else:
                r, out = self.timed(lambda: self.raw.get(prefixes["raw"], raw_dst))
            self.record("restore", who if who != "raw" else "raw GET", r, counted, rec)
            if who == "raw" and "fresh" in raw_variants:
                r, _ = self.timed(lambda: self.raw.get(
                    prefixes["raw"], memoryview(np.empty(self.nbytes, np.uint8))))
                self.record("restore", "raw GET (fresh)", r, counted, rec)
            if verify:
                t0 = time.perf_counter()
                if who == "raw":
                    if not np.array_equal(np.frombuffer(raw_src, np.uint8),
                                          np.frombuffer(raw_dst, np.uint8)):
                        raise AssertionError("raw GET: the bytes read differ from the bytes put")
                else:
                    W.verify(out, self.leaves, self.op, who)
                rec.setdefault("verified", []).append(who)
                log(f"    verified {who}: bit for bit ({time.perf_counter() - t0:.1f} s, untimed)")
            del out

        t0 = time.perf_counter()
        deleted = sum(self.delete_prefix(p) for p in prefixes.values())
        rec["objects_deleted"] = deleted
        rec["vacuum"] = self.vacuum()
        rec["cleanup_seconds"] = round(time.perf_counter() - t0, 2)
        rec["disk_free_gib"] = round(shutil.disk_usage(args.workdir).free / GiB, 1)
        log(f"    cleanup: {deleted} objects deleted, vacuum {rec['vacuum']}, "
            f"{rec['cleanup_seconds']} s; {rec['disk_free_gib']} GiB free")
        self.runs.append(rec)

    def summary(self) -> dict:
        med = {}
        for op, by in self.samples.items():
            for who, rs in by.items():
                s = statistics.median(r["seconds"] for r in rs)
                med.setdefault(op, {})[who] = {
                    "seconds": s, "min": min(r["seconds"] for r in rs),
                    "max": max(r["seconds"] for r in rs),
                    "gib_per_s": self.nbytes / GiB / s,
                    "client_cpu_s_per_gib": statistics.median(r["client_cpu"] for r in rs) / (self.nbytes / GiB),
                    "server_cpu_s_per_gib": statistics.median(r["server_cpu"] for r in rs) / (self.nbytes / GiB),
                    "runs": len(rs)}
        for op, raw in (("save", "raw PUT"), ("restore", "raw GET")):
            m = med.get(op, {})
            if "tensorstash" in m and "tensorstore" in m:
                m["tensorstash"]["ratio_vs_tensorstore"] = m["tensorstore"]["seconds"] / m["tensorstash"]["seconds"]
            for who in ("tensorstash", "tensorstore", "raw PUT (signed)", "raw GET (fresh)"):
                if who in m and raw in m:
                    m[who]["of_raw"] = m[raw]["seconds"] / m[who]["seconds"]
        return med


def table(med: dict, nbytes: int) -> str:
    lines = [f"{'op':<8}{'participant':<19}{'median s':>9}{'min..max s':>15}{'GiB/s':>8}"
             f"{'vs TS':>7}{'of raw':>8}{'CPU s/GiB client':>18}{'server':>8}"]
    for op in ("save", "restore"):
        for who, m in med.get(op, {}).items():
            ratio = f"{m['ratio_vs_tensorstore']:.2f}x" if "ratio_vs_tensorstore" in m else ""
            of_raw = f"{100 * m['of_raw']:.0f}%" if "of_raw" in m else ""
            lines.append(f"{op:<8}{who:<19}{m['seconds']:9.3f}{m['min']:7.2f}..{m['max']:<6.2f}"
                         f"{m['gib_per_s']:8.3f}{ratio:>7}{of_raw:>8}"
                         f"{m['client_cpu_s_per_gib']:18.2f}{m['server_cpu_s_per_gib']:8.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="uncounted runs first (default 1)")
    ap.add_argument("--workdir", default="/tmp/tensorstash-bench-s3",
                    help="the server's files (emptied first, removed after unless --keep)")
    ap.add_argument("--out", default=None,
                    help="JSON results (default bench/results/s3.json, or bench/s3.json without bench/results)")
    ap.add_argument("--raw-object-mib", type=int, default=16)
    ap.add_argument("--raw-threads", type=int, default=4)
    ap.add_argument("--raw-variants", default="unsigned,signed,fresh",
                    help="comma list: unsigned (always), signed (also PUTs with an SHA-256-signed "
                         "payload), fresh (also GETs into a buffer allocated in the timed region)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    args.raw_variants = [v.strip() for v in args.raw_variants.split(",") if v.strip()]
    if args.out is None:
        d = os.path.join(HERE, "results")
        args.out = os.path.join(d if os.path.isdir(d) else HERE, "s3.json")
    args.workdir = os.path.abspath(args.workdir)

    nbytes = S.nbytes(S.big_arrays("w", 8, args.gib, 1))
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir, exist_ok=True)
    free = shutil.disk_usage(args.workdir).free
    need = nbytes * (3 + (1 if "signed" in args.raw_variants else 0)) + 2 * GiB
    if free < need:
        log(f"error: {args.workdir} has {free / GiB:.1f} GiB free; one run needs about {need / GiB:.1f}")
        return 2

    package = snapshot_tensorstash(os.path.join(args.workdir, "package"))

    def on_term(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)

    started = time.time()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
            "args": {k: v for k, v in vars(args).items()},
            "bytes": nbytes, "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                                         "kernel": platform.release(),
                                         "disk_free_gib_start": round(free / GiB, 1)},
            "versions": versions(), "tensorstash_package": package,
            "load_average_start": loadavg()}
    log(f"s3 benchmark: {nbytes / GiB:.3f} GiB (8 float32 arrays, 2x4 mesh), "
        f"{args.warmup} warm-up + {args.runs} runs; server data in {args.workdir}")
    srv = watchdog = None
    try:
        srv = s3_servers.start("seaweedfs", os.path.join(args.workdir, "server"))
        watchdog = start_watchdog(srv.pid, "" if args.keep else args.workdir)
        log(f"SeaweedFS ready in {srv.ready_s:.1f} s: {srv.endpoint} bucket {srv.bucket} (pid {srv.pid})")
        os.environ.update(AWS_ENDPOINT_URL=srv.endpoint, AWS_REGION=srv.region,
                          AWS_DEFAULT_REGION=srv.region, AWS_ACCESS_KEY_ID=srv.access_key,
                          AWS_SECRET_ACCESS_KEY=srv.secret_key)
        meta["server"] = {"kind": srv.kind, "endpoint": srv.endpoint, "bucket": srv.bucket,
                          "command": s3_servers._cmdline(srv.pid).strip()}
        bench = Bench(args, srv)
        package["imported_from"] = os.path.dirname(bench.tensorstash.__file__)
        meta["tensorstore_specs"] = {"context": ORBAX_TS_CONTEXT,
                                     "kvstore_write": ocdbt_kvstore(srv, "PREFIX", "w0", True),
                                     "kvstore_read": ocdbt_kvstore(srv, "PREFIX", "w0", False)}
        t0 = time.perf_counter()
        tree = W.make_tree(bench.leaves, "2x4")
        # The raw participant's bytes: the state's shards, one after the other.
        raw_src = np.empty(nbytes, np.uint8)
        off = 0
        for leaf in bench.leaves:
            for shard in W.get(tree, leaf.path).addressable_shards:
                b = np.asarray(shard.data).reshape(-1).view(np.uint8)
                raw_src[off:off + b.size] = b
                off += b.size
        assert off == nbytes, (off, nbytes)
        raw_dst = np.ones(nbytes, np.uint8)  # touched
        log(f"state made in {time.perf_counter() - t0:.1f} s")
        # Warm up each client on a tiny state (connections, first-call costs), untimed.
        small = [S.Leaf("w", (64, 128), "float32", ("a", "b"), 7)]
        st = W.make_tree(small, "2x4")
        bench.tensorstash.save(bench.url("warmup/tensorstash"), st)
        jax.block_until_ready(bench.tensorstash.restore(bench.url("warmup/tensorstash"),
                                                        target=W.target_tree(small, bench.op)))
        bench.tstore.save("warmup/tensorstore", st)
        jax.block_until_ready(bench.tstore.restore("warmup/tensorstore", W.target_tree(small, bench.op)))
        bench.delete_prefix("warmup")
        total = args.warmup + args.runs
        for run in range(total):
            counted = run >= args.warmup
            log(f"run {run + 1}/{total}" + ("" if counted else " (warm-up)") +
                (" (verifying)" if run == 0 else ""))
            bench.run(tree, memoryview(raw_src), memoryview(raw_dst), run, counted, run == 0)
        med = bench.summary()
        meta["load_average_end"] = loadavg()
        meta["seconds"] = round(time.time() - started, 1)
        meta["server_rss_kib_end"] = _rss_kib(srv.pid)
        result = {"meta": meta, "medians": med, "runs": bench.runs}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        log("")
        log(f"{nbytes / GiB:.3f} GiB, medians of {args.runs} runs; vs TS = TensorStore time / "
            f"tensorstash time; of raw = raw PUT/GET time / time; CPU = process (client) and "
            f"weed (server) CPU seconds per GiB")
        log(table(med, nbytes))
        log(f"load average {' '.join(meta['load_average_start'])} at the start, "
            f"{' '.join(meta['load_average_end'])} at the end; {meta['seconds']} s in all")
        log(f"wrote {args.out}")
        return 0
    except BaseException:
        traceback.print_exc()
        if srv is not None:
            log(f"--- server log tail ({srv.log_path}) ---\n{s3_servers._tail(srv.log_path, 30)}")
        return 1
    finally:
        if srv is not None:
            srv.stop()
            log(f"SeaweedFS stopped (pid {srv.pid})")
        if watchdog is not None:
            watchdog.stdin.close()
            try:
                watchdog.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no slow teardown of JAX and the tools' thread pools
