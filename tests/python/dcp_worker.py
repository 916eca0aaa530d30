"""One process of the 2-process gloo job of test_torch_dcp.py, launched by mp_launch.run_job:

    python dcp_worker.py --phase dcp2 --step WORK --nproc 2 --pid I --port P --layout -

Runs the distributed cases of DCP over tensorstash.torch.StorageWriter/StorageReader and prints
"CASE <name> ok" after each; any failure exits 1 with a traceback. WORK holds the steps: the
test saves WORK/native/0000000001 (plain tensors, tensorstash.save, one process) before the
job; the job writes WORK/dcp/000000000{1,2} (DTensors: dcp.save, dcp.async_save) and
WORK/fsdp_dcp/0000000001 and WORK/fsdp_native/0000000001 (the same FSDP2 state dict by
dcp.save and by tensorstash.save), and rank 0 leaves WORK/fsdp_full.pt (the full values).
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

import torch

from torch_worker import check_locals, dtensors, full_tensors, parse_args, same_bits


def case(name: str) -> None:
    print(f"CASE {name} ok", flush=True)


def main() -> int:
    args = parse_args()
    try:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.pid, world_size=args.nproc,
                                timeout=datetime.timedelta(seconds=90))
        try:
            dcp2(args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test through the exit status
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    print("DONE", flush=True)
    return 0


def dcp2(args) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import tensorstash.torch as ttorch

    work = args.step
    assert dist.get_world_size() == 2
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    full = full_tensors()
    # (DCP's own planner refuses a _StridedShard DTensor outside FSDP: "overlapping chunks".)
    saved_as = {"even": [Shard(0)], "uneven": [Shard(0)], "tiny": [Shard(0)],
                "cols": [Shard(1)], "rep": [Replicate()], "strided": [Shard(1)],
                "f8": [Shard(0)], "scalar": [Replicate()]}
    other = {"even": [Replicate()], "uneven": [Shard(1)], "tiny": [Replicate()],
             "cols": [Shard(0)], "rep": [Shard(0)], "strided": [Shard(0)], "f8": [Shard(1)],
             "scalar": [Replicate()]}

    # dcp.save of DTensors (and a plain tensor, replicated on both ranks, and plain values),
    # then dcp.load onto other placements and onto the same ones.
    def state(tensors: dict, lr: float, name: str) -> dict:
        return {"model": tensors, "extra": {"lr": lr, "name": name, "ids": [1, 2]}}

    step1 = os.path.join(work, "dcp", "0000000001")
    saving = dict(dtensors(full, mesh, saved_as), plain=full["even"] * 2)
    dcp.save(state(saving, 0.5, "run"), storage_writer=ttorch.StorageWriter(step1))
    for layout in (other, saved_as):
        target = state(dict(dtensors(full, mesh, layout, zero=True),
                            plain=torch.zeros_like(full["even"])), 0.0, "")
        dcp.load(target, storage_reader=ttorch.StorageReader(step1))
        check_locals("dcp.load", target["model"], dict(full, plain=full["even"] * 2), mesh,
                     layout)
        assert target["extra"] == {"lr": 0.5, "name": "run", "ids": [1, 2]}, target["extra"]
    case("dcp_save_load")

    # dcp.async_save in thread mode: the future's result, then the step loads.
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    step2 = os.path.join(work, "dcp", "0000000002")
    fut = dcp.async_save(state(dtensors(full, mesh, saved_as), 1.5, "async"),
                         storage_writer=ttorch.StorageWriter(step2),
                         async_checkpointer_type=AsyncCheckpointerType.THREAD)
    fut.result(timeout=120)
    target = state(dtensors(full, mesh, other, zero=True), 0.0, "")
    dcp.load(target, storage_reader=ttorch.StorageReader(step2))
    check_locals("async_save", target["model"], full, mesh, other)
    assert target["extra"]["name"] == "async"
    case("dcp_async_save")

    # A step of tensorstash.save (plain tensors, one process) loads with dcp.load into
    # DTensors.
    native = os.path.join(work, "native", "0000000001")
    target = {k: v for k, v in dtensors(full, mesh, other, zero=True).items()}
    dcp.load(target, storage_reader=ttorch.StorageReader(native))
    check_locals("native", target, full, mesh, other)
    case("dcp_load_native")

    # An existing step is not overwritten unless asked: the save fails, the step stays.
    try:
        dcp.save(state(saving, 9.0, "again"), storage_writer=ttorch.StorageWriter(step1))
    except CheckpointException as e:  # (DCP's, a BaseException, with every rank's error)
        assert all(isinstance(f[0], FileExistsError) for f in e.failures.values()), e
        assert sorted(e.failures) == [0, 1], e
    else:
        raise AssertionError("dcp.save over a complete step succeeded")
    dcp.save(state(saving, 9.0, "again"), storage_writer=ttorch.StorageWriter(step1,
                                                                              overwrite=True))
    target = state(dtensors(full, mesh, saved_as, zero=True), 0.0, "")
    target["model"]["plain"] = torch.zeros_like(full["even"])
    dcp.load(target, storage_reader=ttorch.StorageReader(step1))
    assert target["extra"]["name"] == "again"
    case("dcp_overwrite")

    fsdp2_case(work, mesh)
    case("dcp_fsdp2")


def fsdp2_case(work: str, mesh) -> None:
    """FSDP2 model and optimizer: get_state_dict's DTensors saved by dcp.save through the
    StorageWriter (and by tensorstash.save, for the test's tree comparison), loaded by
    dcp.load into another model's state dict and applied with set_state_dict."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import tensorstash
    import tensorstash.torch as ttorch

    def trained(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(),
                                    torch.nn.Linear(6, 3))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01 * seed)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        return model, opt

    model, opt = trained(1)
    msd, osd = get_state_dict(model, opt)
    assert any(isinstance(v, DTensor) for v in msd.values()), msd
    step = os.path.join(work, "fsdp_dcp", "0000000001")
    dcp.save({"model": msd, "optim": osd}, storage_writer=ttorch.StorageWriter(step))
    tensorstash.save(os.path.join(work, "fsdp_native", "0000000001"),
                     {"model": msd, "optim": osd})
    full = StateDictOptions(full_state_dict=True)
    want_m, want_o = get_state_dict(model, opt, options=full)
    if dist.get_rank() == 0:
        torch.save({"model": want_m, "optim": want_o}, os.path.join(work, "fsdp_full.pt"))

    model2, opt2 = trained(2)
    msd2, osd2 = get_state_dict(model2, opt2)
    target = {"model": msd2, "optim": osd2}
    dcp.load(target, storage_reader=ttorch.StorageReader(step))
    set_state_dict(model2, opt2, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])
    got_m, got_o = get_state_dict(model2, opt2, options=full)
    for k, v in want_m.items():
        assert same_bits(got_m[k], v), k
    for fqn, per_param in want_o["state"].items():
        for name, v in per_param.items():
            assert same_bits(got_o["state"][fqn][name], v), (fqn, name)
    assert got_o["param_groups"][0]["lr"] == 0.01


if __name__ == "__main__":
    sys.exit(main())
