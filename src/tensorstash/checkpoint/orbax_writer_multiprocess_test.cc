// OrbaxWriter with several processes (threads with an InProcessCoordinator): each writes its
// own OCDBT database, process 0 merges them and publishes the checkpoint, which reads back
// whole; a failure in any process leaves nothing.
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/orbax_writer.h"
#include "tensorstash/format/zarr/zarr_array.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/kvstore/ocdbt/ocdbt_kvstore.h"
#include "tensorstash/testing/in_process_coordinator.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

// Runs body(process index, coordinator) in `n` threads; returns each one's status.
std::vector<Status> RunProcesses(int n, const std::function<Status(int, Coordinator*)>& body) {
  auto group = std::make_shared<InProcessCoordinatorGroup>(n);
  std::vector<Status> statuses(n);
  std::vector<std::thread> threads;
  for (int p = 0; p < n; ++p) {
    threads.emplace_back([&, p] {
      InProcessCoordinator coordinator(group, p);
      statuses[p] = body(p, &coordinator);
    });
  }
  for (std::thread& t : threads) t.join();
  return statuses;
}

std::vector<float> Iota(size_t n, float first) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST(OrbaxWriterMultiProcessTest, EachProcessWritesItsOwnDatabaseAndProcessZeroMerges) {
  MemoryKvStore kv;
  // w [8, 3] in shards of 2 rows: rows [0, 4) are held by both processes (replica 0 in process
  // 0, replica 1 in process 1), rows [4, 8) by process 1 alone. r is one box held by both.
  const std::vector<float> w = Iota(24, 1);
  const std::vector<float> r = Iota(5, 100);  // replicated: one box held by both processes
  const int64_t step_value = 7;
  const std::vector<Status> statuses = RunProcesses(2, [&](int p, Coordinator* c) -> Status {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<OrbaxWriter> writer,
                        OrbaxWriter::Create(&kv, "run/9", {}, c));
    std::vector<ShardData> shards;
    if (p == 0) {
      shards.push_back({Box({0, 0}, {2, 3}), w.data(), 0, 2});
      shards.push_back({Box({2, 0}, {2, 3}), w.data() + 6, 0, 2});
    } else {
      shards.push_back({Box({0, 0}, {2, 3}), w.data(), 1, 2});
      shards.push_back({Box({2, 0}, {2, 3}), w.data() + 6, 1, 2});
      shards.push_back({Box({4, 0}, {2, 3}), w.data() + 12, 0, 1});
      shards.push_back({Box({6, 0}, {2, 3}), w.data() + 18, 0, 1});
    }
    TS_RETURN_IF_ERROR(writer->AddArray(
        {"params/w", DType::kFloat32, {8, 3}, OrbaxValueType::kJaxArray}, std::move(shards)));
    TS_RETURN_IF_ERROR(writer->AddArray({"r", DType::kFloat32, {5}},
                                        {{Box({0}, {5}), r.data(), p, 2}}));
    TreeNode root = TreeNode::Dict();
    TreeNode params = TreeNode::Dict();
    params.entries.emplace_back("w", TreeNode::Array(0));
    root.entries.emplace_back("params", std::move(params));
    root.entries.emplace_back("r", TreeNode::Array(1));
    TreeNode step;
    step.kind = TreeNode::Kind::kInt;
    step.int_value = std::to_string(step_value);
    root.entries.emplace_back("step", std::move(step));
    writer->SetTree(std::move(root));
    OrbaxWriteStats stats;
    TS_RETURN_IF_ERROR(writer->Commit(&stats));
    // Replica 0 writes each box: process 0 rows [0, 4) and r (and the scalar, not counted),
    // process 1 rows [4, 8).
    const uint64_t chunks = p == 0 ? 2 + 1 : 2;
    if (stats.chunks != chunks) {
      return InternalError(StrCat("process ", p, " wrote ", stats.chunks, " chunks"));
    }
    return OkStatus();
  });
  for (const Status& s : statuses) ASSERT_TRUE(s.ok()) << s;

  const std::vector<std::string> keys = kv.List("").value();
  for (const std::string& key : keys) {
    EXPECT_THAT(key, HasSubstr("run/9/")) << key;  // nothing left beside it
  }
  EXPECT_TRUE(kv.Size("run/9/ocdbt.process_0/manifest.ocdbt").ok());
  EXPECT_TRUE(kv.Size("run/9/ocdbt.process_1/manifest.ocdbt").ok());
  auto db = OcdbtKvStore::Open(&kv, "run/9").value();
  auto zw = ZarrArray::Open(db.get(), "params.w").value();
  EXPECT_THAT(zw->chunk_shape(), ::testing::ElementsAre(2, 3));
  std::vector<float> got(24);
  ASSERT_TRUE(zw->Read(Box({0, 0}, {8, 3}), DType::kFloat32, got.data()).ok());
  EXPECT_EQ(got, w);
  auto zr = ZarrArray::Open(db.get(), "r").value();
  std::vector<float> got_r(5);
  ASSERT_TRUE(zr->Read(Box({0}, {5}), DType::kFloat32, got_r.data()).ok());
  EXPECT_EQ(got_r, r);
  auto zs = ZarrArray::Open(db.get(), "step").value();
  int64_t got_step = 0;
  ASSERT_TRUE(zs->Read(Box({}, {}), DType::kInt64, &got_step).ok());
  EXPECT_EQ(got_step, step_value);
  const auto metadata = nlohmann::json::parse(kv.Read("run/9/_METADATA").value());
  EXPECT_EQ(metadata["tree_metadata"].size(), 3u);
  const auto arrays = nlohmann::json::parse(kv.Read("run/9/array_metadatas/process_0").value());
  EXPECT_EQ(arrays["array_metadatas"][0]["array_metadata"]["param_name"], "params.w");
}

// Shards that leave a chunk unwritten, in any process: every process fails the same way, and
// nothing is visible (no checkpoint, no temporary folder).
TEST(OrbaxWriterMultiProcessTest, UncoveredArrayFailsEveryProcessAndLeavesNothing) {
  MemoryKvStore kv;
  const std::vector<float> w = Iota(8, 0);
  const std::vector<Status> statuses = RunProcesses(2, [&](int p, Coordinator* c) -> Status {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<OrbaxWriter> writer,
                        OrbaxWriter::Create(&kv, "run/1", {}, c));
    // Both hold rows [0, 2) as replica 0 (written twice), process 1 also rows [4, 6); rows
    // [2, 4) and [6, 8) are held by no one.
    std::vector<ShardData> shards = {{Box({0}, {2}), w.data(), 0, 1}};
    if (p == 1) shards.push_back({Box({4}, {2}), w.data() + 4, 0, 1});
    TS_RETURN_IF_ERROR(writer->AddArray({"x", DType::kFloat32, {8}}, std::move(shards)));
    return writer->Commit();
  });
  for (const Status& s : statuses) {
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("array 'x'"));
  }
  EXPECT_TRUE(kv.List("").value().empty());
}

// Processes that disagree on an array fail before anything is written.
TEST(OrbaxWriterMultiProcessTest, DifferentTreesAreRefused) {
  MemoryKvStore kv;
  const float v[4] = {1, 2, 3, 4};
  const std::vector<Status> statuses = RunProcesses(2, [&](int p, Coordinator* c) -> Status {
    TS_ASSIGN_OR_RETURN(std::unique_ptr<OrbaxWriter> writer,
                        OrbaxWriter::Create(&kv, "run/2", {}, c));
    TS_RETURN_IF_ERROR(writer->AddArray({"x", DType::kFloat32, {p == 0 ? 4 : 3}},
                                        {{Box({0}, {p == 0 ? 4 : 3}), v, p, 2}}));
    return writer->Commit();
  });
  for (const Status& s : statuses) {
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("differs between process"));
  }
  EXPECT_TRUE(kv.List("").value().empty());
}

}  // namespace
}  // namespace tensorstash
