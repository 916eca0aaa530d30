"""Proves the local GCS test fixtures work: that the proxy (gcs_proxy.py) enforces what real GCS
enforces and the emulator ignores, that the raw emulator still ignores it (so the proxy is still
needed: a fixed emulator release makes test_raw_emulator_* fail), and that the credential fakes
(gcs_fakes.py) accept exactly the grants Google's token endpoint accepts.

    cd /work/main && .venv/bin/python -m pytest tests/gcs/test_gcs_servers.py -q
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gcs_fakes  # noqa: E402
import gcs_servers  # noqa: E402

DATA = bytes(range(256)) * 16  # 4 KiB
_counter = [0]


def req(endpoint: str, method: str, target: str, body: bytes | None = None,
        headers: dict | None = None, timeout: float = 20.0):
    """One request with http.client: (status, headers with lower-case names, body)."""
    u = urllib.parse.urlsplit(endpoint)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def fresh(prefix: str = "t") -> str:
    _counter[0] += 1
    return f"{prefix}/{os.getpid()}-{time.monotonic_ns()}-{_counter[0]}/obj"


class Gcs:
    """Requests against one endpoint (the proxy or the raw emulator) and one bucket."""

    def __init__(self, endpoint: str, bucket: str, token: str | None = None):
        self.endpoint, self.bucket, self.token = endpoint, bucket, token

    def _h(self, extra=None):
        h = dict(extra or {})
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    def media(self, name, data, **params):
        qs = urllib.parse.urlencode({"uploadType": "media", "name": name, **params})
        return req(self.endpoint, "POST", f"/upload/storage/v1/b/{self.bucket}/o?{qs}", data,
                   self._h({"Content-Type": "application/octet-stream"}))

    def multipart(self, name, data, **params):
        boundary = "tsboundary42"
        body = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                f"{json.dumps({'name': name})}\r\n--{boundary}\r\n"
                f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + \
            f"\r\n--{boundary}--\r\n".encode()
        qs = urllib.parse.urlencode({"uploadType": "multipart", **params})
        return req(self.endpoint, "POST", f"/upload/storage/v1/b/{self.bucket}/o?{qs}", body,
                   self._h({"Content-Type": f"multipart/related; boundary={boundary}"}))

    def resumable_start(self, name, **params):
        qs = urllib.parse.urlencode({"uploadType": "resumable", **params})
        return req(self.endpoint, "POST", f"/upload/storage/v1/b/{self.bucket}/o?{qs}",
                   json.dumps({"name": name}).encode(),
                   self._h({"Content-Type": "application/json"}))

    def session_put(self, location, data, content_range):
        u = urllib.parse.urlsplit(location)
        assert f"{u.scheme}://{u.netloc}" == self.endpoint, location  # the session is ours
        return req(self.endpoint, "PUT", u.path + "?" + u.query, data,
                   self._h({"Content-Range": content_range}))

    def read(self, name, headers=None, **params):
        qs = urllib.parse.urlencode({"alt": "media", **params})
        return req(self.endpoint, "GET", f"/storage/v1/b/{self.bucket}/o/{q(name)}?{qs}",
                   None, self._h(headers))

    def meta(self, name, **params):
        qs = ("?" + urllib.parse.urlencode(params)) if params else ""
        return req(self.endpoint, "GET", f"/storage/v1/b/{self.bucket}/o/{q(name)}{qs}",
                   None, self._h())

    def generation(self, name) -> str:
        code, _, body = self.meta(name)
        assert code == 200, body
        return json.loads(body)["generation"]

    def delete(self, name, **params):
        qs = ("?" + urllib.parse.urlencode(params)) if params else ""
        return req(self.endpoint, "DELETE", f"/storage/v1/b/{self.bucket}/o/{q(name)}{qs}",
                   None, self._h())

    def compose(self, dest, request: dict, **params):
        qs = ("?" + urllib.parse.urlencode(params)) if params else ""
        return req(self.endpoint, "POST",
                   f"/storage/v1/b/{self.bucket}/o/{q(dest)}/compose{qs}",
                   json.dumps(request).encode(), self._h({"Content-Type": "application/json"}))

    def list(self, **params):
        qs = ("?" + urllib.parse.urlencode(params)) if params else ""
        return req(self.endpoint, "GET", f"/storage/v1/b/{self.bucket}/o{qs}", None, self._h())


def gcs_error(body: bytes, code: int, reason: str) -> str:
    """Asserts body is GCS's JSON error form with this code and reason; returns the message."""
    d = json.loads(body)
    assert d["error"]["code"] == code, d
    assert d["error"]["errors"][0]["reason"] == reason, d
    assert d["error"]["message"], d
    return d["error"]["message"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = gcs_servers.start(str(tmp_path_factory.mktemp("gcs")))
    try:
        yield s
    finally:
        s.stop()
    assert not gcs_servers._s3._alive(s.emulator_pid)
    assert not gcs_servers._s3._alive(s.proxy_pid)


@pytest.fixture
def proxy(srv):
    srv.proxy_control("config", p_429=0, p_503=0, p_reset=0, p_reset_after=0, fail_next="",
                      hostile="", strip_upload_crc32c=0)
    return Gcs(srv.endpoint, srv.bucket)


@pytest.fixture
def raw(srv):
    return Gcs(srv.raw_endpoint, srv.bucket)


# ---------------------------------------------------------------------------------------------
# the servers


def test_cli_start_writes_env_and_stop_ends_every_process(tmp_path):
    py = sys.executable
    script = os.path.join(HERE, "gcs_servers.py")
    out = subprocess.run([py, script, "start", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    env = gcs_servers._s3.read_env(str(tmp_path / "server.env"))
    try:
        for key in ("TS_GCS_ENDPOINT", "TS_GCS_AUTH_ENDPOINT", "TS_GCS_RAW_ENDPOINT"):
            assert env[key].startswith("http://127.0.0.1:"), env
        assert len({env["TS_GCS_ENDPOINT"], env["TS_GCS_AUTH_ENDPOINT"],
                    env["TS_GCS_RAW_ENDPOINT"]}) == 3
        assert env["TS_GCS_BUCKET"] == gcs_servers.DEFAULT_BUCKET
        assert os.path.exists(env["TS_GCS_SA_KEY"]) and os.path.exists(env["TS_GCS_AUTHORIZED_USER"])
        code, _, body = Gcs(env["TS_GCS_ENDPOINT"], env["TS_GCS_BUCKET"]).media("cli/x", b"abc")
        assert code == 200, body
        # A second start on the same workdir refuses while the servers run.
        again = subprocess.run([py, script, "start", str(tmp_path)], capture_output=True,
                               text=True, timeout=60)
        assert again.returncode == 1 and "already running" in again.stderr
    finally:
        stop = subprocess.run([py, script, "stop", str(tmp_path)], capture_output=True, text=True,
                              timeout=60)
    assert stop.returncode == 0
    pids = [int(env[k]) for k in ("TS_GCS_EMULATOR_PID", "TS_GCS_PROXY_PID", "TS_GCS_FAKES_PID")]
    assert not any(gcs_servers._s3._alive(p) for p in pids)
    again = subprocess.run([py, script, "stop", str(tmp_path)], capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 0 and "not running" in again.stderr


def test_raw_emulator_ignores_what_the_proxy_enforces(raw):
    """If this fails, the emulator got fixed: the proxy may no longer be needed for that rule."""
    name = fresh("raw")
    assert raw.media(name, b"one", ifGenerationMatch=0)[0] == 200
    assert raw.media(name, b"two", ifGenerationMatch=0)[0] == 200  # overwritten
    assert raw.read(name)[2] == b"two"
    assert raw.read(name, generation=1)[0] == 200
    assert raw.read(name, ifGenerationMatch=1)[0] == 200
    for i in range(3):
        assert raw.media(f"{name}-{i}", b"x")[0] == 200
    code, _, body = raw.list(prefix=name, maxResults=1)
    assert code == 200 and len(json.loads(body)["items"]) == 4
    assert "nextPageToken" not in json.loads(body)
    code, hdrs, body = raw.read(name, headers={"Range": "bytes=10-20"})
    assert code == 206 and body == b""  # a bogus 206, not 416
    assert "x-goog-generation" not in hdrs
    srcs = {"sourceObjects": [{"name": name}] * 33, "destination": {}}
    assert raw.compose(name + "-c", srcs)[0] == 200
    assert raw.delete(name, ifGenerationMatch=1)[0] in (200, 204)


def test_the_bucket_keeps_no_soft_deleted_objects(srv):
    """start() turns soft delete off: otherwise every deleted object stays in the emulator's
    memory for 7 days."""
    code, _, body = req(srv.raw_endpoint, "GET", f"/storage/v1/b/{srv.bucket}")
    assert code == 200, body
    policy = json.loads(body).get("softDeletePolicy", {})
    assert str(policy.get("retentionDurationSeconds")) == "0", policy


def test_upload_answers_lose_their_crc32c_when_asked(srv, proxy):
    name = fresh()
    srv.proxy_control("config", strip_upload_crc32c=2)
    for upload in (proxy.media, proxy.multipart):
        code, _, body = upload(name, b"bytes")
        assert code == 200, body
        assert "crc32c" not in json.loads(body)
    code, _, body = proxy.media(name, b"bytes")  # the count is spent: answers are whole again
    assert code == 200 and json.loads(body)["crc32c"], body
    assert proxy.meta(name)[0] == 200 and "crc32c" in json.loads(proxy.meta(name)[2])


# ---------------------------------------------------------------------------------------------
# preconditions on writes


def test_media_create_only(proxy):
    name = fresh()
    code, _, body = proxy.media(name, b"first", ifGenerationMatch=0)
    assert code == 200, body
    gen = json.loads(body)["generation"]
    code, _, body = proxy.media(name, b"second", ifGenerationMatch=0)
    assert code == 412
    assert name in gcs_error(body, 412, "conditionNotMet")
    assert proxy.read(name)[2] == b"first" and proxy.generation(name) == gen
    # matching the live generation replaces; a stale one does not
    code, _, body = proxy.media(name, b"third", ifGenerationMatch=gen)
    assert code == 200, body
    assert proxy.media(name, b"fourth", ifGenerationMatch=gen)[0] == 412
    assert proxy.read(name)[2] == b"third"
    # ifGenerationNotMatch: fails on the live generation and on a missing object
    live = proxy.generation(name)
    assert proxy.media(name, b"x", ifGenerationNotMatch=live)[0] == 412
    assert proxy.media(fresh(), b"x", ifGenerationNotMatch=live)[0] == 412
    assert proxy.media(name, b"fifth", ifGenerationNotMatch=gen)[0] == 200
    # metageneration
    assert proxy.media(name, b"x", ifMetagenerationMatch=99)[0] == 412
    assert proxy.read(name)[2] == b"fifth"


def test_racing_create_only_writers_one_wins(proxy):
    """The proxy's lock makes check + write atomic: of 8 concurrent create-only uploads of one
    name exactly one succeeds, and the object holds that writer's bytes."""
    import threading

    name = fresh()
    results = [None] * 8
    start = threading.Barrier(len(results))

    def writer(i):
        start.wait()
        results[i] = proxy.media(name, f"writer {i}".encode() * 1000, ifGenerationMatch=0)[0]

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [200] + [412] * 7, results
    winner = results.index(200)
    assert proxy.read(name)[2] == f"writer {winner}".encode() * 1000


def test_keep_alive_chunked_and_expect_continue(proxy):
    """One client connection for several requests (answers of every kind keep the framing),
    a chunked upload body, and `Expect: 100-continue` as libcurl sends it for large bodies."""
    u = urllib.parse.urlsplit(proxy.endpoint)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=20)
    name = fresh()
    try:
        conn.request("POST", f"/upload/storage/v1/b/{proxy.bucket}/o?uploadType=media&name="
                     f"{q(name)}&ifGenerationMatch=0", body=iter([b"chunk-1,", b"chunk-2"]),
                     headers={"Content-Type": "application/octet-stream"}, encode_chunked=True)
        r = conn.getresponse()
        assert r.status == 200, r.read()
        r.read()
        for target, headers, status, body in (
                (f"/storage/v1/b/{proxy.bucket}/o/{q(name)}?alt=media", {}, 200, b"chunk-1,chunk-2"),
                (f"/storage/v1/b/{proxy.bucket}/o/{q(name)}?alt=media", {"Range": "bytes=99-"}, 416, None),
                (f"/storage/v1/b/{proxy.bucket}/o/{q(name)}?alt=media&generation=1", {}, 404, None),
                (f"/storage/v1/b/{proxy.bucket}/o/{q(name)}?alt=media", {"Range": "bytes=6-"}, 206, b"1,chunk-2")):
            conn.request("GET", target, headers=headers)
            r = conn.getresponse()
            got = r.read()
            assert r.status == status, (target, r.status, got)
            if body is not None:
                assert got == body
    finally:
        conn.close()
    big = os.urandom(2 << 20)
    name2 = fresh()
    # Send the headers, wait for 100 Continue, then the body (what libcurl does).
    with socket.create_connection((u.hostname, u.port), timeout=20) as sock:
        sock.sendall((f"POST /upload/storage/v1/b/{proxy.bucket}/o?uploadType=media&name="
                      f"{q(name2)}&ifGenerationMatch=0 HTTP/1.1\r\nHost: {u.netloc}\r\n"
                      f"Content-Type: application/octet-stream\r\nContent-Length: {len(big)}\r\n"
                      "Expect: 100-continue\r\n\r\n").encode())
        data = b""
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            assert more, data
            data += more
        assert data.startswith(b"HTTP/1.1 100"), data  # nothing sent yet: only the headers
        sock.sendall(big)
        while data.count(b"\r\n\r\n") < 2:
            more = sock.recv(65536)
            assert more, data
            data += more
    final = data.split(b"\r\n\r\n", 1)[1]
    assert final.startswith(b"HTTP/1.1 200 "), final[:200]
    assert proxy.read(name2)[2] == big


def test_multipart_create_only(proxy):
    name = fresh()
    assert proxy.multipart(name, DATA, ifGenerationMatch=0)[0] == 200
    code, _, body = proxy.multipart(name, b"other", ifGenerationMatch=0)
    assert code == 412
    gcs_error(body, 412, "conditionNotMet")
    assert proxy.read(name)[2] == DATA


def test_resumable_preconditions_at_start_and_at_finalize(proxy):
    name = fresh()
    assert proxy.media(name, b"exists")[0] == 200
    code, _, body = proxy.resumable_start(name, ifGenerationMatch=0)
    assert code == 412
    gcs_error(body, 412, "conditionNotMet")

    # The object appears while the session is open: finalize is refused.
    late = fresh()
    code, hdrs, body = proxy.resumable_start(late, ifGenerationMatch=0)
    assert code == 200, body
    loc = hdrs["location"]
    code, hdrs, _ = proxy.session_put(loc, b"0123", "bytes 0-3/*")
    assert code == 308 and hdrs["range"] == "bytes=0-3"
    assert proxy.media(late, b"winner", ifGenerationMatch=0)[0] == 200
    code, _, body = proxy.session_put(loc, b"456789", "bytes 4-9/10")
    assert code == 412
    gcs_error(body, 412, "conditionNotMet")
    assert proxy.read(late)[2] == b"winner"

    # Without a competitor the same session shape completes.
    ok = fresh()
    code, hdrs, _ = proxy.resumable_start(ok, ifGenerationMatch=0)
    loc = hdrs["location"]
    assert proxy.session_put(loc, b"0123", "bytes 0-3/*")[0] == 308
    code, _, body = proxy.session_put(loc, b"456789", "bytes 4-9/10")
    assert code == 200, body
    assert proxy.read(ok)[2] == b"0123456789"


def test_resumable_cancel(proxy):
    name = fresh()
    code, hdrs, _ = proxy.resumable_start(name, ifGenerationMatch=0)
    loc = hdrs["location"]
    u = urllib.parse.urlsplit(loc)
    code, _, body = req(proxy.endpoint, "DELETE", u.path + "?" + u.query)
    assert code == 499
    code, _, _ = proxy.session_put(loc, b"abc", "bytes 0-2/3")
    assert code == 404
    assert proxy.meta(name)[0] == 404


def test_compose_rules(proxy):
    a, b = fresh(), fresh()
    assert proxy.media(a, b"AAA")[0] == 200
    assert proxy.media(b, b"BB")[0] == 200
    dest = fresh()
    # no destination key: filled in (the emulator alone drops the connection)
    code, _, body = proxy.compose(dest, {"sourceObjects": [{"name": a}, {"name": b}]},
                                  ifGenerationMatch=0)
    assert code == 200, body
    assert proxy.read(dest)[2] == b"AAABB"
    code, _, body = proxy.compose(dest, {"sourceObjects": [{"name": b}], "destination": {}},
                                  ifGenerationMatch=0)
    assert code == 412
    gcs_error(body, 412, "conditionNotMet")
    assert proxy.read(dest)[2] == b"AAABB"
    # more than 32 sources
    code, _, body = proxy.compose(fresh(), {"sourceObjects": [{"name": a}] * 33})
    assert code == 400
    assert "32" in gcs_error(body, 400, "invalid")
    code, _, body = proxy.compose(fresh(), {"sourceObjects": [{"name": a}] * 32})
    assert code == 200, body
    # source generations
    ga = proxy.generation(a)
    stale = str(int(ga) - 1)
    code, _, body = proxy.compose(fresh(), {"sourceObjects": [{"name": a, "generation": stale}]})
    assert code == 404
    gcs_error(body, 404, "notFound")
    code, _, body = proxy.compose(fresh(), {"sourceObjects": [
        {"name": a, "objectPreconditions": {"ifGenerationMatch": stale}}]})
    assert code == 412
    d2 = fresh()
    code, _, body = proxy.compose(d2, {"sourceObjects": [{"name": a, "generation": ga},
                                                          {"name": b}]})
    assert code == 200, body
    assert proxy.read(d2)[2] == b"AAABB"
    code, _, body = proxy.compose(fresh(), {"sourceObjects": [{"name": fresh()}]})
    assert code == 404


def test_delete_preconditions(proxy):
    name = fresh()
    assert proxy.media(name, b"x")[0] == 200
    gen = proxy.generation(name)
    code, _, body = proxy.delete(name, ifGenerationMatch=str(int(gen) + 1))
    assert code == 412
    gcs_error(body, 412, "conditionNotMet")
    assert proxy.meta(name)[0] == 200
    assert proxy.delete(name, generation=str(int(gen) + 1))[0] == 404
    assert proxy.meta(name)[0] == 200
    assert proxy.delete(name, ifGenerationMatch=gen)[0] in (200, 204)
    assert proxy.meta(name)[0] == 404


def test_names_that_look_like_api_paths(proxy):
    for name in (fresh() + "/compose", fresh() + "/copyTo/b/x/o/y", fresh() + " é%/ü"):
        code, _, body = proxy.media(name, b"odd", ifGenerationMatch=0)
        assert code == 200, (name, body)
        assert proxy.media(name, b"odd", ifGenerationMatch=0)[0] == 412, name
        gen = proxy.generation(name)
        code, hdrs, body = proxy.read(name, generation=gen)
        assert code == 200 and body == b"odd" and hdrs["x-goog-generation"] == gen, name
        assert proxy.read(name, generation=str(int(gen) + 1))[0] == 404, name


def test_empty_media_upload(proxy):
    name = fresh()
    code, _, body = proxy.media(name, b"", ifGenerationMatch=0)
    assert code == 200, body
    code, _, body = proxy.read(name)
    assert code == 200 and body == b""
    assert json.loads(proxy.meta(name)[2])["size"] == "0"


def test_copy_and_rewrite_preconditions(proxy):
    src, dst = fresh(), fresh()
    assert proxy.media(src, b"source")[0] == 200
    assert proxy.media(dst, b"taken")[0] == 200
    gen = proxy.generation(src)
    for verb in ("copyTo", "rewriteTo"):
        def go(d, **params):
            qs = ("?" + urllib.parse.urlencode(params)) if params else ""
            return req(proxy.endpoint, "POST", f"/storage/v1/b/{proxy.bucket}/o/{q(src)}/{verb}"
                       f"/b/{proxy.bucket}/o/{q(d)}{qs}", b"{}",
                       {"Content-Type": "application/json"})
        code, _, body = go(dst, ifGenerationMatch=0)
        assert code == 412, verb
        gcs_error(body, 412, "conditionNotMet")
        assert go(fresh(), ifSourceGenerationMatch=str(int(gen) + 1))[0] == 412, verb
        assert go(fresh(), sourceGeneration=str(int(gen) + 1))[0] == 404, verb
        ok = fresh()
        code, _, body = go(ok, ifGenerationMatch=0, ifSourceGenerationMatch=gen)
        assert code == 200, (verb, body)
        assert proxy.read(ok)[2] == b"source"
    assert proxy.read(dst)[2] == b"taken"


def test_bad_values_and_emulator_errors_in_gcs_form(proxy, raw):
    name = fresh()
    code, _, body = proxy.media(name, b"x", ifGenerationMatch="abc")
    assert code == 400
    assert "ifGenerationMatch" in gcs_error(body, 400, "invalid")
    assert proxy.meta(name)[0] == 404
    assert proxy.read(name, generation="zz")[0] == 400
    # The emulator answers a delete of a missing object 404 without GCS's error body; the proxy
    # gives it one.
    missing = fresh()
    code, _, body = raw.delete(missing)
    assert code == 404
    code, _, body = proxy.delete(missing)
    assert code == 404
    gcs_error(body, 404, "notFound")


def test_stats_count_operations(srv, proxy):
    srv.proxy_control("reset_stats")
    name = fresh()
    proxy.media(name, b"abc")
    proxy.multipart(fresh(), b"abc")
    proxy.read(name)
    proxy.meta(name)
    proxy.list(prefix=name)
    proxy.compose(fresh(), {"sourceObjects": [{"name": name}]})
    proxy.delete(name)
    st = srv.proxy_control("stats")
    assert st["ops"] == {"media": 1, "multipart": 1, "read": 1, "meta": 1, "list": 1,
                         "compose": 1, "delete": 1}
    assert st["requests"] == 7 and st["status"]["200"] >= 6


# ---------------------------------------------------------------------------------------------
# reads


def test_reads_pinned_to_a_generation(proxy):
    name = fresh()
    assert proxy.media(name, DATA)[0] == 200
    gen = proxy.generation(name)
    code, hdrs, body = proxy.read(name, generation=gen)
    assert code == 200 and body == DATA
    assert hdrs["x-goog-generation"] == gen
    assert hdrs["x-goog-metageneration"].isdigit()
    code, _, body = proxy.read(name, ifGenerationMatch=gen)
    assert code == 200 and body == DATA
    # replaced behind the reader's back
    assert proxy.media(name, b"replaced")[0] == 200
    code, _, body = proxy.read(name, generation=gen)
    assert code == 404
    gcs_error(body, 404, "notFound")
    assert proxy.meta(name, generation=gen)[0] == 404
    code, _, body = proxy.read(name, ifGenerationMatch=gen)
    assert code == 412
    gcs_error(body, 412, "conditionNotMet")
    assert proxy.meta(name, ifGenerationMatch=gen)[0] == 412
    new = proxy.generation(name)
    assert new != gen
    assert proxy.read(name, ifGenerationNotMatch=new)[0] == 304
    code, hdrs, body = proxy.read(name)
    assert code == 200 and body == b"replaced" and hdrs["x-goog-generation"] == new
    assert proxy.read(fresh())[0] == 404


def test_ranges(proxy):
    name = fresh()
    assert proxy.media(name, DATA)[0] == 200
    n = len(DATA)
    code, hdrs, body = proxy.read(name, headers={"Range": "bytes=10-19"})
    assert code == 206 and body == DATA[10:20]
    assert hdrs["content-range"] == f"bytes 10-19/{n}"
    code, _, body = proxy.read(name, headers={"Range": f"bytes={n - 5}-{n + 100}"})
    assert code == 206 and body == DATA[-5:]
    code, _, body = proxy.read(name, headers={"Range": "bytes=-7"})
    assert code == 206 and body == DATA[-7:]
    for start in (n, n + 1, n + 1000):
        code, hdrs, body = proxy.read(name, headers={"Range": f"bytes={start}-{start + 5}"})
        assert code == 416, (start, code)
        assert hdrs["content-range"] == f"bytes */{n}"
        gcs_error(body, 416, "requestedRangeNotSatisfiable")
    assert proxy.read(name, headers={"Range": f"bytes={n}-"})[0] == 416
    empty = fresh()
    assert proxy.media(empty, b"")[0] == 200
    assert proxy.read(empty, headers={"Range": "bytes=0-"})[0] == 416
    assert proxy.read(empty)[0] == 200


# ---------------------------------------------------------------------------------------------
# listing


def test_listing_is_paged(proxy):
    base = fresh("list").rsplit("/", 1)[0]
    names = [f"{base}/{c}" for c in ("a", "b", "c", "d", "e")]
    names += [f"{base}/sub/x", f"{base}/sub/y", f"{base}/zz/q"]
    for n in names:
        assert proxy.media(n, b"1")[0] == 200

    def collect(**params):
        pages, token = [], None
        while True:
            p = dict(params)
            if token:
                p["pageToken"] = token
            code, _, body = proxy.list(**p)
            assert code == 200, body
            d = json.loads(body)
            pages.append([it["name"] for it in d.get("items", [])] + d.get("prefixes", []))
            token = d.get("nextPageToken")
            if not token:
                return pages

    pages = collect(prefix=base + "/", maxResults=2)
    assert [len(p) for p in pages] == [2, 2, 2, 2]
    assert sorted(sum(pages, [])) == sorted(names)
    pages = collect(prefix=base + "/", delimiter="/", maxResults=3)
    flat = sum(pages, [])
    assert [len(p) for p in pages] == [3, 3, 1]
    assert sorted(flat) == sorted(names[:5] + [f"{base}/sub/", f"{base}/zz/"])
    assert collect(prefix=base + "/") == [sorted(names)]
    pages = collect(prefix=base + "/", startOffset=f"{base}/c", endOffset=f"{base}/e")
    assert pages == [[f"{base}/c", f"{base}/d"]]
    code, _, body = proxy.list(prefix=base + "/", pageToken="not-a-token")
    assert code == 400
    gcs_error(body, 400, "invalid")


# ---------------------------------------------------------------------------------------------
# tokens and the fakes


def _jwt_claims(tokens, email, **over):
    now = int(time.time())
    c = {"iss": email, "scope": "https://www.googleapis.com/auth/devstorage.read_write",
         "aud": tokens.token_uri, "iat": now, "exp": now + 3600}
    c.update(over)
    return c


def _grant(token_uri, form: dict):
    u = urllib.parse.urlsplit(token_uri)
    return req(f"{u.scheme}://{u.netloc}", "POST", u.path, urllib.parse.urlencode(form).encode(),
               {"Content-Type": "application/x-www-form-urlencoded"})


def test_auth_listener_needs_an_issued_unexpired_token(srv, proxy):
    auth = Gcs(srv.auth_endpoint, srv.bucket)
    code, hdrs, body = auth.list()
    assert code == 401
    assert "tokens" in gcs_error(body, 401, "required")
    auth.token = "garbage"
    assert auth.list()[0] == 401
    # A token from the running fakes, through the service-account key they wrote.
    key = json.load(open(srv.sa_key))
    from cryptography.hazmat.primitives import serialization
    pk = serialization.load_pem_private_key(key["private_key"].encode(), None)
    claims = {"iss": key["client_email"], "aud": key["token_uri"],
              "scope": "https://www.googleapis.com/auth/devstorage.full_control",
              "iat": int(time.time()), "exp": int(time.time()) + 3600}
    code, _, body = _grant(key["token_uri"], {"grant_type": gcs_fakes.JWT_GRANT,
                                              "assertion": gcs_fakes.sign_jwt(pk, key["private_key_id"], claims)})
    assert code == 200, body
    auth.token = json.loads(body)["access_token"]
    assert srv.fakes_control("token")["grants"]["jwt"] >= 1
    code, _, body = auth.media(fresh(), b"authorised", ifGenerationMatch=0)
    assert code == 200, body
    assert auth.list()[0] == 200
    # A resumable session's URL needs no token (as on GCS); starting one does.
    sess = fresh()
    code, hdrs, body = auth.resumable_start(sess, ifGenerationMatch=0)
    assert code == 200, body
    anonymous = Gcs(srv.auth_endpoint, srv.bucket)
    assert anonymous.resumable_start(fresh())[0] == 401
    code, _, body = anonymous.session_put(hdrs["location"], b"abc", "bytes 0-2/3")
    assert code == 200, body
    assert auth.read(sess)[2] == b"abc"
    # An expired token is refused.
    with open(srv.tokens_file, "a") as f:
        f.write(f"expired-token {time.time() - 1:.3f}\n")
    auth.token = "expired-token"
    assert auth.list()[0] == 401
    # The open listener needs none.
    assert proxy.list()[0] == 200


@pytest.fixture
def fakes(tmp_path):
    tokens_file = str(tmp_path / "tokens.txt")
    with gcs_fakes.TokenServer(tokens_file) as tok, gcs_fakes.MetadataServer(tok) as meta:
        yield tok, meta, tokens_file


def test_token_endpoint_verifies_the_jwt(fakes, tmp_path):
    tok, _, tokens_file = fakes
    path = str(tmp_path / "sa.json")
    kid, key = gcs_fakes.write_service_account_key(path, tok)
    info = json.load(open(path))
    assert info["type"] == "service_account" and info["token_uri"] == tok.token_uri
    assert info["private_key_id"] == kid and "BEGIN PRIVATE KEY" in info["private_key"]
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    email = info["client_email"]

    def grant(assertion):
        return _grant(tok.token_uri, {"grant_type": gcs_fakes.JWT_GRANT, "assertion": assertion})

    tok.expires_in = 120
    code, _, body = grant(gcs_fakes.sign_jwt(key, kid, _jwt_claims(tok, email)))
    assert code == 200, body
    got = json.loads(body)
    assert got["token_type"] == "Bearer" and got["expires_in"] == 120
    line = open(tokens_file).read().split()
    assert line[0] == got["access_token"] and abs(float(line[1]) - (time.time() + 120)) < 30
    assert tok.grants["jwt"] == 1

    other = gcs_fakes.new_rsa_key()
    bad = {
        "wrong key": gcs_fakes.sign_jwt(other, kid, _jwt_claims(tok, email)),
        "unknown kid": gcs_fakes.sign_jwt(key, "nope", _jwt_claims(tok, email)),
        "wrong aud": gcs_fakes.sign_jwt(key, kid, _jwt_claims(tok, email, aud="https://x/token")),
        "wrong iss": gcs_fakes.sign_jwt(key, kid, _jwt_claims(tok, "someone@else")),
        "wrong scope": gcs_fakes.sign_jwt(key, kid, _jwt_claims(tok, email, scope="openid")),
        "too long": gcs_fakes.sign_jwt(key, kid, _jwt_claims(
            tok, email, exp=int(time.time()) + 3601)),
        "expired": gcs_fakes.sign_jwt(key, kid, _jwt_claims(
            tok, email, iat=int(time.time()) - 7200, exp=int(time.time()) - 3600)),
        "not a jwt": "abc.def",
    }
    for what, assertion in bad.items():
        code, _, body = grant(assertion)
        assert code == 400, what
        assert json.loads(body)["error"] == "invalid_grant", what
    assert "Signature" in _refusal(grant, bad["wrong key"])
    assert tok.grants["jwt"] == 1 and tok.refused == len(bad) + 1
    assert len(open(tokens_file).read().splitlines()) == 1


def _refusal(grant, assertion) -> str:
    code, _, body = grant(assertion)
    assert code == 400
    return json.loads(body)["error_description"]


def test_token_endpoint_refresh_grant(fakes, tmp_path):
    tok, _, tokens_file = fakes
    path = str(tmp_path / "adc.json")
    info = gcs_fakes.write_authorized_user(path, tok)
    on_disk = json.load(open(path))
    assert on_disk["type"] == "authorized_user" and on_disk["token_uri"] == tok.token_uri
    form = {"grant_type": "refresh_token", "client_id": info["client_id"],
            "client_secret": info["client_secret"], "refresh_token": info["refresh_token"]}
    code, _, body = _grant(tok.token_uri, form)
    assert code == 200, body
    assert json.loads(body)["access_token"] in open(tokens_file).read()
    assert _grant(tok.token_uri, {**form, "client_secret": "wrong"})[0] == 401
    code, _, body = _grant(tok.token_uri, {**form, "refresh_token": "wrong"})
    assert code == 400 and json.loads(body)["error"] == "invalid_grant"
    assert _grant(tok.token_uri, {**form, "grant_type": "password"})[0] == 400
    assert tok.grants["refresh"] == 1 and tok.refused == 3


def test_metadata_server(fakes):
    tok, meta, tokens_file = fakes
    path = "/computeMetadata/v1/instance/service-accounts/default/token"
    code, hdrs, _ = req(meta.url, "GET", path)
    assert code == 403 and hdrs["metadata-flavor"] == "Google"
    meta.expires_in = 5
    code, hdrs, body = req(meta.url, "GET", path, headers={"Metadata-Flavor": "Google"})
    assert code == 200 and hdrs["metadata-flavor"] == "Google"
    got = json.loads(body)
    assert got["expires_in"] == 5 and got["access_token"] in open(tokens_file).read()
    assert meta.token_requests == 1 and tok.grants["metadata"] == 1
    code, _, body = req(meta.url, "GET", "/computeMetadata/v1/project/project-id",
                        headers={"Metadata-Flavor": "Google"})
    assert code == 200 and body.decode() == gcs_fakes.PROJECT_ID
    # silent: the connection is accepted and never answered
    code, _, body = req(meta.url, "GET", "/__fake__/config?silent=1")
    assert code == 200 and json.loads(body)["silent"] is True
    with pytest.raises(TimeoutError):
        req(meta.url, "GET", path, headers={"Metadata-Flavor": "Google"}, timeout=0.5)
    meta.silent = False
    meta.delay_s = 0.3
    with pytest.raises(TimeoutError):
        req(meta.url, "GET", path, headers={"Metadata-Flavor": "Google"}, timeout=0.05)
    meta.delay_s = 0
    assert req(meta.url, "GET", path, headers={"Metadata-Flavor": "Google"})[0] == 200


# ---------------------------------------------------------------------------------------------
# fault injection


def test_fault_injection(srv, proxy):
    srv.proxy_control("reset_stats")
    st = srv.proxy_control("config", fail_next="429,503")
    assert st["fail_next"] == ["429", "503"]
    code, _, body = proxy.list()
    assert code == 429
    gcs_error(body, 429, "rateLimitExceeded")
    code, _, body = proxy.list()
    assert code == 503
    gcs_error(body, 503, "backendError")
    assert proxy.list()[0] == 200

    # reset before forwarding: nothing written
    name = fresh()
    srv.proxy_control("config", fail_next="reset")
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        proxy.media(name, b"lost", ifGenerationMatch=0)
    assert proxy.meta(name)[0] == 404
    # reset after forwarding: written, answer lost; a retry of the create-only write is 412
    srv.proxy_control("config", fail_next="reset_after")
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        proxy.media(name, b"kept", ifGenerationMatch=0)
    assert proxy.read(name)[2] == b"kept"
    assert proxy.media(name, b"retry", ifGenerationMatch=0)[0] == 412

    st = srv.proxy_control("stats")
    assert st["injected_429"] == 1 and st["injected_503"] == 1
    assert st["injected_reset"] == 1 and st["injected_reset_after"] == 1
    assert st["precondition_failed"] == 1

    # probabilities with a seed give the same sequence twice
    def run():
        srv.proxy_control("config", p_503=0.5, seed=7)
        return [proxy.list()[0] for _ in range(12)]

    first = run()
    assert set(first) == {200, 503}
    assert run() == first
    srv.proxy_control("config", p_503=0)
    assert req(srv.endpoint, "GET", "/__gcs_proxy__/config?p_503=2")[0] == 400
    assert req(srv.endpoint, "GET", "/__gcs_proxy__/config?fail_next=teapot")[0] == 400


def test_hostile_modes(srv, proxy):
    name = fresh()
    assert proxy.media(name, DATA)[0] == 200
    n = len(DATA)

    srv.proxy_control("config", hostile="flip", hostile_count=1)
    code, hdrs, body = proxy.read(name)
    assert code == 200 and len(body) == n and body != DATA
    assert sum(a != b for a, b in zip(body, DATA)) == 1
    assert hdrs["x-goog-hash"] == proxy.read(name)[1]["x-goog-hash"]  # the true bytes' hash
    assert proxy.read(name)[2] == DATA  # count 1: the next read is honest

    srv.proxy_control("config", hostile="truncate", hostile_count=1)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        proxy.read(name, headers={"Range": "bytes=100-1099"})
    assert proxy.read(name, headers={"Range": "bytes=100-1099"})[2] == DATA[100:1100]

    srv.proxy_control("config", hostile="ignore_range")
    for _ in range(2):
        code, _, body = proxy.read(name, headers={"Range": "bytes=100-199"})
        assert code == 200 and body == DATA
    srv.proxy_control("config", hostile="")
    assert proxy.read(name, headers={"Range": "bytes=100-199"})[2] == DATA[100:200]

    srv.proxy_control("config", hostile="shift_range", hostile_count=2)
    assert proxy.read(name)[2] == DATA  # not ranged: not shifted, and not counted
    for rng, want in (("bytes=100-199", DATA[99:199]), ("bytes=0-9", DATA[1:11])):
        code, hdrs, body = proxy.read(name, headers={"Range": rng})
        assert code == 206 and body == want, rng
        assert hdrs["content-range"] == f"bytes {rng[6:]}/{n}"
    assert proxy.read(name, headers={"Range": "bytes=0-9"})[2] == DATA[:10]
    st = srv.proxy_control("stats")
    assert st["hostile_served"] >= 6 and st["hostile_count"] == 0
    assert req(srv.endpoint, "GET", "/__gcs_proxy__/config?hostile=evil")[0] == 400


def test_hostile_reads_of_matching_objects_only_and_after_skipping_some(srv, proxy):
    a, b = fresh() + "/state/data/0-0.dat", fresh() + "/state/index"
    for name in (a, b):
        assert proxy.media(name, DATA)[0] == 200
    srv.proxy_control("reset_stats")
    srv.proxy_control("config", hostile="flip", hostile_match=r"/state/data/", hostile_skip=1,
                      hostile_count=1)
    assert proxy.read(b)[2] == DATA  # does not match: never flipped
    assert proxy.read(a)[2] == DATA  # matches, skipped
    assert proxy.read(b)[2] == DATA
    body = proxy.read(a)[2]          # flipped
    assert len(body) == len(DATA) and sum(x != y for x, y in zip(body, DATA)) == 1
    assert proxy.read(a)[2] == DATA  # count 1: spent
    st = srv.proxy_control("stats")
    assert st["hostile_served"] == 1 and st["hostile_objects"] == {a: 1}, st
    assert st["hostile_match"] == "/state/data/" and st["hostile_skip"] == 0, st
    # hostile= resets the pattern and the skip: every object again.
    st = srv.proxy_control("config", hostile="flip", hostile_count=1)
    assert st["hostile_match"] == "" and st["hostile_skip"] == 0, st
    assert proxy.read(b)[2] != DATA
    assert req(srv.endpoint, "GET", "/__gcs_proxy__/config?hostile_match=(")[0] == 400
    assert req(srv.endpoint, "GET", "/__gcs_proxy__/config?hostile_skip=-1")[0] == 400
    srv.proxy_control("config", hostile="")
