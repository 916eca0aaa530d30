// Writes the seed corpora of the fuzz targets from real checkpoints: for each of a few small
// steps saved into a MemoryKvStore, its index, tree.json and COMMIT, one zstd chunk, and the
// whole step folder as a bundle (fuzz_targets.h).
//   make_seed_corpus <fuzz/corpus>     (scripts/run_fuzz.sh --regenerate-corpus runs it)
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "fuzz/fuzz_targets.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/checkpoint/orbax_writer.h"
#include "tensorstash/format/chunk_codec.h"
#include "tensorstash/format/safetensors/safetensors_header.h"
#include "tensorstash/format/zarr/zarr_array.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/kvstore/ocdbt/ocdbt_kvstore.h"
#include "tensorstash/util/str_util.h"

namespace ts = tensorstash;

namespace {

void Put(const std::filesystem::path& path, const std::string& bytes) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

[[noreturn]] void Die(const ts::Status& status) {
  std::fprintf(stderr, "make_seed_corpus: %s\n", status.ToString().c_str());
  std::exit(1);
}

struct Spec {
  ts::ArraySpec spec;
  std::vector<int64_t> split;  // shard boundaries of dimension 0 ({} = one shard)
};

// Saves `arrays` as step "s" with small chunks and returns its files (keys under the step).
std::map<std::string, std::string> Save(const std::vector<Spec>& arrays, bool tree_of_values) {
  ts::MemoryKvStore kv;
  ts::WriterOptions options;
  options.target_chunk_bytes = 64;
  options.target_data_file_bytes = 256;
  options.sync = false;
  auto writer = ts::CheckpointWriter::Create(&kv, "s", options);
  if (!writer.ok()) Die(writer.status());
  std::vector<std::vector<char>> buffers;
  buffers.reserve(64);
  for (const Spec& a : arrays) {
    std::vector<ts::ShardData> shards;
    std::vector<int64_t> cuts = a.split;
    const int64_t n = a.spec.shape.empty() ? 1 : a.spec.shape[0];
    cuts.insert(cuts.begin(), 0);
    cuts.push_back(n);
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      ts::Box box = ts::Box::FromShape(a.spec.shape);
      if (!a.spec.shape.empty()) {
        box.origin[0] = cuts[i];
        box.shape[0] = cuts[i + 1] - cuts[i];
      }
      buffers.emplace_back(static_cast<size_t>(box.num_elements()) * ts::ItemSize(a.spec.dtype));
      for (size_t b = 0; b < buffers.back().size(); ++b) {
        buffers.back()[b] = static_cast<char>((b * 7 + i) % 13);
      }
      shards.push_back({box, buffers.back().data(), 0, 1});
    }
    if (ts::Status s = (*writer)->AddArray(a.spec, shards); !s.ok()) Die(s);
  }
  if (tree_of_values) {
    ts::TreeNode root = ts::TreeNode::Dict();
    for (size_t i = 0; i < arrays.size(); ++i) {
      root.entries.emplace_back(arrays[i].spec.path, ts::TreeNode::Array(static_cast<int64_t>(i)));
    }
    ts::TreeNode values;
    values.kind = ts::TreeNode::Kind::kList;
    ts::TreeNode leaf;
    leaf.kind = ts::TreeNode::Kind::kInt;
    leaf.int_value = "-123456789012345678901234";
    values.items.push_back(leaf);
    leaf = {};
    leaf.kind = ts::TreeNode::Kind::kFloat;
    leaf.float_value = 0.1;
    values.items.push_back(leaf);
    leaf = {};
    leaf.kind = ts::TreeNode::Kind::kBytes;
    leaf.string_value = std::string("hi\0\xff", 4);
    values.items.push_back(leaf);
    leaf = {};
    leaf.kind = ts::TreeNode::Kind::kTuple;
    values.items.push_back(leaf);
    root.entries.emplace_back("meta", values);
    (*writer)->SetTree(root);
  }
  if (ts::Status s = (*writer)->Commit(); !s.ok()) Die(s);
  std::map<std::string, std::string> files;
  const std::vector<std::string> keys = *kv.List("s/");
  for (const std::string& key : keys) files[key.substr(2)] = *kv.Read(key);
  return files;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path out = argv[1];
  std::vector<std::vector<Spec>> steps = {
      {{{"w", ts::DType::kFloat32, {3, 5}}, {}}},
      {{{"w", ts::DType::kFloat32, {7, 10}}, {5}},
       {{"b", ts::DType::kBfloat16, {10}}, {}},
       {{"z", ts::DType::kInt32, {12, 3}, ts::Codec::kZstd}, {6}},
       {{"step", ts::DType::kInt64, {}}, {}},
       {{"empty", ts::DType::kUint8, {0, 4}}, {}}},
      {},
      {{{"params/w", ts::DType::kComplex64, {4, 2}}, {2}},
       {{"opt/mu/layer~1", ts::DType::kFloat8E4m3fn, {9}}, {}}},
      // The ml_dtypes types of fewer bits and the later float8 variants, by name in tree.json.
      {{{"q/int4", ts::DType::kInt4, {9, 3}}, {4}},
       {{"q/scale", ts::DType::kFloat8E8m0fnu, {9}}, {}},
       {{"f4", ts::DType::kFloat4E2m1fn, {4, 4}, ts::Codec::kZstd}, {}},
       {{"u2", ts::DType::kUint2, {5}}, {}},
       {{"f6", ts::DType::kFloat6E3m2fn, {3}}, {}},
       {{"fnuz", ts::DType::kFloat8E4m3fnuz, {2, 3}}, {}}},
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::map<std::string, std::string> files = Save(steps[i], i == 1);
    const std::string name = "seed" + std::to_string(i);
    Put(out / "index" / name, files.at("state/index"));
    Put(out / "tree_json" / name, files.at("state/tree.json"));
    Put(out / "commit_record" / name, files.at("COMMIT"));
    Put(out / "step" / name, ts::fuzz::EncodeBundle(files));
  }
  // OCDBT databases: one leaf; several levels with zstd; empty.
  for (int i = 0; i < 3; ++i) {
    ts::MemoryKvStore kv;
    ts::OcdbtWriter::Options options;
    options.zstd = i == 1;
    options.max_decoded_node_bytes = 4096;
    auto writer = ts::OcdbtWriter::Create(&kv, "db", options);
    if (!writer.ok()) Die(writer.status());
    const int count = i == 0 ? 5 : i == 1 ? 120 : 0;
    for (int k = 0; k < count; ++k) {
      const ts::Status added = (*writer)->Add(
          "params.w" + std::to_string(k % 7) + "/c/" + std::to_string(k),
          std::string(static_cast<size_t>(k * 37 % 300), static_cast<char>('a' + k % 26)));
      if (!added.ok()) Die(added);
    }
    if (const ts::Status done = (*writer)->Finish(); !done.ok()) Die(done);
    std::map<std::string, std::string> files;
    const std::vector<std::string> keys = *kv.List("db/");
    for (const std::string& key : keys) files[key.substr(3)] = *kv.Read(key);
    Put(out / "ocdbt" / ("seed" + std::to_string(i)), ts::fuzz::EncodeBundle(files));
  }
  // Foreign steps: Orbax over OCDBT (OrbaxWriter); Orbax zarr folders (v3 sharded zstd, v2
  // blosc and gzip); a zarr group (v2 zstd); zarr folders of TensorStore's int4, float8_e8m0fnu
  // and float4_e2m1fn (v2 and v3).
  const std::vector<float> values = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  for (int i = 0; i < 4; ++i) {
    ts::MemoryKvStore kv;
    if (i == 0) {
      auto writer = ts::OrbaxWriter::Create(&kv, "s", {.sync = false});
      if (!writer.ok()) Die(writer.status());
      const ts::Box box = ts::Box::FromShape({3, 4});
      if (ts::Status s = (*writer)->AddArray({"params/w", ts::DType::kFloat32, {3, 4}},
                                             {{box, values.data(), 0, 1}});
          !s.ok())
        Die(s);
      if (ts::Status s = (*writer)->Commit(); !s.ok()) Die(s);
    }
    const std::vector<std::pair<std::string, ts::ZarrArraySpec>> zarrs =
        i == 1
            ? std::vector<std::pair<std::string, ts::ZarrArraySpec>>{{"s/params.w",
                                                                      {3,
                                                                       ts::DType::kFloat32,
                                                                       {3, 4},
                                                                       {2, 4},
                                                                       true,
                                                                       {1, 4}}},
                                                                     {"s/opt.0",
                                                                      {2,
                                                                       ts::DType::kFloat32,
                                                                       {12},
                                                                       {5},
                                                                       true,
                                                                       {},
                                                                       ts::ZarrCompressor::kBlosc}},
                                                                     {"s/opt.1",
                                                                      {2,
                                                                       ts::DType::kFloat32,
                                                                       {12},
                                                                       {12},
                                                                       true,
                                                                       {},
                                                                       ts::ZarrCompressor::kGzip,
                                                                       1,
                                                                       '/'}}}
        : i == 2 ? std::vector<std::pair<std::string, ts::ZarrArraySpec>>{{"s/['params']['w']",
                                                                           {2,
                                                                            ts::DType::kFloat32,
                                                                            {3, 4},
                                                                            {2, 2}}}}
        : i == 3 ? std::vector<std::pair<std::string, ts::ZarrArraySpec>>{
                       {"s/q.int4", {2, ts::DType::kInt4, {12}, {5}}},
                       {"s/q.scale", {3, ts::DType::kFloat8E8m0fnu, {3, 4}, {2, 4}}},
                       {"s/f.four", {3, ts::DType::kFloat4E2m1fn, {6}, {6}}}}
                 : std::vector<std::pair<std::string, ts::ZarrArraySpec>>{};
    for (const auto& [prefix, spec] : zarrs) {
      auto writer = ts::ZarrArrayWriter::Create(&kv, prefix, spec);
      if (!writer.ok()) Die(writer.status());
      if (ts::Status s = (*writer)->WriteBox(ts::Box::FromShape(spec.shape), values.data());
          !s.ok())
        Die(s);
    }
    if (i == 1 || i == 3) {  // Orbax's tree metadata (dicts, and a list for opt)
      const std::vector<std::tuple<std::string, std::string, int>> leaves =
          i == 1 ? std::vector<std::tuple<std::string, std::string, int>>{{"params", "w", 2},
                                                                           {"opt", "0", 1},
                                                                           {"opt", "1", 1}}
                 : std::vector<std::tuple<std::string, std::string, int>>{
                       {"q", "int4", 2}, {"q", "scale", 2}, {"f", "four", 2}};
      std::string tree;
      for (const auto& [a, b, type] : leaves) {
        tree += ts::StrCat(tree.empty() ? "" : ", ", "\"('", a, "', '", b,
                           "')\": ", "{\"key_metadata\": [{\"key\": \"", a,
                           "\", \"key_type\": 2}, ", "{\"key\": \"", b, "\", \"key_type\": ", type,
                           "}], ", "\"value_metadata\": {\"value_type\": \"np.ndarray\"}}");
      }
      (void)kv.Write("s/_METADATA", ts::StrCat("{\"tree_metadata\": {", tree, "}}"));
    }
    if (i == 2) {
      (void)kv.Write("s/.zgroup", R"({"zarr_format": 2})");
      (void)kv.Write("s/.zattrs", R"({"write_completed": true})");
    }
    std::map<std::string, std::string> files;
    const std::vector<std::string> keys = *kv.List("s/");
    for (const std::string& key : keys) files[key.substr(2)] = *kv.Read(key);
    Put(out / "foreign_step" / ("seed" + std::to_string(i)), ts::fuzz::EncodeBundle(files));
  }
  // One compressed chunk, with its raw size in front.
  std::string raw(300, '\0');
  for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<char>(i % 17);
  std::string frame;
  if (!ts::EncodeChunk(ts::Codec::kZstd, 3, raw, &frame).ok()) return 1;
  Put(out / "chunk_codec" / "seed0",
      std::string{static_cast<char>(raw.size() & 0xff), static_cast<char>(raw.size() >> 8), 0} +
          frame);
  // safetensors files (seeds 0-2; seeds 3 and 4, a repeated name and an overlap, were written
  // by hand and are kept).
  const std::vector<std::vector<ts::SafetensorsTensor>> files = {
      {{"a", ts::DType::kFloat32, {2, 3}}, {"b.bias", ts::DType::kBfloat16, {4}}},
      {{"x", ts::DType::kUint8, {0}}, {"s", ts::DType::kInt64, {}},
       {"f8", ts::DType::kFloat8E4m3fn, {3, 1}}},
      {}};
  for (size_t i = 0; i < files.size(); ++i) {
    std::vector<ts::SafetensorsTensor> tensors = files[i];
    ts::Result<std::string> header = ts::EncodeSafetensorsHeader(
        tensors, i == 0 ? std::vector<std::pair<std::string, std::string>>{{"format", "pt"}}
                        : std::vector<std::pair<std::string, std::string>>{});
    if (!header.ok()) return 1;
    const uint64_t data = tensors.empty() ? header->size() : tensors.back().end;
    std::string file = *header;
    for (uint64_t b = header->size(); b < data; ++b) file += static_cast<char>(b % 7);
    Put(out / "safetensors_header" / ("seed" + std::to_string(i)), file);
  }
  return 0;
}
