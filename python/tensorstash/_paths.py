"""Step paths and store URLs as the engine takes them (kvstore/registry.h opens every store)."""

from __future__ import annotations

import os

from . import _ext, _tree


def abspath(path: str | os.PathLike) -> str:
    """The absolute form of a folder path, or a store URL ("memory://run") as it is. ValueError
    for a path that is not valid Unicode (undecodable bytes of a file name, which Python keeps
    as lone surrogates): the engine takes UTF-8 paths."""
    text = os.fspath(path)
    _tree.check_text(text, f"the path {text!r}", "tensorstash takes UTF-8 paths only")
    return text if _ext.has_url_scheme(text) else os.path.abspath(text)


def split(path: str | os.PathLike) -> tuple[str, str]:
    """A step folder's path or URL -> (its root's path or URL, the step's name), as the engine
    splits it (kvstore/registry.h): the root is opened by URL, the step is a key in it."""
    text = os.fspath(path)
    _tree.check_text(text, f"the path {text!r}", "tensorstash takes UTF-8 paths only")
    return _ext.split_step_url(text)


def configure_s3(*, endpoint: str | None = None, region: str | None = None,
                 path_style: bool | None = None, profile: str | None = None,
                 access_key_id: str | None = None, secret_access_key: str | None = None,
                 session_token: str | None = None, anonymous: bool = False,
                 prefix: str | None = None) -> None:
    """Explicit settings for the ``s3://`` paths opened from now on in this process.

    Each argument given wins over the environment (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
    ``AWS_PROFILE``) and the AWS config files; ``None`` keeps what they say. ``endpoint`` is
    ``"http(s)://host[:port]"``; ``path_style`` chooses ``host/bucket/key`` over
    ``bucket.host/key`` (custom endpoints default to path style). Keys given here replace the
    credential chain (environment, shared files, web identity, container, instance metadata);
    ``anonymous=True`` sends unsigned requests.

    ``prefix`` (``"s3://bucket"`` or ``"s3://bucket/path"``) scopes the settings to the paths at
    or under it, so that two buckets in one process can have different endpoints or keys::

        tensorstash.configure_s3(endpoint="http://minio-a:9000", prefix="s3://bucket-a")
        tensorstash.configure_s3(endpoint="http://minio-b:9000", prefix="s3://bucket-b")

    A path takes the settings of the longest prefix it lies under (``"s3://b"`` covers
    ``"s3://b/run"``, not ``"s3://bb"``), and the settings given without ``prefix`` when none
    matches. Each call replaces the previous one for the same prefix (a call with only
    ``prefix`` makes the paths under it go back to the environment); a call without arguments
    does so for the unscoped settings. ValueError for settings that do not resolve or a prefix
    that is not an ``s3://`` URL.
    """
    _ext.configure_s3(endpoint, region, path_style, profile, access_key_id, secret_access_key,
                      session_token, anonymous, prefix)


def configure_gcs(*, endpoint: str | None = None, credentials_file: str | None = None,
                  token: str | None = None, anonymous: bool = False,
                  user_project: str | None = None, prefix: str | None = None,
                  allow_http_token: bool = False) -> None:
    """Explicit settings for the ``gs://`` paths opened from now on in this process.

    ``endpoint`` (``"http(s)://host[:port]"``) wins over ``STORAGE_EMULATOR_HOST`` and Google's
    ``https://storage.googleapis.com``. Credentials, at most one: ``credentials_file`` (a
    service-account key or the ``authorized_user`` file of ``gcloud auth application-default
    login``; read now), ``token`` (an OAuth 2 access token sent as it is, never refreshed; e.g.
    ``gcloud auth print-access-token``) or ``anonymous=True`` (no credentials: public buckets,
    emulators). Without any, an emulator named by ``STORAGE_EMULATOR_HOST`` is used
    anonymously, and otherwise Google's Application Default Credentials are looked for:
    ``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's ``application_default_credentials.json``, then
    the metadata server (GCE, GKE, TPU VMs); when none is found, requests fail with
    PermissionError listing where it looked. ``user_project`` bills requester-pays buckets to
    that project.

    A token is never sent over plain ``http://`` to a host other than loopback (127.0.0.0/8,
    ``::1``, ``localhost``) or the one ``STORAGE_EMULATOR_HOST`` names: such requests fail with
    PermissionError before anything is sent, unless ``allow_http_token=True`` (an emulator or
    proxy you trust elsewhere on your network).

    Any endpoint but Google's is checked once per process and bucket before the first write:
    a server that ignores ``ifGenerationMatch`` (gcp-storage-emulator) is refused writes.

    ``prefix`` (``"gs://bucket"`` or ``"gs://bucket/path"``) scopes the settings to the paths at
    or under it; a path takes the settings of the longest prefix it lies under, and those given
    without ``prefix`` when none matches. Each call replaces the previous one for the same
    prefix. ValueError for more than one credential, an empty token, a malformed credentials
    file, or a prefix that is not a ``gs://`` URL; PermissionError for a credentials file that
    cannot be read.
    """
    _ext.configure_gcs(endpoint, token, anonymous, user_project, prefix,
                       credentials_file=credentials_file, allow_http_token=allow_http_token)
