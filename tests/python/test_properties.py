"""Property tests: random trees of random arrays (NumPy or jax.Array on a random mesh), saved and
restored without a target and onto another random mesh, bit for bit."""

from __future__ import annotations

import math
import os
import tempfile

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorstash
from tshelpers import (ALL_DTYPES, assert_jax_array, assert_same_array, assert_same_tree,
                       global_array, mesh, named, random_array)

# Derandomized (the same examples every run) and without an example database, so CI runs are
# reproducible and write nothing into the repository. TS_HYPOTHESIS_PROFILE=thorough for more.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=500, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("TS_HYPOTHESIS_PROFILE", "ci"))

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1), (8,), (2, 2, 2)]
NAMES = ("a", "b", "c")
DIMS = [0, 1, 2, 3, 4, 5, 8, 12, 16]


@st.composite
def shardings(draw, shape):
    """(mesh shape, PartitionSpec entries) valid for `shape`: each mesh axis used at most once,
    only on a dimension it divides."""
    mesh_shape = draw(st.sampled_from(MESHES))
    free = list(range(len(mesh_shape)))
    spec = []
    for dim in shape:
        options = [None] + [a for a in free if dim % mesh_shape[a] == 0]
        a = draw(st.sampled_from(options))
        if a is not None:
            free.remove(a)
        spec.append(None if a is None else NAMES[a])
    # Trailing Nones may be dropped from a spec; try both forms.
    if draw(st.booleans()):
        while spec and spec[-1] is None:
            spec.pop()
    return mesh_shape, tuple(spec)


@st.composite
def array_leaves(draw):
    shape = tuple(draw(st.lists(st.sampled_from(DIMS), max_size=4)))
    dt = draw(st.sampled_from(ALL_DTYPES))
    seed = draw(st.integers(0, 2**31))
    # None: a NumPy array (target); mostly jax.Arrays.
    save = draw(shardings(shape)) if draw(st.integers(0, 3)) else None
    target = draw(shardings(shape)) if draw(st.integers(0, 3)) else None
    return ("array", shape, dt, seed, save, target)


scalar_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5), st.binary(max_size=5),
).map(lambda v: ("scalar", v))

# Str keys, and the int and tuple keys of optimizer state dicts and Orbax trees (typed_dict).
keys = st.one_of(st.text(max_size=4), st.sampled_from(["a/b", "~", "~1", "", "é"]),
                 st.integers(-3, 3), st.tuples(st.integers(0, 2), st.sampled_from(["a", "/"])))


def dicts(values):
    """Dicts of `keys`, no two of which have the same text (1 and "1": one path, refused)."""
    def apart(d):
        return len({k if isinstance(k, str) else str(k) for k in d}) == len(d)
    return st.dictionaries(keys, values, max_size=3).filter(apart)


def trees(depth: int = 3):
    """Trees of containers up to `depth` deep; the root is a non-empty dict (or, at depth 0, a
    leaf), so that every example holds something."""
    leaf = st.one_of(array_leaves(), array_leaves(), array_leaves(), scalar_leaves)
    if depth == 0:
        return leaf
    child = trees(depth - 1)
    return st.one_of(leaf,
                     dicts(child),
                     st.lists(child, max_size=3),
                     st.lists(child, max_size=3).map(tuple))


def root_trees():
    """A dict of random subtrees, plus a list of 1 to 4 arrays so that no example is empty."""
    return st.one_of(
        st.builds(lambda arrays, rest: {"_arrays": arrays, **rest},
                  st.lists(array_leaves(), min_size=1, max_size=4),
                  dicts(trees(2))),
        array_leaves())


def build(spec, fn):
    if isinstance(spec, dict):
        return {k: build(v, fn) for k, v in spec.items()}
    if isinstance(spec, list):
        return [build(v, fn) for v in spec]
    if isinstance(spec, tuple) and spec and spec[0] not in ("array", "scalar"):
        return tuple(build(v, fn) for v in spec)
    if spec == ():
        return ()
    return fn(spec)


def values_of(leaf):
    _, shape, dt, seed, _, _ = leaf
    return random_array(np.random.default_rng(seed), shape, dt)


def saved_leaf(leaf):
    if leaf[0] == "scalar":
        return leaf[1]
    values, save = values_of(leaf), leaf[4]
    if save is None:
        return values
    return global_array(values, named(mesh(save[0], NAMES), *save[1]))


def target_sharding(leaf):
    mesh_shape, spec = leaf[5]
    return named(mesh(mesh_shape, NAMES), *spec)


def target_leaf(leaf):
    if leaf[0] == "scalar":
        return leaf[1]
    _, shape, dt, _, _, target = leaf
    if target is None:
        return np.empty(shape, dt)
    return jax.ShapeDtypeStruct(shape, dt, sharding=target_sharding(leaf))


def check_leaf(got, leaf, path):
    if leaf[0] == "scalar":
        assert_same_tree(got, leaf[1], path)
    elif leaf[5] is None:
        assert_same_array(got, values_of(leaf), path)
    else:
        assert_jax_array(got, values_of(leaf), target_sharding(leaf), path)


STATS = {"examples": 0, "arrays": 0, "jax_saved": 0, "jax_targets": 0, "elements": 0}


def walk_check(got, spec, path=""):
    if isinstance(spec, dict):
        assert isinstance(got, dict) and list(got) == list(spec), path
        for k in spec:
            walk_check(got[k], spec[k], f"{path}/{k}")
    elif isinstance(spec, list) or (isinstance(spec, tuple) and (not spec or spec[0] not in ("array", "scalar"))):
        assert type(got) is type(spec) and len(got) == len(spec), path
        for i, (g, s) in enumerate(zip(got, spec)):
            walk_check(g, s, f"{path}/{i}")
    else:
        check_leaf(got, spec, path)


@given(spec=root_trees(), codec=st.sampled_from([None, "zstd"]),
       chunk_bytes=st.sampled_from([8, 100, 4096, 8 << 20]))
def test_save_restore_random_trees(spec, codec, chunk_bytes):
    tree = build(spec, saved_leaf)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "root", "0000000042")
        tensorstash.save(path, tree, codec=codec, chunk_bytes=chunk_bytes, sync=False)
        # Without a target: plain containers (namedtuples none here), NumPy arrays as saved.
        plain = build(spec, lambda leaf: values_of(leaf) if leaf[0] == "array" else leaf[1])
        assert_same_tree(tensorstash.restore(path), plain)
        # With a target: onto the target's (other) meshes and shardings.
        got = tensorstash.restore(path, target=build(spec, target_leaf),
                                  max_inflight_bytes=4096)
        walk_check(got, spec)
        STATS["examples"] += 1
        for leaf in _leaves(spec):
            if leaf[0] == "array":
                STATS["arrays"] += 1
                STATS["jax_saved"] += leaf[4] is not None
                STATS["jax_targets"] += leaf[5] is not None
                STATS["elements"] += math.prod(leaf[1])
        # The metadata agrees with what was saved.
        meta = tensorstash.metadata(path)
        metas = [m for m in _leaves(meta) if isinstance(m, tensorstash.ArrayMetadata)]
        arrays = [leaf for leaf in _leaves(spec) if leaf[0] == "array"]
        assert len(metas) == len(arrays)
        for m, leaf in zip(metas, arrays):
            assert (m.shape, m.dtype) == (leaf[1], leaf[2]), m.path
            if codec is None:
                assert m.stored_bytes == math.prod(leaf[1]) * leaf[2].itemsize


def test_the_examples_were_not_trivial():
    """Runs after the property test (file order): it must have covered many sharded arrays."""
    print(STATS)
    assert STATS["examples"] >= 20, STATS
    assert STATS["jax_saved"] >= 25 and STATS["jax_targets"] >= 25, STATS


def _leaves(spec):
    if isinstance(spec, dict):
        for v in spec.values():
            yield from _leaves(v)
    elif isinstance(spec, list) or (isinstance(spec, tuple) and (not spec or spec[0] not in ("array", "scalar"))):
        for v in spec:
            yield from _leaves(v)
    else:
        yield spec
