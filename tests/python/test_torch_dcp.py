"""DCP's storage interfaces over tensorstash steps (issue 39 part 3):
tensorstash.torch.StorageWriter / StorageReader under dcp.save, dcp.async_save (thread mode)
and dcp.load, in one process (no_dist) and in one shared job of 2 gloo processes
(tests/python/dcp_worker.py: DTensors, FSDP2's get_state_dict); the steps they write are
native steps (restore, metadata, `tensorstash inspect/verify/ls`)."""

from __future__ import annotations

import json
import os
import subprocess
import warnings

import numpy as np
import pytest
import torch

import mp_launch
import tensorstash
import torch_worker

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "dcp_worker.py")
TIMEOUT_S = 240
PYTHONPATH = os.pathsep.join([os.path.dirname(os.path.dirname(tensorstash.__file__)), HERE])
JOB_CASES = {"dcp_save_load", "dcp_async_save", "dcp_load_native", "dcp_overwrite",
             "dcp_fsdp2"}


def cli() -> str:
    path = os.environ.get("TENSORSTASH_CLI", os.path.join(REPO, "build", "tensorstash"))
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing: build the tensorstash target, or set TENSORSTASH_CLI")
    return path


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # DCP warns that no_dist runs in a single process
        warnings.simplefilter("ignore", UserWarning)
        yield


def state() -> dict:
    """A state dict of every kind of leaf DCP saves: tensors of several dtypes (0-d, empty,
    bool, bfloat16, float8), plain values, and one the tree cannot hold (a set)."""
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(5, 7, generator=g), "b": torch.arange(6).to(torch.bfloat16),
                  "mask": torch.tensor([True, False, True]),
                  "f8": torch.randn(4, 2, generator=g).to(torch.float8_e4m3fn),
                  "ids": torch.arange(10, dtype=torch.int64).reshape(2, 5),
                  "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5)},
        "optim": {"state": {"w": {"step": torch.tensor(7.0), "exp_avg": torch.ones(5, 7)}},
                  "param_groups": [{"lr": 0.125, "betas": (0.9, 0.99), "params": ["w"],
                                    "foreach": None, "fused": False}]},
        "meta": {"epoch": 3, "name": "run-1", "tags": {"a", "b"}},
    }


def zeros_like_state(s: dict) -> dict:
    def z(x):
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        if isinstance(x, dict):
            return {k: z(v) for k, v in x.items()}
        if isinstance(x, list):  # (DCP walks lists of dicts, so the target must have them)
            return [z(v) for v in x]
        return None
    return z(s)


def assert_same(got, want, where=""):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert torch_worker.same_bits(got, want), (where, got, want)
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list) and any(isinstance(v, torch.Tensor) for v in want):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}/{i}")
    else:
        assert got == want, (where, got, want)


def tree_json(step: str) -> dict:
    with open(os.path.join(step, "state", "tree.json"), "rb") as f:
        return json.load(f)


def test_save_and_load_in_one_process(tmp_path):
    s = state()
    step = str(tmp_path / "0000000001")
    dcp.save(s, storage_writer=tensorstash.torch.StorageWriter(step), no_dist=True)
    target = zeros_like_state(s)
    dcp.load(target, storage_reader=tensorstash.torch.StorageReader(step), no_dist=True)
    assert_same(target, s)


def test_the_step_is_a_native_step_with_the_tree_of_tensorstash_save(tmp_path):
    s = state()
    s["meta"].pop("tags")  # (tensorstash.save refuses a set; DCP pickles it)
    step = str(tmp_path / "dcp" / "0000000001")
    dcp.save(s, storage_writer=tensorstash.torch.StorageWriter(step), no_dist=True)
    native = str(tmp_path / "native" / "0000000001")
    tensorstash.save(native, s)
    assert tree_json(step) == tree_json(native)
    assert tensorstash.metadata(step) == tensorstash.metadata(native)
    got = tensorstash.restore(step)
    for name, want in s["model"].items():
        assert np.asarray(got["model"][name]).tobytes() == \
            want.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), name
    assert got["optim"]["param_groups"] == s["optim"]["param_groups"]
    # The CLI reads it as any step.
    out = subprocess.run([cli(), "inspect", "--json", step], capture_output=True, text=True,
                         check=True).stdout
    assert "model/w" in out and "optim/state/w/exp_avg" in out, out
    subprocess.run([cli(), "verify", step], capture_output=True, text=True, check=True)
    out = subprocess.run([cli(), "ls", str(tmp_path / "dcp")], capture_output=True, text=True,
                         check=True).stdout
    assert "0000000001" in out, out


def test_verify_finds_a_damaged_chunk_of_a_dcp_step(tmp_path):
    step = str(tmp_path / "0000000001")
    dcp.save({"w": torch.arange(4096, dtype=torch.float32)},
             storage_writer=tensorstash.torch.StorageWriter(step), no_dist=True)
    data = os.path.join(step, "state", "data")
    name = sorted(os.listdir(data))[0]
    with open(os.path.join(data, name), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = subprocess.run([cli(), "verify", step], capture_output=True, text=True)
    assert r.returncode == 1, (r.stdout, r.stderr)
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(4096)},
                 storage_reader=tensorstash.torch.StorageReader(step), no_dist=True)


def test_async_save_in_thread_mode(tmp_path):
    s = state()
    step = str(tmp_path / "0000000002")
    fut = dcp.async_save(s, storage_writer=tensorstash.torch.StorageWriter(step),
                         async_checkpointer_type=AsyncCheckpointerType.THREAD, no_dist=True)
    fut.result(timeout=120)
    target = zeros_like_state(s)
    dcp.load(target, storage_reader=tensorstash.torch.StorageReader(step), no_dist=True)
    assert_same(target, s)


def test_a_tensorstash_save_step_loads_with_dcp_load(tmp_path):
    s = {"model": {"w": torch.randn(3, 4), "b": torch.arange(3).to(torch.bfloat16)},
         "step": 12, "layers": [torch.ones(2), torch.full((2,), 3.0)]}
    step = str(tmp_path / "0000000003")
    tensorstash.save(step, s)
    target = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(3, dtype=torch.bfloat16)},
              "step": 0, "layers": [torch.zeros(2), torch.zeros(2)]}
    dcp.load(target, storage_reader=tensorstash.torch.StorageReader(step), no_dist=True)
    assert_same(target, s)
    # Only part of the step: DCP loads the keys its state dict has.
    part = {"model": {"w": torch.zeros(3, 4)}}
    dcp.load(part, storage_reader=tensorstash.torch.StorageReader(step), no_dist=True)
    assert torch.equal(part["model"]["w"], s["model"]["w"])


def test_read_metadata_gives_one_chunk_per_tensor(tmp_path):
    step = str(tmp_path / "0000000004")
    tensorstash.save(step, {"w": np.arange(1 << 16, dtype=np.float32)}, chunk_bytes=4096)
    meta = tensorstash.torch.StorageReader(step).read_metadata()
    w = meta.state_dict_metadata["w"]
    assert tuple(w.size) == (1 << 16,) and w.properties.dtype == torch.float32
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in w.chunks] == [((0,), (1 << 16,))]


def test_an_existing_step_is_refused_unless_overwrite(tmp_path):
    step = str(tmp_path / "0000000005")
    dcp.save({"w": torch.ones(3)}, storage_writer=tensorstash.torch.StorageWriter(step),
             no_dist=True)
    with pytest.raises(CheckpointException) as e:
        dcp.save({"w": torch.zeros(3)}, storage_writer=tensorstash.torch.StorageWriter(step),
                 no_dist=True)
    assert "already exists" in str(e.value)
    dcp.save({"w": torch.zeros(3)},
             storage_writer=tensorstash.torch.StorageWriter(step, overwrite=True), no_dist=True)
    assert np.array_equal(tensorstash.restore(step)["w"], np.zeros(3, np.float32))


# ---------------------------------------------------------------------------------------------
# One job of 2 gloo processes for every distributed case.


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("dcpjob"))
    tensorstash.save(os.path.join(work, "native", "0000000001"), torch_worker.full_tensors())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = mp_launch.run_job(WORKER, "dcp2", work, 2, "-", work, env=env, timeout_s=TIMEOUT_S,
                            pythonpath=PYTHONPATH)
    return work, out


def test_every_case_of_the_2_process_job_passed_in_every_process(job):
    _, out = job
    seen: dict[int, set[str]] = {}
    pid = None
    for line in out.splitlines():
        if line.startswith("--- process "):
            pid = int(line.split()[2].split("/")[0])
            seen[pid] = set()
        elif line.startswith("CASE ") and line.endswith(" ok") and pid is not None:
            seen[pid].add(line.split()[1])
    assert seen == {0: JOB_CASES, 1: JOB_CASES}, out


def test_both_ranks_wrote_and_the_steps_restore_whole_in_one_process(job):
    work, _ = job
    full = torch_worker.full_tensors()
    for step, names in ((os.path.join(work, "dcp", "0000000001"), list(full) + ["plain"]),
                        (os.path.join(work, "dcp", "0000000002"), list(full))):
        files = os.listdir(os.path.join(step, "state", "data"))
        assert {int(name.split("-")[0]) for name in files} == {0, 1}, files
        want = dict(full, plain=full["even"] * 2)
        target = {"model": {n: torch.zeros_like(want[n]) for n in names}}
        got = tensorstash.restore(step, target=target)["model"]
        for n in names:
            assert torch_worker.same_bits(got[n], want[n]), (step, n)
        subprocess.run([cli(), "verify", step], capture_output=True, text=True, check=True)
    extra = tensorstash.restore(os.path.join(work, "dcp", "0000000001"))["extra"]
    assert extra == {"lr": 9.0, "name": "again", "ids": [1, 2]}, extra  # (the overwrite)


def test_an_fsdp2_dcp_step_has_the_tree_of_tensorstash_save_and_restores(job):
    work, _ = job
    step = os.path.join(work, "fsdp_dcp", "0000000001")
    assert tree_json(step) == tree_json(os.path.join(work, "fsdp_native", "0000000001"))
    want = torch.load(os.path.join(work, "fsdp_full.pt"))
    target = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
              "optim": {"state": {fqn: {n: torch.zeros_like(v) for n, v in per.items()}
                                  for fqn, per in want["optim"]["state"].items()},
                        "param_groups": want["optim"]["param_groups"]}}
    got = tensorstash.restore(step, target=target)
    for k, v in want["model"].items():
        assert torch_worker.same_bits(got["model"][k], v), k
    for fqn, per in want["optim"]["state"].items():
        for n, v in per.items():
            assert torch_worker.same_bits(got["optim"]["state"][fqn][n], v), (fqn, n)
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
