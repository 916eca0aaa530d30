"""The PyTorch adapter in one process (issue 39 part 1): every torch dtype the engine stores,
bit-exact; the refused ones; 0-d and empty tensors; raw model/optimizer state dicts; restores
into new tensors like the target's and tensorstash.torch.load in place; casts. DTensors and
torch.distributed: test_torch_distributed.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import tensorstash
import tensorstash.torch as ttorch

HERE = os.path.dirname(os.path.abspath(__file__))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b have the same dtype, shape and bytes (NaNs and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def random_tensor(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    """Random bits of `dtype` (every byte pattern, NaNs too), bool as 0/1."""
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8,
                        generator=g)
    return raw.view(dtype)


@pytest.mark.parametrize("dtype", list(ttorch.DTYPES), ids=lambda d: str(d).split(".")[-1])
def test_every_dtype_round_trips_bit_exact(tmp_path, dtype):
    x = random_tensor(dtype)
    tree = {"x": x, "t": x.t(), "s": x[0, 0].clone()}  # a non-contiguous view and a 0-d tensor
    step = str(tmp_path / "1")
    tensorstash.save(step, tree)
    back = tensorstash.restore(step, target={k: torch.empty_like(v) for k, v in tree.items()})
    for k, v in tree.items():
        assert isinstance(back[k], torch.Tensor) and same_bits(back[k], v.contiguous()), k
    # Without a target: NumPy arrays of the same name and bytes (ml_dtypes for bfloat16/float8).
    plain = tensorstash.restore(step)
    assert plain["x"].dtype == np.dtype(tensorstash.numpy.dtype_from_name(ttorch.DTYPES[dtype]))
    assert plain["x"].tobytes() == x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("make, name", [
    (lambda: torch.zeros(3, dtype=torch.complex32), "complex32"),
    (lambda: torch.zeros(3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2), "float4_e2m1fn_x2"),
    (lambda: torch.zeros(3, dtype=torch.uint8).view(torch.bits8), "bits8"),
])
def test_refused_dtypes_name_the_path(tmp_path, make, name):
    with pytest.raises(TypeError, match=rf"torch\.{name} tensor at 'model/w'"):
        tensorstash.save(str(tmp_path / "1"), {"model": {"w": make()}})
    assert not os.path.exists(tmp_path / "1")


def test_other_unsavable_tensors_name_the_path(tmp_path):
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)
    with pytest.raises(TypeError, match="quantized tensor at 'q'"):
        tensorstash.save(str(tmp_path / "1"), {"q": q})
    with pytest.raises(TypeError, match="meta device"):
        tensorstash.save(str(tmp_path / "2"), {"m": torch.empty(3, device="meta")})
    with pytest.raises(TypeError, match="layout"):
        tensorstash.save(str(tmp_path / "3"), {"s": torch.eye(3).to_sparse()})


def test_zero_dim_and_empty_tensors(tmp_path):
    tree = {"scalar": torch.tensor(2.5, dtype=torch.float64), "int": torch.tensor(-3),
            "empty": torch.empty(0, 4, dtype=torch.bfloat16), "empty3": torch.zeros(2, 0, 3)}
    tensorstash.save(str(tmp_path / "1"), tree)
    back = tensorstash.restore(str(tmp_path / "1"), target=tree)
    for k, v in tree.items():
        assert same_bits(back[k], v), k
    assert back["scalar"].item() == 2.5 and back["int"].item() == -3


def model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * seed, betas=(0.9, 0.95))
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_raw_state_dicts_save_and_load_in_place(tmp_path):
    model, opt = model_and_optimizer(1)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    assert 0 in state["optim"]["state"]  # int keys, tuples, None and bools in param_groups
    step = str(tmp_path / "1")
    tensorstash.save(step, state)

    model2, opt2 = model_and_optimizer(2)
    target = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    weight = target["model"]["0.weight"]
    out = tensorstash.torch.load(step, target)
    assert out is target
    assert target["model"]["0.weight"] is weight  # in place: the model's own tensors
    for k, v in model.state_dict().items():
        assert same_bits(model2.state_dict()[k], v), k
    opt2.load_state_dict(target["optim"])
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert b["param_groups"][0]["betas"] == (0.9, 0.95) and b["param_groups"][0]["lr"] == 1e-3
    for i, per_param in a["state"].items():
        for name, v in per_param.items():
            assert same_bits(b["state"][i][name], v), (i, name)


def test_get_state_dict_forms_save_and_load(tmp_path):
    # torch.distributed.checkpoint.state_dict's forms: fqn keys ("0.weight") in the optimizer
    # state and in param_groups' "params".
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt = model_and_optimizer(1)
    msd, osd = get_state_dict(model, opt)
    assert "0.weight" in osd["state"] and "0.weight" in osd["param_groups"][0]["params"]
    step = str(tmp_path / "1")
    tensorstash.save(step, {"model": msd, "optim": osd})
    model2, opt2 = model_and_optimizer(2)
    msd2, osd2 = get_state_dict(model2, opt2)
    tensorstash.torch.load(step, {"model": msd2, "optim": osd2})
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    for k, v in model.state_dict().items():
        assert same_bits(model2.state_dict()[k], v), k
    a, b = opt.state_dict(), opt2.state_dict()
    assert b["param_groups"][0]["lr"] == 1e-3
    for i, per_param in a["state"].items():
        for name, v in per_param.items():
            assert same_bits(b["state"][i][name], v), (i, name)


def test_restore_makes_new_tensors_like_the_target(tmp_path):
    model, _ = model_and_optimizer(1)
    step = str(tmp_path / "1")
    tensorstash.save(step, {"w": model[0].weight, "b": model[0].bias.detach()})
    target = {"w": torch.nn.Parameter(torch.zeros(3, 4)), "b": torch.zeros(3)}
    back = tensorstash.restore(step, target=target)
    assert isinstance(back["w"], torch.nn.Parameter) and back["w"].requires_grad
    assert back["w"] is not target["w"] and not target["w"].any()  # the target is untouched
    assert torch.equal(back["w"].detach(), model[0].weight.detach())
    assert torch.equal(back["b"], model[0].bias.detach())


def test_casts_into_the_targets_dtype(tmp_path):
    x = torch.tensor([1.5, -2.25, 3.0])
    step = str(tmp_path / "1")
    tensorstash.save(step, {"x": x, "i": torch.tensor([1, 2, 3], dtype=torch.int32)})
    back = tensorstash.restore(step, target={"x": torch.empty(3, dtype=torch.bfloat16),
                                             "i": torch.empty(3, dtype=torch.int64)})
    assert back["x"].dtype == torch.bfloat16 and torch.equal(back["x"], x.bfloat16())
    assert back["i"].dtype == torch.int64 and back["i"].tolist() == [1, 2, 3]
    # In place into a float64 tensor: cast too.
    dst = {"x": torch.zeros(3, dtype=torch.float64), "i": torch.zeros(3, dtype=torch.int16)}
    tensorstash.torch.load(step, dst)
    assert dst["x"].tolist() == [1.5, -2.25, 3.0] and dst["i"].tolist() == [1, 2, 3]


def test_shape_mismatch_and_missing_keys_leave_the_state_unchanged(tmp_path):
    step = str(tmp_path / "1")
    tensorstash.save(step, {"x": torch.ones(3)})
    dst = {"x": torch.zeros(2)}  # (a larger target is filled as for JAX: padding)
    with pytest.raises(ValueError, match="'x'.*larger than"):
        tensorstash.torch.load(step, dst)
    assert not dst["x"].any()
    with pytest.raises(KeyError, match="'y'"):
        tensorstash.torch.load(step, {"x": torch.zeros(3), "y": torch.zeros(1)})


def test_load_reads_cpu_tensors_in_place_and_copies_the_others(tmp_path, monkeypatch):
    # Contiguous CPU targets take the chunks straight into their memory (no tensor is built
    # and copied: that was two more passes over the bytes); a transposed view, a target
    # sharing memory with another (tied weights) and the scalars go the other way. Values
    # right either way, casts included.
    built = []
    build = ttorch.TorchAdapter.build
    monkeypatch.setattr(ttorch.TorchAdapter, "build",
                        lambda self, target, shape, buffers: built.append(shape) or
                        build(self, target, shape, buffers))
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    step = str(tmp_path / "1")
    tensorstash.save(step, {"w": w, "b": torch.arange(5, dtype=torch.int32), "t": w.T.clone(),
                            "tied": w, "h": w, "n": 3})
    tied = torch.zeros(4, 6)
    state = {"w": torch.zeros(4, 6), "b": torch.zeros(5, dtype=torch.int64),
             "t": torch.zeros(4, 6).T, "tied": tied, "h": tied, "n": 0}
    w_ptr = state["w"].data_ptr()
    progress = []
    assert ttorch.load(step, state, progress=lambda d, t: progress.append((d, t))) is state
    assert torch.equal(state["w"], w) and state["w"].data_ptr() == w_ptr
    assert state["b"].tolist() == list(range(5)) and state["b"].dtype == torch.int64
    assert torch.equal(state["t"], w.T) and torch.equal(tied, w) and state["n"] == 3
    # Built (and copied): the transposed view and the second of the tied pair only.
    assert sorted(built) == [(4, 6), (6, 4)], built
    assert progress[-1][0] == progress[-1][1] == (24 + 5 * 2 + 24 + 24 + 24) * 4
    # A CPU tensor restored into new tensors is still built (restore() never writes targets).
    built.clear()
    target = {"w": torch.zeros(4, 6)}
    back = tensorstash.restore(step, target=target)
    assert built == [(4, 6)] and not target["w"].any() and torch.equal(back["w"], w)


def test_load_checks_every_leaf_before_reading_any(tmp_path):
    # A planning error (another shape) is raised before the first read: the tensors read in
    # place before it in the tree keep their values.
    step = str(tmp_path / "1")
    tensorstash.save(step, {"a": torch.ones(3), "b": torch.ones(3)})
    state = {"a": torch.zeros(3), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match="'b'"):
        ttorch.load(step, state)
    assert not state["a"].any() and not state["b"].any()


def test_mixed_with_numpy_and_no_coordinator_without_torch_distributed(tmp_path):
    step = str(tmp_path / "1")
    tensorstash.save(step, {"t": torch.arange(4), "n": np.arange(3)})
    back = tensorstash.restore(step, target={"t": torch.zeros(4, dtype=torch.int64),
                                             "n": np.zeros(3, np.int64)})
    assert isinstance(back["t"], torch.Tensor) and isinstance(back["n"], np.ndarray)
    assert back["t"].tolist() == [0, 1, 2, 3]
    assert ttorch.default_coordinator() is None  # torch.distributed not initialized


def test_importing_tensorstash_never_imports_torch_and_torch_may_come_later(tmp_path):
    # A fresh interpreter: tensorstash (even after a lookup) leaves torch alone; torch imported
    # after the first lookup is registered at the next.
    code = f"""
import sys, numpy as np, tensorstash
tensorstash.save({str(tmp_path / "1")!r}, {{"n": np.arange(3)}})
assert "torch" not in sys.modules, "tensorstash imported torch"
import torch
assert callable(tensorstash.torch.load)  # the attribute imports tensorstash.torch on first use
tensorstash.save({str(tmp_path / "2")!r}, {{"t": torch.arange(3, dtype=torch.bfloat16)}})
back = tensorstash.restore({str(tmp_path / "2")!r}, target={{"t": torch.zeros(3, dtype=torch.bfloat16)}})
assert isinstance(back["t"], torch.Tensor) and back["t"].tolist() == [0.0, 1.0, 2.0], back
print("ok")
"""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(tensorstash.__file__))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


@pytest.fixture
def process_group_of_one():
    """torch.distributed initialized with one gloo process on 127.0.0.1 (a free port)."""
    import mp_launch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{mp_launch.free_port()}",
                            rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_the_coordinators_waits_leave_the_store_to_other_threads(process_group_of_one):
    # A background save's wait must not hold the store's client: another thread of the same
    # process sets the key meanwhile (torch's blocking store.wait() would hold it until its
    # timeout, and the set with it).
    import threading
    import time
    assert ttorch.default_coordinator() is None  # one process: no coordinator is needed
    coord = ttorch.TorchCoordinator()
    assert (coord.process_index(), coord.process_count()) == (0, 1)
    got = []
    waiter = threading.Thread(target=lambda: got.append(coord.key_value_get("k", 20_000)))
    start = time.monotonic()
    waiter.start()
    time.sleep(0.2)
    coord.key_value_set("k", "v\u00e9")
    waiter.join(30)
    assert got == ["v\u00e9"] and time.monotonic() - start < 10, got
    coord.barrier("b", 1000)  # one process: passes
    with pytest.raises(TimeoutError, match="never"):
        coord.key_value_get("never", 200)
    # Another instance uses other keys (each operation its own sequence number).
    with pytest.raises(TimeoutError):
        ttorch.TorchCoordinator().key_value_get("k", 100)


def test_the_coordinators_try_get_answers_without_waiting(process_group_of_one):
    import time
    coord = ttorch.TorchCoordinator()
    start = time.monotonic()
    assert coord.key_value_try_get("address/1") is None
    assert time.monotonic() - start < 5  # (no wait for a key that may never come)
    coord.key_value_set("address/1", "127.0.0.1:4000 \u00e9")
    assert coord.key_value_try_get("address/1") == "127.0.0.1:4000 \u00e9"
    assert ttorch.TorchCoordinator().key_value_try_get("address/1") is None  # other keys


def test_cpu_tensors_need_no_host_copy():
    adapter = ttorch.TorchAdapter()
    xs = [torch.arange(3), torch.zeros(2, 2)]
    started = adapter.start_save(xs)
    assert all(a is b for a, b in zip(started, xs))
    shape, shards, stable = adapter.save_shards(started[0], 1, 2)
    assert shape == (3,) and not stable  # views of memory the user may change
    assert [s[3:] for s in shards] == [(1, 2)]  # the whole tensor, replica 1 of 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_save_from_pinned_copies_and_restore_onto_the_device(tmp_path):
    x = torch.arange(64 * 33, dtype=torch.float32, device="cuda").reshape(64, 33)
    tree = {"x": x, "t": x.t(), "b": x.to(torch.bfloat16), "s": x[1, 1]}
    want = {k: v.cpu().clone() for k, v in tree.items()}
    with tensorstash.CheckpointManager(str(tmp_path), async_save=True) as mgr:
        mgr.save(1, tree)
        x.add_(1000)  # at once, on the device's stream: the step keeps the values of save()
        mgr.wait_until_finished()
    target = {k: torch.empty_like(v) for k, v in tree.items()}
    got = tensorstash.restore(str(tmp_path / "0000000001"), target=target)
    for k, v in want.items():
        assert got[k].device.type == "cuda" and same_bits(got[k].cpu(), v.contiguous()), k
