#!/usr/bin/env python3
"""The gcs benchmark: tensorstash on gs:// against TensorStore's own GCS driver (zarr3 + OCDBT,
the format Orbax writes) and against Google's own Python client (google-cloud-storage) moving
the same bytes, on one local gcp-storage-emulator (bench/README.md, "gcs").

    python bench/gcs.py [--gib 1.0] [--runs 3] [--warmup 1] [--workdir /tmp/tensorstash-bench-gcs]
                        [--out bench/results/gcs.json] [--raw-object-mib 8] [--raw-threads 4]

One process, JAX on 8 CPU devices, the state of bench/s3.py (the main benchmark's "large"
scenario scaled to --gib: 8 float32 arrays sharded over a 2x4 mesh), whose pieces it reuses
(timing, CPU accounting, TensorStore's Orbax specs, the package snapshot). The script starts the
emulator and the enforcing proxy in front of it (tests/gcs/gcs_servers.py, 127.0.0.1 only, the
emulator's objects in memory) and stops them at the end, also on an error or a signal.

Where the bytes go. The proxy buffers whole answers and takes one lock around every request, so
reads are measured against the raw emulator. Writes cannot all be: tensorstash refuses to save
to a server that ignores ifGenerationMatch (the emulator does; README, "Checkpoints on GCS"),
so every participant's save goes through the proxy, the same path for all, and one reference
row uploads the same bytes with Google's client straight to the emulator (what the proxy costs).
Each run, in an order that rotates run by run, each participant saves the state, restores it,
and its objects are deleted (untimed), so that the emulator holds one copy at a time:

  tensorstash  tensorstash.save("gs://bucket/...", state) (STORAGE_EMULATOR_HOST: the proxy) and
               tensorstash.restore(url, target) onto the same 2x4 shardings
               (configure_gcs(endpoint=<emulator>, anonymous=True)); defaults otherwise.
  tensorstore  TensorStore's gcs kvstore driver writing what Orbax writes to gs:// (bench/s3.py's
               OCDBT + zarr3 + zstd specs with {"driver": "gcs", "bucket", "path"} as the base
               and Orbax's 400 MiB GCS target data file size), pointed at the proxy, then at the
               emulator, by TENSORSTORE_GCS_HTTP_URL.
  google-cloud-storage
               Google's Python client (anonymous credentials, client_options api_endpoint): the
               bytes of the state's shards as --raw-object-mib objects (8 MiB: one multipart
               upload each, CRC-32C sent, as the client does by default) from --raw-threads
               threads with a client each; downloads into a preallocated, touched buffer (the
               client checks the hashes the emulator sends). "raw" rows.

CPU: the benchmark process's user + system time (resource.getrusage: the client side, all its
threads), the emulator's and the proxy's (/proc/<pid>/stat), each over the timed region, per
GiB moved. Before each timed operation the emulator is left to go idle. The restores of the
first run are compared bit for bit with the state (untimed); a difference stops the benchmark.

gcp-storage-emulator is one Python process serving one request at a time: it, not the clients,
bounds every figure here (its CPU s/GiB is reported beside each). Medians over the counted runs;
writes the JSON (every run, medians, machine, versions) to --out. Not part of make test.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import io
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "gcs"))

import s3 as B  # noqa: E402  (bench/s3.py: sets XLA_FLAGS, imports JAX; timing, specs, snapshot)
import gcs_servers  # noqa: E402  (tests/gcs)
import numpy as np  # noqa: E402

S, W, jax = B.S, B.W, B.jax
GiB = B.GiB
log = B.log
PARTICIPANTS = ("tensorstash", "tensorstore", "google-cloud-storage")
GCS_OCDBT_TARGET_DATA_FILE_SIZE = 400 * 2 ** 20  # orbax tensorstore_utils, for a gcs base


def proc_cpu(pid: int) -> float:
    """utime + stime of one process (the emulator and the proxy are one process each)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read().decode("ascii", "replace")
    fields = data[data.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / B.CLK_TCK


class Timed:
    """Wall time and the CPU time of this process, the emulator and the proxy over a region."""

    def __init__(self, srv):
        self.srv = srv

    def __enter__(self):
        self.c0 = B.self_cpu_seconds()
        self.e0, self.p0 = proc_cpu(self.srv.emulator_pid), proc_cpu(self.srv.proxy_pid)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.client_cpu = B.self_cpu_seconds() - self.c0
        self.server_cpu = proc_cpu(self.srv.emulator_pid) - self.e0
        self.proxy_cpu = proc_cpu(self.srv.proxy_pid) - self.p0
        return False

    def result(self) -> dict:
        return {"seconds": self.seconds, "client_cpu": self.client_cpu,
                "server_cpu": self.server_cpu, "proxy_cpu": self.proxy_cpu}


# --- Google's own client ---------------------------------------------------------------------

class _Into(io.RawIOBase):
    """A writable file over a memoryview: the client's download lands in the buffer."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = len(b)
        if self.pos + n > len(self.view):
            raise ValueError(f"download longer than {len(self.view)} bytes")
        self.view[self.pos:self.pos + n] = b
        self.pos += n
        return n


class GoogleClient:
    """google-cloud-storage uploads / downloads of one buffer's bytes as objects of
    `object_bytes`, from `threads` threads with a client (and its HTTP session) each."""

    def __init__(self, bucket: str, object_bytes: int, threads: int):
        self.bucket_name, self.object_bytes, self.threads = bucket, object_bytes, threads

    def _buckets(self, endpoint: str, n: int) -> list:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
        return [storage.Client(project="bench", credentials=AnonymousCredentials(),
                               client_options={"api_endpoint": endpoint}).bucket(self.bucket_name)
                for _ in range(n)]

    def _run(self, endpoint: str, fn, n: int) -> None:
        offsets = iter(range(0, n, self.object_bytes))
        lock = threading.Lock()
        errors: list = []
        count = min(self.threads, max(1, n // self.object_bytes))
        buckets = self._buckets(endpoint, count)

        def work(bucket):
            try:
                while not errors:
                    with lock:
                        off = next(offsets, None)
                    if off is None:
                        return
                    fn(bucket, off)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(b,)) for b in buckets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    @staticmethod
    def name(prefix: str, off: int) -> str:
        return f"{prefix}/{off:013d}"

    def upload(self, endpoint: str, prefix: str, buf: memoryview) -> None:
        def one(bucket, off):
            part = buf[off:off + self.object_bytes]
            bucket.blob(self.name(prefix, off)).upload_from_file(
                io.BytesIO(part), size=len(part), content_type="application/octet-stream")
        self._run(endpoint, one, len(buf))

    def download(self, endpoint: str, prefix: str, buf: memoryview) -> None:
        def one(bucket, off):
            part = buf[off:off + self.object_bytes]
            into = _Into(part)
            bucket.blob(self.name(prefix, off)).download_to_file(into)
            if into.pos != len(part):
                raise RuntimeError(f"download of {self.name(prefix, off)}: {into.pos} bytes, "
                                   f"expected {len(part)}")
        self._run(endpoint, one, len(buf))


# --- TensorStore's GCS driver (what Orbax writes) --------------------------------------------

def ocdbt_kvstore_gcs(bucket: str, prefix: str, name: str, write: bool) -> dict:
    """bench/s3.py's Orbax OCDBT kvstore with Orbax's gcs base (gcs_utils.get_kvstore_for_gcs)."""
    base = {"driver": "gcs", "bucket": bucket, "path": prefix.rstrip("/") + "/"}
    kv = {"driver": "ocdbt", "base": base}
    if write:
        kv["target_data_file_size"] = GCS_OCDBT_TARGET_DATA_FILE_SIZE
        kv["config"] = {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100000000,
                        "manifest_kind": "single"}
        kv["assume_config"] = True
    kv["path"] = name
    kv["cache_pool"] = "cache_pool#ocdbt"
    kv.update({"experimental_read_coalescing_threshold_bytes": 1000000,
               "experimental_read_coalescing_merged_bytes": 500000000000,
               "experimental_read_coalescing_interval": "1ms"})
    return kv


class TensorStoreGcs(B.TensorStoreS3):
    """bench/s3.py's TensorStore participant on a gcs base; the endpoint is the environment's
    TENSORSTORE_GCS_HTTP_URL when the arrays are opened."""

    def __init__(self, bucket: str):
        import tensorstore as ts
        self.ts, self.bucket = ts, bucket

    def write_spec(self, prefix: str, name: str, arr) -> dict:
        shard_shape = arr.sharding.shard_shape(arr.shape)
        return {"driver": "zarr3", "kvstore": ocdbt_kvstore_gcs(self.bucket, prefix, name, True),
                "recheck_cached_data": False, "recheck_cached_metadata": False,
                "store_data_equal_to_fill_value": True,
                "metadata": B.zarr3_metadata(arr.shape, shard_shape, np.dtype(arr.dtype).name)}

    def read_spec(self, prefix: str, name: str) -> dict:
        return {"driver": "zarr3", "kvstore": ocdbt_kvstore_gcs(self.bucket, prefix, name, False),
                "recheck_cached_data": False, "recheck_cached_metadata": False,
                "fill_missing_data_reads": False}


# --- the benchmark ---------------------------------------------------------------------------

def versions() -> dict:
    out = {}
    for n in ("tensorstash", "tensorstore", "orbax-checkpoint", "jax", "numpy",
              "google-cloud-storage", "google-crc32c", "gcp-storage-emulator"):
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = None
    return out


class Bench:
    def __init__(self, args, srv):
        self.args, self.srv = args, srv
        self.leaves = S.big_arrays("w", 8, args.gib, 1)
        self.nbytes = S.nbytes(self.leaves)
        self.op = S.Op("restore", "restore", "main", layout="2x4")
        import tensorstash
        self.tensorstash = tensorstash
        self.tstore = TensorStoreGcs(srv.bucket)
        self.google = GoogleClient(srv.bucket, args.raw_object_mib << 20, args.raw_threads)
        self.samples: dict = {}
        self.runs: list = []

    def url(self, prefix: str) -> str:
        return f"gs://{self.srv.bucket}/{prefix}"

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every object under prefix + '/' on the raw emulator (one listing page: it
        does not page); returns how many."""
        import urllib.parse
        q = urllib.parse.urlencode({"prefix": prefix + "/"})
        code, _, body = gcs_servers.http(
            "GET", f"{self.srv.raw_endpoint}/storage/v1/b/{self.srv.bucket}/o?{q}", timeout=120)
        if code != 200:
            raise RuntimeError(f"list {prefix}: {code} {body[:200]!r}")
        names = [o["name"] for o in json.loads(body).get("items", [])]
        for n in names:
            code, _, body = gcs_servers.http(
                "DELETE", f"{self.srv.raw_endpoint}/storage/v1/b/{self.srv.bucket}/o/"
                + urllib.parse.quote(n, safe=""), timeout=120)
            if code not in (200, 204):
                raise RuntimeError(f"delete {n}: {code} {body[:200]!r}")
        return len(names)

    def check_memory(self, rec: dict, who: str) -> None:
        """Records the emulator's resident size once a participant's objects are deleted; stops
        the benchmark when it passes --max-emulator-gib (a shared machine, an in-memory server)."""
        kib = B._rss_kib(self.srv.emulator_pid) or 0
        rec.setdefault("emulator_rss_gib", {})[who] = round(kib / (1 << 20), 2)
        if kib > self.args.max_emulator_gib * (1 << 20):
            raise RuntimeError(f"the emulator holds {kib / (1 << 20):.1f} GiB after {who}'s "
                               f"objects were deleted (--max-emulator-gib "
                               f"{self.args.max_emulator_gib})")

    def timed(self, fn) -> tuple[dict, object]:
        gc.collect()
        waited = B.settle(self.srv.emulator_pid)
        with Timed(self.srv) as t:
            out = fn()
        return dict(t.result(), settle_wait=round(waited, 3)), out

    def record(self, op: str, who: str, result: dict, counted: bool, run_rec: dict) -> None:
        run_rec.setdefault(op, {})[who] = result
        if counted:
            self.samples.setdefault(op, {}).setdefault(who, []).append(result)
        s = result["seconds"]
        log(f"    {op:<7} {who:<22} {s:7.3f} s  {self.nbytes / GiB / s:6.3f} GiB/s  cpu client "
            f"{result['client_cpu']:6.2f} s  emulator {result['server_cpu']:6.2f} s  proxy "
            f"{result['proxy_cpu']:6.2f} s")

    def save(self, who: str, prefix: str, tree, raw_src):
        if who == "tensorstash":
            return self.timed(lambda: self.tensorstash.save(self.url(prefix), tree))
        if who == "tensorstore":
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = self.srv.endpoint
            return self.timed(lambda: self.tstore.save(prefix, tree))
        return self.timed(lambda: self.google.upload(self.srv.endpoint, prefix, raw_src))

    def restore(self, who: str, prefix: str, target, raw_dst):
        if who == "tensorstash":
            self.tensorstash.configure_gcs(endpoint=self.srv.raw_endpoint, anonymous=True)
            try:
                return self.timed(lambda: jax.block_until_ready(
                    self.tensorstash.restore(self.url(prefix), target=target)))
            finally:
                self.tensorstash.configure_gcs()
        if who == "tensorstore":
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = self.srv.raw_endpoint
            return self.timed(lambda: jax.block_until_ready(self.tstore.restore(prefix, target)))
        return self.timed(lambda: self.google.download(self.srv.raw_endpoint, prefix, raw_dst))

    def run(self, tree, raw_src, raw_dst, run: int, counted: bool, verify: bool) -> None:
        rec: dict = {"run": run, "counted": counted}
        order = B.rotate(PARTICIPANTS, run)
        rec["order"] = order
        target = W.target_tree(self.leaves, self.op)
        raw = "google-cloud-storage"
        for who in order:
            prefix = f"bench/run{run}/{who}"
            r, _ = self.save(who, prefix, tree, raw_src)
            self.record("save", "raw upload" if who == raw else who, r, counted, rec)
            r, out = self.restore(who, prefix, target, raw_dst)
            self.record("restore", "raw download" if who == raw else who, r, counted, rec)
            if verify:
                t0 = time.perf_counter()
                if who == raw:
                    if not np.array_equal(np.frombuffer(raw_src, np.uint8),
                                          np.frombuffer(raw_dst, np.uint8)):
                        raise AssertionError("google-cloud-storage: the bytes downloaded differ")
                else:
                    W.verify(out, self.leaves, self.op, who)
                rec.setdefault("verified", []).append(who)
                log(f"    verified {who}: bit for bit ({time.perf_counter() - t0:.1f} s, untimed)")
            del out
            rec.setdefault("objects_deleted", {})[who] = self.delete_prefix(prefix)
            self.check_memory(rec, who)
            if who == raw:  # the same bytes straight to the emulator: what the proxy costs
                direct = f"bench/run{run}/direct"
                r, _ = self.timed(lambda: self.google.upload(self.srv.raw_endpoint, direct,
                                                             raw_src))
                self.record("save", "raw upload, no proxy", r, counted, rec)
                rec["objects_deleted"]["direct"] = self.delete_prefix(direct)
        self.runs.append(rec)

    def summary(self) -> dict:
        med = {}
        gib = self.nbytes / GiB
        for op, by in self.samples.items():
            for who, rs in by.items():
                s = statistics.median(r["seconds"] for r in rs)
                med.setdefault(op, {})[who] = {
                    "seconds": s, "min": min(r["seconds"] for r in rs),
                    "max": max(r["seconds"] for r in rs), "gib_per_s": gib / s,
                    "client_cpu_s_per_gib": statistics.median(r["client_cpu"] for r in rs) / gib,
                    "server_cpu_s_per_gib": statistics.median(r["server_cpu"] for r in rs) / gib,
                    "proxy_cpu_s_per_gib": statistics.median(r["proxy_cpu"] for r in rs) / gib,
                    "runs": len(rs)}
        for op, raw in (("save", "raw upload"), ("restore", "raw download")):
            m = med.get(op, {})
            if "tensorstash" in m and "tensorstore" in m:
                m["tensorstash"]["ratio_vs_tensorstore"] = (m["tensorstore"]["seconds"]
                                                            / m["tensorstash"]["seconds"])
                m["tensorstash"]["client_cpu_vs_tensorstore"] = (
                    m["tensorstash"]["client_cpu_s_per_gib"]
                    / m["tensorstore"]["client_cpu_s_per_gib"])
            for who in ("tensorstash", "tensorstore", "raw upload, no proxy"):
                if who in m and raw in m:
                    m[who]["of_raw"] = m[raw]["seconds"] / m[who]["seconds"]
        return med


def table(med: dict) -> str:
    lines = [f"{'op':<8}{'participant':<23}{'median s':>9}{'min..max s':>15}{'GiB/s':>8}"
             f"{'vs TS':>7}{'of raw':>8}{'CPU s/GiB client':>18}{'emulator':>9}{'proxy':>7}"]
    for op in ("save", "restore"):
        for who, m in med.get(op, {}).items():
            ratio = f"{m['ratio_vs_tensorstore']:.2f}x" if "ratio_vs_tensorstore" in m else ""
            of_raw = f"{100 * m['of_raw']:.0f}%" if "of_raw" in m else ""
            lines.append(f"{op:<8}{who:<23}{m['seconds']:9.3f}{m['min']:7.2f}..{m['max']:<6.2f}"
                         f"{m['gib_per_s']:8.3f}{ratio:>7}{of_raw:>8}"
                         f"{m['client_cpu_s_per_gib']:18.2f}{m['server_cpu_s_per_gib']:9.2f}"
                         f"{m['proxy_cpu_s_per_gib']:7.2f}")
    return "\n".join(lines)


def quiet_google_environment(scratch: str) -> None:
    """No credential of the machine, and the GCE metadata server that Google's libraries and
    TensorStore look for when they find none pointed at a closed port of 127.0.0.1."""
    for var in list(os.environ):
        if var.startswith(("GOOGLE_", "STORAGE_", "GCLOUD_", "CLOUDSDK_", "GCE_",
                           "TENSORSTORE_GCS_")):
            del os.environ[var]
    gcloud = os.path.join(scratch, "gcloud")
    os.makedirs(gcloud, exist_ok=True)
    os.environ["CLOUDSDK_CONFIG"] = gcloud
    os.environ["NO_GCE_CHECK"] = "true"
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    for var in ("GCE_METADATA_ROOT", "GCE_METADATA_HOST", "GCE_METADATA_IP"):
        os.environ[var] = closed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="uncounted runs first (default 1)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(),
                                                      "tensorstash-bench-gcs"),
                    help="the servers' logs and the package snapshot (removed after unless --keep)")
    ap.add_argument("--out", default=None,
                    help="JSON results (default bench/results/gcs.json)")
    ap.add_argument("--raw-object-mib", type=int, default=8)
    ap.add_argument("--raw-threads", type=int, default=4)
    ap.add_argument("--max-emulator-gib", type=float, default=6.0,
                    help="stop when the emulator's resident size passes this between "
                         "participants (default 6)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args(argv)
    if args.out is None:
        d = os.path.join(HERE, "results")
        args.out = os.path.join(d if os.path.isdir(d) else HERE, "gcs.json")
    args.workdir = os.path.abspath(args.workdir)
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir, exist_ok=True)
    nbytes = S.nbytes(S.big_arrays("w", 8, args.gib, 1))
    package = B.snapshot_tensorstash(os.path.join(args.workdir, "package"))
    quiet_google_environment(args.workdir)

    servers: list = []

    def on_term(signum, frame):
        for srv in servers:  # the clients' pending requests then fail at once
            srv.stop()
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)

    started = time.time()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
            "args": dict(vars(args)), "bytes": nbytes,
            "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                        "kernel": platform.release()},
            "versions": versions(), "tensorstash_package": package,
            "load_average_start": B.loadavg()}
    log(f"gcs benchmark: {nbytes / GiB:.3f} GiB (8 float32 arrays, 2x4 mesh), {args.warmup} "
        f"warm-up + {args.runs} runs; saves through the enforcing proxy, restores from the "
        f"emulator")
    srv = None
    try:
        srv = gcs_servers.start(os.path.join(args.workdir, "server"))
        servers.append(srv)
        log(f"emulator {srv.raw_endpoint} (pid {srv.emulator_pid}), proxy {srv.endpoint} "
            f"(pid {srv.proxy_pid}), bucket {srv.bucket}, ready in {srv.ready_s:.1f} s")
        os.environ["STORAGE_EMULATOR_HOST"] = srv.endpoint
        meta["server"] = {"emulator": srv.raw_endpoint, "proxy": srv.endpoint,
                          "bucket": srv.bucket}
        bench = Bench(args, srv)
        package["imported_from"] = os.path.dirname(bench.tensorstash.__file__)
        meta["tensorstore_specs"] = {
            "context": B.ORBAX_TS_CONTEXT,
            "kvstore_write": ocdbt_kvstore_gcs(srv.bucket, "PREFIX", "w0", True),
            "kvstore_read": ocdbt_kvstore_gcs(srv.bucket, "PREFIX", "w0", False)}
        t0 = time.perf_counter()
        tree = W.make_tree(bench.leaves, "2x4")
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
        # Warm up each client on a tiny state (connections, first calls), untimed.
        small = [S.Leaf("w", (64, 128), "float32", ("a", "b"), 7)]
        st = W.make_tree(small, "2x4")
        for who in PARTICIPANTS:
            prefix = f"warmup/{who}"
            small_src = memoryview(np.zeros(64 << 10, np.uint8))
            if who == "google-cloud-storage":
                bench.google.upload(srv.endpoint, prefix, small_src)
                bench.google.download(srv.raw_endpoint, prefix,
                                      memoryview(np.empty(64 << 10, np.uint8)))
            else:
                bench.save(who, prefix, st, small_src)
                bench.restore(who, prefix, W.target_tree(small, bench.op), None)
            bench.delete_prefix(prefix)
        total = args.warmup + args.runs
        for run in range(total):
            counted = run >= args.warmup
            log(f"run {run + 1}/{total}" + ("" if counted else " (warm-up)")
                + (" (verifying)" if run == 0 else ""))
            bench.run(tree, memoryview(raw_src), memoryview(raw_dst), run, counted, run == 0)
        med = bench.summary()
        meta["load_average_end"] = B.loadavg()
        meta["seconds"] = round(time.time() - started, 1)
        meta["emulator_rss_kib_end"] = B._rss_kib(srv.emulator_pid)
        result = {"meta": meta, "medians": med, "runs": bench.runs}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        log("")
        log(f"{nbytes / GiB:.3f} GiB, medians of {args.runs} runs; vs TS = TensorStore time / "
            f"tensorstash time; of raw = google-cloud-storage time / time; CPU = this process "
            f"(client), the emulator's and the proxy's CPU seconds per GiB")
        log(table(med))
        log(f"load average {' '.join(meta['load_average_start'])} at the start, "
            f"{' '.join(meta['load_average_end'])} at the end; {meta['seconds']} s in all")
        log(f"wrote {args.out}")
        return 0
    except BaseException:
        traceback.print_exc()
        if srv is not None:
            for what, path in (("emulator", srv.emulator_log), ("proxy", srv.proxy_log)):
                log(f"--- {what} log tail ({path}) ---\n{gcs_servers._s3._tail(path, 30)}")
        return 1
    finally:
        if srv is not None:
            srv.stop()
            log("emulator and proxy stopped")
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no slow teardown of JAX and the tools' thread pools
