"""tensorstash: save and restore sharded pytrees of JAX and NumPy arrays.

    import tensorstash
    tensorstash.save("/ckpt/0000001000", state)              # any pytree of arrays and scalars
    state = tensorstash.restore("/ckpt/0000001000")           # as NumPy, as saved
    state = tensorstash.restore("/ckpt/0000001000", target=abstract_state)  # onto any sharding
    meta = tensorstash.metadata("/ckpt/0000001000")           # reads no array data

    mgr = tensorstash.CheckpointManager("/ckpt", max_to_keep=3)  # a series of steps
    mgr.save(step, state)                                     # returns once copied to host

Paths may be folders or store URLs ("memory://run/0000001000"; tensorstash.store_schemes()).

The engine is C++ (the private module `_ext`); IO runs with the GIL released. Errors are the
usual exceptions: FileNotFoundError (no such step), FileExistsError (step already complete),
KeyError (a target leaf the checkpoint lacks), ValueError (bad shapes, an incomplete step),
TypeError (unsupported leaves), OSError (corrupt or unreadable data), MemoryError.

The package's modules, each small and none importing another in a circle:
    _save.py      save (native and Orbax formats), materialize
    _identity.py  incremental saves' identity shortcut (arrays saved again from their buffers)
    _restore.py   restore, metadata (the engine plans and reads every box in one call)
    _export.py    export_safetensors (any step to a Hugging Face safetensors folder)
    manager.py    CheckpointManager, SaveStats, RestoreStats
    _adapters.py  the framework adapter protocol and its registry (register_adapter, the entry
                  point group "tensorstash.adapters"); numpy.py, jax.py and torch.py
                  implement it
    _tree.py      pytrees <-> the engine's tree JSON
    _options.py   the engine's defaults; _paths.py step paths and URLs; _progress.py progress
"""

from __future__ import annotations

from . import _ext
from ._adapters import register_adapter
from ._export import export_safetensors
from ._paths import configure_gcs, configure_s3
from ._restore import ArrayMetadata, metadata, restore
from ._save import materialize, save
from .manager import CheckpointManager, RestoreStats, SaveStats

__version__ = _ext.__version__
__all__ = ["save", "restore", "metadata", "ArrayMetadata", "CheckpointManager", "SaveStats",
           "RestoreStats", "store_schemes", "configure_s3", "configure_gcs", "register_adapter",
           "export_safetensors", "materialize",
           "__version__"]


def __getattr__(name: str):
    """tensorstash.torch (tensorstash.torch.load, TorchCoordinator): imported on first use, so
    that `import tensorstash` never imports torch."""
    if name == "torch":
        import importlib
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def store_schemes() -> list[str]:
    """The URL schemes a path may start with ("file", "memory", ...); plain paths are folders."""
    return list(_ext.store_schemes())
