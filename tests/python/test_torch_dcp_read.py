"""Reading PyTorch DCP's own checkpoints (FileSystemWriter: `.metadata` + `__<rank>_<n>.distcp`)
without DCP (issue 39 part 4): tensorstash.restore onto torch targets, bit-exact against
dcp.load, for a 1-process checkpoint of every dtype DCP stores and a 2-process (gloo) one with a
DTensor sharded across the ranks; plain non-tensor values; `tensorstash inspect/verify/convert`;
a hostile `.metadata` (a pickle that would run a command) and a damaged `.distcp`.

The checkpoints are made at test time by tests/tools/make_dcp_checkpoints.py with the torch of
the virtual environment. The CLI is $TENSORSTASH_CLI or <repo>/build/tensorstash.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import tensorstash
import torch_worker
from tshelpers import cli_path

dcp = pytest.importorskip("torch.distributed.checkpoint")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
GENERATOR = os.path.join(REPO, "tests", "tools", "make_dcp_checkpoints.py")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp")
    subprocess.run([sys.executable, GENERATOR, str(out)], check=True, timeout=300,
                   capture_output=True)
    return out


def tensors_of(ck: str) -> dict[str, torch.Tensor]:
    """{fqn: zeros of the saved dtype and shape} for every tensor of DCP checkpoint `ck`, from
    DCP's own reading of its metadata."""
    md = dcp.FileSystemReader(ck).read_metadata()
    return {fqn: torch.zeros(tuple(m.size), dtype=m.properties.dtype)
            for fqn, m in md.state_dict_metadata.items() if hasattr(m, "chunks")}


def dcp_loaded(ck: str) -> dict[str, torch.Tensor]:
    target = tensors_of(ck)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, checkpoint_id=ck, no_dist=True)
    return target


@pytest.mark.parametrize("name", ["single", "two_ranks"])
def test_restore_onto_torch_targets_is_bit_exact_with_dcp_load(made, name):
    ck = str(made / name)
    want = dcp_loaded(ck)
    got = tensorstash.restore(ck, target=tensors_of(ck))
    assert set(got) == set(want)
    for fqn, w in want.items():
        assert isinstance(got[fqn], torch.Tensor), fqn
        assert got[fqn].dtype == w.dtype and got[fqn].shape == w.shape, fqn
        assert torch_worker.same_bits(got[fqn], w), fqn
    if name == "two_ranks":  # the DTensor's two shards, one per rank's file
        assert torch.equal(got["sharded"], torch.arange(40, dtype=torch.float32).reshape(10, 4))


def test_restore_without_target_gives_the_plain_values_and_arrays(made):
    ck = str(made / "single")
    got = tensorstash.restore(ck)
    assert got["step"] == 7
    assert got["name"] == "abc"
    assert got["lst"] == [1, 2.5, None, True]
    assert got["model.view"].tolist() == [5, 6, 7, 8]
    assert str(got["model.b"].dtype) == "bfloat16"
    assert tensorstash.metadata(ck) is not None


def test_restore_onto_another_layout_reads_each_box(made):
    # Rows 3-7 of the sharded tensor, as float64: across both ranks' chunks.
    ck = str(made / "two_ranks")
    got = tensorstash.restore(ck, target={"sharded": torch.zeros(10, 4, dtype=torch.float64)})
    assert got["sharded"].dtype == torch.float64
    assert torch.equal(got["sharded"], torch.arange(40, dtype=torch.float64).reshape(10, 4))


def test_cli_inspect_verify_and_convert(made, tmp_path):
    ck = str(made / "two_ranks")
    out = subprocess.run([cli_path(), "inspect", ck], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "dcp" in out.stdout and "sharded" in out.stdout
    out = subprocess.run([cli_path(), "verify", ck], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    dst = str(tmp_path / "native")
    out = subprocess.run([cli_path(), "convert", ck, dst], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    want = dcp_loaded(ck)
    got = tensorstash.restore(dst, target=tensors_of(ck))
    for fqn, w in want.items():
        assert torch_worker.same_bits(got[fqn], w), fqn


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_metadata_is_refused_and_runs_nothing(made, tmp_path):
    ck = tmp_path / "evil"
    shutil.copytree(made / "two_ranks", ck)
    marker = tmp_path / "PWNED"
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(_Evil(str(marker)), f)
    with pytest.raises(Exception, match="posix.system|os.system"):
        tensorstash.restore(str(ck))
    out = subprocess.run([cli_path(), "inspect", str(ck)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert not marker.exists()


def test_a_damaged_distcp_is_found(made, tmp_path):
    ck = tmp_path / "damaged"
    shutil.copytree(made / "two_ranks", ck)
    md = dcp.FileSystemReader(str(ck)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "sharded" and k.offset[0] == 5)
    path = ck / info.relative_path
    data = bytearray(path.read_bytes())
    rows = torch.arange(20, 40, dtype=torch.float32).numpy().tobytes()  # rows 5-9
    at = data.find(rows, info.offset, info.offset + info.length)
    assert at > 0
    data[at + 10] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(Exception, match=info.relative_path):
        tensorstash.restore(str(ck), target=tensors_of(str(ck)))
    out = subprocess.run([cli_path(), "verify", str(ck)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "sharded" in out.stdout + out.stderr


@pytest.mark.parametrize("max_inflight_bytes", [1, 300_000, 256 << 20])
def test_many_chunks_read_side_by_side_under_any_cap(tmp_path, max_inflight_bytes):
    # 48 tensors of 16-64 KiB in one .distcp file: their chunks are read by several threads at
    # once, at most max_inflight_bytes of archives held (1: one at a time), bit-exact.
    g = torch.Generator().manual_seed(1)
    sd = {f"layer{i}.w": torch.randn(64 * (1 + i % 4), 64, generator=g) for i in range(48)}
    sd["emb"] = torch.randn(300, 7, generator=g).to(torch.bfloat16)
    ck = str(tmp_path / "many")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=ck, no_dist=True)
    want = dcp_loaded(ck)
    got = tensorstash.restore(ck, target=tensors_of(ck), max_inflight_bytes=max_inflight_bytes,
                              io_threads=4)
    assert set(got) == set(want) == set(sd)
    for fqn, w in want.items():
        assert torch_worker.same_bits(got[fqn], w), fqn
        assert torch_worker.same_bits(got[fqn], sd[fqn]), fqn


def test_large_chunks_read_their_tensor_bytes_straight_into_the_target(tmp_path):
    # Chunks of 1 MiB and more, wanted whole by a box that holds them as one run, are read
    # with their tensor's bytes straight into it (only the archive's first and last 64 KiB
    # apart, for its records): direct_chunks. A box that wants part of a chunk, a cast, or a
    # small chunk reads the archive whole (staged). A flipped byte in the middle of the
    # tensor's bytes, which only the direct read's CRC-32 sees, is found and named.
    g = torch.Generator().manual_seed(3)
    sd = {"big": torch.randn(1024, 512, generator=g), "wide": torch.randn(3, 200_000, generator=g),
          "small": torch.randn(16, 16, generator=g)}
    ck = str(tmp_path / "large")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=ck, no_dist=True)
    reader = tensorstash._ext.Reader(os.path.dirname(ck), os.path.basename(ck))
    try:
        outs = {k: torch.zeros_like(v) for k, v in sd.items()}
        stats = reader.read_many([(k, [0] * v.dim(), list(v.shape), "float32",
                                   outs[k].view(-1).view(torch.uint8).numpy())
                                  for k, v in sd.items()])
        assert stats["direct_chunks"] == 2 and stats["staged_chunks"] == 1, stats
        for k in sd:
            assert torch_worker.same_bits(outs[k], sd[k]), k
        # Rows 1-1023 of "big" (part of its chunk), and "big" as float64: staged.
        part = torch.zeros(1023, 512)
        wide64 = torch.zeros(3, 200_000, dtype=torch.float64)
        stats = reader.read_many([("big", [1, 0], [1023, 512], "float32",
                                   part.view(-1).view(torch.uint8).numpy()),
                                  ("wide", [0, 0], [3, 200_000], "float64",
                                   wide64.view(-1).view(torch.uint8).numpy())])
        assert stats["direct_chunks"] == 0 and stats["staged_chunks"] == 2, stats
        assert torch.equal(part, sd["big"][1:]) and torch.equal(wide64, sd["wide"].double())
    finally:
        reader.close()
    # tensorstash.torch.load takes the direct path too: bit-exact.
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    tensorstash.torch.load(ck, target)
    for k in sd:
        assert torch_worker.same_bits(target[k], sd[k]), k
    md = dcp.FileSystemReader(ck).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "big")
    path = os.path.join(ck, info.relative_path)
    data = bytearray(open(path, "rb").read())
    data[info.offset + info.length // 2] ^= 0x20
    open(path, "wb").write(bytes(data))
    with pytest.raises(OSError, match=r"(?s)big.*CRC-32"):
        tensorstash.torch.load(ck, {k: torch.zeros_like(v) for k, v in sd.items()})
