// The Orbax writer under injected storage faults and simulated crashes, as the native writer is
// tested in checkpoint_fault_test.cc (issue 14: both publish through engine/publish.h). What
// must hold after every fault: the error reaches the caller naming the operation and key; a
// failed save leaves nothing new visible and an overwritten checkpoint as it was; nothing leaks;
// after a crash at any call, every checkpoint whose Commit returned OK restores bit for bit.
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/orbax_writer.h"
#include "tensorstash/testing/reliability_test_util.h"
#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/testing/fault_injection_kvstore.h"

namespace tensorstash {
namespace {

using test::StoreKind;
using ::testing::HasSubstr;

constexpr int64_t kRows = 48;
constexpr int64_t kCols = 40;

// Version `version` of the checkpoint: one float32 [kRows, kCols] array in 4 shards (4 chunks),
// and an int32 vector.
std::vector<float> Matrix(int version) {
  std::vector<float> m(kRows * kCols);
  for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<float>(version * 100000 + i);
  return m;
}
std::vector<int32_t> Vector(int version) { return {version, -version, 7, version * 3}; }

Status SaveVersion(KvStore* kv, const std::string& dir, int version, bool overwrite) {
  OrbaxWriterOptions options;
  options.overwrite = overwrite;
  options.io_threads = 2;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<OrbaxWriter> writer, OrbaxWriter::Create(kv, dir, options));
  const std::vector<float> m = Matrix(version);
  const std::vector<int32_t> v = Vector(version);
  std::vector<ShardData> shards;
  for (int64_t r = 0; r < kRows; r += kRows / 4) {
    shards.push_back({Box({r, 0}, {kRows / 4, kCols}), m.data() + r * kCols, 0, 1});
  }
  TS_RETURN_IF_ERROR(writer->AddArray({"w", DType::kFloat32, {kRows, kCols}}, std::move(shards)));
  TS_RETURN_IF_ERROR(
      writer->AddArray({"v", DType::kInt32, {4}}, {{Box({0}, {4}), v.data(), 0, 1}}));
  TreeNode root = TreeNode::Dict();
  root.entries.emplace_back("w", TreeNode::Array(0));
  root.entries.emplace_back("v", TreeNode::Array(1));
  writer->SetTree(std::move(root));
  return writer->Commit();
}

// OK and *found set when `dir` holds one of `versions` whole; the open or read error otherwise,
// or DataLoss when its bytes are none of them.
Status RestoreVersion(KvStore* kv, const std::string& dir, const std::set<int>& versions,
                      int* found) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<StepSource> source, OpenStepSource(kv, dir));
  std::vector<float> m(kRows * kCols);
  std::vector<int32_t> v(4);
  TS_RETURN_IF_ERROR(
      source->ReadMany({{"w", Box::FromShape({kRows, kCols}), DType::kFloat32, m.data()},
                        {"v", Box::FromShape({4}), DType::kInt32, v.data()}},
                       nullptr, nullptr));
  for (int version : versions) {
    if (m == Matrix(version) && v == Vector(version)) {
      *found = version;
      return OkStatus();
    }
  }
  return DataLossError(StrCat(dir, " holds none of the saved versions"));
}

uint64_t TestSeed() {
  if (const char* env = std::getenv("TS_FAULT_SEED")) return std::strtoull(env, nullptr, 10);
  return std::random_device()();
}

class OrbaxWriterFaultTest : public test::TempDirTest,
                             public ::testing::WithParamInterface<StoreKind> {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    base_ = test::MakeStore(GetParam(), temp_dir() + "/root").value();
    seed_ = TestSeed();
    std::cout << "[ seed     ] TS_FAULT_SEED=" << seed_ << "\n";
    rng_.seed(seed_);
    kv_ = std::make_unique<FaultInjectionKvStore>(base_.get(), seed_);
  }
  void TearDown() override {
    kv_.reset();
    base_.reset();
    test::TempDirTest::TearDown();
  }

  void ExpectCommittedIntact() {
    for (const auto& [dir, version] : committed_) {
      int found = -1;
      Status restored = RestoreVersion(kv_.get(), dir, {version}, &found);
      EXPECT_EQ(OkStatus(), restored) << "committed checkpoint " << dir;
    }
    // Nothing but committed checkpoints (and leftovers named as temporaries) at the top.
    for (const std::string& folder : test::TopFolders(kv_.get(), "")) {
      if (committed_.count(folder) == 0) {
        EXPECT_THAT(folder, HasSubstr(".orbax-checkpoint-tmp")) << "visible after a failure";
      }
    }
  }

  std::unique_ptr<KvStore> base_;
  std::unique_ptr<FaultInjectionKvStore> kv_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  std::map<std::string, int> committed_;  // checkpoint folder -> the version it holds
};

TEST_P(OrbaxWriterFaultTest, InjectedErrorsReachTheCallerAndLeaveNothingNewVisible) {
  TS_ASSERT_OK(SaveVersion(kv_.get(), "ckpt_a", 0, false));
  committed_["ckpt_a"] = 0;
  std::map<KvOp, int64_t> before, profile;
  for (int i = 0; i < kNumKvOps; ++i)
    before[static_cast<KvOp>(i)] = kv_->calls(Mask(static_cast<KvOp>(i)));
  TS_ASSERT_OK(SaveVersion(kv_.get(), "ckpt_a", 1, /*overwrite=*/true));
  committed_["ckpt_a"] = 1;
  for (const auto& [op, n] : before) {
    if (kv_->calls(Mask(op)) > n) profile[op] = kv_->calls(Mask(op)) - n;
  }
  std::vector<std::pair<KvOp, int64_t>> ops(profile.begin(), profile.end());
  ASSERT_FALSE(ops.empty());
  const int fds = test::CountProcEntries("fd");
  const int threads = test::CountThreads();
  int failed = 0;
  for (int iteration = 0; iteration < 50; ++iteration) {
    const auto [op, count] = ops[rng_() % ops.size()];
    FaultRule rule;
    rule.ops = Mask(op);
    rule.kind = std::vector<FaultKind>{FaultKind::kIoError, FaultKind::kNoSpace,
                                       FaultKind::kShortWrite}[rng_() % 3];
    rule.nth = 1 + static_cast<int64_t>(rng_() % static_cast<uint64_t>(count));
    const bool overwrite = rng_() % 2 == 0;
    const std::string dir = overwrite ? "ckpt_a" : StrCat("ckpt_", iteration);
    const int version = iteration + 2;
    SCOPED_TRACE(StrCat("seed ", seed_, " iteration ", iteration, ": ", KvOpName(op), " call ",
                        rule.nth, " of ", count, overwrite ? " (overwrite)" : ""));
    const size_t logged = kv_->fault_log().size();
    kv_->AddRule(rule);
    const Status saved = SaveVersion(kv_.get(), dir, version, overwrite);
    kv_->ClearRules();
    if (saved.ok()) {
      committed_[dir] = version;  // the fault missed, or hit a best-effort removal
    } else {
      ++failed;
      const std::vector<std::string> log = kv_->fault_log();
      ASSERT_EQ(log.size(), logged + 1) << "failed without an injected fault: " << saved;
      EXPECT_THAT(saved.message(), HasSubstr(log.back())) << saved;
      // Nothing new is visible: an overwritten checkpoint holds its old version; a new one is
      // not there at all.
      if (!overwrite) {
        EXPECT_FALSE(OpenStepSource(kv_.get(), dir).ok()) << dir << " is visible after " << saved;
      }
    }
    ExpectCommittedIntact();
    EXPECT_EQ(test::CountProcEntries("fd"), fds) << "file descriptors leaked";
    EXPECT_LE(test::CountThreadsSettled(threads), threads) << "threads leaked";
    if (HasFailure()) break;
  }
  EXPECT_GT(failed, 10) << "too few faults hit a save to test anything";
}

TEST_P(OrbaxWriterFaultTest, CrashAtAnyPointKeepsEveryCommittedCheckpoint) {
  TS_ASSERT_OK(kv_->StartDurabilityTracking(DurabilityModel::kPosix));
  TS_ASSERT_OK(SaveVersion(kv_.get(), "ckpt_a", 0, false));
  committed_["ckpt_a"] = 0;
  TS_ASSERT_OK(kv_->SimulateCrash());  // a Commit that returned OK survives a crash at once
  ExpectCommittedIntact();
  const int64_t calls_before = kv_->calls(kAllKvOps);
  TS_ASSERT_OK(SaveVersion(kv_.get(), "ckpt_b", 0, false));
  committed_["ckpt_b"] = 0;
  const int64_t total = kv_->calls(kAllKvOps) - calls_before;
  int crashed = 0;
  for (int iteration = 0; iteration < 40; ++iteration) {
    const bool overwrite = rng_() % 2 == 0;
    const std::string dir =
        overwrite ? (rng_() % 2 ? "ckpt_a" : "ckpt_b") : StrCat("new_", iteration);
    const int version = iteration + 1;
    FaultRule rule;
    rule.kind = FaultKind::kCrash;
    rule.nth = 1 + static_cast<int64_t>(rng_() % static_cast<uint64_t>(total + total / 8));
    SCOPED_TRACE(StrCat("seed ", seed_, " iteration ", iteration, ": crash at call ", rule.nth,
                        " of about ", total, overwrite ? " (overwrite)" : ""));
    kv_->AddRule(rule);
    const Status saved = SaveVersion(kv_.get(), dir, version, overwrite);
    kv_->ClearRules();
    if (kv_->crashed()) ++crashed;
    TS_ASSERT_OK(kv_->SimulateCrash());
    if (saved.ok()) {
      committed_[dir] = version;
    } else if (committed_.count(dir) != 0) {
      // A crash during an overwrite: the old version or the new one, whole.
      int found = -1;
      const Status restored = RestoreVersion(kv_.get(), dir, {committed_[dir], version}, &found);
      if (restored.ok()) {
        committed_[dir] = found;
      } else {
        // Between the two renames of an overwrite (stores without exchange): the old one is
        // under its aside name until the next save of it rolls it back; never damaged data.
        EXPECT_FALSE(absl::IsDataLoss(restored)) << restored;
        committed_.erase(dir);
      }
    }
    ExpectCommittedIntact();
    if (HasFailure()) break;
  }
  EXPECT_GT(crashed, 10) << "too few crashes hit a save to test anything";
}

INSTANTIATE_TEST_SUITE_P(Backends, OrbaxWriterFaultTest,
                         ::testing::Values(StoreKind::kFile, StoreKind::kMemory),
                         [](const ::testing::TestParamInfo<StoreKind>& param_info) {
                           return test::StoreName(param_info.param);
                         });

}  // namespace
}  // namespace tensorstash
