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
