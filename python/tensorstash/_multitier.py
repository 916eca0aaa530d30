"""The node-local tier of CheckpointManager (docs/multitier.md): what the package adds to the
engine's LocalTier (tiers/local_tier.h, _ext.LocalTier), which does the saving, the
bookkeeping of who holds what, the peer server and the collective steps: the address the
server listens on, found from JAX's coordinator, and a warning when peers cannot reach it."""

from __future__ import annotations

import os
import socket
from typing import Any

from . import _ext


def _coordinator_address() -> str | None:
    try:
        from jax._src import distributed

        return distributed.global_state.coordinator_address
    except Exception:  # noqa: BLE001 - JAX absent or not initialised
        return None


def _coordinator_is_local() -> bool:
    """Whether the JAX coordinator is on this host's loopback (a job on one host)."""
    address = _coordinator_address() or ""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def default_server_address() -> str:
    """The address of this host that the job's coordinator sees: the source address of a route
    to the JAX coordinator (no packet is sent); 127.0.0.1 when there is none."""
    address = _coordinator_address()
    if not address:
        return "127.0.0.1"
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def open_local_tier(local_dir: str | os.PathLike, *, run: str, coordinator: Any,
                    save_interval_steps: int,
                    max_to_keep: int, address: str | None, port: int, timeout_s: float,
                    engine_options: dict, logger: Any) -> _ext.LocalTier:
    """This process's LocalTier (collective with several processes): its server on `address`,
    else on default_server_address(), with a warning when that is a loopback address while the
    coordinator is elsewhere (the other hosts could not reach it)."""
    several = coordinator is not None and coordinator.process_count() > 1
    bind = address or default_server_address()
    if several and address is None and bind.startswith("127.") and not _coordinator_is_local():
        logger.warning("tensorstash: the local tier's server listens on %s: processes on other "
                       "hosts cannot reach it (no route to a JAX coordinator was found); pass "
                       "local_server_address", bind)
    return _ext.LocalTier(os.path.abspath(os.fspath(local_dir)), run=run, coordinator=coordinator,
                          save_interval_steps=save_interval_steps, max_to_keep=max_to_keep,
                          address=bind, port=port, timeout_s=timeout_s,
                          warn=lambda text: logger.warning("tensorstash: %s", text),
                          **engine_options)
