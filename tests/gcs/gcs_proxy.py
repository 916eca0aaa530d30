#!/usr/bin/env python3
"""An enforcing HTTP proxy in front of gcp-storage-emulator (stdlib only).

The emulator serves the GCS JSON API but ignores what the tensorstash driver relies on (measured
on 2026.7.19, /work/notes/issue41-plan.md section 1): preconditions, `generation=` on reads,
paging, 416, X-Goog-Generation, and it checks no credentials. Real GCS does all of that, so the
driver is tested through this proxy, which adds it back:

  * preconditions ifGenerationMatch / ifGenerationNotMatch / ifMetagenerationMatch /
    ifMetagenerationNotMatch on media, multipart and resumable uploads (checked at the start of
    the session and again when it is finalised), compose (destination, objectPreconditions and
    sourceObjects[].generation), delete and metadata patch: a failed one is 412 conditionNotMet;
  * compose: more than 32 sources is 400; a missing `destination` is filled in (the emulator
    drops the connection without one);
  * reads (metadata and media): ifGenerationMatch not met is 412, ifGenerationNotMatch met is
    304, `generation=G` that is not the live generation is 404; media answers carry
    X-Goog-Generation / X-Goog-Metageneration; a range that starts at or past the size is 416; a
    suffix range (`bytes=-N`) is answered as GCS does (the emulator ignores it);
  * listing paged by maxResults (default and cap 1000) with an opaque pageToken, and
    startOffset/endOffset applied;
  * an empty media upload is sent on as an empty multipart upload (the emulator crashes on it);
  * copyTo / rewriteTo: destination preconditions, source ones (ifSourceGenerationMatch...) and
    sourceGeneration;
  * cancelling a resumable session (DELETE on its URL) is 499, and the session is then 404;
  * a precondition or generation that is not a number is 400; the emulator's own error answers
    (often an empty body) are rewritten into GCS's JSON error form;
  * with --tokens FILE (on the --auth-port listener): a request must carry `Authorization:
    Bearer T` with T a line `T EXPIRES_AT` (unix seconds) of FILE, not expired; else 401.
    Requests to an open resumable session's URL need none (its upload_id is the credential).

Errors have GCS's JSON error form: {"error": {"code", "message", "errors": [{"domain",
"reason", "message"}]}}.

One lock is held around check + forward of every request, so that a check and the write it
guards are atomic (and the single-threaded emulator sees one request at a time). Both listeners
(open and token-checking) share that lock, the session table and the fault configuration.

Fault injection (decisions from random.Random(seed), one draw per forwarded request):
  GET /__gcs_proxy__/config?p_429=&p_503=&p_reset=&p_reset_after=&seed=&fail_next=503,reset
      p_429 / p_503: answer 429 rateLimitExceeded / 503 backendError without forwarding;
      p_reset: cut the connection (TCP reset) without forwarding;
      p_reset_after: forward (the request takes effect), then cut the connection unanswered;
      fail_next: a comma list of faults (429, 503, reset, reset_after, or pass: none) for the
      next requests, one each, before the probabilities are consulted. Returns the stats.
  GET /__gcs_proxy__/config?hostile=MODE&hostile_count=N&hostile_match=RE&hostile_skip=K
      a hostile server on media reads (after every check): flip (one byte of the body flipped,
      headers as for the true bytes), truncate (the whole length announced, half the body sent,
      then a reset), ignore_range (200 with the whole object), shift_range (the bytes one off
      from what Content-Range claims; ranged reads only). N: that many reads (default: all,
      until hostile= turns it off). RE: only reads of objects whose name matches the regular
      expression (re.search; default: every object), e.g. `/state/data/` for the data files
      of a tensorstash step. K: the first K reads that would be hostile are served true
      (default 0). Setting hostile= resets the other three. /stats counts the hostile answers
      (hostile_served) and names their objects (hostile_objects: name -> count).
  GET /__gcs_proxy__/config?strip_upload_crc32c=N
      the next N answers that complete an upload (multipart, media or a resumable session's
      last PUT) go back without their "crc32c" field (the upload itself happens), as a server
      or middlebox that leaves it out would. 0 turns it off.
  GET /__gcs_proxy__/config?compose_delay_s=S
      every compose is answered S seconds late (a server busy writing the composite); 0: off.
  GET /__gcs_proxy__/stats   JSON counters: requests, forwarded, status (by code), ops (by
      kind: media, multipart, resumable_start, session_put, compose, read, meta, list, ...),
      faults injected, precondition_failed, unauthorized.
  GET /__gcs_proxy__/reset_stats   zeroes the counters.

Command line (foreground; tests/gcs/gcs_servers.py runs it detached):
    python tests/gcs/gcs_proxy.py --upstream http://127.0.0.1:EPORT [--port 0]
        [--auth-port 0 --tokens FILE] [--ready-file PATH]
    prints `port=P` (and `auth_port=A`) on stdout once listening, and writes them to --ready-file.
"""

from __future__ import annotations

import argparse
import base64
import email.message
import email.parser
import email.policy
import http.client
import json
import os
import random
import re
import socket
import struct
import sys
import threading
import time
import traceback
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

CONTROL = "/__gcs_proxy__/"
MAX_COMPOSE_SOURCES = 32
MAX_PAGE = 1000
HOSTILE_MODES = ("flip", "truncate", "ignore_range", "shift_range")
UPSTREAM_TIMEOUT_S = 120.0

_OBJ_PATH_PREFIXES = ("/storage/v1/b/", "/b/")


def gcs_error(code: int, reason: str, message: str) -> bytes:
    """A body in GCS's JSON error form."""
    return json.dumps({"error": {"code": code, "message": message, "errors": [
        {"domain": "global", "reason": reason, "message": message}]}}).encode()


class _Fault(Exception):
    pass


class ProxyState:
    """What both listeners share: the lock, the upstream, sessions, faults and counters."""

    def __init__(self, upstream: str, tokens_file: Optional[str] = None):
        u = urllib.parse.urlsplit(upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream must be http://HOST:PORT, got {upstream!r}")
        self.up_host = u.hostname
        self.up_port = u.port or 80
        self.tokens_file = tokens_file
        self.lock = threading.Lock()
        self.sessions: dict[str, dict] = {}   # upload_id -> {"bucket", "name", "pre"}
        self.cancelled: set[str] = set()
        self.cfg_lock = threading.Lock()
        self.p = {"p_429": 0.0, "p_503": 0.0, "p_reset": 0.0, "p_reset_after": 0.0}
        self.seed: Optional[int] = None
        self.rng = random.Random()
        self.fail_next: list[str] = []
        self.hostile: Optional[str] = None
        self.hostile_left = -1  # -1: every media read while `hostile` is set
        self.hostile_match: Optional[re.Pattern] = None  # None: every object
        self.hostile_skip = 0  # hostile reads still to be served true
        self.strip_crc_left = 0  # upload answers still to lose their crc32c
        self.compose_delay_s = 0.0
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"requests": 0, "forwarded": 0, "status": {}, "injected_429": 0,
                      "injected_503": 0, "injected_reset": 0, "injected_reset_after": 0,
                      "precondition_failed": 0, "unauthorized": 0, "upstream_errors": 0,
                      "ops": {}, "hostile_served": 0, "hostile_objects": {}}

    def count_op(self, op: str) -> None:
        with self.cfg_lock:
            self.stats["ops"][op] = self.stats["ops"].get(op, 0) + 1

    def count_status(self, code: int) -> None:
        with self.cfg_lock:
            k = str(code)
            self.stats["status"][k] = self.stats["status"].get(k, 0) + 1

    def draw_fault(self) -> Optional[str]:
        with self.cfg_lock:
            if self.fail_next:
                return self.fail_next.pop(0)
            x = self.rng.random()
            acc = 0.0
            for name, key in (("429", "p_429"), ("503", "p_503"), ("reset", "p_reset"),
                              ("reset_after", "p_reset_after")):
                acc += self.p[key]
                if x < acc:
                    return name
            return None

    def take_hostile(self, ranged: bool, name: str) -> Optional[str]:
        """The hostile mode for this media read of object `name`, if any (range modes only for
        ranged reads of objects of 2 bytes or more; they wait for one)."""
        with self.cfg_lock:
            mode = self.hostile
            if mode is None or self.hostile_left == 0:
                return None
            if mode in ("ignore_range", "shift_range") and not ranged:
                return None
            if self.hostile_match is not None and not self.hostile_match.search(name):
                return None
            if self.hostile_skip > 0:
                self.hostile_skip -= 1
                return None
            if self.hostile_left > 0:
                self.hostile_left -= 1
            self.stats["hostile_served"] += 1
            objects = self.stats["hostile_objects"]
            objects[name] = objects.get(name, 0) + 1
            return mode

    def configure(self, q: dict[str, list[str]]) -> None:
        with self.cfg_lock:
            if "hostile" in q:
                mode = q["hostile"][0]
                if mode not in HOSTILE_MODES + ("",):
                    raise ValueError(f"unknown hostile mode {mode!r}; expected one of "
                                     f"{HOSTILE_MODES} or empty (off)")
                self.hostile = mode or None
                self.hostile_left = -1
                self.hostile_match = None
                self.hostile_skip = 0
            if "hostile_count" in q:
                self.hostile_left = int(q["hostile_count"][0])
            if "hostile_match" in q:
                pattern = q["hostile_match"][0]
                try:
                    self.hostile_match = re.compile(pattern) if pattern else None
                except re.error as e:
                    raise ValueError(f"hostile_match={pattern!r} is not a regular expression: "
                                     f"{e}") from None
            if "hostile_skip" in q:
                skip = int(q["hostile_skip"][0])
                if skip < 0:
                    raise ValueError(f"hostile_skip={skip} is negative")
                self.hostile_skip = skip
            for key in self.p:
                if key in q:
                    v = float(q[key][0])
                    if not 0.0 <= v <= 1.0:
                        raise ValueError(f"{key}={v} is not a probability")
                    self.p[key] = v
            if sum(self.p.values()) > 1.0:
                raise ValueError(f"the fault probabilities add up to more than 1: {self.p}")
            if "seed" in q:
                self.seed = int(q["seed"][0])
                self.rng = random.Random(self.seed)
            if "compose_delay_s" in q:
                delay = float(q["compose_delay_s"][0])
                if not 0.0 <= delay <= 600.0:
                    raise ValueError(f"compose_delay_s={delay} is not 0..600")
                self.compose_delay_s = delay
            if "strip_upload_crc32c" in q:
                n = int(q["strip_upload_crc32c"][0])
                if n < 0:
                    raise ValueError(f"strip_upload_crc32c={n} is negative")
                self.strip_crc_left = n
            if "fail_next" in q:
                faults = [f for f in q["fail_next"][0].split(",") if f]
                for f in faults:
                    if f not in ("429", "503", "reset", "reset_after", "pass"):
                        raise ValueError(f"unknown fault {f!r} in fail_next")
                self.fail_next = faults

    def snapshot(self) -> dict:
        with self.cfg_lock:
            return {**json.loads(json.dumps(self.stats)), **self.p, "seed": self.seed,
                    "fail_next": list(self.fail_next), "hostile": self.hostile or "",
                    "hostile_count": self.hostile_left,
                    "hostile_match": self.hostile_match.pattern if self.hostile_match else "",
                    "hostile_skip": self.hostile_skip,
                    "strip_upload_crc32c": self.strip_crc_left}

    def upload_answer_rewrite(self):
        """A rewrite that drops "crc32c" from an upload's answer, while strip_upload_crc32c
        lasts; else None."""
        with self.cfg_lock:
            if self.strip_crc_left <= 0:
                return None
            self.strip_crc_left -= 1

        def strip(raw: bytes) -> bytes:
            try:
                d = json.loads(raw)
            except ValueError:
                return raw
            if isinstance(d, dict):
                d.pop("crc32c", None)
            return json.dumps(d).encode()
        return strip

    def token_ok(self, header: Optional[str]) -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        tok = header[len("Bearer "):].strip()
        if not tok:
            return False
        try:
            with open(self.tokens_file) as f:
                lines = f.read().splitlines()
        except OSError:
            return False
        now = time.time()
        for line in lines:
            parts = line.split()
            if parts and parts[0] == tok:
                exp = float(parts[1]) if len(parts) > 1 else float("inf")
                if now < exp:
                    return True
        return False

    # -- upstream

    def upstream(self, method: str, target: str, headers: list[tuple[str, str]],
                 body: Optional[bytes]) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.up_host, self.up_port, timeout=UPSTREAM_TIMEOUT_S)
        conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        sent = set()
        for k, v in headers:
            lk = k.lower()
            if lk in ("content-length", "transfer-encoding", "connection", "keep-alive",
                      "proxy-connection", "expect"):
                continue
            conn.putheader(k, v)
            sent.add(lk)
        if "host" not in sent:
            conn.putheader("Host", f"{self.up_host}:{self.up_port}")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            conn.putheader("Content-Length", str(len(body or b"")))
        conn.putheader("Connection", "close")
        conn.endheaders(body or None)
        resp = conn.getresponse()
        resp._ts_conn = conn  # keep the connection alive as long as the response
        return resp

    def metadata(self, bucket: str, name: str) -> Optional[dict]:
        """The live object's resource from the emulator, None if there is none."""
        target = ("/storage/v1/b/" + urllib.parse.quote(bucket, safe="") + "/o/"
                  + urllib.parse.quote(name, safe=""))
        resp = self.upstream("GET", target, [], None)
        data = resp.read()
        resp._ts_conn.close()
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise RuntimeError(f"metadata of gs://{bucket}/{name}: emulator answered "
                               f"{resp.status}: {data[:200]!r}")
        return json.loads(data)


def _q1(q: dict[str, list[str]], key: str) -> Optional[str]:
    v = q.get(key)
    return v[0] if v else None


def precondition_failure(meta: Optional[dict], pre: dict[str, Optional[str]]) -> Optional[str]:
    """Why the preconditions in `pre` fail against the live object `meta` (None: all hold)."""
    gen = int(meta["generation"]) if meta else None
    mgen = int(meta.get("metageneration", 1)) if meta else None
    v = pre.get("ifGenerationMatch")
    if v is not None:
        v = int(v)
        if v == 0 and meta is not None:
            return f"ifGenerationMatch=0 but the object exists (generation {gen})"
        if v != 0 and gen != v:
            return f"ifGenerationMatch={v} but the live generation is {gen}"
    v = pre.get("ifGenerationNotMatch")
    if v is not None:
        v = int(v)
        if meta is None:
            return f"ifGenerationNotMatch={v} but there is no live object"
        if gen == v:
            return f"ifGenerationNotMatch={v} and the live generation is {gen}"
    v = pre.get("ifMetagenerationMatch")
    if v is not None:
        if meta is None or mgen != int(v):
            return f"ifMetagenerationMatch={v} but the live metageneration is {mgen}"
    v = pre.get("ifMetagenerationNotMatch")
    if v is not None:
        if meta is None or mgen == int(v):
            return f"ifMetagenerationNotMatch={v} and the live metageneration is {mgen}"
    return None


_PRE_KEYS = ("ifGenerationMatch", "ifGenerationNotMatch", "ifMetagenerationMatch",
             "ifMetagenerationNotMatch")


def _pre_from_query(q, keys=_PRE_KEYS, rename=None) -> dict[str, str]:
    """The preconditions in the query (400 if one is not a number); rename maps a query name
    to the name precondition_failure() knows (ifSourceGenerationMatch -> ifGenerationMatch)."""
    out = {}
    for k in keys:
        v = _q1(q, k)
        if v is None:
            continue
        if not v.strip().lstrip("-").isdigit():
            raise _Reply(400, "invalid", f"Invalid value for {k}: {v!r} (an int64 is expected)")
        out[(rename or {}).get(k, k)] = v.strip()
    return out


def _check_number(what: str, v: Optional[str]) -> Optional[str]:
    if v is not None and not v.strip().lstrip("-").isdigit():
        raise _Reply(400, "invalid", f"Invalid value for {what}: {v!r} (an int64 is expected)")
    return v.strip() if v is not None else None


_SRC_KEYS = ("ifSourceGenerationMatch", "ifSourceGenerationNotMatch",
             "ifSourceMetagenerationMatch", "ifSourceMetagenerationNotMatch")
_SRC_RENAME = {k: k.replace("Source", "") for k in _SRC_KEYS}


def _multipart_meta(content_type: str, body: bytes) -> dict:
    """The JSON metadata part (the first part) of a multipart/related upload body. Only the
    body up to the second delimiter is parsed: the email parser takes about a minute of CPU per
    GiB of data part, which made the proxy, not the client, the bottleneck of large uploads."""
    ctype = email.message.Message()
    ctype["Content-Type"] = content_type
    boundary = ctype.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise ValueError(f"no boundary in Content-Type {content_type!r}")
    delim = b"--" + boundary.encode()
    start = body.find(delim)
    second = body.find(delim, start + len(delim)) if start >= 0 else -1
    if second < 0:
        raise ValueError("not a multipart body (fewer than two delimiters)")
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body[:second] + delim
        + b"--\r\n")
    if not msg.is_multipart():
        raise ValueError("not a multipart body")
    first = next(iter(msg.iter_parts()))
    return json.loads(first.get_payload(decode=True) or b"{}")


def _parse_range(value: str) -> Optional[tuple[Optional[int], Optional[int]]]:
    """`bytes=S-E`, `bytes=S-` or `bytes=-N` → (S, E) / (S, None) / (None, N); None if not one
    range of that form (then it is forwarded as is)."""
    v = value.strip()
    if not v.startswith("bytes=") or "," in v:
        return None
    a, sep, b = v[6:].strip().partition("-")
    if not sep:
        return None
    try:
        if a == "":
            return (None, int(b))
        return (int(a), int(b) if b else None)
    except ValueError:
        return None


def _split_object_path(path: str) -> Optional[tuple[str, str, str]]:
    """(kind, bucket, name) for a JSON API path: kind is "list", "object", "compose",
    "upload", "download" or "other"; name is unquoted."""
    for api, kind_prefix in (("/upload/storage/v1/b/", "upload"),
                             ("/download/storage/v1/b/", "download"),
                             ("/storage/v1/b/", ""), ("/b/", "")):
        if path.startswith(api):
            rest = path[len(api):]
            bucket, sep, tail = rest.partition("/")
            if kind_prefix == "upload":
                return ("upload", urllib.parse.unquote(bucket), "")
            if not sep:
                return ("other", urllib.parse.unquote(bucket), "")
            if tail == "o":
                return ("list", urllib.parse.unquote(bucket), "")
            if not tail.startswith("o/"):
                return ("other", urllib.parse.unquote(bucket), "")
            obj = tail[2:]
            if kind_prefix == "download":
                return ("download", urllib.parse.unquote(bucket), urllib.parse.unquote(obj))
            if obj.endswith("/compose"):
                return ("compose", urllib.parse.unquote(bucket),
                        urllib.parse.unquote(obj[:-len("/compose")]))
            for special in ("/copyTo/b/", "/rewriteTo/b/"):
                if special in obj:
                    src, _, dst = obj.partition(special)
                    dbucket, _, dobj = dst.partition("/o/")
                    return ("copy", urllib.parse.unquote(bucket),
                            "\0".join((urllib.parse.unquote(src), urllib.parse.unquote(dbucket),
                                        urllib.parse.unquote(dobj))))
            for special in ("/acl", "/restore"):
                if special in obj:
                    return ("other", urllib.parse.unquote(bucket), "")
            return ("object", urllib.parse.unquote(bucket), urllib.parse.unquote(obj))
    return None


def _encode_token(after: str) -> str:
    return base64.urlsafe_b64encode(json.dumps({"v": 1, "after": after}).encode()).decode()


def _decode_token(tok: str) -> str:
    try:
        d = json.loads(base64.urlsafe_b64decode(tok.encode() + b"=" * (-len(tok) % 4)))
        if d.get("v") != 1 or not isinstance(d.get("after"), str):
            raise ValueError
        return d["after"]
    except Exception:
        raise ValueError(f"invalid pageToken {tok!r}") from None


_REASONS = {400: "invalid", 401: "required", 403: "forbidden", 404: "notFound", 409: "conflict",
            412: "conditionNotMet", 416: "requestedRangeNotSatisfiable", 429: "rateLimitExceeded",
            499: "clientClosedRequest", 501: "notImplemented", 503: "backendError"}


def _is_gcs_error(body: bytes) -> bool:
    try:
        e = json.loads(body)["error"]
        return isinstance(e["code"], int) and isinstance(e["errors"], list) and bool(e["message"])
    except Exception:
        return False


class _Reply(Exception):
    """Answer the client with this status, reason and message (GCS JSON error body)."""

    def __init__(self, code: int, reason: str, message: str, headers=()):
        super().__init__(message)
        self.code, self.reason, self.message, self.headers = code, reason, message, list(headers)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "gcs_proxy"
    state: ProxyState  # set on the server class

    def log_message(self, fmt, *args):  # one line per request, to stderr (the log file)
        sys.stderr.write("%s [%s] %s\n" % (self.server.server_address[1],
                                           self.log_date_time_string(), fmt % args))

    # -- plumbing

    def _read_body(self) -> bytes:
        te = self.headers.get("Transfer-Encoding", "")
        if "chunked" in te.lower():
            out = bytearray()
            while True:
                line = self.rfile.readline(65537)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline(65537)
        n = int(self.headers.get("Content-Length", "0") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, code: int, body: bytes, headers=(), content_type="application/json") -> None:
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        if content_type and not any(k.lower() == "content-type" for k, _ in headers):
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.state.count_status(code)

    def _error(self, r: _Reply) -> None:
        self._send(r.code, gcs_error(r.code, r.reason, r.message), r.headers)

    def _reset(self) -> None:
        """Close the client connection with a TCP reset (SO_LINGER 0)."""
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.close_connection = True
        try:
            self.connection.close()
        except OSError:
            pass

    def _relay(self, resp: http.client.HTTPResponse, extra_headers=(), rewrite=None,
               truncate: bool = False) -> None:
        """Send the upstream response on (its body buffered: the emulator is in memory).
        extra_headers replace upstream headers of the same name. truncate: announce the whole
        body, send half of it, then reset the connection."""
        body = resp.read()
        resp._ts_conn.close()
        if rewrite is not None:
            body = rewrite(body)
        replaced = {k.lower() for k, _ in extra_headers}
        headers = []
        for k, v in resp.getheaders():
            if k.lower() in ("content-length", "transfer-encoding", "connection", "keep-alive",
                             "server", "date") or k.lower() in replaced:
                continue
            headers.append((k, v))
        headers.extend(extra_headers)
        if truncate:
            self.send_response(resp.status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            self.state.count_status(resp.status)
            return self._reset()
        if resp.status >= 400 and not _is_gcs_error(body):
            # The emulator answers many errors with an empty or ad-hoc body; GCS's is JSON.
            msg = body.decode("utf-8", "replace").strip()[:500] or resp.reason or "error"
            try:
                msg = json.loads(body)["error"]["message"]
            except Exception:
                pass
            body = gcs_error(resp.status, _REASONS.get(resp.status, "backendError"
                                                      if resp.status >= 500 else "invalid"),
                             f"{msg} ({self.command} {urllib.parse.urlsplit(self.path).path})")
            headers = [(k, v) for k, v in headers if k.lower() != "content-type"]
            headers.append(("Content-Type", "application/json; charset=UTF-8"))
        self._send(resp.status, body, headers, content_type=None)

    # -- entry points

    def do_GET(self): self._handle()
    def do_POST(self): self._handle()
    def do_PUT(self): self._handle()
    def do_DELETE(self): self._handle()
    def do_PATCH(self): self._handle()
    def do_HEAD(self): self._handle()

    def _handle(self) -> None:
        st = self.state
        body = self._read_body()
        split = urllib.parse.urlsplit(self.path)
        path, q = split.path, urllib.parse.parse_qs(split.query, keep_blank_values=True)
        if path.startswith(CONTROL):
            return self._control(path[len(CONTROL):], q)
        with st.cfg_lock:
            st.stats["requests"] += 1
        # As on GCS, a resumable session's URL is its own credential: no token needed.
        session_url = (path.startswith("/upload/storage/v1/b/")
                       and _q1(q, "upload_id") in st.sessions)
        if (self.server.require_tokens and not session_url
                and not st.token_ok(self.headers.get("Authorization"))):
            with st.cfg_lock:
                st.stats["unauthorized"] += 1
            return self._error(_Reply(
                401, "required", "Anonymous caller or an unknown or expired token: this proxy "
                f"needs a bearer token listed in {st.tokens_file}",
                [("WWW-Authenticate", 'Bearer realm="gcs_proxy"')]))
        fault = st.draw_fault()
        if fault in ("429", "503"):
            with st.cfg_lock:
                st.stats["injected_" + fault] += 1
            code = int(fault)
            return self._error(_Reply(code, "rateLimitExceeded" if code == 429 else "backendError",
                                      f"injected {code} (gcs_proxy fault injection)"))
        if fault == "reset":
            with st.cfg_lock:
                st.stats["injected_reset"] += 1
            return self._reset()
        try:
            with st.lock:
                self._checked_forward(path, split.query, q, body,
                                      reset_after=(fault == "reset_after"))
        except _Reply as r:
            if r.code == 412:
                with st.cfg_lock:
                    st.stats["precondition_failed"] += 1
            self._error(r)
        except _Fault:
            with st.cfg_lock:
                st.stats["injected_reset_after"] += 1
            self._reset()
        except (OSError, http.client.HTTPException) as e:
            with st.cfg_lock:
                st.stats["upstream_errors"] += 1
            self._error(_Reply(502, "backendError",
                               f"gcs_proxy: the emulator failed on {self.command} {self.path}: {e!r}"))
        except Exception as e:  # a bug here must not look like a network fault to the client
            traceback.print_exc()
            self._error(_Reply(500, "backendError",
                               f"gcs_proxy: internal error on {self.command} {self.path}: {e!r}"))

    def _control(self, what: str, q) -> None:
        try:
            if what == "config":
                self.state.configure(q)
            elif what == "reset_stats":
                with self.state.cfg_lock:
                    self.state.reset_stats()
            elif what != "stats":
                raise ValueError(f"unknown control path {CONTROL}{what}")
        except ValueError as e:
            return self._send(400, gcs_error(400, "invalid", str(e)))
        self._send(200, json.dumps(self.state.snapshot()).encode())

    # -- the checks

    def _forward(self, target: Optional[str] = None, body: Optional[bytes] = None,
                 headers: Optional[list] = None) -> http.client.HTTPResponse:
        st = self.state
        with st.cfg_lock:
            st.stats["forwarded"] += 1
        hdrs = headers if headers is not None else [
            (k, v) for k, v in self.headers.items() if k.lower() != "authorization"]
        return st.upstream(self.command, target or self.path, hdrs, body)

    def _check_pre(self, bucket: str, name: str, pre: dict) -> Optional[dict]:
        meta = self.state.metadata(bucket, name)
        why = precondition_failure(meta, pre)
        if why:
            raise _Reply(412, "conditionNotMet",
                         f"Precondition failed on gs://{bucket}/{name}: {why}")
        return meta

    def _checked_forward(self, path: str, query: str, q, body: bytes, reset_after: bool) -> None:
        parts = _split_object_path(path)
        kind, bucket, name = parts if parts else ("other", "", "")
        method = self.command
        if kind == "compose" and method != "POST":  # an object whose name ends in /compose
            kind, name = "object", name + "/compose"
        self.state.count_op(_op_name(kind, method, q))
        handler = None
        if kind == "list" and method == "GET":
            handler = self._list
        elif kind in ("object", "download") and method in ("GET", "HEAD"):
            handler = self._read
        elif kind == "object" and method in ("DELETE", "PATCH"):
            handler = self._modify
        elif kind == "compose" and method == "POST":
            handler = self._compose
        elif kind == "copy" and method == "POST":
            handler = self._copy
        elif kind == "upload":
            handler = self._upload
        if handler is None:
            resp = self._forward(body=body if body or method in ("POST", "PUT", "PATCH") else None)
            return self._finish(resp, reset_after)
        handler(bucket, name, q, body, reset_after)

    def _finish(self, resp, reset_after: bool, extra_headers=(), rewrite=None,
                truncate: bool = False) -> None:
        if reset_after:
            resp.read()
            resp._ts_conn.close()
            raise _Fault()
        self._relay(resp, extra_headers, rewrite, truncate)

    def _read(self, bucket, name, q, body, reset_after) -> None:
        pre = _pre_from_query(q)
        want_gen = _check_number("generation", _q1(q, "generation"))
        meta = self.state.metadata(bucket, name)
        if meta is None:
            raise _Reply(404, "notFound", f"No such object: {bucket}/{name}")
        if want_gen is not None and str(meta["generation"]) != want_gen:
            raise _Reply(404, "notFound",
                         f"No such object: {bucket}/{name} generation {want_gen} (the live "
                         f"generation is {meta['generation']})")
        # GCS: a failed ifGenerationNotMatch / ifMetagenerationNotMatch on a read is 304.
        not_match = {k: v for k, v in pre.items() if k.endswith("NotMatch")}
        match = {k: v for k, v in pre.items() if not k.endswith("NotMatch")}
        why = precondition_failure(meta, match)
        if why:
            raise _Reply(412, "conditionNotMet", f"Precondition failed on gs://{bucket}/{name}: {why}")
        if precondition_failure(meta, not_match):
            self.send_response(304)
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.state.count_status(304)
            return
        media = (self.command in ("GET", "HEAD")
                 and (_q1(q, "alt") == "media" or path_is_download(self.path)))
        if not media:
            return self._finish(self._forward(), reset_after)
        gen_headers = [("X-Goog-Generation", str(meta["generation"])),
                       ("X-Goog-Metageneration", str(meta.get("metageneration", 1))),
                       ("X-Goog-Stored-Content-Length", str(meta.get("size", "0")))]
        size = int(meta.get("size", 0))
        headers = [(k, v) for k, v in self.headers.items() if k.lower() != "authorization"]
        rng_value = self.headers.get("Range")
        start = end = None
        if rng_value is not None:
            r = _parse_range(rng_value)
            if r is not None:
                start, end = r
                if start is None:  # suffix: the last `end` bytes
                    if end == 0 or size == 0:
                        raise _Reply(416, "requestedRangeNotSatisfiable",
                                     f"Range {rng_value} of gs://{bucket}/{name} ({size} bytes)",
                                     [("Content-Range", f"bytes */{size}")])
                    start, end = max(0, size - end), size - 1
                if start >= size:
                    raise _Reply(416, "requestedRangeNotSatisfiable",
                                 f"Range {rng_value} starts at or past the size of "
                                 f"gs://{bucket}/{name} ({size} bytes)",
                                 [("Content-Range", f"bytes */{size}")])
                headers = [(k, v) for k, v in headers if k.lower() != "range"]
                if end is not None and end < start:
                    start = end = None  # not a valid range: GCS ignores it (200, whole)
                else:
                    end = size - 1 if end is None else min(end, size - 1)
                    headers.append(("Range", f"bytes={start}-{end}"))
        # A hostile server, when asked (the config's `hostile`): wrong bytes, short bodies,
        # ranges ignored or shifted. Clients must answer each with an error or a correct retry.
        mode = self.state.take_hostile(ranged=start is not None and size > 1, name=name)
        rewrite, truncate = None, False
        if mode == "ignore_range":
            headers = [(k, v) for k, v in headers if k.lower() != "range"]
        elif mode == "shift_range":
            shift = -1 if start > 0 else 1
            s2, e2 = start + shift, min(end + shift, size - 1)
            headers = [(k, v) for k, v in headers if k.lower() != "range"]
            headers.append(("Range", f"bytes={s2}-{e2}"))
            gen_headers.append(("Content-Range", f"bytes {start}-{start + e2 - s2}/{size}"))
        elif mode == "flip":
            def rewrite(b: bytes) -> bytes:
                if not b:
                    return b
                i = len(b) // 2
                return b[:i] + bytes([b[i] ^ 0x01]) + b[i + 1:]
        elif mode == "truncate":
            truncate = True
        resp = self._forward(headers=headers)
        self._finish(resp, reset_after, gen_headers, rewrite, truncate)

    def _modify(self, bucket, name, q, body, reset_after) -> None:
        pre = _pre_from_query(q)
        want_gen = _check_number("generation", _q1(q, "generation"))
        if pre or want_gen is not None:
            meta = self._check_pre(bucket, name, pre)
            if want_gen is not None and (meta is None or str(meta["generation"]) != want_gen):
                raise _Reply(404, "notFound", f"No such object: {bucket}/{name} generation {want_gen}")
        resp = self._forward(body=body if self.command == "PATCH" else None)
        self._finish(resp, reset_after)

    def _copy(self, bucket, names, q, body, reset_after) -> None:
        """copyTo / rewriteTo: destination preconditions (ifGenerationMatch...), source ones
        (ifSourceGenerationMatch...) and sourceGeneration."""
        src, dbucket, dst = names.split("\0")
        src_pre = _pre_from_query(q, _SRC_KEYS, _SRC_RENAME)
        want = _check_number("sourceGeneration", _q1(q, "sourceGeneration"))
        meta = self.state.metadata(bucket, src)
        if meta is None or (want is not None and str(meta["generation"]) != want):
            raise _Reply(404, "notFound", f"No such object: {bucket}/{src}"
                         + (f" generation {want}" if want is not None else ""))
        why = precondition_failure(meta, src_pre)
        if why:
            raise _Reply(412, "conditionNotMet", f"Precondition failed on source gs://{bucket}/"
                         f"{src}: {why}")
        self._check_pre(dbucket, dst, _pre_from_query(q))
        self._finish(self._forward(body=body), reset_after)

    def _compose(self, bucket, name, q, body, reset_after) -> None:
        try:
            req = json.loads(body or b"{}")
            if not isinstance(req, dict):
                raise ValueError("not an object")
        except ValueError as e:
            raise _Reply(400, "parseError", f"compose of gs://{bucket}/{name}: bad JSON body: {e}")
        srcs = req.get("sourceObjects")
        if not isinstance(srcs, list) or not srcs:
            raise _Reply(400, "required", "compose: sourceObjects is required")
        if len(srcs) > MAX_COMPOSE_SOURCES:
            raise _Reply(400, "invalid", f"compose of gs://{bucket}/{name}: {len(srcs)} source "
                         f"objects, at most {MAX_COMPOSE_SOURCES} are allowed")
        for s in srcs:
            if not isinstance(s, dict) or not isinstance(s.get("name"), str):
                raise _Reply(400, "invalid", "compose: each source object needs a name")
            meta = self.state.metadata(bucket, s["name"])
            if meta is None:
                raise _Reply(404, "notFound", f"compose: no such source object {bucket}/{s['name']}")
            g = s.get("generation")
            if g is not None and str(g) != str(meta["generation"]):
                raise _Reply(404, "notFound", f"compose: source {bucket}/{s['name']} has no "
                             f"generation {g} (the live one is {meta['generation']})")
            op = s.get("objectPreconditions") or {}
            if "ifGenerationMatch" in op and str(op["ifGenerationMatch"]) != str(meta["generation"]):
                raise _Reply(412, "conditionNotMet", f"compose: source {bucket}/{s['name']}: "
                             f"ifGenerationMatch={op['ifGenerationMatch']} but the live generation "
                             f"is {meta['generation']}")
        self._check_pre(bucket, name, _pre_from_query(q))
        if self.state.compose_delay_s:
            time.sleep(self.state.compose_delay_s)
        dest = req.get("destination")
        if not isinstance(dest, dict):
            req["destination"] = {}
        body = json.dumps(req).encode()
        headers = [(k, v) for k, v in self.headers.items()
                   if k.lower() not in ("authorization", "content-type")]
        headers.append(("Content-Type", "application/json"))
        self._finish(self._forward(body=body, headers=headers), reset_after)

    def _upload(self, bucket, name, q, body, reset_after) -> None:
        utype = _q1(q, "uploadType")
        upload_id = _q1(q, "upload_id")
        if upload_id is not None:
            return self._resumable_continue(upload_id, q, body, reset_after)
        if self.command != "POST":
            return self._finish(self._forward(body=body), reset_after)
        pre = _pre_from_query(q)
        if utype == "media":
            name = _q1(q, "name")
            if name is None:
                raise _Reply(400, "required", "media upload without a name= parameter")
            self._check_pre(bucket, name, pre)
            if not body:
                return self._empty_media(name, reset_after)
            return self._finish(self._forward(body=body), reset_after,
                                rewrite=self.state.upload_answer_rewrite())
        if utype == "multipart":
            try:
                meta = _multipart_meta(self.headers.get("Content-Type", ""), body)
            except Exception as e:
                raise _Reply(400, "invalid", f"multipart upload: unreadable body: {e}")
            name = _q1(q, "name") or meta.get("name")
            if not name:
                raise _Reply(400, "required", "multipart upload without an object name")
            self._check_pre(bucket, name, pre)
            return self._finish(self._forward(body=body), reset_after,
                                rewrite=self.state.upload_answer_rewrite())
        if utype == "resumable":
            try:
                meta = json.loads(body) if body else {}
            except ValueError:
                raise _Reply(400, "parseError", "resumable upload start: bad JSON body")
            name = _q1(q, "name") or (meta.get("name") if isinstance(meta, dict) else None)
            if not name:
                raise _Reply(400, "required", "resumable upload start without an object name")
            self._check_pre(bucket, name, pre)
            resp = self._forward(body=body)
            loc = resp.getheader("Location")
            if resp.status == 200 and loc:
                lq = urllib.parse.parse_qs(urllib.parse.urlsplit(loc).query)
                uid = _q1(lq, "upload_id")
                if uid:
                    self.state.sessions[uid] = {"bucket": bucket, "name": name, "pre": pre}
            return self._finish(resp, reset_after)
        return self._finish(self._forward(body=body), reset_after)

    def _empty_media(self, name: str, reset_after: bool) -> None:
        boundary = "gcs_proxy_" + os.urandom(8).hex()
        ctype = self.headers.get("Content-Type") or "application/octet-stream"
        mp = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
              f"{json.dumps({'name': name})}\r\n--{boundary}\r\nContent-Type: {ctype}\r\n\r\n"
              f"\r\n--{boundary}--\r\n").encode()
        split = urllib.parse.urlsplit(self.path)
        q = [(k, v) for k, v in urllib.parse.parse_qsl(split.query, keep_blank_values=True)
             if k != "uploadType"] + [("uploadType", "multipart")]
        target = split.path + "?" + urllib.parse.urlencode(q)
        headers = [(k, v) for k, v in self.headers.items()
                   if k.lower() not in ("authorization", "content-type")]
        headers.append(("Content-Type", f"multipart/related; boundary={boundary}"))
        self._finish(self._forward(target=target, body=mp, headers=headers), reset_after)

    def _resumable_continue(self, upload_id, q, body, reset_after) -> None:
        st = self.state
        if upload_id in st.cancelled:
            if self.command == "DELETE":
                raise _Reply(499, "clientClosedRequest", f"upload {upload_id} was cancelled")
            raise _Reply(404, "notFound", f"resumable upload {upload_id} was cancelled")
        sess = st.sessions.get(upload_id)
        if self.command == "DELETE":
            st.cancelled.add(upload_id)
            st.sessions.pop(upload_id, None)
            raise _Reply(499, "clientClosedRequest", f"resumable upload {upload_id} cancelled")
        if sess is not None and self._finalises(len(body)):
            pre = dict(sess["pre"])
            pre.update(_pre_from_query(q))
            self._check_pre(sess["bucket"], sess["name"], pre)
        resp = self._forward(body=body)
        rewrite = None
        if resp.status in (200, 201):
            st.sessions.pop(upload_id, None)
            rewrite = st.upload_answer_rewrite()
        self._finish(resp, reset_after, rewrite=rewrite)

    def _finalises(self, nbody: int) -> bool:
        """Whether this PUT completes the session (Content-Range forms as GCS defines them)."""
        cr = (self.headers.get("Content-Range") or "").strip()
        if not cr:
            return True
        if not cr.startswith("bytes "):
            return False
        rng, _, total = cr[6:].partition("/")
        if total == "*" or not total.isdigit():
            return False
        if rng == "*":
            return True
        a, _, b = rng.partition("-")
        try:
            end = int(b) if b != "*" else int(a) + nbody - 1
        except ValueError:
            return False
        return end + 1 >= int(total)

    def _list(self, bucket, name, q, body, reset_after) -> None:
        try:
            max_results = int(_q1(q, "maxResults") or MAX_PAGE)
            if max_results <= 0:
                raise ValueError
        except ValueError:
            raise _Reply(400, "invalid", f"invalid maxResults {_q1(q, 'maxResults')!r}")
        max_results = min(max_results, MAX_PAGE)
        after = None
        tok = _q1(q, "pageToken")
        if tok:
            try:
                after = _decode_token(tok)
            except ValueError as e:
                raise _Reply(400, "invalid", str(e))
        start_off, end_off = _q1(q, "startOffset"), _q1(q, "endOffset")
        split = urllib.parse.urlsplit(self.path)
        keep = [(k, v) for k, v in urllib.parse.parse_qsl(split.query, keep_blank_values=True)
                if k not in ("maxResults", "pageToken", "startOffset", "endOffset")]
        target = split.path + ("?" + urllib.parse.urlencode(keep) if keep else "")
        resp = self._forward(target=target)

        def page(raw: bytes) -> bytes:
            if resp.status != 200:
                return raw
            d = json.loads(raw)
            entries = [(it["name"], "item", it) for it in d.get("items") or []]
            entries += [(p, "prefix", p) for p in d.get("prefixes") or []]
            if start_off:
                entries = [e for e in entries if e[0] >= start_off]
            if end_off:
                entries = [e for e in entries if e[0] < end_off]
            entries.sort(key=lambda e: e[0])
            if after is not None:
                entries = [e for e in entries if e[0] > after]
            chunk, more = entries[:max_results], len(entries) > max_results
            out = {"kind": d.get("kind", "storage#objects")}
            items = [e[2] for e in chunk if e[1] == "item"]
            prefixes = [e[2] for e in chunk if e[1] == "prefix"]
            if items:
                out["items"] = items
            if prefixes:
                out["prefixes"] = prefixes
            if more:
                out["nextPageToken"] = _encode_token(chunk[-1][0])
            return json.dumps(out).encode()

        self._finish(resp, reset_after, rewrite=page)


def _op_name(kind: str, method: str, q) -> str:
    """The request's name in stats["ops"]: list, read, meta, delete, patch, compose, copy,
    media, multipart, resumable_start, session_put, session_cancel, or METHOD_other."""
    if kind == "upload":
        if _q1(q, "upload_id") is not None:
            return "session_cancel" if method == "DELETE" else "session_put"
        t = _q1(q, "uploadType") or "?"
        return "resumable_start" if t == "resumable" else t
    if kind == "object" or kind == "download":
        if method in ("GET", "HEAD"):
            return "read" if kind == "download" or _q1(q, "alt") == "media" else "meta"
        return method.lower()
    if kind in ("list", "compose", "copy"):
        return kind
    return method + "_other"


def path_is_download(path: str) -> bool:
    return path.startswith("/download/storage/v1/")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False

    def __init__(self, addr, state: ProxyState, require_tokens: bool):
        handler = type("BoundHandler", (Handler,), {"state": state})
        super().__init__(addr, handler)
        self.require_tokens = require_tokens


class GcsProxy:
    """The proxy in this process (threads): an open listener and, with tokens_file, a
    token-checking one. Usable as a context manager."""

    def __init__(self, upstream: str, port: int = 0, tokens_file: Optional[str] = None,
                 auth_port: int = 0, host: str = "127.0.0.1"):
        self.state = ProxyState(upstream, tokens_file)
        self.servers = [_Server((host, port), self.state, False)]
        if tokens_file:
            self.servers.append(_Server((host, auth_port), self.state, True))
        self.threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in self.servers]
        for t in self.threads:
            t.start()

    @property
    def endpoint(self) -> str:
        return "http://127.0.0.1:%d" % self.servers[0].server_address[1]

    @property
    def auth_endpoint(self) -> Optional[str]:
        if len(self.servers) < 2:
            return None
        return "http://127.0.0.1:%d" % self.servers[1].server_address[1]

    def close(self) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()

    def __enter__(self) -> "GcsProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="the emulator, http://127.0.0.1:PORT")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tokens", help="bearer tokens file (lines `TOKEN EXPIRES_AT`)")
    ap.add_argument("--auth-port", type=int, default=0,
                    help="port of the token-checking listener (with --tokens)")
    ap.add_argument("--ready-file", help="written (port=, auth_port=) once listening")
    a = ap.parse_args(argv)
    if a.tokens and not os.path.exists(a.tokens):
        open(a.tokens, "a").close()
    p = GcsProxy(a.upstream, a.port, a.tokens, a.auth_port)
    text = f"port={p.servers[0].server_address[1]}\n"
    if p.auth_endpoint:
        text += f"auth_port={p.servers[1].server_address[1]}\n"
    if a.ready_file:
        tmp = a.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, a.ready_file)
    sys.stdout.write(text)
    sys.stdout.flush()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        p.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
