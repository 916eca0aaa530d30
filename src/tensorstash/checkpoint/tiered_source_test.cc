// TieredStepSource: a step read chunk by chunk from the cheapest holder with an intact copy.
// Fabricated holdings: a "local" and a "peer" holding of half the rows each, and a whole
// "persistent" step, all of one array of 8 x 6 floats in rows of 2; and a peer over HTTP.
#include "tensorstash/checkpoint/tiered_source.h"

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_test_util.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/kvstore/http/http_kvstore.h"
#include "tensorstash/kvstore/http/peer_server.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/util/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

const std::vector<int64_t> kShape = {8, 6};
constexpr uint64_t kSeed = 17;
constexpr char kStep[] = "0000000005";

Box Rows(int64_t first, int64_t count) { return Box({first, 0}, {count, kShape[1]}); }

// Writes a step holding the row blocks starting at `firsts` (2 rows each) into `kv`.
void WriteStepInto(KvStore* kv, const std::vector<int64_t>& firsts, bool holding) {
  std::vector<std::vector<char>> data;
  std::vector<ShardData> shards;
  for (int64_t first : firsts) {
    data.push_back(test::MakeBoxData(DType::kFloat32, kShape, kSeed, Rows(first, 2)));
  }
  for (size_t i = 0; i < firsts.size(); ++i) {
    ShardData shard;
    shard.box = Rows(firsts[i], 2);
    shard.data = data[i].data();
    shards.push_back(shard);
  }
  WriterOptions options;
  options.holding = holding;
  options.sync = false;
  std::unique_ptr<CheckpointWriter> writer = CheckpointWriter::Create(kv, kStep, options).value();
  TS_EXPECT_OK(writer->AddArray({"w", DType::kFloat32, kShape}, shards));
  TS_EXPECT_OK(writer->Commit());
}

std::unique_ptr<MemoryKvStore> WriteStep(const std::vector<int64_t>& firsts, bool holding) {
  auto kv = std::make_unique<MemoryKvStore>();
  WriteStepInto(kv.get(), firsts, holding);
  return kv;
}

// Flips one byte of every data file of the step in `kv`.
void Corrupt(MemoryKvStore* kv) {
  const std::vector<std::string> keys = kv->List(std::string(kStep) + "/").value();
  for (const std::string& key : keys) {
    if (key.find("/data/") == std::string::npos) continue;
    std::string bytes = kv->Read(key).value();
    bytes[bytes.size() / 2] ^= 0x40;
    TS_ASSERT_OK(kv->Write(key, bytes));
  }
}

struct Holdings {
  std::unique_ptr<MemoryKvStore> local = WriteStep({0, 2}, true);
  std::unique_ptr<MemoryKvStore> peer = WriteStep({4, 6}, true);
  std::unique_ptr<MemoryKvStore> persistent = WriteStep({0, 2, 4, 6}, false);

  std::unique_ptr<TieredStepSource> Open(bool with_persistent = true) {
    std::vector<StepHolder> holders;
    holders.push_back({Tier::kLocal, std::move(local), kStep, "local"});
    holders.push_back({Tier::kPeer, std::move(peer), kStep, "peer"});
    if (with_persistent) holders.push_back({Tier::kPersistent, std::move(persistent), kStep, ""});
    std::unique_ptr<TieredStepSource> source = TieredStepSource::Open(std::move(holders)).value();
    EXPECT_THAT(source->open_errors(), IsEmpty());
    return source;
  }
};

std::vector<char> ReadBox(TieredStepSource& source, const Box& box) {
  std::vector<char> out(static_cast<size_t>(box.num_elements()) * 4, '\x55');
  TS_EXPECT_OK(source.ReadMany({{"w", box, DType::kFloat32, out.data()}}, nullptr, nullptr));
  return out;
}

TEST(TieredStepSourceTest, EachChunkComesFromItsCheapestHolder) {
  Holdings holdings;
  std::unique_ptr<TieredStepSource> source = holdings.Open();
  // The whole array: rows 0-3 from local, 4-7 from the peer, nothing from persistent storage.
  EXPECT_EQ(ReadBox(*source, Box::FromShape(kShape)),
            test::MakeArrayData(DType::kFloat32, kShape, kSeed));
  const TierStats& stats = source->tier_stats();
  EXPECT_EQ(stats.bytes[0], 4u * 6 * 4);
  EXPECT_EQ(stats.bytes[1], 4u * 6 * 4);
  EXPECT_EQ(stats.bytes[2], 0u);
  EXPECT_THAT(stats.failures, IsEmpty());
  // A box across both holdings and past the shape: zeros there.
  const Box odd({3, 2}, {6, 5});
  EXPECT_EQ(ReadBox(*source, odd), test::MakeBoxData(DType::kFloat32, kShape, kSeed, odd));
}

TEST(TieredStepSourceTest, ACorruptLocalChunkIsReadFromTheNextHolder) {
  Holdings holdings;
  Corrupt(holdings.local.get());
  std::unique_ptr<TieredStepSource> source = holdings.Open();
  EXPECT_EQ(ReadBox(*source, Rows(0, 4)),
            test::MakeBoxData(DType::kFloat32, kShape, kSeed, Rows(0, 4)));
  const TierStats& stats = source->tier_stats();
  EXPECT_TRUE(stats.local_failed);
  EXPECT_THAT(stats.failures, Not(IsEmpty()));
  EXPECT_THAT(stats.failures.front(), HasSubstr("local"));
  EXPECT_GT(stats.bytes[2], 0u);  // from persistent storage: the peer does not hold rows 0-3
}

TEST(TieredStepSourceTest, AChunkNobodyHoldsIsDataLossNamingIt) {
  Holdings holdings;
  std::unique_ptr<TieredStepSource> source = holdings.Open(/*with_persistent=*/false);
  std::vector<char> out(8 * 6 * 4);
  // Rows 0-7 are held; corrupt the peer so that rows 4-7 have no intact copy.
  std::unique_ptr<MemoryKvStore> peer = WriteStep({4, 6}, true);
  Corrupt(peer.get());
  std::vector<StepHolder> holders;
  holders.push_back({Tier::kLocal, WriteStep({0, 2}, true), kStep, "local"});
  holders.push_back({Tier::kPeer, std::move(peer), kStep, "peer"});
  source = TieredStepSource::Open(std::move(holders)).value();
  const Status status = source->ReadMany(
      {{"w", Box::FromShape(kShape), DType::kFloat32, out.data()}}, nullptr, nullptr);
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr("array 'w'"));
  EXPECT_THAT(MessageOf(status), HasSubstr("peer"));
  // Only the local holding: rows 4-7 are held by nobody.
  holders.clear();
  holders.push_back({Tier::kLocal, WriteStep({0, 2}, true), kStep, "local"});
  source = TieredStepSource::Open(std::move(holders)).value();
  const Status missing =
      source->ReadMany({{"w", Rows(4, 2), DType::kFloat32, out.data()}}, nullptr, nullptr);
  EXPECT_TRUE(absl::IsDataLoss(missing)) << missing;
  EXPECT_THAT(MessageOf(missing), HasSubstr("held by none"));
}

TEST(TieredStepSourceTest, HoldersThatDoNotOpenOrDisagreeAreLeftOut) {
  std::vector<StepHolder> holders;
  holders.push_back({Tier::kLocal, std::make_unique<MemoryKvStore>(), kStep, "empty"});
  holders.push_back({Tier::kPeer, WriteStep({0, 2, 4, 6}, false), kStep, "peer"});
  std::unique_ptr<TieredStepSource> source = TieredStepSource::Open(std::move(holders)).value();
  ASSERT_EQ(source->open_errors().size(), 1u);
  EXPECT_THAT(source->open_errors()[0], HasSubstr("empty"));
  EXPECT_EQ(source->holders().size(), 1u);
  holders.clear();
  holders.push_back({Tier::kLocal, std::make_unique<MemoryKvStore>(), kStep, "empty"});
  EXPECT_TRUE(absl::IsNotFound(TieredStepSource::Open(std::move(holders)).status()));
}

TEST(TieredStepSourceTest, APeerOverHttpIsAHolderLikeAnyOther) {
  const std::string root = ::testing::TempDir() + "tiered_peer_" + std::to_string(::getpid());
  std::filesystem::remove_all(root);
  {
    std::unique_ptr<FileKvStore> files = FileKvStore::Open(root).value();
    WriteStepInto(files.get(), {4, 6}, true);
  }
  PeerServerOptions options;
  options.secret = "a-secret-of-sixteen-or-more";
  std::unique_ptr<PeerServer> server = PeerServer::Start(root, options).value();
  std::vector<StepHolder> holders;
  holders.push_back({Tier::kLocal, WriteStep({0, 2}, true), kStep, "local"});
  holders.push_back(
      {Tier::kPeer, HttpKvStore::Open(server->url(), options.secret).value(), kStep, ""});
  std::unique_ptr<TieredStepSource> source = TieredStepSource::Open(std::move(holders)).value();
  EXPECT_THAT(source->open_errors(), IsEmpty());
  EXPECT_EQ(ReadBox(*source, Box::FromShape(kShape)),
            test::MakeArrayData(DType::kFloat32, kShape, kSeed));
  EXPECT_EQ(source->tier_stats().bytes[1], 4u * 6 * 4);
  server.reset();
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace tensorstash
