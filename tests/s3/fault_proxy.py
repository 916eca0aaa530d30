#!/usr/bin/env python3
"""A fault-injecting HTTP reverse proxy to put in front of a local S3 server (stdlib only).

Listens on 127.0.0.1 (a free port unless given), one thread per connection, and answers every
response with `Connection: close` (no keep-alive towards the client). Each request is either

  * answered 503 SlowDown (S3 XML error body) WITHOUT being forwarded, with probability p_503
    (the request body is read and discarded first);
  * forwarded, after which the client connection is cut mid-response: the status line, the
    headers and about half of the body are sent (half of the header block when the body is
    empty), then the socket is closed with SO_LINGER 0 so that the client sees a TCP reset -
    with probability p_reset (the upstream server HAS handled the request: a PUT took effect);
  * forwarded faithfully otherwise.

Forwarding is verbatim: method, request target (path + query), every header in order with
its case (Host, Authorization, Expect, ... unchanged), the body streamed (Content-Length or raw
chunked framing). Clients therefore sign for the proxy's host:port; the server verifies the
signature over the Host header as sent (SeaweedFS, rclone and moto all accept that). The
response (status, headers, body) is streamed back; a chunked upstream body is re-chunked.

Decisions come from random.Random(seed) (one draw per request, in arrival order).

Control paths (never faulted, never forwarded; S3 bucket names cannot contain '_'):
  GET /__fault_proxy__/stats                           -> JSON counters and probabilities
  GET /__fault_proxy__/config?p_503=0.5&p_reset=0      -> set probabilities, returns stats

Module use::

    with FaultProxy("http://127.0.0.1:8333", p_503=0.1, p_reset=0.02, seed=0) as fp:
        fp.endpoint        # "http://127.0.0.1:PORT"; sign requests for this endpoint
        fp.requests, fp.served, fp.injected_503, fp.injected_resets, fp.upstream_errors

Command line (the proxy runs detached, in its own session, and outlives the command)::

    python tests/s3/fault_proxy.py start TARGET WORKDIR [--p-503 0.1] [--p-reset 0.02] [--seed 0] [--port 0]
        TARGET: the server's endpoint URL, or a server.env written by s3_servers.py (its
        TS_S3_ENDPOINT); writes WORKDIR/proxy.env (TS_S3_PROXY_ENDPOINT, TS_S3_PROXY_PID,
        TS_S3_PROXY_TARGET, TS_S3_PROXY_LOG) and prints it
    python tests/s3/fault_proxy.py stop WORKDIR
        stops it (idempotent); its final counters are in WORKDIR/proxy.stats.json
    python tests/s3/fault_proxy.py serve TARGET [...]   (foreground; what `start` runs)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
CONTROL_PREFIX = "/__fault_proxy__/"
ENV_FILE = "proxy.env"
STATS_FILE = "proxy.stats.json"
_PIECE = 64 * 1024

_SLOWDOWN = ('<?xml version="1.0" encoding="UTF-8"?>\n'
             "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
             "<Resource>{resource}</Resource><RequestId>{rid}</RequestId></Error>")


class _ClientGone(Exception):
    pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # so that Expect: 100-continue is answered (with 100) here
    timeout = 300  # seconds of client silence before the connection is dropped
    server_version = "tensorstash-fault-proxy"

    # ---- plumbing -------------------------------------------------------------------------

    @property
    def proxy(self) -> "FaultProxy":
        return self.server.fault_proxy  # type: ignore[attr-defined]

    def log_message(self, fmt, *args):  # noqa: D401 - quiet unless asked
        if self.proxy.verbose:
            sys.stderr.write("fault_proxy: %s - %s\n" % (self.address_string(), fmt % args))

    def _request_body(self):
        """Yield the request body as it arrives: Content-Length bytes, or the raw chunked framing
        (size lines, data, trailers) byte for byte."""
        te = self.headers.get("Transfer-Encoding", "")
        if "chunked" in te.lower():
            while True:
                line = self.rfile.readline(65537)
                if not line:
                    raise _ClientGone("client closed inside a chunked body")
                yield line
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers, then the empty line
                        t = self.rfile.readline(65537)
                        if not t:
                            raise _ClientGone("client closed inside chunked trailers")
                        yield t
                        if t in (b"\r\n", b"\n"):
                            return
                left = size + 2  # data + CRLF
                while left:
                    piece = self.rfile.read(min(left, _PIECE))
                    if not piece:
                        raise _ClientGone("client closed inside a chunk")
                    left -= len(piece)
                    yield piece
        n = int(self.headers.get("Content-Length", "0") or 0)
        while n > 0:
            piece = self.rfile.read(min(n, _PIECE))
            if not piece:
                raise _ClientGone("client closed inside the body")
            n -= len(piece)
            with self.proxy._lock:
                self.proxy.request_bytes += len(piece)
            yield piece

    def _send_raw(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
        except OSError as e:
            raise _ClientGone(str(e)) from e

    def _reset(self) -> None:
        """Close the client socket with SO_LINGER 0: the client gets a TCP RST."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        try:
            self.rfile.close()  # drop makefile()'s reference so that close() really closes
        except OSError:
            pass
        try:
            self.connection.close()
        except OSError:
            pass

    def finish(self):
        try:
            super().finish()
        except OSError:
            pass

    @staticmethod
    def _head(status: int, reason: str, headers) -> bytes:
        lines = [f"HTTP/1.1 {status} {reason}"]
        lines += [f"{k}: {v}" for k, v in headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    # ---- requests --------------------------------------------------------------------------

    def _dispatch(self):
        self.close_connection = True
        if self.path.startswith(CONTROL_PREFIX):
            return self._control()
        p = self.proxy
        with p._lock:
            p.seen.append((self.command, self.path))
        action = p._decide()
        try:
            if action == "503":
                return self._slowdown()
            return self._forward(reset=(action == "reset"))
        except (_ClientGone, OSError):  # the client went away (or timed out): nothing to answer
            self.close_connection = True
            return

    def _control(self):
        url = urllib.parse.urlsplit(self.path)
        name = url.path[len(CONTROL_PREFIX):]
        p = self.proxy
        if name == "config":
            q = urllib.parse.parse_qs(url.query)
            try:
                p.set_probabilities(float(q["p_503"][0]) if "p_503" in q else None,
                                    float(q["p_reset"][0]) if "p_reset" in q else None)
            except ValueError as e:
                body = json.dumps({"error": str(e)}).encode()
                self._send_raw(self._head(400, "Bad Request", [("Content-Type", "application/json"),
                               ("Content-Length", len(body)), ("Connection", "close")]) + body)
                return
        elif name != "stats":
            self._send_raw(self._head(404, "Not Found", [("Content-Length", 0), ("Connection", "close")]))
            return
        for _ in self._request_body():
            pass
        body = json.dumps(p.stats()).encode()
        self._send_raw(self._head(200, "OK", [("Content-Type", "application/json"),
                                              ("Content-Length", len(body)),
                                              ("Connection", "close")]) + body)

    def _slowdown(self):
        for _ in self._request_body():  # read it so that closing does not reset the client
            pass
        p = self.proxy
        with p._lock:
            p.injected_503 += 1
            rid = f"FAULTPROXY{p.requests:08d}"
        resource = urllib.parse.urlsplit(self.path).path
        body = _SLOWDOWN.format(resource=resource.replace("&", "&amp;").replace("<", "&lt;"),
                                rid=rid).encode()
        headers = [("Content-Type", "application/xml"), ("Content-Length", len(body)),
                   ("x-amz-request-id", rid), ("Date", self.date_time_string()),
                   ("Server", self.server_version), ("Connection", "close")]
        self._send_raw(self._head(503, "Slow Down", headers) + (b"" if self.command == "HEAD" else body))
        self.log_request(503)

    def _bad_gateway(self, err: Exception):
        p = self.proxy
        with p._lock:
            p.upstream_errors += 1
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>BadGateway</Code>'
                f"<Message>fault proxy: upstream failed: {type(err).__name__}</Message></Error>").encode()
        self._send_raw(self._head(502, "Bad Gateway", [("Content-Type", "application/xml"),
                       ("Content-Length", len(body)), ("Connection", "close")])
                       + (b"" if self.command == "HEAD" else body))
        self.log_request(502)

    def _forward(self, reset: bool):
        p = self.proxy
        up = http.client.HTTPConnection(p._target_host, p._target_port, timeout=p.upstream_timeout)
        try:
            try:
                up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    up.putheader(k, v)
                up.endheaders()
            except OSError as e:
                for _ in self._request_body():
                    pass
                return self._bad_gateway(e)
            send_err = None
            for piece in self._request_body():  # _ClientGone propagates: nothing to answer
                if send_err is None:
                    try:
                        up.send(piece)
                    except OSError as e:  # upstream answered early and closed; read its answer
                        send_err = e
            try:
                resp = up.getresponse()
            except (OSError, http.client.HTTPException) as e:
                return self._bad_gateway(send_err or e)

            chunked = resp.chunked
            headers = [(k, v) for k, v in resp.getheaders()
                       if k.lower() not in ("connection", "keep-alive", "transfer-encoding")]
            if chunked:
                headers.append(("Transfer-Encoding", "chunked"))
            headers.append(("Connection", "close"))
            head = self._head(resp.status, resp.reason, headers)
            length = resp.length  # None when chunked / until close; 0 for HEAD, 204, 304
            has_body = self.command != "HEAD" and resp.status not in (204, 304) and length != 0

            if reset:
                with p._lock:
                    p.injected_resets += 1
                if not has_body:
                    self._send_raw(head[: len(head) // 2])
                    return self._reset()
                self._send_raw(head)
                budget = (length // 2) if length is not None else _PIECE // 2
                while budget > 0:
                    piece = resp.read(min(budget, _PIECE))
                    if not piece:
                        break
                    budget -= len(piece)
                    self._send_raw(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                self.log_request(resp.status)
                return self._reset()

            with p._lock:  # counted before the client can see the answer
                p.served += 1
            self._send_raw(head)
            if has_body:
                while True:
                    try:
                        piece = resp.read1(_PIECE) if not chunked else resp.read(_PIECE)
                    except (OSError, http.client.HTTPException):
                        return self._reset()  # upstream broke mid-body: pass the breakage on
                    if not piece:
                        break
                    self._send_raw(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                if chunked:
                    self._send_raw(b"0\r\n\r\n")
            self.log_request(resp.status)
        finally:
            up.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = _dispatch


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    allow_reuse_address = False


class FaultProxy:
    """See the module docstring. start() binds 127.0.0.1:port (0: a free one) and serves in a
    background thread; stop() shuts it down. Counters (all updated before the client sees the
    answer): requests (all non-control requests), served (forwarded, upstream answered, no fault
    injected), injected_503, injected_resets, upstream_errors (502 sent), request_bytes (the
    Content-Length framed request bodies received); seen_requests() lists
    the (method, path) of every non-control request, in arrival order."""

    def __init__(self, target_endpoint: str, p_503: float = 0.10, p_reset: float = 0.02,
                 seed: int = 0, port: int = 0, verbose: bool = False,
                 upstream_timeout: float = 300.0):
        u = urllib.parse.urlsplit(target_endpoint)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"target must be an http:// endpoint, got {target_endpoint!r}")
        self.target = target_endpoint.rstrip("/")
        self._target_host = u.hostname
        self._target_port = u.port or 80
        self._port = port
        self.verbose = verbose
        self.upstream_timeout = upstream_timeout
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.seed = seed
        self.p_503 = 0.0
        self.p_reset = 0.0
        self.set_probabilities(p_503, p_reset)
        self.requests = self.served = self.injected_503 = self.injected_resets = 0
        self.upstream_errors = 0
        self.request_bytes = 0  # request bodies received (Content-Length framed)
        self.seen: list[tuple[str, str]] = []  # (method, path) of each non-control request
        self._httpd: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    def set_probabilities(self, p_503: Optional[float] = None, p_reset: Optional[float] = None):
        a = self.p_503 if p_503 is None else float(p_503)
        b = self.p_reset if p_reset is None else float(p_reset)
        if not (0 <= a <= 1 and 0 <= b <= 1 and a + b <= 1 + 1e-12):
            raise ValueError(f"bad probabilities p_503={a} p_reset={b}")
        with self._lock:
            self.p_503, self.p_reset = a, b

    def _decide(self) -> str:
        with self._lock:
            self.requests += 1
            r = self._rng.random()
            if r < self.p_503:
                return "503"
            if r < self.p_503 + self.p_reset:
                return "reset"
            return "forward"

    def stats(self) -> dict:
        with self._lock:
            return {"endpoint": self.endpoint if self._httpd else None, "target": self.target,
                    "seed": self.seed, "p_503": self.p_503, "p_reset": self.p_reset,
                    "requests": self.requests, "served": self.served,
                    "injected_503": self.injected_503, "injected_resets": self.injected_resets,
                    "upstream_errors": self.upstream_errors, "request_bytes": self.request_bytes}

    def seen_requests(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.seen)

    @property
    def port(self) -> int:
        assert self._httpd is not None, "not started"
        return self._httpd.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FaultProxy":
        if self._httpd is None:
            self._httpd = _Server(("127.0.0.1", self._port), _Handler)
            self._httpd.fault_proxy = self  # type: ignore[attr-defined]
            self._thread = threading.Thread(target=self._httpd.serve_forever,
                                            kwargs={"poll_interval": 0.1},
                                            name="fault-proxy", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None and self._thread is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# command line


def _target_of(arg: str) -> str:
    if os.path.isfile(arg):
        sys.path.insert(0, _HERE)
        from s3_servers import read_env
        return read_env(arg)["TS_S3_ENDPOINT"]
    return arg


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("start", "serve"):
        p = sub.add_parser(name)
        p.add_argument("target", help="http://127.0.0.1:PORT of the S3 server, or its server.env")
        if name == "start":
            p.add_argument("workdir")
        p.add_argument("--p-503", type=float, default=0.10)
        p.add_argument("--p-reset", type=float, default=0.02)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--port", type=int, default=0)
        p.add_argument("--verbose", action="store_true")
        if name == "serve":
            p.add_argument("--ready-file", help="write the proxy's stats JSON here once listening")
            p.add_argument("--stats-file", help="write the final stats JSON here on exit")
    p = sub.add_parser("stop")
    p.add_argument("workdir")
    a = ap.parse_args(argv)

    sys.path.insert(0, _HERE)
    import s3_servers as S

    if a.cmd == "serve":
        fp = FaultProxy(_target_of(a.target), a.p_503, a.p_reset, a.seed, a.port, a.verbose)

        def on_term(*_):
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, on_term)
        httpd = _Server(("127.0.0.1", a.port), _Handler)
        httpd.fault_proxy = fp  # type: ignore[attr-defined]
        fp._httpd = httpd
        if a.ready_file:
            S.write_env(a.ready_file, {"TS_S3_PROXY_ENDPOINT": fp.endpoint})
        print(f"fault_proxy: {fp.endpoint} -> {fp.target} p_503={fp.p_503} p_reset={fp.p_reset} "
              f"seed={fp.seed}", file=sys.stderr, flush=True)
        try:
            httpd.serve_forever(poll_interval=0.1)
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            httpd.server_close()
            st = fp.stats()
            print(f"fault_proxy: exiting: {json.dumps(st)}", file=sys.stderr, flush=True)
            if a.stats_file:
                with open(a.stats_file, "w") as f:
                    json.dump(st, f)
        return 0

    if a.cmd == "start":
        workdir = os.path.abspath(a.workdir)
        os.makedirs(workdir, exist_ok=True)
        env_path = os.path.join(workdir, ENV_FILE)
        if os.path.exists(env_path):
            old = S.read_env(env_path)
            pid = int(old.get("TS_S3_PROXY_PID", "0") or 0)
            if pid > 0 and S._alive(pid) and "fault_proxy" in S._cmdline(pid):
                print(f"a proxy is already running from {env_path} (pid {pid}); stop it first",
                      file=sys.stderr)
                return 1
        target = _target_of(a.target)
        ready = os.path.join(workdir, "proxy.ready")
        log_path = os.path.join(workdir, "proxy.log")
        if os.path.exists(ready):
            os.unlink(ready)
        cmd = [sys.executable, os.path.abspath(__file__), "serve", target,
               "--p-503", repr(a.p_503), "--p-reset", repr(a.p_reset), "--seed", str(a.seed),
               "--port", str(a.port), "--ready-file", ready,
               "--stats-file", os.path.join(workdir, STATS_FILE)] + (["--verbose"] if a.verbose else [])
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=workdir, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                S.stop_pid(proc.pid, None, proc)
                print(f"fault proxy did not start:\n{S._tail(log_path)}", file=sys.stderr)
                return 1
            time.sleep(0.05)
        endpoint = S.read_env(ready)["TS_S3_PROXY_ENDPOINT"]
        text = S.write_env(env_path, {"TS_S3_PROXY_ENDPOINT": endpoint,
                                      "TS_S3_PROXY_TARGET": target,
                                      "TS_S3_PROXY_PID": str(proc.pid),
                                      "TS_S3_PROXY_LOG": log_path})
        sys.stdout.write(text)
        return 0

    env_path = os.path.join(os.path.abspath(a.workdir), ENV_FILE)
    if not os.path.exists(env_path):
        print(f"no {env_path}: nothing to stop", file=sys.stderr)
        return 0
    pid = int(S.read_env(env_path).get("TS_S3_PROXY_PID", "0") or 0)
    if pid > 0 and S.stop_pid(pid, "fault_proxy"):
        print(f"stopped fault proxy (pid {pid})", file=sys.stderr)
    else:
        print(f"fault proxy (pid {pid}) is not running", file=sys.stderr)
    stats = os.path.join(os.path.abspath(a.workdir), STATS_FILE)
    if os.path.exists(stats):
        with open(stats) as f:
            print(f.read().strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
