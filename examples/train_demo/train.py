"""A small JAX training job that checkpoints with tensorstash.CheckpointManager.

An MLP (about 2.4 M parameters by default) learns a synthetic regression task with a
hand-written Adam, on 8 CPU devices arranged as the mesh given by --mesh (2x4, 4x2, 1x8, ...).
Parameters and optimizer state are sharded over that mesh. Every --save-every steps the whole
state is saved asynchronously (the loop only waits for the copy to host memory), with the run's
config as JSON metadata and the data iterator's position as per-process state. Started again on
the same --ckpt-dir, the job resumes from the newest complete step, restoring onto the *current*
mesh, and continues as if it had never stopped: the losses are bit-identical to an uninterrupted
run's, whatever mesh either part ran on.

    python examples/train_demo/train.py --ckpt-dir /tmp/ckpts --log /tmp/log.jsonl --mesh 2x4
    python examples/train_demo/train.py --ckpt-dir /tmp/ckpts --log /tmp/log.jsonl --mesh 4x2

Every event goes to --log as one JSON object per line, each written with one write(2) so that a
killed process never leaves half a line:
    {"event": "start", "resumed_from": 40 or null, "restore_s": ..., "mesh": [4, 2], ...}
    {"event": "loss", "step": 41, "loss": 0.123}   # the loss of the batch of step 41, computed
                                                    # with the parameters after 41 updates
    {"event": "save", "step": 50}                   # save() returned: the state is copied
    {"event": "saved", "step": 50, "blocking_s": ..., "stored_bytes": ..., ...}   # on commit
    {"event": "preempted", "step": 57}              # --handle-sigterm: saved step 57 and left
    {"event": "done", "step": 100, "digest": "sha256 of every parameter and optimizer byte"}

With --handle-sigterm a SIGTERM (what a scheduler sends before it preempts a job) makes the loop
save its current step, wait for the commit, and exit 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

# 8 CPU devices: must be set before JAX is first imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

# float32 throughout, whatever JAX_ENABLE_X64 says, so that every run computes the same bits.
jax.config.update("jax_enable_x64", False)

import tensorstash  # noqa: E402

AXES = ("data", "model")

# What must be the same for a run to resume another's checkpoints (the mesh, the number of steps
# and the checkpoint cadence may change between restarts).
MODEL_KEYS = ("d_in", "hidden", "layers", "d_out", "batch", "lr", "seed")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", required=True, help="checkpoint root (steps are folders in it)")
    p.add_argument("--log", required=True, help="JSON-lines file the events are appended to")
    p.add_argument("--mesh", default="2x4", help="device mesh DATAxMODEL over the 8 devices")
    p.add_argument("--steps", type=int, default=100, help="train until this many updates")
    p.add_argument("--save-every", type=int, default=10, help="save every k steps (0: never)")
    p.add_argument("--max-to-keep", type=int, default=3)
    p.add_argument("--sync-save", action="store_true", help="blocking saves instead of async")
    p.add_argument("--handle-sigterm", action="store_true",
                   help="on SIGTERM, save the current step and exit 0")
    p.add_argument("--d-in", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3, help="hidden layers")
    p.add_argument("--d-out", type=int, default=128)
    p.add_argument("--batch", type=int, default=64, help="global batch (a multiple of 8)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="sleep this long after each step (tests use it to slow a tiny model down)")
    args = p.parse_args(argv)
    try:
        args.mesh_shape = tuple(int(n) for n in args.mesh.lower().split("x"))
    except ValueError:
        p.error(f"--mesh {args.mesh!r}: expected DATAxMODEL, e.g. 2x4")
    if len(args.mesh_shape) != 2 or args.mesh_shape[0] * args.mesh_shape[1] != 8:
        p.error(f"--mesh {args.mesh!r}: need two sizes whose product is 8")
    if args.batch % 8:
        p.error("--batch must be a multiple of 8 (one slice per device)")
    return args


class EventLog:
    """Appends one JSON object per line; each line is a single write(2) on an O_APPEND file, so a
    SIGKILL never leaves a partial line and concurrent writers (the commit callback's thread)
    never interleave."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, **event) -> None:
        os.write(self.fd, (json.dumps(event) + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)


class SyntheticData:
    """Deterministic synthetic regression data: batch i is a pure function of (seed, i), so the
    iterator's whole state is its position, which each process saves as its per-process state.
    Inputs are standard normal; targets are sin(x @ T) for a fixed random "teacher" T."""

    def __init__(self, seed: int, batch: int, d_in: int, d_out: int):
        self.seed, self.batch, self.d_in = seed, batch, d_in
        teacher = np.random.default_rng([seed, 2**31]).standard_normal((d_in, d_out))
        self.teacher = teacher / np.sqrt(d_in)
        self.position = 0

    def state(self) -> dict:
        return {"seed": self.seed, "position": self.position}

    def set_state(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"the checkpoint's data iterator has seed {state['seed']}, "
                             f"this run {self.seed}")
        self.position = int(state["position"])

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.position])
        x = rng.standard_normal((self.batch, self.d_in))
        y = np.sin(x @ self.teacher)
        self.position += 1
        return x.astype(np.float32), y.astype(np.float32)


def layer_dims(cfg: dict) -> list[int]:
    return [cfg["d_in"]] + [cfg["hidden"]] * cfg["layers"] + [cfg["d_out"]]


def param_specs(cfg: dict) -> dict:
    """How each parameter is sharded: weights over both mesh axes, biases over "model"."""
    specs = {}
    for i in range(len(layer_dims(cfg)) - 1):
        specs[f"w{i}"] = P("data", "model")
        specs[f"b{i}"] = P("model")
    return specs


def init_params(cfg: dict) -> dict:
    rng = np.random.default_rng([cfg["seed"], 2**31 + 1])
    params = {}
    dims = layer_dims(cfg)
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        params[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        params[f"b{i}"] = np.zeros((b,), np.float32)
    return params


def forward(params: dict, x: jax.Array, n_layers: int) -> jax.Array:
    h = x
    for i in range(n_layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n_layers - 1:
            h = jax.nn.gelu(h)
    return h


def make_train_step(cfg: dict, mesh: Mesh):
    """One Adam step, as a jitted function of (state, x, y) -> (loss, new state).

    Why shard_map and not plain jit with sharded parameters: the losses must not depend on the
    mesh, bit for bit, so that a job resumed on 4x2 continues exactly where the 2x4 one stopped.
    Left to itself, XLA's partitioner computes `h @ w` with w split over the contraction axis as
    partial products plus an all-reduce whose grouping follows the mesh (on 2x4 vs 4x2 the same
    sums are added in a different order), and the losses of the two meshes drift apart in the
    last bits within a few steps (tried: they do). So this step fixes the order of every
    floating-point reduction itself, in a way that is the same on every 8-device mesh:
      - the batch is split over all 8 devices in device order (P(("data", "model"))), which is
        the same slice per device on every mesh;
      - each device all-gathers the parameters (data movement only, no arithmetic) and computes
        its slice's forward and backward pass with whole weight matrices;
      - the loss and gradients are summed with one psum over all 8 devices (one replica group,
        in device order: again the same on every mesh);
      - each device keeps its own block of the summed gradient and updates its shards of
        parameters and Adam moments elementwise, which no sharding can change.
    Storage (and what the checkpoint holds) stays sharded over the mesh; only the arithmetic
    is made layout-independent.
    """
    specs = param_specs(cfg)
    n_layers = len(specs) // 2
    state_specs = {"params": specs, "opt": {"mu": specs, "nu": specs, "count": P()}}
    batch_spec = P(AXES, None)
    total = cfg["batch"] * cfg["d_out"]
    lr, b1, b2, eps = cfg["lr"], 0.9, 0.999, 1e-8

    def gather(a, spec):
        for dim, axis in enumerate(spec):
            if axis is not None:
                a = jax.lax.all_gather(a, axis, axis=dim, tiled=True)
        return a

    def own_block(full, like, spec):
        for dim, axis in enumerate(spec):
            if axis is not None:
                size = like.shape[dim]
                full = jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(axis) * size, size, dim)
        return full

    def local_step(state, x, y):
        params = state["params"]
        whole = {k: gather(v, specs[k]) for k, v in params.items()}

        def loss_fn(p):
            err = forward(p, x, n_layers) - y
            return jnp.sum(err * err) / total  # this device's share of the mean

        loss, grads = jax.value_and_grad(loss_fn)(whole)
        loss = jax.lax.psum(loss, AXES)
        grads = jax.lax.psum(grads, AXES)
        grads = {k: own_block(g, params[k], specs[k]) for k, g in grads.items()}
        count = state["opt"]["count"] + 1
        t = count.astype(jnp.float32)
        c1 = 1 - jnp.power(jnp.float32(b1), t)
        c2 = 1 - jnp.power(jnp.float32(b2), t)
        mu = {k: b1 * state["opt"]["mu"][k] + (1 - b1) * g for k, g in grads.items()}
        nu = {k: b2 * state["opt"]["nu"][k] + (1 - b2) * (g * g) for k, g in grads.items()}
        new_params = {k: params[k] - lr * (mu[k] / c1) / (jnp.sqrt(nu[k] / c2) + eps)
                      for k in params}
        return loss, {"params": new_params, "opt": {"mu": mu, "nu": nu, "count": count}}

    step = jax.shard_map(local_step, mesh=mesh, in_specs=(state_specs, batch_spec, batch_spec),
                         out_specs=(P(), state_specs), check_vma=False)
    # The old state's buffers are donated: they are reused for the new state as soon as a step
    # runs, which is only safe because CheckpointManager.save has copied them to host memory
    # by the time it returns (an async save that kept referring to them would save garbage,
    # and the resumed run's losses would show it).
    return jax.jit(step, donate_argnums=0), state_specs, batch_spec


def shardings(specs, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, P))


def initial_state(cfg: dict, mesh: Mesh, state_specs) -> dict:
    params = init_params(cfg)
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    state = {"params": params, "opt": {"mu": zeros, "nu": zeros, "count": np.zeros((), np.int32)}}
    return jax.device_put(state, shardings(state_specs, mesh))


def abstract_state(cfg: dict, mesh: Mesh, state_specs) -> dict:
    """The restore target: shapes and dtypes, each with its sharding on the *current* mesh."""
    params = {k: v.shape for k, v in init_params(cfg).items()}
    shapes = {"params": params, "opt": {"mu": params, "nu": params, "count": ()}}
    dtypes = jax.tree.map(lambda s: np.int32 if s == () else np.float32, shapes,
                          is_leaf=lambda s: isinstance(s, tuple))
    return jax.tree.map(lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype,
                                                                           sharding=sharding),
                        shapes, dtypes, shardings(state_specs, mesh),
                        is_leaf=lambda s: isinstance(s, tuple))


def digest(state: dict) -> str:
    """sha256 of every array's bytes, in path order: equal digests mean bit-identical states."""
    h = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(state),
                             key=lambda kv: jax.tree_util.keystr(kv[0])):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
    return h.hexdigest()


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = {"d_in": args.d_in, "hidden": args.hidden, "layers": args.layers,
           "d_out": args.d_out, "batch": args.batch, "lr": args.lr, "seed": args.seed}
    devices = jax.devices()
    if len(devices) != 8:
        raise SystemExit(f"need 8 devices, have {len(devices)} (was JAX imported before "
                         "XLA_FLAGS was set?)")
    mesh = Mesh(np.array(devices).reshape(args.mesh_shape), AXES)
    log = EventLog(args.log)
    train_step, state_specs, batch_spec = make_train_step(cfg, mesh)
    batch_sharding = NamedSharding(mesh, batch_spec)
    # Compiled ahead, so that "start" in the log means ready to train.
    batch_struct = jax.ShapeDtypeStruct((cfg["batch"], cfg["d_in"]), np.float32,
                                        sharding=batch_sharding)
    target_struct = jax.ShapeDtypeStruct((cfg["batch"], cfg["d_out"]), np.float32,
                                         sharding=batch_sharding)
    train_step = train_step.lower(abstract_state(cfg, mesh, state_specs), batch_struct,
                                  target_struct).compile()
    data = SyntheticData(cfg["seed"], cfg["batch"], cfg["d_in"], cfg["d_out"])

    def on_save(stats) -> None:  # runs when a step has committed
        log.write(event="saved", step=stats.step, async_save=stats.async_save,
                  raw_bytes=stats.raw_bytes, stored_bytes=stats.stored_bytes,
                  blocking_s=stats.blocking_s, total_s=stats.total_s, gbps=stats.gbps)

    mgr = tensorstash.CheckpointManager(args.ckpt_dir, max_to_keep=args.max_to_keep,
                                        save_interval_steps=max(args.save_every, 1),
                                        async_save=not args.sync_save,
                                        handle_sigterm=args.handle_sigterm, on_save=on_save)
    with mgr:
        step = mgr.latest_step()
        restore_s = None
        if step is None:
            step = 0
            state = initial_state(cfg, mesh, state_specs)
        else:
            saved_cfg = mgr.metadata(step)["config"]
            changed = [k for k in MODEL_KEYS if saved_cfg.get(k) != cfg[k]]
            if changed:
                raise SystemExit(f"{mgr.step_path(step)} was saved with another config "
                                 f"({', '.join(f'{k}: {saved_cfg.get(k)} vs {cfg[k]}' for k in changed)})")
            t0 = time.perf_counter()
            state = mgr.restore(step, target=abstract_state(cfg, mesh, state_specs))
            jax.block_until_ready(state)
            restore_s = time.perf_counter() - t0
            data.set_state(mgr.per_process(step)["data_iter"])
            if data.position != step or int(state["opt"]["count"]) != step:
                raise SystemExit(f"step {step}: data position {data.position}, Adam count "
                                 f"{int(state['opt']['count'])}")
        log.write(event="start", pid=os.getpid(), mesh=list(args.mesh_shape),
                  resumed_from=None if restore_s is None else step, restore_s=restore_s,
                  steps=args.steps, config=cfg)

        saved_step = step if restore_s is not None else None

        last_loss = None

        def save(force: bool = False) -> None:
            nonlocal saved_step
            if mgr.save(step, state, metadata={"config": cfg, "mesh": list(args.mesh_shape)},
                        per_process={"data_iter": data.state()},
                        metrics=None if last_loss is None else {"loss": last_loss}, force=force):
                saved_step = step
                log.write(event="save", step=step)  # copied to host; the write goes on

        while step < args.steps:
            x, y = next(data)
            loss, state = train_step(state, jax.device_put(x, batch_sharding),
                                     jax.device_put(y, batch_sharding))
            last_loss = float(loss)
            log.write(event="loss", step=step, loss=last_loss)
            step += 1
            if args.save_every and (mgr.should_save(step) or step == args.steps):
                save(force=step == args.steps)
            if args.handle_sigterm and mgr.reached_preemption(step):
                if saved_step != step:
                    save(force=True)
                mgr.wait_until_finished()
                log.write(event="preempted", step=step)
                return 0
            if args.step_sleep:
                time.sleep(args.step_sleep)
        mgr.wait_until_finished()
        log.write(event="done", step=step, digest=digest(state))
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
