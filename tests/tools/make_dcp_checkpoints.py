"""Writes real PyTorch DCP checkpoints (FileSystemWriter: `.metadata` + `__<rank>_<n>.distcp`)
for tensorstash's DCP reader tests, with the torch in the virtual environment (nothing is
downloaded).

    python tests/tools/make_dcp_checkpoints.py OUT_DIR

OUT_DIR/single: one process; every dtype DCP stores, a view, a 0-d tensor, an empty tensor, and
non-tensor entries (an int, a str, a list), which DCP stores as torch.save'd bytes items.
OUT_DIR/two_ranks: two gloo processes on 127.0.0.1; "sharded" is a DTensor sharded on dim 0 over
both ranks (two chunks, one per rank's file), "replicated" a plain tensor both ranks hold.
OUT_DIR/expected.pt: the state dicts as torch.load returns them, for bit-exact comparisons.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp


def single_state():
    g = torch.Generator().manual_seed(0)
    sd = {
        "model": {
            "w": torch.randn(3, 4, generator=g),
            "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "view": torch.arange(20, dtype=torch.int64)[5:9],
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.zeros(0, 3, dtype=torch.float32),
        },
        "step": 7,
        "name": "abc",
        "lst": [1, 2.5, None, True],
    }
    for dt in (torch.float16, torch.int8, torch.uint8, torch.int16, torch.int32, torch.bool,
               torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.uint16,
               torch.uint32, torch.uint64):
        name = str(dt).removeprefix("torch.")
        sd["model"]["d_" + name] = (torch.arange(6) % 5).to(dt).reshape(2, 3)
    return sd


def two_rank_state(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    return {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "replicated": torch.arange(6, dtype=torch.int32),
        "step": 3,
    }


def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dcp.save(two_rank_state(rank), checkpoint_id=os.path.join(out, "two_ranks"))
    dist.destroy_process_group()


def main(out):
    os.makedirs(out, exist_ok=True)
    single = single_state()
    dcp.save(single, checkpoint_id=os.path.join(out, "single"),
             no_dist=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, out), nprocs=2)
    expected = {"single": single,
                "two_ranks": {"sharded": torch.arange(40, dtype=torch.float32).reshape(10, 4),
                              "replicated": torch.arange(6, dtype=torch.int32), "step": 3}}
    torch.save(expected, os.path.join(out, "expected.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
