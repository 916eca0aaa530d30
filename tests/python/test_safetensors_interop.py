"""safetensors in both directions, checked against the `safetensors` library (and transformers).

Files written by the library (its numpy API, and its low-level ``serialize_file`` for the dtypes
numpy lacks: bf16 and the float8 types) restore bit-exact through tensorstash.restore, with and
without a target and onto JAX shardings; our exports load with the library; hostile files are
clear errors; the index is written last (a fault or a kill during an export leaves no index);
a sharded JAX save on 8 CPU devices exports; and a tiny LlamaForCausalLM saved with tensorstash,
exported and loaded by transformers' from_pretrained gives identical logits.

The CLI is $TENSORSTASH_CLI or <repo>/build/tensorstash.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as stnp

import tensorstash
from tshelpers import assert_jax_array, assert_same_array, flip_byte, global_array, mesh, named, pattern

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CLI = os.environ.get("TENSORSTASH_CLI", os.path.join(REPO, "build", "tensorstash"))

# safetensors name -> NumPy dtype, for every dtype both have.
ST_DTYPES = {
    "BOOL": np.dtype(bool), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32), "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
NUMPY_API = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "F32", "F64",
             "C64"}


def values(name: str, shape=(6, 5), seed: int = 0) -> np.ndarray:
    dt = ST_DTYPES[name]
    if dt == bool:
        return (np.arange(np.prod(shape)).reshape(shape) % 3 == 0)
    # Random bits: every bit pattern (NaNs included) must come back as it was.
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def library_file(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Writes `tensors` with the library's low-level API (every dtype, names as given)."""
    kept = {k: np.ascontiguousarray(v) for k, v in tensors.items()}  # alive while it writes
    safetensors.serialize_file(
        {k: safetensors.TensorSpec(dtype=v.dtype.name, shape=list(v.shape),
                                   data_ptr=v.ctypes.data, data_len=v.nbytes)
         for k, v in kept.items()},
        path, metadata={"format": "pt"})


def library_load(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file through the library's deserializer."""
    with open(path, "rb") as f:
        out = {}
        for name, t in safetensors.deserialize(f.read()):
            out[name] = np.frombuffer(bytes(t["data"]), ST_DTYPES[t["dtype"]]).reshape(t["shape"])
        return out


def test_library_files_restore_bit_exact_for_every_dtype(tmp_path):
    want = {f"layer.{i}.{name}": values(name, seed=i) for i, name in enumerate(ST_DTYPES)}
    want["numpy.api.x"] = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = str(tmp_path / "model.safetensors")
    library_file(path, want)
    got = tensorstash.restore(path)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert_same_array(got[k], v, k)
    # The same through the numpy API's own writer, read from the folder holding the file.
    np_want = {f"t_{n}": values(n, (3, 7), seed=5) for n in NUMPY_API}
    folder = tmp_path / "np"
    folder.mkdir()
    stnp.save_file(np_want, str(folder / "model.safetensors"))
    got = tensorstash.restore(str(folder))
    for k, v in np_want.items():
        assert_same_array(got[k], v, k)
    meta = tensorstash.metadata(path)
    bf16 = f"layer.{list(ST_DTYPES).index('BF16')}.BF16"
    assert meta[bf16].dtype == ml_dtypes.bfloat16
    assert tuple(meta[bf16].shape) == (6, 5)


def test_sharded_library_folder_restores_onto_jax_shardings(tmp_path):
    import jax
    a = pattern((16, 12), np.float32)
    b = pattern((8,), ml_dtypes.bfloat16, seed=1)
    folder = tmp_path / "hf"
    folder.mkdir()
    library_file(str(folder / "model-00001-of-00002.safetensors"), {"w.a": a})
    library_file(str(folder / "model-00002-of-00002.safetensors"), {"w.b": b})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": a.nbytes + b.nbytes},
         "weight_map": {"w.a": "model-00001-of-00002.safetensors",
                        "w.b": "model-00002-of-00002.safetensors"}}))
    m = mesh((4, 2))
    sa, sb = named(m, "a", "b"), named(m, None)
    target = {"w.a": jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sa),
              "w.b": jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=sb)}
    got = tensorstash.restore(str(folder), target=target)
    assert_jax_array(got["w.a"], a, sa, "w.a")
    assert_jax_array(got["w.b"], b, sb, "w.b")
    # A target of another dtype: a cast on the way.
    got = tensorstash.restore(str(folder), target={"w.a": np.zeros((16, 12), np.float64)})
    assert_same_array(got["w.a"], a.astype(np.float64), "w.a as float64")


def test_cli_inspect_verify_and_convert_of_safetensors(tmp_path):
    want = {"a.weight": pattern((5, 3), np.float32), "a.bias": pattern((3,), np.int64)}
    path = str(tmp_path / "x.safetensors")
    stnp.save_file(want, path)
    out = subprocess.run([CLI, "inspect", path], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "a.weight" in out.stdout and "safetensors" in out.stdout
    out = subprocess.run([CLI, "verify", path], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    for to in ("native", "orbax"):
        dst = str(tmp_path / f"conv-{to}")
        out = subprocess.run([CLI, "convert", "--to", to, path, dst], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        got = tensorstash.restore(dst)
        for k, v in want.items():
            assert_same_array(got[k], v, f"{to}: {k}")


@pytest.mark.parametrize("case", ["duplicate", "overlap", "outside", "huge_length", "bad_json",
                                  "unknown_dtype", "size"])
def test_hostile_files_are_clear_errors(tmp_path, case):
    def file(header: str, data: bytes) -> bytes:
        h = header.encode()
        return struct.pack("<Q", len(h)) + h + data

    t = '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
    contents, message = {
        "duplicate": (file("{" + t + "," + t + "}", bytes(8)), "tensor 'a' appears twice"),
        "overlap": (file('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                         '"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', bytes(12)),
                    "overlaps tensor 'a'"),
        "outside": (file('{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', bytes(8)),
                    "past the end of the file"),
        "huge_length": (struct.pack("<Q", 2**62) + b"{}", "over the limit"),
        "bad_json": (file('{"a":', b""), "not valid JSON"),
        "unknown_dtype": (file('{"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}}', bytes(8)),
                          'unknown dtype "Q7"'),
        "size": (file('{"a":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}}', bytes(8)),
                 "needs 16"),
    }[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(contents)
    with pytest.raises(OSError, match="bad.safetensors") as info:
        tensorstash.restore(str(path))
    assert message in str(info.value)
    out = subprocess.run([CLI, "verify", str(path)], capture_output=True, text=True)
    assert out.returncode != 0 and message in out.stderr + out.stdout


def test_export_loads_with_the_library(tmp_path):
    want = {"model": {"embed": {"weight": values("BF16", (10, 4))},
                      "layers": [{"w": values(n, (3, 4), seed=i)} for i, n in
                                 enumerate(["F32", "F16", "F8_E4M3", "F8_E5M2", "I64", "BOOL"])]},
            "step": 7}
    src = str(tmp_path / "ckpt")
    tensorstash.save(src, want)
    dst = str(tmp_path / "hf")
    result = tensorstash.export_safetensors(src, dst, max_shard_bytes=100)
    assert result["skipped"] == ["step"]
    assert result["tensors"] == 7
    names = sorted(os.listdir(dst))
    n = len(result["files"])
    assert n > 1
    assert names == sorted(result["files"] + ["model.safetensors.index.json"])
    assert result["files"][0] == f"model-00001-of-{n:05d}.safetensors"
    index = json.loads(open(os.path.join(dst, "model.safetensors.index.json")).read())
    flat = {"model.embed.weight": want["model"]["embed"]["weight"]}
    flat.update({f"model.layers.{i}.w": layer["w"] for i, layer in enumerate(want["model"]["layers"])})
    assert sorted(index["weight_map"]) == sorted(flat)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in flat.values())
    loaded = {}
    for f in result["files"]:
        with safetensors.safe_open(os.path.join(dst, f), "np") as handle:
            assert handle.metadata() == {"format": "pt"}
        loaded.update(library_load(os.path.join(dst, f)))
    assert sorted(loaded) == sorted(flat)
    for k, v in flat.items():
        assert_same_array(loaded[k], v, k)
    # The export reads back through tensorstash too, and the CLI writes the same thing.
    back = tensorstash.restore(dst)
    for k, v in flat.items():
        assert_same_array(back[k], v, k)
    cli_dst = str(tmp_path / "hf-cli")
    out = subprocess.run([CLI, "convert", "--to", "safetensors", "--max-shard-bytes", "100", src,
                          cli_dst], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert sorted(os.listdir(cli_dst)) == names
    for f in result["files"]:
        assert open(os.path.join(dst, f), "rb").read() == open(os.path.join(cli_dst, f), "rb").read()


def test_orbax_checkpoint_exports(tmp_path):
    import orbax.checkpoint as ocp
    want = {"enc": {"w": pattern((12, 8), np.float32), "b": pattern((8,), ml_dtypes.bfloat16)}}
    src = str(tmp_path / "orbax")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(src, want)
    dst = str(tmp_path / "hf")
    result = tensorstash.export_safetensors(src, dst)
    assert result["files"] == ["model-00001-of-00001.safetensors"]
    loaded = library_load(os.path.join(dst, result["files"][0]))
    assert sorted(loaded) == ["enc.b", "enc.w"]
    assert_same_array(loaded["enc.w"], want["enc"]["w"], "enc.w")
    assert_same_array(loaded["enc.b"], want["enc"]["b"], "enc.b")


def test_export_refuses_colliding_names_and_missing_dtypes(tmp_path):
    src = str(tmp_path / "collide")
    tensorstash.save(src, {"a": {"b": np.zeros(2, np.float32)}, "a.b": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match="'a/b' and 'a.b'"):
        tensorstash.export_safetensors(src, str(tmp_path / "out1"))
    src = str(tmp_path / "complex")
    tensorstash.save(src, {"z": np.zeros(2, np.complex128)})
    with pytest.raises(ValueError, match="no dtype for complex128"):
        tensorstash.export_safetensors(src, str(tmp_path / "out2"))
    assert not os.path.exists(tmp_path / "out1") and not os.path.exists(tmp_path / "out2")


def test_a_fault_during_export_leaves_no_index(tmp_path):
    src = str(tmp_path / "ckpt")
    tensorstash.save(src, {f"w{i}": pattern((64, 64), np.float32, seed=i) for i in range(6)})
    flip_byte(src, "w4")  # the read of w4 fails its checksum, after other files were written
    dst = tmp_path / "hf"
    with pytest.raises(OSError):
        tensorstash.export_safetensors(src, str(dst), max_shard_bytes=20000)
    assert not (dst / "model.safetensors.index.json").exists()
    assert not dst.exists() or not os.listdir(dst)
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith("hf")]
    assert leftovers == [], leftovers


def test_a_killed_export_leaves_no_index(tmp_path):
    src = str(tmp_path / "ckpt")
    tensorstash.save(src, {f"w{i}": pattern((1024, 1024), np.float32, seed=i) for i in range(48)})
    dst = str(tmp_path / "hf")
    code = ("import sys, tensorstash; "
            "tensorstash.export_safetensors(sys.argv[1], sys.argv[2], max_shard_bytes=1 << 22, "
            "io_threads=1)")
    proc = subprocess.Popen([sys.executable, "-c", code, src, dst])
    # Kill it once it has begun writing (whenever that is): a folder or a temporary one appears.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if any(n.startswith("hf") for n in os.listdir(tmp_path)):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    index = os.path.join(dst, "model.safetensors.index.json")
    if os.path.exists(index):  # it finished before the kill: then it is whole
        got = tensorstash.restore(dst)
        assert len(got) == 48
    else:
        assert not os.path.exists(dst) or not any(
            n.endswith(".safetensors") for n in os.listdir(dst))


def test_sharded_jax_save_exports(tmp_path):
    import jax
    m = mesh((4, 2))
    a = pattern((32, 16), np.float32)
    b = pattern((8, 4), ml_dtypes.bfloat16, seed=2)
    state = {"params": {"dense": {"kernel": global_array(a, named(m, "a", "b")),
                                  "bias": global_array(b, named(m, "b"))}}}
    src = str(tmp_path / "ckpt")
    tensorstash.save(src, state)
    dst = str(tmp_path / "hf")
    result = tensorstash.export_safetensors(src, dst, max_shard_bytes=1024)
    assert len(result["files"]) == 2
    loaded = {}
    for f in result["files"]:
        loaded.update(library_load(os.path.join(dst, f)))
    assert_same_array(loaded["params.dense.kernel"], a, "kernel")
    assert_same_array(loaded["params.dense.bias"], b, "bias")
    # And back onto another sharding.
    s = named(mesh((8,)), "a")
    got = tensorstash.restore(dst, target={"params.dense.kernel": jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=s)})
    assert_jax_array(got["params.dense.kernel"], a, s, "kernel")


def test_llama_from_pretrained_gives_identical_logits(tmp_path):
    import torch  # scripts/setup.sh installs both: a missing one is a failure, never a skip
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    src = str(tmp_path / "ckpt")
    tensorstash.save(src, state)
    dst = str(tmp_path / "hf")
    result = tensorstash.export_safetensors(src, dst, max_shard_bytes=20_000)
    assert len(result["files"]) > 1
    model.config.save_pretrained(dst)
    loaded = transformers.LlamaForCausalLM.from_pretrained(dst).eval()
    ids = torch.arange(16).reshape(2, 8) % 128
    with torch.no_grad():
        want = model(ids).logits
        got = loaded(ids).logits
    assert torch.equal(got, want)
