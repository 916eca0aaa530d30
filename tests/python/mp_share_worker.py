"""One process of a shared-reads restore (issue 42; run by test_multiprocess_share.py).

    python mp_share_worker.py --phase restore --step PATH --nproc N --pid I --port P --layout MODE

MODE: "replicated" (every process restores the whole step as NumPy), "reshard" (each process
its own rows of "w" over the job's devices, in blocks that cut the stored chunks unevenly, and
"b" replicated), "corrupt" (replicated; the others receive process 0's chunks with a byte flipped: process 0
publishes, through the coordinator, the address of a proxy in front of its peer server that
flips a byte of every chunk it forwards),
"kill" (replicated; process 1 SIGKILLs itself once its first read has landed), "default"
(replicated, share_reads left at its default: on for an s3:// step). Every process
but a killed one checks its arrays bit for bit, and writes restore()'s stats to
share-<MODE>-<pid>.json in the working folder before leaving the job.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

import mp_worker


class CorruptingProxy:
    """An HTTP server on loopback that forwards each GET to `upstream` (headers included) and
    answers with what came back, one byte of every 200 answer flipped."""

    def __init__(self, upstream: str) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server name
                request = urllib.request.Request(upstream + self.path, headers={
                    k: v for k, v in self.headers.items() if k.lower().startswith("x-")})
                try:
                    with urllib.request.urlopen(request, timeout=30) as answer:
                        status, body = answer.status, bytearray(answer.read())
                except urllib.error.HTTPError as e:
                    status, body = e.code, bytearray(e.read())
                if status == 200 and body:
                    body[len(body) // 2] ^= 0x5A
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(bytes(body))

            def log_message(self, *a):  # quiet
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class CorruptingCoordinator:
    """The job's coordinator, but the peer address this process publishes for a shared restore
    ("<url> <secret>" under ".../peer/<pid>") is a CorruptingProxy's in front of the real one."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.proxies: list[CorruptingProxy] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def key_value_set(self, key: str, value: str) -> None:
        if key.endswith(f"/peer/{self.inner.process_index()}"):
            url, secret = value.split(" ", 1)
            self.proxies.append(CorruptingProxy(url))
            value = f"{self.proxies[-1].url} {secret}"
        self.inner.key_value_set(key, value)


def run(args) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import tensorstash
    import tensorstash.jax
    from tensorstash import _options
    from tshelpers import assert_same_array, pattern

    values = {"w": pattern((16, 24), np.float32, seed=1), "b": pattern((10, 6), np.int32, seed=2)}
    # Short, so that a dead process costs seconds (the default is half an hour).
    mode = args.layout
    _options.COORDINATION_TIMEOUT_S = 4.0 if mode == "kill" else 8.0
    extra = {}
    if mode == "corrupt" and args.pid == 0:
        extra["coordinator"] = CorruptingCoordinator(tensorstash.jax.default_coordinator())
    progress = None
    if mode == "kill" and args.pid == 1:
        def progress(done, total):  # noqa: ARG001 - the first call: a read has landed
            os.kill(os.getpid(), signal.SIGKILL)
    stats: dict = {}
    if mode == "reshard":
        mesh = Mesh(np.array(jax.devices()), ("x",))
        target = {"w": jax.ShapeDtypeStruct((16, 24), np.float32,
                                            sharding=NamedSharding(mesh, P("x", None))),
                  "b": jax.ShapeDtypeStruct((10, 6), np.int32, sharding=NamedSharding(mesh, P()))}
        got = tensorstash.restore(args.step, target=target, share_reads=True, stats=stats)
        for k, a in got.items():
            for s in a.addressable_shards:
                assert_same_array(np.asarray(s.data), values[k][s.index], f"{k} {s.index}")
    else:
        share = {} if mode == "default" else {"share_reads": True}
        got = tensorstash.restore(args.step, stats=stats, progress=progress, **share, **extra)
        for k in values:
            assert_same_array(got[k], values[k], k)
    assert stats["shared"], stats
    with open(f"share-{mode}-{args.pid}.json", "w") as f:
        json.dump(stats, f)
    print(f"process {args.pid}: {json.dumps(stats)}", flush=True)
    if mode == "kill":
        # Not jax.distributed.shutdown: it would wait for the dead process. Process 0 hosts
        # JAX's coordination service, whose end makes JAX kill the processes still in the job:
        # it leaves only once the other survivors have written their stats (or a deadline).
        if args.pid == 0:
            others = [f"share-{mode}-{p}.json" for p in range(2, args.nproc)]
            deadline = time.monotonic() + 60
            while not all(os.path.exists(f) for f in others) and time.monotonic() < deadline:
                time.sleep(0.05)
        sys.stdout.flush()
        os._exit(0)


def main() -> int:
    args = mp_worker.parse_args()
    return mp_worker.run_in_job(args, run, distributed=True)


if __name__ == "__main__":
    sys.exit(main())
