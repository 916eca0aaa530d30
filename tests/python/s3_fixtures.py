"""Fixtures of the tests of tensorstash on S3 (test_s3.py, test_s3_jax.py): a local SeaweedFS
server for the module (tests/s3/s3_servers.py) and, per test, its AWS settings in this process
and a fresh key prefix. Import them into a test module:

    from s3_fixtures import S3, server, s3  # noqa: F401

Importing this module puts tests/s3 on sys.path, so that s3_servers and fault_proxy import.
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from dataclasses import dataclass

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "s3"))

import s3_servers  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One SeaweedFS server (signatures checked, conditional writes honoured) for the module."""
    srv = s3_servers.start("seaweedfs", str(tmp_path_factory.mktemp("seaweedfs")))
    try:
        yield srv
    finally:
        srv.stop()
    assert not srv.alive()


def list_keys(server, prefix: str) -> list[str]:
    """Every key of the server's bucket under `prefix`, sorted (paginated)."""
    c = server.client()
    out, token = [], None
    while True:
        kw = {"Bucket": server.bucket, "Prefix": prefix}
        if token:
            kw["ContinuationToken"] = token
        r = c.list_objects_v2(**kw)
        out += [o["Key"] for o in r.get("Contents", [])]
        if not r.get("IsTruncated"):
            return sorted(out)
        token = r["NextContinuationToken"]


@dataclass
class S3:
    server: s3_servers.Server
    bucket: str
    prefix: str  # key prefix of this test, no trailing '/'
    url: str     # "s3://<bucket>/<prefix>"

    def step(self, name: str = "0000000001") -> str:
        return f"{self.url}/{name}"

    def client(self):
        return self.server.client()

    def keys(self, prefix: str | None = None) -> list[str]:
        """Every key under `prefix` (default: this test's prefix + '/'), paginated."""
        return list_keys(self.server, self.prefix + "/" if prefix is None else prefix)

    def env(self) -> dict[str, str]:
        """The environment for a subprocess: this process's, AWS settings included."""
        return dict(os.environ)


def aws_vars(server, scratch: str) -> dict[str, str]:
    """The AWS settings that point the engine at `server` and at nothing else: no shared files
    from the home directory (names under `scratch` that do not exist), no instance metadata."""
    return {
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_REGION": server.region,
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_SHARED_CREDENTIALS_FILE": os.path.join(scratch, "no-such-aws-credentials"),
        "AWS_CONFIG_FILE": os.path.join(scratch, "no-such-aws-config"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def unique_prefix(name: str) -> str:
    """A fresh key prefix named after `name` (a test's)."""
    return f"{re.sub(r'[^a-z0-9-]+', '-', name.lower()).strip('-')[:60]}-{secrets.token_hex(4)}"


@pytest.fixture
def s3(server, monkeypatch, tmp_path, request):
    """The AWS environment of `server` set in this process (every other AWS_* variable removed),
    and a fresh prefix for the test."""
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    for k, v in aws_vars(server, str(tmp_path)).items():
        monkeypatch.setenv(k, v)
    prefix = unique_prefix(request.node.name)
    return S3(server, server.bucket, prefix, f"s3://{server.bucket}/{prefix}")
