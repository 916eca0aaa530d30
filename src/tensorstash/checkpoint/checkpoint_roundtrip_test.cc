// Save and restore through CheckpointWriter and CheckpointReader, bit for bit, on every backend:
// random shapes (0-d, zero-size dimensions, uneven shards, ranks 1-8) of every dtype, random
// target boxes, resharding, many small chunks, zstd, replicated shards, dtype casts on read,
// custom trees, overwrite, the staging byte cap, direct reads, and the order of the commit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/array/convert.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"

namespace tensorstash {
namespace {

using test::BytesEqual;
using test::HeldShards;
using test::MakeBoxData;
using test::Sharding;
using test::StoreKind;
using test::TestArray;
using ::testing::HasSubstr;

// Saves `arrays`, each with every device's shard of its sharding, from one process.
Status SaveArrays(KvStore* kv, const std::string& dir, const std::vector<TestArray>& arrays,
                  const WriterOptions& options, const TreeNode* tree = nullptr,
                  WriteStats* stats = nullptr) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      CheckpointWriter::Create(kv, dir, options));
  std::vector<HeldShards> held;
  held.reserve(arrays.size());
  for (const TestArray& a : arrays) {
    held.push_back(test::HoldAllShards(a.spec, a.seed, a.sharding));
    TS_RETURN_IF_ERROR(writer->AddArray(a.spec, held.back().shards));
  }
  if (tree != nullptr) writer->SetTree(*tree);
  return writer->Commit(stats);
}

// The expected contents of `box` of `a` read as `dtype` (zeros outside the shape).
std::vector<char> Expected(const TestArray& a, const Box& box, DType dtype) {
  std::vector<char> stored = MakeBoxData(a.spec.dtype, a.spec.shape, a.seed, box);
  if (dtype == a.spec.dtype) return stored;
  std::vector<char> out(static_cast<size_t>(box.num_elements()) * ItemSize(dtype));
  const Status converted = ConvertElements(a.spec.dtype, stored.data(), dtype, out.data(),
                                           static_cast<size_t>(box.num_elements()), "expected");
  EXPECT_TRUE(converted.ok()) << converted;
  return out;
}

// Reads `box` of `a` as `dtype` and compares it with what was saved.
void ExpectRead(CheckpointReader* reader, const TestArray& a, const Box& box, DType dtype,
                const std::string& context) {
  SCOPED_TRACE(StrCat(context, ": array '", a.spec.path, "' ", DTypeName(a.spec.dtype), " [",
                      StrJoin(a.spec.shape, ","), "] read ", box.ToString(), " as ",
                      DTypeName(dtype)));
  const std::vector<char> want = Expected(a, box, dtype);
  // Garbage first, so that a region the reader forgot to fill shows.
  std::vector<char> got(want.size(), static_cast<char>(0x5a));
  TS_ASSERT_OK(reader->Read({a.spec.path, box, dtype, got.data()}));
  EXPECT_TRUE(BytesEqual(want, got));
}

class CheckpointRoundTripTest : public test::TempDirTest,
                                public ::testing::WithParamInterface<StoreKind> {
 protected:
  void SetUp() override {
    test::TempDirTest::SetUp();
    Result<std::unique_ptr<KvStore>> store = test::MakeStore(GetParam(), root());
    TS_ASSERT_OK(store.status());
    kv_ = *std::move(store);
  }
  void TearDown() override {
    kv_.reset();
    test::TempDirTest::TearDown();
  }
  std::string root() const { return temp_dir() + "/root"; }

  // Opens `dir` for reading. With the file backend through a second store on the same root, so
  // nothing is shared with the writer but the disk.
  Result<std::unique_ptr<CheckpointReader>> Open(const std::string& dir,
                                                 ReaderOptions options = {}) {
    if (GetParam() == StoreKind::kFile) {
      TS_ASSIGN_OR_RETURN(std::unique_ptr<FileKvStore> store, FileKvStore::Open(root(), false));
      read_kv_ = std::move(store);
      return CheckpointReader::Open(read_kv_.get(), dir, options);
    }
    return CheckpointReader::Open(kv_.get(), dir, options);
  }

  // Every key of the store that does not start with one of `allowed` prefixes.
  std::vector<std::string> KeysOutside(const std::vector<std::string>& allowed) {
    Result<std::vector<std::string>> keys = kv_->List("");
    EXPECT_TRUE(keys.ok()) << keys.status();
    std::vector<std::string> out;
    for (const std::string& key : keys.value_or(std::vector<std::string>{})) {
      bool ok = false;
      for (const std::string& prefix : allowed) ok = ok || key.rfind(prefix, 0) == 0;
      if (!ok) out.push_back(key);
    }
    return out;
  }

  void RunRandomCase(int case_index);

  // What the random cases covered, so that a generator that degenerates is noticed.
  struct Coverage {
    std::set<DType> dtypes;
    std::set<int> ranks;
    int zero_size = 0, zstd = 0, uneven = 0, replicated = 0, multi_file = 0;
    uint64_t chunks = 0;
  } coverage_;

  std::unique_ptr<KvStore> kv_;
  std::unique_ptr<KvStore> read_kv_;
};

std::vector<int64_t> RandomShape(int rank, std::mt19937_64& rng) {
  // Small enough that a case stays fast; large enough for uneven shards and many chunks.
  static constexpr int64_t kMaxExtent[9] = {0, 300, 40, 14, 7, 5, 4, 3, 3};
  std::vector<int64_t> shape(rank);
  for (int d = 0; d < rank; ++d) {
    shape[d] = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(kMaxExtent[rank]));
  }
  if (rank > 0 && rng() % 8 == 0) shape[rng() % rank] = 0;  // a zero-size dimension
  return shape;
}

template <typename T>
T Pick(std::mt19937_64& rng, std::initializer_list<T> choices) {
  return *(choices.begin() + rng() % choices.size());
}

void CheckpointRoundTripTest::RunRandomCase(int case_index) {
  std::mt19937_64 rng(0x5eed0000u + static_cast<uint64_t>(case_index));
  const int rank = case_index % 9;
  const int num_arrays = 1 + static_cast<int>(rng() % 3);
  std::vector<TestArray> arrays;
  for (int j = 0; j < num_arrays; ++j) {
    TestArray a;
    a.spec.path = StrCat("case", case_index, "/", j == 2 ? "nested/" : "", "a", j);
    // Array 0 walks through the dtypes (7 is prime to 30: every dtype within 30 cases).
    a.spec.dtype = AllDTypes()[(case_index * 7 + j * 3) % kNumDTypes];
    a.spec.shape = RandomShape(j == 0 ? rank : static_cast<int>(rng() % 9), rng);
    if (rng() % 3 == 0) {
      a.spec.codec = Codec::kZstd;
      a.spec.zstd_level = 1 + static_cast<int>(rng() % 5);
    }
    a.spec.target_chunk_bytes = Pick<int64_t>(rng, {0, 0, 8, 64, 256, 4096});
    a.seed = rng();
    a.sharding = test::RandomSharding(static_cast<int>(a.spec.shape.size()), 8, rng);
    arrays.push_back(std::move(a));
  }
  WriterOptions options;
  options.target_chunk_bytes = Pick<int64_t>(rng, {32, 512, 1 << 20});
  options.target_data_file_bytes = Pick<int64_t>(rng, {100, 4096, int64_t{1} << 30});
  options.max_inflight_bytes = Pick<uint64_t>(rng, {1, 1000, uint64_t{256} << 20});
  options.io_threads = 1 + static_cast<int>(rng() % 4);
  options.split_replicated_writes = rng() % 2 == 0;
  options.sync = rng() % 8 == 0;
  const std::string dir = StrCat("run/", test::StepName(case_index));
  std::string description;
  for (const TestArray& a : arrays) {
    description += StrCat(" ['", a.spec.path, "' ", DTypeName(a.spec.dtype), " [",
                          StrJoin(a.spec.shape, ","), "] ", CodecName(a.spec.codec), " chunk ",
                          a.spec.target_chunk_bytes, " ", a.sharding.ToString(), "]");
  }
  SCOPED_TRACE(StrCat("case ", case_index, ":", description, " writer chunk ",
                      options.target_chunk_bytes, " file ", options.target_data_file_bytes,
                      " split ", options.split_replicated_writes));

  WriteStats stats;
  TS_ASSERT_OK(SaveArrays(kv_.get(), dir, arrays, options, nullptr, &stats));

  ReaderOptions read_options;
  read_options.io_threads = 1 + static_cast<int>(rng() % 4);
  read_options.max_inflight_bytes = Pick<uint64_t>(rng, {1, 777, uint64_t{256} << 20});
  read_options.coalesce_gap_bytes = Pick<uint64_t>(rng, {0, 100, 64 << 10});
  read_options.max_request_bytes = Pick<uint64_t>(rng, {1, 300, uint64_t{32} << 20});
  Result<std::unique_ptr<CheckpointReader>> reader = Open(dir, read_options);
  TS_ASSERT_OK(reader.status());
  CheckpointReader& r = **reader;
  ASSERT_EQ(r.arrays().size(), arrays.size());
  EXPECT_EQ(r.commit_record().process_count, 1);
  coverage_.chunks += r.index().entries.size();
  coverage_.multi_file += r.index().files.size() > 1;
  for (const TestArray& a : arrays) {
    coverage_.dtypes.insert(a.spec.dtype);
    coverage_.ranks.insert(static_cast<int>(a.spec.shape.size()));
    coverage_.zero_size += Box::FromShape(a.spec.shape).empty();
    coverage_.zstd += a.spec.codec == Codec::kZstd;
    bool uneven = false, replicated = false;
    for (const test::DeviceShard& d : test::ShardArray(a.spec.shape, a.sharding)) {
      replicated = replicated || d.num_replicas > 1;
      for (size_t k = 0; k < d.box.shape.size(); ++k) {
        uneven = uneven || (d.box.shape[k] != 0 && d.box.shape[k] != a.spec.shape[k] &&
                            a.spec.shape[k] % d.box.shape[k] != 0);
      }
    }
    coverage_.uneven += uneven;
    coverage_.replicated += replicated;
  }

  uint64_t raw_total = 0;
  for (size_t i = 0; i < arrays.size(); ++i) {
    const TestArray& a = arrays[i];
    Result<const ArrayMetadata*> meta = r.FindArray(a.spec.path);
    TS_ASSERT_OK(meta.status());
    EXPECT_EQ((*meta)->dtype, a.spec.dtype);
    EXPECT_EQ((*meta)->shape(), a.spec.shape);
    EXPECT_EQ((*meta)->codec, a.spec.codec);
    const Box whole = Box::FromShape(a.spec.shape);
    const uint64_t raw = static_cast<uint64_t>(whole.num_elements()) * ItemSize(a.spec.dtype);
    raw_total += raw;
    if (a.spec.codec == Codec::kNone) {
      EXPECT_EQ(r.StoredBytes(i), raw);
    }

    ExpectRead(&r, a, whole, a.spec.dtype, "whole array");
    for (int k = 0; k < 3; ++k) {
      ExpectRead(&r, a, test::RandomBox(a.spec.shape, k == 0 ? 0 : 3, rng), a.spec.dtype,
                 StrCat("random box ", k));
    }

    // Restore onto another layout: every device's box in one ReadMany.
    const Sharding target = test::RandomSharding(static_cast<int>(a.spec.shape.size()), 8, rng);
    SCOPED_TRACE(StrCat("reshard to ", target.ToString()));
    std::vector<test::DeviceShard> devices = test::ShardArray(a.spec.shape, target);
    std::vector<std::vector<char>> buffers;
    std::vector<ReadRequest> requests;
    buffers.reserve(devices.size());
    for (const test::DeviceShard& d : devices) {
      buffers.emplace_back(static_cast<size_t>(d.box.num_elements()) * ItemSize(a.spec.dtype),
                           static_cast<char>(0x5a));
      requests.push_back({a.spec.path, d.box, a.spec.dtype, buffers.back().data()});
    }
    TS_ASSERT_OK(r.ReadMany(requests));
    for (size_t d = 0; d < devices.size(); ++d) {
      EXPECT_TRUE(
          BytesEqual(MakeBoxData(a.spec.dtype, a.spec.shape, a.seed, devices[d].box), buffers[d]))
          << "device " << d << " box " << devices[d].box.ToString();
    }
  }
  EXPECT_EQ(stats.raw_bytes, raw_total);
  Result<std::vector<BadChunk>> bad = r.Verify();
  TS_ASSERT_OK(bad.status());
  EXPECT_TRUE(bad->empty());
}

TEST_P(CheckpointRoundTripTest, RandomArraysEveryDTypeAndRank) {
  // 6 x 17 cases: every dtype several times, every rank 0-8 many times.
  constexpr int kCases = 6 * 17;
  for (int c = 0; c < kCases; ++c) {
    RunRandomCase(c);
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(coverage_.dtypes.size(), static_cast<size_t>(kNumDTypes));
  EXPECT_EQ(coverage_.ranks, (std::set<int>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_GE(coverage_.zero_size, 5);
  EXPECT_GE(coverage_.zstd, 20);
  EXPECT_GE(coverage_.uneven, 20);
  EXPECT_GE(coverage_.replicated, 20);
  EXPECT_GE(coverage_.multi_file, 10);
  EXPECT_GE(coverage_.chunks, 2000u);
  std::cout << "random cases: " << coverage_.chunks << " chunks, " << coverage_.zero_size
            << " zero-size, " << coverage_.zstd << " zstd, " << coverage_.uneven << " uneven, "
            << coverage_.replicated << " replicated arrays, " << coverage_.multi_file
            << " multi-file steps\n";
  // Nothing but complete steps is left.
  EXPECT_THAT(KeysOutside({"run/"}), ::testing::IsEmpty());
  Result<std::vector<std::string>> keys = kv_->List("run/");
  TS_ASSERT_OK(keys.status());
  for (const std::string& key : *keys) EXPECT_FALSE(IsTemporaryStepName(key)) << key;
}

TEST_P(CheckpointRoundTripTest, ZeroDimensionalAndZeroSizeArrays) {
  std::vector<TestArray> arrays = {
      {{"scalar", DType::kFloat64, {}}, 1, test::Replicated(0, 4)},
      {{"scalar_c", DType::kComplex128, {}, Codec::kZstd}, 2, test::Replicated(0, 1)},
      {{"empty1", DType::kInt32, {0}}, 3, {{4}, {0}}},
      {{"empty3", DType::kBfloat16, {3, 0, 5}}, 4, {{2, 2}, {0, 1, -1}}},
      {{"empty_last", DType::kUint8, {7, 6, 0}}, 5, {{3}, {-1, 0, -1}}},
      {{"tiny", DType::kBool, {1}}, 6, {{4}, {0}}},  // shards 1..3 are empty
  };
  WriterOptions options;
  options.sync = false;
  TS_ASSERT_OK(SaveArrays(kv_.get(), "zero", arrays, options));
  Result<std::unique_ptr<CheckpointReader>> reader = Open("zero");
  TS_ASSERT_OK(reader.status());
  for (const TestArray& a : arrays) {
    ExpectRead(reader->get(), a, Box::FromShape(a.spec.shape), a.spec.dtype, "whole");
    // A box wholly past the shape (or of a 0-d array, the only element) reads as zeros.
    Box past = Box::FromShape(a.spec.shape);
    for (size_t d = 0; d < past.shape.size(); ++d) {
      past.origin[d] = a.spec.shape[d] + 1;
      past.shape[d] = 2;
    }
    ExpectRead(reader->get(), a, past, a.spec.dtype, "past the end");
  }
  EXPECT_EQ((*reader)->StoredBytes(2), 0u);
  EXPECT_EQ((*reader)->StoredBytes(3), 0u);
}

TEST_P(CheckpointRoundTripTest, TargetBoxesSubBoxesPastTheShapeAndWhole) {
  const TestArray a{{"w", DType::kFloat16, {37, 23}}, 99, {{3, 2}, {0, 1}}};
  WriterOptions options;
  options.sync = false;
  options.target_chunk_bytes = 40;  // shards of ~13x12 float16 become many chunks
  TS_ASSERT_OK(SaveArrays(kv_.get(), "boxes", {a}, options));
  Result<std::unique_ptr<CheckpointReader>> reader = Open("boxes");
  TS_ASSERT_OK(reader.status());
  EXPECT_GT((*reader)->index().entries.size(), 20u);
  ExpectRead(reader->get(), a, Box::FromShape({37, 23}), DType::kFloat16, "whole");
  ExpectRead(reader->get(), a, Box({5, 7}, {1, 1}), DType::kFloat16, "one element");
  ExpectRead(reader->get(), a, Box({11, 3}, {20, 17}), DType::kFloat16, "sub-box");
  ExpectRead(reader->get(), a, Box({30, 20}, {15, 9}), DType::kFloat16, "past the corner");
  ExpectRead(reader->get(), a, Box({0, 0}, {50, 40}), DType::kFloat16, "larger than the array");
  ExpectRead(reader->get(), a, Box({40, 30}, {2, 2}), DType::kFloat16, "wholly outside");
  ExpectRead(reader->get(), a, Box({3, 3}, {0, 5}), DType::kFloat16, "empty box");
  std::mt19937_64 rng(7);
  for (int k = 0; k < 40; ++k) {
    ExpectRead(reader->get(), a, test::RandomBox(a.spec.shape, 6, rng), DType::kFloat16,
               StrCat("random ", k));
  }
  // Bad requests.
  std::vector<char> buffer(64);
  Status status = (*reader)->Read({"w", Box({0}, {2}), DType::kFloat16, buffer.data()});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("'w'"));
  status = (*reader)->Read({"w", Box({-1, 0}, {2, 2}), DType::kFloat16, buffer.data()});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  status = (*reader)->Read({"nope", Box({0, 0}, {2, 2}), DType::kFloat16, buffer.data()});
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(status.message(), HasSubstr("nope"));
}

TEST_P(CheckpointRoundTripTest, ManySmallChunksAndDataFiles) {
  const TestArray a{{"big", DType::kInt16, {64, 48, 5}}, 5, {{2, 4}, {1, 0, -1}}};
  WriterOptions options;
  options.sync = false;
  options.target_chunk_bytes = 16;
  options.target_data_file_bytes = 1000;
  WriteStats stats;
  TS_ASSERT_OK(SaveArrays(kv_.get(), "many", {a}, options, nullptr, &stats));
  Result<std::unique_ptr<CheckpointReader>> reader = Open("many");
  TS_ASSERT_OK(reader.status());
  const ChunkIndex& index = (*reader)->index();
  EXPECT_GE(index.entries.size(), 64u * 48 * 5 * 2 / 16);
  EXPECT_GT(index.files.size(), 10u);
  EXPECT_EQ(stats.chunks, index.entries.size());
  EXPECT_EQ(stats.data_files, index.files.size());
  for (const IndexEntry& e : index.entries) EXPECT_LE(e.length, 16u);
  ExpectRead(reader->get(), a, Box::FromShape(a.spec.shape), DType::kInt16, "whole");
  ExpectRead(reader->get(), a, Box({3, 5, 1}, {50, 30, 3}), DType::kInt16, "sub-box");
}

TEST_P(CheckpointRoundTripTest, ZstdCompressesAndRoundTrips) {
  // Compressible contents: small repeating values.
  const std::vector<int64_t> shape = {256, 96};
  std::vector<int32_t> data(256 * 96);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<int32_t>(i % 13);
  ArraySpec spec{"z", DType::kInt32, shape, Codec::kZstd, 5, 0};
  std::vector<ShardData> shards;
  for (int s = 0; s < 4; ++s) {  // row blocks of 64
    shards.push_back({Box({64 * s, 0}, {64, 96}), data.data() + 64 * 96 * s, 0, 1});
  }
  WriterOptions options;
  options.sync = false;
  options.target_chunk_bytes = 4096;
  Result<std::unique_ptr<CheckpointWriter>> writer =
      CheckpointWriter::Create(kv_.get(), "z", options);
  TS_ASSERT_OK(writer.status());
  TS_ASSERT_OK((*writer)->AddArray(spec, shards));
  // A random (incompressible) zstd array next to it.
  const TestArray noise{
      {"noise", DType::kFloat32, {33, 17}, Codec::kZstd, 1, 128}, 4, {{2}, {-1, 0}}};
  HeldShards held = test::HoldAllShards(noise.spec, noise.seed, noise.sharding);
  TS_ASSERT_OK((*writer)->AddArray(noise.spec, held.shards));
  WriteStats stats;
  TS_ASSERT_OK((*writer)->Commit(&stats));
  EXPECT_LT(stats.stored_bytes, stats.raw_bytes);

  Result<std::unique_ptr<CheckpointReader>> reader = Open("z");
  TS_ASSERT_OK(reader.status());
  EXPECT_LT((*reader)->StoredBytes(0), data.size() * 4 / 8);
  std::vector<int32_t> got(data.size(), -1);
  TS_ASSERT_OK((*reader)->Read({"z", Box::FromShape(shape), DType::kInt32, got.data()}));
  EXPECT_EQ(got, data);
  std::vector<int32_t> part(10 * 20, -1);
  TS_ASSERT_OK((*reader)->Read({"z", Box({60, 70}, {10, 20}), DType::kInt32, part.data()}));
  for (int i = 0; i < 10; ++i) {
    for (int j = 0; j < 20; ++j) ASSERT_EQ(part[i * 20 + j], data[(60 + i) * 96 + 70 + j]);
  }
  ExpectRead(reader->get(), noise, Box::FromShape(noise.spec.shape), DType::kFloat32, "noise");
  ExpectRead(reader->get(), noise, Box({5, 5}, {30, 30}), DType::kFloat32, "noise past end");
}

// Replicas of a shard hold different bytes here, so the restored data shows which replica
// wrote each chunk.
TEST_P(CheckpointRoundTripTest, ReplicatedShardsSplitOnAndOff) {
  const std::vector<int64_t> shape = {40, 12};
  const int replicas = 3;
  for (bool split : {false, true}) {
    SCOPED_TRACE(StrCat("split_replicated_writes ", split));
    ArraySpec spec{"r", DType::kUint32, shape, Codec::kNone, 0, 192};  // 4-row chunks
    std::vector<std::vector<char>> buffers;
    std::vector<ShardData> shards;
    buffers.reserve(2 * replicas);
    for (int half = 0; half < 2; ++half) {
      const Box box({20 * half, 0}, {20, 12});
      for (int replica = 0; replica < replicas; ++replica) {
        buffers.push_back(MakeBoxData(spec.dtype, shape, 100 + replica, box));
        shards.push_back({box, buffers.back().data(), replica, replicas});
      }
    }
    WriterOptions options;
    options.sync = false;
    options.split_replicated_writes = split;
    const std::string dir = split ? "split_on" : "split_off";
    Result<std::unique_ptr<CheckpointWriter>> writer =
        CheckpointWriter::Create(kv_.get(), dir, options);
    TS_ASSERT_OK(writer.status());
    TS_ASSERT_OK((*writer)->AddArray(spec, shards));
    WriteStats stats;
    TS_ASSERT_OK((*writer)->Commit(&stats));
    EXPECT_EQ(stats.raw_bytes, 40u * 12 * 4);  // each chunk once, whoever wrote it
    Result<std::unique_ptr<CheckpointReader>> reader = Open(dir);
    TS_ASSERT_OK(reader.status());
    const ArrayMetadata& meta = (*reader)->arrays()[0];
    ASSERT_EQ(meta.grid.NumStoredChunks(), 10);
    std::set<int> writers;
    for (int64_t chunk = 0; chunk < meta.grid.NumChunks(); ++chunk) {
      const Box box = meta.grid.ChunkBox(chunk);
      std::vector<char> got(static_cast<size_t>(box.num_elements()) * 4);
      TS_ASSERT_OK((*reader)->Read({"r", box, DType::kUint32, got.data()}));
      int from = -1;
      for (int replica = 0; replica < replicas; ++replica) {
        if (got == MakeBoxData(spec.dtype, shape, 100 + replica, box)) from = replica;
      }
      ASSERT_NE(from, -1) << "chunk " << box.ToString() << " matches no replica";
      writers.insert(from);
    }
    if (split) {
      EXPECT_EQ(writers, (std::set<int>{0, 1, 2})) << "every replica writes a share";
    } else {
      EXPECT_EQ(writers, (std::set<int>{0})) << "only replica 0 writes";
    }
  }
}

TEST_P(CheckpointRoundTripTest, DTypeCastOnRead) {
  const std::vector<TestArray> arrays = {
      {{"f32", DType::kFloat32, {33, 10}}, 1, {{2}, {0, -1}}},
      {{"i32", DType::kInt32, {50}}, 2, {{3}, {0}}},
      {{"i64", DType::kInt64, {20}}, 3, {{2}, {0}}},
      {{"u8", DType::kUint8, {17}}, 4, {{1}, {-1}}},
      {{"c64", DType::kComplex64, {9}, Codec::kZstd}, 5, {{2}, {0}}},
  };
  WriterOptions options;
  options.sync = false;
  options.target_chunk_bytes = 64;
  TS_ASSERT_OK(SaveArrays(kv_.get(), "cast", arrays, options));
  Result<std::unique_ptr<CheckpointReader>> reader = Open("cast");
  TS_ASSERT_OK(reader.status());
  CheckpointReader* r = reader->get();
  ExpectRead(r, arrays[0], Box::FromShape({33, 10}), DType::kBfloat16, "f32->bf16");
  ExpectRead(r, arrays[0], Box({3, 2}, {40, 5}), DType::kBfloat16, "f32->bf16 past end");
  ExpectRead(r, arrays[0], Box::FromShape({33, 10}), DType::kFloat64, "f32->f64");
  ExpectRead(r, arrays[0], Box::FromShape({33, 10}), DType::kFloat8E4m3fn, "f32->f8");
  ExpectRead(r, arrays[1], Box::FromShape({50}), DType::kInt64, "i32->i64");
  ExpectRead(r, arrays[1], Box({7}, {60}), DType::kFloat64, "i32->f64");
  ExpectRead(r, arrays[3], Box::FromShape({17}), DType::kInt16, "u8->i16");
  ExpectRead(r, arrays[4], Box::FromShape({9}), DType::kComplex128, "c64->c128");

  // Random int64 values do not fit int8: InvalidArgument naming the array.
  std::vector<int8_t> small(20);
  Status status = r->Read({"i64", Box::FromShape({20}), DType::kInt8, small.data()});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("i64"));
  // No float -> int conversion.
  std::vector<int32_t> ints(33 * 10);
  status = r->Read({"f32", Box::FromShape({33, 10}), DType::kInt32, ints.data()});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("f32"));
}

// A tree with awkward keys and every kind of leaf, and array paths that escape the keys.
TEST_P(CheckpointRoundTripTest, CustomTreeSurvivesRoundTrip) {
  auto leaf = [](TreeNode::Kind kind) {
    TreeNode node;
    node.kind = kind;
    return node;
  };
  auto int_leaf = [&](std::string value) {
    TreeNode node = leaf(TreeNode::Kind::kInt);
    node.int_value = std::move(value);
    return node;
  };
  auto float_leaf = [&](double value) {
    TreeNode node = leaf(TreeNode::Kind::kFloat);
    node.float_value = value;
    return node;
  };
  auto string_leaf = [&](TreeNode::Kind kind, std::string value) {
    TreeNode node = leaf(kind);
    node.string_value = std::move(value);
    return node;
  };
  auto bool_leaf = [&](bool value) {
    TreeNode node = leaf(TreeNode::Kind::kBool);
    node.bool_value = value;
    return node;
  };
  const std::string unicode = "p\xc3\xa4r\xc3\xa4m \xe2\x88\x82 \xf0\x9f\x9a\x80";  // "päräm ∂ 🚀"
  const std::vector<TestArray> arrays = {
      {{"a~1b", DType::kFloat32, {5, 3}}, 1, {{2}, {0, -1}}},
      {{"~0tilde/x", DType::kInt8, {4}}, 2, {{1}, {-1}}},
      {{unicode, DType::kBfloat16, {}}, 3, test::Replicated(0, 2)},
      {{"/", DType::kUint16, {6}}, 4, {{2}, {0}}},  // key "" under key ""
      {{"list/0", DType::kFloat64, {2, 2}}, 5, {{1}, {-1, -1}}},
      {{"tuple/5/1", DType::kBool, {9}}, 6, {{3}, {0}}},
  };
  TreeNode root = TreeNode::Dict();
  root.entries.emplace_back("a/b", TreeNode::Array(0));
  TreeNode tilde = TreeNode::Dict();
  tilde.entries.emplace_back("x", TreeNode::Array(1));
  root.entries.emplace_back("~tilde", tilde);
  root.entries.emplace_back(unicode, TreeNode::Array(2));
  TreeNode empty_key = TreeNode::Dict();
  empty_key.entries.emplace_back("", TreeNode::Array(3));
  root.entries.emplace_back("", empty_key);
  TreeNode list = leaf(TreeNode::Kind::kList);
  list.items = {TreeNode::Array(4),
                leaf(TreeNode::Kind::kNone),
                int_leaf("123456789012345678901234567890123456789012345678901234567890"),
                int_leaf("-98765432109876543210987654321"),
                int_leaf("0"),
                float_leaf(std::numeric_limits<double>::quiet_NaN()),
                float_leaf(std::numeric_limits<double>::infinity()),
                float_leaf(-std::numeric_limits<double>::infinity()),
                float_leaf(-0.0),
                float_leaf(0.1),
                float_leaf(std::numeric_limits<double>::denorm_min()),
                float_leaf(std::numeric_limits<double>::max()),
                float_leaf(-1.0 / 3.0)};
  root.entries.emplace_back("list", list);
  TreeNode tuple = leaf(TreeNode::Kind::kTuple);
  TreeNode inner = leaf(TreeNode::Kind::kTuple);
  inner.items = {leaf(TreeNode::Kind::kNone), TreeNode::Array(5)};
  tuple.items = {bool_leaf(true),
                 bool_leaf(false),
                 string_leaf(TreeNode::Kind::kString, std::string("h\xc3\xa9llo\0 \"q\" \\", 13)),
                 string_leaf(TreeNode::Kind::kBytes, std::string("\0\xff\x80raw\n", 7)),
                 string_leaf(TreeNode::Kind::kString, ""),
                 inner,
                 leaf(TreeNode::Kind::kList),
                 TreeNode::Dict(),
                 string_leaf(TreeNode::Kind::kBytes, "")};
  root.entries.emplace_back("tuple", tuple);
  root.entries.emplace_back("none", leaf(TreeNode::Kind::kNone));

  WriterOptions options;
  options.sync = false;
  TS_ASSERT_OK(SaveArrays(kv_.get(), "tree", arrays, options, &root));
  Result<std::unique_ptr<CheckpointReader>> reader = Open("tree");
  TS_ASSERT_OK(reader.status());
  std::string why;
  EXPECT_TRUE(test::TreesEqual(root, (*reader)->tree(), "", &why)) << why;
  ASSERT_EQ((*reader)->arrays().size(), arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) {
    EXPECT_EQ((*reader)->arrays()[i].path, arrays[i].spec.path);
    Result<std::vector<std::string>> keys = SplitArrayPath(arrays[i].spec.path);
    TS_ASSERT_OK(keys.status());
    ExpectRead(reader->get(), arrays[i], Box::FromShape(arrays[i].spec.shape), arrays[i].spec.dtype,
               "tree leaf");
  }
  EXPECT_EQ(*SplitArrayPath("a~1b"), std::vector<std::string>{"a/b"});
  EXPECT_EQ(*SplitArrayPath("/"), (std::vector<std::string>{"", ""}));
}

TEST_P(CheckpointRoundTripTest, InvalidCustomTreesAreRefused) {
  const std::vector<TestArray> arrays = {{{"x", DType::kInt32, {3}}, 1, {{1}, {-1}}},
                                         {{"y", DType::kInt32, {3}}, 2, {{1}, {-1}}}};
  WriterOptions options;
  options.sync = false;
  struct Case {
    std::string name;
    TreeNode tree;
  };
  std::vector<Case> cases;
  {
    TreeNode t = TreeNode::Dict();
    t.entries.emplace_back("x", TreeNode::Array(0));
    t.entries.emplace_back("y", TreeNode::Array(0));  // array 0 twice, array 1 never
    cases.push_back({"array referenced twice", t});
  }
  {
    TreeNode t = TreeNode::Dict();
    t.entries.emplace_back("x", TreeNode::Array(0));
    t.entries.emplace_back("y", TreeNode::Array(7));
    cases.push_back({"array out of range", t});
  }
  {
    TreeNode t = TreeNode::Dict();
    t.entries.emplace_back("x", TreeNode::Array(0));
    t.entries.emplace_back("bad \xff\xfe utf-8", TreeNode::Array(1));
    cases.push_back({"invalid UTF-8 key", t});
  }
  {
    TreeNode t = TreeNode::Dict();
    t.entries.emplace_back("x", TreeNode::Array(0));
    t.entries.emplace_back("x", TreeNode::Array(1));
    cases.push_back({"duplicate key", t});
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    const std::string dir = StrCat("bad", i);
    const Status status = SaveArrays(kv_.get(), dir, arrays, options, &cases[i].tree);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    Result<std::unique_ptr<CheckpointReader>> reader = Open(dir);
    EXPECT_FALSE(reader.ok());
  }
  EXPECT_THAT(KeysOutside({}), ::testing::IsEmpty()) << "a failed save leaves nothing behind";
}

TEST_P(CheckpointRoundTripTest, OverwriteFalseKeepsTheOldStep) {
  const TestArray old_array{{"w", DType::kFloat32, {10, 10}}, 1, {{2}, {0, -1}}};
  WriterOptions options;
  options.sync = false;
  TS_ASSERT_OK(SaveArrays(kv_.get(), "ckpt/0001", {old_array}, options));
  const TestArray new_array{{"w", DType::kFloat32, {10, 10}}, 2, {{2}, {0, -1}}};
  const Status status = SaveArrays(kv_.get(), "ckpt/0001", {new_array}, options);
  EXPECT_EQ(status.code(), absl::StatusCode::kAlreadyExists) << status;
  EXPECT_THAT(status.message(), HasSubstr("ckpt/0001"));
  Result<std::unique_ptr<CheckpointReader>> reader = Open("ckpt/0001");
  TS_ASSERT_OK(reader.status());
  ExpectRead(reader->get(), old_array, Box::FromShape({10, 10}), DType::kFloat32, "old step");
  Result<std::vector<BadChunk>> bad = (*reader)->Verify();
  TS_ASSERT_OK(bad.status());
  EXPECT_TRUE(bad->empty());
  EXPECT_THAT(KeysOutside({"ckpt/0001/"}), ::testing::IsEmpty());
}

TEST_P(CheckpointRoundTripTest, OverwriteTrueReplacesTheStep) {
  WriterOptions options;
  options.sync = GetParam() == StoreKind::kFile;
  const std::vector<TestArray> old_arrays = {{{"w", DType::kFloat32, {10, 10}}, 1, {{2}, {0, -1}}},
                                             {{"gone", DType::kInt8, {1000}}, 2, {{4}, {0}}}};
  TS_ASSERT_OK(SaveArrays(kv_.get(), "ckpt/0002", old_arrays, options));
  options.overwrite = true;
  const std::vector<TestArray> new_arrays = {{{"w", DType::kFloat64, {7, 3}}, 3, {{3}, {-1, 0}}},
                                             {{"new", DType::kInt64, {5}}, 4, {{1}, {-1}}}};
  TS_ASSERT_OK(SaveArrays(kv_.get(), "ckpt/0002", new_arrays, options));
  Result<std::unique_ptr<CheckpointReader>> reader = Open("ckpt/0002");
  TS_ASSERT_OK(reader.status());
  ASSERT_EQ((*reader)->arrays().size(), 2u);
  for (const TestArray& a : new_arrays) {
    ExpectRead(reader->get(), a, Box::FromShape(a.spec.shape), a.spec.dtype, "new step");
  }
  EXPECT_EQ((*reader)->FindArray("gone").status().code(), absl::StatusCode::kNotFound);
  // Overwriting a missing step is a plain save.
  TS_ASSERT_OK(SaveArrays(kv_.get(), "ckpt/0003", new_arrays, options));
  // No temporary or moved-aside folder, no stale data file of the old step.
  EXPECT_THAT(KeysOutside({"ckpt/0002/", "ckpt/0003/"}), ::testing::IsEmpty());
  Result<std::vector<std::string>> keys = kv_->List("ckpt/0002/");
  TS_ASSERT_OK(keys.status());
  std::set<std::string> expected_files = {"ckpt/0002/COMMIT", "ckpt/0002/state/index",
                                          "ckpt/0002/state/tree.json"};
  for (const DataFileInfo& f : (*reader)->index().files) {
    expected_files.insert(StrCat("ckpt/0002/state/", f.name));
  }
  EXPECT_EQ(std::set<std::string>(keys->begin(), keys->end()), expected_files);
}

// The staging cap holds when every chunk is smaller than the cap, however the read coalesces.
TEST_P(CheckpointRoundTripTest, ByteLimiterCapIsRespected) {
  const TestArray a{{"w", DType::kFloat32, {256, 128}}, 11, {{4, 2}, {0, 1}}};
  WriterOptions options;
  options.sync = false;
  options.target_chunk_bytes = 2048;
  TS_ASSERT_OK(SaveArrays(kv_.get(), "cap", {a}, options));
  for (uint64_t cap : {uint64_t{4096}, uint64_t{10000}, uint64_t{64} << 10}) {
    SCOPED_TRACE(StrCat("cap ", cap));
    ReaderOptions read_options;
    read_options.max_inflight_bytes = cap;
    read_options.io_threads = 4;
    Result<std::unique_ptr<CheckpointReader>> reader = Open("cap", read_options);
    TS_ASSERT_OK(reader.status());
    for (const IndexEntry& e : (*reader)->index().entries) ASSERT_LE(e.length, cap);
    // A layout whose boxes cut across the stored chunks: nothing can be read in place.
    const Sharding target{{3, 5}, {0, 1}};
    std::vector<test::DeviceShard> devices = test::ShardArray(a.spec.shape, target);
    std::vector<std::vector<char>> buffers;
    std::vector<ReadRequest> requests;
    buffers.reserve(devices.size());
    for (const test::DeviceShard& d : devices) {
      buffers.emplace_back(static_cast<size_t>(d.box.num_elements()) * 4);
      requests.push_back({"w", d.box, DType::kFloat32, buffers.back().data()});
    }
    ReadStats stats;
    TS_ASSERT_OK((*reader)->ReadMany(requests, &stats));
    EXPECT_GT(stats.staged_chunks, 0u);
    EXPECT_GT(stats.peak_staging_bytes, 0u);
    EXPECT_LE(stats.peak_staging_bytes, cap);
    for (size_t d = 0; d < devices.size(); ++d) {
      EXPECT_TRUE(
          BytesEqual(MakeBoxData(a.spec.dtype, a.spec.shape, a.seed, devices[d].box), buffers[d]));
    }
    // An unaligned box too.
    std::vector<char> odd(100 * 77 * 4);
    TS_ASSERT_OK(
        (*reader)->Read({"w", Box({13, 29}, {100, 77}), DType::kFloat32, odd.data()}, &stats));
    EXPECT_LE(stats.peak_staging_bytes, cap);
    EXPECT_TRUE(
        BytesEqual(MakeBoxData(a.spec.dtype, a.spec.shape, a.seed, Box({13, 29}, {100, 77})), odd));
  }
}

// With zstd a staged chunk also needs room to decode into; the cap covers both.
TEST_P(CheckpointRoundTripTest, ByteLimiterCapCoversDecoding) {
  const TestArray a{{"z", DType::kInt16, {200, 64}, Codec::kZstd}, 13, {{2, 2}, {0, 1}}};
  WriterOptions options;
  options.sync = false;
  options.target_chunk_bytes = 1024;  // stored ~1 KiB, decoded 1 KiB
  TS_ASSERT_OK(SaveArrays(kv_.get(), "capz", {a}, options));
  for (uint64_t cap : {uint64_t{3000}, uint64_t{10000}, uint64_t{50000}}) {
    SCOPED_TRACE(StrCat("cap ", cap));
    ReaderOptions read_options;
    read_options.max_inflight_bytes = cap;
    read_options.io_threads = 4;
    Result<std::unique_ptr<CheckpointReader>> reader = Open("capz", read_options);
    TS_ASSERT_OK(reader.status());
    for (const IndexEntry& e : (*reader)->index().entries) ASSERT_LE(e.length + 1024, cap);
    const Box box({7, 3}, {180, 60});
    std::vector<char> got(static_cast<size_t>(box.num_elements()) * 2);
    ReadStats stats;
    TS_ASSERT_OK((*reader)->Read({"z", box, DType::kInt16, got.data()}, &stats));
    EXPECT_GT(stats.staged_chunks, 1u);
    EXPECT_LE(stats.peak_staging_bytes, cap);
    EXPECT_TRUE(BytesEqual(MakeBoxData(a.spec.dtype, a.spec.shape, a.seed, box), got));
  }
}

TEST_P(CheckpointRoundTripTest, SameLayoutReadsDirectly) {
  // Row blocks (replicated twice), so that the chunks of a shard lie side by side in the file.
  const TestArray a{{"w", DType::kBfloat16, {120, 64}}, 12, {{4, 2}, {0, -1}}};
  WriterOptions options;
  options.sync = false;
  options.target_chunk_bytes = 1024;
  TS_ASSERT_OK(SaveArrays(kv_.get(), "direct", {a}, options));
  Result<std::unique_ptr<CheckpointReader>> reader = Open("direct");
  TS_ASSERT_OK(reader.status());
  const size_t num_chunks = (*reader)->index().entries.size();
  EXPECT_GT(num_chunks, 4u);
  // Each distinct saved shard (replica 0 of each box), in the saved dtype.
  std::vector<test::DeviceShard> devices = test::ShardArray(a.spec.shape, a.sharding);
  std::vector<std::vector<char>> buffers;
  std::vector<ReadRequest> requests;
  std::vector<Box> boxes;
  buffers.reserve(devices.size());
  for (const test::DeviceShard& d : devices) {
    if (d.replica_id != 0) continue;
    buffers.emplace_back(static_cast<size_t>(d.box.num_elements()) * 2);
    requests.push_back({"w", d.box, DType::kBfloat16, buffers.back().data()});
    boxes.push_back(d.box);
  }
  ReadStats stats;
  TS_ASSERT_OK((*reader)->ReadMany(requests, &stats));
  EXPECT_EQ(stats.direct_chunks, num_chunks);
  EXPECT_EQ(stats.staged_chunks, 0u);
  EXPECT_EQ(stats.peak_staging_bytes, 0u);
  EXPECT_EQ(stats.bytes_read, 120u * 64 * 2);
  EXPECT_LT(stats.requests, num_chunks) << "neighbouring chunks are fetched together";
  for (size_t i = 0; i < boxes.size(); ++i) {
    EXPECT_TRUE(BytesEqual(MakeBoxData(a.spec.dtype, a.spec.shape, a.seed, boxes[i]), buffers[i]));
  }
  // A different dtype or layout goes through staging.
  std::vector<char> cast(120 * 64 * 4);
  TS_ASSERT_OK(
      (*reader)->Read({"w", Box::FromShape({120, 64}), DType::kFloat32, cast.data()}, &stats));
  EXPECT_EQ(stats.direct_chunks, 0u);
  EXPECT_EQ(stats.staged_chunks, num_chunks);
}

// A KvStore that logs every mutating call (and syncs) before passing it on, and can make the
// n-th of them fail instead (fault injection).
class RecordingKvStore final : public ForwardingKvStore {
 public:
  explicit RecordingKvStore(KvStore* base) : ForwardingKvStore(base) {}

  std::vector<std::string> log() {
    std::lock_guard<std::mutex> lock(mutex_);
    return log_;
  }
  // The `n`-th logged call (0-based) fails with Unknown and is not passed on.
  void FailAt(size_t n) { fail_at_ = n; }
  Status Record(std::string entry) {
    std::lock_guard<std::mutex> lock(mutex_);
    log_.push_back(entry);
    if (log_.size() - 1 == fail_at_) return UnknownError(StrCat("injected fault: ", entry));
    return OkStatus();
  }

  Status Write(std::string_view key, std::string_view value) override {
    TS_RETURN_IF_ERROR(Record(StrCat("write ", key)));
    return base()->Write(key, value);
  }
  Result<std::unique_ptr<WritableFile>> OpenForWrite(std::string_view key) override {
    TS_RETURN_IF_ERROR(Record(StrCat("open ", key)));
    TS_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, base()->OpenForWrite(key));
    return std::unique_ptr<WritableFile>(new File(this, std::string(key), std::move(file)));
  }
  Status Delete(std::string_view key) override {
    TS_RETURN_IF_ERROR(Record(StrCat("delete ", key)));
    return base()->Delete(key);
  }
  Status DeletePrefix(std::string_view prefix) override {
    TS_RETURN_IF_ERROR(Record(StrCat("deleteprefix ", prefix)));
    return base()->DeletePrefix(prefix);
  }
  Status RenameDirectory(std::string_view from, std::string_view to) override {
    TS_RETURN_IF_ERROR(Record(StrCat("rename ", from, " ", to)));
    return base()->RenameDirectory(from, to);
  }
  Status Sync(std::string_view key) override {
    TS_RETURN_IF_ERROR(Record(StrCat("sync ", key)));
    return base()->Sync(key);
  }
  Status SyncDirectory(std::string_view dir) override {
    TS_RETURN_IF_ERROR(Record(StrCat("syncdir ", dir)));
    return base()->SyncDirectory(dir);
  }

 private:
  class File final : public WritableFile {
   public:
    File(RecordingKvStore* store, std::string key, std::unique_ptr<WritableFile> base)
        : store_(store), key_(std::move(key)), base_(std::move(base)) {}
    Status WriteAt(uint64_t offset, const void* data, size_t size) override {
      TS_RETURN_IF_ERROR(store_->Record(StrCat("writeat ", key_)));
      return base_->WriteAt(offset, data, size);
    }
    Status Sync() override {
      TS_RETURN_IF_ERROR(store_->Record(StrCat("filesync ", key_)));
      return base_->Sync();
    }
    Status Close() override { return base_->Close(); }

   private:
    RecordingKvStore* store_;
    std::string key_;
    std::unique_ptr<WritableFile> base_;
  };

  std::mutex mutex_;
  std::vector<std::string> log_;
  size_t fail_at_ = static_cast<size_t>(-1);
};

bool IsMutation(const std::string& entry) {
  for (const char* op : {"write ", "open ", "writeat ", "delete ", "deleteprefix ", "rename "}) {
    if (entry.rfind(op, 0) == 0) return true;
  }
  return false;
}

// How the commit becomes visible: without rename, COMMIT is the last thing written (and an old
// COMMIT the first thing removed); with rename, nothing is written under the step's own name.
TEST_P(CheckpointRoundTripTest, CommitProtocolOrder) {
  RecordingKvStore recorder(kv_.get());
  const TestArray a{{"w", DType::kInt32, {64, 8}}, 3, {{4}, {0, -1}}};
  WriterOptions options;
  options.target_chunk_bytes = 256;
  options.target_data_file_bytes = 1024;
  for (bool overwrite : {false, true}) {
    SCOPED_TRACE(StrCat("overwrite ", overwrite));
    options.overwrite = overwrite;
    const size_t first = recorder.log().size();
    TS_ASSERT_OK(SaveArrays(&recorder, "run/0007", {a}, options));
    std::vector<std::string> log = recorder.log();
    log.erase(log.begin(), log.begin() + static_cast<std::ptrdiff_t>(first));
    auto find = [&](const std::string& entry) {
      return static_cast<size_t>(std::find(log.begin(), log.end(), entry) - log.begin());
    };
    const std::string commit = "run/0007/COMMIT";
    if (GetParam() == StoreKind::kMemoryNoRename) {
      const size_t commit_write = find("write " + commit);
      ASSERT_LT(commit_write, log.size());
      EXPECT_LT(find("write run/0007/state/index"), commit_write);
      EXPECT_LT(find("write run/0007/state/tree.json"), commit_write);
      EXPECT_LT(find("sync run/0007/state/index"), commit_write);
      EXPECT_LT(find("sync run/0007/state/tree.json"), commit_write);
      for (size_t i = commit_write + 1; i < log.size(); ++i) {
        EXPECT_FALSE(IsMutation(log[i])) << "after COMMIT: " << log[i];
      }
      size_t first_mutation = 0;
      while (first_mutation < log.size() && !IsMutation(log[first_mutation])) ++first_mutation;
      ASSERT_LT(first_mutation, log.size());
      if (overwrite) {
        EXPECT_EQ(log[first_mutation], "delete " + commit)
            << "the old step must become invisible before it is touched";
      }
      EXPECT_EQ(std::count(log.begin(), log.end(), "write " + commit), 1);
    } else {
      std::string rename_into_place;
      for (const std::string& entry : log) {
        // Only renames touch the step's own name; a complete step is never deleted in place
        // (an incomplete leftover may be).
        if (IsMutation(entry) && entry.rfind("rename ", 0) != 0 &&
            entry.rfind("deleteprefix run/0007.old-", 0) != 0 &&
            entry != "deleteprefix run/0007/") {
          EXPECT_EQ(entry.find("run/0007/"), std::string::npos) << entry;
        }
        if (overwrite) {
          EXPECT_NE(entry, "deleteprefix run/0007/");
        }
        if (entry.rfind("rename run/0007.tmp-", 0) == 0) rename_into_place = entry;
      }
      ASSERT_FALSE(rename_into_place.empty());
      const size_t rename_at = find(rename_into_place);
      // The temporary folder held a complete step (COMMIT synced) before the rename.
      const std::string temp = rename_into_place.substr(7, rename_into_place.find(' ', 7) - 7);
      EXPECT_LT(find(StrCat("sync ", temp, "/COMMIT")), rename_at);
      EXPECT_LT(rename_at, find("syncdir run"));
    }
    Result<std::unique_ptr<CheckpointReader>> reader = Open("run/0007");
    TS_ASSERT_OK(reader.status());
    ExpectRead(reader->get(), a, Box::FromShape(a.spec.shape), DType::kInt32, "after save");
  }
}

// Every store call of a save fails in turn. Whatever fails, the step is afterwards exactly one
// of: the old step, intact; the new step, complete; or (where the protocol allows) no step. An
// error means the new step did not become visible, unless the failure came after the commit
// point (a sync once COMMIT is written or the folder renamed into place).
TEST_P(CheckpointRoundTripTest, FaultAtEveryStoreCallLeavesAConsistentStep) {
  const TestArray old_array{{"w", DType::kInt32, {64, 8}}, 1, {{4}, {0, -1}}};
  const std::vector<TestArray> new_arrays = {
      {{"w", DType::kInt32, {64, 8}}, 2, {{2}, {0, -1}}},
      {{"x", DType::kInt8, {10}, Codec::kZstd}, 3, {{1}, {-1}}}};
  WriterOptions options;
  options.target_chunk_bytes = 256;
  options.target_data_file_bytes = 1024;
  options.io_threads = 2;
  const bool rename = GetParam() != StoreKind::kMemoryNoRename;
  enum Outcome { kOld, kNew, kNone };
  for (bool overwrite : {false, true}) {
    size_t faults = 0;
    for (size_t k = 0;; ++k) {
      SCOPED_TRACE(StrCat("overwrite ", overwrite, ", fault at call ", k));
      Result<std::unique_ptr<KvStore>> store =
          test::MakeStore(GetParam(), StrCat(temp_dir(), "/fault", overwrite, "-", k));
      TS_ASSERT_OK(store.status());
      options.overwrite = false;
      if (overwrite) {
        TS_ASSERT_OK(SaveArrays(store->get(), "s/0001", {old_array}, options));
      }
      RecordingKvStore faulty(store->get());
      faulty.FailAt(k);
      options.overwrite = overwrite;
      const Status status = SaveArrays(&faulty, "s/0001", new_arrays, options);
      const std::vector<std::string> log = faulty.log();
      const bool injected = k < log.size();
      const std::string failed = injected ? log[k] : "";
      SCOPED_TRACE(StrCat("failed call: ", failed, "; status: ", status.ToString()));
      // Where the step became visible, and where (without rename) the old one stopped being.
      size_t commit_at = log.size(), old_gone_at = log.size();
      for (size_t i = 0; i < log.size(); ++i) {
        if (rename ? log[i].rfind("rename s/0001.tmp-", 0) == 0 : log[i] == "write s/0001/COMMIT") {
          commit_at = std::min(commit_at, i);
        }
        if (log[i] == "delete s/0001/COMMIT") old_gone_at = std::min(old_gone_at, i);
      }
      std::set<Outcome> allowed;
      if (!injected || status.ok()) {
        allowed = {kNew};
      } else if (k > commit_at) {
        // A sync after the commit point failed: the new step may be visible, or be removed
        // again (the writer undoes the rename, putting back a replaced step, or without rename
        // deletes the folder it failed to make durable).
        allowed = {kNew, kNone};
        if (overwrite && rename) allowed.insert(kOld);
      } else if (!overwrite) {
        allowed = {kNone};
      } else if (rename) {
        allowed = {kOld};
      } else {
        allowed = {k <= old_gone_at ? kOld : kNone};
      }
      if (injected && failed.rfind("deleteprefix s/0001.old-", 0) == 0) {
        TS_EXPECT_OK(status) << "removing the replaced step is after the commit";
      }
      if (!injected) {
        TS_EXPECT_OK(status);
      }

      Outcome outcome = kNone;
      Result<std::unique_ptr<CheckpointReader>> reader =
          CheckpointReader::Open(store->get(), "s/0001");
      if (reader.ok()) {
        const TestArray& w = (*reader)->arrays().size() == 1 ? old_array : new_arrays[0];
        outcome = &w == &old_array ? kOld : kNew;
        std::vector<char> got(64 * 8 * 4);
        TS_ASSERT_OK((*reader)->Read({"w", Box::FromShape({64, 8}), DType::kInt32, got.data()}));
        EXPECT_TRUE(
            BytesEqual(MakeBoxData(DType::kInt32, {64, 8}, w.seed, Box::FromShape({64, 8})), got));
        Result<std::vector<BadChunk>> bad = (*reader)->Verify();
        TS_ASSERT_OK(bad.status());
        EXPECT_TRUE(bad->empty());
      } else {
        EXPECT_THAT(reader.status().code(), ::testing::AnyOf(absl::StatusCode::kNotFound,
                                                             absl::StatusCode::kFailedPrecondition))
            << reader.status();
      }
      EXPECT_EQ(allowed.count(outcome), 1u) << "outcome " << outcome << " (0 old, 1 new, 2 none)";
      if (!injected) break;
      ++faults;
    }
    EXPECT_GE(faults, 15u) << "the sweep covered too few calls";
  }
}

TEST_P(CheckpointRoundTripTest, WriterRefusesBadInput) {
  Result<std::unique_ptr<CheckpointWriter>> writer =
      CheckpointWriter::Create(kv_.get(), "step.tmp-1234", {});
  EXPECT_EQ(writer.status().code(), absl::StatusCode::kInvalidArgument);
  writer = CheckpointWriter::Create(kv_.get(), "../up", {});
  EXPECT_EQ(writer.status().code(), absl::StatusCode::kInvalidArgument);
  writer = CheckpointWriter::Create(kv_.get(), "ok", {});
  TS_ASSERT_OK(writer.status());
  std::vector<char> data(64);
  Status status = (*writer)->AddArray({"w", DType::kInt8, {4}}, {{Box({2}, {4}), data.data()}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("'w'"));
  status = (*writer)->AddArray({"v", DType::kInt8, {4}}, {{Box({0}, {4}), nullptr}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  status = (*writer)->AddArray({"u", DType::kInt8, {4}}, {{Box({0}, {4}), data.data(), 2, 2}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  status = (*writer)->AddArray({"bad~path", DType::kInt8, {4}}, {});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  status = (*writer)->AddArray({"neg", DType::kInt8, {-1}}, {});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  TS_ASSERT_OK((*writer)->AddArray({"t", DType::kInt8, {4}}, {{Box({0}, {4}), data.data()}}));
  status = (*writer)->AddArray({"t", DType::kInt8, {4}}, {{Box({0}, {4}), data.data()}});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  // A shard that does not cover the array: nothing is committed.
  TS_ASSERT_OK((*writer)->AddArray({"half", DType::kInt8, {8}}, {{Box({0}, {4}), data.data()}}));
  status = (*writer)->Commit();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("'half'"));
  EXPECT_EQ((*writer)->Commit().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(Open("ok").ok());
  EXPECT_THAT(KeysOutside({}), ::testing::IsEmpty());
}

INSTANTIATE_TEST_SUITE_P(CheckpointStores, CheckpointRoundTripTest,
                         ::testing::Values(StoreKind::kFile, StoreKind::kMemory,
                                           StoreKind::kMemoryNoRename),
                         [](const ::testing::TestParamInfo<StoreKind>& param_info) {
                           return test::StoreName(param_info.param);
                         });

}  // namespace
}  // namespace tensorstash
