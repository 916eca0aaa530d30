// OrbaxWriter in the memory store: the OCDBT database and zarr arrays read back with our own
// readers, the metadata documents, and the commit's all-or-nothing behaviour. Orbax itself
// restores what the writer writes in tests/python/test_orbax_write.py.
#include "tensorstash/checkpoint/orbax_writer.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/format/zarr/zarr_array.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/kvstore/ocdbt/ocdbt_kvstore.h"

namespace tensorstash {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<float> Iota(size_t n) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), 1.0f);
  return v;
}

// The rows [r0, r0 + rows) of a row-major [R, C] matrix.
std::vector<float> Rows(const std::vector<float>& m, int64_t cols, int64_t r0, int64_t rows) {
  return std::vector<float>(m.begin() + r0 * cols, m.begin() + (r0 + rows) * cols);
}

TEST(OrbaxWriterTest, WritesZarrArraysInOcdbtAndMetadata) {
  MemoryKvStore kv;
  const std::vector<float> w = Iota(10 * 3);
  // Uneven sharding over 4 devices (3, 3, 3, 1 rows), as jax gives it.
  std::vector<std::vector<float>> parts;
  std::vector<ShardData> shards;
  for (int64_t r = 0; r < 10; r += 3) {
    const int64_t rows = std::min<int64_t>(3, 10 - r);
    parts.push_back(Rows(w, 3, r, rows));
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t r = static_cast<int64_t>(i) * 3;
    shards.push_back(
        {Box({r, 0}, {static_cast<int64_t>(parts[i].size() / 3), 3}), parts[i].data(), 0, 2});
    shards.push_back({Box({r, 0}, {static_cast<int64_t>(parts[i].size() / 3), 3}), parts[i].data(),
                      1, 2});  // a replica: not written twice
  }
  const int32_t b[4] = {7, 0, 0, -1};
  auto writer = OrbaxWriter::Create(&kv, "run/5").value();
  ASSERT_TRUE(writer
                  ->AddArray({"params/w", DType::kFloat32, {10, 3}, OrbaxValueType::kJaxArray},
                             std::move(shards))
                  .ok());
  ASSERT_TRUE(writer->AddArray({"b", DType::kInt32, {4}}, {{Box({0}, {4}), b, 0, 1}}).ok());
  TreeNode root = TreeNode::Dict();
  TreeNode params = TreeNode::Dict();
  params.entries.emplace_back("w", TreeNode::Array(0));
  root.entries.emplace_back("params", std::move(params));
  TreeNode list;
  list.kind = TreeNode::Kind::kList;
  list.items.push_back(TreeNode::Array(1));
  TreeNode step;
  step.kind = TreeNode::Kind::kInt;
  step.int_value = "-12";
  list.items.push_back(step);
  list.items.push_back(TreeNode());  // None: recorded without data
  root.entries.emplace_back("l", std::move(list));
  writer->SetTree(std::move(root));
  OrbaxWriteStats stats;
  ASSERT_TRUE(writer->Commit(&stats).ok());
  EXPECT_EQ(stats.chunks, 5u);
  EXPECT_EQ(stats.raw_bytes, 10u * 3 * 4 + 16);

  // Nothing is left of the temporary folder.
  const std::vector<std::string> keys = kv.List("").value();
  for (const std::string& key : keys) EXPECT_THAT(key, HasSubstr("run/5/")) << key;

  auto db = OcdbtKvStore::Open(&kv, "run/5").value();
  auto zw = ZarrArray::Open(db.get(), "params.w").value();
  EXPECT_EQ(zw->zarr_format(), 3);
  EXPECT_TRUE(zw->sharded());
  EXPECT_THAT(zw->chunk_shape(), ElementsAre(3, 3));
  std::vector<float> got(30);
  ASSERT_TRUE(zw->Read(Box({0, 0}, {10, 3}), DType::kFloat32, got.data()).ok());
  EXPECT_EQ(got, w);
  auto zb = ZarrArray::Open(db.get(), "l.0").value();
  int32_t got_b[4];
  ASSERT_TRUE(zb->Read(Box({0}, {4}), DType::kInt32, got_b).ok());
  EXPECT_EQ(std::memcmp(got_b, b, sizeof(b)), 0);
  auto zs = ZarrArray::Open(db.get(), "l.1").value();
  EXPECT_EQ(zs->dtype(), DType::kInt64);
  int64_t got_step = 0;
  ASSERT_TRUE(zs->Read(Box({}, {}), DType::kInt64, &got_step).ok());
  EXPECT_EQ(got_step, -12);
  EXPECT_FALSE(ZarrArray::Open(db.get(), "l.2").ok());

  const auto metadata = nlohmann::json::parse(kv.Read("run/5/_METADATA").value());
  EXPECT_EQ(metadata["use_ocdbt"], true);
  EXPECT_EQ(metadata["use_zarr3"], true);
  EXPECT_EQ(metadata["store_array_data_equal_to_fill_value"], false);
  const auto& tree = metadata["tree_metadata"];
  ASSERT_EQ(tree.size(), 4u);
  EXPECT_EQ(tree["('l', '2')"]["value_metadata"]["value_type"], "None");
  EXPECT_EQ(tree["('l', '2')"]["value_metadata"]["skip_deserialize"], true);
  EXPECT_EQ(tree["('params', 'w')"]["value_metadata"]["value_type"], "jax.Array");
  EXPECT_EQ(tree["('params', 'w')"]["value_metadata"]["write_shape"], nlohmann::json({3, 3}));
  EXPECT_EQ(tree["('l', '0')"]["value_metadata"]["value_type"], "np.ndarray");
  EXPECT_EQ(tree["('l', '1')"]["value_metadata"]["value_type"], "scalar");
  EXPECT_EQ(tree["('l', '1')"]["key_metadata"],
            nlohmann::json::parse(R"([{"key": "l", "key_type": 2}, {"key": "1", "key_type": 1}])"));
  const auto checkpoint = nlohmann::json::parse(kv.Read("run/5/_CHECKPOINT_METADATA").value());
  EXPECT_THAT(checkpoint["item_handlers"].get<std::string>(),
              HasSubstr("StandardCheckpointHandler"));
  const auto arrays = nlohmann::json::parse(kv.Read("run/5/array_metadatas/process_0").value());
  EXPECT_EQ(arrays["array_metadatas"][0]["array_metadata"]["param_name"], "params.w");
}

TEST(OrbaxWriterTest, RecordsPrngKeyImplementationAsOrbaxDoes) {
  MemoryKvStore kv;
  auto writer = OrbaxWriter::Create(&kv, "run/1", {}).value();
  const uint32_t key[2] = {0, 42};
  OrbaxArraySpec spec{"rng", DType::kUint32, {2}, OrbaxValueType::kJaxArray, "threefry2x32"};
  ASSERT_TRUE(writer->AddArray(spec, {{Box({0}, {2}), key, 0, 1}}).ok());
  const float x[1] = {1};
  ASSERT_TRUE(writer
                  ->AddArray({"x", DType::kFloat32, {1}, OrbaxValueType::kJaxArray},
                             {{Box({0}, {1}), x, 0, 1}})
                  .ok());
  // Orbax keeps array metadata (and so a key's implementation) for jax.Array leaves only.
  OrbaxArraySpec numpy_key{"k2", DType::kUint32, {2}, OrbaxValueType::kNumpyArray, "rbg"};
  Status refused = writer->AddArray(numpy_key, {{Box({0}, {2}), key, 0, 1}});
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("'k2'"));
  OrbaxWriteStats stats;
  ASSERT_TRUE(writer->Commit(&stats).ok());
  const auto arrays = nlohmann::json::parse(kv.Read("run/1/array_metadatas/process_0").value());
  const auto& entries = arrays["array_metadatas"];
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0]["array_metadata"]["param_name"], "rng");
  EXPECT_EQ(entries[0]["array_metadata"]["ext_metadata"],
            nlohmann::json::parse(R"({"random_key_impl": "threefry2x32"})"));
  EXPECT_TRUE(entries[1]["array_metadata"]["ext_metadata"].is_null());
}

TEST(OrbaxWriterTest, OrbaxOwnFilesAreReadThroughTheReadersStore) {
  // What Orbax records beside the arrays (array_metadatas/process_0, _sharding) is read from the
  // checkpoint's store, whichever it is: the reader serves those files by name, and nothing
  // outside the checkpoint's folder.
  MemoryKvStore kv;
  auto writer = OrbaxWriter::Create(&kv, "run/1", {}).value();
  const uint32_t key[2] = {0, 42};
  OrbaxArraySpec spec{"rng", DType::kUint32, {2}, OrbaxValueType::kJaxArray, "rbg"};
  ASSERT_TRUE(writer->AddArray(spec, {{Box({0}, {2}), key, 0, 1}}).ok());
  OrbaxWriteStats stats;
  ASSERT_TRUE(writer->Commit(&stats).ok());
  ASSERT_TRUE(kv.Write("run/2/secret", "not the checkpoint's").ok());
  auto reader = OpenStepSource(&kv, "run/1");
  ASSERT_TRUE(reader.ok()) << reader.status();
  Result<std::string> arrays = (*reader)->ReadFile("array_metadatas/process_0");
  ASSERT_TRUE(arrays.ok()) << arrays.status();
  EXPECT_EQ(*arrays, kv.Read("run/1/array_metadatas/process_0").value());
  Result<std::string> missing = (*reader)->ReadFile("_no_such_file");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_THAT(missing.status().message(), HasSubstr("_no_such_file"));
  for (const char* outside : {"../2/secret", "/run/2/secret", "a//b", "./_METADATA", ""}) {
    Result<std::string> refused = (*reader)->ReadFile(outside);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << outside;
  }
}

TEST(OrbaxWriterTest, ManagerItemLayoutAndChunkSource) {
  MemoryKvStore kv;
  OrbaxWriterOptions options;
  options.item = "default";
  auto writer = OrbaxWriter::Create(&kv, "ckpts/3", options).value();
  const std::vector<float> m = Iota(5 * 4);
  ASSERT_TRUE(writer
                  ->AddArray({"m", DType::kFloat32, {5, 4}}, {2, 4},
                             [&](const Box& box, void* dest) {
                               std::vector<float> rows = Rows(m, 4, box.origin[0], box.shape[0]);
                               std::memcpy(dest, rows.data(), rows.size() * 4);
                               return OkStatus();
                             })
                  .ok());
  ASSERT_TRUE(writer->AddFile("_sharding", "{}").ok());
  uint64_t last = 0, total = 0;
  ASSERT_TRUE(writer
                  ->Commit(nullptr,
                           [&](uint64_t d, uint64_t t) {
                             last = d;
                             total = t;
                           })
                  .ok());
  EXPECT_EQ(last, 80u);
  EXPECT_EQ(total, 80u);
  EXPECT_TRUE(kv.Read("ckpts/3/_CHECKPOINT_METADATA").ok());
  EXPECT_TRUE(kv.Read("ckpts/3/default/_METADATA").ok());
  EXPECT_EQ(kv.Read("ckpts/3/default/_sharding").value(), "{}");
  const auto checkpoint = nlohmann::json::parse(kv.Read("ckpts/3/_CHECKPOINT_METADATA").value());
  EXPECT_TRUE(checkpoint["item_handlers"].contains("default"));
  auto db = OcdbtKvStore::Open(&kv, "ckpts/3/default").value();
  auto za = ZarrArray::Open(db.get(), "m").value();
  EXPECT_THAT(za->chunk_shape(), ElementsAre(2, 4));
  std::vector<float> got(20);
  ASSERT_TRUE(za->Read(Box({0, 0}, {5, 4}), DType::kFloat32, got.data()).ok());
  EXPECT_EQ(got, m);
}

TEST(OrbaxWriterTest, JsonItemsBesideTheItemAsOrbaxWritesThem) {
  MemoryKvStore kv;
  OrbaxWriterOptions options;
  options.item = "default";
  options.json_items = {{"metrics", "metrics", R"({"loss": 2.5})"}};
  auto writer = OrbaxWriter::Create(&kv, "ckpts/4", options).value();
  const std::vector<float> v = Iota(3);
  ASSERT_TRUE(writer->AddArray({"v", DType::kFloat32, {3}}, {{Box({0}, {3}), v.data(), 0, 1}})
                  .ok());
  ASSERT_TRUE(writer->Commit().ok());
  EXPECT_EQ(kv.Read("ckpts/4/metrics/metrics").value(), R"({"loss": 2.5})");
  const auto checkpoint = nlohmann::json::parse(kv.Read("ckpts/4/_CHECKPOINT_METADATA").value());
  EXPECT_THAT(checkpoint["item_handlers"]["metrics"].get<std::string>(),
              HasSubstr("JsonCheckpointHandler"));
  EXPECT_THAT(checkpoint["item_handlers"]["default"].get<std::string>(),
              HasSubstr("StandardCheckpointHandler"));

  // A JSON item needs a step folder's item, a plain name, and a name of its own.
  OrbaxWriterOptions no_item;
  no_item.json_items = {{"metrics", "metrics", "{}"}};
  EXPECT_EQ(OrbaxWriter::Create(&kv, "ckpts/5", no_item).status().code(),
            absl::StatusCode::kInvalidArgument);
  OrbaxWriterOptions nested = options;
  nested.json_items = {{"a/b", "metrics", "{}"}};
  EXPECT_EQ(OrbaxWriter::Create(&kv, "ckpts/5", nested).status().code(),
            absl::StatusCode::kInvalidArgument);
  OrbaxWriterOptions twice = options;
  twice.json_items = {{"default", "metrics", "{}"}};
  EXPECT_EQ(OrbaxWriter::Create(&kv, "ckpts/5", twice).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(OrbaxWriterTest, ChunkSourcesStayUnderTheByteCap) {
  MemoryKvStore kv;
  OrbaxWriterOptions options;
  options.io_threads = 4;
  options.max_inflight_bytes = 2 * 4 * 4;  // two chunks of [1, 4] float32
  auto writer = OrbaxWriter::Create(&kv, "ckpt", options).value();
  const std::vector<float> m = Iota(16 * 4);
  std::atomic<int> running{0}, most{0}, calls{0};
  ASSERT_TRUE(writer
                  ->AddArray({"m", DType::kFloat32, {16, 4}}, {1, 4},
                             [&](const Box& box, void* dest) {
                               const int now = ++running;
                               int seen = most.load();
                               while (now > seen && !most.compare_exchange_weak(seen, now)) {
                               }
                               std::this_thread::sleep_for(std::chrono::milliseconds(2));
                               std::memcpy(dest, m.data() + box.origin[0] * 4, 16);
                               ++calls;
                               --running;
                               return OkStatus();
                             })
                  .ok());
  OrbaxWriteStats stats;
  ASSERT_TRUE(writer->Commit(&stats).ok());
  EXPECT_EQ(calls.load(), 16);
  EXPECT_EQ(stats.chunks, 16u);
  EXPECT_LE(most.load(), 2);
  auto db = OcdbtKvStore::Open(&kv, "ckpt").value();
  std::vector<float> got(64);
  ASSERT_TRUE(ZarrArray::Open(db.get(), "m")
                  .value()
                  ->Read(Box({0, 0}, {16, 4}), DType::kFloat32, got.data())
                  .ok());
  EXPECT_EQ(got, m);
}

TEST(OrbaxWriterTest, FailuresLeaveNothing) {
  MemoryKvStore kv;
  {  // A failing source: no checkpoint, no temporary folder.
    auto writer = OrbaxWriter::Create(&kv, "c/1").value();
    ASSERT_TRUE(writer
                    ->AddArray({"x", DType::kFloat32, {8}}, {2},
                               [](const Box& box, void*) {
                                 return box.origin[0] == 4 ? DataLossError("bad chunk")
                                                           : OkStatus();
                               })
                    .ok());
    Status s = writer->Commit();
    EXPECT_TRUE(absl::IsDataLoss(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("bad chunk"));
    EXPECT_TRUE(kv.List("").value().empty());
  }
  {  // Colliding names ("a.b" and a/b).
    auto writer = OrbaxWriter::Create(&kv, "c/1").value();
    const float v = 1;
    ASSERT_TRUE(writer->AddArray({"a.b", DType::kFloat32, {}}, {{Box(), &v, 0, 1}}).ok());
    ASSERT_TRUE(writer->AddArray({"a/b", DType::kFloat32, {}}, {{Box(), &v, 0, 1}}).ok());
    Status s = writer->Commit();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("same Orbax name 'a.b'"));
    EXPECT_TRUE(kv.List("").value().empty());
  }
  {  // Shards that do not tile the array.
    auto writer = OrbaxWriter::Create(&kv, "c/1").value();
    const std::vector<float> v = Iota(8);
    Status s = writer->AddArray({"x", DType::kFloat32, {8}}, {{Box({0}, {4}), v.data(), 0, 1}});
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("cover 1 of the 2 cells"));
  }
  {  // An existing checkpoint is kept unless `overwrite`.
    const float v = 2;
    auto writer = OrbaxWriter::Create(&kv, "c/1").value();
    ASSERT_TRUE(writer->AddArray({"x", DType::kFloat32, {}}, {{Box(), &v, 0, 1}}).ok());
    ASSERT_TRUE(writer->Commit().ok());
    auto again = OrbaxWriter::Create(&kv, "c/1").value();
    ASSERT_TRUE(again->AddArray({"y", DType::kFloat32, {}}, {{Box(), &v, 0, 1}}).ok());
    EXPECT_TRUE(absl::IsAlreadyExists(again->Commit()));
    OrbaxWriterOptions options;
    options.overwrite = true;
    auto over = OrbaxWriter::Create(&kv, "c/1", options).value();
    ASSERT_TRUE(over->AddArray({"y", DType::kFloat32, {}}, {{Box(), &v, 0, 1}}).ok());
    ASSERT_TRUE(over->Commit().ok());
    auto db = OcdbtKvStore::Open(&kv, "c/1").value();
    EXPECT_THAT(db->List("").value(), ElementsAre("y/c", "y/zarr.json"));
    const std::vector<std::string> keys = kv.List("").value();
    for (const std::string& key : keys) EXPECT_THAT(key, HasSubstr("c/1/")) << key;
  }
}

// Haiku's module names keep their '/' in the parameter name and the OCDBT keys, as Orbax
// writes them; a string leaf goes into _strings.json, with value type "string"; a string whose
// name has a '/' (a JSON pointer level for Orbax) is refused, and so are bytes.
TEST(OrbaxWriterTest, SlashKeysAndStringLeaves) {
  MemoryKvStore kv;
  const float v[2] = {1, 2};
  auto writer = OrbaxWriter::Create(&kv, "h/1").value();
  ASSERT_TRUE(writer->AddArray({"mlp~1~0~1linear_0/w", DType::kFloat32, {2}},
                               {{Box({0}, {2}), v, 0, 1}})
                  .ok());
  TreeNode root = TreeNode::Dict();
  TreeNode linear = TreeNode::Dict();
  linear.entries.emplace_back("w", TreeNode::Array(0));
  root.entries.emplace_back("mlp/~/linear_0", std::move(linear));
  TreeNode name;
  name.kind = TreeNode::Kind::kString;
  name.string_value = "adam";
  root.entries.emplace_back("opt", name);
  writer->SetTree(root);
  ASSERT_TRUE(writer->Commit().ok());
  auto db = OcdbtKvStore::Open(&kv, "h/1").value();
  auto zw = ZarrArray::Open(db.get(), "mlp/~/linear_0.w").value();
  float got[2];
  ASSERT_TRUE(zw->Read(Box({0}, {2}), DType::kFloat32, got).ok());
  EXPECT_EQ(got[1], 2);
  const auto metadata = nlohmann::json::parse(kv.Read("h/1/_METADATA").value());
  EXPECT_EQ(metadata["tree_metadata"]["('opt',)"]["value_metadata"]["value_type"], "string");
  EXPECT_EQ(nlohmann::json::parse(kv.Read("h/1/_strings.json").value()),
            nlohmann::json({{"opt", "adam"}}));

  for (const bool bytes : {false, true}) {
    auto bad = OrbaxWriter::Create(&kv, "h/2").value();
    TreeNode tree = TreeNode::Dict();
    TreeNode inner = TreeNode::Dict();
    TreeNode leaf = name;
    if (bytes) leaf.kind = TreeNode::Kind::kBytes;
    inner.entries.emplace_back("s", leaf);
    tree.entries.emplace_back(bytes ? "b" : "a/b", std::move(inner));
    bad->SetTree(std::move(tree));
    Status s = bad->Commit();
    EXPECT_TRUE(absl::IsUnimplemented(s)) << s;
    EXPECT_FALSE(kv.Read("h/2/_METADATA").ok());
  }
}

}  // namespace
}  // namespace tensorstash
