"""Python's cyclic garbage collector paused around the package's bulk work."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """The cyclic garbage collector off inside the block (as it was, after). A restore or a
    save makes objects by the thousand per thousand arrays (boxes, buffers, shard views), none
    of them in cycles, and each collection walks every object alive. Profiles with 4,000
    arrays on 8 CPU devices: collections took 150 ms of a 750 ms restore, and 0.6-1.2 s of the
    save's 1.2-1.8 s gathering of shards.

    A young-generation pass runs first: it walks at most a few hundred objects, and it runs the
    collector's callbacks, where frameworks free what they deferred. JAX frees there the buffers
    of arrays the program has dropped (_xla_gc_callback), so without it the host memory of an
    earlier restore's arrays stays allocated through this one, and is freed in the middle of it
    (issue 38, part 7: a 288 MiB restore right after the process dropped a 128 MiB restored tree
    took 0.22-0.26 s without the pass, 0.15-0.18 s with it, on 2 loaded cores)."""
    gc.collect(0)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
