#!/usr/bin/env python3
"""Start and stop a local GCS emulator and the enforcing proxy in front of it, for tests.

Stdlib only (plus gcp-storage-emulator, run as a program). Everything listens on 127.0.0.1, on
free ports; nothing talks to any other address (the emulator has no telemetry).

  emulator  `gcp-storage-emulator start --in-memory --default-bucket BUCKET`: the GCS JSON API,
            but it ignores preconditions, `generation=` on reads, paging and credentials, and
            serves one request at a time (tests/gcs/gcs_proxy.py says what the proxy adds).
            start(..., on_disk=True) keeps its objects in files instead (WORKDIR/.cloudstorage/
            BUCKET/NAME; Servers.stored_path), for tests that damage stored bytes behind its
            back: the object keeps its generation and recorded checksums.
  proxy     tests/gcs/gcs_proxy.py in front of it, two listeners sharing one lock: an open one
            (TS_GCS_ENDPOINT) and one that needs a bearer token listed in TS_GCS_TOKENS
            (TS_GCS_AUTH_ENDPOINT; tests/gcs/gcs_fakes.py appends the tokens it issues there).
  fakes     tests/gcs/gcs_fakes.py: a token endpoint (TS_GCS_TOKEN_URI) that knows the
            service-account key TS_GCS_SA_KEY and the authorized user TS_GCS_AUTHORIZED_USER
            (both files written in WORKDIR, pointing at it), and a metadata server
            (TS_GCS_METADATA_HOST, host:port). Their counters and settings: GET
            <base>/__fake__/stats and /__fake__/config?expires_in=&delay_s=&silent= on either.

As a module::

    import gcs_servers
    with gcs_servers.start("/tmp/work") as srv:
        srv.endpoint, srv.auth_endpoint, srv.raw_endpoint, srv.bucket, srv.tokens_file
        srv.env()          # what server.env holds

As a command (the servers run detached, in their own sessions, and outlive the command)::

    python tests/gcs/gcs_servers.py start WORKDIR [--bucket NAME]
        waits until all three are ready, writes WORKDIR/server.env and prints it; exits 1 with the
        tail of the logs if they do not become ready
    python tests/gcs/gcs_servers.py stop WORKDIR
        stops them (their process groups); idempotent

server.env holds KEY=VALUE lines: TS_GCS_ENDPOINT, TS_GCS_AUTH_ENDPOINT, TS_GCS_RAW_ENDPOINT,
TS_GCS_BUCKET, TS_GCS_TOKENS, TS_GCS_TOKEN_URI, TS_GCS_METADATA_HOST, TS_GCS_SA_KEY,
TS_GCS_AUTHORIZED_USER, TS_GCS_EMULATOR_PID, TS_GCS_PROXY_PID, TS_GCS_FAKES_PID,
TS_GCS_EMULATOR_LOG, TS_GCS_PROXY_LOG, TS_GCS_FAKES_LOG.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import secrets
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "s3"))
import s3_servers as _s3  # noqa: E402  (ports, process groups, env files: shared with S3)

DEFAULT_BUCKET = "tensorstash-test"
ENV_FILE = "server.env"
START_TIMEOUT_S = 60.0
EMULATOR_MARK = "gcp-storage-emulator"
PROXY_MARK = "gcs_proxy.py"
PROXY_SCRIPT = os.path.join(_HERE, "gcs_proxy.py")
FAKES_MARK = "gcs_fakes.py"
FAKES_SCRIPT = os.path.join(_HERE, "gcs_fakes.py")

# Requests to the servers must never go through an HTTP proxy of the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(method: str, url: str, body: Optional[bytes] = None, headers: Optional[dict] = None,
         timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """One request; (status, headers with lower-case names, body), whatever the status."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


_LIVE: "set[Servers]" = set()


class Servers:
    """The emulator and the proxy. stop() is idempotent; usable as a context manager."""

    def __init__(self, workdir: str, bucket: str):
        self.workdir = workdir
        self.bucket = bucket
        self.raw_endpoint = ""
        self.endpoint = ""
        self.auth_endpoint = ""
        self.tokens_file = os.path.join(workdir, "tokens.txt")
        self.emulator_pid = 0
        self.proxy_pid = 0
        self.fakes_pid = 0
        self.token_uri = ""
        self.metadata_host = ""
        self.sa_key = ""
        self.authorized_user = ""
        self.fakes_log = os.path.join(workdir, "fakes.log")
        self.emulator_log = os.path.join(workdir, "emulator.log")
        self.proxy_log = os.path.join(workdir, "proxy.log")
        self.ready_s: Optional[float] = None
        self.on_disk = False
        self._procs: list[subprocess.Popen] = []

    def stored_path(self, name: str) -> str:
        """The file that holds object `name` of the bucket (on_disk servers only)."""
        if not self.on_disk:
            raise RuntimeError("the emulator keeps its objects in memory (start(on_disk=True))")
        return os.path.join(self.workdir, ".cloudstorage", self.bucket, *name.split("/"))

    def env(self) -> dict[str, str]:
        return {
            "TS_GCS_ENDPOINT": self.endpoint,
            "TS_GCS_AUTH_ENDPOINT": self.auth_endpoint,
            "TS_GCS_RAW_ENDPOINT": self.raw_endpoint,
            "TS_GCS_BUCKET": self.bucket,
            "TS_GCS_TOKENS": self.tokens_file,
            "TS_GCS_TOKEN_URI": self.token_uri,
            "TS_GCS_METADATA_HOST": self.metadata_host,
            "TS_GCS_SA_KEY": self.sa_key,
            "TS_GCS_AUTHORIZED_USER": self.authorized_user,
            "TS_GCS_EMULATOR_PID": str(self.emulator_pid),
            "TS_GCS_PROXY_PID": str(self.proxy_pid),
            "TS_GCS_FAKES_PID": str(self.fakes_pid),
            "TS_GCS_EMULATOR_LOG": self.emulator_log,
            "TS_GCS_PROXY_LOG": self.proxy_log,
            "TS_GCS_FAKES_LOG": self.fakes_log,
        }

    def proxy_control(self, what: str, **params) -> dict:
        """GET /__gcs_proxy__/<what>?params on the proxy (config, stats, reset_stats)."""
        url = f"{self.endpoint}/__gcs_proxy__/{what}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        code, _, body = http("GET", url)
        if code != 200:
            raise RuntimeError(f"{url}: {code} {body[:300]!r}")
        return json.loads(body)

    def fakes_control(self, which: str, **params) -> dict:
        """Stats of the token endpoint (which="token") or the metadata server ("metadata"),
        after setting params (expires_in, delay_s, silent) when given."""
        base = {"token": self.token_uri.rsplit("/", 1)[0],
                "metadata": "http://" + self.metadata_host}[which]
        url = f"{base}/__fake__/config?" + urllib.parse.urlencode(params)
        code, _, body = http("GET", url)
        if code != 200:
            raise RuntimeError(f"{url}: {code} {body[:300]!r}")
        return json.loads(body)

    def stop(self) -> None:
        procs = {p.pid: p for p in self._procs}
        if self.fakes_pid:
            _s3.stop_pid(self.fakes_pid, FAKES_MARK, procs.get(self.fakes_pid))
        if self.proxy_pid:
            _s3.stop_pid(self.proxy_pid, PROXY_MARK, procs.get(self.proxy_pid))
        if self.emulator_pid:
            _s3.stop_pid(self.emulator_pid, EMULATOR_MARK, procs.get(self.emulator_pid))
        _LIVE.discard(self)

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Servers(endpoint={self.endpoint!r}, raw={self.raw_endpoint!r}, bucket={self.bucket!r})"


@atexit.register
def _stop_leftovers() -> None:
    for s in list(_LIVE):
        try:
            s.stop()
        except Exception:  # pragma: no cover
            pass


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GOOGLE_", "STORAGE_", "GCLOUD_", "CLOUDSDK_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env["NO_PROXY"] = env["no_proxy"] = "*"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _spawn(cmd: list[str], log_path: str, cwd: str) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        log.write(("$ " + shlex.join(cmd) + "\n").encode())
        log.flush()
        return subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=_child_env(),
                                start_new_session=True)


def _wait(deadline: float, proc: subprocess.Popen, what: str, fn, interval: float = 0.05):
    last = None
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with status {proc.returncode} while waiting for {what}")
        try:
            return fn()
        except Exception as e:
            last = e
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not ready: {what} still failing: {last!r}")
        time.sleep(interval)


def _start_emulator(srv: Servers, deadline: float, detach: bool) -> subprocess.Popen:
    (port,) = _s3.free_ports(1)
    cmd = [_s3._exe("gcp-storage-emulator"), "start", "--host", "127.0.0.1", "--port", str(port),
           "--default-bucket", srv.bucket]
    if not srv.on_disk:
        cmd.insert(-2, "--in-memory")
    # On disk, it keeps its files under ./.cloudstorage of its working folder (STORAGE_BASE's
    # default, and _child_env drops the STORAGE_ variables).
    proc = _spawn(cmd, srv.emulator_log, srv.workdir)
    srv.emulator_pid = proc.pid
    srv.raw_endpoint = f"http://127.0.0.1:{port}"
    if not detach:
        srv._procs.append(proc)

    def owns_port():
        if not _s3._listening_pids_port(proc.pid, port):
            raise RuntimeError(f"pid {proc.pid} does not listen on 127.0.0.1:{port} (yet)")

    def bucket_exists():
        code, _, body = http("GET", f"{srv.raw_endpoint}/storage/v1/b/{srv.bucket}", timeout=5)
        if code != 200:
            raise RuntimeError(f"GET bucket {srv.bucket}: {code} {body[:200]!r}")

    _wait(deadline, proc, f"a listening socket on port {port}", owns_port)
    _wait(deadline, proc, f"bucket {srv.bucket}", bucket_exists, interval=0.1)
    return proc


def _start_proxy(srv: Servers, deadline: float, detach: bool) -> subprocess.Popen:
    ready = os.path.join(srv.workdir, "proxy.ready")
    if os.path.exists(ready):
        os.unlink(ready)
    open(srv.tokens_file, "w").close()  # a fresh start: no token of an earlier run counts
    cmd = [sys.executable, PROXY_SCRIPT, "--upstream", srv.raw_endpoint,
           "--tokens", srv.tokens_file, "--ready-file", ready]
    proc = _spawn(cmd, srv.proxy_log, srv.workdir)
    srv.proxy_pid = proc.pid
    if not detach:
        srv._procs.append(proc)

    def ports():
        vals = _s3.read_env(ready)
        return int(vals["port"]), int(vals["auth_port"])

    port, auth_port = _wait(deadline, proc, f"{ready}", ports)
    srv.endpoint = f"http://127.0.0.1:{port}"
    srv.auth_endpoint = f"http://127.0.0.1:{auth_port}"
    return proc


def _start_fakes(srv: Servers, deadline: float, detach: bool) -> subprocess.Popen:
    ready = os.path.join(srv.workdir, "fakes.ready")
    if os.path.exists(ready):
        os.unlink(ready)
    cmd = [sys.executable, FAKES_SCRIPT, "--tokens", srv.tokens_file, "--workdir", srv.workdir,
           "--ready-file", ready]
    proc = _spawn(cmd, srv.fakes_log, srv.workdir)
    srv.fakes_pid = proc.pid
    if not detach:
        srv._procs.append(proc)
    vals = _wait(deadline, proc, f"{ready}", lambda: _s3.read_env(ready))
    srv.token_uri = vals["token_uri"]
    srv.metadata_host = vals["metadata_host"]
    srv.sa_key = vals["sa_key"]
    srv.authorized_user = vals["authorized_user"]
    return proc


def no_soft_delete(srv: Servers) -> None:
    """Turn the bucket's soft delete off. The emulator, as GCS, keeps every deleted object for
    the bucket's soft-delete retention (7 days by default), in memory: without this, what tests
    and benchmarks delete piles up in it (a benchmark's gibibytes per run). Raises RuntimeError
    when the emulator does not take the setting."""
    body = json.dumps({"softDeletePolicy": {"retentionDurationSeconds": "0"}}).encode()
    b = urllib.parse.quote(srv.bucket, safe="")
    code, _, answer = http("PATCH", f"{srv.raw_endpoint}/storage/v1/b/{b}", body,
                           {"Content-Type": "application/json"})
    try:
        got = json.loads(answer).get("softDeletePolicy", {}) if code == 200 else {}
    except ValueError:
        got = {}
    if str(got.get("retentionDurationSeconds")) != "0":
        raise RuntimeError(f"could not turn the emulator's soft delete off: {code} "
                           f"{answer[:300]!r}")


def _roundtrip(srv: Servers) -> None:
    """A create-only upload, a read and a delete through the proxy."""
    name = ".ts-ready-probe-" + secrets.token_hex(4)
    probe = b"tensorstash-ready-probe " + secrets.token_hex(8).encode()
    b = urllib.parse.quote(srv.bucket, safe="")
    n = urllib.parse.quote(name, safe="")
    code, _, body = http("POST", f"{srv.endpoint}/upload/storage/v1/b/{b}/o?uploadType=media"
                         f"&name={n}&ifGenerationMatch=0", probe,
                         {"Content-Type": "application/octet-stream"})
    if code != 200:
        raise RuntimeError(f"probe upload: {code} {body[:200]!r}")
    code, _, got = http("GET", f"{srv.endpoint}/storage/v1/b/{b}/o/{n}?alt=media")
    if code != 200 or got != probe:
        raise RuntimeError(f"probe read: {code} {got[:200]!r}")
    code, _, body = http("DELETE", f"{srv.endpoint}/storage/v1/b/{b}/o/{n}")
    if code not in (200, 204):
        raise RuntimeError(f"probe delete: {code} {body[:200]!r}")


def start(workdir: str, bucket: str = DEFAULT_BUCKET, timeout: float = START_TIMEOUT_S,
          attempts: int = 3, detach: bool = False, on_disk: bool = False) -> Servers:
    """Start the emulator (bucket created, its soft delete off), the proxy and the credential fakes with their files
    in workdir; return once a create-only upload, a read and a delete work through the proxy. Raises RuntimeError
    (the log tails also go to stderr) if they are not ready within `timeout` s; a start whose
    emulator dies early (its port taken meanwhile) is retried, `attempts` times in all.
    detach=True: not stopped at interpreter exit (the CLI). on_disk=True: the emulator keeps
    its objects in files under workdir (Servers.stored_path) instead of in memory."""
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    errors = []
    for attempt in range(1, attempts + 1):
        srv = Servers(workdir, bucket)
        srv.on_disk = on_disk
        if not detach:
            _LIVE.add(srv)
        try:
            _start_emulator(srv, deadline, detach)
            no_soft_delete(srv)
            _start_proxy(srv, deadline, detach)
            _start_fakes(srv, deadline, detach)
            _roundtrip(srv)
        except Exception as e:
            srv.stop()
            errors.append(f"attempt {attempt}: {e}\n--- {srv.emulator_log} (tail) ---\n"
                          f"{_s3._tail(srv.emulator_log)}\n--- {srv.proxy_log} (tail) ---\n"
                          f"{_s3._tail(srv.proxy_log)}")
            if attempt < attempts and time.monotonic() < deadline:
                continue
            break
        srv.ready_s = time.monotonic() - t0
        return srv
    msg = f"GCS emulator/proxy did not become ready in {workdir}:\n" + "\n".join(errors)
    print(msg, file=sys.stderr)
    raise RuntimeError(msg)


def stop_from_env(workdir: str) -> str:
    path = os.path.join(os.path.abspath(workdir), ENV_FILE)
    if not os.path.exists(path):
        return f"no {path}: nothing to stop"
    env = _s3.read_env(path)
    out = []
    for key, mark, what in (("TS_GCS_FAKES_PID", FAKES_MARK, "fakes"),
                            ("TS_GCS_PROXY_PID", PROXY_MARK, "proxy"),
                            ("TS_GCS_EMULATOR_PID", EMULATOR_MARK, "emulator")):
        pid = int(env.get(key, "0") or 0)
        if pid <= 0:
            out.append(f"no {key} in {path}")
        elif _s3.stop_pid(pid, mark):
            out.append(f"stopped the {what} (pid {pid})")
        else:
            out.append(f"the {what} (pid {pid}) is not running")
    return "; ".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("start", help="start the emulator and the proxy detached; wait for them")
    p.add_argument("workdir")
    p.add_argument("--bucket", default=DEFAULT_BUCKET)
    p.add_argument("--timeout", type=float, default=START_TIMEOUT_S)
    p = sub.add_parser("stop", help="stop the servers recorded in WORKDIR/server.env")
    p.add_argument("workdir")
    a = ap.parse_args(argv)
    if a.cmd == "start":
        env_path = os.path.join(os.path.abspath(a.workdir), ENV_FILE)
        if os.path.exists(env_path):
            old = _s3.read_env(env_path)
            for key, mark in (("TS_GCS_EMULATOR_PID", EMULATOR_MARK), ("TS_GCS_PROXY_PID", PROXY_MARK),
                              ("TS_GCS_FAKES_PID", FAKES_MARK)):
                pid = int(old.get(key, "0") or 0)
                if pid > 0 and _s3._alive(pid) and mark in _s3._cmdline(pid):
                    print(f"servers are already running from {env_path} (pid {pid}); stop them "
                          "first", file=sys.stderr)
                    return 1
        try:
            srv = start(a.workdir, bucket=a.bucket, timeout=a.timeout, detach=True)
        except RuntimeError:
            return 1
        sys.stdout.write(_s3.write_env(env_path, srv.env()))
        print(f"# ready in {srv.ready_s:.1f} s; env in {env_path}", file=sys.stderr)
        return 0
    print(stop_from_env(a.workdir), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
