// TieredStepSource: a step read chunk by chunk from the cheapest holder with an intact copy.
// Fabricated holdings: a "local" and a "peer" holding of half the rows each, and a whole
// "persistent" step, all of one array of 8 x 6 floats in rows of 2; and a peer over HTTP.
#include "tensorstash/tiers/tiered_source.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/http/http_kvstore.h"
#include "tensorstash/kvstore/http/peer_server.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

const std::vector<int64_t> kShape = {8, 6};
constexpr uint64_t kSeed = 17;
constexpr char kStep[] = "0000000005";

Box Rows(int64_t first, int64_t count, const std::vector<int64_t>& shape = kShape) {
  return Box({first, 0}, {count, shape[1]});
}

// Writes a step of array "w" of `shape` holding the blocks of `rows` rows starting at `firsts`
// into `kv`.
void WriteStepInto(KvStore* kv, const std::vector<int64_t>& firsts, bool holding,
                   const std::vector<int64_t>& shape = kShape, int64_t rows = 2) {
  std::vector<std::vector<char>> data;
  std::vector<ShardData> shards;
  for (int64_t first : firsts) {
    data.push_back(test::MakeBoxData(DType::kFloat32, shape, kSeed, Rows(first, rows, shape)));
  }
  for (size_t i = 0; i < firsts.size(); ++i) {
    ShardData shard;
    shard.box = Rows(firsts[i], rows, shape);
    shard.data = data[i].data();
    shards.push_back(shard);
  }
  WriterOptions options;
  options.holding = holding;
  options.sync = false;
  std::unique_ptr<CheckpointWriter> writer = CheckpointWriter::Create(kv, kStep, options).value();
  TS_EXPECT_OK(writer->AddArray({"w", DType::kFloat32, shape}, shards));
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
    bytes[0] ^= 0x40;  // a byte of the file's first chunk (padding may follow a chunk)
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

// A peer that accepts one connection at a time and, for every request, either sends the
// headers and a few bytes of a larger body and hangs up (dies mid-transfer) or never answers.
class BrokenPeer {
 public:
  enum class Mode { kHangUpMidBody, kSilent };
  explicit BrokenPeer(Mode mode) : mode_(mode) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    EXPECT_EQ(::listen(listener_, 8), 0);
    socklen_t length = sizeof(address);
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~BrokenPeer() {
    stop_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    ::close(listener_);
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

 private:
  void Serve() {
    while (!stop_) {
      const int connection = ::accept(listener_, nullptr, nullptr);
      if (connection < 0) return;
      char request[4096];
      if (::recv(connection, request, sizeof(request), 0) > 0 && mode_ == Mode::kHangUpMidBody) {
        const std::string head =
            "HTTP/1.1 206 Partial Content\r\nContent-Length: 100000\r\n"
            "Content-Range: bytes 0-99999/100000\r\n\r\n0123456789";
        ::send(connection, head.data(), head.size(), MSG_NOSIGNAL);
      } else if (mode_ == Mode::kSilent) {
        for (int i = 0; i < 50 && !stop_; ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      ::close(connection);
    }
  }
  Mode mode_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A holding whose metadata reads fine but whose data files are read from `broken`: a peer that
// answered while the step was opened and then died or stalled.
class DataFromBrokenPeer final : public ForwardingKvStore {
 public:
  DataFromBrokenPeer(std::unique_ptr<KvStore> good, std::unique_ptr<KvStore> broken)
      : ForwardingKvStore(good.get()), good_(std::move(good)), broken_(std::move(broken)) {}
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override {
    if (key.find("/data/") != std::string_view::npos) {
      return broken_->ReadRange(key, offset, size, dest);
    }
    return good_->ReadRange(key, offset, size, dest);
  }
  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override {
    if (key.find("/data/") == std::string_view::npos) return good_->OpenForRead(key);
    TS_ASSIGN_OR_RETURN(uint64_t size, good_->Size(key));
    return RangeReadableFile(this, std::string(key), size);
  }

 private:
  std::unique_ptr<KvStore> good_;
  std::unique_ptr<KvStore> broken_;
};

TEST(TieredStepSourceTest, APeerThatDiesOrStallsMidTransferIsLeftForTheNextHolder) {
  for (BrokenPeer::Mode mode : {BrokenPeer::Mode::kHangUpMidBody, BrokenPeer::Mode::kSilent}) {
    SCOPED_TRACE(mode == BrokenPeer::Mode::kSilent ? "silent" : "hangs up");
    BrokenPeer broken(mode);
    HttpKvStoreOptions options;
    options.stall_timeout = std::chrono::seconds(1);
    std::vector<StepHolder> holders;
    holders.push_back(
        {Tier::kPeer,
         std::make_unique<DataFromBrokenPeer>(
             WriteStep({0, 2, 4, 6}, true),
             HttpKvStore::Open(broken.url(), "a-secret-of-sixteen-or-more", options).value()),
         kStep, "peer"});
    holders.push_back({Tier::kPersistent, WriteStep({0, 2, 4, 6}, false), kStep, "persistent"});
    std::unique_ptr<TieredStepSource> source = TieredStepSource::Open(std::move(holders)).value();
    const auto started = std::chrono::steady_clock::now();
    EXPECT_EQ(ReadBox(*source, Box::FromShape(kShape)),
              test::MakeArrayData(DType::kFloat32, kShape, kSeed));
    // Within a few stall timeouts (the whole read, then each piece, may wait for one).
    EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(15));
    const TierStats& stats = source->tier_stats();
    ASSERT_THAT(stats.failures, Not(IsEmpty()));
    EXPECT_THAT(stats.failures.front(), HasSubstr(broken.url()));
    EXPECT_EQ(stats.bytes[2], 8u * 6 * 4);
  }
}

TEST(TieredStepSourceTest, LocalHoldingsAreMappedOthersAreRead) {
  // Mapping needs files: the local holding in a folder, with chunks of at least 1 MiB.
  const std::string root = ::testing::TempDir() + "tiered_map_" + std::to_string(::getpid());
  std::filesystem::remove_all(root);
  const std::vector<int64_t> shape = {1024, 1024};  // 4 MiB, two chunks of rows
  const auto data = test::MakeArrayData(DType::kFloat32, shape, kSeed);
  std::vector<StepHolder> holders;
  {
    std::unique_ptr<FileKvStore> local = FileKvStore::Open(root).value();
    WriteStepInto(local.get(), {0}, true, shape, 512);
    holders.push_back({Tier::kLocal, std::move(local), kStep, "local"});
  }
  auto persistent = std::make_unique<MemoryKvStore>();
  WriteStepInto(persistent.get(), {0, 512}, false, shape, 512);
  holders.push_back({Tier::kPersistent, std::move(persistent), kStep, "persistent"});
  std::unique_ptr<TieredStepSource> source = TieredStepSource::Open(std::move(holders)).value();
  const Box top({0, 0}, {512, 1024}), bottom({512, 0}, {512, 1024});
  std::vector<Result<MappedBox>> mapped = source->MapMany(
      {{"w", top, DType::kFloat32, nullptr}, {"w", bottom, DType::kFloat32, nullptr}}, {});
  ASSERT_EQ(mapped.size(), 2u);
  TS_ASSERT_OK(mapped[0].status());
  EXPECT_EQ(std::memcmp(mapped[0]->data(), data.data(), mapped[0]->size()), 0);
  EXPECT_TRUE(absl::IsUnimplemented(mapped[1].status())) << mapped[1].status();
  EXPECT_EQ(source->tier_stats().bytes[0], 512u * 1024 * 4);
  std::filesystem::remove_all(root);
}

TEST(TieredStepSourceTest, TheMappingBudgetIsOneForAllLocalHoldings) {
  // This node may hold several holdings of a save (its own and a replica): each half of the rows
  // in a folder of its own. A budget of one mapping maps one half, not one per holding.
  const std::string root = ::testing::TempDir() + "tiered_budget_" + std::to_string(::getpid());
  std::filesystem::remove_all(root);
  const std::vector<int64_t> shape = {1024, 1024};
  std::vector<StepHolder> holders;
  for (int64_t first : {0, 512}) {
    std::unique_ptr<FileKvStore> local =
        FileKvStore::Open(root + "/" + std::to_string(first)).value();
    WriteStepInto(local.get(), {first}, true, shape, 512);
    holders.push_back({Tier::kLocal, std::move(local), kStep, "local"});
  }
  std::unique_ptr<TieredStepSource> source = TieredStepSource::Open(std::move(holders)).value();
  const Box top({0, 0}, {512, 1024}), bottom({512, 0}, {512, 1024});
  MapOptions options;
  options.max_mappings = 1;
  uint64_t made = 0;
  options.mappings_made = &made;
  std::vector<Result<MappedBox>> mapped = source->MapMany(
      {{"w", top, DType::kFloat32, nullptr}, {"w", bottom, DType::kFloat32, nullptr}}, options);
  ASSERT_EQ(mapped.size(), 2u);
  EXPECT_EQ(mapped[0].ok() + mapped[1].ok(), 1) << mapped[0].status() << mapped[1].status();
  EXPECT_EQ(made, 1u);
  // What was not mapped is read, from its holding.
  const auto data = test::MakeArrayData(DType::kFloat32, shape, kSeed);
  EXPECT_EQ(ReadBox(*source, Box::FromShape(shape)), data);
  std::filesystem::remove_all(root);
}

TEST(TieredStepSourceTest, HoldersMayListTheArraysInAnotherOrder) {
  // Two arrays, "a" and "b", of the same rows; the holdings add them in opposite orders.
  auto write = [](const std::vector<std::string>& order, int64_t first) {
    auto kv = std::make_unique<MemoryKvStore>();
    std::vector<std::vector<char>> data;
    WriterOptions options;
    options.holding = true;
    options.sync = false;
    std::unique_ptr<CheckpointWriter> writer =
        CheckpointWriter::Create(kv.get(), kStep, options).value();
    for (const std::string& path : order) {
      data.push_back(
          test::MakeBoxData(DType::kFloat32, kShape, path == "a" ? 1 : 2, Rows(first, 4)));
      ShardData shard;
      shard.box = Rows(first, 4);
      shard.data = data.back().data();
      TS_EXPECT_OK(writer->AddArray({path, DType::kFloat32, kShape}, {shard}));
    }
    TS_EXPECT_OK(writer->Commit());
    return kv;
  };
  std::vector<StepHolder> holders;
  holders.push_back({Tier::kLocal, write({"a", "b"}, 0), kStep, "local"});
  holders.push_back({Tier::kPeer, write({"b", "a"}, 4), kStep, "peer"});
  std::unique_ptr<TieredStepSource> source = TieredStepSource::Open(std::move(holders)).value();
  EXPECT_THAT(source->open_errors(), IsEmpty());
  for (const char* path : {"a", "b"}) {
    std::vector<char> out(8 * 6 * 4);
    TS_ASSERT_OK(source->ReadMany({{path, Box::FromShape(kShape), DType::kFloat32, out.data()}},
                                  nullptr, nullptr));
    EXPECT_EQ(out, test::MakeArrayData(DType::kFloat32, kShape, path[0] == 'a' ? 1 : 2)) << path;
  }
  EXPECT_EQ(source->tier_stats().bytes[1], 2u * 4 * 6 * 4);  // rows 4-7 of both, from the peer
}

}  // namespace
}  // namespace tensorstash
