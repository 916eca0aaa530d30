// CheckpointReader::MapMany: boxes mapped from the data files instead of read.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

constexpr char kStep[] = "step";
// 1024 x 1024 float32 (4 MiB) in two row shards, so 2 MiB chunks; and a compressed one; and a
// small one (64 x 64 float32: two chunks of 8 KiB, stored one after the other).
const std::vector<int64_t> kShape = {1024, 1024};
// Two row chunks of 17 x 1040 float32: 70,720 bytes each, large enough to be page-aligned were
// they not continuing their array, and not a whole number of pages.
const std::vector<int64_t> kOddShape = {34, 1040};

class CheckpointMapTest : public test::TempDirTest {
 protected:
  void Write(KvStore* kv) {
    WriterOptions options;
    options.sync = false;
    Result<std::unique_ptr<CheckpointWriter>> writer = CheckpointWriter::Create(kv, kStep, options);
    TS_ASSERT_OK(writer.status());
    const test::Sharding rows{{2}, {0, -1}};
    std::vector<test::HeldShards> held;
    held.reserve(4);
    ArraySpec big{"big", DType::kFloat32, kShape};
    ArraySpec packed{"packed", DType::kFloat32, kShape};
    packed.codec = Codec::kZstd;
    ArraySpec small{"small", DType::kFloat32, {64, 64}};
    ArraySpec odd{"odd", DType::kFloat32, kOddShape};
    for (const ArraySpec& spec : {big, packed, small, odd}) {
      held.push_back(test::HoldAllShards(spec, 11, rows));
      TS_ASSERT_OK((*writer)->AddArray(spec, held.back().shards));
    }
    TS_ASSERT_OK((*writer)->Commit());
  }

  void SetUp() override {
    test::TempDirTest::SetUp();
    Result<std::unique_ptr<FileKvStore>> store = FileKvStore::Open(temp_dir() + "/root");
    TS_ASSERT_OK(store.status());
    kv_ = *std::move(store);
    Write(kv_.get());
  }

  std::unique_ptr<CheckpointReader> Open(KvStore* kv) {
    Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv, kStep);
    EXPECT_TRUE(reader.ok()) << reader.status();
    return reader.ok() ? *std::move(reader) : nullptr;
  }

  static void ExpectBox(const Result<MappedBox>& mapped, const Box& box) {
    ASSERT_TRUE(mapped.ok()) << mapped.status();
    const std::vector<char> want = test::MakeBoxData(DType::kFloat32, kShape, 11, box);
    ASSERT_EQ(mapped->size(), want.size());
    EXPECT_EQ(std::memcmp(mapped->data(), want.data(), want.size()), 0);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(mapped->data()) % 4096, 0u);
  }

  // Flips bits `mask` of the byte `at` bytes into chunk `e`, in its data file.
  void FlipByte(const CheckpointReader& reader, const IndexEntry& e, uint64_t at, char mask) {
    const std::string path = temp_dir() + "/root/" + ItemDir(kStep, kStateItem) + "/" +
                             reader.index().files[e.file_id].name;
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0) << path;
    char byte = 0;
    const off_t where = static_cast<off_t>(e.offset + at);
    ASSERT_EQ(::pread(fd, &byte, 1, where), 1);
    byte ^= mask;
    ASSERT_EQ(::pwrite(fd, &byte, 1, where), 1);
    ::close(fd);
  }

  std::unique_ptr<FileKvStore> kv_;
};

TEST_F(CheckpointMapTest, MapsWholeArraysAndShardBoxesBitForBit) {
  auto reader = Open(kv_.get());
  ASSERT_NE(reader, nullptr);
  const Box whole = Box::FromShape(kShape);
  const Box lower({512, 0}, {512, 1024});
  std::vector<Result<MappedBox>> mapped = reader->MapMany(
      {{"big", whole, DType::kFloat32, nullptr}, {"big", lower, DType::kFloat32, nullptr}});
  ASSERT_EQ(mapped.size(), 2u);
  ExpectBox(mapped[0], whole);
  ExpectBox(mapped[1], lower);
  // Copy-on-write: changing the mapped memory changes neither the file nor other mappings.
  std::memset(mapped[0]->data(), 0x5a, 4096);
  std::vector<Result<MappedBox>> again =
      reader->MapMany({{"big", whole, DType::kFloat32, nullptr}});
  ExpectBox(again[0], whole);
}

TEST_F(CheckpointMapTest, BoxesThatCannotBeMappedAreUnimplementedNotErrors) {
  auto reader = Open(kv_.get());
  ASSERT_NE(reader, nullptr);
  std::vector<Result<MappedBox>> mapped = reader->MapMany({
      {"packed", Box::FromShape(kShape), DType::kFloat32, nullptr},   // compressed
      {"small", Box({0, 0}, {64, 32}), DType::kFloat32, nullptr},     // not runs, small chunks
      {"big", Box::FromShape(kShape), DType::kFloat64, nullptr},      // a cast
      {"big", Box({0, 0}, {1024, 512}), DType::kFloat32, nullptr},    // chunk rows not runs
      {"big", Box({0, 0}, {2048, 1024}), DType::kFloat32, nullptr},   // past the shape
      {"big", Box({0, 0}, {0, 1024}), DType::kFloat32, nullptr},      // empty
  });
  for (size_t i = 0; i < mapped.size(); ++i) {
    EXPECT_EQ(mapped[i].status().code(), absl::StatusCode::kUnimplemented)
        << i << ": " << mapped[i].status();
  }
  EXPECT_THAT(mapped[0].status().message(), HasSubstr("'packed'"));
  // Unknown arrays and wrong ranks are errors, as for reads.
  std::vector<Result<MappedBox>> bad = reader->MapMany({
      {"nope", Box::FromShape(kShape), DType::kFloat32, nullptr},
      {"big", Box::FromShape({1024}), DType::kFloat32, nullptr},
  });
  EXPECT_EQ(bad[0].status().code(), absl::StatusCode::kNotFound) << bad[0].status();
  EXPECT_EQ(bad[1].status().code(), absl::StatusCode::kInvalidArgument) << bad[1].status();
}

TEST_F(CheckpointMapTest, BoxesStoredAsRunsShareOneMappingAndOutliveEachOther) {
  auto reader = Open(kv_.get());
  ASSERT_NE(reader, nullptr);
  // "small" whole (its two 8 KiB chunks one after the other in the file), each of its chunks,
  // and "big": all runs of one data file, near enough to share one mapping.
  const std::vector<int64_t> small_shape = {64, 64};
  const std::vector<Box> small_boxes = {Box::FromShape(small_shape), Box({0, 0}, {32, 64}),
                                        Box({32, 0}, {32, 64})};
  std::vector<ReadRequest> requests;
  for (const Box& box : small_boxes) requests.push_back({"small", box, DType::kFloat32, nullptr});
  requests.push_back({"big", Box::FromShape(kShape), DType::kFloat32, nullptr});
  std::vector<Result<MappedBox>> mapped = reader->MapMany(requests);
  ASSERT_EQ(mapped.size(), 4u);
  auto expect_small = [&](const Result<MappedBox>& box, const Box& where) {
    ASSERT_TRUE(box.ok()) << box.status();
    const std::vector<char> want = test::MakeBoxData(DType::kFloat32, small_shape, 11, where);
    ASSERT_EQ(box->size(), want.size());
    EXPECT_EQ(std::memcmp(box->data(), want.data(), want.size()), 0);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(box->data()) % 64, 0u);
  };
  for (size_t i = 0; i < small_boxes.size(); ++i) expect_small(mapped[i], small_boxes[i]);
  ExpectBox(mapped[3], Box::FromShape(kShape));
  // Each view keeps the mapping: the others gone, the last one still reads (and writes, privately).
  Result<MappedBox> last = std::move(mapped[2]);
  mapped.clear();
  expect_small(last, small_boxes[2]);
  std::memset(last->data(), 0x5a, last->size());
  std::vector<Result<MappedBox>> again =
      reader->MapMany({{"small", small_boxes[2], DType::kFloat32, nullptr}});
  expect_small(again[0], small_boxes[2]);
}

TEST_F(CheckpointMapTest, AnArraySavedInRowShardsIsOneRunOfItsFile) {
  auto reader = Open(kv_.get());
  ASSERT_NE(reader, nullptr);
  const std::vector<Box> boxes = {Box::FromShape(kOddShape), Box({0, 0}, {17, 1040}),
                                  Box({17, 0}, {17, 1040})};
  std::vector<ReadRequest> requests;
  for (const Box& box : boxes) requests.push_back({"odd", box, DType::kFloat32, nullptr});
  std::vector<Result<MappedBox>> mapped = reader->MapMany(requests);
  for (size_t i = 0; i < boxes.size(); ++i) {
    ASSERT_TRUE(mapped[i].ok()) << i << ": " << mapped[i].status();
    const std::vector<char> want = test::MakeBoxData(DType::kFloat32, kOddShape, 11, boxes[i]);
    ASSERT_EQ(mapped[i]->size(), want.size());
    EXPECT_EQ(std::memcmp(mapped[i]->data(), want.data(), want.size()), 0) << i;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(mapped[i]->data()) % 64, 0u) << i;
  }
}

TEST_F(CheckpointMapTest, MappingsPastTheBudgetAreUnimplemented) {
  auto reader = Open(kv_.get());
  ASSERT_NE(reader, nullptr);
  const Box top({0, 0}, {512, 1024});
  const Box bottom({512, 0}, {512, 1024});
  const std::vector<ReadRequest> halves = {{"big", top, DType::kFloat32, nullptr},
                                           {"big", bottom, DType::kFloat32, nullptr}};
  // Both halves in one shared mapping: one entry is enough.
  std::vector<Result<MappedBox>> shared = reader->MapMany(halves, {.max_mappings = 1});
  ExpectBox(shared[0], top);
  ExpectBox(shared[1], bottom);
  // Mappings of one half each: the second is over the budget.
  std::vector<Result<MappedBox>> apart =
      reader->MapMany(halves, {.max_mappings = 1, .shared_mapping_bytes = 1});
  ExpectBox(apart[0], top);
  EXPECT_EQ(apart[1].status().code(), absl::StatusCode::kUnimplemented) << apart[1].status();
  std::vector<Result<MappedBox>> none = reader->MapMany(halves, {.max_mappings = 0});
  EXPECT_EQ(none[0].status().code(), absl::StatusCode::kUnimplemented) << none[0].status();
}

TEST_F(CheckpointMapTest, StoresWithoutMappableFilesAreUnimplemented) {
  MemoryKvStore memory;
  Write(&memory);
  auto reader = Open(&memory);
  ASSERT_NE(reader, nullptr);
  std::vector<Result<MappedBox>> mapped =
      reader->MapMany({{"big", Box::FromShape(kShape), DType::kFloat32, nullptr}});
  EXPECT_EQ(mapped[0].status().code(), absl::StatusCode::kUnimplemented) << mapped[0].status();
}

TEST_F(CheckpointMapTest, ACorruptSmallChunkFailsItsBoxOnlyNotItsNeighbours) {
  auto reader = Open(kv_.get());
  ASSERT_NE(reader, nullptr);
  const IndexEntry* victim = nullptr;  // the second chunk of "small"
  for (const IndexEntry& e : reader->index().entries) {
    if (reader->arrays()[e.array_id].path == "small" && e.chunk == 1) victim = &e;
  }
  ASSERT_NE(victim, nullptr);
  FlipByte(*reader, *victim, 3, 0x10);
  std::vector<Result<MappedBox>> mapped = reader->MapMany({
      {"small", Box::FromShape({64, 64}), DType::kFloat32, nullptr},
      {"small", Box({0, 0}, {32, 64}), DType::kFloat32, nullptr},
      {"big", Box::FromShape(kShape), DType::kFloat32, nullptr},
  });
  EXPECT_EQ(mapped[0].status().code(), absl::StatusCode::kDataLoss) << mapped[0].status();
  EXPECT_THAT(std::string(mapped[0].status().message()), HasSubstr("of array 'small'"));
  EXPECT_TRUE(mapped[1].ok()) << mapped[1].status();
  ExpectBox(mapped[2], Box::FromShape(kShape));
}

TEST_F(CheckpointMapTest, ACorruptChunkIsDataLossNamingIt) {
  auto reader = Open(kv_.get());
  ASSERT_NE(reader, nullptr);
  // Flip a byte inside the first stored chunk of "big".
  const IndexEntry* victim = nullptr;
  for (const IndexEntry& e : reader->index().entries) {
    if (reader->arrays()[e.array_id].path == "big") {
      victim = &e;
      break;
    }
  }
  ASSERT_NE(victim, nullptr);
  FlipByte(*reader, *victim, victim->length / 2, 0x40);
  std::vector<Result<MappedBox>> mapped =
      reader->MapMany({{"big", Box::FromShape(kShape), DType::kFloat32, nullptr}});
  EXPECT_EQ(mapped[0].status().code(), absl::StatusCode::kDataLoss) << mapped[0].status();
  EXPECT_THAT(std::string(mapped[0].status().message()), HasSubstr("array 'big'"));
}

// ReadMany with map_spans: chunks cut into pieces for another layout are copied out of a mapping.
class CheckpointMappedSpanTest : public CheckpointMapTest {
 protected:
  // Reads "big" (row chunks) as two column halves and "packed" whole; returns the stats.
  ReadStats ReadColumns(KvStore* kv, bool map_spans, Status* status, bool with_packed = false) {
    ReaderOptions options;
    options.map_spans = map_spans;
    Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv, kStep, options);
    EXPECT_TRUE(reader.ok()) << reader.status();
    ReadStats stats;
    if (!reader.ok()) return stats;
    const Box left({0, 0}, {1024, 512});
    const Box right({0, 512}, {1024, 512});
    std::vector<char> a(left.num_elements() * 4), b(right.num_elements() * 4);
    std::vector<char> packed(1024 * 1024 * 4);
    std::vector<ReadRequest> requests = {{"big", left, DType::kFloat32, a.data()},
                                         {"big", right, DType::kFloat32, b.data()}};
    if (with_packed)
      requests.push_back({"packed", Box::FromShape(kShape), DType::kFloat32, packed.data()});
    *status = (*reader)->ReadMany(requests, &stats);
    if (status->ok()) {
      EXPECT_EQ(a, test::MakeBoxData(DType::kFloat32, kShape, 11, left));
      EXPECT_EQ(b, test::MakeBoxData(DType::kFloat32, kShape, 11, right));
      if (with_packed) {
        EXPECT_EQ(packed, test::MakeBoxData(DType::kFloat32, kShape, 11, Box::FromShape(kShape)));
      }
    }
    return stats;
  }
};

TEST_F(CheckpointMappedSpanTest, PiecesComeFromAMappingBitForBit) {
  Status status;
  ReadStats mapped = ReadColumns(kv_.get(), true, &status);
  TS_ASSERT_OK(status);
  EXPECT_GT(mapped.mapped_spans, 0u);
  EXPECT_EQ(mapped.staged_chunks, 2u);
  ReadStats staged = ReadColumns(kv_.get(), false, &status);
  TS_ASSERT_OK(status);
  EXPECT_EQ(staged.mapped_spans, 0u);
  EXPECT_EQ(staged.bytes_read, mapped.bytes_read);
}

TEST_F(CheckpointMappedSpanTest, CompressedChunksInTheReadMeanNoMapping) {
  Status status;
  ReadStats stats = ReadColumns(kv_.get(), true, &status, /*with_packed=*/true);
  TS_ASSERT_OK(status);
  EXPECT_EQ(stats.mapped_spans, 0u);
}

TEST_F(CheckpointMappedSpanTest, StoresWithoutMappableFilesRead) {
  MemoryKvStore memory;
  Write(&memory);
  Status status;
  ReadStats stats = ReadColumns(&memory, true, &status);
  TS_ASSERT_OK(status);
  EXPECT_EQ(stats.mapped_spans, 0u);
  EXPECT_EQ(stats.staged_chunks, 2u);
}

TEST_F(CheckpointMappedSpanTest, ACorruptChunkInAMappedSpanIsDataLoss) {
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv_.get(), kStep);
  TS_ASSERT_OK(reader.status());
  const IndexEntry* victim = nullptr;
  for (const IndexEntry& e : (*reader)->index().entries) {
    if ((*reader)->arrays()[e.array_id].path == "big") victim = &e;
  }
  ASSERT_NE(victim, nullptr);
  FlipByte(**reader, *victim, 7, 0x01);
  Status status;
  ReadColumns(kv_.get(), true, &status);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("array 'big'"));
}

}  // namespace
}  // namespace tensorstash
