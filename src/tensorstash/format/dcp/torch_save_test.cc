#include "tensorstash/format/dcp/torch_save.h"

#include <zlib.h>

#include <complex>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/format/dcp/dcp_metadata.h"
#include "tensorstash/testing/status_test_macros.h"
#include "tensorstash/testing/test_files.h"
#include "tensorstash/util/endian.h"

namespace tensorstash {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Dir(const std::string& name) { return std::string(TS_TEST_DATA_DIR) + "/dcp/" + name; }

template <typename T>
std::vector<T> Values(std::string_view archive, const TorchSavedTensor& t) {
  std::vector<T> out(t.data_length / sizeof(T));
  std::memcpy(out.data(), archive.data() + t.data_offset, t.data_length);
  return out;
}

// Every tensor of the single-process checkpoint, located through its metadata and archive,
// holds what tests/tools/make_dcp_checkpoints.py saved.
TEST(TorchSave, ReadsEveryTensorOfARealCheckpoint) {
  Result<DcpMetadata> md =
      ParseDcpMetadata(ReadFileToString(Dir("single") + "/.metadata"), "single");
  TS_ASSERT_OK(md.status());
  std::map<std::string, std::pair<std::string, TorchSavedTensor>> found;
  for (const DcpTensor& t : md->tensors) {
    ASSERT_EQ(t.chunks.size(), 1u);
    const DcpItemLocation& loc = t.chunks[0].location;
    std::string file = ReadFileToString(Dir("single") + "/" + loc.relative_path);
    ASSERT_LE(loc.offset + loc.length, file.size());
    std::string archive = file.substr(loc.offset, loc.length);
    Result<TorchSavedTensor> saved = ReadTorchSavedTensor(archive, t.fqn);
    TS_ASSERT_OK(saved.status()) << t.fqn;
    EXPECT_EQ(saved->dtype, t.dtype) << t.fqn;
    EXPECT_EQ(saved->shape, t.shape) << t.fqn;
    uint64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    EXPECT_EQ(saved->data_length, n * ItemSize(t.dtype)) << t.fqn;
    found[t.fqn] = {archive, *saved};
  }
  ASSERT_EQ(found.size(), 17u);
  auto get = [&](const std::string& k) -> std::pair<std::string, TorchSavedTensor>& {
    return found.at(k);
  };
  // (arange(6) % 5).to(dtype).reshape(2, 3) for the dtypes below.
  EXPECT_THAT(Values<int64_t>(get("model.view").first, get("model.view").second),
              ElementsAre(5, 6, 7, 8));
  EXPECT_THAT(Values<uint16_t>(get("model.d_uint16").first, get("model.d_uint16").second),
              ElementsAre(0, 1, 2, 3, 4, 0));
  EXPECT_THAT(Values<uint64_t>(get("model.d_uint64").first, get("model.d_uint64").second),
              ElementsAre(0, 1, 2, 3, 4, 0));
  EXPECT_THAT(Values<int8_t>(get("model.d_int8").first, get("model.d_int8").second),
              ElementsAre(0, 1, 2, 3, 4, 0));
  EXPECT_THAT(Values<uint8_t>(get("model.d_bool").first, get("model.d_bool").second),
              ElementsAre(0, 1, 1, 1, 1, 0));
  // float8_e4m3fn: 0, 1, 2, 3, 4, 0 are 0x00, 0x38, 0x40, 0x44, 0x48, 0x00.
  EXPECT_THAT(Values<uint8_t>(get("model.d_float8_e4m3fn").first, get("model.d_float8_e4m3fn").second),
              ElementsAre(0x00, 0x38, 0x40, 0x44, 0x48, 0x00));
  EXPECT_THAT(Values<std::complex<float>>(get("model.d_complex64").first,
                                          get("model.d_complex64").second),
              ElementsAre(0.f, 1.f, 2.f, 3.f, 4.f, 0.f));
  EXPECT_THAT(Values<double>(get("model.scalar").first, get("model.scalar").second),
              ElementsAre(2.5));
  EXPECT_EQ(get("model.empty").second.data_length, 0u);
}

TEST(TorchSave, ReadsAShardOfATwoRankCheckpoint) {
  Result<DcpMetadata> md =
      ParseDcpMetadata(ReadFileToString(Dir("two_ranks") + "/.metadata"), "two");
  TS_ASSERT_OK(md.status());
  const DcpChunk& second = md->tensors[0].chunks[1];  // rows 5-9 of arange(40).reshape(10, 4)
  std::string file = ReadFileToString(Dir("two_ranks") + "/" + second.location.relative_path);
  std::string archive = file.substr(second.location.offset, second.location.length);
  Result<TorchSavedTensor> t = ReadTorchSavedTensor(archive, "x");
  TS_ASSERT_OK(t.status());
  EXPECT_THAT(t->shape, ElementsAre(5, 4));
  std::vector<float> v = Values<float>(archive, *t);
  ASSERT_EQ(v.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(v[i], 20.f + i);
}

// A stored zip of `files` (as torch.save lays them out, without alignment).
std::string Zip(const std::vector<std::pair<std::string, std::string>>& files) {
  std::string out, dir;
  for (const auto& [name, data] : files) {
    uint32_t crc = static_cast<uint32_t>(
        crc32(0, reinterpret_cast<const Bytef*>(data.data()), static_cast<uInt>(data.size())));
    uint32_t local = static_cast<uint32_t>(out.size());
    for (std::string* s : {&out, &dir}) {
      PutLE32(s, s == &out ? 0x04034b50 : 0x02014b50);
      if (s == &dir) PutLE16(s, 20);
      PutLE16(s, 20);
      PutLE16(s, 0);
      PutLE16(s, 0);
      PutLE32(s, 0);
      PutLE32(s, crc);
      PutLE32(s, static_cast<uint32_t>(data.size()));
      PutLE32(s, static_cast<uint32_t>(data.size()));
      PutLE16(s, static_cast<uint16_t>(name.size()));
      PutLE16(s, 0);
      if (s == &dir) {
        PutLE16(s, 0);
        PutLE16(s, 0);
        PutLE16(s, 0);
        PutLE32(s, 0);
        PutLE32(s, local);
      }
      *s += name;
      if (s == &out) *s += data;
    }
  }
  uint32_t dir_offset = static_cast<uint32_t>(out.size());
  out += dir;
  PutLE32(&out, 0x06054b50);
  PutLE32(&out, 0);
  PutLE16(&out, static_cast<uint16_t>(files.size()));
  PutLE16(&out, static_cast<uint16_t>(files.size()));
  PutLE32(&out, static_cast<uint32_t>(dir.size()));
  PutLE32(&out, dir_offset);
  PutLE16(&out, 0);
  return out;
}

// data.pkl of _rebuild_tensor_v2((storage, type, "0", "cpu", numel), offset, size, stride, ...).
std::string DataPkl(const std::string& storage_type, int numel, int offset,
                    const std::vector<int>& size, const std::vector<int>& stride,
                    const std::string& rebuild = "_rebuild_tensor_v2") {
  std::string p = "\x80\x02" "ctorch._utils\n" + rebuild + "\n((X";
  PutLE32(&p, 7);
  p += "storage" + storage_type + "X";
  PutLE32(&p, 1);
  p += "0X";
  PutLE32(&p, 3);
  p += "cpuJ";
  PutLE32(&p, static_cast<uint32_t>(numel));
  p += "tQJ";
  PutLE32(&p, static_cast<uint32_t>(offset));
  p += "(";
  for (int s : size) {
    p += "J";
    PutLE32(&p, static_cast<uint32_t>(s));
  }
  p += "t(";
  for (int s : stride) {
    p += "J";
    PutLE32(&p, static_cast<uint32_t>(s));
  }
  p += "t\x89" "ccollections\nOrderedDict\n)RtR.";
  return p;
}

const std::string kFloat = "ctorch\nFloatStorage\n";

TEST(TorchSave, LocatesAnOffsetViewInsideAStorage) {
  std::string data(40, '\0');
  for (int i = 0; i < 10; ++i) data[4 * i] = static_cast<char>(i);
  std::string zip = Zip({{"a/data.pkl", DataPkl(kFloat, 10, 3, {2, 2}, {2, 1})},
                         {"a/data/0", data}, {"a/byteorder", "little"}});
  Result<TorchSavedTensor> t = ReadTorchSavedTensor(zip, "x");
  TS_ASSERT_OK(t.status());
  EXPECT_EQ(t->dtype, DType::kFloat32);
  EXPECT_THAT(t->shape, ElementsAre(2, 2));
  EXPECT_EQ(t->data_length, 16u);
  EXPECT_EQ(zip[t->data_offset], 3);
}

TEST(TorchSave, RefusesWhatIsNotOneContiguousTensor) {
  const std::string data(40, '\0');
  struct Case {
    std::string name;
    std::string zip;
    absl::StatusCode code;
    std::string message;
  };
  const absl::StatusCode loss = absl::StatusCode::kDataLoss;
  const Case cases[] = {
      {"transposed", Zip({{"a/data.pkl", DataPkl(kFloat, 10, 0, {2, 3}, {1, 2})}, {"a/data/0", data}}),
       absl::StatusCode::kUnimplemented, "not stored contiguously"},
      {"past storage", Zip({{"a/data.pkl", DataPkl(kFloat, 10, 8, {3}, {1})}, {"a/data/0", data}}),
       loss, "runs past its storage"},
      {"storage size", Zip({{"a/data.pkl", DataPkl(kFloat, 11, 0, {3}, {1})}, {"a/data/0", data}}),
       loss, "data.pkl says 44"},
      {"no storage", Zip({{"a/data.pkl", DataPkl(kFloat, 10, 0, {3}, {1})}}), loss,
       "no entry data/0"},
      {"no pickle", Zip({{"a/data/0", data}}), loss, "no data.pkl"},
      {"big endian", Zip({{"a/data.pkl", DataPkl(kFloat, 10, 0, {3}, {1})}, {"a/data/0", data},
                          {"a/byteorder", "big"}}),
       absl::StatusCode::kUnimplemented, "byte order 'big'"},
      {"not a tensor", Zip({{"a/data.pkl", "\x80\x02K\x07."}}), loss, "does not hold one tensor"},
      {"untyped v2", Zip({{"a/data.pkl", DataPkl("ctorch.storage\nUntypedStorage\n", 40, 0, {3}, {1})},
                          {"a/data/0", data}}),
       loss, "untyped"},
      {"v3 without dtype", Zip({{"a/data.pkl", DataPkl(kFloat, 10, 0, {3}, {1}, "_rebuild_tensor_v3")},
                                {"a/data/0", data}}),
       loss, "from 6 arguments"},
      {"huge size", Zip({{"a/data.pkl", DataPkl(kFloat, 10, 0, {0x7fffffff, 0x7fffffff, 0x7fffffff}, {1, 1, 1})},
                         {"a/data/0", data}}),
       loss, "overflows"},
      {"evil storage type", Zip({{"a/data.pkl", DataPkl("cos\nsystem\n", 10, 0, {3}, {1})}, {"a/data/0", data}}),
       absl::StatusCode::kInvalidArgument, "os.system"},
  };
  for (const Case& c : cases) {
    Result<TorchSavedTensor> t = ReadTorchSavedTensor(c.zip, "item7");
    ASSERT_FALSE(t.ok()) << c.name;
    EXPECT_EQ(t.status().code(), c.code) << c.name << ": " << t.status();
    EXPECT_THAT(t.status().message(), HasSubstr(c.message)) << c.name;
    EXPECT_THAT(t.status().message(), HasSubstr("item7")) << c.name;
  }
}

}  // namespace
}  // namespace tensorstash

namespace tensorstash {
namespace {

// A hole (bytes not read) inside the storage entry: located without looking at it, the entry's
// CRC left to the caller; a hole over anything else is OutOfRange, never a read of its bytes
// (the hole is filled with garbage here, which a read of it would take for damage).
TEST(TorchSave, LocatesATensorAroundAHoleInItsBytes) {
  Result<DcpMetadata> md =
      ParseDcpMetadata(ReadFileToString(Dir("two_ranks") + "/.metadata"), "two");
  TS_ASSERT_OK(md.status());
  const DcpChunk& second = md->tensors[0].chunks[1];  // rows 5-9 of arange(40).reshape(10, 4)
  std::string file = ReadFileToString(Dir("two_ranks") + "/" + second.location.relative_path);
  const std::string archive = file.substr(second.location.offset, second.location.length);
  Result<TorchSavedTensor> whole = ReadTorchSavedTensor(archive, "x");
  TS_ASSERT_OK(whole.status());
  EXPECT_TRUE(whole->whole_entry);
  const uint64_t begin = whole->data_offset, end = begin + whole->data_length;
  auto with_hole = [&](uint64_t hole_begin, uint64_t hole_end) {
    std::string holed = archive;
    for (uint64_t i = hole_begin; i < hole_end; ++i) holed[i] = static_cast<char>(0xA5);
    return ReadTorchSavedTensor(holed, "x", /*check_crc=*/true, ZipHole{hole_begin, hole_end});
  };
  Result<TorchSavedTensor> around = with_hole(begin + 8, end - 8);
  TS_ASSERT_OK(around.status());
  EXPECT_EQ(around->data_offset, begin);
  EXPECT_EQ(around->data_length, whole->data_length);
  EXPECT_TRUE(around->whole_entry);
  EXPECT_EQ(around->data_crc32, whole->data_crc32);
  EXPECT_EQ(around->data_crc32,
            static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(archive.data() + begin),
                                        static_cast<uInt>(end - begin))));
  // The whole entry may be the hole.
  TS_EXPECT_OK(with_hole(begin, end).status());
  // Past the entry's ends (into the next local header, or the previous), over data.pkl, over
  // the central directory: OutOfRange.
  EXPECT_TRUE(absl::IsOutOfRange(with_hole(begin + 8, end + 1).status()));
  EXPECT_TRUE(absl::IsOutOfRange(with_hole(begin - 1, end - 8).status()));
  EXPECT_TRUE(absl::IsOutOfRange(with_hole(40, 60).status()));
  EXPECT_TRUE(absl::IsOutOfRange(with_hole(archive.size() - 30, archive.size() - 20).status()));
  // Without a hole, the same garbage is a CRC mismatch.
  std::string damaged = archive;
  damaged[begin + 8] ^= 1;
  EXPECT_TRUE(absl::IsDataLoss(ReadTorchSavedTensor(damaged, "x").status()));
}

}  // namespace
}  // namespace tensorstash
