// Incremental steps (docs/format.md, 6.1): a save against a base step references the base's
// unchanged chunks instead of writing them; reads follow the references on every backend, check
// every chunk's CRC wherever it lies, and name the step and file of a missing or bad one.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/checkpoint/materialize.h"
#include "tensorstash/format/index_format.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/testing/in_process_coordinator.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using test::BytesEqual;
using test::MakeArrayData;
using test::StoreKind;
using ::testing::HasSubstr;

// One array saved from one whole buffer.
struct Array {
  ArraySpec spec;
  std::vector<char> data;
};

// A LoRA-like state: a large frozen array of several chunks, a small trained one, a zstd one.
std::vector<Array> State(uint64_t trained_seed) {
  std::vector<Array> arrays;
  auto add = [&](std::string path, std::vector<int64_t> shape, uint64_t seed, Codec codec) {
    ArraySpec spec{path, DType::kFloat32, shape, codec, 3, 4096};
    arrays.push_back({spec, MakeArrayData(spec.dtype, spec.shape, seed)});
  };
  add("frozen/w", {64, 64}, 1, Codec::kNone);       // 16 KiB: 4 chunks of 4 KiB
  add("frozen/z", {32, 64}, 2, Codec::kZstd);       // 2 chunks, compressed
  add("lora/a", {16, 64}, trained_seed, Codec::kNone);  // 1 chunk
  return arrays;
}

Status Save(KvStore* kv, const std::string& dir, const std::vector<Array>& arrays,
            WriterOptions options, WriteStats* stats = nullptr) {
  options.sync = false;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      CheckpointWriter::Create(kv, dir, options));
  for (const Array& a : arrays) {
    TS_RETURN_IF_ERROR(
        writer->AddArray(a.spec, {{Box::FromShape(a.spec.shape), a.data.data(), 0, 1}}));
  }
  return writer->Commit(stats);
}

void ExpectRestores(KvStore* kv, const std::string& dir, const std::vector<Array>& arrays) {
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv, dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  for (const Array& a : arrays) {
    std::vector<char> got(a.data.size());
    TS_ASSERT_OK((*reader)->Read({a.spec.path, Box::FromShape(a.spec.shape), a.spec.dtype,
                                  got.data()}));
    EXPECT_TRUE(BytesEqual(a.data, got)) << dir << " " << a.spec.path;
  }
  Result<std::vector<BadChunk>> bad = (*reader)->Verify();
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_TRUE(bad->empty());
}

class IncrementalTest : public test::TempDirTest,
                        public ::testing::WithParamInterface<StoreKind> {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    Result<std::unique_ptr<KvStore>> kv = test::MakeStore(GetParam(), temp_dir() + "/root");
    ASSERT_TRUE(kv.ok()) << kv.status();
    kv_ = *std::move(kv);
  }
  std::unique_ptr<KvStore> kv_;
};

TEST_P(IncrementalTest, UnchangedChunksAreReferencedDirectlyAndRestoreBitExact) {
  const std::vector<Array> first = State(10);
  TS_ASSERT_OK(Save(kv_.get(), "run/0000000001", first, {.record_digests = true}));
  {
    // A step with digests is index version 2; one without stays 1.0.
    TS_ASSERT_OK(Save(kv_.get(), "run/plain", first, {}));
    auto plain = CheckpointReader::Open(kv_.get(), "run/plain").value();
    EXPECT_FALSE(IndexNeedsVersion2(plain->index()));
    EXPECT_EQ(kv_->Read("run/plain/state/index").value().substr(8, 2), std::string("\1\0", 2));
  }
  std::vector<Array> second = State(11);  // lora/a changed
  WriteStats stats;
  TS_ASSERT_OK(Save(kv_.get(), "run/0000000002", second, {.base = "run/0000000001"}, &stats));
  EXPECT_EQ(stats.chunks, 1u);  // only lora/a's chunk
  EXPECT_EQ(stats.referenced_chunks, 6u);
  EXPECT_EQ(stats.raw_bytes, 16u * 64 * 4);
  ExpectRestores(kv_.get(), "run/0000000002", second);
  ExpectRestores(kv_.get(), "run/0000000001", first);
  auto reader = CheckpointReader::Open(kv_.get(), "run/0000000002").value();
  EXPECT_EQ(reader->commit_record().depends_on, std::vector<std::string>{"0000000001"});
  // Its own files hold the changed chunk only.
  EXPECT_EQ(reader->commit_record().items.at("state").data_bytes, 16u * 64 * 4);

  // The third step saved against the second refers straight to step 1's file for the frozen
  // chunks (never through step 2), and to step 2's for lora/a, which did not change again.
  TS_ASSERT_OK(Save(kv_.get(), "run/0000000003", second, {.base = "run/0000000002"}, &stats));
  EXPECT_EQ(stats.chunks, 0u);
  EXPECT_EQ(stats.referenced_chunks, 7u);
  ExpectRestores(kv_.get(), "run/0000000003", second);
  reader = CheckpointReader::Open(kv_.get(), "run/0000000003").value();
  EXPECT_EQ(reader->commit_record().depends_on,
            (std::vector<std::string>{"0000000001", "0000000002"}));
  for (const DataFileInfo& f : reader->index().files) {
    EXPECT_THAT(f.step, ::testing::AnyOf("0000000001", "0000000002"));
    EXPECT_EQ(f.name.rfind("state/data/", 0), 0u) << f.name;
  }
}

TEST_P(IncrementalTest, ChangedDtypeGridOrCodecIsWrittenAgain) {
  const std::vector<Array> first = State(10);
  TS_ASSERT_OK(Save(kv_.get(), "0000000001", first, {.record_digests = true}));
  std::vector<Array> second = State(10);
  second[0].spec.target_chunk_bytes = 8192;                  // another grid
  second[1].spec.codec = Codec::kNone;                       // another codec
  second[2].spec.dtype = DType::kInt32;                      // same bytes, another dtype
  WriteStats stats;
  TS_ASSERT_OK(Save(kv_.get(), "0000000002", second, {.base = "0000000001"}, &stats));
  EXPECT_EQ(stats.referenced_chunks, 0u);
  EXPECT_EQ(stats.chunks, 2u + 2u + 1u);
  ExpectRestores(kv_.get(), "0000000002", second);
}

// Saves `arrays`, those whose path is in `promised` with their shards marked same_as_base.
Status SavePromising(KvStore* kv, const std::string& dir, const std::vector<Array>& arrays,
                     const std::vector<std::string>& promised, WriterOptions options,
                     WriteStats* stats) {
  options.sync = false;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      CheckpointWriter::Create(kv, dir, options));
  for (const Array& a : arrays) {
    ShardData shard{Box::FromShape(a.spec.shape), a.data.data(), 0, 1};
    shard.same_as_base =
        std::find(promised.begin(), promised.end(), a.spec.path) != promised.end();
    TS_RETURN_IF_ERROR(writer->AddArray(a.spec, {shard}));
  }
  return writer->Commit(stats);
}

TEST_P(IncrementalTest, SameAsBasePromiseSkipsHashingOnlyAgainstTheCommitItNames) {
  const std::vector<Array> first = State(10);
  WriteStats stats;
  TS_ASSERT_OK(Save(kv_.get(), "0000000001", first, {.record_digests = true}, &stats));
  const std::string id1 = stats.commit_id;
  ASSERT_EQ(id1.size(), 32u);
  EXPECT_EQ(id1, StepCommitId(CheckpointReader::Open(kv_.get(), "0000000001")
                                  .value()->commit_record()));
  // Without record_digests no id is read back (the step cannot be a base).
  TS_ASSERT_OK(Save(kv_.get(), "plain", first, {}, &stats));
  EXPECT_EQ(stats.commit_id, "");

  // frozen/w's buffer changed although the caller promises it did not: taken at its word, the
  // chunks are referenced without their bytes being read (what makes the promise pay), so the
  // step restores the base's bytes. lora/a, not promised, is hashed and written.
  std::vector<Array> second = State(11);
  second[0].data[0] ^= 1;
  TS_ASSERT_OK(SavePromising(kv_.get(), "0000000002", second, {"frozen/w", "frozen/z"},
                             {.base = "0000000001", .base_commit_id = id1}, &stats));
  EXPECT_EQ(stats.unhashed_chunks, 4u + 2u);
  EXPECT_EQ(stats.referenced_chunks, 6u);
  EXPECT_EQ(stats.chunks, 1u);
  std::vector<Array> expected = second;
  expected[0].data = first[0].data;
  ExpectRestores(kv_.get(), "0000000002", expected);

  // The base saved again under its name (other bytes) has another id: the promise made for the
  // old record is not kept, every chunk is hashed, and the changed one is written.
  TS_ASSERT_OK(Save(kv_.get(), "0000000003", first,
                    {.overwrite = true, .record_digests = true}, &stats));
  const std::string id3 = stats.commit_id;
  TS_ASSERT_OK(Save(kv_.get(), "0000000003", State(12),
                    {.overwrite = true, .record_digests = true}, &stats));
  EXPECT_NE(stats.commit_id, id3);
  TS_ASSERT_OK(SavePromising(kv_.get(), "0000000004", second, {"frozen/w", "frozen/z"},
                             {.base = "0000000003", .base_commit_id = id3}, &stats));
  EXPECT_EQ(stats.unhashed_chunks, 0u);
  EXPECT_EQ(stats.referenced_chunks, 5u);  // frozen/w's 3 unchanged chunks and frozen/z's 2
  ExpectRestores(kv_.get(), "0000000004", second);
}

TEST_P(IncrementalTest, MaterializeReportsProgressAndStopsOnItsError) {
  const std::vector<Array> first = State(10);
  const std::vector<Array> second = State(11);
  TS_ASSERT_OK(Save(kv_.get(), "run/0000000001", first, {.record_digests = true}));
  TS_ASSERT_OK(Save(kv_.get(), "run/0000000002", second, {.base = "run/0000000001"}));
  const uint64_t total = (64 * 64 + 32 * 64 + 16 * 64) * 4;

  // Stopped by its progress callback after the first chunk: the error, and nothing at dst.
  int calls = 0;
  Status stopped = MaterializeStep(kv_.get(), "run/0000000002", kv_.get(), "copy/0000000002",
                                   {}, [&](uint64_t, uint64_t) -> Status {
                                     ++calls;
                                     return CancelledError("stop here");
                                   });
  EXPECT_TRUE(absl::IsCancelled(stopped)) << stopped;
  EXPECT_THAT(stopped.message(), HasSubstr("stop here"));
  EXPECT_GE(calls, 1);
  EXPECT_FALSE(CheckpointReader::Open(kv_.get(), "copy/0000000002").ok());

  // Run to the end: every byte reported once, the copy self-contained and exact.
  uint64_t last = 0, seen_total = 0;
  TS_ASSERT_OK(MaterializeStep(kv_.get(), "run/0000000002", kv_.get(), "copy/0000000002", {},
                               [&](uint64_t done, uint64_t of) -> Status {
                                 EXPECT_GT(done, last);
                                 last = done;
                                 seen_total = of;
                                 return OkStatus();
                               }));
  EXPECT_EQ(seen_total, total);
  EXPECT_EQ(last, total);
  ExpectRestores(kv_.get(), "copy/0000000002", second);
  auto copy = CheckpointReader::Open(kv_.get(), "copy/0000000002").value();
  EXPECT_TRUE(copy->commit_record().depends_on.empty());
}

TEST_P(IncrementalTest, BaseWithoutDigestsIsWrittenInFull) {
  const std::vector<Array> first = State(10);
  TS_ASSERT_OK(Save(kv_.get(), "0000000001", first, {}));
  WriteStats stats;
  TS_ASSERT_OK(Save(kv_.get(), "0000000002", first, {.base = "0000000001"}, &stats));
  EXPECT_EQ(stats.referenced_chunks, 0u);
  EXPECT_EQ(stats.chunks, 7u);
  ExpectRestores(kv_.get(), "0000000002", first);
}

TEST_P(IncrementalTest, BadBasesAreRefused) {
  const std::vector<Array> first = State(10);
  EXPECT_EQ(Save(kv_.get(), "a/0000000002", first, {.base = "b/0000000001"}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Save(kv_.get(), "a/0000000002", first, {.base = "a/0000000002"}).code(),
            absl::StatusCode::kInvalidArgument);
  Status missing = Save(kv_.get(), "a/0000000002", first, {.base = "a/0000000001"});
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_THAT(std::string(missing.message()), HasSubstr("a/0000000001"));
}

TEST_P(IncrementalTest, MissingBaseFileIsDataLossNamingFileAndStep) {
  const std::vector<Array> first = State(10);
  TS_ASSERT_OK(Save(kv_.get(), "0000000001", first, {.record_digests = true}));
  TS_ASSERT_OK(Save(kv_.get(), "0000000002", State(11), {.base = "0000000001"}));
  TS_ASSERT_OK(kv_->Delete("0000000001/state/data/0-0.dat"));
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv_.get(), "0000000002");
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kDataLoss) << reader.status();
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr("state/data/0-0.dat"));
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr("step '0000000001'"));
}

TEST_P(IncrementalTest, CorruptBaseChunkIsFoundByReadAndVerifyNamingTheBaseFile) {
  const std::vector<Array> first = State(10);
  TS_ASSERT_OK(Save(kv_.get(), "0000000001", first, {.record_digests = true}));
  TS_ASSERT_OK(Save(kv_.get(), "0000000002", State(11), {.base = "0000000001"}));
  // Flip a byte of frozen/w's first chunk in step 1's file.
  auto base = CheckpointReader::Open(kv_.get(), "0000000001").value();
  const IndexEntry& e = base->index().entries[0];
  const std::string key = StrCat("0000000001/state/", base->index().files[e.file_id].name);
  std::string bytes = kv_->Read(key).value();
  bytes[e.offset] ^= 1;
  TS_ASSERT_OK(kv_->Write(key, bytes));
  auto reader = CheckpointReader::Open(kv_.get(), "0000000002").value();
  std::vector<char> got(64 * 64 * 4);
  Status read = reader->Read({"frozen/w", Box::FromShape({64, 64}), DType::kFloat32, got.data()});
  EXPECT_EQ(read.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(read.message()), HasSubstr(key));
  std::vector<BadChunk> bad = reader->Verify().value();
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].file, key);
  EXPECT_EQ(bad[0].array_path, "frozen/w");
}

TEST_P(IncrementalTest, DependsOnMustMatchTheIndex) {
  TS_ASSERT_OK(Save(kv_.get(), "0000000001", State(10), {.record_digests = true}));
  TS_ASSERT_OK(Save(kv_.get(), "0000000002", State(11), {.base = "0000000001"}));
  // A COMMIT that drops depends_on (an edit, or a tool that does not know it) is refused.
  std::string commit = kv_->Read("0000000002/COMMIT").value();
  const size_t at = commit.find("\"depends_on\"");
  ASSERT_NE(at, std::string::npos);
  commit.replace(at, std::string("\"depends_on\"").size(), "\"depends_xx\"");
  TS_ASSERT_OK(kv_->Write("0000000002/COMMIT", commit));
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv_.get(), "0000000002");
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr("depends on"));
}

// A job restarted with another process count saves against the step of the old one: the grid
// is the same (the shards are), each process matches its own chunks, and the base file both
// processes refer to is listed once.
TEST_P(IncrementalTest, TwoProcessesSaveAgainstAStepOfOneProcess) {
  const ArraySpec frozen{"frozen/w", DType::kFloat32, {64, 64}, Codec::kNone, 3, 4096};
  const ArraySpec lora{"lora/a", DType::kFloat32, {8, 64}, Codec::kNone, 3, 4096};
  const std::vector<char> frozen_data = MakeArrayData(frozen.dtype, frozen.shape, 1);
  const Box top({0, 0}, {32, 64}), bottom({32, 0}, {32, 64});
  const std::vector<char> top_data = test::MakeBoxData(frozen.dtype, frozen.shape, 1, top);
  const std::vector<char> bottom_data = test::MakeBoxData(frozen.dtype, frozen.shape, 1, bottom);
  {
    // Step 1: one process holding both row shards.
    const std::vector<char> lora_data = MakeArrayData(lora.dtype, lora.shape, 10);
    auto writer = CheckpointWriter::Create(kv_.get(), "0000000001",
                                           {.sync = false, .record_digests = true})
                      .value();
    TS_ASSERT_OK(writer->AddArray(frozen, {{top, top_data.data(), 0, 1},
                                           {bottom, bottom_data.data(), 0, 1}}));
    TS_ASSERT_OK(writer->AddArray(lora, {{Box::FromShape(lora.shape), lora_data.data(), 0, 1}}));
    TS_ASSERT_OK(writer->Commit());
  }
  const std::vector<char> lora2 = MakeArrayData(lora.dtype, lora.shape, 11);
  auto group = std::make_shared<InProcessCoordinatorGroup>(2);
  std::vector<Status> statuses(2);
  std::vector<WriteStats> stats(2);
  std::vector<std::thread> threads;
  for (int p = 0; p < 2; ++p) {
    threads.emplace_back([&, p] {
      InProcessCoordinator coordinator(group, p);
      Result<std::unique_ptr<CheckpointWriter>> writer = CheckpointWriter::Create(
          kv_.get(), "0000000002", {.sync = false, .base = "0000000001"}, &coordinator);
      statuses[p] = writer.status();
      if (!writer.ok()) return;
      statuses[p] = (*writer)->AddArray(
          frozen, {{p == 0 ? top : bottom, p == 0 ? top_data.data() : bottom_data.data(), 0, 1}});
      if (statuses[p].ok()) {
        std::vector<ShardData> shards;
        if (p == 0) shards.push_back({Box::FromShape(lora.shape), lora2.data(), 0, 1});
        statuses[p] = (*writer)->AddArray(lora, shards);
      }
      if (statuses[p].ok()) statuses[p] = (*writer)->Commit(&stats[p]);
    });
  }
  for (std::thread& t : threads) t.join();
  TS_ASSERT_OK(statuses[0]);
  TS_ASSERT_OK(statuses[1]);
  EXPECT_EQ(stats[0].referenced_chunks, 2u);
  EXPECT_EQ(stats[1].referenced_chunks, 2u);
  EXPECT_EQ(stats[0].chunks + stats[1].chunks, 1u);  // lora/a
  auto reader = CheckpointReader::Open(kv_.get(), "0000000002").value();
  size_t base_files = 0;
  for (const DataFileInfo& f : reader->index().files) base_files += f.step.empty() ? 0 : 1;
  EXPECT_EQ(base_files, 1u);
  std::vector<char> got(frozen_data.size());
  TS_ASSERT_OK(reader->Read({"frozen/w", Box::FromShape(frozen.shape), frozen.dtype, got.data()}));
  EXPECT_TRUE(BytesEqual(frozen_data, got));
  std::vector<char> got_lora(lora2.size());
  TS_ASSERT_OK(reader->Read({"lora/a", Box::FromShape(lora.shape), lora.dtype, got_lora.data()}));
  EXPECT_TRUE(BytesEqual(lora2, got_lora));
}

INSTANTIATE_TEST_SUITE_P(Stores, IncrementalTest,
                         ::testing::Values(StoreKind::kFile, StoreKind::kMemory,
                                           StoreKind::kMemoryNoRename),
                         [](const auto& param_info) { return test::StoreName(param_info.param); });

}  // namespace
}  // namespace tensorstash
