"""The identity shortcut of incremental saves (docs/format.md 6.1): an immutable array saved
again from the very buffers an earlier save read is unchanged, so its chunks are referenced in
that save's step without hashing them.

Only leaves whose adapter names their buffers (identity(): jax.Arrays) and whose buffers nothing
else can change (the save's `stable` flag: off-host arrays, or host arrays under
trust_immutable) take part; NumPy arrays, which their owner may change in place, never do.
The record holds a weak reference to each leaf: while the leaf saved earlier is alive and not
deleted (a donated array is deleted), its buffers cannot have been freed and reused, so a leaf
of today that is that object, or names the same buffers with the same shape, dtype and
sharding, holds the same bytes. The engine keeps the promise only against the step whose save
this record describes, and only while that step's commit record is the one that save wrote
(WriterOptions::base_commit_id); anything else is hashed as before.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from . import _adapters


def _identity(x: Any) -> Any:
    """The adapter's name for `x`'s buffers, or None when it has none (or cannot tell)."""
    identity = getattr(_adapters.adapter_for(x), "identity", None)
    if identity is None:
        return None
    try:
        return identity(x)
    except Exception:  # noqa: BLE001 - no identity: the array is hashed, as without one
        return None


class SavedArrays:
    """The leaves one save read that can take part, by array path: a weak reference to each.

    `leaves`: (array path, leaf) in the order of `arrays`, the save's (path, dtype, shape,
    shards, stable) tuples (_save.arrays_to_save). Only weak references are kept (nothing is
    pinned in memory) and buffers are named only when a leaf is not the very object saved
    before: a live, undeleted jax.Array keeps its buffers for its whole life."""

    def __init__(self, leaves: list[tuple[str, Any]], arrays: list[tuple]) -> None:
        self._by_path: dict[str, weakref.ref] = {}
        for (path, x), array in zip(leaves, arrays, strict=True):
            if not array[4]:  # not stable: something else may change its buffers
                continue
            if getattr(_adapters.adapter_for(x), "identity", None) is None:
                continue
            try:
                self._by_path[path] = weakref.ref(x)
            except TypeError:  # a leaf type without weak references cannot take part
                continue

    def __len__(self) -> int:
        return len(self._by_path)

    def unchanged(self, leaves: list[tuple[str, Any]], arrays: list[tuple]) -> list[str]:
        """The array paths of `leaves` that are, at the same path, the same buffers as the
        recorded save read, the leaf then still alive and not deleted."""
        paths = []
        for (path, x), array in zip(leaves, arrays, strict=True):
            ref = self._by_path.get(path)
            if ref is None or not array[4]:
                continue
            before = ref()
            if before is None:  # freed: its buffers may hold another array's bytes by now
                continue
            if before is x:  # being saved, so not deleted
                paths.append(path)
                continue
            if type(before) is not type(x) or before.shape != x.shape or before.dtype != x.dtype:
                continue
            identity = _identity(before)  # None once deleted (donated)
            if identity is not None and identity == _identity(x):
                paths.append(path)
        return paths


# One-off saves (tensorstash.save with record_digests or base): the arrays of the last few
# steps this process saved, by step path: (commit id, SavedArrays).
_RECENT_STEPS = 4
_recent: dict[str, tuple[str, SavedArrays]] = {}
_recent_lock = threading.Lock()


def remember(step_path: str, commit_id: str, saved: SavedArrays) -> None:
    with _recent_lock:
        _recent.pop(step_path, None)
        if commit_id and len(saved):
            _recent[step_path] = (commit_id, saved)
            while len(_recent) > _RECENT_STEPS:
                _recent.pop(next(iter(_recent)))


def recalled(step_path: str) -> tuple[str, SavedArrays] | None:
    with _recent_lock:
        return _recent.get(step_path)
