"""Framework adapters: what is NumPy- or JAX-specific in saving and restoring a leaf.

An adapter is a small object with these methods (see numpy.NumpyAdapter, jax.JaxAdapter):

    owns(x) -> bool
        Whether leaf `x` (a leaf to save, or a target leaf to restore into) is the adapter's.
    check_savable(x, path) -> None
        TypeError naming `path` when `x` cannot be saved (an abstract array, say).
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
        The restored leaf from `buffers` ({key: NumPy array of the box, native byte order}).
    build_many(items) -> list   (optional)
        The leaves of [(target, shape, buffers)], finished in the same batch, built together
        (jax.JaxAdapter places each on all its devices in one call, then waits once).
    orbax_sharding(x) -> str | None
        The JSON Orbax records in `_sharding` for the leaf's sharding (save(format="orbax")),
        or None: the leaf is then recorded as a NumPy array.

A new framework is one new module with one such class, registered here. The first adapter that
owns a leaf handles it; NumPy's takes every target leaf that is left.
"""

from __future__ import annotations

from typing import Any, Protocol

from . import numpy as tnp


class FrameworkAdapter(Protocol):
    def owns(self, x: Any) -> bool: ...

    def check_savable(self, x: Any, path: str) -> None: ...

    def save_shards(self, x: Any, process_index: int,
                    process_count: int) -> tuple[tuple[int, ...], list[tuple], bool]: ...

    def restore_boxes(self, target: Any, shape: tuple[int, ...]) -> dict[Any, tuple]: ...

    def build(self, target: Any, shape: tuple[int, ...], buffers: dict[Any, Any]) -> Any: ...

    # Optional: the dtype a leaf is read in for `target` when it is not the target's own (JAX
    # with 64-bit types off narrows float64 to float32, and so on: jax.restore_dtype).
    # def restore_dtype(self, target: Any) -> np.dtype: ...

    def orbax_sharding(self, x: Any) -> str | None: ...


def _adapters() -> list[FrameworkAdapter]:
    adapters: list[FrameworkAdapter] = []
    try:
        import jax  # noqa: F401  (JAX is optional: NumPy-only use works without it)
    except ImportError:
        pass
    else:
        from . import jax as tjax
        adapters.append(tjax.JaxAdapter())
    adapters.append(NUMPY)
    return adapters


NUMPY = tnp.NumpyAdapter()
ADAPTERS: list[FrameworkAdapter] = _adapters()


def owner(x: Any) -> FrameworkAdapter | None:
    """The adapter whose array `x` is, or None (`x` is not an array leaf)."""
    for adapter in ADAPTERS:
        if adapter.owns(x):
            return adapter
    return None


def adapter_for(x: Any) -> FrameworkAdapter:
    """The adapter that handles leaf `x`: its owner, else NumPy's (which takes any target with
    .shape and .dtype, and anything np.asarray takes)."""
    return owner(x) or NUMPY
