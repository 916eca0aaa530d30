// SharedStepSource and the peer server's /v1/shared routes: processes as threads over one
// in-memory store and an in-process coordinator, each with its own peer server on loopback.
#include "tensorstash/share/peer/shared_source.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/http/http_client.h"
#include "tensorstash/kvstore/http/peer_server.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/testing/in_process_coordinator.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::AllOf;
using ::testing::Each;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

const std::vector<int64_t> kShape = {8, 6};
constexpr uint64_t kSeed = 5;
constexpr char kStep[] = "0000000003";

Box Rows(int64_t first, int64_t count) { return Box({first, 0}, {count, kShape[1]}); }

// A step of array "w" (8 x 6 float32, chunks of 2 rows) and array "b" (zstd, 8 x 6 in chunks of
// 4 rows) in a memory store.
void WriteStepInto(KvStore* kv);

std::unique_ptr<MemoryKvStore> WriteStep() {
  auto kv = std::make_unique<MemoryKvStore>();
  WriteStepInto(kv.get());
  return kv;
}

// A memory store without rename that says it is an object store: steps commit by record into
// an attempt folder (engine/object_store_commit.h).
class ObjectStoreLike final : public ForwardingKvStore {
 public:
  using ForwardingKvStore::ForwardingKvStore;
  KvStoreCapabilities Capabilities() const override {
    KvStoreCapabilities caps = ForwardingKvStore::Capabilities();
    caps.object_store = true;
    caps.conditional_write = true;
    return caps;
  }
};

void WriteStepInto(KvStore* kv) {
  const std::vector<char> data = test::MakeBoxData(DType::kFloat32, kShape, kSeed, Rows(0, 8));
  std::vector<ShardData> shards;
  for (int64_t first = 0; first < 8; first += 2) {
    ShardData shard;
    shard.box = Rows(first, 2);
    shard.data = data.data() + first * kShape[1] * 4;
    shards.push_back(shard);
  }
  WriterOptions options;
  options.sync = false;
  std::unique_ptr<CheckpointWriter> writer = CheckpointWriter::Create(kv, kStep, options).value();
  TS_EXPECT_OK(writer->AddArray({"w", DType::kFloat32, kShape}, shards));
  ArraySpec b{"b", DType::kFloat32, kShape};
  b.codec = Codec::kZstd;
  b.target_chunk_bytes = 96;
  ShardData whole;
  whole.box = Rows(0, 8);
  whole.data = data.data();
  TS_EXPECT_OK(writer->AddArray(b, {whole}));
  TS_EXPECT_OK(writer->Commit());
}

uint64_t StoredDataBytes(KvStore* kv) {
  auto source = SharedStepSource::Open(kv, kStep, {}, nullptr, {}).value();
  return source->StoredBytes(0) + source->StoredBytes(1);
}

struct ProcessResult {
  Status status = OkStatus();
  Status finish = OkStatus();
  std::vector<std::vector<char>> data;  // per request
  ShareStats stats;
};

// A process's coordinator, given the one it would have (which outlives it).
using CoordinatorOf = std::function<std::unique_ptr<Coordinator>(int, Coordinator*)>;

// Process p reads boxes[p] of both arrays; `tweak` adjusts its options, `store_of` (when set)
// gives its store, `coordinator_of` (when set) its coordinator.
std::vector<ProcessResult> RunJob(KvStore* kv, const std::vector<std::vector<Box>>& boxes,
                                  const std::function<void(int, ShareOptions&)>& tweak = nullptr,
                                  int dead = -1,
                                  const std::function<KvStore*(int)>& store_of = nullptr,
                                  const std::function<void(int)>& read_done = nullptr,
                                  const CoordinatorOf& coordinator_of = nullptr) {
  const int n = static_cast<int>(boxes.size());
  auto group = std::make_shared<InProcessCoordinatorGroup>(n);
  std::vector<ProcessResult> results(n);
  std::vector<std::thread> threads;
  for (int p = 0; p < n; ++p) {
    threads.emplace_back([&, p] {
      InProcessCoordinator in_process(group, p);
      std::unique_ptr<Coordinator> wrapped =
          coordinator_of ? coordinator_of(p, &in_process) : nullptr;
      Coordinator& coordinator = wrapped ? *wrapped : in_process;
      ShareOptions share;
      share.key_prefix = "test/";
      share.timeout = std::chrono::milliseconds(3000);
      if (tweak) tweak(p, share);
      ProcessResult& r = results[p];
      Result<std::unique_ptr<SharedStepSource>> source =
          SharedStepSource::Open(store_of ? store_of(p) : kv, kStep, {}, &coordinator, share);
      if (!source.ok()) {
        r.status = source.status();
        return;
      }
      std::vector<ReadRequest> requests;
      for (const std::string path : {"w", "b"}) {
        for (const Box& box : boxes[p]) {
          r.data.emplace_back(box.num_elements() * 4);
          requests.push_back({path, box, DType::kFloat32, r.data.back().data()});
        }
      }
      r.status = (*source)->Share(requests);
      // A process that dies once it has agreed: its server goes, its chunks are never served.
      if (p == dead || !r.status.ok()) {
        if (p == dead && read_done) read_done(p);
        return;
      }
      r.status = (*source)->ReadMany(requests, nullptr, nullptr);
      if (read_done) read_done(p);
      r.finish = (*source)->Finish();
      r.stats = (*source)->share_stats();
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

void ExpectExact(const ProcessResult& r, const std::vector<Box>& boxes) {
  ASSERT_THAT(r.data, SizeIs(2 * boxes.size()));
  for (size_t i = 0; i < r.data.size(); ++i) {
    const std::vector<char> expected =
        test::MakeBoxData(DType::kFloat32, kShape, kSeed, boxes[i % boxes.size()]);
    EXPECT_EQ(r.data[i], expected) << "request " << i;
  }
}

TEST(SharedStepSource, ReplicasReadEveryStoredByteOnceBetweenThem) {
  auto kv = WriteStep();
  const std::vector<std::vector<Box>> boxes(3, {Rows(0, 8)});
  const std::vector<ProcessResult> results = RunJob(kv.get(), boxes);
  uint64_t storage = 0, peer = 0;
  for (int p = 0; p < 3; ++p) {
    TS_ASSERT_OK(results[p].status);
    TS_EXPECT_OK(results[p].finish);
    ExpectExact(results[p], boxes[p]);
    EXPECT_TRUE(results[p].stats.active);
    EXPECT_THAT(results[p].stats.fallbacks, IsEmpty());
    EXPECT_GT(results[p].stats.storage_bytes, 0u) << "the reads are spread over the processes";
    storage += results[p].stats.storage_bytes;
    peer += results[p].stats.peer_bytes;
  }
  EXPECT_EQ(storage, StoredDataBytes(kv.get()));
  EXPECT_EQ(peer, 2 * StoredDataBytes(kv.get()));
}

TEST(SharedStepSource, AStepCommittedByRecordIsSharedToo) {
  MemoryKvStore memory(/*supports_rename=*/false);
  ObjectStoreLike kv(&memory);
  WriteStepInto(&kv);
  ASSERT_THAT(memory.List("").value(), testing::Contains(HasSubstr("/attempt-")));
  const std::vector<std::vector<Box>> boxes(2, {Rows(0, 8)});
  const std::vector<ProcessResult> results = RunJob(&kv, boxes);
  uint64_t storage = 0;
  for (int p = 0; p < 2; ++p) {
    TS_ASSERT_OK(results[p].status);
    ExpectExact(results[p], boxes[p]);
    EXPECT_THAT(results[p].stats.fallbacks, IsEmpty());
    EXPECT_GT(results[p].stats.peer_bytes, 0u);
    storage += results[p].stats.storage_bytes;
  }
  EXPECT_EQ(storage, StoredDataBytes(&kv));
}

TEST(SharedStepSource, UnevenOverlappingBoxesShareTheChunksTheyHaveInCommon) {
  auto kv = WriteStep();
  const std::vector<std::vector<Box>> boxes = {
      {Rows(0, 5)}, {Rows(3, 5)}, {Rows(1, 6), Rows(7, 1)}, {Rows(6, 2)}};
  const std::vector<ProcessResult> results = RunJob(kv.get(), boxes);
  uint64_t storage = 0;
  for (int p = 0; p < 4; ++p) {
    TS_ASSERT_OK(results[p].status);
    ExpectExact(results[p], boxes[p]);
    EXPECT_THAT(results[p].stats.fallbacks, IsEmpty());
    storage += results[p].stats.storage_bytes;
  }
  EXPECT_EQ(storage, StoredDataBytes(kv.get()));
}

// A coordinator that publishes, instead of this process's peer server ("<prefix>peer/<p>"),
// `fake`'s address and secret; everything else goes to `inner`.
class PeerSwappingCoordinator final : public Coordinator {
 public:
  PeerSwappingCoordinator(Coordinator* inner, std::string fake) : inner_(inner), fake_(fake) {}
  int process_index() const override { return inner_->process_index(); }
  int process_count() const override { return inner_->process_count(); }
  Status Barrier(std::string_view name, std::chrono::milliseconds timeout) override {
    return inner_->Barrier(name, timeout);
  }
  Status KeyValueSet(std::string_view key, std::string_view value) override {
    const bool peer = key.ends_with("peer/" + std::to_string(process_index()));
    return inner_->KeyValueSet(key, peer ? std::string_view(fake_) : value);
  }
  Result<std::string> KeyValueGet(std::string_view key,
                                  std::chrono::milliseconds timeout) override {
    return inner_->KeyValueGet(key, timeout);
  }
  Result<std::optional<std::string>> KeyValueTryGet(std::string_view key) override {
    return inner_->KeyValueTryGet(key);
  }

 private:
  Coordinator* inner_;
  std::string fake_;
};

// A peer server that serves every stored chunk of the step under its /v1/shared/ name, one
// byte flipped: what a process with bad memory or a bad link would send.
std::unique_ptr<PeerServer> CorruptPeer(KvStore* kv, PeerServerOptions options) {
  std::unique_ptr<PeerServer> server = PeerServer::Start("", options).value();
  std::unique_ptr<CheckpointReader> reader = CheckpointReader::Open(kv, kStep, {}).value();
  for (const IndexEntry& e : reader->index().entries) {
    auto bytes = std::make_shared<std::string>(e.length, '\0');
    EXPECT_TRUE(kv->ReadRange(reader->DataFileKey(e.file_id), e.offset, e.length, bytes->data())
                    .ok());
    (*bytes)[bytes->size() / 2] ^= 0x5a;
    server->Publish(std::to_string(e.array_id) + "/" + std::to_string(e.chunk), bytes);
  }
  return server;
}

TEST(SharedStepSource, ACorruptPeerIsCaughtAndItsChunksReadFromStorage) {
  auto kv = WriteStep();
  PeerServerOptions fake;
  fake.secret = "0123456789abcdef0123456789abcdef";
  std::unique_ptr<PeerServer> corrupt = CorruptPeer(kv.get(), fake);
  const std::vector<std::vector<Box>> boxes(3, {Rows(0, 8)});
  // Process 1 publishes the corrupt server as its own: the others receive its chunks from it.
  // (Its own server is then never asked: its Finish waits out its short timeout.)
  const std::vector<ProcessResult> results = RunJob(
      kv.get(), boxes,
      [](int p, ShareOptions& o) {
        if (p == 1) o.timeout = std::chrono::milliseconds(500);
      },
      -1, nullptr, nullptr,
      [&](int p, Coordinator* inner) -> std::unique_ptr<Coordinator> {
        if (p != 1) return nullptr;
        return std::make_unique<PeerSwappingCoordinator>(
            inner, corrupt->url() + " " + fake.secret);
      });
  for (int p = 0; p < 3; ++p) {
    TS_ASSERT_OK(results[p].status);
    ExpectExact(results[p], boxes[p]);
  }
  ASSERT_GT(results[1].stats.served_chunks, 0u);
  for (int p : {0, 2}) {
    EXPECT_EQ(results[p].stats.fallback_chunks, results[1].stats.served_chunks);
    EXPECT_THAT(results[p].stats.fallbacks,
                Each(AllOf(HasSubstr("process 1"), HasSubstr("CRC-32C mismatch"),
                           HasSubstr("read from storage"))));
  }
}

// A store whose ReadRange (the pump's reads) waits until Release().
class StallingKvStore final : public ForwardingKvStore {
 public:
  using ForwardingKvStore::ForwardingKvStore;
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return released_; });
    return ForwardingKvStore::ReadRange(key, offset, size, dest);
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
};

TEST(SharedStepSource, AProcessThatDiesAfterTheAgreementCostsItsChunksNotTheRestore) {
  auto kv = WriteStep();
  // Process 2 agrees, serves nothing (its pump stalls), then goes while the others wait.
  StallingKvStore stalling(kv.get());
  std::atomic<bool> dying{false};
  std::thread releaser([&] {
    while (!dying.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    stalling.Release();
  });
  const std::vector<std::vector<Box>> boxes(3, {Rows(0, 8)});
  const auto start = std::chrono::steady_clock::now();
  const std::vector<ProcessResult> results = RunJob(
      kv.get(), boxes, nullptr, /*dead=*/2,
      [&](int p) -> KvStore* { return p == 2 ? static_cast<KvStore*>(&stalling) : kv.get(); },
      [&](int p) {
        if (p == 2) dying = true;
      });
  releaser.join();
  for (int p : {0, 1}) {
    TS_ASSERT_OK(results[p].status);
    ExpectExact(results[p], boxes[p]);
    EXPECT_GT(results[p].stats.fallback_chunks, 0u);
    EXPECT_THAT(results[p].stats.fallbacks, Each(HasSubstr("process 2")));
    // Process 2 never asks for what they serve it.
    EXPECT_THAT(std::string(results[p].finish.message()), HasSubstr("not fetched"));
  }
  // Bounded by the timeouts (3 s each for the wait of Finish), not a hang.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
}

TEST(SharedStepSource, AStalledPeerCostsOneTimeoutThenItsChunksComeFromStorage) {
  auto kv = WriteStep();
  StallingKvStore stalling(kv.get());
  const std::vector<std::vector<Box>> boxes(3, {Rows(0, 8)});
  // Process 2's pump stalls until the others are done.
  std::atomic<int> finished{0};
  std::thread releaser([&] {
    while (finished.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    stalling.Release();
  });
  const std::vector<ProcessResult> results = RunJob(
      kv.get(), boxes,
      [&](int p, ShareOptions& o) {
        o.timeout = std::chrono::milliseconds(p == 2 ? 500 : 1500);
      },
      -1,
      [&](int p) -> KvStore* {
        return p == 2 ? static_cast<KvStore*>(&stalling) : kv.get();
      },
      [&](int p) {
        if (p != 2) ++finished;
      });
  releaser.join();
  for (int p = 0; p < 3; ++p) {
    TS_ASSERT_OK(results[p].status);
    ExpectExact(results[p], boxes[p]);
  }
  for (int p : {0, 1}) {
    ASSERT_GT(results[p].stats.fallback_chunks, 0u);
    EXPECT_THAT(results[p].stats.fallbacks,
                Each(AllOf(HasSubstr("process 2"), HasSubstr("read from storage"))));
    EXPECT_THAT(results[p].stats.fallbacks[0], HasSubstr("within 1500 ms"));
  }
}

// A store that counts the ReadRange calls (the pump's requests) on the step's data files.
class CountingKvStore final : public ForwardingKvStore {
 public:
  CountingKvStore(KvStore* base, std::set<std::string> data_keys)
      : ForwardingKvStore(base), data_keys_(std::move(data_keys)) {}
  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override {
    if (data_keys_.contains(std::string(key))) ++requests;
    return ForwardingKvStore::ReadRange(key, offset, size, dest);
  }
  std::atomic<int> requests{0};

 private:
  std::set<std::string> data_keys_;
};

std::set<std::string> DataKeys(KvStore* kv) {
  std::unique_ptr<CheckpointReader> reader = CheckpointReader::Open(kv, kStep, {}).value();
  std::set<std::string> keys;
  for (uint32_t f = 0; f < reader->index().files.size(); ++f) keys.insert(reader->DataFileKey(f));
  return keys;
}

std::string Layout(KvStore* kv) {
  std::unique_ptr<CheckpointReader> reader = CheckpointReader::Open(kv, kStep, {}).value();
  std::string out;
  for (const IndexEntry& e : reader->index().entries) {
    out += std::to_string(e.array_id) + "/" + std::to_string(e.chunk) + " file " +
           std::to_string(e.file_id) + " @" + std::to_string(e.offset) + "+" +
           std::to_string(e.length) + "; ";
  }
  return out;
}

TEST(SharedStepSource, TheServerReadsNeighbouringChunksInOneRequest) {
  auto kv = WriteStep();
  const std::set<std::string> keys = DataKeys(kv.get());
  // Two replicas: each serves a run of neighbouring chunks of "w" (4 chunks of 48 bytes, 64
  // bytes apart in one data file: alignment) and of "b". With a cap of 1 byte, one request per
  // chunk.
  for (const uint64_t cap : {uint64_t{32} << 20, uint64_t{1}}) {
    SCOPED_TRACE(cap);
    std::vector<std::unique_ptr<CountingKvStore>> stores;
    for (int p = 0; p < 2; ++p) stores.push_back(std::make_unique<CountingKvStore>(kv.get(), keys));
    const std::vector<std::vector<Box>> boxes(2, {Rows(0, 8)});
    // (RunJob opens with default ReaderOptions; the cap is a ReaderOptions field.)
    auto group = std::make_shared<InProcessCoordinatorGroup>(2);
    std::vector<ProcessResult> results(2);
    std::vector<std::thread> threads;
    for (int p = 0; p < 2; ++p) {
      threads.emplace_back([&, p] {
        InProcessCoordinator coordinator(group, p);
        ShareOptions share;
        share.key_prefix = "count/";
        share.timeout = std::chrono::milliseconds(3000);
        ReaderOptions options;
        options.max_request_bytes = cap;
        auto source =
            SharedStepSource::Open(stores[p].get(), kStep, options, &coordinator, share).value();
        ProcessResult& r = results[p];
        std::vector<ReadRequest> requests;
        for (const std::string path : {"w", "b"}) {
          r.data.emplace_back(Rows(0, 8).num_elements() * 4);
          requests.push_back({path, Rows(0, 8), DType::kFloat32, r.data.back().data()});
        }
        r.status = source->Share(requests);
        if (r.status.ok()) r.status = source->ReadMany(requests, nullptr, nullptr);
        r.finish = source->Finish();
        r.stats = source->share_stats();
      });
    }
    for (std::thread& t : threads) t.join();
    for (int p = 0; p < 2; ++p) {
      TS_ASSERT_OK(results[p].status);
      TS_EXPECT_OK(results[p].finish);
      ExpectExact(results[p], boxes[p]);
      const int served = static_cast<int>(results[p].stats.served_chunks);
      ASSERT_GE(served, 2);
      if (cap == 1) {
        EXPECT_EQ(stores[p]->requests.load(), served) << "process " << p;
      } else {
        // One run of "w" and one of "b" (whatever the files), not one request per chunk.
        EXPECT_LE(stores[p]->requests.load(), 2)
            << "process " << p << " served " << served << ": " << Layout(kv.get());
        EXPECT_LT(stores[p]->requests.load(), served) << "process " << p;
      }
    }
    EXPECT_EQ(results[0].stats.storage_bytes + results[1].stats.storage_bytes,
              StoredDataBytes(kv.get()));
  }
}

TEST(SharedStepSource, OneProcessReadsAsWithoutSharing) {
  auto kv = WriteStep();
  const std::vector<std::vector<Box>> boxes = {{Rows(1, 6)}};
  const std::vector<ProcessResult> results = RunJob(kv.get(), boxes);
  TS_ASSERT_OK(results[0].status);
  ExpectExact(results[0], boxes[0]);
  EXPECT_FALSE(results[0].stats.active);
  EXPECT_EQ(results[0].stats.peer_bytes, 0u);
}

// A chunk counts as served once its last byte has been sent, not when its answer is queued: a
// publisher that stops once everything is served must not cut a transfer on the wire.
TEST(PeerServerShared, AChunkIsServedOnceSentWhole) {
  PeerServerOptions options;
  options.secret = "0123456789abcdef0123";
  std::unique_ptr<PeerServer> server = PeerServer::Start("", options).value();
  const size_t size = size_t{64} << 20;  // far more than the sockets' buffers hold
  server->Publish("0/1", std::make_shared<const std::string>(size, 'x'));
  const std::string url = server->url();  // http://127.0.0.1:PORT
  const int port = std::stoi(url.substr(url.rfind(':') + 1));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  const std::string request = std::string("GET /v1/shared/0/1 HTTP/1.1\r\nHost: x\r\n") +
                              kPeerSecretHeader + ": " + options.secret + "\r\n\r\n";
  ASSERT_EQ(::send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
  std::vector<char> buffer(1 << 20);
  const ssize_t first = ::recv(fd, buffer.data(), buffer.size(), 0);  // the answer has begun
  ASSERT_GT(first, 0);
  // Not served while most of it has not left the server.
  EXPECT_THAT(server->WaitServed({{"0/1", 1}},
                                 std::chrono::steady_clock::now() + std::chrono::milliseconds(300)),
              SizeIs(1));
  size_t received = static_cast<size_t>(first);  // (with the headers: done at `size`)
  for (ssize_t n; (n = ::recv(fd, buffer.data(), buffer.size(), 0)) > 0;) {
    received += static_cast<size_t>(n);
    if (received >= size) break;
  }
  EXPECT_THAT(server->WaitServed({{"0/1", 1}},
                                 std::chrono::steady_clock::now() + std::chrono::seconds(10)),
              IsEmpty());
  ::close(fd);
}

TEST(PeerServerShared, NotYetThenTheBytesThenGone) {
  PeerServerOptions options;
  options.secret = "0123456789abcdef0123";
  std::unique_ptr<PeerServer> server = PeerServer::Start("", options).value();
  HttpClient client;
  auto get = [&](const std::string& key, const std::string& secret) {
    HttpRequest request;
    request.url = server->url() + "/v1/shared/" + key;
    request.headers.emplace_back(kPeerSecretHeader, secret);
    return client.Perform(request, "test").value();
  };
  EXPECT_EQ(get("0/1", options.secret).status, 503);
  server->Publish("0/1", std::make_shared<const std::string>("chunk bytes"));
  EXPECT_EQ(get("0/1", "wrong secret wrong").status, 403);
  const HttpResponse ok = get("0/1", options.secret);
  EXPECT_EQ(ok.status, 200);
  EXPECT_EQ(ok.body, "chunk bytes");
  // (Counted once the last byte has gone, which may be a moment after the client has it.)
  EXPECT_THAT(server->WaitServed({{"0/1", 1}},
                                 std::chrono::steady_clock::now() + std::chrono::seconds(10)),
              IsEmpty());
  EXPECT_THAT(server->WaitServed({{"0/1", 2}}, std::chrono::steady_clock::now()), SizeIs(1));
  server->PublishFailure("0/1", "unreadable");
  const HttpResponse failed = get("0/1", options.secret);
  EXPECT_EQ(failed.status, 410);
  EXPECT_EQ(failed.body, "unreadable");
  // A server of no folder serves no files.
  HttpRequest object;
  object.url = server->url() + "/v1/object/x";
  object.headers.emplace_back(kPeerSecretHeader, options.secret);
  EXPECT_EQ(client.Perform(object, "test").value().status, 404);
}

}  // namespace
}  // namespace tensorstash
