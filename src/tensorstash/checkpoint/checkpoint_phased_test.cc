// The writer's two phases: every process writes its part (WritePart), the parts travel as bytes,
// and one process commits them (CommitParts). The step equals the collective Commit's; a part of
// another step, a tampered or foreign blob, and a missing part are refused, and then nothing is
// visible. And an array added with a chunk source is pulled chunk by chunk under the staging cap.
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/testing/in_process_coordinator.h"
#include "tensorstash/testing/status_test_macros.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/endian.h"

namespace tensorstash {
namespace {

using test::BytesEqual;
using test::HeldShards;
using test::MakeBoxData;
using test::TestArray;
using ::testing::HasSubstr;

constexpr int kProcesses = 3;

std::vector<TestArray> Arrays() {
  return {
      {{"params/w", DType::kFloat32, {61, 37}}, 1, {{2, 3}, {0, 1}}},
      {{"params/b", DType::kBfloat16, {37}}, 2, {{2, 3}, {1}}},
      {{"opt/mu", DType::kInt64, {9, 3, 5}, Codec::kZstd}, 3, {{6}, {0, -1, -1}}},
      {{"step", DType::kInt32, {}}, 4, test::Replicated(0, 6)},
  };
}

WriterOptions Options() {
  WriterOptions options;
  options.target_chunk_bytes = 200;
  options.target_data_file_bytes = 2048;
  options.io_threads = 2;
  options.coordination_timeout = std::chrono::seconds(60);
  return options;
}

// Process `p` of kProcesses holds the devices of its contiguous block.
bool Owns(int p, int device, int devices) { return device * kProcesses / devices == p; }

// One process's writer with its shards (and a file of its own) added.
struct ProcessWriter {
  std::vector<HeldShards> held;
  std::unique_ptr<CheckpointWriter> writer;
};
Status MakeWriter(KvStore* kv, const std::string& dir, Coordinator* c, ProcessWriter* out,
                  bool drop_a_shard = false) {
  TS_ASSIGN_OR_RETURN(out->writer, CheckpointWriter::Create(kv, dir, Options(), c));
  const int p = c->process_index();
  for (const TestArray& a : Arrays()) {
    const int devices = a.sharding.num_devices();
    out->held.push_back(
        test::HoldShards(a.spec, a.seed, a.sharding, [&](int d) { return Owns(p, d, devices); }));
    std::vector<ShardData> shards = out->held.back().shards;
    if (drop_a_shard && p == 2 && a.spec.path == "params/w" && !shards.empty()) shards.pop_back();
    TS_RETURN_IF_ERROR(out->writer->AddArray(a.spec, shards));
  }
  return out->writer->AddFile(StrCat("process/", p), StrCat("state of process ", p));
}

// Runs phase 1 of a save of `dir` by kProcesses threads. The writers (and their coordinators)
// stay, so that one of them can commit; `bytes[p]` is process p's part, encoded.
struct PhasedSave {
  std::shared_ptr<InProcessCoordinatorGroup> group =
      std::make_shared<InProcessCoordinatorGroup>(kProcesses);
  std::vector<std::unique_ptr<InProcessCoordinator>> coordinators;
  std::vector<ProcessWriter> writers{kProcesses};
  std::vector<std::string> bytes{kProcesses};
  std::vector<Status> statuses{kProcesses};

  void WriteParts(KvStore* kv, const std::string& dir, bool drop_a_shard = false) {
    for (int p = 0; p < kProcesses; ++p) {
      coordinators.push_back(std::make_unique<InProcessCoordinator>(group, p));
    }
    std::vector<std::thread> threads;
    for (int p = 0; p < kProcesses; ++p) {
      threads.emplace_back([&, p] {
        statuses[p] = [&]() -> Status {
          TS_RETURN_IF_ERROR(
              MakeWriter(kv, dir, coordinators[p].get(), &writers[p], drop_a_shard));
          TS_ASSIGN_OR_RETURN(WrittenPart part, writers[p].writer->WritePart());
          TS_ASSIGN_OR_RETURN(bytes[p], EncodeWrittenPart(part));
          return OkStatus();
        }();
      });
    }
    for (std::thread& t : threads) t.join();
  }
};

std::vector<WrittenPart> DecodeAll(const std::vector<std::string>& bytes) {
  std::vector<WrittenPart> parts;
  for (size_t p = 0; p < bytes.size(); ++p) {
    Result<WrittenPart> part = DecodeWrittenPart(bytes[p], StrCat("part ", p));
    EXPECT_TRUE(part.ok()) << part.status();
    if (part.ok()) parts.push_back(*std::move(part));
  }
  return parts;
}

// The collective save of the same arrays by kProcesses threads.
void CollectiveSave(KvStore* kv, const std::string& dir) {
  auto group = std::make_shared<InProcessCoordinatorGroup>(kProcesses);
  std::vector<Status> statuses(kProcesses);
  std::vector<std::thread> threads;
  for (int p = 0; p < kProcesses; ++p) {
    threads.emplace_back([&, p] {
      InProcessCoordinator c(group, p);
      ProcessWriter w;
      statuses[p] = MakeWriter(kv, dir, &c, &w);
      if (statuses[p].ok()) statuses[p] = w.writer->Commit();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int p = 0; p < kProcesses; ++p) TS_EXPECT_OK(statuses[p]) << "process " << p;
}

// Every array read whole, bit for bit as written.
void ExpectArraysRestore(KvStore* kv, const std::string& dir) {
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv, dir);
  TS_ASSERT_OK(reader.status());
  for (const TestArray& a : Arrays()) {
    const Box whole = Box::FromShape(a.spec.shape);
    std::vector<char> got(static_cast<size_t>(whole.num_elements()) * ItemSize(a.spec.dtype));
    TS_ASSERT_OK((*reader)->ReadMany({{a.spec.path, whole, a.spec.dtype, got.data()}}));
    EXPECT_TRUE(BytesEqual(MakeBoxData(a.spec.dtype, a.spec.shape, a.seed, whole), got))
        << a.spec.path;
  }
}

void ExpectNoStep(KvStore* kv, const std::string& dir) {
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv, dir);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kNotFound) << reader.status();
}

class CheckpointPhasedTest : public test::TempDirTest {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    Result<std::unique_ptr<KvStore>> store =
        test::MakeStore(test::StoreKind::kFile, temp_dir() + "/root");
    TS_ASSERT_OK(store.status());
    kv_ = *std::move(store);
  }
  std::unique_ptr<KvStore> kv_;
};

TEST_F(CheckpointPhasedTest, PartsCarriedAsBytesCommitTheSameStepAsTheCollectiveSave) {
  PhasedSave save;
  save.WriteParts(kv_.get(), "job/0000000001");
  for (int p = 0; p < kProcesses; ++p) TS_ASSERT_OK(save.statuses[p]) << "process " << p;
  ExpectNoStep(kv_.get(), "job/0000000001");  // nothing visible before the commit
  // Process 1, not 0, commits: any process whose writer wrote a part may.
  TS_ASSERT_OK(save.writers[1].writer->CommitParts(DecodeAll(save.bytes)));
  CollectiveSave(kv_.get(), "job/0000000002");

  ExpectArraysRestore(kv_.get(), "job/0000000001");
  ExpectArraysRestore(kv_.get(), "job/0000000002");
  Result<std::unique_ptr<CheckpointReader>> phased =
      CheckpointReader::Open(kv_.get(), "job/0000000001");
  Result<std::unique_ptr<CheckpointReader>> collective =
      CheckpointReader::Open(kv_.get(), "job/0000000002");
  TS_ASSERT_OK(phased.status());
  TS_ASSERT_OK(collective.status());
  EXPECT_EQ((*phased)->commit_record().process_count, kProcesses);
  ASSERT_EQ((*phased)->arrays().size(), (*collective)->arrays().size());
  for (size_t i = 0; i < (*phased)->arrays().size(); ++i) {
    EXPECT_EQ((*phased)->arrays()[i].path, (*collective)->arrays()[i].path);
    EXPECT_EQ((*phased)->arrays()[i].grid.chunk_shape,
              (*collective)->arrays()[i].grid.chunk_shape);
  }
  EXPECT_EQ((*phased)->index().entries.size(), (*collective)->index().entries.size());
  EXPECT_EQ((*phased)->index().files.size(), (*collective)->index().files.size());
  for (int p = 0; p < kProcesses; ++p) {
    Result<std::string> file = (*phased)->ReadFile(StrCat("process/", p));
    TS_ASSERT_OK(file.status());
    EXPECT_EQ(*file, StrCat("state of process ", p));
  }
  Result<std::vector<BadChunk>> bad = (*phased)->Verify();
  TS_ASSERT_OK(bad.status());
  EXPECT_TRUE(bad->empty());
  // Nothing of the save is left outside the two steps.
  Result<std::vector<std::string>> keys = kv_->List("");
  TS_ASSERT_OK(keys.status());
  for (const std::string& key : *keys) {
    EXPECT_TRUE(key.rfind("job/0000000001/", 0) == 0 || key.rfind("job/0000000002/", 0) == 0)
        << "leftover " << key;
  }
}

TEST_F(CheckpointPhasedTest, APartOfAnotherStepIsRefusedAndNothingBecomesVisible) {
  PhasedSave mine, other;
  mine.WriteParts(kv_.get(), "job/0000000001");
  other.WriteParts(kv_.get(), "job/0000000002");
  for (int p = 0; p < kProcesses; ++p) {
    TS_ASSERT_OK(mine.statuses[p]);
    TS_ASSERT_OK(other.statuses[p]);
  }
  std::vector<std::string> bytes = mine.bytes;
  bytes[2] = other.bytes[2];
  const Status status = mine.writers[0].writer->CommitParts(DecodeAll(bytes));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("process 2"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("job/0000000002"));
  ExpectNoStep(kv_.get(), "job/0000000001");
  // The other save still commits with its own parts.
  TS_ASSERT_OK(other.writers[2].writer->CommitParts(DecodeAll(other.bytes)));
  ExpectArraysRestore(kv_.get(), "job/0000000002");
}

TEST_F(CheckpointPhasedTest, TamperedOrForeignBytesAreRefused) {
  PhasedSave save;
  save.WriteParts(kv_.get(), "job/0000000001");
  for (int p = 0; p < kProcesses; ++p) TS_ASSERT_OK(save.statuses[p]);
  for (size_t at : {size_t{20}, save.bytes[1].size() / 2, save.bytes[1].size() - 1}) {
    std::string tampered = save.bytes[1];
    tampered[at] = static_cast<char>(tampered[at] ^ 0x10);
    Result<WrittenPart> part = DecodeWrittenPart(tampered, "part of process 1");
    EXPECT_EQ(part.status().code(), absl::StatusCode::kDataLoss) << "byte " << at;
    EXPECT_THAT(std::string(part.status().message()), HasSubstr("part of process 1"));
  }
  Result<WrittenPart> truncated =
      DecodeWrittenPart(std::string_view(save.bytes[1]).substr(0, 40), "truncated part");
  EXPECT_FALSE(truncated.ok());
  EXPECT_THAT(std::string(truncated.status().message()), HasSubstr("truncated part"));
  Result<WrittenPart> foreign = DecodeWrittenPart("{\"not\": \"a part\"}", "foreign blob");
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kInvalidArgument) << foreign.status();
  EXPECT_THAT(std::string(foreign.status().message()), HasSubstr("foreign blob"));
  // Untouched, the same bytes commit.
  TS_ASSERT_OK(save.writers[0].writer->CommitParts(DecodeAll(save.bytes)));
  ExpectArraysRestore(kv_.get(), "job/0000000001");
}

// Every prefix of a part is refused, and so is a part whose CRC is right but whose counts are
// absurd (no allocation follows what a hostile blob claims).
TEST(WrittenPartEncodingTest, TruncationsAndHostileCountsAreErrors) {
  WrittenPart part;
  part.dir = "job/0000000001";
  part.attempt = "00ab";
  part.process_index = 1;
  part.process_count = 2;
  part.array_digests = {"d0", "d1"};
  part.index.files = {{"data/1-0.dat", 96}};
  part.index.entries = {{0, 0, 0, 0, 48, 7}, {1, 0, 0, 48, 48, 9}};
  part.files["process/1"] = {5, 42};
  part.stats.chunks = 2;
  Result<std::string> bytes = EncodeWrittenPart(part);
  TS_ASSERT_OK(bytes.status());
  Result<WrittenPart> back = DecodeWrittenPart(*bytes, "part");
  TS_ASSERT_OK(back.status());
  EXPECT_EQ(back->dir, part.dir);
  EXPECT_EQ(back->attempt, part.attempt);
  EXPECT_EQ(back->process_index, 1);
  EXPECT_EQ(back->array_digests, part.array_digests);
  EXPECT_EQ(back->index.entries, part.index.entries);
  EXPECT_EQ(back->index.files, part.index.files);
  EXPECT_EQ(back->files.at("process/1").crc32c, 42u);
  EXPECT_EQ(back->stats.chunks, 2u);
  for (size_t n = 0; n < bytes->size(); ++n) {
    EXPECT_FALSE(DecodeWrittenPart(std::string_view(*bytes).substr(0, n), "prefix").ok()) << n;
  }
  // The array count (after the header, dir and attempt) set to 2^31, the CRC made right.
  std::string hostile = bytes->substr(0, bytes->size() - 4);
  const size_t count_at = 16 + 4 + part.dir.size() + 4 + part.attempt.size() + 8;
  ASSERT_EQ(GetLE32(hostile.data() + count_at), 2u);
  hostile[count_at + 3] = static_cast<char>(0x80);
  PutLE32(&hostile, Crc32c(hostile));
  Result<WrittenPart> bad = DecodeWrittenPart(hostile, "hostile part");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("hostile part"));
}

TEST_F(CheckpointPhasedTest, AMissingPartIsRefusedAndNothingIsLeft) {
  PhasedSave save;
  save.WriteParts(kv_.get(), "job/0000000001");
  for (int p = 0; p < kProcesses; ++p) TS_ASSERT_OK(save.statuses[p]);
  std::vector<WrittenPart> parts = DecodeAll(save.bytes);
  parts.erase(parts.begin() + 2);
  const Status status = save.writers[0].writer->CommitParts(std::move(parts));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("no part from process 2"));
  ExpectNoStep(kv_.get(), "job/0000000001");
  Result<std::vector<std::string>> keys = kv_->List("");
  TS_ASSERT_OK(keys.status());
  EXPECT_THAT(*keys, ::testing::IsEmpty()) << "the folder written into is removed";
}

TEST_F(CheckpointPhasedTest, AnUncoveredArrayIsRefusedNamingIt) {
  PhasedSave save;
  save.WriteParts(kv_.get(), "job/0000000001", /*drop_a_shard=*/true);
  for (int p = 0; p < kProcesses; ++p) TS_ASSERT_OK(save.statuses[p]);
  const Status status = save.writers[0].writer->CommitParts(DecodeAll(save.bytes));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("params/w"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("do not cover the array"));
  ExpectNoStep(kv_.get(), "job/0000000001");
}

TEST_F(CheckpointPhasedTest, CommitPartsNeedsTheWritersOwnPart) {
  Result<std::unique_ptr<CheckpointWriter>> writer =
      CheckpointWriter::Create(kv_.get(), "job/0000000001", Options());
  TS_ASSERT_OK(writer.status());
  EXPECT_EQ((*writer)->CommitParts({}).code(), absl::StatusCode::kFailedPrecondition);
}

// An array whose chunks come from a source, larger than the staging cap: pulled chunk by chunk,
// never more than the cap (one chunk above it alone) held at once, and stored bit-exactly.
TEST_F(CheckpointPhasedTest, ChunkSourceArrayStreamsUnderTheStagingCap) {
  const ArraySpec spec{"big", DType::kFloat32, {512, 1024}};  // 2 MiB
  const std::vector<char> data = MakeBoxData(spec.dtype, spec.shape, 9, Box::FromShape(spec.shape));
  WriterOptions options;
  options.target_chunk_bytes = 64 << 10;
  options.max_inflight_bytes = 256 << 10;
  options.io_threads = 4;
  Result<std::unique_ptr<CheckpointWriter>> writer =
      CheckpointWriter::Create(kv_.get(), "0000000005", options);
  TS_ASSERT_OK(writer.status());
  std::atomic<int> calls{0};
  const Box whole = Box::FromShape(spec.shape);
  TS_ASSERT_OK((*writer)->AddArrayFromSource(spec, [&](const Box& box, void* dest) {
    ++calls;
    return CopyBox(box, spec.dtype, data.data(), whole, spec.dtype, dest, box, "big");
  }));
  WriteStats stats;
  TS_ASSERT_OK((*writer)->Commit(&stats));
  EXPECT_EQ(stats.raw_bytes, data.size());
  EXPECT_GT(calls.load(), 8) << "the array is pulled in chunks, not whole";
  EXPECT_EQ(static_cast<uint64_t>(calls.load()), stats.chunks);
  EXPECT_GT(stats.peak_staged_bytes, 0u);
  EXPECT_LE(stats.peak_staged_bytes, options.max_inflight_bytes);

  Result<std::unique_ptr<CheckpointReader>> reader =
      CheckpointReader::Open(kv_.get(), "0000000005");
  TS_ASSERT_OK(reader.status());
  std::vector<char> got(data.size());
  TS_ASSERT_OK((*reader)->ReadMany({{"big", whole, spec.dtype, got.data()}}));
  EXPECT_TRUE(BytesEqual(data, got));
}

TEST_F(CheckpointPhasedTest, AChunkSourceErrorFailsTheSaveNamingTheArray) {
  Result<std::unique_ptr<CheckpointWriter>> writer =
      CheckpointWriter::Create(kv_.get(), "0000000006", Options());
  TS_ASSERT_OK(writer.status());
  TS_ASSERT_OK((*writer)->AddArrayFromSource({"a", DType::kInt32, {100}}, [](const Box&, void*) {
    return DataLossError("source chunk unreadable");
  }));
  EXPECT_EQ((*writer)->AddArrayFromSource({"b", DType::kInt32, {4}}, ChunkSource()).code(),
            absl::StatusCode::kInvalidArgument);
  const Status status = (*writer)->Commit();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("array 'a'"));
  ExpectNoStep(kv_.get(), "0000000006");
}

}  // namespace
}  // namespace tensorstash
