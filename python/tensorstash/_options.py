"""The engine's defaults, read once from the C++ side (_ext.defaults()), so that every signature
of the package (save, restore, CheckpointManager) and the engine agree on them."""

from __future__ import annotations

import os

from . import _ext

_DEFAULTS = _ext.defaults()

CHUNK_BYTES: int = _DEFAULTS["chunk_bytes"]
DATA_FILE_BYTES: int = _DEFAULTS["data_file_bytes"]
MAX_INFLIGHT_BYTES: int = _DEFAULTS["max_inflight_bytes"]
ZSTD_LEVEL: int = _DEFAULTS["zstd_level"]
# How long a collective step (a save's commit, a manager's agreement, the RAM tier's exchanges)
# waits for every process before it fails naming the ones that did not arrive.
COORDINATION_TIMEOUT_S: float = _DEFAULTS["coordination_timeout_s"]
# Restored buffers are handed to devices in batches of about this many bytes; the engine reads the
# next batch while this one is placed, so host memory holds about two.
HOST_BATCH_BYTES: int = _DEFAULTS["host_batch_bytes"]
# A save copies a jax.Array out of accelerator memory into JAX's pinned host memory
# (jax.device_put to memory kind "pinned_host", at about 48 GB/s on an H200) rather than into
# pageable memory (copy_to_host_async, 2-6 GB/s there): bench/gpu_save.py, bench/README.md.
# TENSORSTASH_SAVE_VIA_PINNED_HOST=0 turns it off (JAX keeps pinned memory it allocated for
# later use, so a process holds about its largest save's bytes of it once it has saved).
SAVE_VIA_PINNED_HOST: bool = os.environ.get("TENSORSTASH_SAVE_VIA_PINNED_HOST", "1") != "0"


def check_codec(codec: str | None) -> None:
    if codec not in (None, "none", "zstd"):
        raise ValueError(f"unknown codec {codec!r}; use None or 'zstd'")
