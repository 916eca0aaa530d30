#include "tensorstash/format/dcp/dcp_metadata.h"

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/status_test_macros.h"
#include "tensorstash/testing/test_files.h"
#include "tensorstash/util/endian.h"

namespace tensorstash {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string RealMetadata(const std::string& name) {
  return ReadFileToString(std::string(TS_TEST_DATA_DIR) + "/dcp/" + name + "/.metadata");
}

// Pieces of a protocol-2 pickle, to write the metadata DCP would write, and variants of it.
std::string Str(const std::string& s) {
  std::string out = "X";
  PutLE32(&out, static_cast<uint32_t>(s.size()));
  return out + s;
}
std::string Int(int64_t v) {
  std::string out = "\x8a\x08";
  PutLE64(&out, static_cast<uint64_t>(v));
  return out;
}
std::string Global(const std::string& module, const std::string& name) {
  return "c" + module + "\n" + name + "\n";
}
std::string Tuple(const std::vector<std::string>& items) {
  std::string out = "(";
  for (const std::string& i : items) out += i;
  return out + "t";
}
std::string Dict(const std::vector<std::pair<std::string, std::string>>& items) {
  std::string out = "}(";
  for (const auto& [k, v] : items) out += k + v;
  return out + "u";
}
std::string List(const std::vector<std::string>& items) {
  std::string out = "(";
  for (const std::string& i : items) out += i;
  return out + "l";
}
// A dataclass instance: cls.__new__(cls), then BUILD with `state`.
std::string Object(const std::string& module, const std::string& cls, const std::string& state) {
  return Global(module, cls) + ")\x81" + state + "b";
}
const std::string kMeta = "torch.distributed.checkpoint.metadata";
std::string Fields(const std::string& cls, const std::vector<std::pair<std::string, std::string>>& f) {
  std::vector<std::pair<std::string, std::string>> items;
  for (const auto& [k, v] : f) items.emplace_back(Str(k), v);
  return Object(kMeta, cls, Dict(items));
}
std::string Size(const std::vector<int64_t>& v) {
  std::vector<std::string> items;
  for (int64_t i : v) items.push_back(Int(i));
  return Global("torch", "Size") + "(" + Tuple(items) + "tR";
}
std::string Properties(const std::string& dtype) {
  return Object(kMeta, "TensorProperties",
                Tuple({Global("torch", dtype), "N", "\x89", "N", "\x89"}));
}
struct ChunkSpec {
  std::vector<int64_t> offsets, sizes;
  std::string file;
  int64_t offset, length;
};
std::string Tensor(const std::string& dtype, const std::vector<int64_t>& shape,
                   const std::vector<ChunkSpec>& chunks) {
  std::vector<std::string> cs;
  for (const ChunkSpec& c : chunks) {
    cs.push_back(Fields("ChunkStorageMetadata", {{"offsets", Size(c.offsets)}, {"sizes", Size(c.sizes)}}));
  }
  return Fields("TensorStorageMetadata",
                {{"properties", Properties(dtype)}, {"size", Size(shape)}, {"chunks", List(cs)}});
}
std::string Index(const std::string& fqn, const std::string& offset) {
  return Fields("MetadataIndex", {{"fqn", Str(fqn)}, {"offset", offset}, {"index", "N"}});
}
std::string Info(const std::string& file, int64_t offset, int64_t length,
                 const std::string& extra = "") {
  std::string state = "}(" + Str("relative_path") + Str(file) + Str("offset") + Int(offset) +
                      Str("length") + Int(length) + extra + "u";
  return Object("torch.distributed.checkpoint.filesystem", "_StorageInfo", state);
}
struct Entry {
  std::string fqn;
  std::string dtype;  // empty: a bytes item
  std::vector<int64_t> shape;
  std::vector<ChunkSpec> chunks;
};
std::string Metadata(const std::vector<Entry>& entries, const std::string& storage_extra = "",
                     const std::string& info_extra = "") {
  std::vector<std::pair<std::string, std::string>> sd, storage, planner;
  for (const Entry& e : entries) {
    if (e.dtype.empty()) {
      sd.emplace_back(Str(e.fqn), Object(kMeta, "BytesStorageMetadata", "}"));
      storage.emplace_back(Index(e.fqn, "N"), Info("__0_0.distcp", 0, 10, info_extra));
    } else {
      sd.emplace_back(Str(e.fqn), Tensor(e.dtype, e.shape, e.chunks));
      for (const ChunkSpec& c : e.chunks) {
        storage.emplace_back(Index(e.fqn, Size(c.offsets)), Info(c.file, c.offset, c.length, info_extra));
      }
    }
    planner.emplace_back(Str(e.fqn), Tuple({Str("model"), Int(0), Str(e.fqn)}));
  }
  std::string storage_dict = Dict(storage);
  storage_dict.insert(storage_dict.size() - 1, storage_extra);
  return "\x80\x02" +
         Fields("Metadata", {{"state_dict_metadata", Dict(sd)},
                             {"planner_data", Dict(planner)},
                             {"storage_data", storage_dict},
                             {"storage_meta", "N"},
                             {"version", Str("1.0.0")}}) +
         ".";
}

const std::vector<Entry> kGood = {
    {"w", "float32", {4, 6}, {{{0, 0}, {2, 6}, "__0_0.distcp", 0, 100}, {{2, 0}, {2, 6}, "__1_0.distcp", 50, 100}}},
    {"b", "bfloat16", {}, {{{}, {}, "__0_0.distcp", 100, 10}}},
    {"step", "", {}, {}},
};

TEST(DcpMetadata, ReadsTwoRankCheckpointWrittenByTorch) {
  Result<DcpMetadata> md = ParseDcpMetadata(RealMetadata("two_ranks"), "two_ranks");
  TS_ASSERT_OK(md.status());
  EXPECT_EQ(md->version, "1.0.0");
  ASSERT_EQ(md->tensors.size(), 2u);
  const DcpTensor& s = md->tensors[0];
  EXPECT_EQ(s.fqn, "sharded");
  EXPECT_EQ(s.dtype, DType::kFloat32);
  EXPECT_THAT(s.shape, ElementsAre(10, 4));
  EXPECT_THAT(s.path, ElementsAre("sharded"));
  ASSERT_EQ(s.chunks.size(), 2u);
  EXPECT_THAT(s.chunks[0].offsets, ElementsAre(0, 0));
  EXPECT_THAT(s.chunks[0].sizes, ElementsAre(5, 4));
  EXPECT_EQ(s.chunks[0].location.relative_path, "__0_0.distcp");
  EXPECT_EQ(s.chunks[0].location.offset, 0u);
  EXPECT_EQ(s.chunks[0].location.length, 1641u);
  EXPECT_THAT(s.chunks[1].offsets, ElementsAre(5, 0));
  EXPECT_EQ(s.chunks[1].location.relative_path, "__1_0.distcp");
  EXPECT_EQ(s.chunks[1].location.offset, 1261u);
  EXPECT_EQ(s.chunks[1].location.length, 1641u);
  const DcpTensor& r = md->tensors[1];
  EXPECT_EQ(r.fqn, "replicated");
  EXPECT_EQ(r.dtype, DType::kInt32);
  ASSERT_EQ(r.chunks.size(), 1u);  // saved once, though both ranks held it
  ASSERT_EQ(md->bytes_items.size(), 1u);
  EXPECT_EQ(md->bytes_items[0].fqn, "step");
  EXPECT_EQ(md->bytes_items[0].location.relative_path, "__1_0.distcp");
  EXPECT_EQ(md->bytes_items[0].location.length, 1261u);
}

TEST(DcpMetadata, ReadsEveryDtypeTorchWrote) {
  Result<DcpMetadata> md = ParseDcpMetadata(RealMetadata("single"), "single");
  TS_ASSERT_OK(md.status());
  std::map<std::string, const DcpTensor*> by_name;
  for (const DcpTensor& t : md->tensors) by_name[t.fqn] = &t;
  EXPECT_EQ(by_name.at("model.b")->dtype, DType::kBfloat16);
  EXPECT_EQ(by_name.at("model.d_float8_e4m3fn")->dtype, DType::kFloat8E4m3fn);
  EXPECT_EQ(by_name.at("model.d_float8_e5m2")->dtype, DType::kFloat8E5m2);
  EXPECT_EQ(by_name.at("model.d_uint64")->dtype, DType::kUint64);
  EXPECT_EQ(by_name.at("model.d_complex64")->dtype, DType::kComplex64);
  EXPECT_EQ(by_name.at("model.d_bool")->dtype, DType::kBool);
  EXPECT_TRUE(by_name.at("model.scalar")->shape.empty());
  EXPECT_EQ(by_name.at("model.scalar")->chunks.size(), 1u);
  EXPECT_THAT(by_name.at("model.empty")->shape, ElementsAre(0, 3));
  EXPECT_THAT(by_name.at("model.w")->path, ElementsAre("model", "w"));
  EXPECT_EQ(md->tensors.size(), 17u);
  ASSERT_EQ(md->bytes_items.size(), 3u);  // step, name, lst
}

TEST(DcpMetadata, ReadsWhatTheTestWriterWrites) {
  Result<DcpMetadata> md = ParseDcpMetadata(Metadata(kGood), "ck");
  TS_ASSERT_OK(md.status());
  ASSERT_EQ(md->tensors.size(), 2u);
  EXPECT_EQ(md->tensors[0].chunks[1].location.offset, 50u);
  EXPECT_THAT(md->tensors[0].path, ElementsAre("model", "0", "w"));
  EXPECT_EQ(md->tensors[1].dtype, DType::kBfloat16);
  ASSERT_EQ(md->bytes_items.size(), 1u);
}

struct Bad {
  std::string name;
  std::string pickle;
  absl::StatusCode code;
  std::vector<std::string> message;
};

TEST(DcpMetadata, RefusesWhatIsNotDcpOrNotUnderstood) {
  auto with = [](auto change) {
    std::vector<Entry> e = kGood;
    change(e);
    return Metadata(e);
  };
  const absl::StatusCode loss = absl::StatusCode::kDataLoss;
  const absl::StatusCode unimpl = absl::StatusCode::kUnimplemented;
  const Bad cases[] = {
      {"overlap", with([](auto& e) { e[0].chunks[1].offsets = {1, 0}; }), loss,
       {"tensor 'w'", "chunks 0 and 1 overlap"}},
      {"hole", with([](auto& e) { e[0].shape = {5, 6}; }), loss,
       {"tensor 'w'", "cover 24 of its 30 elements"}},
      {"outside", with([](auto& e) { e[0].chunks[1].sizes = {3, 6}; }), loss,
       {"tensor 'w'", "chunk 1", "outside the shape"}},
      {"rank", with([](auto& e) { e[0].chunks[1].sizes = {2}; }), loss,
       {"tensor 'w'", "chunk 1 has rank"}},
      {"negative", with([](auto& e) { e[0].shape = {4, -6}; }), loss, {"negative extent"}},
      {"overflow", with([](auto& e) { e[0].shape = {INT64_MAX, 4}; }), loss, {"overflows"}},
      {"traversal", with([](auto& e) { e[0].chunks[0].file = "../../etc/passwd"; }), loss,
       {"'../../etc/passwd'", "not a file name"}},
      {"dotdot", with([](auto& e) { e[0].chunks[0].file = ".."; }), loss, {"not a file name"}},
      {"negative offset", with([](auto& e) { e[0].chunks[0].offset = -1; }), loss,
       {"negative offset"}},
      {"complex32", with([](auto& e) { e[1].dtype = "complex32"; }), unimpl,
       {"tensor 'b'", "complex32"}},
      {"transforms", Metadata(kGood, "", Str("transform_descriptors") + List({Str("zstd")})),
       unimpl, {"transforms"}},
      {"extra root", "\x80\x02" + Global("collections", "OrderedDict") + ")R.", loss,
       {"not a DCP Metadata"}},
      {"other entry", "\x80\x02" + Fields("Metadata", {{"state_dict_metadata", Dict({{Str("x"), Global("collections", "OrderedDict") + ")R"}})}, {"storage_data", "}"}}) + ".",
       unimpl, {"entry 'x'", "collections.OrderedDict"}},
      {"evil", "\x80\x02" + Fields("Metadata", {{"state_dict_metadata", Global("os", "system")}}) + ".",
       absl::StatusCode::kInvalidArgument, {"os.system"}},
  };
  for (const Bad& c : cases) {
    Result<DcpMetadata> md = ParseDcpMetadata(c.pickle, "ck");
    ASSERT_FALSE(md.ok()) << c.name;
    EXPECT_EQ(md.status().code(), c.code) << c.name << ": " << md.status();
    EXPECT_THAT(md.status().message(), HasSubstr("ck")) << c.name;
    for (const std::string& m : c.message) {
      EXPECT_THAT(md.status().message(), HasSubstr(m)) << c.name;
    }
  }
}

TEST(DcpMetadata, EveryChunkAndBytesItemNeedsItsStorageEntry) {
  std::string md = Metadata(kGood);
  // Drop the storage entry of w's second chunk: rename its file's index to another offset.
  std::string index = Index("w", Size({2, 0}));
  size_t at = md.find(index);
  ASSERT_NE(at, std::string::npos);
  md.replace(at, index.size(), Index("w", Size({3, 0})));
  Result<DcpMetadata> r = ParseDcpMetadata(md, "ck");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), AllOf(HasSubstr("tensor 'w' chunk at (2, 0)"),
                                          HasSubstr("no storage entry")));
  // Two entries for one item.
  std::string dup = Metadata(kGood, Index("step", "N") + Info("__0_0.distcp", 5, 5));
  r = ParseDcpMetadata(dup, "ck");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("two storage entries"));
}

TEST(DcpMetadata, EveryTruncationOfARealFileIsAnError) {
  std::string md = RealMetadata("two_ranks");
  for (size_t n = 0; n < md.size(); ++n) {
    EXPECT_FALSE(ParseDcpMetadata(std::string_view(md).substr(0, n), "ck").ok()) << n;
  }
}

}  // namespace
}  // namespace tensorstash
