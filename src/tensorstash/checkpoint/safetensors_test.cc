// Unit tests of the safetensors header parser (hostile headers), SafetensorsReader (files,
// folders, box reads of byte ranges, casts, zeros past the shape) and ExportSafetensors (names,
// sharding, the index last). The safetensors library and transformers are checked against in
// tests/python/test_safetensors_interop.py.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/checkpoint/safetensors_export.h"
#include "tensorstash/checkpoint/safetensors_reader.h"
#include "tensorstash/format/safetensors/safetensors_header.h"
#include "tensorstash/kvstore/file/file_kvstore.h"
#include "tensorstash/kvstore/memory/memory_kvstore.h"
#include "tensorstash/testing/status_test_macros.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

// A file from a header's JSON text and `data_bytes` bytes of data (byte i = i % 251).
std::string File(const std::string& json, size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += json;
  for (size_t i = 0; i < data_bytes; ++i) out += static_cast<char>(i % 251);
  return out;
}

Status ParseFile(const std::string& file) {
  Result<uint64_t> n = ParseSafetensorsHeaderLength(file.substr(0, 8), file.size(), "f");
  if (!n.ok()) return n.status();
  return ParseSafetensorsHeader(std::string_view(file).substr(8, *n), file.size(), "f").status();
}

void ExpectError(const std::string& file, absl::StatusCode code, const std::string& text) {
  Status s = ParseFile(file);
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(text));
  EXPECT_THAT(std::string(s.message()), HasSubstr("'f'"));
}

TEST(SafetensorsHeaderTest, ParsesAWellFormedHeader) {
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2],"data_offsets":[24,28]},)"
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})";
  const std::string file = File(json, 28);
  auto header = ParseSafetensorsHeader(std::string_view(file).substr(8, json.size()), file.size(), "f");
  TS_ASSERT_OK(header.status());
  ASSERT_EQ(header->tensors.size(), 2u);
  EXPECT_EQ(header->tensors[0].name, "a");  // file order
  EXPECT_EQ(header->tensors[0].dtype, DType::kFloat32);
  EXPECT_EQ(header->tensors[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(header->tensors[0].begin, 8 + json.size());
  EXPECT_EQ(header->tensors[1].dtype, DType::kBfloat16);
  ASSERT_EQ(header->metadata.size(), 1u);
  EXPECT_EQ(header->metadata[0].second, "pt");
}

TEST(SafetensorsHeaderTest, RefusesHostileHeaders) {
  const std::string t = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  // Lengths.
  ExpectError("abc", absl::StatusCode::kDataLoss, "too short");
  std::string huge(8, '\0');
  huge[4] = 1;  // 2^32
  ExpectError(huge + "{}", absl::StatusCode::kDataLoss, "over the limit");
  std::string past(8, '\0');
  past[0] = 100;
  ExpectError(past + "{}", absl::StatusCode::kDataLoss, "past the end of the file");
  // JSON.
  ExpectError(File("{\"a\":", 0), absl::StatusCode::kDataLoss, "not valid JSON");
  ExpectError(File("[1]", 0), absl::StatusCode::kDataLoss, "does not start with '{'");
  ExpectError(File("{" + t + "," + t + "}", 8), absl::StatusCode::kDataLoss,
              "tensor 'a' appears twice");
  ExpectError(File(R"({"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8),
              absl::StatusCode::kDataLoss, "appears twice");
  ExpectError(File(R"({"a":{"dtype":"F32","shape":[2]}})", 0), absl::StatusCode::kDataLoss,
              "lacks \"data_offsets\"");
  ExpectError(File(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
              absl::StatusCode::kDataLoss, "negative");
  ExpectError(File(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8),
              absl::StatusCode::kDataLoss, "non-integer");
  // Dtypes.
  ExpectError(File(R"({"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", 8),
              absl::StatusCode::kDataLoss, "unknown dtype \"F33\"");
  ExpectError(File(R"({"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", 1),
              absl::StatusCode::kUnimplemented, "F4");
  // Offsets and sizes.
  ExpectError(File(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
              absl::StatusCode::kDataLoss, "needs 12");
  ExpectError(File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8),
              absl::StatusCode::kDataLoss, "end before they begin");
  ExpectError(File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4),
              absl::StatusCode::kDataLoss, "past the end of the file");
  ExpectError(File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                   R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
              absl::StatusCode::kDataLoss, "overlaps tensor 'a'");
  ExpectError(File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
              absl::StatusCode::kDataLoss, "a hole of 4 bytes before tensor 'a'");
  ExpectError(File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 10),
              absl::StatusCode::kDataLoss, "2 bytes after the last tensor");
  ExpectError(File(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296,4294967296],)"
                   R"("data_offsets":[0,8]}})", 8),
              absl::StatusCode::kDataLoss, "overflows");
  ExpectError(File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8),
              absl::StatusCode::kDataLoss, "unknown member \"x\"");
  ExpectError(File(R"({"__metadata__":{"k":{"x":1}}})", 0), absl::StatusCode::kDataLoss,
              "nested object");
}

TEST(SafetensorsHeaderTest, EncodeParsesBack) {
  std::vector<SafetensorsTensor> tensors(2);
  tensors[0].name = "w.0";
  tensors[0].dtype = DType::kFloat8E4m3fn;
  tensors[0].shape = {3, 5};
  tensors[1].name = "b\"q";
  tensors[1].dtype = DType::kInt64;
  tensors[1].shape = {};
  auto header = EncodeSafetensorsHeader(tensors, {{"format", "pt"}});
  TS_ASSERT_OK(header.status());
  EXPECT_EQ(header->size() % 8, 0u);
  const std::string file = *header + std::string(15 + 8, 'x');
  auto parsed = ParseSafetensorsHeader(std::string_view(file).substr(8, header->size() - 8),
                                       file.size(), "f");
  TS_ASSERT_OK(parsed.status());
  ASSERT_EQ(parsed->tensors.size(), 2u);
  EXPECT_EQ(parsed->tensors[1].name, "b\"q");
  EXPECT_EQ(parsed->tensors[1].begin, tensors[1].begin);
  EXPECT_EQ(parsed->tensors[0].dtype, DType::kFloat8E4m3fn);
  tensors[0].dtype = DType::kComplex128;
  EXPECT_EQ(EncodeSafetensorsHeader(tensors, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

// A file with "m": int32 [5, 6, 7] holding 0..209 and "s": float32 scalar 2.5.
std::string SampleFile() {
  std::vector<SafetensorsTensor> tensors(2);
  tensors[0].name = "m";
  tensors[0].dtype = DType::kInt32;
  tensors[0].shape = {5, 6, 7};
  tensors[1].name = "s";
  tensors[1].dtype = DType::kFloat32;
  tensors[1].shape = {};
  std::string file = *EncodeSafetensorsHeader(tensors, {});
  std::vector<int32_t> m(210);
  std::iota(m.begin(), m.end(), 0);
  file.append(reinterpret_cast<const char*>(m.data()), m.size() * 4);
  const float s = 2.5f;
  file.append(reinterpret_cast<const char*>(&s), 4);
  return file;
}

TEST(SafetensorsReaderTest, ReadsBoxesOfAFile) {
  MemoryKvStore kv;
  TS_ASSERT_OK(kv.Write("x/model.safetensors", SampleFile()));
  for (const std::string path : {"x/model.safetensors", "x"}) {
    auto source = OpenStepSource(&kv, path);
    TS_ASSERT_OK(source.status());
    EXPECT_EQ((*source)->format(), StepFormat::kSafetensors);
    ASSERT_EQ((*source)->arrays().size(), 2u);
    EXPECT_EQ((*source)->tree().entries[0].first, "m");
    // A box inside: [1:3, 2:5, 3:7], read as int64 (a cast).
    const Box box({1, 2, 3}, {2, 3, 4});
    std::vector<int64_t> got(24);
    ReadStats stats;
    TS_ASSERT_OK((*source)->ReadMany({{"m", box, DType::kInt64, got.data()}}, &stats, nullptr));
    size_t i = 0;
    for (int a = 1; a < 3; ++a)
      for (int b = 2; b < 5; ++b)
        for (int c = 3; c < 7; ++c) EXPECT_EQ(got[i++], a * 42 + b * 7 + c);
    // Only the box's rows' span was read, not the whole tensor.
    EXPECT_LT(stats.bytes_read, 210u * 4);
    // A box reaching past the shape: zeros there.
    std::vector<int32_t> past(2 * 6 * 8, -1);
    TS_ASSERT_OK((*source)->ReadMany({{"m", Box({4, 0, 0}, {2, 6, 8}), DType::kInt32, past.data()}},
                                     nullptr, nullptr));
    EXPECT_EQ(past[0], 4 * 42);
    EXPECT_EQ(past[7], 0);       // column 7 is past the shape
    EXPECT_EQ(past[6 * 8], 0);   // row 5 is past the shape
    float s = 0;
    TS_ASSERT_OK((*source)->ReadMany({{"s", Box({}, {}), DType::kFloat32, &s}}, nullptr, nullptr));
    EXPECT_EQ(s, 2.5f);
    auto bad = (*source)->Verify(nullptr);
    TS_ASSERT_OK(bad.status());
    EXPECT_TRUE(bad->empty());
  }
}

TEST(SafetensorsReaderTest, ReadsAnIndexedFolderAndRefusesBadIndexes) {
  MemoryKvStore kv;
  TS_ASSERT_OK(kv.Write("hf/a.safetensors", SampleFile()));
  std::vector<SafetensorsTensor> t(1);
  t[0].name = "z";
  t[0].dtype = DType::kUint8;
  t[0].shape = {3};
  TS_ASSERT_OK(kv.Write("hf/b.safetensors", *EncodeSafetensorsHeader(t, {}) + "abc"));
  TS_ASSERT_OK(kv.Write("hf/model.safetensors.index.json",
                        R"({"metadata":{},"weight_map":{"m":"a.safetensors","z":"b.safetensors",)"
                        R"("s":"a.safetensors"}})"));
  auto source = OpenStepSource(&kv, "hf");
  TS_ASSERT_OK(source.status());
  ASSERT_EQ((*source)->arrays().size(), 3u);
  std::string z(3, '\0');
  TS_ASSERT_OK((*source)->ReadMany({{"z", Box({0}, {3}), DType::kUint8, z.data()}}, nullptr, nullptr));
  EXPECT_EQ(z, "abc");

  TS_ASSERT_OK(kv.Write("hf/model.safetensors.index.json",
                        R"({"weight_map":{"m":"a.safetensors","z":"a.safetensors","s":"a.safetensors"}})"));
  EXPECT_THAT(std::string(OpenStepSource(&kv, "hf").status().message()),
              HasSubstr("tensor 'z' in 'hf/a.safetensors', which does not hold it"));
  TS_ASSERT_OK(kv.Write("hf/model.safetensors.index.json",
                        R"({"weight_map":{"m":"../a.safetensors"}})"));
  EXPECT_THAT(std::string(OpenStepSource(&kv, "hf").status().message()),
              HasSubstr("not a file of the folder"));
  TS_ASSERT_OK(kv.Write("hf/model.safetensors.index.json", R"({"weight_map":{"m":"a.safetensors"}})"));
  EXPECT_THAT(std::string(OpenStepSource(&kv, "hf").status().message()),
              HasSubstr("tensor 's' of 'hf/a.safetensors' is not in"));
  TS_ASSERT_OK(kv.Write("hf/model.safetensors.index.json", "{"));
  EXPECT_EQ(OpenStepSource(&kv, "hf").status().code(), absl::StatusCode::kDataLoss);
}

TEST(SafetensorsExportTest, ExportsShardedWithTheIndexLast) {
  MemoryKvStore kv;
  TS_ASSERT_OK(kv.Write("src/model.safetensors", SampleFile()));
  auto source = OpenStepSource(&kv, "src");
  TS_ASSERT_OK(source.status());
  SafetensorsExportOptions options;
  options.max_shard_bytes = 100;  // "m" (840 bytes) and "s" in files of their own
  options.piece_bytes = 100;      // several pieces per tensor
  auto result = ExportSafetensors(source->get(), &kv, "out", options);
  TS_ASSERT_OK(result.status());
  EXPECT_EQ(result->files,
            (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                      "model-00002-of-00002.safetensors"}));
  EXPECT_EQ(result->total_bytes, 844u);
  auto back = OpenStepSource(&kv, "out");
  TS_ASSERT_OK(back.status());
  std::vector<int32_t> m(210);
  TS_ASSERT_OK((*back)->ReadMany({{"m", Box::FromShape({5, 6, 7}), DType::kInt32, m.data()}},
                                 nullptr, nullptr));
  for (int i = 0; i < 210; ++i) ASSERT_EQ(m[i], i);
  auto index = kv.Read("out/model.safetensors.index.json");
  TS_ASSERT_OK(index.status());
  EXPECT_THAT(*index, HasSubstr("\"total_size\": 844"));
  // A second export into it is refused.
  EXPECT_EQ(ExportSafetensors(source->get(), &kv, "out", options).status().code(),
            absl::StatusCode::kAlreadyExists);
}

// Pieces never exceed piece_bytes, even when a row of the first dimension does: a row of "m"
// is 168 bytes, cut at the second dimension (28-byte steps) or the third (4-byte elements).
TEST(SafetensorsExportTest, PiecesSmallerThanARowGiveTheSameFile) {
  MemoryKvStore kv;
  TS_ASSERT_OK(kv.Write("src/model.safetensors", SampleFile()));
  auto source = OpenStepSource(&kv, "src");
  TS_ASSERT_OK(source.status());
  std::string reference;
  for (uint64_t piece : {uint64_t{1} << 20, uint64_t{100}, uint64_t{30}, uint64_t{8}, uint64_t{1}}) {
    SafetensorsExportOptions options;
    options.piece_bytes = piece;
    options.max_inflight_bytes = std::max<uint64_t>(piece, 4);
    const std::string out = StrCat("out", piece);
    auto result = ExportSafetensors(source->get(), &kv, out, options);
    TS_ASSERT_OK(result.status());
    ASSERT_EQ(result->files.size(), 1u);
    auto file = kv.Read(StrCat(out, "/", result->files[0]));
    TS_ASSERT_OK(file.status());
    if (reference.empty()) reference = *file;
    EXPECT_EQ(*file, reference) << "piece_bytes " << piece;
  }
  auto back = OpenStepSource(&kv, "out1");
  TS_ASSERT_OK(back.status());
  std::vector<int32_t> m(210);
  TS_ASSERT_OK((*back)->ReadMany({{"m", Box::FromShape({5, 6, 7}), DType::kInt32, m.data()}},
                                 nullptr, nullptr));
  for (int i = 0; i < 210; ++i) ASSERT_EQ(m[i], i);
}

// Into files on disk, where pieces of 1 MiB and more go through O_DIRECT for their whole 4 KiB
// blocks: tensors at offsets that are not multiples of 4 KiB (any header length), pieces of
// several sizes, come out byte for byte.
TEST(SafetensorsExportTest, DirectWritesOfUnalignedPiecesGiveTheSameFile) {
  MemoryKvStore kv;
  std::vector<SafetensorsTensor> tensors(2);
  tensors[0].name = "a";
  tensors[0].dtype = DType::kInt32;
  tensors[0].shape = {3};
  tensors[1].name = "big";
  tensors[1].dtype = DType::kInt32;
  tensors[1].shape = {777, 1031};  // 3.06 MiB, rows of 4124 bytes
  std::string file = *EncodeSafetensorsHeader(tensors, {});
  std::vector<int32_t> values(3 + 777 * 1031);
  std::iota(values.begin(), values.end(), 11);
  file.append(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  TS_ASSERT_OK(kv.Write("src/model.safetensors", file));
  auto source = OpenStepSource(&kv, "src");
  TS_ASSERT_OK(source.status());
  char dir[] = "/tmp/tensorstash_export_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  auto disk = FileKvStore::Open(dir);
  TS_ASSERT_OK(disk.status());
  for (uint64_t piece : {uint64_t{64} << 20, uint64_t{3} << 20, uint64_t{1100000}}) {
    SafetensorsExportOptions options;
    options.piece_bytes = piece;
    options.io_threads = 3;
    const std::string out = StrCat("out", piece);
    auto result = ExportSafetensors(source->get(), disk->get(), out, options);
    TS_ASSERT_OK(result.status());
    ASSERT_EQ(result->files.size(), 1u);
    auto written = (*disk)->Read(StrCat(out, "/", result->files[0]));
    TS_ASSERT_OK(written.status());
    // The header may differ (its padding, metadata); the tensors' bytes are the last ones.
    const size_t data = values.size() * 4;
    ASSERT_GT(written->size(), data) << piece;
    EXPECT_NE((written->size() - data) % 4096, 0u);
    EXPECT_TRUE(written->compare(written->size() - data, data, file, file.size() - data) == 0)
        << "piece_bytes " << piece;
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

TEST(SafetensorsExportTest, AFailedReadEndsTheExportWithoutAnIndexOrLeftovers) {
  MemoryKvStore kv;
  TS_ASSERT_OK(kv.Write("src/model.safetensors", SampleFile()));
  auto source = OpenStepSource(&kv, "src");
  TS_ASSERT_OK(source.status());
  TS_ASSERT_OK(kv.Delete("src/model.safetensors"));  // every read of a tensor now fails
  SafetensorsExportOptions options;
  options.piece_bytes = 28;        // 30 pieces of "m"
  options.max_inflight_bytes = 28;  // one at a time: a skipped piece must not keep its bytes
  options.io_threads = 2;
  auto result = ExportSafetensors(source->get(), &kv, "out", options);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kNotFound) << result.status();
  auto left = kv.List("");
  TS_ASSERT_OK(left.status());
  EXPECT_TRUE(left->empty()) << left->size() << " keys left, e.g. " << (*left)[0];
}

TEST(SafetensorsExportTest, RefusesCollidingNamesAndMissingDtypes) {
  TreeNode root = TreeNode::Dict();
  TreeNode a = TreeNode::Dict();
  a.entries.emplace_back("b", TreeNode::Array(0));
  root.entries.emplace_back("a", a);
  root.entries.emplace_back("a.b", TreeNode::Array(1));
  auto names = SafetensorsNames(root, nullptr);
  EXPECT_EQ(names.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(names.status().message()), HasSubstr("'a/b' and 'a.b'"));
  TreeNode list = TreeNode::Dict();
  TreeNode items;
  items.kind = TreeNode::Kind::kList;
  items.items.push_back(TreeNode::Array(0));
  list.entries.emplace_back("layers", items);
  TreeNode step;
  step.kind = TreeNode::Kind::kInt;
  step.int_value = "3";
  list.entries.emplace_back("step", step);
  std::vector<std::string> skipped;
  auto ok = SafetensorsNames(list, &skipped);
  TS_ASSERT_OK(ok.status());
  EXPECT_EQ((*ok)[0].first, "layers.0");
  EXPECT_EQ(skipped, std::vector<std::string>{"step"});
  EXPECT_THAT(std::string(SafetensorsDTypeName(DType::kComplex128, "tensor 'x'").status().message()),
              HasSubstr("tensor 'x': safetensors has no dtype for complex128"));
}

}  // namespace
}  // namespace tensorstash
