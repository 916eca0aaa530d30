#!/usr/bin/env python3
"""Shared reads (issue 42, docs/shared_reads.md): N JAX processes (jax.distributed over a
loopback coordinator, one CPU device each) restore one step, with share_reads on and off, and
Orbax restores the same state on the same processes.

    sudo .venv/bin/python bench/share.py                # 4 processes, 1 GiB, file and S3
    sudo .venv/bin/python bench/share.py --quick        # 64 MiB, one run: a smoke test
    options: --size-mib N --procs N --runs N --chunk-layers N --s3-mib-per-s R
             --only file|s3 --no-orbax --workdir DIR --out FILE.json

The state: 4 float32 arrays of 24 stacked layers (24 x rows x 1024), stored in chunks of
--chunk-layers layers (4). Two layouts:
  replicated  every process restores every array whole (data-parallel replicas);
  reshard     the layers split over the processes (6 each with 4 processes), so that a stored
              chunk of 4 layers straddles two processes' blocks: those chunks are needed twice.

Two storages, each simulating nodes that share a storage system:
  file  the step (and Orbax's checkpoint) in one ext4 image, built once (mkfs.ext4 -d). Each
        process runs in a mount namespace of its own (unshare -m) and attaches the image as a
        read-only loop device of its own (losetup -r --direct-io=on: the loop device reads the
        image with O_DIRECT, so the image file's page cache does not merge the processes'
        reads) mounted there; the page cache is dropped before each timed restore. Bytes read
        from storage: the sectors each loop device read (/sys/block/loopN/stat), summed.
  s3    the step in the S3 server the tests use (SeaweedFS), behind a TCP proxy in this script
        that caps the bytes it returns at --s3-mib-per-s in all (a token bucket: one shared
        storage link; 0: no cap, the server's own speed). Bytes read from storage: the bytes
        the proxy returned.

Methods: tensorstash with share_reads=True ("shared"), with share_reads=False ("alone"), and
Orbax's PyTreeCheckpointer (file only: Orbax reads S3 through TensorStore's own settings). A
restore's time is the slowest process's (each times its restore between two barriers).

Needs root (losetup, mount, unshare, drop_caches). Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import http.server

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "s3"))

LAYERS = 24
COLS = 1024
NUM_ARRAYS = 4
METHODS = ("shared", "alone", "orbax")
LAYOUTS = ("replicated", "reshard")


class BenchError(Exception):
    pass


def log(msg: str) -> None:
    print(f"[share {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def state_rows(size_mib: int) -> int:
    rows = size_mib * (1 << 20) // (NUM_ARRAYS * LAYERS * COLS * 4)
    if rows < 1:
        raise BenchError(f"--size-mib {size_mib} is too small")
    return rows


def make_state(size_mib: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(42)
    rows = state_rows(size_mib)
    return {f"w{i}": rng.random((LAYERS, rows, COLS), dtype=np.float32)
            for i in range(NUM_ARRAYS)}


def fmt_bytes(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


# --- the bandwidth-capped proxy ---------------------------------------------------------------

class CappedProxy:
    """A TCP proxy on 127.0.0.1 to `upstream` (host, port) in a thread of its own (asyncio). The
    bytes it returns to clients, all connections together, pass one token bucket of `rate`
    bytes per second (bursts of at most 256 KiB): a storage link of that bandwidth (a rate of 0:
    no cap). Requests go upstream unthrottled. `returned` counts the bytes returned so far."""

    CHUNK = 64 << 10

    def __init__(self, upstream: tuple[str, int], rate: float) -> None:
        self.upstream = upstream
        self.rate = float(rate)
        self.burst = 256 << 10
        self.returned = 0
        self._tokens = 0.0
        self._last = time.monotonic()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._lock = asyncio.Lock()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    async def _take(self, n: int) -> None:
        async with self._lock:  # first come, first served: one link
            while True:
                now = time.monotonic()
                self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
                self._last = now
                if self._tokens >= n:
                    self._tokens -= n
                    return
                await asyncio.sleep((n - self._tokens) / self.rate)

    async def _pipe(self, reader, writer, capped: bool) -> None:
        try:
            while data := await reader.read(self.CHUNK):
                if capped:
                    if self.rate > 0:
                        await self._take(len(data))
                    self.returned += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                writer.close()
            except OSError:
                pass

    async def _client(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer, False),
                             self._pipe(up_reader, writer, True))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


class Control:
    """A tiny HTTP server the workers ask for the proxy's byte count (GET /returned)."""

    def __init__(self, proxy: CappedProxy) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = str(proxy.returned).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/returned"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


# --- one process of the job -------------------------------------------------------------------

def loop_sectors_read(device: str) -> int:
    with open(f"/sys/block/{os.path.basename(device)}/stat") as f:
        return int(f.read().split()[2])


def worker(args) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    device = None
    mount = None
    if args.storage == "file":
        # This process's own view of the storage: the image as a loop device of its own,
        # mounted in this mount namespace only.
        device = subprocess.run(["losetup", "-r", "--direct-io=on", "-f", "--show", args.image],
                                check=True, capture_output=True, text=True).stdout.strip()
        mount = os.path.join(args.workdir, f"mnt{args.pid}")
        os.makedirs(mount, exist_ok=True)
        subprocess.run(["mount", "-o", "ro,noload", device, mount], check=True)
    try:
        run_worker(args, device, mount)
    finally:
        if mount is not None:
            subprocess.run(["umount", mount], check=False)
        if device is not None:
            subprocess.run(["losetup", "-d", device], check=False)


def run_worker(args, device: str | None, mount: str | None) -> None:
    import urllib.request

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                               num_processes=args.procs, process_id=args.pid)
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import tensorstash
    from tensorstash import _options

    _options.COORDINATION_TIMEOUT_S = 120.0
    state = make_state(args.size_mib)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    shardings = {"replicated": NamedSharding(mesh, P()),
                 "reshard": NamedSharding(mesh, P("x"))}
    if args.storage == "file":
        step = os.path.join(mount, "ts", "0000000001")
        orbax_path = os.path.join(mount, "orbax")
    else:
        step = args.s3_step
        orbax_path = None

    def storage_bytes() -> int:
        if device is not None:
            return loop_sectors_read(device) * 512
        with urllib.request.urlopen(args.control, timeout=30) as answer:
            return int(answer.read())

    ocp = None
    if "orbax" in args.methods and orbax_path is not None:
        from absl import logging as absl_logging
        import orbax.checkpoint as ocp
        absl_logging.set_verbosity(absl_logging.ERROR)

    results = []
    for layout in args.layouts:
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[layout])
                  for k, v in state.items()}
        for method in args.methods:
            if method == "orbax" and ocp is None:
                continue
            for run in range(args.runs):
                name = f"{layout}/{method}/{run}"
                multihost_utils.sync_global_devices(f"share bench: before {name}")
                if args.pid == 0 and device is not None:
                    subprocess.run(["sync"], check=True)
                    with open("/proc/sys/vm/drop_caches", "w") as f:
                        f.write("3\n")
                multihost_utils.sync_global_devices(f"share bench: cold {name}")
                before = storage_bytes()
                stats: dict = {}
                gc.collect()
                t0 = time.perf_counter()
                if method == "orbax":
                    ckptr = ocp.PyTreeCheckpointer()
                    restored = ckptr.restore(orbax_path, args=ocp.args.PyTreeRestore(
                        item=target,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
                else:
                    restored = tensorstash.restore(step, target=target, stats=stats,
                                                   share_reads=method == "shared")
                jax.block_until_ready(restored)
                seconds = time.perf_counter() - t0
                multihost_utils.sync_global_devices(f"share bench: after {name}")
                after = storage_bytes()
                if method == "orbax":
                    ckptr.close()
                if run == 0:
                    for k, arr in restored.items():
                        for shard in arr.addressable_shards:
                            if not np.array_equal(np.asarray(shard.data), state[k][shard.index]):
                                raise BenchError(f"{name}: {k!r} differs in {shard.index}")
                del restored
                results.append({
                    "layout": layout, "method": method, "run": run, "seconds": seconds,
                    # file: this process's own device; s3: the shared link (after - before is
                    # the whole job's, the same on every process)
                    "storage_bytes": after - before,
                    "shared": bool(stats.get("shared")),
                    "ts_storage_bytes": stats.get("storage_bytes"),
                    "peer_bytes": stats.get("peer_bytes"),
                    "fallbacks": len(stats.get("fallbacks", [])),
                    "fallback_lines": list(stats.get("fallbacks", []))[:3]})
    print("SHARE_RESULT " + json.dumps(results), flush=True)
    multihost_utils.sync_global_devices("share bench: done")
    jax.distributed.shutdown()


# --- the driver -------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(args, storage: str, extra: list[str], env: dict) -> list[list[dict]]:
    port = free_port()
    base = [sys.executable, os.path.abspath(__file__), "--worker", "--storage", storage,
            "--procs", str(args.procs), "--port", str(port), "--size-mib", str(args.size_mib),
            "--runs", str(args.runs), "--workdir", args.workdir,
            "--layouts", ",".join(args.layouts), "--methods", ",".join(args.methods), *extra]
    procs = []
    for pid in range(args.procs):
        command = base + ["--pid", str(pid)]
        if storage == "file":  # a mount namespace of its own
            command = ["unshare", "-m", "--propagation", "private"] + command
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results, errors = [], []
    for pid, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, err = proc.communicate()
            errors.append(f"process {pid} ran past {args.timeout} s")
        lines = [line for line in out.splitlines() if line.startswith("SHARE_RESULT ")]
        if proc.returncode != 0 or not lines:
            errors.append(f"process {pid} exited {proc.returncode}: {err[-4000:]}")
        else:
            results.append(json.loads(lines[-1][len("SHARE_RESULT "):]))
    if errors:
        raise BenchError(f"{storage}: " + "\n".join(errors))
    return results


def combine(storage: str, per_process: list[list[dict]]) -> list[dict]:
    """One row per (layout, method, run): the slowest process's time; the storage bytes summed
    over the processes' devices (file) or the link's (s3)."""
    rows = []
    for i, first in enumerate(per_process[0]):
        same = [p[i] for p in per_process]
        if storage == "file":
            read = sum(r["storage_bytes"] for r in same)
        else:
            read = max(r["storage_bytes"] for r in same)
        rows.append({"storage": storage, "layout": first["layout"], "method": first["method"],
                     "run": first["run"], "seconds": max(r["seconds"] for r in same),
                     "process_seconds": [r["seconds"] for r in same], "storage_bytes": read,
                     "ts_storage_bytes": [r["ts_storage_bytes"] for r in same],
                     "peer_bytes": [r["peer_bytes"] for r in same],
                     "fallbacks": sum(r["fallbacks"] for r in same),
                     "fallback_lines": [line for r in same for line in r["fallback_lines"]][:4],
                     "shared": all(r["shared"] for r in same)})
    return rows


def summarize(rows: list[dict], state_bytes: int, procs: int) -> list[dict]:
    """Per (storage, layout, method): the median over runs, and the shared restore against
    the unshared one."""
    out = []
    keys = sorted({(r["storage"], r["layout"], r["method"]) for r in rows},
                  key=lambda k: (k[0], LAYOUTS.index(k[1]), METHODS.index(k[2])))
    for key in keys:
        mine = [r for r in rows if (r["storage"], r["layout"], r["method"]) == key]
        seconds = float(np.median([r["seconds"] for r in mine]))
        read = float(np.median([r["storage_bytes"] for r in mine]))
        out.append({"storage": key[0], "layout": key[1], "method": key[2], "seconds": seconds,
                    "storage_bytes": read, "state_bytes": state_bytes,
                    "read_x_state": read / state_bytes, "runs": len(mine),
                    "fallbacks": sum(r["fallbacks"] for r in mine)})
    for s in out:
        alone = [a for a in out if (a["storage"], a["layout"], a["method"]) ==
                 (s["storage"], s["layout"], "alone")]
        if alone:
            s["x_alone"] = s["seconds"] / alone[0]["seconds"]
            # The goal: within 1.3x of a quarter (1/procs) of the unshared time.
            s["x_alone_over_procs"] = s["seconds"] / (alone[0]["seconds"] / procs)
    return out


def print_table(summary: list[dict]) -> None:
    print(f"{'storage':8} {'layout':11} {'method':7} {'time s':>8} {'read':>10} {'x state':>8} "
          f"{'x alone':>8} {'x alone/N':>9}")
    for s in summary:
        print(f"{s['storage']:8} {s['layout']:11} {s['method']:7} {s['seconds']:8.2f} "
              f"{fmt_bytes(s['storage_bytes']):>10} {s['read_x_state']:8.2f} "
              f"{s.get('x_alone', float('nan')):8.2f} {s.get('x_alone_over_procs', float('nan')):9.2f}")


def build_image(args, state: dict[str, np.ndarray]) -> str:
    """The ext4 image holding the tensorstash step (root/ts) and Orbax's checkpoint (orbax)."""
    import tensorstash

    src = os.path.join(args.workdir, "image-src")
    os.makedirs(src)
    chunk = args.chunk_layers * state["w0"][0].nbytes
    tensorstash.save(os.path.join(src, "ts", "0000000001"), state, chunk_bytes=chunk)
    if "orbax" in args.methods:
        from absl import logging as absl_logging
        import orbax.checkpoint as ocp
        absl_logging.set_verbosity(absl_logging.ERROR)
        ckptr = ocp.PyTreeCheckpointer()
        ckptr.save(os.path.join(src, "orbax"), args=ocp.args.PyTreeSave(state))
        ckptr.close()
    used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
    image = os.path.join(args.workdir, "state.ext4")
    size_mib = used * 5 // 4 // (1 << 20) + 64
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", src, image, f"{size_mib}M"], check=True)
    shutil.rmtree(src)
    return image


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--chunk-layers", type=int, default=4)
    parser.add_argument("--s3-mib-per-s", type=float, default=100.0)
    parser.add_argument("--only", choices=("file", "s3"))
    parser.add_argument("--no-orbax", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="64 MiB, one run, S3 at 16 MiB/s: a smoke test")
    parser.add_argument("--workdir")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "share.json"))
    parser.add_argument("--timeout", type=float, default=1800)
    # The workers' own arguments.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--storage", help=argparse.SUPPRESS)
    parser.add_argument("--pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--image", help=argparse.SUPPRESS)
    parser.add_argument("--s3-step", help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--methods", default=",".join(METHODS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.layouts = args.layouts.split(",")
    args.methods = args.methods.split(",")
    if args.worker:
        worker(args)
        return 0

    if args.quick:
        args.size_mib, args.runs, args.s3_mib_per_s = 64, 1, 16.0
    if args.no_orbax:
        args.methods = [m for m in args.methods if m != "orbax"]
    if os.geteuid() != 0:
        raise BenchError("needs root: losetup, mount, unshare and drop_caches")
    own_workdir = args.workdir is None
    args.workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="ts-share-bench-"))
    os.makedirs(args.workdir, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    state = make_state(args.size_mib)
    state_bytes = sum(v.nbytes for v in state.values())
    meta = {"procs": args.procs, "state_bytes": state_bytes, "runs": args.runs,
            "chunk_layers": args.chunk_layers, "layers": LAYERS, "arrays": NUM_ARRAYS,
            "cpus": os.cpu_count(), "s3_mib_per_s": args.s3_mib_per_s,
            "loadavg_start": os.getloadavg()}
    log(f"state: {NUM_ARRAYS} arrays {(LAYERS, state_rows(args.size_mib), COLS)} float32, "
        f"{fmt_bytes(state_bytes)}; {args.procs} processes; workdir {args.workdir}")
    rows: list[dict] = []
    try:
        if args.only in (None, "file"):
            image = build_image(args, state)
            log(f"image {image}: {fmt_bytes(os.path.getsize(image))}")
            per_process = run_job(args, "file", ["--image", image], env)
            rows += combine("file", per_process)
            os.remove(image)
        if args.only in (None, "s3"):
            import s3_servers
            import tensorstash

            srv = s3_servers.start("seaweedfs", os.path.join(args.workdir, "s3"))
            try:
                step = f"s3://{srv.bucket}/share-bench/0000000001"
                s3_env = {**env, **srv.env(), "AWS_ENDPOINT_URL": srv.endpoint}
                saved = os.environ.copy()
                os.environ.update(s3_env)
                try:
                    tensorstash.save(step, state,
                                     chunk_bytes=args.chunk_layers * state["w0"][0].nbytes)
                finally:
                    os.environ.clear()
                    os.environ.update(saved)
                host, port = srv.endpoint.split("//")[1].split(":")
                proxy = CappedProxy((host, int(port)), args.s3_mib_per_s * (1 << 20))
                control = Control(proxy)
                s3_env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.port}"
                s3_args = argparse.Namespace(**vars(args))
                s3_args.methods = [m for m in args.methods if m != "orbax"]
                per_process = run_job(s3_args, "s3", ["--s3-step", step,
                                                      "--control", control.url], s3_env)
                rows += combine("s3", per_process)
                proxy.close()
            finally:
                srv.stop()
    finally:
        if own_workdir:
            shutil.rmtree(args.workdir, ignore_errors=True)
    summary = summarize(rows, state_bytes, args.procs)
    meta["loadavg_end"] = os.getloadavg()
    print_table(summary)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "summary": summary, "runs": rows}, f, indent=1)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        log(f"error: {e}")
        sys.exit(1)
