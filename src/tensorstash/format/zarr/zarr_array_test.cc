// ZarrArray / ZarrArrayWriter on the memory KvStore: round trips for every dtype and layout,
// partial boxes, fill values, hand-made chunks whose byte layout is known, and hostile metadata
// and chunk bytes. Interop with TensorStore and zarr-python is tests/python/test_zarr_interop.py.
#include "tensorstash/format/zarr/zarr_array.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <zstd.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/array/convert.h"
#include "tensorstash/format/zarr/zarr_codec.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/endian.h"
#include "tensorstash/testing/status_test_macros.h"

#ifndef TS_ASSERT_OK
#endif

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

// Random elements (bool as 0/1), never all zero.
std::string RandomData(DType dtype, int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string out(static_cast<size_t>(count) * ItemSize(dtype), '\0');
  for (char& c : out) c = static_cast<char>(rng());
  if (dtype == DType::kBool) {
    for (char& c : out) c = static_cast<char>(c & 1);
  }
  if (!out.empty()) out[0] = 1;
  return out;
}

std::string ReadAll(const ZarrArray& array, DType dtype, ThreadPool* pool = nullptr) {
  const Box box = Box::FromShape(array.shape());
  std::string out(static_cast<size_t>(box.num_elements()) * ItemSize(dtype), '\x55');
  Status status = array.Read(box, dtype, out.data(), pool);
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

// The elements of `sub` out of `data` (C order over `outer`), with zeros outside `outer`.
std::string Slice(const std::string& data, const Box& outer, const Box& sub, DType dtype) {
  std::string out(static_cast<size_t>(sub.num_elements()) * ItemSize(dtype), '\0');
  const Box part = Intersect(sub, outer);
  EXPECT_TRUE(CopyBox(part, dtype, data.data(), outer, dtype, out.data(), sub, "slice").ok());
  return out;
}

// A float32 array "c" of 64 elements in one unsharded chunk holding `data`, opened for reading.
Result<std::unique_ptr<ZarrArray>> WriteOneChunk(MemoryKvStore* kv, int format,
                                                 ZarrCompressor compressor,
                                                 const std::string& data) {
  ZarrArraySpec spec;
  spec.zarr_format = format;
  spec.sharded = false;
  spec.compressor = compressor;
  spec.dtype = DType::kFloat32;
  spec.shape = {64};
  spec.chunk_shape = {64};
  TS_ASSIGN_OR_RETURN(std::unique_ptr<ZarrArrayWriter> writer,
                      ZarrArrayWriter::Create(kv, "c", spec));
  TS_RETURN_IF_ERROR(writer->WriteBox(Box::FromShape({64}), data.data()));
  return ZarrArray::Open(kv, "c");
}

struct Layout {
  const char* name;
  ZarrArraySpec spec;  // dtype and shape filled in per test
};

std::vector<Layout> Layouts() {
  std::vector<Layout> out;
  auto add = [&](const char* name, int format, bool sharded, ZarrCompressor compressor,
                 std::vector<int64_t> chunk, std::vector<int64_t> inner, char sep = '.') {
    ZarrArraySpec spec;
    spec.zarr_format = format;
    spec.sharded = sharded;
    spec.compressor = compressor;
    spec.chunk_shape = std::move(chunk);
    spec.inner_chunk_shape = std::move(inner);
    spec.dimension_separator = sep;
    if (compressor == ZarrCompressor::kGzip || compressor == ZarrCompressor::kBlosc) spec.level = 5;
    out.push_back({name, spec});
  };
  add("v3_sharded_zstd", 3, true, ZarrCompressor::kZstd, {4, 3}, {2, 3});
  add("v3_sharded_orbax", 3, true, ZarrCompressor::kZstd, {4, 6}, {});
  add("v3_sharded_blosc", 3, true, ZarrCompressor::kBlosc, {2, 6}, {1, 2});
  add("v3_plain_gzip", 3, false, ZarrCompressor::kGzip, {2, 4}, {});
  add("v3_plain_none", 3, false, ZarrCompressor::kNone, {3, 3}, {});
  add("v2_blosc", 2, false, ZarrCompressor::kBlosc, {2, 3}, {});
  add("v2_zstd_slash", 2, false, ZarrCompressor::kZstd, {4, 4}, {}, '/');
  add("v2_gzip", 2, false, ZarrCompressor::kGzip, {5, 2}, {});
  add("v2_none", 2, false, ZarrCompressor::kNone, {1, 7}, {});
  return out;
}

TEST(ZarrArrayTest, RoundTripEveryDtypeAndLayout) {
  const std::vector<int64_t> shape = {5, 7};  // odd: clipped edge chunks everywhere
  for (const Layout& layout : Layouts()) {
    for (int t = 0; t < kNumDTypes; ++t) {
      const DType dtype = AllDTypes()[t];
      SCOPED_TRACE(StrCat(layout.name, " ", DTypeName(dtype)));
      MemoryKvStore kv;
      ZarrArraySpec spec = layout.spec;
      spec.dtype = dtype;
      spec.shape = shape;
      auto writer = ZarrArrayWriter::Create(&kv, "params.w", spec);
      if (dtype == DType::kUint2 || dtype == DType::kUint4 || dtype == DType::kFloat6E2m3fn ||
          dtype == DType::kFloat6E3m2fn || dtype == DType::kFloat8E4m3) {
        // No TensorStore data type: refused, naming the dtype.
        ASSERT_FALSE(writer.ok());
        EXPECT_THAT(std::string(writer.status().message()), HasSubstr(DTypeName(dtype)));
        continue;
      }
      ASSERT_TRUE(writer.ok()) << writer.status();
      const std::string data = RandomData(dtype, 35, 7 + t);
      TS_ASSERT_OK((*writer)->WriteBox(Box::FromShape(shape), data.data()));
      auto array = ZarrArray::Open(&kv, "params.w");
      ASSERT_TRUE(array.ok()) << array.status();
      EXPECT_EQ((*array)->dtype(), dtype);
      EXPECT_EQ((*array)->shape(), shape);
      EXPECT_EQ((*array)->zarr_format(), spec.zarr_format);
      EXPECT_EQ((*array)->chunk_shape(), spec.chunk_shape);
      EXPECT_TRUE(ReadAll(**array, dtype) == data);
      // A box that straddles chunks and reaches past the shape: zeros there.
      const Box sub({1, 2}, {6, 4});
      std::string got(static_cast<size_t>(sub.num_elements()) * ItemSize(dtype), '\x55');
      TS_ASSERT_OK((*array)->Read(sub, dtype, got.data()));
      EXPECT_TRUE(got == Slice(data, Box::FromShape(shape), sub, dtype));
    }
  }
}

TEST(ZarrArrayTest, KeysFollowTheEncoding) {
  MemoryKvStore kv;
  ZarrArraySpec spec;
  spec.shape = {3, 4};
  spec.chunk_shape = {2, 2};
  ASSERT_TRUE(ZarrArrayWriter::Create(&kv, "a", spec).ok());
  spec.zarr_format = 2;
  ASSERT_TRUE(ZarrArrayWriter::Create(&kv, "b", spec).ok());
  spec.dimension_separator = '/';
  ASSERT_TRUE(ZarrArrayWriter::Create(&kv, "c", spec).ok());
  spec.dtype = DType::kFloat32;
  EXPECT_EQ((*ZarrArray::Open(&kv, "a"))->ChunkKey({1, 0}), "a/c/1/0");
  EXPECT_EQ((*ZarrArray::Open(&kv, "b"))->ChunkKey({1, 0}), "b/1.0");
  EXPECT_EQ((*ZarrArray::Open(&kv, "c/"))->ChunkKey({1, 0}), "c/1/0");
  const std::string data = RandomData(DType::kFloat32, 12, 1);
  spec.zarr_format = 3;
  auto w = ZarrArrayWriter::Create(&kv, "a", spec);
  TS_ASSERT_OK((*w)->WriteBox(Box::FromShape({3, 4}), data.data()));
  EXPECT_TRUE(kv.Size("a/c/1/1").ok());
  EXPECT_TRUE(kv.Size("a/zarr.json").ok());
}

TEST(ZarrArrayTest, ZeroDimensionalAndEmptyArrays) {
  for (int format : {2, 3}) {
    SCOPED_TRACE(format);
    MemoryKvStore kv;
    ZarrArraySpec spec;
    spec.zarr_format = format;
    spec.dtype = DType::kInt32;
    auto w = ZarrArrayWriter::Create(&kv, "s", spec);  // shape []
    ASSERT_TRUE(w.ok()) << w.status();
    const int32_t value = -12345;
    TS_ASSERT_OK((*w)->WriteChunk({}, &value));
    EXPECT_TRUE(kv.Size(format == 3 ? "s/c" : "s/0").ok());
    auto a = ZarrArray::Open(&kv, "s");
    ASSERT_TRUE(a.ok()) << a.status();
    int32_t got = 0;
    TS_ASSERT_OK((*a)->Read(Box(), DType::kInt32, &got));
    EXPECT_EQ(got, value);
    int64_t wide = 0;
    TS_ASSERT_OK((*a)->Read(Box(), DType::kInt64, &wide));
    EXPECT_EQ(wide, value);

    spec.shape = {0, 3};
    spec.chunk_shape = {};
    auto e = ZarrArrayWriter::Create(&kv, "e", spec);
    ASSERT_TRUE(e.ok()) << e.status();
    TS_ASSERT_OK((*e)->WriteBox(Box::FromShape({0, 3}), nullptr));
    auto ea = ZarrArray::Open(&kv, "e");
    ASSERT_TRUE(ea.ok()) << ea.status();
    EXPECT_EQ((*ea)->shape(), (std::vector<int64_t>{0, 3}));
    TS_EXPECT_OK((*ea)->Read(Box::FromShape({0, 3}), DType::kInt32, nullptr));
    // A box wholly past an empty array reads zeros.
    int32_t past[3] = {7, 7, 7};
    TS_ASSERT_OK((*ea)->Read(Box({0, 0}, {1, 3}), DType::kInt32, past));
    EXPECT_EQ(past[0] | past[1] | past[2], 0);
  }
}

TEST(ZarrArrayTest, MissingChunksAndInnerChunksReadTheFillValue) {
  MemoryKvStore kv;
  ZarrArraySpec spec;
  spec.dtype = DType::kFloat32;
  spec.shape = {4, 4};
  spec.chunk_shape = {2, 4};
  spec.inner_chunk_shape = {2, 2};
  ASSERT_TRUE(ZarrArrayWriter::Create(&kv, "x", spec).ok());
  // Nonzero data only in the top-right inner chunk of shard 0.
  std::vector<float> data(16, 0.0f);
  data[2] = 1.5f;
  data[7] = -2.0f;
  auto w = ZarrArrayWriter::Create(&kv, "x", spec);
  TS_ASSERT_OK((*w)->WriteBox(Box::FromShape({4, 4}), data.data()));
  EXPECT_TRUE(kv.Size("x/c/0/0").ok());
  EXPECT_TRUE(absl::IsNotFound(kv.Size("x/c/1/0").status()));  // all fill: not stored
  // Now declare a fill value of NaN: missing shards and inner chunks read as NaN.
  std::string meta = *kv.Read("x/zarr.json");
  const size_t pos = meta.find("\"fill_value\":0.0");
  ASSERT_NE(pos, std::string::npos) << meta;
  meta.replace(pos, 16, "\"fill_value\":\"NaN\"");
  TS_ASSERT_OK(kv.Write("x/zarr.json", meta));
  auto a = ZarrArray::Open(&kv, "x");
  ASSERT_TRUE(a.ok()) << a.status();
  std::vector<float> got(16);
  TS_ASSERT_OK((*a)->Read(Box::FromShape({4, 4}), DType::kFloat32, got.data()));
  for (int i = 0; i < 16; ++i) {
    const int row = i / 4, col = i % 4;
    if (row < 2 && col >= 2) {
      EXPECT_EQ(got[i], data[i]) << i;
    } else {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    }
  }
  // The same through ranged reads of the shard (a box that is not the whole shard).
  float one = 0;
  TS_ASSERT_OK((*a)->Read(Box({1, 3}, {1, 1}), DType::kFloat32, &one));
  EXPECT_EQ(one, -2.0f);
  TS_ASSERT_OK((*a)->Read(Box({0, 0}, {1, 1}), DType::kFloat32, &one));
  EXPECT_TRUE(std::isnan(one));
  // Cast to float64 keeps NaN; to an integer type the NaN fill cannot convert.
  std::vector<int32_t> ints(16);
  EXPECT_FALSE((*a)->Read(Box::FromShape({4, 4}), DType::kInt32, ints.data()).ok());
}

TEST(ZarrArrayTest, ParallelReadMatchesSequential) {
  MemoryKvStore kv;
  ZarrArraySpec spec;
  spec.dtype = DType::kBfloat16;
  spec.shape = {33, 17};
  spec.chunk_shape = {8, 8};
  spec.inner_chunk_shape = {4, 8};
  auto w = ZarrArrayWriter::Create(&kv, "p", spec);
  ASSERT_TRUE(w.ok());
  const std::string data = RandomData(DType::kBfloat16, 33 * 17, 3);
  ThreadPool pool(4);
  TS_ASSERT_OK((*w)->WriteBox(Box::FromShape(spec.shape), data.data(), &pool));
  auto a = ZarrArray::Open(&kv, "p");
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(ReadAll(**a, DType::kBfloat16, &pool) == data);
  EXPECT_TRUE(ReadAll(**a, DType::kBfloat16) == data);
  // Cast on read: bfloat16 -> float32 matches ConvertElements.
  std::string expect(data.size() * 2, '\0');
  TS_ASSERT_OK(
      ConvertElements(DType::kBfloat16, data.data(), DType::kFloat32, expect.data(), 33 * 17, "x"));
  EXPECT_TRUE(ReadAll(**a, DType::kFloat32, &pool) == expect);
}

TEST(ZarrArrayTest, WriteChunkAndBoxAlignment) {
  MemoryKvStore kv;
  ZarrArraySpec spec;
  spec.dtype = DType::kUint16;
  spec.shape = {5, 5};
  spec.chunk_shape = {2, 2};
  auto w = ZarrArrayWriter::Create(&kv, "u", spec);
  ASSERT_TRUE(w.ok());
  const uint16_t corner = 0xBEEF;  // chunk [2, 2] is the 1x1 corner
  TS_ASSERT_OK((*w)->WriteChunk({2, 2}, &corner));
  EXPECT_FALSE((*w)->WriteChunk({3, 0}, &corner).ok());
  const std::string data = RandomData(DType::kUint16, 4, 5);
  EXPECT_THAT(std::string((*w)->WriteBox(Box({1, 0}, {2, 2}), data.data()).message()),
              HasSubstr("whole chunks"));
  TS_ASSERT_OK((*w)->WriteBox(Box({2, 2}, {2, 2}), data.data()));
  auto a = ZarrArray::Open(&kv, "u");
  std::vector<uint16_t> got(25);
  TS_ASSERT_OK((*a)->Read(Box::FromShape({5, 5}), DType::kUint16, got.data()));
  EXPECT_EQ(got[24], 0xBEEF);
  EXPECT_EQ(got[0], 0);
  EXPECT_EQ(std::memcmp(&got[12], data.data(), 4), 0);
}

// ---- hand-made chunks: the byte layouts the specs define ----

TEST(ZarrArrayTest, V2FortranOrderBigEndianRawChunk) {
  MemoryKvStore kv;
  TS_ASSERT_OK(kv.Write("f/.zarray", R"({"zarr_format":2,"shape":[2,3],"chunks":[2,3],
      "dtype":">i4","compressor":null,"fill_value":-1,"order":"F","filters":null})"));
  // Fortran order: column by column; big-endian int32.
  std::string chunk;
  for (int32_t v : {0, 10, 1, 11, 2, 12}) {
    for (int b = 3; b >= 0; --b) chunk.push_back(static_cast<char>((v >> (8 * b)) & 0xff));
  }
  TS_ASSERT_OK(kv.Write("f/0.0", chunk));
  auto a = ZarrArray::Open(&kv, "f");
  ASSERT_TRUE(a.ok()) << a.status();
  std::vector<int32_t> got(6);
  TS_ASSERT_OK((*a)->Read(Box::FromShape({2, 3}), DType::kInt32, got.data()));
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2, 10, 11, 12}));
  // Wrong-length chunk: DataLoss naming the key.
  TS_ASSERT_OK(kv.Write("f/0.0", chunk.substr(4)));
  Status s = (*a)->Read(Box::FromShape({2, 3}), DType::kInt32, got.data());
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("'f/0.0'"));
}

TEST(ZarrArrayTest, V3ShardHandMadeWithIndexAtStartAndTranspose) {
  MemoryKvStore kv;
  TS_ASSERT_OK(kv.Write("t/zarr.json", R"({"zarr_format":3,"node_type":"array","shape":[2,2],
      "data_type":"uint8","chunk_grid":{"name":"regular","configuration":{"chunk_shape":[2,2]}},
      "chunk_key_encoding":{"name":"default","configuration":{"separator":"."}},
      "fill_value":9,"codecs":[{"name":"sharding_indexed","configuration":{
        "chunk_shape":[1,2],"codecs":[{"name":"transpose","configuration":{"order":[1,0]}},
        {"name":"bytes"}],"index_codecs":[{"name":"bytes","configuration":{"endian":"little"}},
        {"name":"crc32c"}],"index_location":"start"}}]})"));
  // Index: inner chunk 0 at 36 (2 bytes), inner chunk 1 missing; 36 = 2*16 + 4.
  std::string index;
  PutLE64(&index, 36);
  PutLE64(&index, 2);
  PutLE64(&index, ~uint64_t{0});
  PutLE64(&index, ~uint64_t{0});
  PutLE32(&index, Crc32c(index));
  TS_ASSERT_OK(kv.Write("t/c.0.0", index + std::string("\x05\x06", 2)));
  auto a = ZarrArray::Open(&kv, "t");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE((*a)->sharded());
  EXPECT_EQ((*a)->inner_chunk_shape(), (std::vector<int64_t>{1, 2}));
  uint8_t got[4] = {};
  TS_ASSERT_OK((*a)->Read(Box::FromShape({2, 2}), DType::kUint8, got));
  EXPECT_EQ(got[0], 5);
  EXPECT_EQ(got[1], 6);
  EXPECT_EQ(got[2], 9);
  EXPECT_EQ(got[3], 9);
  TS_ASSERT_OK((*a)->Read(Box({0, 1}, {1, 1}), DType::kUint8, got));  // ranged path
  EXPECT_EQ(got[0], 6);

  // Hostile shards: a flipped index byte (crc32c), an entry past the end, a truncated shard.
  std::string bad = index + std::string("\x05\x06", 2);
  bad[3] ^= 1;
  TS_ASSERT_OK(kv.Write("t/c.0.0", bad));
  Status s = (*a)->Read(Box::FromShape({2, 2}), DType::kUint8, got);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("crc32c"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("'t/c.0.0'"));
  std::string outside;
  PutLE64(&outside, 36);
  PutLE64(&outside, 200);
  PutLE64(&outside, ~uint64_t{0});
  PutLE64(&outside, ~uint64_t{0});
  PutLE32(&outside, Crc32c(outside));
  TS_ASSERT_OK(kv.Write("t/c.0.0", outside + "xx"));
  s = (*a)->Read(Box({0, 1}, {1, 1}), DType::kUint8, got);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("outside the shard"));
  TS_ASSERT_OK(kv.Write("t/c.0.0", index.substr(0, 10)));
  s = (*a)->Read(Box::FromShape({2, 2}), DType::kUint8, got);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("shorter than its"));
}

// Encodes every chunk of `data` with the chain of `zarr_json` and stores it: exercises codec
// combinations the writer does not produce (nested sharding, big-endian, crc32c, transposes).
void StoreWithMetadata(MemoryKvStore* kv, const std::string& prefix, const std::string& zarr_json,
                       const std::string& data) {
  TS_ASSERT_OK(kv->Write(prefix + "/zarr.json", zarr_json));
  auto a = ZarrArray::Open(kv, prefix);
  ASSERT_TRUE(a.ok()) << a.status();
  const ZarrMetadata& m = (*a)->metadata();
  const Box shape_box = Box::FromShape(m.shape);
  std::vector<int64_t> grid_extent(m.rank());
  int64_t count = 1;
  for (int d = 0; d < m.rank(); ++d) {
    grid_extent[d] = (m.shape[d] + m.chunk_shape[d] - 1) / m.chunk_shape[d];
    count *= grid_extent[d];
  }
  for (int64_t linear = 0; linear < count; ++linear) {
    std::vector<int64_t> grid(m.rank());
    int64_t rest = linear;
    Box chunk_box(std::vector<int64_t>(m.rank()), m.chunk_shape);
    for (int d = m.rank() - 1; d >= 0; --d) {
      grid[d] = rest % grid_extent[d];
      rest /= grid_extent[d];
      chunk_box.origin[d] = grid[d] * m.chunk_shape[d];
    }
    std::string raw(static_cast<size_t>(chunk_box.num_elements()) * ItemSize(m.dtype), '\0');
    FillBox(chunk_box, m.fill_value, raw.data(), chunk_box);
    TS_ASSERT_OK(CopyBox(Intersect(chunk_box, shape_box), m.dtype, data.data(), shape_box, m.dtype,
                         raw.data(), chunk_box, "store"));
    std::string encoded;
    TS_ASSERT_OK(
        EncodeZarrChunk(m.codecs, m.dtype, m.chunk_shape, m.fill_value, raw, &encoded, "store"));
    TS_ASSERT_OK(kv->Write((*a)->ChunkKey(grid), encoded));
  }
}

std::string V3Json(const std::string& dtype, const std::string& shape, const std::string& chunks,
                   const std::string& codecs, const std::string& fill = "0",
                   const std::string& encoding = R"({"name":"default"})") {
  return StrCat(R"({"zarr_format":3,"node_type":"array","shape":)", shape, R"(,"data_type":")",
                dtype, R"(","chunk_grid":{"name":"regular","configuration":{"chunk_shape":)",
                chunks, R"(}},"chunk_key_encoding":)", encoding, R"(,"fill_value":)", fill,
                R"(,"codecs":)", codecs, R"(,"attributes":{"x":1},"dimension_names":null})");
}

TEST(ZarrArrayTest, CodecChainsRoundTrip) {
  const std::vector<std::pair<std::string, std::string>> chains = {
      {"big_endian_crc",
       R"([{"name":"bytes","configuration":{"endian":"big"}},{"name":"crc32c"}])"},
      {"transpose_gzip",
       R"([{"name":"transpose","configuration":{"order":[2,0,1]}},{"name":"bytes","configuration":{"endian":"little"}},{"name":"gzip","configuration":{"level":1}}])"},
      {"transpose_F_blosc",
       R"([{"name":"transpose","configuration":{"order":"F"}},{"name":"bytes","configuration":{"endian":"big"}},{"name":"blosc","configuration":{"cname":"zstd","clevel":3,"shuffle":"bitshuffle","typesize":8,"blocksize":0}}])"},
      {"nested_sharding_then_zstd",
       R"([{"name":"sharding_indexed","configuration":{"chunk_shape":[2,2,3],"codecs":[{"name":"sharding_indexed","configuration":{"chunk_shape":[1,1,3],"codecs":[{"name":"bytes","configuration":{"endian":"big"}}],"index_codecs":[{"name":"bytes","configuration":{"endian":"big"}}],"index_location":"start"}}],"index_codecs":[{"name":"bytes","configuration":{"endian":"little"}},{"name":"crc32c"}]}},{"name":"zstd","configuration":{"level":1,"checksum":true}}])"},
      {"transpose_then_sharding",
       R"([{"name":"transpose","configuration":{"order":[1,2,0]}},{"name":"sharding_indexed","configuration":{"chunk_shape":[2,3,2],"codecs":[{"name":"bytes","configuration":{"endian":"little"}},{"name":"zstd","configuration":{"level":0}}],"index_codecs":[{"name":"bytes","configuration":{"endian":"little"}}]}}])"},
  };
  for (const auto& [name, codecs] : chains) {
    for (DType dtype : {DType::kComplex64, DType::kInt16, DType::kFloat64}) {
      SCOPED_TRACE(StrCat(name, " ", DTypeName(dtype)));
      MemoryKvStore kv;
      const std::string data = RandomData(dtype, 5 * 5 * 7, 11);
      StoreWithMetadata(&kv, "arr",
                        V3Json(std::string(DTypeName(dtype)), "[5,5,7]", "[4,4,3]", codecs,
                               Kind(dtype) == DTypeKind::kComplex ? "[0,0]" : "0"),
                        data);
      auto a = ZarrArray::Open(&kv, "arr");
      ASSERT_TRUE(a.ok()) << a.status();
      EXPECT_TRUE(ReadAll(**a, dtype) == data);
      const Box sub({1, 3, 2}, {4, 2, 5});
      std::string got(static_cast<size_t>(sub.num_elements()) * ItemSize(dtype), '\0');
      TS_ASSERT_OK((*a)->Read(sub, dtype, got.data()));
      EXPECT_TRUE(got == Slice(data, Box::FromShape({5, 5, 7}), sub, dtype));
    }
  }
}

TEST(ZarrArrayTest, V2KeyEncodingInV3) {
  MemoryKvStore kv;
  const std::string data = RandomData(DType::kInt8, 6, 2);
  StoreWithMetadata(&kv, "k",
                    V3Json("int8", "[2,3]", "[1,3]", R"(["bytes"])", "0",
                           R"({"name":"v2","configuration":{"separator":"/"}})"),
                    data);
  EXPECT_TRUE(kv.Size("k/1/0").ok());
  auto a = ZarrArray::Open(&kv, "k");
  EXPECT_TRUE(ReadAll(**a, DType::kInt8) == data);
}

TEST(ZarrArrayTest, FillValueForms) {
  struct Case {
    std::string dtype, fill;
    std::string expect_hex;  // host-order bytes, hex
  };
  const std::vector<Case> cases = {
      {"float32", "\"NaN\"", "0000c07f"},
      {"float32", "\"Infinity\"", "0000807f"},
      {"float64", "\"-Infinity\"", "000000000000f0ff"},
      {"float32", "\"0x7fc00001\"", "0100c07f"},
      {"float32", "1.5", "0000c03f"},
      {"bfloat16", "1.0", "803f"},
      {"float16", "-2", "00c0"},
      {"float8_e4m3fn", "\"NaN\"", "7f"},
      {"complex64", "[1.0, \"NaN\"]", "0000803f0000c07f"},
      {"int16", "-2", "feff"},
      {"uint64", "18446744073709551615", "ffffffffffffffff"},
      {"bool", "true", "01"},
      {"int32", "3.0", "03000000"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dtype + " " + c.fill);
    auto m = ParseZarrV3Metadata(V3Json(c.dtype, "[1]", "[1]", R"(["bytes"])", c.fill), "f");
    ASSERT_TRUE(m.ok()) << m.status();
    std::string hex;
    for (unsigned char b : m->fill_value) hex += StrCat(Hex32(b).substr(6));
    EXPECT_EQ(hex, c.expect_hex);
  }
  for (const auto& [dtype, fill] :
       std::vector<std::pair<std::string, std::string>>{{"int8", "200"},
                                                        {"uint8", "-1"},
                                                        {"float32", "\"nan\""},
                                                        {"bool", "\"x\""},
                                                        {"int32", "1.5"},
                                                        {"complex64", "[1]"},
                                                        {"float32", "{}"},
                                                        {"float32", "\"0xzz\""}}) {
    SCOPED_TRACE(dtype + " " + fill);
    auto m = ParseZarrV3Metadata(V3Json(dtype, "[1]", "[1]", R"(["bytes"])", fill), "arr 'q'");
    EXPECT_TRUE(absl::IsInvalidArgument(m.status())) << m.status();
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("arr 'q'"));
  }
  // v2 typestrs and the names TensorStore writes.
  for (const auto& [typestr, dtype] :
       std::vector<std::pair<std::string, DType>>{{"|b1", DType::kBool},
                                                  {"<c16", DType::kComplex128},
                                                  {"bfloat16", DType::kBfloat16},
                                                  {">u2", DType::kUint16},
                                                  {"|i1", DType::kInt8},
                                                  {"float8_e5m2", DType::kFloat8E5m2},
                                                  {"int4", DType::kInt4},
                                                  {"int2", DType::kInt2},
                                                  {"float4_e2m1fn", DType::kFloat4E2m1fn},
                                                  {"float8_e8m0fnu", DType::kFloat8E8m0fnu},
                                                  {"float8_e4m3fnuz", DType::kFloat8E4m3fnuz}}) {
    auto m = ParseZarrV2Metadata(
        StrCat(R"({"zarr_format":2,"shape":[1],"chunks":[1],"dtype":")", typestr,
               R"(","compressor":null,"fill_value":null,"order":"C","filters":null})"),
        "v2");
    ASSERT_TRUE(m.ok()) << typestr << m.status();
    EXPECT_EQ(m->dtype, dtype);
  }
}

TEST(ZarrMetadataTest, SubByteAndNewFloatTypesAsTensorStoreWritesThem) {
  // TensorStore 0.1.86 writes the ml_dtypes names in both versions, one byte per element.
  for (DType dtype : {DType::kInt4, DType::kInt2, DType::kFloat4E2m1fn, DType::kFloat8E3m4,
                      DType::kFloat8E4m3fnuz, DType::kFloat8E5m2fnuz, DType::kFloat8E4m3b11fnuz,
                      DType::kFloat8E8m0fnu}) {
    SCOPED_TRACE(DTypeName(dtype));
    for (int format : {2, 3}) {
      ZarrMetadata m;
      m.zarr_format = format;
      m.dtype = dtype;
      m.shape = {5};
      m.chunk_shape = {5};
      m.fill_value = std::string(1, '\0');
      m.codecs = {ZarrCodec{}};
      Result<std::string> text = EncodeZarrMetadata(m);
      ASSERT_TRUE(text.ok()) << text.status();
      EXPECT_THAT(*text, HasSubstr(StrCat("\"", DTypeName(dtype), "\"")));
      auto back = format == 3 ? ParseZarrV3Metadata(*text, "a") : ParseZarrV2Metadata(*text, "a");
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(back->dtype, dtype);
      EXPECT_EQ(back->fill_value, m.fill_value);
    }
  }
  // int4 fill values: the low four bits, two's complement, and range-checked.
  auto m = ParseZarrV3Metadata(V3Json("int4", "[1]", "[1]", R"(["bytes"])", "-1"), "a");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->fill_value, std::string(1, '\x0f'));
  m = ParseZarrV3Metadata(V3Json("int4", "[1]", "[1]", R"(["bytes"])", "8"), "a");
  EXPECT_TRUE(absl::IsInvalidArgument(m.status())) << m.status();
  m = ParseZarrV3Metadata(V3Json("uint2", "[1]", "[1]", R"(["bytes"])", "3"), "a");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->fill_value, std::string(1, '\x03'));
  // The types TensorStore has no data type for are not written.
  for (DType dtype : {DType::kUint4, DType::kUint2, DType::kFloat6E2m3fn, DType::kFloat6E3m2fn,
                      DType::kFloat8E4m3}) {
    ZarrMetadata w;
    w.zarr_format = 3;
    w.dtype = dtype;
    w.shape = {5};
    w.chunk_shape = {5};
    w.fill_value = std::string(1, '\0');
    w.codecs = {ZarrCodec{}};
    Result<std::string> text = EncodeZarrMetadata(w);
    ASSERT_FALSE(text.ok()) << DTypeName(dtype);
    EXPECT_THAT(std::string(text.status().message()), HasSubstr(std::string(DTypeName(dtype))));
  }
}

// ---- hostile metadata ----

TEST(ZarrArrayHostileTest, MetadataIsRejectedWithTheArrayNamed) {
  struct Case {
    std::string name, v3_json;
    absl::StatusCode code;
  };
  const std::string ok_codecs = R"([{"name":"bytes"}])";
  std::string rank33 = "[";
  for (int i = 0; i < 33; ++i) rank33 += i ? ",1" : "1";
  rank33 += "]";
  const std::vector<Case> cases = {
      {"not json", "{\"zarr_format\":3,", absl::StatusCode::kInvalidArgument},
      {"not an object", "[1,2]", absl::StatusCode::kInvalidArgument},
      {"group", R"({"zarr_format":3,"node_type":"group"})", absl::StatusCode::kInvalidArgument},
      {"format 4", R"({"zarr_format":4,"node_type":"array"})", absl::StatusCode::kInvalidArgument},
      {"shape string", V3Json("int8", "\"abc\"", "[1]", ok_codecs),
       absl::StatusCode::kInvalidArgument},
      {"negative dim", V3Json("int8", "[-1]", "[1]", ok_codecs),
       absl::StatusCode::kInvalidArgument},
      {"overflowing count",
       V3Json("float64", "[4611686018427387904,4611686018427387904]", "[1,1]", ok_codecs),
       absl::StatusCode::kInvalidArgument},
      {"huge dim", V3Json("int8", "[18446744073709551615]", "[1]", ok_codecs),
       absl::StatusCode::kInvalidArgument},
      {"float dim", V3Json("int8", "[1.5]", "[1]", ok_codecs), absl::StatusCode::kInvalidArgument},
      {"rank 33", V3Json("int8", rank33, rank33, ok_codecs), absl::StatusCode::kInvalidArgument},
      {"rank mismatch", V3Json("int8", "[4,4]", "[4]", ok_codecs),
       absl::StatusCode::kInvalidArgument},
      {"zero chunk", V3Json("int8", "[4]", "[0]", ok_codecs), absl::StatusCode::kInvalidArgument},
      {"huge chunk", V3Json("float64", "[1048576,1048576]", "[1048576,1048576]", ok_codecs),
       absl::StatusCode::kInvalidArgument},
      {"unknown dtype", V3Json("float128", "[4]", "[4]", ok_codecs),
       absl::StatusCode::kUnimplemented},
      {"unknown codec", V3Json("int8", "[4]", "[4]", R"([{"name":"bytes"},{"name":"lzma"}])"),
       absl::StatusCode::kUnimplemented},
      {"no array codec", V3Json("int8", "[4]", "[4]", R"([{"name":"zstd"}])"),
       absl::StatusCode::kInvalidArgument},
      {"two array codecs", V3Json("int8", "[4]", "[4]", R"(["bytes","bytes"])"),
       absl::StatusCode::kInvalidArgument},
      {"codec not object", V3Json("int8", "[4]", "[4]", R"([7])"),
       absl::StatusCode::kInvalidArgument},
      {"codecs not array", V3Json("int8", "[4]", "[4]", R"({"name":"bytes"})"),
       absl::StatusCode::kInvalidArgument},
      {"bad endian",
       V3Json("int8", "[4]", "[4]", R"([{"name":"bytes","configuration":{"endian":7}}])"),
       absl::StatusCode::kInvalidArgument},
      {"bad transpose",
       V3Json("int8", "[4,4]", "[4,4]",
              R"([{"name":"transpose","configuration":{"order":[0,0]}},"bytes"])"),
       absl::StatusCode::kInvalidArgument},
      {"inner not dividing",
       V3Json(
           "int8", "[4]", "[4]",
           R"([{"name":"sharding_indexed","configuration":{"chunk_shape":[3],"codecs":["bytes"],"index_codecs":["bytes","crc32c"]}}])"),
       absl::StatusCode::kInvalidArgument},
      {"compressed index",
       V3Json(
           "int8", "[4]", "[4]",
           R"([{"name":"sharding_indexed","configuration":{"chunk_shape":[2],"codecs":["bytes"],"index_codecs":["bytes","zstd"]}}])"),
       absl::StatusCode::kUnimplemented},
      {"huge inner chunk",
       V3Json(
           "int64", "[1099511627776]", "[1099511627776]",
           R"([{"name":"sharding_indexed","configuration":{"chunk_shape":[1099511627776],"codecs":["bytes"],"index_codecs":["bytes"]}}])"),
       absl::StatusCode::kInvalidArgument},
      {"irregular grid",
       R"({"zarr_format":3,"node_type":"array","shape":[1],"data_type":"int8","chunk_grid":{"name":"rectilinear"},"fill_value":0,"codecs":["bytes"]})",
       absl::StatusCode::kUnimplemented},
      {"storage transformer",
       R"({"zarr_format":3,"node_type":"array","shape":[1],"data_type":"int8","chunk_grid":{"name":"regular","configuration":{"chunk_shape":[1]}},"fill_value":0,"codecs":["bytes"],"storage_transformers":[{"name":"x"}]})",
       absl::StatusCode::kUnimplemented},
      {"missing codecs",
       R"({"zarr_format":3,"node_type":"array","shape":[1],"data_type":"int8","chunk_grid":{"name":"regular","configuration":{"chunk_shape":[1]}},"fill_value":0})",
       absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    MemoryKvStore kv;
    TS_ASSERT_OK(kv.Write("model/layer0/zarr.json", c.v3_json));
    auto a = ZarrArray::Open(&kv, "model/layer0");
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), c.code) << a.status();
    EXPECT_THAT(std::string(a.status().message()), HasSubstr("'model/layer0'"));
  }
}

TEST(ZarrArrayHostileTest, V2MetadataIsRejected) {
  const std::string base = R"("zarr_format":2,"shape":[4],"chunks":[2],"order":"C","fill_value":0)";
  const std::vector<std::pair<std::string, absl::StatusCode>> cases = {
      {StrCat("{", base, R"(,"dtype":"<f4","compressor":null,"filters":[{"id":"delta"}]})"),
       absl::StatusCode::kUnimplemented},
      {StrCat("{", base, R"(,"dtype":[["a","<f4"]],"compressor":null,"filters":null})"),
       absl::StatusCode::kUnimplemented},
      {StrCat("{", base, R"(,"dtype":"<U4","compressor":null,"filters":null})"),
       absl::StatusCode::kUnimplemented},
      {StrCat("{", base, R"(,"dtype":"<f4","compressor":{"id":"lzma"},"filters":null})"),
       absl::StatusCode::kUnimplemented},
      {StrCat("{", base, R"(,"dtype":"<f4","compressor":{"no_id":1},"filters":null})"),
       absl::StatusCode::kInvalidArgument},
      {R"({"zarr_format":2,"shape":[4],"chunks":[2],"order":"K","fill_value":0,"dtype":"<f4"})",
       absl::StatusCode::kInvalidArgument},
      {R"({"zarr_format":2,"shape":[4],"chunks":[2],"order":"C","fill_value":0,"dtype":"<f4","dimension_separator":"_"})",
       absl::StatusCode::kInvalidArgument},
  };
  for (const auto& [text, code] : cases) {
    SCOPED_TRACE(text);
    MemoryKvStore kv;
    TS_ASSERT_OK(kv.Write("p/.zarray", text));
    auto a = ZarrArray::Open(&kv, "p");
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), code) << a.status();
    EXPECT_THAT(std::string(a.status().message()), HasSubstr("'p'"));
  }
  MemoryKvStore empty;
  auto missing = ZarrArray::Open(&empty, "nothing/here");
  EXPECT_TRUE(absl::IsNotFound(missing.status())) << missing.status();
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("'nothing/here'"));
}

TEST(ZarrArrayHostileTest, CorruptChunkDataIsDataLossNamingTheKey) {
  for (ZarrCompressor compressor :
       {ZarrCompressor::kZstd, ZarrCompressor::kGzip, ZarrCompressor::kBlosc}) {
    for (int format : {2, 3}) {
      SCOPED_TRACE(StrCat(static_cast<int>(compressor), " v", format));
      MemoryKvStore kv;
      const std::string data = RandomData(DType::kFloat32, 64, 9);
      Result<std::unique_ptr<ZarrArray>> a = WriteOneChunk(&kv, format, compressor, data);
      ASSERT_TRUE(a.ok()) << a.status();
      const std::string key = (*a)->ChunkKey({0});
      const std::string good = *kv.Read(key);
      std::vector<std::string> bad = {good.substr(0, good.size() / 2), "", "garbage!",
                                      good + "trailing junk"};
      std::string flipped = good;
      flipped[flipped.size() / 2] ^= 0x40;
      flipped[flipped.size() / 3] ^= 0x11;
      bad.push_back(flipped);
      for (size_t i = 0; i < bad.size(); ++i) {
        TS_ASSERT_OK(kv.Write(key, bad[i]));
        std::string got(data.size(), '\0');
        Status s = (*a)->Read(Box::FromShape({64}), DType::kFloat32, got.data());
        if (s.ok()) {
          // Only a flip inside blosc/zstd payload bytes may decode "successfully" (no checksum);
          // the result must then still be the full size, never a crash.
          EXPECT_EQ(i, bad.size() - 1) << "accepted corrupt input " << i;
          continue;
        }
        EXPECT_TRUE(absl::IsDataLoss(s)) << i << " " << s;
        EXPECT_THAT(std::string(s.message()), HasSubstr(key)) << i;
      }
    }
  }
}

// With a StagingPool, whole chunks landing as one run of the destination are decoded straight
// into it: the same values as the general path, for every layout; damage is still DataLoss.
TEST(ZarrArrayTest, InPlaceReadsMatchTheGeneralPath) {
  const std::vector<int64_t> shape = {
      20, 84};  // most layouts divide it; clipped edges go the general way
  for (const Layout& layout : Layouts()) {
    for (DType dtype : {DType::kFloat32, DType::kUint8, DType::kBfloat16}) {
      SCOPED_TRACE(StrCat(layout.name, " ", DTypeName(dtype)));
      MemoryKvStore kv;
      ZarrArraySpec spec = layout.spec;
      spec.dtype = dtype;
      spec.shape = shape;
      auto writer = ZarrArrayWriter::Create(&kv, "p", spec);
      ASSERT_TRUE(writer.ok()) << writer.status();
      const std::string data = RandomData(dtype, 20 * 84, 3);
      TS_ASSERT_OK((*writer)->WriteBox(Box::FromShape(shape), data.data()));
      auto array = ZarrArray::Open(&kv, "p");
      ASSERT_TRUE(array.ok()) << array.status();
      StagingPool staging(1 << 20);
      ThreadPool pool(3);
      // Each stored chunk as its own box (contiguous: the fast path), and the whole array.
      const std::vector<int64_t>& chunk = (*array)->chunk_shape();
      for (int64_t r = 0; r < shape[0]; r += chunk[0]) {
        for (int64_t c = 0; c < shape[1]; c += chunk[1]) {
          const Box box({r, c}, chunk);
          std::string got(static_cast<size_t>(box.num_elements()) * ItemSize(dtype), '\x55');
          TS_ASSERT_OK((*array)->Read(box, dtype, got.data(), nullptr, &staging));
          EXPECT_TRUE(got == Slice(data, Box::FromShape(shape), box, dtype)) << box.ToString();
        }
      }
      std::string all(data.size(), '\x55');
      TS_ASSERT_OK((*array)->Read(Box::FromShape(shape), dtype, all.data(), &pool, &staging));
      EXPECT_TRUE(all == data);
      // Unsharded zstd chunks went through the pool's buffers.
      if (!(*array)->sharded() && spec.compressor == ZarrCompressor::kZstd) {
        EXPECT_GT(staging.buffers_created(), 0u);
      }
    }
  }
}

TEST(ZarrArrayHostileTest, InPlaceReadsOfDamagedChunksAreDataLoss) {
  for (ZarrCompressor compressor : {ZarrCompressor::kZstd, ZarrCompressor::kNone}) {
    SCOPED_TRACE(static_cast<int>(compressor));
    MemoryKvStore kv;
    const std::string data = RandomData(DType::kFloat32, 64, 9);
    Result<std::unique_ptr<ZarrArray>> a = WriteOneChunk(&kv, 2, compressor, data);
    ASSERT_TRUE(a.ok()) << a.status();
    const std::string key = (*a)->ChunkKey({0});
    const std::string good = *kv.Read(key);
    // Twice the data, compressed: a chunk that decodes to more bytes than its shape holds.
    std::string twice(ZSTD_compressBound(2 * data.size()), '\0');
    twice.resize(
        ZSTD_compress(twice.data(), twice.size(), (data + data).data(), 2 * data.size(), 1));
    std::vector<std::string> bad = {good.substr(0, good.size() / 2), "", "garbage!",
                                    good + "trailing junk"};
    if (compressor == ZarrCompressor::kZstd) bad.push_back(twice);
    StagingPool staging(1 << 20);
    for (size_t i = 0; i < bad.size(); ++i) {
      TS_ASSERT_OK(kv.Write(key, bad[i]));
      std::string got(data.size(), '\0');
      Status s = (*a)->Read(Box::FromShape({64}), DType::kFloat32, got.data(), nullptr, &staging);
      EXPECT_TRUE(absl::IsDataLoss(s)) << i << " " << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr(key)) << i;
    }
    // A missing chunk reads the fill value (0).
    TS_ASSERT_OK(kv.Delete(key));
    std::string got(data.size(), '\x55');
    TS_ASSERT_OK((*a)->Read(Box::FromShape({64}), DType::kFloat32, got.data(), nullptr, &staging));
    EXPECT_EQ(got, std::string(data.size(), '\0'));
  }
}

// A compressed chunk larger than one streaming piece is read and decoded piece by piece: the
// same values, at most one piece of staging whatever the chunk's size, and damage anywhere in
// it DataLoss naming the chunk (a skippable frame after the data is no damage).
TEST(ZarrArrayTest, LargeCompressedChunksAreDecodedPieceByPiece) {
  constexpr int64_t kElements = int64_t{3} << 20;  // 12 MiB of float32: three pieces or more
  MemoryKvStore kv;
  ZarrArraySpec spec;
  spec.zarr_format = 3;
  spec.sharded = false;
  spec.compressor = ZarrCompressor::kZstd;
  spec.dtype = DType::kFloat32;
  spec.shape = {kElements};
  spec.chunk_shape = {kElements};
  auto writer = ZarrArrayWriter::Create(&kv, "big", spec);
  ASSERT_TRUE(writer.ok()) << writer.status();
  const std::string data = RandomData(DType::kFloat32, kElements, 5);
  TS_ASSERT_OK((*writer)->WriteBox(Box::FromShape({kElements}), data.data()));
  auto array = ZarrArray::Open(&kv, "big");
  ASSERT_TRUE(array.ok()) << array.status();
  const std::string key = (*array)->ChunkKey({0});
  const std::string good = *kv.Read(key);
  ASSERT_GT(good.size(), 2 * kInPlaceStreamPieceBytes);
  EXPECT_TRUE((*array)->ReadsInPlace({0}, Box::FromShape({kElements}),
                                     Box::FromShape({kElements}), DType::kFloat32));
  EXPECT_FALSE((*array)->ReadsInPlace({0}, Box::FromShape({kElements}),
                                      Box::FromShape({kElements}), DType::kFloat64));

  StagingPool staging(uint64_t{1} << 30);
  std::string got(data.size(), '\x55');
  TS_ASSERT_OK((*array)->Read(Box::FromShape({kElements}), DType::kFloat32, got.data(), nullptr,
                              &staging));
  EXPECT_TRUE(got == data);
  EXPECT_LE(staging.peak(), kInPlaceStreamPieceBytes);

  // A skippable frame (magic 0x184D2A50, 4-byte length, payload) after the data: still good.
  std::string skippable(
      "\x50\x2A\x4D\x18\x03\x00\x00\x00"
      "abc",
      11);
  TS_ASSERT_OK(kv.Write(key, good + skippable));
  std::fill(got.begin(), got.end(), '\x55');
  TS_ASSERT_OK((*array)->Read(Box::FromShape({kElements}), DType::kFloat32, got.data(), nullptr,
                              &staging));
  EXPECT_TRUE(got == data);

  std::string flipped = good;
  for (size_t i = good.size() / 2; i < good.size() / 2 + 64; ++i) flipped[i] ^= 0x5A;
  std::string twice(ZSTD_compressBound(2 * data.size()), '\0');
  twice.resize(
      ZSTD_compress(twice.data(), twice.size(), (data + data).data(), 2 * data.size(), 1));
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"truncated", good.substr(0, good.size() - kInPlaceStreamPieceBytes / 2)},
      {"truncated", good.substr(0, good.size() - 1)},
      {"decodes to more than", twice},
      {"decodes to more than", good + good},
      {"", flipped},
      {"more than any encoding",
       std::string(2 * data.size() + 16 * kElements + (128 << 10), 'x')},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(i);
    TS_ASSERT_OK(kv.Write(key, bad[i].second));
    Status s = (*array)->Read(Box::FromShape({kElements}), DType::kFloat32, got.data(), nullptr,
                              &staging);
    EXPECT_TRUE(absl::IsDataLoss(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(key));
    EXPECT_THAT(std::string(s.message()), HasSubstr(bad[i].first));
  }
  // Random damage (a cut, or bytes changed, anywhere): DataLoss, or values where zstd stored
  // the bytes raw and has no checksum to tell; never a crash or a read that does not end.
  std::mt19937 rng(17);
  for (int i = 0; i < 24; ++i) {
    std::string damaged = good;
    if (i % 3 == 0) {
      damaged.resize(rng() % good.size());
    } else {
      for (int k = 0; k < 1 + i % 5; ++k) damaged[rng() % good.size()] ^= 1 + rng() % 255;
    }
    TS_ASSERT_OK(kv.Write(key, damaged));
    Status s = (*array)->Read(Box::FromShape({kElements}), DType::kFloat32, got.data(), nullptr,
                              &staging);
    EXPECT_TRUE(s.ok() || absl::IsDataLoss(s)) << i << " " << s;
  }
  EXPECT_LE(staging.peak(), kInPlaceStreamPieceBytes);
}

// ZstdDecodeStreamInto takes the stream in pieces of any size, down to one byte.
TEST(ZarrCodecTest, ZstdStreamsInPiecesOfAnySize) {
  const std::string data = RandomData(DType::kUint8, 100000, 8);
  std::string z(ZSTD_compressBound(data.size()), '\0');
  z.resize(ZSTD_compress(z.data(), z.size(), data.data(), data.size(), 3));
  for (size_t piece : {size_t{1}, size_t{7}, size_t{4096}, z.size()}) {
    SCOPED_TRACE(piece);
    size_t offset = 0;
    std::string out(data.size(), '\0');
    TS_ASSERT_OK(ZstdDecodeStreamInto(
        [&]() -> Result<std::string_view> {
          const size_t n = std::min(piece, z.size() - offset);
          std::string_view next(z.data() + offset, n);
          offset += n;
          return next;
        },
        out.data(), out.size(), "stream"));
    EXPECT_TRUE(out == data);
  }
  // The reader's error comes back as it is.
  Status s = ZstdDecodeStreamInto([]() -> Result<std::string_view> { return UnavailableError("gone"); },
                                  nullptr, 0, "stream");
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
}

TEST(ZarrArrayHostileTest, DecompressionBombIsBounded) {
  MemoryKvStore kv;
  TS_ASSERT_OK(kv.Write("b/.zarray", R"({"zarr_format":2,"shape":[16],"chunks":[16],"dtype":"<f4",
      "compressor":{"id":"zstd","level":1},"fill_value":0,"order":"C","filters":null})"));
  // 64 MiB of zeros in a few KiB: far more than the 64-byte chunk.
  std::string zeros(64 << 20, '\0');
  std::string frame(ZSTD_compressBound(zeros.size()), '\0');
  frame.resize(ZSTD_compress(frame.data(), frame.size(), zeros.data(), zeros.size(), 1));
  TS_ASSERT_OK(kv.Write("b/0", frame));
  auto a = ZarrArray::Open(&kv, "b");
  ASSERT_TRUE(a.ok());
  float got[16];
  Status s = (*a)->Read(Box::FromShape({16}), DType::kFloat32, got);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("more than"));
  // The same without a declared size (streaming frame).
  ZSTD_CStream* cs = ZSTD_createCStream();
  ZSTD_initCStream(cs, 1);
  std::string streamed(ZSTD_compressBound(zeros.size()), '\0');
  ZSTD_inBuffer in{zeros.data(), zeros.size(), 0};
  ZSTD_outBuffer out{streamed.data(), streamed.size(), 0};
  ZSTD_compressStream(cs, &out, &in);
  ZSTD_endStream(cs, &out);
  ZSTD_freeCStream(cs);
  streamed.resize(out.pos);
  ASSERT_EQ(ZSTD_getFrameContentSize(streamed.data(), streamed.size()), ZSTD_CONTENTSIZE_UNKNOWN);
  TS_ASSERT_OK(kv.Write("b/0", streamed));
  s = (*a)->Read(Box::FromShape({16}), DType::kFloat32, got);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  // A streaming frame of the right size decodes.
  std::vector<float> values(16, 2.5f);
  cs = ZSTD_createCStream();
  ZSTD_initCStream(cs, 1);
  std::string small(1024, '\0');
  ZSTD_inBuffer in2{values.data(), 64, 0};
  ZSTD_outBuffer out2{small.data(), small.size(), 0};
  ZSTD_compressStream(cs, &out2, &in2);
  ZSTD_endStream(cs, &out2);
  ZSTD_freeCStream(cs);
  small.resize(out2.pos);
  TS_ASSERT_OK(kv.Write("b/0", small));
  TS_ASSERT_OK((*a)->Read(Box::FromShape({16}), DType::kFloat32, got));
  EXPECT_EQ(got[15], 2.5f);
}

TEST(ZarrArrayHostileTest, BadReadRequests) {
  MemoryKvStore kv;
  ZarrArraySpec spec;
  spec.dtype = DType::kFloat32;
  spec.shape = {4};
  ASSERT_TRUE(ZarrArrayWriter::Create(&kv, "r", spec).ok());
  auto a = ZarrArray::Open(&kv, "r");
  float buf[4];
  EXPECT_TRUE(absl::IsInvalidArgument((*a)->Read(Box::FromShape({4, 1}), DType::kFloat32, buf)));
  EXPECT_TRUE(absl::IsInvalidArgument((*a)->Read(Box({-1}, {2}), DType::kFloat32, buf)));
  EXPECT_TRUE(absl::IsInvalidArgument((*a)->Read(Box::FromShape({4}), DType::kBool, buf)));
  EXPECT_TRUE(absl::IsInvalidArgument((*a)->Read(Box::FromShape({4}), DType::kFloat32, nullptr)));
  // Writer specs.
  spec.chunk_shape = {0};
  EXPECT_FALSE(ZarrArrayWriter::Create(&kv, "w", spec).ok());
  spec.chunk_shape = {4};
  spec.inner_chunk_shape = {3};
  EXPECT_TRUE(absl::IsInvalidArgument(ZarrArrayWriter::Create(&kv, "w", spec).status()));
  spec.shape = {-1};
  EXPECT_TRUE(absl::IsInvalidArgument(ZarrArrayWriter::Create(&kv, "w", spec).status()));
}

// Random byte damage to metadata and shards: any outcome but a crash (run under ASan in CI).
TEST(ZarrArrayHostileTest, RandomDamageNeverCrashes) {
  MemoryKvStore kv;
  ZarrArraySpec spec;
  spec.dtype = DType::kInt32;
  spec.shape = {6, 5};
  spec.chunk_shape = {4, 4};
  spec.inner_chunk_shape = {2, 2};
  auto w = ZarrArrayWriter::Create(&kv, "d", spec);
  ASSERT_TRUE(w.ok());
  const std::string data = RandomData(DType::kInt32, 30, 4);
  TS_ASSERT_OK((*w)->WriteBox(Box::FromShape({6, 5}), data.data()));
  const std::string meta = *kv.Read("d/zarr.json");
  const std::string shard = *kv.Read("d/c/0/0");
  std::mt19937 rng(42);
  std::vector<int32_t> got(30);
  for (int iter = 0; iter < 2000; ++iter) {
    std::string m = meta, s = shard;
    std::string& target = iter % 2 ? s : m;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      target[rng() % target.size()] = static_cast<char>(rng());
    }
    if (iter % 7 == 0) target.resize(rng() % target.size());
    TS_ASSERT_OK(kv.Write("d/zarr.json", m));
    TS_ASSERT_OK(kv.Write("d/c/0/0", s));
    auto a = ZarrArray::Open(&kv, "d");
    if (!a.ok()) continue;
    const Box box = Box::FromShape((*a)->shape());
    if (box.num_elements() > 1000 || box.rank() != 2) continue;
    got.resize(static_cast<size_t>(box.num_elements()) * 2);
    (void)(*a)->Read(box, DType::kInt64, got.data());
    (void)(*a)->Read(Box({1, 1}, {2, 2}), DType::kInt32, got.data());
  }
}

}  // namespace
}  // namespace tensorstash
