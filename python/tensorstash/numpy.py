"""NumPy adapter: dtypes by name (bfloat16, float8/6/4 and int2/int4 via ml_dtypes) and raw byte
views."""

from __future__ import annotations

import numpy as np

from . import _ext

try:  # ml_dtypes registers bfloat16 and the float8 types with NumPy.
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is a declared dependency
    ml_dtypes = None

# The dtypes the engine stores, by the names NumPy and ml_dtypes use.
DTYPE_NAMES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2",
    # ml_dtypes' narrower types; the sub-byte ones take one byte per element, as NumPy holds them.
    "int2", "int4", "uint2", "uint4", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn",
    "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu",
)


def _dtype_of(name: str) -> np.dtype:
    if ml_dtypes is not None and hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


# The dtypes made so far: a restore asks once per array, and hasattr on ml_dtypes plus np.dtype
# took 10 µs (8% of restoring 4,000 small arrays into NumPy).
_DTYPES: dict[str, np.dtype] = {}


def dtype_from_name(name: str) -> np.dtype:
    """The NumPy dtype for one of DTYPE_NAMES; ValueError for any other name."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        if name not in DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPE_NAMES)}")
        dtype = _DTYPES[name] = _dtype_of(name)
    return dtype


# dtype -> its engine name, for the dtypes seen so far: numpy's dtype.name takes about 2 µs, and
# a save or restore asks once or twice per array.
_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype) -> str:
    """The engine's name for a NumPy (or ml_dtypes, or JAX) dtype; TypeError if unsupported."""
    dtype = np.dtype(dtype)
    name = _NAMES.get(dtype)
    if name is None:
        name = dtype.name
        if name not in DTYPE_NAMES:
            raise TypeError(f"dtype {name!r} cannot be stored; supported: {', '.join(DTYPE_NAMES)}")
        _NAMES[dtype] = name
    return name


def dtype_kind(dtype) -> str:
    """"b" (bool), "i" (signed or unsigned integers), "f" (floats, bfloat16 and float8 too) or
    "c" (complex) for a dtype of DTYPE_NAMES: the classes of the engine's casts."""
    name = dtype_name(dtype)
    if name == "bool":
        return "b"
    if "int" in name:
        return "i"
    return "c" if name.startswith("complex") else "f"


def native_contiguous(array: np.ndarray) -> np.ndarray:
    """`array` itself when it is C-contiguous in native byte order, else such a copy.

    The engine takes elements as native (little-endian) bytes, the format's byte order, so the
    bytes of a big-endian array ('>f4') would be stored as other values."""
    if not array.dtype.isnative:
        return array.astype(array.dtype.newbyteorder("="), order="C")
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would make 0-d arrays 1-d)
        return np.ascontiguousarray(array)
    return array


def byte_view(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array's memory (no copy), for the engine."""
    if not array.flags.c_contiguous:
        raise ValueError("internal: buffers passed to the engine must be C-contiguous")
    return array.reshape(-1).view(np.uint8)


# XLA's CPU client adopts a host buffer as a device buffer without copying it when its address
# is a multiple of 64 bytes; NumPy's own allocations are only 16-byte aligned.
_ALIGNMENT = 64
# From this size (NumPy's own threshold for advising transparent huge pages) restored buffers are
# mapped by the engine instead (page-aligned, no huge-page advice): the first write to a huge page
# can cost many times that of small pages, as on a VM whose host has reclaimed the memory
# (_ext.host_buffer).
_OWN_MEMORY_FROM = 4 << 20


def empty_aligned(shape, dtype) -> np.ndarray:
    """np.empty(shape, dtype), with its data 64-byte aligned.

    Restored buffers are allocated this way so that jax.device_put onto a CPU device takes them
    over instead of copying them: one copy of every restored byte fewer, and half the memory."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes >= _OWN_MEMORY_FROM:
        return _ext.host_buffer(nbytes).view(dtype).reshape(shape)
    raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class NumpyAdapter:
    """Leaves that are NumPy arrays, NumPy scalars or anything np.asarray takes; restore targets
    with .shape and .dtype (np.ndarray, np.generic). See _adapters.py for the protocol."""

    def owns(self, x) -> bool:
        return isinstance(x, (np.ndarray, np.generic))

    def check_savable(self, x, path: str) -> None:
        pass

    def dtype_name(self, x) -> str:
        return dtype_name(x.dtype)

    def restore_dtype(self, target) -> np.dtype:
        # Native byte order, the format's: build() converts to a big-endian target's order.
        return np.dtype(target.dtype).newbyteorder("=")

    def save_shards(self, x, process_index: int, process_count: int):
        a = native_contiguous(np.asarray(x))
        # Every process holds the whole array: they share the writing as replicas.
        shards = [((0,) * a.ndim, a.shape, byte_view(a), process_index, process_count)]
        return a.shape, shards, False

    def restore_boxes(self, target, shape):
        return {None: ((0,) * len(shape), shape)}

    def build(self, target, shape, buffers):
        out = buffers[None]
        if isinstance(target, np.generic):
            return out[()]
        wanted = np.dtype(target.dtype)
        return out if wanted.isnative else out.astype(wanted)

    def orbax_sharding(self, x) -> None:
        return None

    def default_coordinator(self) -> None:
        return None  # NumPy has no distributed runtime: pass save(coordinator=) for one
