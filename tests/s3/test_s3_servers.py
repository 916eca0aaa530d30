"""Proves the local S3 test fixtures (s3_servers.py, fault_proxy.py) work, and pins down how
each server behaves where S3 implementations differ (signatures, conditional PUT, ranged GET).

    cd /work/main && .venv/bin/python -m pytest tests/s3/test_s3_servers.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from botocore.exceptions import ClientError, ConnectionClosedError, ResponseStreamingError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fault_proxy  # noqa: E402
import s3_servers  # noqa: E402

KINDS = s3_servers.KINDS
DATA = bytes(range(256)) * 64  # 16 KiB


@pytest.fixture(scope="module", params=KINDS)
def server(request, tmp_path_factory):
    kind = request.param
    t0 = time.monotonic()
    srv = s3_servers.start(kind, str(tmp_path_factory.mktemp(kind)))
    try:
        print(f"\n{kind}: ready in {time.monotonic() - t0:.2f} s at {srv.endpoint}")
        yield srv
    finally:
        t0 = time.monotonic()
        srv.stop()
        print(f"\n{kind}: stopped in {time.monotonic() - t0:.2f} s")
    assert not srv.alive()


@pytest.fixture(scope="module")
def seaweedfs(tmp_path_factory):
    with s3_servers.start("seaweedfs", str(tmp_path_factory.mktemp("seaweedfs-proxied"))) as srv:
        yield srv


def _status(fn):
    try:
        r = fn()
    except ClientError as e:
        return e.response["ResponseMetadata"]["HTTPStatusCode"], e.response
    return r["ResponseMetadata"]["HTTPStatusCode"], r


def test_put_get_roundtrip(server):
    c = server.client()
    assert server.endpoint.startswith("http://127.0.0.1:")
    assert server.region == "us-east-1"
    c.put_object(Bucket=server.bucket, Key="dir/obj", Body=DATA)
    assert c.get_object(Bucket=server.bucket, Key="dir/obj")["Body"].read() == DATA
    assert c.head_object(Bucket=server.bucket, Key="dir/obj")["ContentLength"] == len(DATA)
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=server.bucket, Prefix="dir/")["Contents"]]
    assert keys == ["dir/obj"]
    code, _ = _status(lambda: c.get_object(Bucket=server.bucket, Key="dir/missing"))
    assert code == 404


def test_wrong_secret(server):
    bad = s3_servers.make_client(server.endpoint, server.access_key, server.secret_key + "x")
    code, resp = _status(bad.list_buckets)
    if server.kind == "moto":
        assert code == 200  # moto checks no signature at all
    else:
        assert code == 403 and resp["Error"]["Code"] == "SignatureDoesNotMatch", resp
        code, _ = _status(lambda: bad.put_object(Bucket=server.bucket, Key="evil", Body=b"x"))
        assert code == 403
        code, _ = _status(lambda: server.client().head_object(Bucket=server.bucket, Key="evil"))
        assert code == 404


def test_put_if_none_match(server):
    c = server.client()
    b = server.bucket
    c.put_object(Bucket=b, Key="inm", Body=b"first")
    code, resp = _status(lambda: c.put_object(Bucket=b, Key="inm", Body=b"second", IfNoneMatch="*"))
    got = c.get_object(Bucket=b, Key="inm")["Body"].read()
    if server.kind == "rclone":
        # rclone serve s3 (1.75.2) ignores If-None-Match on PUT: it overwrites and answers 200.
        assert code == 200 and got == b"second"
    else:
        assert code == 412 and resp["Error"]["Code"] == "PreconditionFailed", resp
        assert got == b"first"
    code, _ = _status(lambda: c.put_object(Bucket=b, Key="inm-new", Body=b"x", IfNoneMatch="*"))
    assert code == 200


def test_ranged_get(server):
    c = server.client()
    c.put_object(Bucket=server.bucket, Key="ranged", Body=DATA)
    r = c.get_object(Bucket=server.bucket, Key="ranged", Range="bytes=100-299")
    body = r["Body"].read()
    # Every server sends only the requested bytes with Content-Range ...
    assert body == DATA[100:300]
    assert r["ContentRange"] == f"bytes 100-299/{len(DATA)}"
    if server.kind == "rclone":
        # ... but rclone serve s3 (1.75.2) answers 200 instead of 206 (the body IS the range,
        # not the whole object; a client must trust Content-Range, not the status).
        assert r["ResponseMetadata"]["HTTPStatusCode"] == 200
    else:
        assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
    r = c.get_object(Bucket=server.bucket, Key="ranged", Range=f"bytes={len(DATA) - 10}-")
    assert r["Body"].read() == DATA[-10:]
    code, _ = _status(lambda: c.get_object(Bucket=server.bucket, Key="ranged",
                                           Range=f"bytes={len(DATA) + 5}-{len(DATA) + 9}"))
    assert code == 416


# ------------------------------------------------------------------------------------------
# fault proxy (in front of SeaweedFS, which checks signatures: the client signs for the
# proxy's host:port and the proxy passes the Host header through unchanged)


def _proxied_client(srv, fp, **kw):
    return s3_servers.make_client(fp.endpoint, srv.access_key, srv.secret_key, **kw)


def test_proxy_passthrough(seaweedfs):
    with fault_proxy.FaultProxy(seaweedfs.endpoint, p_503=0.0, p_reset=0.0) as fp:
        assert fp.endpoint.startswith("http://127.0.0.1:") and fp.endpoint != seaweedfs.endpoint
        c = _proxied_client(seaweedfs, fp)
        big = os.urandom(3 * 1024 * 1024 + 1)
        c.put_object(Bucket=seaweedfs.bucket, Key="via-proxy", Body=big)
        assert c.get_object(Bucket=seaweedfs.bucket, Key="via-proxy")["Body"].read() == big
        r = c.get_object(Bucket=seaweedfs.bucket, Key="via-proxy", Range="bytes=10-19")
        assert r["ResponseMetadata"]["HTTPStatusCode"] == 206 and r["Body"].read() == big[10:20]
        bad = s3_servers.make_client(fp.endpoint, seaweedfs.access_key, "wrong-secret")
        code, _ = _status(bad.list_buckets)
        assert code == 403  # signatures are still checked through the proxy
        assert fp.injected_503 == 0 and fp.injected_resets == 0
        assert fp.served == fp.requests == 4


def test_proxy_always_503(seaweedfs):
    with fault_proxy.FaultProxy(seaweedfs.endpoint, p_503=1.0, p_reset=0.0, seed=1) as fp:
        c = _proxied_client(seaweedfs, fp)
        b = seaweedfs.bucket
        ops = [c.list_buckets,
               lambda: c.put_object(Bucket=b, Key="never", Body=b"x" * 100000),
               lambda: c.get_object(Bucket=b, Key="never"),
               lambda: c.head_object(Bucket=b, Key="never")]
        for op in ops:
            code, resp = _status(op)
            assert code == 503, resp
        code, resp = _status(lambda: c.get_object(Bucket=b, Key="x"))
        assert resp["Error"]["Code"] == "SlowDown"
        assert fp.injected_503 == fp.requests == 5 and fp.served == 0
    code, _ = _status(lambda: seaweedfs.client().head_object(Bucket=b, Key="never"))
    assert code == 404  # nothing was forwarded


def test_proxy_reset(seaweedfs):
    with fault_proxy.FaultProxy(seaweedfs.endpoint, p_503=0.0, p_reset=0.0) as fp:
        c = _proxied_client(seaweedfs, fp)
        b = seaweedfs.bucket
        c.put_object(Bucket=b, Key="reset-me", Body=DATA)
        fp.set_probabilities(p_reset=1.0)
        with pytest.raises((ResponseStreamingError, ConnectionClosedError)):
            c.get_object(Bucket=b, Key="reset-me")["Body"].read()
        with pytest.raises(ConnectionClosedError):
            c.put_object(Bucket=b, Key="reset-put", Body=b"applied anyway")
        assert fp.injected_resets == 2
    # the reset PUT reached the server
    assert seaweedfs.client().get_object(Bucket=b, Key="reset-put")["Body"].read() == b"applied anyway"


def test_proxy_seeded_mix(seaweedfs):
    def run(seed):
        with fault_proxy.FaultProxy(seaweedfs.endpoint, p_503=0.3, p_reset=0.0, seed=seed) as fp:
            c = _proxied_client(seaweedfs, fp)
            return [_status(c.list_buckets)[0] for _ in range(20)]

    a = run(7)
    assert a == run(7) and set(a) == {200, 503}


# ------------------------------------------------------------------------------------------
# command lines (detached servers)


def _cli(script, *args):
    return subprocess.run([sys.executable, os.path.join(HERE, script), *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_start_stop(tmp_path):
    wd = str(tmp_path)
    r = _cli("s3_servers.py", "start", "rclone", wd)
    assert r.returncode == 0, r.stderr
    env = s3_servers.read_env(os.path.join(wd, "server.env"))
    assert r.stdout == open(os.path.join(wd, "server.env")).read()
    pid = int(env["TS_S3_PID"])
    try:
        assert s3_servers._alive(pid) and os.getpgid(pid) == pid  # its own process group
        assert env["AWS_REGION"] == "us-east-1" and env["TS_S3_BUCKET"]
        c = s3_servers.make_client(env["TS_S3_ENDPOINT"], env["AWS_ACCESS_KEY_ID"],
                                   env["AWS_SECRET_ACCESS_KEY"])
        c.put_object(Bucket=env["TS_S3_BUCKET"], Key="cli", Body=b"cli")

        r = _cli("fault_proxy.py", "start", os.path.join(wd, "server.env"), wd,
                 "--p-503", "0", "--p-reset", "0")
        assert r.returncode == 0, r.stderr
        penv = s3_servers.read_env(os.path.join(wd, "proxy.env"))
        pc = s3_servers.make_client(penv["TS_S3_PROXY_ENDPOINT"], env["AWS_ACCESS_KEY_ID"],
                                    env["AWS_SECRET_ACCESS_KEY"])
        assert pc.get_object(Bucket=env["TS_S3_BUCKET"], Key="cli")["Body"].read() == b"cli"
        for _ in range(2):  # idempotent
            r = _cli("fault_proxy.py", "stop", wd)
            assert r.returncode == 0, r.stderr
        assert not s3_servers._alive(int(penv["TS_S3_PROXY_PID"]))
        assert '"served": 1' in r.stdout
    finally:
        for _ in range(2):  # idempotent
            r = _cli("s3_servers.py", "stop", wd)
            assert r.returncode == 0, r.stderr
    assert not s3_servers._alive(pid)
