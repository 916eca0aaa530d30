"""Switching a Flax NNX training loop from Orbax to tensorstash, mid-run (README: "Coming from
Orbax").

    python examples/from_orbax/nnx_switch.py [--root /tmp/nnx_run] [--steps 6]

Part 1 is the loop as an Orbax user has it today: an NNX model with dropout (so its state holds
typed PRNG keys) and an optax optimizer, checkpointed by `ocp.CheckpointManager` every 2 steps.
Part 2 is the same loop after the switch: `tensorstash.CheckpointManager` opens the same root,
finds Orbax's steps, resumes from the newest one and goes on saving there in Orbax's format
(`format="orbax"` is what the root already holds; drop it on a new root to save tensorstash's own
format). Part 3 shows that nothing was locked in: Orbax's own manager lists every step and
restores the last one, written by tensorstash, bit for bit.

Prints "PASS" at the end; any difference raises.
"""

from __future__ import annotations

import argparse
import os
import shutil

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402

import tensorstash  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.hidden(x))))


def make():
    model = MLP(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def batch(step: int):
    rng = np.random.default_rng(step)
    x = rng.standard_normal((64, 16), dtype=np.float32)
    return x, x.sum(axis=1, keepdims=True)


def abstract_state():
    """The state's shapes, dtypes and shardings, without computing it (what both tools restore
    into)."""
    return nnx.state(nnx.eval_shape(make))


def same(a, b) -> bool:
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="/tmp/tensorstash_nnx_switch")
    p.add_argument("--steps", type=int, default=6, help="steps of each part")
    args = p.parse_args()
    shutil.rmtree(args.root, ignore_errors=True)
    n = args.steps

    # --- 1. Before: Orbax's CheckpointManager ---------------------------------------------
    model, optimizer = make()
    options = ocp.CheckpointManagerOptions(max_to_keep=3, save_interval_steps=2)
    with ocp.CheckpointManager(args.root, options=options) as mgr:
        for step in range(n):
            loss = train_step(model, optimizer, *batch(step))
            mgr.save(step, args=ocp.args.StandardSave(nnx.state((model, optimizer))),
                     metrics={"loss": float(loss)})
        mgr.wait_until_finished()
    print(f"orbax:       steps {sorted(ocp.CheckpointManager(args.root).all_steps())}")

    # --- 2. After: tensorstash's CheckpointManager on the same root --------------------------
    model, optimizer = make()  # a fresh process would start here
    with tensorstash.CheckpointManager(args.root, max_to_keep=3, save_interval_steps=2,
                                       format="orbax") as mgr:
        start = mgr.latest_step()
        print(f"tensorstash: found {mgr.format} steps {mgr.all_steps()}, resuming from {start}")
        state = mgr.restore(start, target=abstract_state())
        nnx.update((model, optimizer), state)
        for step in range(start + 1, start + 1 + n):
            loss = train_step(model, optimizer, *batch(step))
            mgr.save(step, nnx.state((model, optimizer)), metrics={"loss": float(loss)})
        mgr.wait_until_finished()
        last = mgr.latest_step()
        print(f"tensorstash: steps {mgr.all_steps()} (loss {float(loss):.4f})")

    # --- 3. Orbax still reads the run --------------------------------------------------------
    with ocp.CheckpointManager(args.root) as mgr:
        steps = mgr.all_steps()
        restored = mgr.restore(last, args=ocp.args.StandardRestore(abstract_state()))
    if last not in steps:
        raise AssertionError(f"Orbax does not list step {last}: {steps}")
    mine = nnx.state((model, optimizer))
    diffs = [jax.tree_util.keystr(k) for (k, a), b in zip(
        jax.tree_util.tree_leaves_with_path(mine), jax.tree_util.tree_leaves(restored))
        if not same(a, b)]
    if diffs or jax.tree_util.tree_structure(mine) != jax.tree_util.tree_structure(restored):
        raise AssertionError(f"Orbax restored step {last} differently: {diffs}")
    print(f"orbax:       lists {steps}, restores step {last} as saved")
    print("PASS")


if __name__ == "__main__":
    main()
