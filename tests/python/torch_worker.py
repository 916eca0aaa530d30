"""One process of a torch.distributed job of test_torch_distributed.py (gloo on 127.0.0.1),
launched by mp_launch.run_job, hence its command line:

    python torch_worker.py --phase job2|job4|job2b --step WORK --nproc N --pid I --port P --layout -

Each job runs many cases (spawning is slow: the imports take most of it) and prints
"CASE <name> ok" after each; any failure exits 1 with a traceback. WORK holds the steps: the
test saves WORK/root1/0000000001 (plain tensors, one process) before job2, which saves
WORK/root2/0000000002 (DTensors on a mesh of 2); job4 saves WORK/root4/0000000004 on a (2, 2)
mesh, which job2b (2 processes again) restores (4 -> 2) before it checks that saves leave no
keys in the process group's store. The expected values are full_tensors(): each process lays them out itself
(distribute_tensor with src_data_rank=None: no communication) to build leaves and expectations.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback

import torch

# (shape, dtype) of each leaf; values from full_tensors().
SHAPES = {
    "even": ((8, 4), torch.float32),
    "uneven": ((7, 3), torch.bfloat16),
    "tiny": ((1, 5), torch.float32),     # rank 1's shard of Shard(0) is empty
    "cols": ((4, 6), torch.int32),
    "rep": ((5,), torch.float64),
    "strided": ((8, 2), torch.float32),
    "f8": ((6, 2), torch.float8_e4m3fn),
    "scalar": ((), torch.float32),
}


def full_tensors() -> dict[str, torch.Tensor]:
    """The global values of SHAPES' leaves (the same in every process)."""
    out = {}
    for i, (name, (shape, dtype)) in enumerate(SHAPES.items()):
        n = 1
        for d in shape:
            n *= d
        values = (torch.arange(n, dtype=torch.float64) * 0.75 - 3 + i).reshape(shape)
        out[name] = values.to(dtype)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def parse_args():
    p = argparse.ArgumentParser()
    for name in ("--phase", "--step", "--layout"):
        p.add_argument(name, required=True)
    for name in ("--nproc", "--pid", "--port"):
        p.add_argument(name, type=int, required=True)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    try:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.pid, world_size=args.nproc,
                                timeout=datetime.timedelta(seconds=90))
        try:
            {"job2": job2, "job4": job4, "job2b": job2b}[args.phase](args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test through the exit status
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    print("DONE", flush=True)
    return 0


def case(name: str) -> None:
    print(f"CASE {name} ok", flush=True)


def check_locals(what: str, got: dict, full: dict, mesh, placements: dict) -> None:
    """Each leaf of `got` is a DTensor on `mesh` with `placements` (or, for a name without
    placements, a plain tensor) holding this rank's part of `full`, bit for bit."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    for name, value in full.items():
        if name not in placements:
            assert isinstance(got[name], torch.Tensor) and not isinstance(got[name], DTensor)
            assert same_bits(got[name], value), (what, name, got[name], value)
            continue
        leaf = got[name]
        assert isinstance(leaf, DTensor), (what, name, type(leaf))
        assert tuple(leaf.placements) == tuple(placements[name]), (what, name, leaf.placements)
        assert tuple(leaf.shape) == tuple(value.shape), (what, name, leaf.shape)
        want = distribute_tensor(value, mesh, placements[name], src_data_rank=None).to_local()
        assert same_bits(leaf.to_local(), want), (what, name, leaf.to_local(), want)


def dtensors(full: dict, mesh, placements: dict, zero: bool = False) -> dict:
    """full's leaves laid out on `mesh` (plain tensors where `placements` has no entry);
    zeros of the same layouts with `zero` (restore targets)."""
    from torch.distributed.tensor import distribute_tensor
    out = {}
    for name, value in full.items():
        v = torch.zeros_like(value) if zero else value
        out[name] = (distribute_tensor(v, mesh, placements[name], src_data_rank=None)
                     if name in placements else v.clone())
    return out


def job2(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    import tensorstash
    import tensorstash.torch as ttorch

    work = args.step
    rank = dist.get_rank()
    assert dist.get_world_size() == 2
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    full = full_tensors()
    full_plain = dict(full, plain=full["even"] * 2)
    saved_as = {"even": [Shard(0)], "uneven": [Shard(0)], "tiny": [Shard(0)],
                "cols": [Shard(1)], "rep": [Replicate()],
                "strided": [_StridedShard(0, split_factor=2)], "f8": [Shard(0)],
                "scalar": [Replicate()]}
    other = {"even": [_StridedShard(0, split_factor=2)], "uneven": [Replicate()],
             "tiny": [Shard(1)], "cols": [Shard(0)], "rep": [Shard(0)],
             "strided": [Shard(0)], "f8": [Shard(1)], "scalar": [Replicate()]}

    # The layouts are torch's own: the strided shard holds rows 0, 1, 4, 5 on rank 0.
    boxes, replica, count = ttorch._layout(dtensors({"strided": full["strided"]}, mesh,
                                                    saved_as)["strided"])
    want_rows = [(0, 2), (4, 2)] if rank == 0 else [(2, 2), (6, 2)]
    assert [(o[0], s[0]) for (o, s), _ in boxes] == want_rows, boxes
    assert (replica, count) == (0, 1)
    boxes, replica, count = ttorch._layout(dtensors({"rep": full["rep"]}, mesh, saved_as)["rep"])
    assert (replica, count) == (rank, 2), (replica, count)
    case("layouts")

    # The coordinator: the default one is torch's; its store carries values and barriers,
    # and a wait past its timeout is a TimeoutError.
    coord = tensorstash._adapters.default_coordinator()
    assert isinstance(coord, ttorch.TorchCoordinator), coord
    assert (coord.process_index(), coord.process_count()) == (rank, 2)
    if rank == 0:
        coord.key_value_set("hello", "from 0 \u00e9")
    assert coord.key_value_get("hello", 30_000) == "from 0 \u00e9"
    coord.barrier("after-hello", 30_000)
    try:
        coord.key_value_get("never-set", 300)
    except TimeoutError as e:
        assert "never-set" in str(e), e
    else:
        raise AssertionError("key_value_get of a key never set returned")
    coord.barrier("end", 30_000)
    case("coordinator")

    # 1 -> 2: the step the test saved in one process (plain tensors) onto DTensors.
    step1 = os.path.join(work, "root1", "0000000001")
    for name, placements in (("saved_as", saved_as), ("other", other)):
        got = tensorstash.restore(step1, target=dtensors(full_plain, mesh, placements,
                                                         zero=True))
        check_locals(f"1->2 {name}", got, full_plain, mesh, placements)
    case("restore_1_to_2")

    # Saved by 2 (default coordinator), restored by 2 onto the same and other placements.
    step2 = os.path.join(work, "root2", "0000000002")
    tree = {"model": dtensors(full_plain, mesh, saved_as),
            "optim": {"state": {0: {"step": torch.tensor(3.0)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "foreach": None,
                                        "params": [0]}]}}
    tensorstash.save(step2, tree)
    for name, placements in (("saved_as", saved_as), ("other", other)):
        target = {"model": dtensors(full_plain, mesh, placements, zero=True),
                  "optim": tree["optim"]}
        got = tensorstash.restore(step2, target=target)
        check_locals(f"2->2 {name}", got["model"], full_plain, mesh, placements)
        assert got["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    case("save_and_restore_2")

    # In place: the local shards of the state's own DTensors take the values.
    state = {"model": dtensors(full_plain, mesh, other, zero=True)}
    ptrs = {k: v.to_local().data_ptr() if hasattr(v, "to_local") else v.data_ptr()
            for k, v in state["model"].items()}
    assert ttorch.load(step2, state) is state
    check_locals("load in place", state["model"], full_plain, mesh, other)
    for k, v in state["model"].items():
        assert (v.to_local() if hasattr(v, "to_local") else v).data_ptr() == ptrs[k], k
    case("load_in_place")

    # The manager with a local (RAM) tier: background saves by both processes, a restart, and
    # a restore of the latest step from a new manager (coordinated through torch's store).
    root = os.path.join(work, "mroot")
    local = os.path.join(work, "local", str(rank))
    options = dict(max_to_keep=2, local_dir=local, local_save_interval_steps=1,
                   save_interval_steps=2)
    with tensorstash.CheckpointManager(root, **options) as mgr:
        for step in (1, 2, 3):
            model = dtensors({k: v + step for k, v in full.items()
                              if v.dtype != torch.float8_e4m3fn}, mesh, saved_as)
            mgr.save(step, {"model": model, "step": step},
                     per_process={"rank": rank, "step": step})
        mgr.wait_until_finished()
    dist.barrier()
    with tensorstash.CheckpointManager(root, **options) as mgr:
        assert mgr.latest_step() == 3, mgr.latest_step()
        want = {k: v + 3 for k, v in full.items() if v.dtype != torch.float8_e4m3fn}
        got = mgr.restore(3, target={"model": dtensors(want, mesh, other, zero=True),
                                     "step": 0})
        check_locals("manager restore", got["model"], want, mesh, other)
        assert got["step"] == 3
    assert os.listdir(local), "the local tier holds nothing"
    case("manager_local_dir")

    fsdp2_case(work, mesh)
    case("fsdp2_get_state_dict")


def fsdp2_case(work: str, mesh) -> None:
    """FSDP2 (fully_shard) model and optimizer: get_state_dict's DTensors saved by tensorstash,
    loaded in place into another model's state dict, applied with set_state_dict; rank 0
    leaves the full state (torch.save) for the test's 2 -> 1 check."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import tensorstash

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
    step = os.path.join(work, "fsdp", "0000000001")
    tensorstash.save(step, {"model": msd, "optim": osd})
    full = StateDictOptions(full_state_dict=True)  # (every rank gets the full values)
    want_m, want_o = get_state_dict(model, opt, options=full)
    if dist.get_rank() == 0:
        torch.save({"model": want_m, "optim": want_o}, os.path.join(work, "fsdp_full.pt"))

    model2, opt2 = trained(2)
    msd2, osd2 = get_state_dict(model2, opt2)
    tensorstash.torch.load(step, {"model": msd2, "optim": osd2})
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    got_m, got_o = get_state_dict(model2, opt2, options=full)
    for k, v in want_m.items():
        assert same_bits(got_m[k], v), k
    for fqn, per_param in want_o["state"].items():
        for name, v in per_param.items():
            assert same_bits(got_o["state"][fqn][name], v), (fqn, name)
    assert got_o["param_groups"][0]["lr"] == 0.01


def job4(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    import tensorstash

    work = args.step
    assert dist.get_world_size() == 4
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = {k: v for k, v in full_tensors().items() if k in ("even", "uneven", "cols", "rep")}
    saved_as = {"even": [_StridedShard(0, split_factor=2), Shard(0)],  # FSDP over TP
                "uneven": [Shard(0), Shard(1)], "cols": [Replicate(), Shard(1)],
                "rep": [Replicate(), Replicate()]}
    other = {"even": [Shard(1), Shard(0)], "uneven": [Replicate(), Shard(0)],
             "cols": [Shard(0), Shard(0)], "rep": [Shard(0), Replicate()]}
    # 2 -> 4: job2's step onto the (2, 2) mesh.
    step2 = os.path.join(work, "root2", "0000000002")
    got = tensorstash.restore(step2, target={"model": dtensors(full, mesh, saved_as, zero=True)})
    check_locals("2->4", got["model"], full, mesh, saved_as)
    case("restore_2_to_4")
    step4 = os.path.join(work, "root4", "0000000004")
    tensorstash.save(step4, {"model": dtensors(full, mesh, saved_as)})
    got = tensorstash.restore(step4, target={"model": dtensors(full, mesh, other, zero=True)})
    check_locals("4->4", got["model"], full, mesh, other)
    case("save_and_restore_4")


# The leaves job4 saves, with their placements there and the ones job2b restores them onto.
JOB4_LEAVES = ("even", "uneven", "cols", "rep")


def job2b(args) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    import tensorstash
    import tensorstash.torch as ttorch

    work = args.step
    assert dist.get_world_size() == 2
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    full = {k: v for k, v in full_tensors().items() if k in JOB4_LEAVES}

    # 4 -> 2: job4's step (saved on a (2, 2) mesh) onto a mesh of 2, two layouts.
    step4 = os.path.join(work, "root4", "0000000004")
    for name, placements in (
            ("sharded", {"even": [Shard(0)], "uneven": [Shard(1)], "cols": [Shard(0)],
                         "rep": [Shard(0)]}),
            ("mixed", {"even": [_StridedShard(0, split_factor=2)], "uneven": [Replicate()],
                       "cols": [Shard(1)], "rep": [Replicate()]})):
        got = tensorstash.restore(step4, target={"model": dtensors(full, mesh, placements,
                                                                   zero=True)})
        check_locals(f"4->2 {name}", got["model"], full, mesh, placements)
        state = {"model": dtensors(full, mesh, placements, zero=True)}
        ttorch.load(step4, state)
        check_locals(f"4->2 in place {name}", state["model"], full, mesh, placements)
    case("restore_4_to_2")

    # Saves leave nothing in the process group's store: tensorstash.save (its own
    # coordinator, closed when the save is done) and DCP through StorageWriter (the
    # coordinator rank drops the save's keys), several times each.
    store = dist.distributed_c10d._get_default_store()

    def ours() -> list[str]:
        return sorted(k for k in store.list_keys() if k.startswith("tensorstash"))

    placements = {"even": [Shard(0)], "uneven": [Shard(0)], "cols": [Shard(1)],
                  "rep": [Replicate()]}
    dist.barrier()  # (the other rank may start its first save as soon as it is here)
    before = ours()
    for i in range(3):
        tree = {"model": dtensors({k: v + i for k, v in full.items()}, mesh, placements),
                "i": i}
        tensorstash.save(os.path.join(work, "keys", f"{i:010d}"), tree)
        dcp.save(tree, storage_writer=ttorch.StorageWriter(
            os.path.join(work, "keys_dcp", f"{i:010d}")))
    # A manager's saves (both tiers): the keys go when the managers close.
    root = os.path.join(work, "keys_mgr")
    options = dict(max_to_keep=2, local_dir=os.path.join(work, "keys_local", str(dist.get_rank())),
                   local_save_interval_steps=1, save_interval_steps=2)
    with tensorstash.CheckpointManager(root, **options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": dtensors({k: v + step for k, v in full.items()}, mesh,
                                              placements)}, per_process={"step": step})
        mgr.wait_until_finished()
        assert mgr.latest_step() == 3
    dist.barrier()  # (every rank is past its last save before the store is looked at)
    assert ours() == before == [], (before, ours())
    got = tensorstash.restore(os.path.join(work, "keys", "0000000002"),
                              target={"model": dtensors(full, mesh, placements, zero=True),
                                      "i": 0})
    check_locals("after the saves", got["model"], {k: v + 2 for k, v in full.items()}, mesh,
                 placements)
    case("no_keys_left")


if __name__ == "__main__":
    sys.exit(main())
