"""Fixtures of the tests of tensorstash on GCS (test_gcs.py, test_gcs_jax.py): the emulator
behind the enforcing proxy and the credential fakes for the module (tests/gcs/gcs_servers.py),
and a closed port of 127.0.0.1 to point Google's metadata-server lookup at. Import them into a
test module:

    from gcs_fixtures import NO_METADATA_SERVER, gcs_servers, server  # noqa: F401

Importing this module puts tests/gcs on sys.path, so that gcs_servers imports.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "gcs"))

import gcs_servers  # noqa: E402


def closed_port() -> str:
    """127.0.0.1:P with nothing listening on P (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# Where the GCE metadata server is looked for (GCE_METADATA_HOST and friends) in these tests:
# Google's libraries and TensorStore ask it for a token when they find no credentials, and it
# must never be the real link-local address.
NO_METADATA_SERVER = closed_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The emulator, the enforcing proxy and the credential fakes, for the module."""
    srv = gcs_servers.start(str(tmp_path_factory.mktemp("gcs")))
    try:
        yield srv
    finally:
        srv.stop()
