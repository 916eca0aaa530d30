#!/usr/bin/env python3
"""The PyTorch benchmark (issue 39 part 8): tensorstash against DCP (FileSystemWriter/Reader,
async_save, its Hugging Face consolidation), torch.save/torch.load and safetensors, on the same
state dict, folder and machine, next to the raw write speed (see bench/README.md, "pytorch").

    python bench/pytorch.py [--gib 1.0] [--runs 3] [--warmup 1] [--tools ...] [--quick]

(Named pytorch.py, not torch.py: a script's folder comes first on sys.path, so a bench/torch.py
would be imported as torch by every script of bench/ that imports torch, itself included.)

The harness imports neither torch nor tensorstash; each job is a gloo job of 1 or 2 fresh
processes on 127.0.0.1 (`--worker`), which builds the state dict (outside the timed regions),
runs its operations and prints BENCH_RESULT with rank 0's times. A timed region of a job of 2
runs from a barrier to a barrier. Every save starts after `sync` with its previous output
removed and free memory primed (scenarios.prime_free_memory); every restore starts after the
page cache is dropped (cold; "warm" in the results where the machine refuses). Results:
<out>/pytorch.json (every run) and pytorch.md (medians, min..max, ratios, goals).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import scenarios as S  # noqa: E402  (numpy only)

MiB, GiB = 1 << 20, 1 << 30
D_MODEL = 1024
TOOLS = ("tensorstash", "dcp", "dcp+ts", "torch.save", "safetensors")
DEFAULT_TOOLS = ("tensorstash", "dcp", "torch.save", "safetensors")
DISTRIBUTED = ("tensorstash", "dcp", "dcp+ts")  # the tools that save and restore DTensors


def log(msg: str) -> None:
    print(msg, flush=True)


# --- the state dicts --------------------------------------------------------------------------

def layer_shapes(i: int) -> dict[str, tuple[int, ...]]:
    """One layer's tensors (48 MiB of float32 with D_MODEL 1024)."""
    d = D_MODEL
    return {f"layers.{i}.attn.qkv.weight": (3 * d, d), f"layers.{i}.attn.out.weight": (d, d),
            f"layers.{i}.mlp.up.weight": (4 * d, d), f"layers.{i}.mlp.down.weight": (d, 4 * d),
            f"layers.{i}.ln1.weight": (d,), f"layers.{i}.ln2.weight": (d,)}


def model_shapes(gib: float) -> dict[str, tuple[int, ...]]:
    """A transformer-like state dict of about `gib` GiB of float32: an embedding (8192 x 1024;
    512 rows below 0.25 GiB) and as many layers as the rest takes, at least one."""
    emb_rows = 8192 if gib >= 0.25 else 512
    per_layer = nbytes(layer_shapes(0))
    layers = max(1, round((gib * GiB - emb_rows * D_MODEL * 4) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (emb_rows, D_MODEL)}
    for i in range(layers):
        shapes.update(layer_shapes(i))
    return shapes


def small_shapes(count: int, kib: int) -> dict[str, tuple[int, ...]]:
    return {f"small.{i}": (kib * 256,) for i in range(count)}


def nbytes(shapes: dict[str, tuple[int, ...]]) -> int:
    total = 0
    for shape in shapes.values():
        n = 4
        for d in shape:
            n *= d
        total += n
    return total


# --- the worker (a process of a gloo job) -----------------------------------------------------

def worker_main(job: dict) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=20))
    try:
        W = Worker(job, rank, world)
        out = {}
        for op in job["ops"]:
            out[op] = W.run(op)
            dist.barrier()
        if rank == 0:
            print("BENCH_RESULT " + json.dumps(out), flush=True)
    finally:
        dist.destroy_process_group()


class Worker:
    def __init__(self, job: dict, rank: int, world: int):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.job, self.rank, self.world = job, rank, world
        self.tool = job["tool"]
        self.dir = job["dir"]
        self.verify = job["verify"]
        self.shapes = model_shapes(job["gib"])
        self.mesh = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            self.mesh = init_device_mesh("cpu", (world,))
        # Every module a tool's calls use is imported here, outside the timed regions (the
        # first import of tensorstash or of torch.distributed.checkpoint takes seconds on a
        # loaded machine).
        import safetensors.torch  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.format_utils  # noqa: F401
        import torch.distributed.checkpoint._consolidate_hf_safetensors  # noqa: F401
        import torch.distributed.tensor  # noqa: F401
        import tensorstash
        import tensorstash.torch
        import tensorstash.torch_dcp  # noqa: F401
        del tensorstash

    # Values: a function of the tensor's number and the element's global index, exact in
    # float32, so that any process can make or check any part of any tensor.
    def _values(self, k: int, shape: tuple[int, ...], rows: tuple[int, int] | None = None):
        torch = self.torch
        cols = 1
        for d in shape[1:]:
            cols *= d
        lo, hi = rows if rows is not None else (0, shape[0])
        idx = torch.arange(lo * cols, hi * cols, dtype=torch.int32)
        v = idx.mul_(40503).add_(k * 97).bitwise_and_(0xFFFFFF).to(torch.float32)
        return v.reshape((hi - lo,) + tuple(shape[1:]))

    def state(self, shapes: dict, sharded: bool, zero: bool = False) -> dict:
        """The state dict of `shapes`: plain tensors, or with `sharded` DTensors sharded by rows
        over this job's mesh; zeros of the same layout with `zero` (restore targets)."""
        torch = self.torch
        out = {}
        for k, (name, shape) in enumerate(shapes.items()):
            if sharded and self.world > 1:
                from torch.distributed.tensor import DTensor, Shard
                per = -(-shape[0] // self.world)
                lo, hi = min(shape[0], self.rank * per), min(shape[0], (self.rank + 1) * per)
                local = (torch.zeros((hi - lo,) + tuple(shape[1:])) if zero
                         else self._values(k, shape, (lo, hi)))
                full = torch.empty(shape, device="meta")
                out[name] = DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False,
                                               shape=full.shape, stride=full.stride())
            else:
                out[name] = torch.zeros(shape) if zero else self._values(k, shape)
        return out

    def check(self, shapes: dict, got: dict, what: str) -> None:
        if not self.verify:
            return
        torch = self.torch
        for k, (name, shape) in enumerate(shapes.items()):
            t = got[name]
            if hasattr(t, "to_local"):
                from torch.distributed.tensor import Shard
                assert tuple(t.placements) == (Shard(0),), (what, name)
                per = -(-shape[0] // self.world)
                lo, hi = min(shape[0], self.rank * per), min(shape[0], (self.rank + 1) * per)
                want, t = self._values(k, shape, (lo, hi)), t.to_local()
            else:
                want = self._values(k, shape)
            if not torch.equal(t, want):
                raise AssertionError(f"{self.tool} {what}: {name} differs on rank {self.rank}")

    # -- timing helpers

    def barrier(self) -> None:
        self.dist.barrier()

    def before_save(self, path: str, n: int) -> None:
        if self.rank == 0:
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self.barrier()
        os.sync()
        S.prime_free_memory(os.path.join(self.dir, f"prime{self.rank}"), n // self.world)
        self.barrier()

    def before_restore(self, n: int) -> str:
        """Drops the page cache, or evicts the benchmark folder's files from it (rank 0);
        returns how cold the cache is (scenarios.make_cold)."""
        os.sync()
        cache = S.make_cold(self.dir) if self.rank == 0 else "cold"
        S.prime_free_memory(os.path.join(self.dir, f"prime{self.rank}"), 2 * n // self.world)
        self.barrier()
        return cache

    def timed(self, fn):
        self.barrier()
        t0 = time.perf_counter()
        out = fn()
        self.barrier()
        return time.perf_counter() - t0, out

    def path(self, what: str) -> str:
        safe = self.tool.replace("+", "_").replace(".", "_")
        return os.path.join(self.dir, safe, what)

    # -- the tools' calls

    def save(self, sd: dict, path: str) -> None:
        torch = self.torch
        if self.tool == "tensorstash":
            import tensorstash
            tensorstash.save(os.path.join(path, "0000000001"), sd)
        elif self.tool in ("dcp", "dcp+ts"):
            import torch.distributed.checkpoint as dcp
            writer = (dcp.FileSystemWriter(path) if self.tool == "dcp"
                      else _ts_writer(os.path.join(path, "0000000001")))
            dcp.save(sd, storage_writer=writer)
        elif self.tool == "torch.save":
            torch.save(sd, path)
            _fsync(path)
        elif self.tool == "safetensors":
            import safetensors.torch
            safetensors.torch.save_file(sd, path)
            _fsync(path)
        else:
            raise ValueError(self.tool)

    def restore(self, target: dict, path: str) -> dict:
        """Restores `path` into `target` in place (tensorstash, DCP) or as new tensors
        (torch.load, safetensors: they have no in-place load); returns the state dict."""
        torch = self.torch
        if self.tool == "tensorstash":
            import tensorstash.torch
            return tensorstash.torch.load(os.path.join(path, "0000000001"), target)
        if self.tool in ("dcp", "dcp+ts"):
            import torch.distributed.checkpoint as dcp
            reader = (dcp.FileSystemReader(path) if self.tool == "dcp"
                      else _ts_reader(os.path.join(path, "0000000001")))
            dcp.load(target, storage_reader=reader)
            return target
        if self.tool == "torch.save":
            return torch.load(path, weights_only=True)
        if self.tool == "safetensors":
            import safetensors.torch
            return safetensors.torch.load_file(path)
        raise ValueError(self.tool)

    # -- the operations

    def run(self, op: str) -> dict:
        return getattr(self, "op_" + op.replace("-", "_"))()

    def _save_op(self, shapes: dict, what: str, sharded: bool) -> dict:
        sd = self.state(shapes, sharded)
        path = self.path(what)
        self.before_save(path, nbytes(shapes))
        seconds, _ = self.timed(lambda: self.save(sd, path))
        return {"seconds": seconds}

    def _restore_op(self, shapes: dict, what: str, sharded: bool, label: str) -> dict:
        target = self.state(shapes, sharded, zero=True)
        cache = self.before_restore(nbytes(shapes))
        seconds, got = self.timed(lambda: self.restore(target, self.path(what)))
        self.check(shapes, got, label)
        return {"seconds": seconds, "cache": cache}

    def op_save_1(self):
        return self._save_op(self.shapes, "s1", False)

    def op_restore_1(self):
        return self._restore_op(self.shapes, "s1", False, "restore 1")

    def op_save_2(self):
        return self._save_op(self.shapes, "s2", True)

    def op_restore_2(self):
        return self._restore_op(self.shapes, "s2", True, "restore 2")

    def op_restore_2_to_1(self):
        return self._restore_op(self.shapes, "s2", False, "restore 2 -> 1")

    def op_restore_1_to_2(self):
        return self._restore_op(self.shapes, "s1", True, "restore 1 -> 2")

    def op_restore_dcp(self):
        """tensorstash.torch.load of DCP's own 1-process checkpoint (FileSystemWriter's files,
        read by tensorstash's DCP reader), in place; the DCP job runs it after its restore_1,
        which is dcp.load of the same files."""
        import tensorstash.torch
        assert self.tool == "dcp"
        target = self.state(self.shapes, False, zero=True)
        cache = self.before_restore(nbytes(self.shapes))
        seconds, got = self.timed(lambda: tensorstash.torch.load(self.path("s1"), target))
        self.check(self.shapes, got, "restore of DCP's checkpoint")
        return {"seconds": seconds, "cache": cache}

    def op_small_save(self):
        return self._save_op(small_shapes(self.job["small_count"], self.job["small_kib"]),
                             "small", False)

    def op_small_restore(self):
        return self._restore_op(small_shapes(self.job["small_count"], self.job["small_kib"]),
                                "small", False, "small restore")

    def op_async(self) -> dict:
        """How long the save call blocks, and until the step is complete, for the second of two
        background saves of the state (the first warms up)."""
        sd = self.state(self.shapes, self.world > 1)
        n = nbytes(self.shapes)
        root = self.path("async")
        if self.tool == "tensorstash":
            import tensorstash
            self.before_save(root, n)
            with tensorstash.CheckpointManager(root, async_save=True, max_to_keep=3) as mgr:
                mgr.save(1, sd)
                mgr.wait_until_finished()
                S.prime_free_memory(os.path.join(self.dir, f"prime{self.rank}"), n)
                self.barrier()
                t0 = time.perf_counter()
                mgr.save(2, sd)
                blocking = time.perf_counter() - t0
                mgr.wait_until_finished()
                self.barrier()
                committed = time.perf_counter() - t0
        elif self.tool == "dcp":
            import torch.distributed.checkpoint as dcp
            self.before_save(root, n)

            def start(step: int):
                response = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(
                    os.path.join(root, str(step))))
                return getattr(response, "upload_completion", response)

            start(1).result()
            S.prime_free_memory(os.path.join(self.dir, f"prime{self.rank}"), n)
            self.barrier()
            t0 = time.perf_counter()
            future = start(2)
            blocking = time.perf_counter() - t0
            future.result()
            self.barrier()
            committed = time.perf_counter() - t0
        else:
            raise ValueError(f"no async save for {self.tool}")
        if self.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        return {"blocking": blocking, "seconds": committed}

    def op_hf_save(self) -> dict:
        """DCP's Hugging Face writer, every rank its shards (save_distributed), one output file:
        the input of DCP's consolidation (op_consolidate)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        sd = self.state(self.shapes, True)
        path = self.path("hf_sharded")
        self.before_save(path, nbytes(self.shapes))
        mapping = {name: 1 for name in self.shapes}
        seconds, _ = self.timed(lambda: dcp.save(sd, storage_writer=HuggingFaceStorageWriter(
            path, fqn_to_index_mapping=mapping, save_distributed=True)))
        return {"seconds": seconds}

    def op_consolidate(self) -> dict:
        """DCP's consolidation of op_hf_save's shards into whole tensors in one safetensors
        file (its default of one thread), each output file fsynced as tensorstash's export
        syncs its own."""
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files)
        src, dst = self.path("hf_sharded"), self.path("hf_whole")
        self.before_save(dst, nbytes(self.shapes))
        os.makedirs(dst, exist_ok=True)
        mapping = {name: 1 for name in self.shapes}
        cache = self.before_restore(nbytes(self.shapes))

        def consolidate():
            consolidate_safetensors_files(src, dst, mapping)
            for name in os.listdir(dst):
                _fsync(os.path.join(dst, name))

        seconds, _ = self.timed(consolidate)
        return {"seconds": seconds, "cache": cache}

    def op_to_torch_save(self) -> dict:
        """DCP's format_utils.dcp_to_torch_save of the 2-process DCP checkpoint (whole tensors
        in one torch.save file), fsynced."""
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        src, dst = self.path("s2"), self.path("whole.pt")
        self.before_save(dst, nbytes(self.shapes))
        cache = self.before_restore(nbytes(self.shapes))

        def convert():
            dcp_to_torch_save(src, dst)
            _fsync(dst)

        seconds, _ = self.timed(convert)
        os.remove(dst)
        return {"seconds": seconds, "cache": cache}


def _ts_writer(path: str):
    import tensorstash.torch
    return tensorstash.torch.StorageWriter(path)


def _ts_reader(path: str):
    import tensorstash.torch
    return tensorstash.torch.StorageReader(path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- the harness ------------------------------------------------------------------------------

class HarnessError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(args, tool: str, nproc: int, ops: list[str], run: int) -> dict:
    job = {"tool": tool, "ops": ops, "dir": args.dir, "gib": args.gib,
           "small_count": args.small_count, "small_kib": args.small_kib,
           "verify": run < args.warmup + 1 or args.verify_all, "port": free_port()}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    env.update(OMP_NUM_THREADS="1", WORLD_SIZE=str(nproc))
    logs = os.path.join(args.dir, "logs")
    os.makedirs(logs, exist_ok=True)
    procs, files = [], []
    for rank in range(nproc):
        f = open(os.path.join(logs, f"run{run}-{tool}-{nproc}-{'+'.join(ops)}-{rank}.log"),
                 "w+")
        files.append(f)
        procs.append(subprocess.Popen(
            [args.python, os.path.abspath(__file__), "--worker", json.dumps(job)],
            env=dict(env, RANK=str(rank)), stdout=f, stderr=subprocess.STDOUT, cwd=REPO))
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                time.sleep(2)
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read())
        f.close()
    if any(p.returncode != 0 for p in procs):
        raise HarnessError(f"{tool} {ops} by {nproc} (run {run}) failed (exit statuses "
                           f"{[p.returncode for p in procs]}; -9: killed, e.g. out of memory):\n"
                           + "\n".join(t[-4000:] for t in texts))
    lines = [line for line in texts[0].splitlines() if line.startswith("BENCH_RESULT ")]
    return json.loads(lines[-1][len("BENCH_RESULT "):])


def export_ts(args, run: int) -> dict:
    """`tensorstash convert --to safetensors` of the 2-process tensorstash step, cold."""
    src = os.path.join(args.dir, "tensorstash", "s2", "0000000001")
    dst = os.path.join(args.dir, "tensorstash", "hf_whole")
    shutil.rmtree(dst, ignore_errors=True)
    n = nbytes(model_shapes(args.gib))
    os.sync()
    S.prime_free_memory(os.path.join(args.dir, "prime"), n)
    cache = S.make_cold(args.dir)
    t0 = time.perf_counter()
    p = subprocess.run([args.cli, "convert", "--to", "safetensors", src, dst],
                       capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        raise HarnessError(f"tensorstash convert failed (run {run}):\n{p.stdout}\n{p.stderr}")
    return {"seconds": seconds, "cache": cache}


def check_exports(args) -> None:
    """The two Hugging Face exports hold the same tensors, bit for bit (safetensors.numpy)."""
    import numpy as np
    from safetensors.numpy import load_file

    def load(folder: str) -> dict:
        out = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(folder, name)))
        return out

    ours = load(os.path.join(args.dir, "tensorstash", "hf_whole"))
    theirs = load(os.path.join(args.dir, "dcp", "hf_whole"))
    if set(ours) != set(model_shapes(args.gib)) or set(ours) != set(theirs):
        raise HarnessError(f"the exports name different tensors: {sorted(set(ours) ^ set(theirs))[:5]}")
    for name in ours:
        if not np.array_equal(ours[name], theirs[name]):
            raise HarnessError(f"the exports differ at {name}")


# What an operation needs done before it in the same run (the checkpoint it reads).
NEEDS = {"restore_1": ["save_1"], "restore_2": ["save_2"], "restore_2_to_1": ["save_2"],
         "restore_1_to_2": ["save_1"], "restore_dcp": ["save_1", "restore_1"],
         "small_restore": ["small_save"], "consolidate": ["hf_save"],
         "to_torch_save": ["save_2"], "export": ["save_2", "hf_save", "consolidate"]}


def wanted_ops(only: list[str] | None) -> set[str] | None:
    """The operations to run for `--ops` (with what they need); None: all."""
    if only is None:
        return None
    out, todo = set(), list(only)
    while todo:
        op = todo.pop()
        if op not in out:
            out.add(op)
            todo += NEEDS.get(op, [])
    return out


def one_run(args, run: int, results: dict) -> None:
    def record(op: str, tool: str, value: dict) -> None:
        results["runs"].setdefault(op, {}).setdefault(tool, []).append(dict(value, run=run))

    wanted = wanted_ops(args.ops)

    def job(tool: str, nproc: int, ops: list[str]) -> dict:
        ops = [op for op in ops if wanted is None or op in wanted]
        if not ops:
            return {}
        log(f"run {run}: {tool} by {nproc} process{'es' if nproc > 1 else ''}: {ops}")
        return run_job(args, tool, nproc, ops, run)

    shift = run % len(args.tools)
    tools = args.tools[shift:] + args.tools[:shift]  # an order rotating run by run
    dist_tools = [t for t in tools if t in DISTRIBUTED]
    # 2 processes: save and restore (DTensors sharded by rows); DCP's HF shards for its export.
    for tool in dist_tools:
        ops = ["save_2", "restore_2"] + (["hf_save"] if tool == "dcp" and args.export else [])
        for op, value in job(tool, 2, ops).items():
            record(op, tool, value)
    # 1 process.
    for tool in tools:
        ops = ["save_1", "restore_1"]
        if tool in DISTRIBUTED:
            ops.append("restore_2_to_1")
        if tool == "dcp" and "tensorstash" in tools:
            ops.append("restore_dcp")  # tensorstash reading DCP's own files
        if args.small_count:
            ops += ["small_save", "small_restore"]
        if tool in ("tensorstash", "dcp"):
            ops.append("async")
        if tool == "dcp" and args.export:
            ops += ["consolidate", "to_torch_save"]
        for op, value in job(tool, 1, ops).items():
            if op == "restore_dcp":
                record(op, "tensorstash", value)
                record(op, "dcp", results["runs"]["restore_1"]["dcp"][-1])
            else:
                record(op, tool, value)
    # 2 processes restore the 1-process checkpoints.
    for tool in dist_tools:
        for op, value in job(tool, 2, ["restore_1_to_2"]).items():
            record(op, tool, value)
    if (args.export and "tensorstash" in tools and "dcp" in tools
            and (wanted is None or "export" in wanted)):
        log(f"run {run}: export to safetensors (tensorstash convert)")
        record("export", "tensorstash", export_ts(args, run))
        if run < args.warmup + 1:
            check_exports(args)
    if wanted is not None and not wanted & {"export", "save_1", "restore_1"}:
        return
    # The storage's raw speed for the same bytes (bench/run.py's raw file test): a write with
    # fsync, and a cold read into fresh memory (its page faults count, as a restore's do).
    from run import RawFile
    raw, n = os.path.join(args.dir, "raw.bin"), nbytes(model_shapes(args.gib))
    log(f"run {run}: raw write and read")
    raw_file = RawFile()
    written = raw_file.write(raw, n, True)
    record("export", "raw write", {"seconds": written})
    record("save_1", "raw write", {"seconds": written})
    read, cache = raw_file.read(raw, n, cold=True, fresh=True), "cold"
    if read is None:  # the page cache cannot be dropped here: the file is evicted from it
        cache = S.make_cold(raw)
        read = raw_file.read(raw, n, cold=False, fresh=True) if cache != "warm" else None
    if read is not None:
        record("restore_1", "raw read", {"seconds": read, "cache": cache})
    os.remove(raw)
    for tool in tools:
        shutil.rmtree(os.path.join(args.dir, tool.replace("+", "_").replace(".", "_")),
                      ignore_errors=True)


# --- the report -------------------------------------------------------------------------------

OPS = [  # (op, what, bytes key)
    ("save_1", "save, 1 process", "model"), ("restore_1", "restore, 1 process", "model"),
    ("save_2", "save, 2 processes", "model"), ("restore_2", "restore, 2 processes", "model"),
    ("restore_2_to_1", "restore 2 -> 1 (saved by 2, restored by 1)", "model"),
    ("restore_1_to_2", "restore 1 -> 2 (onto DTensors)", "model"),
    ("restore_dcp", "restore DCP's own 1-process checkpoint (tensorstash: its DCP reader)",
     "model"),
    ("small_save", "many small: save", "small"), ("small_restore", "many small: restore", "small"),
    ("async", "async save (1 process)", "model"),
    ("hf_save", "DCP's HF writer, 2 processes (the consolidation's input)", "model"),
    ("export", "export to a Hugging Face safetensors folder", "model"),
    ("consolidate", "export to a Hugging Face safetensors folder", "model"),
    ("to_torch_save", "DCP's dcp_to_torch_save (whole tensors, one torch.save file)", "model"),
]
GOALS = [("save_1", 2.0), ("restore_1", 2.0), ("save_2", 2.0), ("restore_2", 2.0),
         ("restore_2_to_1", 3.0), ("restore_1_to_2", 3.0), ("restore_dcp", 1.0)]


def summarize(results: dict, warmup: int) -> dict:
    out: dict = {}
    for op, by_tool in results["runs"].items():
        for tool, entries in by_tool.items():
            counted = [e for e in entries if e["run"] >= warmup] or entries
            summary = {}
            for metric in ("seconds", "blocking"):
                values = [e[metric] for e in counted if metric in e]
                if values:
                    summary[metric] = {"median": statistics.median(values), "min": min(values),
                                       "max": max(values), "n": len(values)}
            summary["cache"] = sorted({e.get("cache", "") for e in counted} - {""})
            out.setdefault(op, {})[tool] = summary
    return out


def write_markdown(results: dict, path: str) -> None:
    summary, meta = results["summary"], results["meta"]
    sizes = {"model": meta["model_bytes"], "small": meta["small_bytes"]}
    lines = [f"# PyTorch: tensorstash against DCP, torch.save and safetensors",
             "", f"{meta['date']}, commit {meta['commit']}; "
             f"{meta.get('runs_done', meta['warmup'] + meta['runs']) - meta['warmup']} counted "
             "runs after "
             f"{meta['warmup']} warm-up; state dict {meta['model_bytes'] / GiB:.2f} GiB "
             f"({meta['model_tensors']} float32 tensors), many small: "
             f"{meta['small_count']} x {meta['small_kib']} KiB; load average "
             f"{meta['load_start']} at the start, {meta.get('load_end', '?')} at the end; "
             f"restores {meta['cache']}.", "",
             "| operation | participant | median | min..max | GiB/s | DCP / this |",
             "|---|---|---|---|---|---|"]
    exports = {}
    for op, what, size in OPS:
        if op not in summary:
            continue
        dcp = summary[op].get("dcp", {}).get("seconds", {}).get("median")
        for tool, s in summary[op].items():
            for metric in ("blocking", "seconds"):
                if metric not in s:
                    continue
                m = s[metric]
                label = what + (" (blocking)" if metric == "blocking" else
                                " (until complete)" if "blocking" in s else "")
                ref = summary[op].get("dcp", {}).get(metric, {}).get("median")
                ratio = (f"{ref / m['median']:.2f}x" if ref and tool != "dcp"
                         and not tool.startswith("raw") else "")
                rate = sizes[size] / GiB / m["median"]
                lines.append(f"| {label} | {tool} | {m['median']:.3f} s | {m['min']:.3f}.."
                             f"{m['max']:.3f} | {rate:.2f} | {ratio} |")
        if op in ("export", "consolidate"):
            for tool, s in summary[op].items():
                exports[tool if op == "export" else "dcp consolidate"] = s["seconds"]["median"]
        del dcp
    lines += ["", "Goals (issue 39): DCP median / tensorstash median.", "",
              "| operation | goal | measured |", "|---|---|---|"]
    for op, goal in GOALS:
        s = summary.get(op, {})
        if "tensorstash" in s and "dcp" in s:
            r = s["dcp"]["seconds"]["median"] / s["tensorstash"]["seconds"]["median"]
            lines.append(f"| {op} | {goal:.0f}x | {r:.2f}x {'met' if r >= goal else 'missed'} |")
    if "tensorstash" in exports and "raw write" in exports:
        frac = exports["raw write"] / exports["tensorstash"]
        theirs = (f" (DCP's consolidation: {exports['raw write'] / exports['dcp consolidate']:.0%})"
                  if "dcp consolidate" in exports else "")
        lines.append(f"| export (of raw write speed) | 80% | {frac:.0%} "
                     f"{'met' if frac >= 0.8 else 'missed'}{theirs} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--small-count", type=int, default=10_000)
    ap.add_argument("--small-kib", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tools", default=",".join(DEFAULT_TOOLS),
                    help=f"any of {', '.join(TOOLS)} (dcp+ts: DCP's save and load through "
                         "tensorstash.torch.StorageWriter/StorageReader)")
    ap.add_argument("--no-export", dest="export", action="store_false")
    ap.add_argument("--ops", default=None,
                    help="only these operations (comma-separated: save_1, restore_1, save_2, "
                         "restore_2, restore_2_to_1, restore_1_to_2, restore_dcp, small_save, "
                         "small_restore, async, export, ...) and what they need")
    ap.add_argument("--dir", default="/tmp/tensorstash-bench-torch")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--name", default="pytorch", help="the results' file names")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--pythonpath", default=os.environ.get("PYTHONPATH"),
                    help="PYTHONPATH of the workers (default: this one's)")
    ap.add_argument("--cli", default=os.environ.get(
        "TENSORSTASH_CLI", os.path.join(REPO, "build", "tensorstash")))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    ap.add_argument("--verify-all", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 32 MiB, 200 small tensors, 1 run, no warm-up")
    args = ap.parse_args(argv)
    args.tools = [t for t in args.tools.split(",") if t]
    args.ops = [op for op in args.ops.split(",") if op] if args.ops else None
    for t in args.tools:
        if t not in TOOLS:
            ap.error(f"unknown tool {t!r}; choose from {', '.join(TOOLS)}")
    if args.quick:
        args.gib, args.small_count, args.runs, args.warmup = 1 / 32, 200, 1, 0
        args.name = args.name + "-quick"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(json.loads(args.worker))
        return 0
    if os.path.exists(args.dir):
        shutil.rmtree(args.dir)
    os.makedirs(args.dir)
    os.makedirs(args.out, exist_ok=True)
    import run as bench_run  # (machine facts)
    shapes = model_shapes(args.gib)
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    versions = json.loads(subprocess.run(
        [args.python, "-c", "import importlib.metadata as m, json; print(json.dumps("
         "{n: m.version(n) for n in ['torch', 'safetensors', 'numpy']}))"],
        capture_output=True, text=True, check=True).stdout)
    results = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC"), "commit": commit, "runs": args.runs, "warmup": args.warmup,
        "model_bytes": nbytes(shapes), "model_tensors": len(shapes),
        "small_count": args.small_count, "small_kib": args.small_kib,
        "small_bytes": args.small_count * args.small_kib * 1024,
        "tools": args.tools, "machine": bench_run.machine_facts(args.dir),
        "versions": versions, "load_start": os.getloadavg()[0],
        "cache": "cold (page cache dropped)" if S.drop_page_cache() else
                 "cold (the benchmark's files evicted with posix_fadvise: the page cache "
                 "cannot be dropped here)"},
        "runs": {}}
    json_path = os.path.join(args.out, args.name + ".json")

    def write_results() -> None:
        results["meta"]["load_end"] = os.getloadavg()[0]
        results["summary"] = summarize(results, args.warmup)
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
        write_markdown(results, os.path.join(args.out, args.name + ".md"))

    try:
        for run in range(args.warmup + args.runs):
            one_run(args, run, results)
            results["meta"]["runs_done"] = run + 1
            write_results()  # (after every run: a stopped benchmark keeps what it measured)
    finally:
        write_results()
        shutil.rmtree(args.dir, ignore_errors=True)
    log(open(os.path.join(args.out, args.name + ".md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
