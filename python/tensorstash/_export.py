"""export_safetensors: any checkpoint step to a Hugging Face safetensors folder."""

from __future__ import annotations

import os
from typing import Any

from . import _ext, _paths


def export_safetensors(src: str | os.PathLike, dst: str | os.PathLike, *,
                       max_shard_bytes: int = 5 * 2**30, max_inflight_bytes: int = 0,
                       io_threads: int = 0) -> dict[str, Any]:
    """Writes the step at ``src`` (tensorstash, Orbax, or safetensors) as a Hugging Face folder
    at ``dst``, which must not exist or be empty.

    Tensors are named by their tree keys joined with ``'.'`` (list positions as numbers), the
    names of a torch ``state_dict``, and stored whole in their saved dtype, packed in tree order
    into ``model-0000k-of-0000n.safetensors`` files of at most ``max_shard_bytes`` of tensor data
    each (a larger tensor gets a file of its own), with ``{"format": "pt"}`` as header metadata.
    ``model.safetensors.index.json`` is always written, last, after every file is synced, so
    that a half export is never taken for a whole one (on local folders, the folder is written
    under a temporary name and renamed into place). ``max_inflight_bytes`` bounds the memory
    (0: 1 GiB); ``io_threads`` 0 picks a default.

    Returns ``{"files": [...], "total_bytes": n, "tensors": n, "skipped": [...]}`` where
    ``skipped`` lists the paths of non-array leaves (ints, strings), which safetensors cannot
    hold. ValueError for names that collide after joining and for dtypes safetensors lacks
    (complex128, int4, ...); FileExistsError when ``dst`` holds files.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, not {max_shard_bytes}")
    src_root, src_step = _paths.split(_paths.abspath(src))
    dst_root, dst_step = _paths.split(_paths.abspath(dst))
    return dict(_ext.export_safetensors(src_root, src_step, dst_root, dst_step,
                                        int(max_shard_bytes), int(max_inflight_bytes),
                                        int(io_threads)))
