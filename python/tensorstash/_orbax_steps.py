"""The steps of a root written by Orbax's CheckpointManager: which format a root holds, how its
step folders are named, which of them are finalized, and what items a step holds.

One small policy per root format: the native format's steps are the engine's (10-digit folders
with COMMIT, manager/step_store.h); this module is the Orbax side, which CheckpointManager uses
for a root of Orbax steps. Orbax's own rules, as orbax-checkpoint 0.12 applies them:

- a step folder is named `[<prefix>_]<step>` (CheckpointManagerOptions step_prefix), the step
  zero-padded to `step_format_fixed_length` digits when that is set, plain decimal otherwise;
- a step is finalized once its folder has its final name: a save writes into
  `<name>.orbax-checkpoint-tmp-<...>` and renames it last, so folders with that marker (and
  any other name that does not parse) are not steps; `commit_success.txt` marks the steps that
  Orbax writes in place on object stores, and is written here too;
- a step holds its items as subfolders (StandardSave's item "default", or the names of an
  `ocp.args.Composite`), listed with their handlers in the step's `_CHECKPOINT_METADATA`;
  the item "metrics" (a JsonSave written by the manager) holds the metrics of best_fn.

A root is a local folder or a store URL (gs://, s3://): on a URL the folders and files are
those of the store's listing (_ext.store_list) and files are read whole (_ext.store_read).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

from . import _ext

TMP_MARKER = ".orbax-checkpoint-tmp"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS = "commit_success.txt"
ITEM_METADATA = "_METADATA"  # an array tree item (StandardSave, PyTreeSave)
METRICS_ITEM = "metrics"  # Orbax's item of the metrics of best_fn: file "metrics" in it
DEFAULT_ITEM = "default"  # the item of a plain StandardSave step
_JSON_HANDLER = "JsonCheckpointHandler"

# What marks a root as the native format's (docs/format.md, section 2).
_NATIVE_STEP = re.compile(r"^\d{10}$")
_NATIVE_FILES = ("COMMIT", "tree.json")
_NATIVE_ROOT_FILES = ("LOCK", "RUN_ID")


@dataclasses.dataclass(frozen=True)
class _UrlEntry:
    """What this module uses of an os.DirEntry, for a name under a store URL."""

    name: str
    path: str
    folder: bool

    def is_dir(self) -> bool:
        return self.folder

    def is_file(self) -> bool:
        return not self.folder


def _is_url(path: str) -> bool:
    return _ext.has_url_scheme(path)


def join(folder: str, name: str) -> str:
    """`folder`/`name` for a local folder or a store URL."""
    return f"{folder.rstrip('/')}/{name}" if _is_url(folder) else os.path.join(folder, name)


def _url_listing(folder: str) -> tuple[list[str], list[str]]:
    """(files, folders) right under the store URL `folder`; both empty when there is no such
    folder, or no such store yet (a memory:// store that a manager is about to create)."""
    try:
        return _ext.store_list(folder)
    except FileNotFoundError:
        return [], []


def _entries(root: str) -> list:
    """The folders and files right under `root` (os.DirEntry, or _UrlEntry on a URL); [] for a
    missing root."""
    if _is_url(root):
        files, folders = _url_listing(root)
        return ([_UrlEntry(n, join(root, n), True) for n in folders]
                + [_UrlEntry(n, join(root, n), False) for n in files])
    try:
        with os.scandir(root) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _file_names(folder: str) -> set[str]:
    """The names of the files right under `folder` (empty for a missing folder)."""
    if _is_url(folder):
        return set(_url_listing(folder)[0])
    try:
        with os.scandir(folder) as it:
            return {e.name for e in it if e.is_file()}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _has_file(folder: str, name: str) -> bool:
    if _is_url(folder):
        return name in _url_listing(folder)[0]
    return os.path.exists(os.path.join(folder, name))


def _has_folder(folder: str, name: str) -> bool:
    if _is_url(folder):
        return name in _url_listing(folder)[1]
    return os.path.isdir(os.path.join(folder, name))


def _read(path: str) -> bytes:
    """The bytes of the file `path`; FileNotFoundError naming it when there is none."""
    if _is_url(path):
        folder, _, name = path.rstrip("/").rpartition("/")
        value = _ext.store_read(folder, name)
        if value is None:
            raise FileNotFoundError(f"{path} does not exist")
        return value
    with open(path, "rb") as f:
        return f.read()


def detect_format(root: str) -> str | None:
    """"native", "orbax" or None (an empty or missing root) from what the local folder `root`
    holds: a 10-digit folder with COMMIT or tree.json is a native step, a folder holding
    _CHECKPOINT_METADATA (or an Orbax temporary folder) an Orbax one. Without steps, the native
    manager's LOCK or RUN_ID makes the root native; beside Orbax steps they are ignored (the
    LOCK that an earlier tensorstash left in an Orbax root). ValueError naming the root when it
    holds steps of both formats."""
    native = orbax = marked = None
    for entry in _entries(root):
        if entry.name in _NATIVE_ROOT_FILES and entry.is_file():
            marked = entry.name
        elif not entry.is_dir():
            continue
        elif TMP_MARKER in entry.name:
            orbax = orbax or entry.name
        else:
            # One look into the folder (on a store URL each look is a listing request).
            files = _file_names(entry.path)
            if CHECKPOINT_METADATA in files:
                orbax = orbax or entry.name
            elif _NATIVE_STEP.match(entry.name) and any(f in files for f in _NATIVE_FILES):
                native = native or entry.name
    if native and orbax:
        raise ValueError(f"{root} holds both tensorstash steps ({native!r}) and Orbax steps "
                         f"({orbax!r}); a checkpoint root holds one format")
    return "orbax" if orbax else "native" if native or marked else None


@dataclasses.dataclass(frozen=True)
class StepNames:
    """Orbax's step folder names: `[<prefix>_]<step>`, zero-padded to `fixed_length` digits
    when it is set (CheckpointManagerOptions step_prefix and step_format_fixed_length)."""

    prefix: str | None = None
    fixed_length: int | None = None

    def name(self, step: int) -> str:
        digits = f"{step:0{self.fixed_length}d}" if self.fixed_length else str(step)
        return f"{self.prefix}_{digits}" if self.prefix else digits

    def parse(self, name: str) -> int | None:
        """The step of a finalized step folder's name, as Orbax matches it; None otherwise."""
        if TMP_MARKER in name:
            return None
        head = f"{self.prefix}_" if self.prefix else ""
        if not name.startswith(head):
            return None
        digits = name[len(head):]
        if self.fixed_length:
            n = self.fixed_length
            ok = re.fullmatch(rf"0\d{{{n - 1}}}|[1-9]\d{{{n - 1}}}\d*", digits)
        else:
            ok = re.fullmatch(r"0|[1-9]\d*", digits)
        return int(digits) if ok else None


def infer_names(root: str) -> StepNames:
    """The naming of the Orbax steps already in `root` (folders holding _CHECKPOINT_METADATA):
    the prefix before the last '_' when every step has the same one, and the fixed length when
    a step is zero-padded. Plain decimal names without a prefix when there is no step."""
    prefixes, padded = set(), set()
    for entry in _entries(root):
        if (TMP_MARKER in entry.name or not entry.is_dir()
                or not _has_file(entry.path, CHECKPOINT_METADATA)):
            continue
        match = re.fullmatch(r"(?:(.+)_)?(\d+)", entry.name)
        if match is None:
            continue
        prefixes.add(match.group(1))
        if len(match.group(2)) > 1 and match.group(2).startswith("0"):
            padded.add(len(match.group(2)))
    prefix = prefixes.pop() if len(prefixes) == 1 else None
    return StepNames(prefix=prefix, fixed_length=padded.pop() if len(padded) == 1 else None)


def list_steps(root: str, names: StepNames) -> dict[int, str]:
    """{step: folder path} of the finalized steps in `root`, as Orbax's CheckpointManager lists
    them (temporary folders and names that do not parse are left out)."""
    steps = {}
    for entry in _entries(root):
        step = names.parse(entry.name)
        if step is not None and entry.is_dir():
            steps[step] = entry.path
    return steps


def checkpoint_metadata(step_dir: str) -> dict:
    """The step's _CHECKPOINT_METADATA, or {} when it has none (older Orbax)."""
    path = join(step_dir, CHECKPOINT_METADATA)
    try:
        value = json.loads(_read(path))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"the Orbax step metadata {path} is unreadable: {e}") from None
    return value if isinstance(value, dict) else {}


def _is_item_name(name: Any) -> bool:
    """True for the name of a folder directly inside the step (never "..", "." or a path)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and os.sep not in name and "\0" not in name)


def items(step_dir: str) -> dict[str, str]:
    """{item name: "json" or "tree"} of the items of a step: those _CHECKPOINT_METADATA lists,
    else the subfolders (an item with _METADATA is an array tree, one with only JSON files a
    JSON item). The metrics item is included (the caller leaves it out of a restore)."""
    handlers = checkpoint_metadata(step_dir).get("item_handlers")
    found = {}
    if isinstance(handlers, dict):
        for name, handler in handlers.items():
            if not _is_item_name(name):
                raise ValueError(f"the Orbax step {step_dir} names an item {name!r} that is "
                                 "not a folder of the step (_CHECKPOINT_METADATA)")
            if _has_folder(step_dir, name):
                found[name] = "json" if _JSON_HANDLER in str(handler) else "tree"
        return found
    for entry in _entries(step_dir):
        if entry.is_dir() and not entry.name.startswith("_") and entry.name != "d":
            tree = _has_file(entry.path, ITEM_METADATA)
            found[entry.name] = "tree" if tree else "json"
    return found


def read_json_item(item_dir: str) -> Any:
    """The value of a JSON item (JsonSave): its one JSON file besides commit_success.txt.
    OSError naming the folder when it has none or several."""
    files = [e for e in _entries(item_dir)
             if e.is_file() and e.name != COMMIT_SUCCESS and not e.name.startswith("_")]
    if len(files) != 1:
        raise OSError(f"the JSON item {item_dir} holds {len(files)} files, not one")
    return json.loads(_read(files[0].path))


def read_metrics(step_dir: str) -> dict | None:
    """The metrics that the step's "metrics" item holds, or None without one."""
    path = join(join(step_dir, METRICS_ITEM), METRICS_ITEM)
    try:
        value = json.loads(_read(path))
    except (OSError, ValueError, RecursionError):
        # Missing or unreadable: the step has no metrics (retention then ranks it as one
        # without the metric), rather than failing every later save's retention.
        return None
    return value if isinstance(value, dict) else None
