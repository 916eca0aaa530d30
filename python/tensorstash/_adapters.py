"""Framework adapters: what is NumPy-, JAX- or another framework's in saving and restoring a leaf.

An adapter is a small object with these methods (numpy.NumpyAdapter and jax.JaxAdapter have
all of them; those marked optional may be left out, and the functions of this module named
after them stand in with the default given):

    owns(x) -> bool
        Whether leaf `x` (a leaf to save, or a target leaf to restore into) is the adapter's.
    check_savable(x, path) -> None
        TypeError naming `path` when `x` cannot be saved (an abstract array, say).
    dtype_name(x) -> str   (optional; default numpy.dtype_name(x.dtype))
        The engine's name of the dtype of `x` (a leaf to save, or a target), one of
        numpy.DTYPE_NAMES ("float32", "bfloat16", ...); TypeError for a dtype the engine does
        not store. The names are the engine's, not NumPy's, so a framework whose dtypes are not
        NumPy dtypes maps its own here (torch.bfloat16 -> "bfloat16").
    restore_dtype(target) -> np.dtype   (optional; default numpy.dtype_from_name(dtype_name))
        The NumPy dtype, in native byte order, that the engine reads `target`'s leaf in and
        hands to build(): the target's own dtype, or what the framework makes of it (JAX with
        64-bit types off narrows float64 to float32, as jax.device_put does).
    start_save(xs) -> list   (optional)
        Starts what save_shards will wait for (copies of device memory to the host) for every
        leaf of `xs` (the adapter's leaves of one save, in one call, so that the copies can be
        made in one batch and all run before the first is taken); returns, per leaf, what to
        pass to save_shards in its place (the leaf itself, or a handle of its copy).
    save_shards(x, process_index, process_count) -> (shape, shards, stable)
        This process's shards of `x` as _ext.Writer.add_array takes them: (origin, shape, uint8
        view of C-contiguous native-order data, replica id, replica count); `stable` when
        nothing else can change their memory once save() returns (host copies made for it).
    immutable(x) -> bool   (optional)
        Whether the framework's own rules forbid changing `x`'s memory (jax.Array), although
        save_shards' views of it may not be `stable`: host memory that may also be a NumPy
        array's. CheckpointManager(copy_host_jax_arrays=False) then writes them without a copy.
    restore_boxes(target, shape) -> dict[key, (origin, shape)]
        The boxes of the array this process holds under `target`, each read once: one per
        distinct device block (keyed by the block), or one for the whole array.
    build(target, shape, buffers) -> leaf
        The restored leaf from `buffers` ({key: NumPy array of the box, of restore_dtype}).
    restore_into(target, shape, boxes) -> dict[key, np.ndarray] | None   (optional; default None)
        For an in-place load (tensorstash.torch.load): {key: writable C-contiguous uint8 NumPy
        view of the target's own memory that holds box `key` of `boxes` (restore_boxes'), in
        restore_dtype}, so that the engine reads each box straight into the target; None where
        the target's memory cannot take them (another device, not contiguous): the leaf is then
        built and copied as after any restore.
    build_many(items) -> list   (optional)
        The leaves of [(target, shape, buffers)], finished in the same batch, built together
        (jax.JaxAdapter places each on all its devices in one call, then waits once).
    orbax_sharding(x) -> str | None
        The JSON Orbax records in `_sharding` for the leaf's sharding (save(format="orbax")),
        or None: the leaf is then recorded as a NumPy array.
    sharding_record(x) -> dict | None   (optional; default None)
        The description of the leaf's sharding that a native checkpoint records with it
        (docs/format.md 4.2: JSON, in the schema of Orbax's `_sharding` entries), so that a
        restore as saved can place it again (jax.sharding_record); None records nothing.
    default_coordinator() -> Coordinator | None   (optional; default None)
        The framework's distributed runtime as a Coordinator (the protocol of
        jax.JaxCoordinator) when it runs several processes, else None. A save or a
        CheckpointManager given no coordinator takes the first adapter's that is not None.

Adapters are registered, not listed here: register_adapter(adapter) (tensorstash.register_adapter)
from code, or an entry point of the group "tensorstash.adapters" in a distribution's metadata
that loads to an adapter class, instance or zero-argument factory:

    [project.entry-points."tensorstash.adapters"]
    myframework = "myframework_tensorstash:Adapter"

The entry points (in the order of their names), then torch's adapter (tensorstash.torch, when
torch has been imported: tensorstash never imports torch itself) and JAX's (when jax imports) are
registered at the first lookup, once, each after the adapters registered before it; an entry
point that fails to load is left out with a warning naming it. When torch was not imported at
the first lookup, later lookups check for it (one dict lookup) and register its adapter then.
The first adapter that owns a leaf handles it; NumPy's is asked last and takes every target
leaf that is left.
"""

from __future__ import annotations

import importlib.metadata
import sys
import threading
import warnings
from typing import Any, Protocol

import numpy as np

from . import numpy as tnp

ENTRY_POINT_GROUP = "tensorstash.adapters"


class FrameworkAdapter(Protocol):
    """The protocol of the module docstring (optional methods: dtype_name, restore_dtype,
    start_save, immutable, build_many, sharding_record, default_coordinator)."""

    def owns(self, x: Any) -> bool: ...

    def check_savable(self, x: Any, path: str) -> None: ...

    def dtype_name(self, x: Any) -> str: ...

    def restore_dtype(self, target: Any) -> np.dtype: ...

    def save_shards(self, x: Any, process_index: int,
                    process_count: int) -> tuple[tuple[int, ...], list[tuple], bool]: ...

    def restore_boxes(self, target: Any, shape: tuple[int, ...]) -> dict[Any, tuple]: ...

    def build(self, target: Any, shape: tuple[int, ...], buffers: dict[Any, Any]) -> Any: ...

    def orbax_sharding(self, x: Any) -> str | None: ...

    def default_coordinator(self) -> Any: ...


# The methods an adapter cannot do without.
_REQUIRED = ("owns", "check_savable", "save_shards", "restore_boxes", "build", "orbax_sharding")

NUMPY = tnp.NumpyAdapter()

# The registered adapters in the order they are asked, NumPy's last. Replaced, never changed in
# place, so that a lookup iterates a list no registration changes under it.
ADAPTERS: list[FrameworkAdapter] = [NUMPY]
# The list of ADAPTERS once the entry points and built-in adapters are in it: a lookup loads
# them when ADAPTERS is another list (a test may put a list of its own there).
_loaded_into: list | None = None
# The adapters loaded from entry points and the built-in modules, once.
_discovered: list | None = None
_loading = False  # (an entry point's module being imported may look adapters up)
# Whether torch was not imported when the built-in adapters were found: lookups then register
# torch's adapter once the user imports torch.
_torch_waiting = False
_lock = threading.RLock()


def _missing_methods(adapter: Any) -> list[str]:
    return [name for name in _REQUIRED if not callable(getattr(adapter, name, None))]


def _placed(adapters: list, adapter: Any, first: bool) -> list:
    """A copy of `adapters` with `adapter` (moved, if there already) first, or last before
    NumPy's."""
    out = [a for a in adapters if a is not adapter]
    if first:
        out.insert(0, adapter)
    else:
        out.insert(len(out) - 1 if out and out[-1] is NUMPY else len(out), adapter)
    return out


def register_adapter(adapter: Any, *, first: bool = True) -> Any:
    """Registers framework adapter `adapter` (an instance; the protocol is in
    tensorstash._adapters): its owns() is asked before every adapter registered so far
    (`first`, the default: an adapter for a kind of another framework's array wins), or after
    all of them. NumPy's adapter is always asked last. Registering an adapter again moves it.
    Returns `adapter`. TypeError naming what is missing when `adapter` lacks a method the
    protocol requires (a class passed instead of an instance, say)."""
    if isinstance(adapter, type):
        raise TypeError(f"register_adapter takes an adapter instance, not the class "
                        f"{adapter.__name__}: register_adapter({adapter.__name__}())")
    missing = _missing_methods(adapter)
    if missing:
        raise TypeError(f"{adapter!r} is not a framework adapter: it has no "
                        f"{', '.join(missing)} (tensorstash._adapters describes the protocol)")
    global ADAPTERS, _loaded_into
    if adapter is NUMPY:
        return adapter  # always there, last
    with _lock:
        loaded = ADAPTERS is _loaded_into
        ADAPTERS = _placed(ADAPTERS, adapter, first)
        if loaded:
            _loaded_into = ADAPTERS
    return adapter


def _adapter_of(obj: Any) -> Any:
    """The adapter an entry point loads to: a class or a factory is called, an instance
    taken."""
    if isinstance(obj, type):
        return obj()
    if _missing_methods(obj) and callable(obj):
        return obj()
    return obj


def _entry_point_adapters() -> list:
    """The adapters of the entry points of ENTRY_POINT_GROUP, by name; each that fails to load
    (or loads to no adapter) warns, naming it, and is left out."""
    out = []
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
                     key=lambda ep: (ep.name, ep.value)):
        try:
            adapter = _adapter_of(ep.load())
            missing = _missing_methods(adapter)
            if missing:
                raise TypeError(f"{adapter!r} has no {', '.join(missing)}")
        except Exception as e:  # a third party's bug: tensorstash still works without it
            warnings.warn(f"tensorstash: the framework adapter of entry point {ep.name!r} "
                          f"({ep.value}, group {ENTRY_POINT_GROUP!r}) is left out: it failed "
                          f"to load: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
            continue
        out.append(adapter)
    return out


def _torch_adapter() -> list:
    """[torch's adapter] when torch has been imported (never importing it: `import torch`
    takes seconds, and a JAX or NumPy user must not pay it), else []. One that fails to load
    (a broken torch install) is left out with a warning."""
    global _torch_waiting
    _torch_waiting = "torch" not in sys.modules
    if _torch_waiting:
        return []
    try:
        from . import torch as ttorch
        return [ttorch.TorchAdapter()]
    except Exception as e:  # tensorstash still works for the other frameworks
        warnings.warn(f"tensorstash: the torch adapter is left out: importing it failed: "
                      f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
        return []


def _builtin_adapters() -> list:
    """Torch's adapter when torch has been imported, and JAX's when jax imports (both are
    optional: NumPy-only use works without them)."""
    out = _torch_adapter()
    try:
        import jax  # noqa: F401
    except ImportError:
        return out
    from . import jax as tjax
    return out + [tjax.JaxAdapter()]


def _torch_arrived() -> list:
    """ADAPTERS with torch's adapter registered, now that torch has been imported after the
    first lookup."""
    global ADAPTERS, _loaded_into, _discovered
    with _lock:
        if not _torch_waiting or _discovered is None or ADAPTERS is not _loaded_into:
            return ADAPTERS
        found = _torch_adapter()
        _discovered = _discovered + found
        for adapter in found:
            ADAPTERS = _loaded_into = _placed(ADAPTERS, adapter, first=False)
        return ADAPTERS


def _load() -> list:
    """ADAPTERS with the entry points' and built-in adapters registered (found once)."""
    global ADAPTERS, _loaded_into, _discovered, _loading
    with _lock:
        if _loading or ADAPTERS is _loaded_into:
            return ADAPTERS
        if _discovered is None:
            _loading = True
            try:
                _discovered = _entry_point_adapters() + _builtin_adapters()
            finally:
                _loading = False
        adapters = ADAPTERS
        for adapter in _discovered:
            if not any(a is adapter for a in adapters):
                adapters = _placed(adapters, adapter, first=False)
        ADAPTERS = _loaded_into = adapters
        return adapters


def registered() -> list[FrameworkAdapter]:
    """The registered adapters, in the order they are asked (NumPy's last)."""
    adapters = ADAPTERS
    if adapters is not _loaded_into:
        return _load()
    return _torch_arrived() if _torch_waiting and "torch" in sys.modules else adapters


def _reset() -> None:
    """For tests: back to NumPy's adapter alone; the next lookup finds the entry points (and
    JAX's adapter) again, as at the first."""
    global ADAPTERS, _loaded_into, _discovered, _torch_waiting
    with _lock:
        ADAPTERS, _loaded_into, _discovered, _torch_waiting = [NUMPY], None, None, False


def owner(x: Any) -> FrameworkAdapter | None:
    """The adapter whose array `x` is, or None (`x` is not an array leaf)."""
    adapters = ADAPTERS  # asked per leaf: one identity check once loaded
    if adapters is not _loaded_into:
        adapters = _load()
    elif _torch_waiting and "torch" in sys.modules:
        adapters = _torch_arrived()
    for adapter in adapters:
        if adapter.owns(x):
            return adapter
    return None


def adapter_for(x: Any) -> FrameworkAdapter:
    """The adapter that handles leaf `x`: its owner, else NumPy's (which takes any target with
    .shape and .dtype, and anything np.asarray takes)."""
    return owner(x) or NUMPY


def dtype_name(adapter: Any, x: Any) -> str:
    """adapter.dtype_name(x), or its default: the engine's name of NumPy dtype x.dtype."""
    own = getattr(adapter, "dtype_name", None)
    return own(x) if own is not None else tnp.dtype_name(x.dtype)


def restore_dtype(adapter: Any, target: Any) -> np.dtype:
    """adapter.restore_dtype(target), or its default: the NumPy dtype of the target's
    dtype_name, in native byte order (the format's; NumpyAdapter.build converts a big-endian
    target's array to its byte order once read). TypeError for a dtype the engine does not
    store."""
    own = getattr(adapter, "restore_dtype", None)
    return own(target) if own is not None else tnp.dtype_from_name(dtype_name(adapter, target))


def restore_into(adapter: Any, target: Any, shape: tuple[int, ...],
                 boxes: dict[Any, tuple]) -> dict[Any, np.ndarray] | None:
    """The adapter's restore_into, or None for an adapter without one."""
    fn = getattr(adapter, "restore_into", None)
    return fn(target, shape, boxes) if callable(fn) else None


def sharding_record(adapter: Any, x: Any) -> dict | None:
    """adapter.sharding_record(x), or None for an adapter without that method."""
    own = getattr(adapter, "sharding_record", None)
    return own(x) if own is not None else None


def default_coordinator() -> Any:
    """The first registered adapter's default_coordinator() that is not None (the framework
    runs several processes), else None."""
    for adapter in registered():
        ask = getattr(adapter, "default_coordinator", None)
        coordinator = ask() if ask is not None else None
        if coordinator is not None:
            return coordinator
    return None
