"""Object storage used the way a careless user or a hostile server would (issue 36 item 10):
each test is named after the behaviour it guarantees and failed before the fix it guards.
Tests check behaviour, never timings; every server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

import tensorstash
from s3_fixtures import S3, aws_vars, s3, server  # noqa: F401 - the fixtures; puts tests/s3 on sys.path
from tshelpers import assert_same_tree, pattern

import s3_servers  # tests/s3, on sys.path through s3_fixtures


@pytest.fixture(scope="module")
def rclone(tmp_path_factory):
    """rclone's "serve s3": signatures checked, conditional headers ignored, and a ranged GET
    answered 200 (not 206) with the part asked for and a Content-Range."""
    srv = s3_servers.start("rclone", str(tmp_path_factory.mktemp("rclone")))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    """moto (no signature check), for a proxy that changes requests."""
    srv = s3_servers.start("moto", str(tmp_path_factory.mktemp("moto")))
    try:
        yield srv
    finally:
        srv.stop()


class RangeDroppingProxy:
    """An S3 server that ignores Range: forwards every request to `target` (moto, which checks
    no signature) without its Range header, so that a ranged GET gets 200 and the whole object.
    Listens on 127.0.0.1 only."""

    def __init__(self, target: str):
        host, port = target.removeprefix("http://").split(":")

        class Handler(BaseHTTPRequestHandler):
            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() != "range"}
                upstream = http.client.HTTPConnection(host, int(port), timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                    self.send_response(answer.status)
                    for k, v in answer.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

            def log_message(self, *args):
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self):
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def restore_error(url: str, tree: dict) -> list[BaseException]:
    """The errors of restoring `url` with and without mmap (a restore that returns fails)."""
    errors = []
    for kw in ({}, {"mmap": False}):
        with pytest.raises(Exception) as raised:
            got = tensorstash.restore(url, **kw)
            pytest.fail(f"restore({kw}) through a server that does not honour Range returned "
                        f"{'the right' if np.array_equal(got['w'], tree['w']) else 'wrong'} data")
        errors.append(raised.value)
    return errors


def small_tree() -> dict:
    return {"w": pattern((300, 257), np.float32, seed=7), "b": pattern((1000,), np.int64, seed=8),
            "n": 3}


# --- item 10: a server that does not honour Range ------------------------------------------------
# Before the fix both restores failed with "... was replaced or removed after the commit", which
# sent users looking for someone who overwrote their checkpoint.

def test_restore_through_a_server_that_ignores_range_says_so(moto, monkeypatch, tmp_path):
    """Ranged GETs answered 200 with the whole object: restore fails, saying that the server
    ignored the Range header, naming the object and the range."""
    tree = small_tree()
    for k, v in aws_vars(moto, str(tmp_path)).items():
        monkeypatch.setenv(k, v)
    url = f"s3://{moto.bucket}/ignores-range/0000000001"
    tensorstash.save(url, tree)
    assert_same_tree(tensorstash.restore(url), tree)  # whole where ranges are honoured
    proxy = RangeDroppingProxy(moto.endpoint)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        for error in restore_error(url, tree):
            msg = str(error)
            assert "ignored the Range header and answered 200 with the whole object" in msg, msg
            assert "replaced or removed" not in msg, msg
            assert "/state/data/" in msg and "to a request for bytes " in msg, msg
            assert not isinstance(error, (ValueError, FileNotFoundError)), repr(error)
    finally:
        proxy.close()


def test_restore_through_a_server_that_answers_ranges_200_says_so(s3, rclone, monkeypatch,
                                                                   tmp_path):
    """rclone answers a ranged GET with 200 and a Content-Range, where HTTP wants 206 (a 200's
    body is the whole object): restore fails, saying so, naming the object and the range."""
    tree = small_tree()
    tensorstash.save(s3.step(), tree)  # on SeaweedFS: rclone takes no create-only writes
    keys = s3.keys()
    source, dest = s3.client(), rclone.client()
    for key in keys:  # the step, copied object by object
        body = source.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
        dest.put_object(Bucket=rclone.bucket, Key=key, Body=body)
    assert any("/state/data/" in k for k in keys), keys

    for k, v in aws_vars(rclone, str(tmp_path)).items():
        monkeypatch.setenv(k, v)
    for error in restore_error(f"s3://{rclone.bucket}/{s3.prefix}/0000000001", tree):
        msg = str(error)
        assert "with 200 and Content-Range 'bytes " in msg and "instead of 206" in msg, msg
        assert "replaced or removed" not in msg, msg
        assert "/state/data/" in msg and "a request for bytes " in msg, msg
        assert not isinstance(error, (ValueError, FileNotFoundError)), repr(error)


# --- item 10: a backslash in an S3 path -----------------------------------------------------------

def test_a_backslash_in_an_s3_path_is_refused_naming_it(s3):
    """SeaweedFS stores a backslash in a key as '/': a save under s3://bucket/a\\b/... wrote its
    objects under a/b/ and then failed with "syncing the folder ... it holds nothing", naming
    neither the backslash nor the real cause. Now the path is refused before anything is sent,
    with a ValueError that names it and says why; the array path "a\\b" (not a key) still works."""
    for url in (f"{s3.url}/a\\b/0000000001", f"{s3.url}/a\\b"):
        with pytest.raises(ValueError) as raised:
            if url.endswith("0000000001"):
                tensorstash.save(url, {"x": np.arange(3)})
            else:
                tensorstash.CheckpointManager(url).save(1, {"x": np.arange(3)})
            pytest.fail(f"{url!r} was accepted")
        msg = str(raised.value)
        assert f"'{s3.prefix}/a\\b'" in msg and "has a backslash" in msg and s3.bucket in msg, msg
    assert s3.keys() == [], s3.keys()  # nothing written, under any name

    tree = {"a\\b": np.arange(5), "n": 1}
    tensorstash.save(s3.step(), tree)
    assert_same_tree(tensorstash.restore(s3.step()), tree)
