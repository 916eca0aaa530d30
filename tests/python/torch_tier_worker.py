"""One process of a 2-process torch job (gloo on 127.0.0.1) with a multi-tier CheckpointManager,
for test_torch_tiers.py, run on a simulated node by examples/multitier/cluster.py (hence its
command line, the one examples/multitier/worker.py takes):

    python torch_tier_worker.py --pid I --nproc 2 --port P --persistent ROOT --local-dir DIR
                                --out DIR --last-step N [--persistent-interval K]

The state is a data-parallel one, as DDP's or a replicated DTensor's: a plain tensor, two
DTensors replicated over a mesh of 2, an optimizer-like dict, every value a function of the
step (state_at). The job resumes from the manager's latest step (restored onto other
placements: the DTensors sharded), checks the values and its per-process value, then "trains"
to --last-step, saving every step to the local tier and every K steps to ROOT (any store URL).
It writes out/process-<I>.json: the step it resumed from, the restore's bytes per tier and
the steps of both tiers at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch

SHAPES = {"w": ((64, 32), torch.float32), "emb": ((40, 8), torch.bfloat16),
          "b": ((24,), torch.float32)}


def state_at(step: int) -> dict[str, torch.Tensor]:
    """The global values of the state's tensors at `step` (the same in every process)."""
    out = {}
    for i, (name, (shape, dtype)) in enumerate(SHAPES.items()):
        n = 1
        for d in shape:
            n *= d
        out[name] = ((torch.arange(n, dtype=torch.float64) * 0.5 + 100 * step + i)
                     .reshape(shape).to(dtype))
    return out


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--persistent", required=True)
    ap.add_argument("--local-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--last-step", type=int, required=True)
    ap.add_argument("--persistent-interval", type=int, default=10)
    return ap.parse_args()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and
            torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                        b.contiguous().reshape(-1).view(torch.uint8)))


def run(args) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import tensorstash

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (args.nproc,), mesh_dim_names=("dp",))

    def tree(step: int, placements, zero: bool = False) -> dict:
        values = state_at(step)
        if zero:
            values = {k: torch.zeros_like(v) for k, v in values.items()}
        return {"model": {"w": values["w"],
                          "emb": distribute_tensor(values["emb"], mesh, placements,
                                                   src_data_rank=None),
                          "b": distribute_tensor(values["b"], mesh, placements,
                                                 src_data_rank=None)},
                "optim": {"step": step, "param_groups": [{"lr": 0.01, "params": [0, 1, 2]}]}}

    result = {"pid": rank, "resumed_from": None, "restore": None}
    mgr = tensorstash.CheckpointManager(
        args.persistent, save_interval_steps=args.persistent_interval, max_to_keep=2,
        local_dir=args.local_dir, local_save_interval_steps=1, local_max_to_keep=1,
        coordination_timeout=60, local_server_address="127.0.0.1")
    start = mgr.latest_step()
    if start is None:
        start = 0
    else:
        got = mgr.restore(start, target=tree(start, [Shard(0)], zero=True))
        want = state_at(start)
        assert same_bits(got["model"]["w"], want["w"]), "w"
        for name in ("emb", "b"):
            leaf = got["model"][name]
            assert isinstance(leaf, DTensor) and tuple(leaf.placements) == (Shard(0),), name
            local = distribute_tensor(want[name], mesh, [Shard(0)], src_data_rank=None)
            assert same_bits(leaf.to_local(), local.to_local()), name
        assert got["optim"]["step"] == start, got["optim"]
        mine = mgr.per_process(start)
        assert mine == {"rank": rank, "step": start}, mine
        stats = mgr.last_restore_stats
        result["resumed_from"] = start
        result["restore"] = {"bytes_from": stats.bytes_from, "failures": list(stats.failures)}
    for step in range(start + 1, args.last_step + 1):
        mgr.save(step, tree(step, [Replicate()]), per_process={"rank": rank, "step": step})
    mgr.wait_until_finished()
    result["local_steps"] = mgr.local_steps()
    result["all_steps"] = mgr.all_steps()
    mgr.close()
    return result


def write_result(args, result: dict) -> None:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"process-{args.pid}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def main() -> int:
    args = parse_args()
    import torch.distributed as dist

    ok = True
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.pid, world_size=args.nproc,
                                timeout=datetime.timedelta(seconds=90))
        result = run(args)
        write_result(args, result)
        dist.barrier()  # (rank 0 holds the store: it stays until everyone is done with it)
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test through the result
        traceback.print_exc()
        write_result(args, {"pid": args.pid, "error": f"{type(e).__name__}: {e}"})
        ok = False
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)  # a failed peer must not keep this one up


if __name__ == "__main__":
    sys.exit(main())
