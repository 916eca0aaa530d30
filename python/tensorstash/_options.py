"""The engine's defaults, read once from the C++ side (_ext.defaults()), so that every signature
of the package (save, restore, CheckpointManager) and the engine agree on them."""

from __future__ import annotations

from . import _ext

_DEFAULTS = _ext.defaults()

CHUNK_BYTES: int = _DEFAULTS["chunk_bytes"]
DATA_FILE_BYTES: int = _DEFAULTS["data_file_bytes"]
MAX_INFLIGHT_BYTES: int = _DEFAULTS["max_inflight_bytes"]
ZSTD_LEVEL: int = _DEFAULTS["zstd_level"]
# Restored buffers are handed to devices in batches of about this many bytes.
HOST_BATCH_BYTES: int = _DEFAULTS["host_batch_bytes"]


def check_codec(codec: str | None) -> None:
    if codec not in (None, "none", "zstd"):
        raise ValueError(f"unknown codec {codec!r}; use None or 'zstd'")
