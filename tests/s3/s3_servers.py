#!/usr/bin/env python3
"""Start and stop local S3-compatible servers for tests (SeaweedFS, moto, rclone).

Stdlib + botocore only. Every server listens on 127.0.0.1 only, on free ports; nothing talks to
any other address (SeaweedFS telemetry is off; moto and rclone have none).

As a module::

    import s3_servers
    with s3_servers.start("seaweedfs", "/tmp/work") as srv:
        srv.endpoint, srv.access_key, srv.secret_key, srv.region, srv.bucket, srv.pid
        c = srv.client()              # a signed botocore S3 client (path style, no retries)

As a command (the server runs detached, in its own session, and outlives the command)::

    python tests/s3/s3_servers.py start {seaweedfs|moto|rclone} WORKDIR [--bucket NAME]
        waits until the server is ready, writes WORKDIR/server.env and prints it; exits 1 with
        the tail of the server log if it does not become ready
    python tests/s3/s3_servers.py stop WORKDIR
        stops the server named in WORKDIR/server.env (its whole process group); idempotent

server.env holds KEY=VALUE lines: TS_S3_KIND, TS_S3_ENDPOINT, TS_S3_BUCKET, TS_S3_REGION,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_DEFAULT_REGION, TS_S3_PID, TS_S3_LOG.

What each server checks:
  seaweedfs  `weed mini`; signatures are checked: the identity comes from an S3 identity file
             (-s3.config, WORKDIR/s3-identity.json); a wrong secret gets 403
             SignatureDoesNotMatch. Honours If-None-Match and Range.
  moto       `moto_server`; accepts any credentials (no signature check).
  rclone     `rclone serve s3 --auth-key A,S`; signatures are checked (403 on a wrong secret).
             Buckets are the directories under WORKDIR/rclone-root.
"""

from __future__ import annotations

import argparse
import atexit
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

KINDS = ("seaweedfs", "moto", "rclone")
REGION = "us-east-1"
DEFAULT_BUCKET = "tensorstash-test"
ENV_FILE = "server.env"
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
_VENV_BIN = os.path.join(_REPO, ".venv", "bin")

# Keep any HTTP proxy configured in the environment away from our loopback traffic.
for _var in ("NO_PROXY", "no_proxy"):
    _cur = os.environ.get(_var, "")
    if "127.0.0.1" not in _cur.split(","):
        os.environ[_var] = ",".join(p for p in (_cur, "127.0.0.1", "localhost") if p)


def _exe(name: str) -> str:
    """The server binary: the project's venv first, then the venv of this interpreter, then PATH."""
    for d in (_VENV_BIN, os.path.dirname(sys.executable)):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    for d in os.environ.get("PATH", "").split(os.pathsep):
        p = os.path.join(d, name)
        if d and os.access(p, os.X_OK):
            return p
    raise FileNotFoundError(f"{name} not found (looked in {_VENV_BIN} and PATH)")


# The word that must appear in /proc/PID/cmdline for a pid to be one of our servers.
_CMD_MARK = {"seaweedfs": "weed", "moto": "moto_server", "rclone": "rclone"}


# --------------------------------------------------------------------------------------------
# ports, processes


def free_ports(n: int) -> list[int]:
    """n distinct ports that were free on 127.0.0.1 a moment ago (bound to port 0, then closed)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_ports_grpc(n: int, offset: int = 10000) -> list[int]:
    """n distinct ports p, free on 127.0.0.1 a moment ago, with p + offset free too (SeaweedFS
    puts each component's gRPC port at its HTTP port + 10000, and some of its internal clients
    dial that port whatever -X.port.grpc says)."""
    socks, ports = [], []
    try:
        tries = 0
        while len(ports) < n:
            tries += 1
            if tries > 50 * n:
                raise OSError(f"no {n} free port pairs (p, p+{offset}) on 127.0.0.1")
            a = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            a.bind(("127.0.0.1", 0))
            socks.append(a)
            p = a.getsockname()[1]
            if p + offset > 65535:
                continue
            b = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                b.bind(("127.0.0.1", p + offset))
            except OSError:
                b.close()
                continue
            socks.append(b)
            ports.append(p)
        return ports
    finally:
        for s in socks:
            s.close()


def _proc_state(pid: int) -> Optional[str]:
    """The state letter of pid from /proc (None when there is no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return "?"
    return data[data.rfind(")") + 2:].split()[0]


def _alive(pid: int) -> bool:
    st = _proc_state(pid)
    return st is not None and st not in ("Z", "X")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _group_members(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = data[data.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            out.append(int(name))
    return out


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_pid(pid: int, mark: Optional[str] = None, proc: Optional[subprocess.Popen] = None,
             timeout: float = STOP_TIMEOUT_S) -> bool:
    """Stop pid and its process group (pgid == pid: the servers are session leaders): SIGTERM,
    wait up to `timeout` s, then SIGKILL. `mark`, when given, must appear in the process's
    command line (guards against a reused pid). Returns True if something was signalled."""
    leader_ok = _alive(pid) and (mark is None or mark in _cmdline(pid))
    if not leader_ok and _alive(pid):
        return False  # pid reused by an unrelated process: its group cannot be ours either
    members = _group_members(pid)
    if not leader_ok and not members:
        if proc is not None:
            proc.poll()
        return False
    _kill_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()
        if not _alive(pid) and not _group_members(pid):
            break
        time.sleep(0.05)
    else:
        _kill_group(pid, signal.SIGKILL)
    if proc is not None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(pid, signal.SIGKILL)  # leftovers of the group, if any
    return True


def _listening_pids_port(pgid: int, port: int) -> bool:
    """True when a process of group pgid holds a socket listening on 127.0.0.1:port (so that a
    readiness probe never mistakes another program that took the port for our server)."""
    inodes = set()
    for pid in _group_members(pgid) or [pgid]:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    want = f"0100007F:{port:04X}"
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[1] == want and fields[3] == "0A" and fields[9] in inodes:
                    return True
    except OSError:
        return True  # no /proc/net: cannot tell, assume so
    return False


def _tail(path: str, n: int = 60) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(lines[-n:])


# --------------------------------------------------------------------------------------------
# clients


def make_client(endpoint: str, access_key: str, secret_key: str, region: str = REGION,
                max_attempts: int = 1, connect_timeout: float = 3, read_timeout: float = 20,
                **config_kw):
    """A botocore S3 client: SigV4, path-style; max_attempts counts every attempt (1: no retry). Checksums are computed
    only when an operation requires them (the servers differ in what they accept), unless
    config_kw says otherwise."""
    import botocore.session
    from botocore.config import Config

    kw = dict(signature_version="s3v4", s3={"addressing_style": "path"},
              retries={"total_max_attempts": max_attempts, "mode": "standard"},
              connect_timeout=connect_timeout, read_timeout=read_timeout,
              request_checksum_calculation="when_required",
              response_checksum_validation="when_required")
    kw.update(config_kw)
    session = botocore.session.Session()
    return session.create_client("s3", region_name=region, endpoint_url=endpoint,
                                 aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                                 config=Config(**kw))


# --------------------------------------------------------------------------------------------
# servers


_LIVE: "set[Server]" = set()


class Server:
    """A running S3 server. stop() is idempotent; usable as a context manager."""

    def __init__(self, kind: str, workdir: str, endpoint: str, access_key: str, secret_key: str,
                 bucket: str, pid: int, log_path: str, proc: Optional[subprocess.Popen] = None,
                 region: str = REGION):
        self.kind = kind
        self.workdir = workdir
        self.endpoint = endpoint
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.bucket = bucket
        self.pid = pid
        self.log_path = log_path
        self.ready_s: Optional[float] = None
        self._proc = proc

    def client(self, **kw):
        return make_client(self.endpoint, self.access_key, self.secret_key, self.region, **kw)

    def env(self) -> dict[str, str]:
        return {
            "TS_S3_KIND": self.kind,
            "TS_S3_ENDPOINT": self.endpoint,
            "TS_S3_BUCKET": self.bucket,
            "TS_S3_REGION": self.region,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "TS_S3_PID": str(self.pid),
            "TS_S3_LOG": self.log_path,
        }

    def alive(self) -> bool:
        if self._proc is not None:
            self._proc.poll()
        return _alive(self.pid)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        stop_pid(self.pid, _CMD_MARK[self.kind], self._proc, timeout)
        _LIVE.discard(self)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Server({self.kind!r}, endpoint={self.endpoint!r}, bucket={self.bucket!r}, pid={self.pid})"


@atexit.register
def _stop_leftovers() -> None:
    for s in list(_LIVE):
        try:
            s.stop()
        except Exception:  # pragma: no cover
            pass


class _Died(Exception):
    pass


def _child_env(kind: str, workdir: str, access_key: str, secret_key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "RCLONE_", "WEED_", "MOTO_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env["NO_PROXY"] = env["no_proxy"] = "*"
    return env


def _identity_file(workdir: str, access_key: str, secret_key: str) -> str:
    """SeaweedFS's S3 identity file: one identity, these keys, every action. With it every
    request's signature is checked (and an unsigned one refused)."""
    import json
    path = os.path.join(workdir, "s3-identity.json")
    with open(path, "w") as f:
        json.dump({"identities": [{
            "name": "tensorstash-test",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}, f)
    return path


def _command(kind: str, workdir: str, access_key: str, secret_key: str) -> tuple[list[str], str]:
    """The server's command line and its endpoint."""
    if kind == "seaweedfs":
        data = os.path.join(workdir, "data")
        # A retry gets a fresh data dir: weed mini saves its options to data/mini.options and
        # would load the old ports from it.
        if os.path.isdir(data):
            import shutil
            shutil.rmtree(data)
        os.makedirs(data)
        # HTTP ports whose port + 10000 (the gRPC port of each component) is free as well.
        master, volume, filer, s3, webdav, admin = free_ports_grpc(6)
        cmd = [_exe("weed"), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-master.telemetry=false", "-admin.ui=false",
               f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
               f"-s3.port={s3}", f"-webdav.port={webdav}", f"-admin.port={admin}",
               "-s3.port.iceberg=0", "-s3.port.lance=0",
               "-master.volumeSizeLimitMB=64", "-volume.preStopSeconds=0",
               f"-s3.config={_identity_file(workdir, access_key, secret_key)}",
               # Virtual-hosted requests too: <bucket>.localhost:<port> (curl takes any
               # *.localhost name for the loopback address, without asking DNS).
               "-s3.domainName=localhost"]
        # unix sockets default to /tmp/seaweedfs-*-PORT.sock; keep them in workdir when the path fits
        for comp, port in (("filer", filer), ("s3", s3)):
            sock = os.path.join(workdir, f"{comp}-{port}.sock")
            if len(sock) < 100:
                cmd.append(f"-{comp}.localSocket={sock}")
        return cmd, f"http://127.0.0.1:{s3}"
    if kind == "moto":
        (port,) = free_ports(1)
        return [_exe("moto_server"), "-H", "127.0.0.1", "-p", str(port)], f"http://127.0.0.1:{port}"
    if kind == "rclone":
        (port,) = free_ports(1)
        root = os.path.join(workdir, "rclone-root")
        os.makedirs(root, exist_ok=True)
        conf = os.path.join(workdir, "rclone.conf")
        open(conf, "a").close()
        return [_exe("rclone"), "serve", "s3", root, "--addr", f"127.0.0.1:{port}",
                "--auth-key", f"{access_key},{secret_key}",
                "--config", conf, "--cache-dir", os.path.join(workdir, "rclone-cache"),
                "--log-level", "INFO"], f"http://127.0.0.1:{port}"
    raise ValueError(f"unknown server kind {kind!r}; expected one of {KINDS}")


def _retry_until(deadline: float, proc: subprocess.Popen, what: str, fn, interval: float = 0.2):
    last = None
    while True:
        if proc.poll() is not None:
            raise _Died(f"exited with status {proc.returncode} while waiting for {what}")
        try:
            return fn()
        except Exception as e:  # connection refused, 5xx, 403 while the identity loads, ...
            last = e
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not ready: {what} still failing: {last!r}")
        time.sleep(interval)


def _ensure_ready(srv: Server, proc: subprocess.Popen, deadline: float) -> None:
    from botocore.exceptions import ClientError

    port = int(srv.endpoint.rsplit(":", 1)[1])

    def owns_port():
        if not _listening_pids_port(proc.pid, port):
            raise RuntimeError(f"pid {proc.pid} does not listen on 127.0.0.1:{port} (yet)")

    _retry_until(deadline, proc, f"a listening socket on port {port}", owns_port, interval=0.05)
    c = srv.client(connect_timeout=2, read_timeout=10)
    _retry_until(deadline, proc, "ListBuckets", c.list_buckets)

    def create():
        try:
            c.create_bucket(Bucket=srv.bucket)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou",
                                                               "BucketAlreadyExists"):
                raise
        c.head_bucket(Bucket=srv.bucket)

    _retry_until(deadline, proc, f"CreateBucket {srv.bucket}", create)

    probe = b"tensorstash-ready-probe " + secrets.token_bytes(8).hex().encode()
    key = ".ts-ready-probe"

    def roundtrip():
        c.put_object(Bucket=srv.bucket, Key=key, Body=probe)
        got = c.get_object(Bucket=srv.bucket, Key=key)["Body"].read()
        if got != probe:
            raise RuntimeError(f"read back {got!r}")
        c.delete_object(Bucket=srv.bucket, Key=key)

    _retry_until(deadline, proc, "PutObject/GetObject round trip", roundtrip)


def start(kind: str, workdir: str, bucket: str = DEFAULT_BUCKET, timeout: float = START_TIMEOUT_S,
          attempts: int = 3, detach: bool = False, access_key: Optional[str] = None,
          secret_key: Optional[str] = None) -> Server:
    """Start a `kind` server with its files in workdir; return once `bucket` exists and a
    PutObject/GetObject round trip works. The server runs in its own session (process group).
    Raises RuntimeError (with the log tail, also printed to stderr) if it is not ready within
    `timeout` s. A start whose server dies early (a port taken meanwhile) is retried with new
    ports, `attempts` times in all. detach=True: not stopped at interpreter exit (the CLI)."""
    if kind not in KINDS:
        raise ValueError(f"unknown server kind {kind!r}; expected one of {KINDS}")
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    access_key = access_key or "TSTEST" + secrets.token_hex(7).upper()
    secret_key = secret_key or secrets.token_hex(20)
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    errors = []
    for attempt in range(1, attempts + 1):
        cmd, endpoint = _command(kind, workdir, access_key, secret_key)
        log_path = os.path.join(workdir, f"{kind}.log" if attempt == 1 else f"{kind}.{attempt}.log")
        with open(log_path, "wb") as log:
            log.write(("$ " + shlex.join(cmd) + "\n").encode())
            log.flush()
            proc = subprocess.Popen(cmd, cwd=workdir, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT,
                                    env=_child_env(kind, workdir, access_key, secret_key),
                                    start_new_session=True)
        srv = Server(kind, workdir, endpoint, access_key, secret_key, bucket, proc.pid, log_path,
                     proc=None if detach else proc)
        if not detach:
            _LIVE.add(srv)
        try:
            _ensure_ready(srv, proc, deadline)
        except _Died as e:
            stop_pid(proc.pid, None, proc)
            _LIVE.discard(srv)
            errors.append(f"attempt {attempt}: {kind} {e}\n--- {log_path} (tail) ---\n{_tail(log_path)}")
            if attempt < attempts and time.monotonic() < deadline:
                continue
            break
        except BaseException as e:
            stop_pid(proc.pid, None, proc)
            _LIVE.discard(srv)
            errors.append(f"attempt {attempt}: {kind} {e}\n--- {log_path} (tail) ---\n{_tail(log_path)}")
            break
        srv.ready_s = time.monotonic() - t0
        return srv
    msg = f"{kind} server did not become ready in {workdir}:\n" + "\n".join(errors)
    print(msg, file=sys.stderr)
    raise RuntimeError(msg)


# --------------------------------------------------------------------------------------------
# env files (shared with fault_proxy.py)


def write_env(path: str, values: dict[str, str]) -> str:
    text = "".join(f"{k}={v}\n" for k, v in values.items())
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return text


def read_env(path: str) -> dict[str, str]:
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip()
    return out


def stop_from_env(workdir: str) -> str:
    path = os.path.join(os.path.abspath(workdir), ENV_FILE)
    if not os.path.exists(path):
        return f"no {path}: nothing to stop"
    env = read_env(path)
    pid = int(env.get("TS_S3_PID", "0") or 0)
    if pid <= 0:
        return f"no TS_S3_PID in {path}: nothing to stop"
    mark = _CMD_MARK.get(env.get("TS_S3_KIND", ""))
    if stop_pid(pid, mark):
        return f"stopped {env.get('TS_S3_KIND', 'server')} (pid {pid})"
    return f"{env.get('TS_S3_KIND', 'server')} (pid {pid}) is not running"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("start", help="start a server detached and wait until it is ready")
    p.add_argument("kind", choices=KINDS)
    p.add_argument("workdir")
    p.add_argument("--bucket", default=DEFAULT_BUCKET)
    p.add_argument("--timeout", type=float, default=START_TIMEOUT_S)
    p = sub.add_parser("stop", help="stop the server recorded in WORKDIR/server.env")
    p.add_argument("workdir")
    a = ap.parse_args(argv)
    if a.cmd == "start":
        env_path = os.path.join(os.path.abspath(a.workdir), ENV_FILE)
        if os.path.exists(env_path):
            old = read_env(env_path)
            pid = int(old.get("TS_S3_PID", "0") or 0)
            if pid > 0 and _alive(pid) and _CMD_MARK.get(old.get("TS_S3_KIND", ""), "?") in _cmdline(pid):
                print(f"a server is already running from {env_path} (pid {pid}); stop it first",
                      file=sys.stderr)
                return 1
        try:
            srv = start(a.kind, a.workdir, bucket=a.bucket, timeout=a.timeout, detach=True)
        except RuntimeError:
            return 1
        sys.stdout.write(write_env(env_path, srv.env()))
        print(f"# ready in {srv.ready_s:.1f} s; env in {env_path}", file=sys.stderr)
        return 0
    print(stop_from_env(a.workdir), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
