#!/usr/bin/env python3
"""Local fakes of Google's credential endpoints, for the tests of the GCS credential chain.

Stdlib + `cryptography` (in the project's .venv through moto). Both listen on 127.0.0.1 only.

TokenServer: an OAuth 2.0 token endpoint (POST /token, form-encoded) for the two grants Google's
libraries send:
  * `grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer&assertion=JWT`: the JWT of a
    service-account key. Its RS256 signature is verified with the public half of a key
    registered with add_service_account() (looked up by the header's `kid`), and its claims are
    checked: `iss` is that key's client_email, `aud` is this endpoint's URL, `scope` holds one
    of the accepted scopes, 0 < exp - iat <= 3600, iat not in the future (60 s of skew) and exp
    not past.
  * `grant_type=refresh_token` with client_id, client_secret and refresh_token of a registered
    authorized user.
  A grant answers {"access_token", "expires_in", "token_type": "Bearer"} with expires_in as
  configured (default 3600), and appends `TOKEN EXPIRES_AT` to the tokens file (the one the
  proxy of gcs_proxy.py --tokens checks). A refusal is 400 {"error": "invalid_grant",
  "error_description": why} (401 invalid_client for a wrong client id or secret).
  Counters: grants["jwt"], grants["refresh"], grants["metadata"] (tokens the metadata server
  handed out), refused, last_refusal.

MetadataServer: the GCE metadata server. GET /computeMetadata/v1/instance/service-accounts/
default/token (and .../project/project-id, .../instance/service-accounts/default/email) need
`Metadata-Flavor: Google` (403 without it) and answer with that header. Its tokens are issued
by the TokenServer (same tokens file) with the metadata server's own expires_in. It can be made
slow (`delay_s`) or silent (accepts the connection, never answers); counts token requests.

Control (both servers): GET /__fake__/stats, GET /__fake__/config?expires_in=&delay_s=&silent=
(silent=1 or 0), returning the stats as JSON.

Helpers: write_service_account_key() writes a fresh RSA-2048 key file (and registers its public
half with the token server); write_authorized_user() writes an authorized_user file; both point
at the fake's token URL (`token_uri`).

Command line (foreground; `tests/gcs/gcs_servers.py start` runs it detached)::

    python tests/gcs/gcs_fakes.py --tokens FILE --workdir DIR [--ready-file PATH]
        writes DIR/sa-key.json and DIR/authorized-user.json and prints (and writes to
        --ready-file) token_uri=, metadata_host=, sa_key=, authorized_user=
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

JWT_GRANT = "urn:ietf:params:oauth:grant-type:jwt-bearer"
ACCEPTED_SCOPES = ("https://www.googleapis.com/auth/devstorage.full_control",
                   "https://www.googleapis.com/auth/devstorage.read_write",
                   "https://www.googleapis.com/auth/devstorage.read_only",
                   "https://www.googleapis.com/auth/cloud-platform")
MAX_LIFETIME_S = 3600
SKEW_S = 60
PROJECT_ID = "tensorstash-test-project"
CONTROL = "/__fake__/"


def b64url_decode(s: str) -> bytes:
    return base64.urlsafe_b64decode(s.encode() + b"=" * (-len(s) % 4))


def b64url(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def sign_jwt(private_key, kid: str, claims: dict) -> str:
    """An RS256 JWT of `claims` (used by the tests to forge assertions)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    header = {"alg": "RS256", "typ": "JWT", "kid": kid}
    signing_input = (b64url(json.dumps(header).encode()) + "."
                     + b64url(json.dumps(claims).encode()))
    sig = private_key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
    return signing_input + "." + b64url(sig)


def new_rsa_key():
    from cryptography.hazmat.primitives.asymmetric import rsa
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


class _FakeBase:
    """A ThreadingHTTPServer on 127.0.0.1 in a thread, with stats and a config endpoint."""

    def __init__(self, port: int = 0):
        self.lock = threading.Lock()
        self.expires_in = 3600
        self.delay_s = 0.0
        self.silent = False
        self.requests = 0
        owner = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):
                sys.stderr.write("%s %s\n" % (type(owner).__name__, fmt % args))

            def do_GET(self):
                owner._dispatch(self)

            def do_POST(self):
                owner._dispatch(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), H)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def send(h: BaseHTTPRequestHandler, code: int, obj, headers=()) -> None:
        body = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
        h.send_response(code)
        for k, v in headers:
            h.send_header(k, v)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def stats(self) -> dict:
        return {"requests": self.requests, "expires_in": self.expires_in,
                "delay_s": self.delay_s, "silent": self.silent}

    def _dispatch(self, h: BaseHTTPRequestHandler) -> None:
        n = int(h.headers.get("Content-Length", "0") or 0)
        body = h.rfile.read(n) if n else b""
        split = urllib.parse.urlsplit(h.path)
        if split.path.startswith(CONTROL):
            q = urllib.parse.parse_qs(split.query)
            try:
                with self.lock:
                    if "expires_in" in q:
                        self.expires_in = int(q["expires_in"][0])
                    if "delay_s" in q:
                        self.delay_s = float(q["delay_s"][0])
                    if "silent" in q:
                        self.silent = q["silent"][0] not in ("0", "false", "")
            except ValueError as e:
                return self.send(h, 400, {"error": str(e)})
            with self.lock:
                return self.send(h, 200, self.stats())
        with self.lock:
            self.requests += 1
            delay, silent = self.delay_s, self.silent
        if silent:
            # Hold the connection open without an answer until the client gives up.
            h.close_connection = True
            h.connection.settimeout(300)
            try:
                while h.connection.recv(65536):
                    pass
            except OSError:
                pass
            return
        if delay:
            time.sleep(delay)
        self.handle(h, split.path, body)

    def handle(self, h, path: str, body: bytes) -> None:  # pragma: no cover
        raise NotImplementedError


class TokenServer(_FakeBase):
    """The fake OAuth token endpoint (see the module docstring)."""

    def __init__(self, tokens_file: str, port: int = 0):
        self.tokens_file = tokens_file
        self.service_accounts: dict[str, tuple[str, object]] = {}  # kid -> (email, public key)
        self.users: dict[str, tuple[str, str]] = {}                # client_id -> (secret, refresh)
        self.grants = {"jwt": 0, "refresh": 0, "metadata": 0}
        self.refused = 0
        self.last_refusal = ""
        self.issued: list[str] = []
        super().__init__(port)

    @property
    def token_uri(self) -> str:
        return self.url + "/token"

    def stats(self) -> dict:
        return {**super().stats(), "grants": dict(self.grants), "refused": self.refused,
                "last_refusal": self.last_refusal}

    def add_service_account(self, kid: str, client_email: str, public_key) -> None:
        with self.lock:
            self.service_accounts[kid] = (client_email, public_key)

    def add_user(self, client_id: str, client_secret: str, refresh_token: str) -> None:
        with self.lock:
            self.users[client_id] = (client_secret, refresh_token)

    def issue(self, kind: str, expires_in: Optional[int] = None) -> dict:
        """A new token, appended to the tokens file and counted as a `kind` grant."""
        tok = "ya29.fake-" + secrets.token_urlsafe(24)
        with self.lock:
            if expires_in is None:
                expires_in = self.expires_in
            self.grants[kind] += 1
            self.issued.append(tok)
            with open(self.tokens_file, "a") as f:
                f.write(f"{tok} {time.time() + expires_in:.3f}\n")
        return {"access_token": tok, "expires_in": expires_in, "token_type": "Bearer"}

    def _refuse(self, h, why: str, code: int = 400, error: str = "invalid_grant") -> None:
        with self.lock:
            self.refused += 1
            self.last_refusal = why
        self.send(h, code, {"error": error, "error_description": why})

    def check_jwt(self, assertion: str) -> Optional[str]:
        """Why the assertion is refused (None: it is good)."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        parts = assertion.split(".")
        if len(parts) != 3:
            return "assertion is not a JWT (three dot-separated parts)"
        try:
            header = json.loads(b64url_decode(parts[0]))
            claims = json.loads(b64url_decode(parts[1]))
            sig = b64url_decode(parts[2])
        except ValueError as e:
            return f"assertion does not decode: {e}"
        if not isinstance(header, dict) or not isinstance(claims, dict):
            return "JWT header or claims are not JSON objects"
        if header.get("alg") != "RS256":
            return f"alg is {header.get('alg')!r}, not RS256"
        kid = header.get("kid")
        with self.lock:
            sa = self.service_accounts.get(kid)
        if sa is None:
            return f"unknown kid {kid!r}"
        email, pub = sa
        try:
            pub.verify(sig, (parts[0] + "." + parts[1]).encode(), padding.PKCS1v15(),
                       hashes.SHA256())
        except InvalidSignature:
            return "Invalid JWT Signature."
        if claims.get("iss") != email:
            return f"iss is {claims.get('iss')!r}, not {email!r}"
        if claims.get("aud") != self.token_uri:
            return f"aud is {claims.get('aud')!r}, not {self.token_uri!r}"
        scopes = str(claims.get("scope", "")).split()
        if not any(s in ACCEPTED_SCOPES for s in scopes):
            return f"scope {claims.get('scope')!r} holds none of {ACCEPTED_SCOPES}"
        iat, exp = claims.get("iat"), claims.get("exp")
        if not isinstance(iat, int) or not isinstance(exp, int):
            return "iat and exp must be integers"
        now = time.time()
        if not 0 < exp - iat <= MAX_LIFETIME_S:
            return f"exp - iat = {exp - iat} s, must be in (0, {MAX_LIFETIME_S}]"
        if iat > now + SKEW_S:
            return f"iat {iat} is in the future (now {now:.0f})"
        if exp < now - SKEW_S:
            return f"exp {exp} is past (now {now:.0f})"
        return None

    def handle(self, h, path: str, body: bytes) -> None:
        if h.command != "POST" or path != "/token":
            return self.send(h, 404, {"error": "not_found", "error_description": path})
        form = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
        grant = (form.get("grant_type") or [""])[0]
        if grant == JWT_GRANT:
            why = self.check_jwt((form.get("assertion") or [""])[0])
            if why:
                return self._refuse(h, why)
            return self.send(h, 200, self.issue("jwt"))
        if grant == "refresh_token":
            cid = (form.get("client_id") or [""])[0]
            with self.lock:
                user = self.users.get(cid)
            if user is None or (form.get("client_secret") or [""])[0] != user[0]:
                return self._refuse(h, "The OAuth client was not found or its secret is wrong.",
                                    401, "invalid_client")
            if (form.get("refresh_token") or [""])[0] != user[1]:
                return self._refuse(h, "Bad refresh token.")
            return self.send(h, 200, self.issue("refresh"))
        return self._refuse(h, f"unsupported grant_type {grant!r}", 400, "unsupported_grant_type")


class MetadataServer(_FakeBase):
    """The fake GCE metadata server; its tokens come from (and are counted by) a TokenServer."""

    def __init__(self, tokens: TokenServer, port: int = 0,
                 email: str = "default-sa@tensorstash-test-project.iam.gserviceaccount.com"):
        self.tokens = tokens
        self.email = email
        self.token_requests = 0
        super().__init__(port)

    @property
    def host(self) -> str:
        """What GCE_METADATA_HOST holds: host:port."""
        return f"127.0.0.1:{self.port}"

    def stats(self) -> dict:
        return {**super().stats(), "token_requests": self.token_requests}

    def handle(self, h, path: str, body: bytes) -> None:
        flavor = [("Metadata-Flavor", "Google")]
        if h.headers.get("Metadata-Flavor") != "Google":
            return self.send(h, 403, b"Missing Metadata-Flavor:Google header.\n", flavor)
        if path in ("/", "/computeMetadata/v1", "/computeMetadata/v1/"):
            return self.send(h, 200, {"instance": {}, "project": {}}, flavor)
        if path == "/computeMetadata/v1/project/project-id":
            return self.send(h, 200, PROJECT_ID.encode(), flavor)
        if path == "/computeMetadata/v1/instance/service-accounts/default/email":
            return self.send(h, 200, self.email.encode(), flavor)
        if path == "/computeMetadata/v1/instance/service-accounts/default/token":
            with self.lock:
                self.token_requests += 1
                expires_in = self.expires_in
            tok = self.tokens.issue("metadata", expires_in)
            return self.send(h, 200, tok, flavor)
        return self.send(h, 404, b"Not found\n", flavor)


def write_service_account_key(path: str, tokens: Optional[TokenServer],
                              client_email: str = "ts-test@tensorstash-test-project.iam.gserviceaccount.com",
                              register: bool = True, token_uri: Optional[str] = None):
    """Write a fresh RSA-2048 service-account key file at path; register its public half with
    `tokens` (unless register=False). Returns (key id, private key)."""
    from cryptography.hazmat.primitives import serialization

    key = new_rsa_key()
    kid = secrets.token_hex(20)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    uri = token_uri or (tokens.token_uri if tokens else "https://oauth2.googleapis.com/token")
    info = {"type": "service_account", "project_id": PROJECT_ID, "private_key_id": kid,
            "private_key": pem, "client_email": client_email, "client_id": "1" + "0" * 20,
            "auth_uri": "https://accounts.google.com/o/oauth2/auth", "token_uri": uri}
    _write_private(path, info)
    if register and tokens is not None:
        tokens.add_service_account(kid, client_email, key.public_key())
    return kid, key


def write_authorized_user(path: str, tokens: Optional[TokenServer], register: bool = True,
                          token_uri: Optional[str] = None) -> dict:
    """Write an authorized_user file (what `gcloud auth application-default login` writes, plus
    `token_uri` pointing at the fake); register the user with `tokens`. Returns its fields."""
    info = {"type": "authorized_user",
            "client_id": secrets.token_hex(8) + ".apps.googleusercontent.com",
            "client_secret": secrets.token_urlsafe(18),
            "refresh_token": "1//fake-" + secrets.token_urlsafe(30),
            "quota_project_id": PROJECT_ID}
    uri = token_uri or (tokens.token_uri if tokens else None)
    if uri:
        info["token_uri"] = uri
    _write_private(path, info)
    if register and tokens is not None:
        tokens.add_user(info["client_id"], info["client_secret"], info["refresh_token"])
    return info


def _write_private(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", required=True, help="the proxy's tokens file (appended to)")
    ap.add_argument("--workdir", required=True, help="where the key files are written")
    ap.add_argument("--ready-file")
    a = ap.parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    tokens = TokenServer(a.tokens)
    meta = MetadataServer(tokens)
    sa = os.path.join(os.path.abspath(a.workdir), "sa-key.json")
    au = os.path.join(os.path.abspath(a.workdir), "authorized-user.json")
    write_service_account_key(sa, tokens)
    write_authorized_user(au, tokens)
    text = (f"token_uri={tokens.token_uri}\nmetadata_host={meta.host}\nsa_key={sa}\n"
            f"authorized_user={au}\n")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
