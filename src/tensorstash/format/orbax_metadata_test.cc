#include "tensorstash/format/orbax_metadata.h"

#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

// Written by orbax-checkpoint 0.12.8 (PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True))
// for {'params': {'w': jnp.arange(6.).reshape(2, 3), 'b': np.zeros(3, np.int32)}, 'step': 7,
// 'opt': [None, {}], 'lr': 0.5}.
constexpr char kOrbaxWritten[] =
    R"j({"tree_metadata": {"('lr',)": {"key_metadata": [{"key": "lr", "key_type": 2}], )j"
    R"j("value_metadata": {"value_type": "scalar", "skip_deserialize": false}}, )j"
    R"j("('opt', '0')": {"key_metadata": [{"key": "opt", "key_type": 2}, {"key": "0", )j"
    R"j("key_type": 1}], "value_metadata": {"value_type": "None", "skip_deserialize": true}}, )j"
    R"j("('opt', '1')": {"key_metadata": [{"key": "opt", "key_type": 2}, {"key": "1", )j"
    R"j("key_type": 1}], "value_metadata": {"value_type": "Dict", "skip_deserialize": true}}, )j"
    R"j("('params', 'b')": {"key_metadata": [{"key": "params", "key_type": 2}, {"key": "b", )j"
    R"j("key_type": 2}], "value_metadata": {"value_type": "np.ndarray", )j"
    R"j("skip_deserialize": false}}, "('params', 'w')": {"key_metadata": [{"key": "params", )j"
    R"j("key_type": 2}, {"key": "w", "key_type": 2}], "value_metadata": {"value_type": )j"
    R"j("jax.Array", "skip_deserialize": false, "write_shape": [2, 3]}}, "('step',)": )j"
    R"j({"key_metadata": [{"key": "step", "key_type": 2}], "value_metadata": {"value_type": )j"
    R"j("scalar", "skip_deserialize": false}}}, "use_ocdbt": true, "use_zarr3": true, )j"
    R"j("store_array_data_equal_to_fill_value": true, "custom_metadata": null})j";

constexpr OrbaxKeyType kDict = OrbaxKeyType::kDict;
constexpr OrbaxKeyType kSeq = OrbaxKeyType::kSequence;

OrbaxTreeEntry Entry(std::vector<OrbaxKey> keys, std::string type) {
  OrbaxTreeEntry e;
  e.name = OrbaxEntryName(keys);
  e.keys = std::move(keys);
  e.value_type = std::move(type);
  return e;
}

// Decodes `text`, which must fail with DataLoss; returns the message.
std::string DecodeError(const std::string& text) {
  Result<OrbaxMetadata> r = DecodeOrbaxMetadata(text, "Orbax metadata 's/_METADATA'");
  EXPECT_FALSE(r.ok()) << text;
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("s/_METADATA")) << text;
  return std::string(r.status().message());
}

TEST(OrbaxMetadataTest, RoundTrip) {
  OrbaxMetadata m;
  m.tree.push_back(Entry({{"params", kDict}, {"w", kDict}}, kOrbaxJaxArrayType));
  m.tree.back().skip_deserialize = false;
  m.tree.back().write_shape = std::vector<int64_t>{4, 1, int64_t{1} << 40};
  m.tree.push_back(Entry({{"opt", kDict}, {"0", kSeq}}, kOrbaxNoneType));
  m.tree.back().skip_deserialize = true;
  m.tree.push_back(Entry({{"it's \"q\"\n\\ é", kDict}}, kOrbaxScalarType));
  m.tree.push_back(Entry({{"x", kDict}}, "my.CustomHandler"));
  m.tree.back().write_shape = std::vector<int64_t>{};
  m.use_ocdbt = true;
  m.use_zarr3 = false;
  m.store_array_data_equal_to_fill_value = false;
  const std::string text = EncodeOrbaxMetadata(m);
  Result<OrbaxMetadata> back = DecodeOrbaxMetadata(text, "t");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, m);
  EXPECT_EQ(EncodeOrbaxMetadata(*back), text);

  // Absent fields stay absent; an empty tree is a tree.
  OrbaxMetadata bare;
  bare.tree.push_back(Entry({{"a", kDict}}, kOrbaxNumpyArrayType));
  EXPECT_EQ(DecodeOrbaxMetadata(EncodeOrbaxMetadata(bare), "t").value(), bare);
  EXPECT_EQ(DecodeOrbaxMetadata(EncodeOrbaxMetadata(OrbaxMetadata()), "t").value(),
            OrbaxMetadata());
}

// What the Orbax writer writes, byte for byte (compact JSON, fields in Orbax's order).
TEST(OrbaxMetadataTest, EncodesCompactJsonInOrbaxsFieldOrder) {
  OrbaxMetadata m;
  m.tree.push_back(Entry({{"w", kDict}}, kOrbaxJaxArrayType));
  m.tree.back().skip_deserialize = false;
  m.tree.back().write_shape = std::vector<int64_t>{2};
  m.use_ocdbt = true;
  m.use_zarr3 = true;
  m.store_array_data_equal_to_fill_value = false;
  EXPECT_EQ(EncodeOrbaxMetadata(m),
            R"j({"tree_metadata":{"('w',)":{"key_metadata":[{"key":"w","key_type":2}],)j"
            R"j("value_metadata":{"value_type":"jax.Array","skip_deserialize":false,)j"
            R"j("write_shape":[2]}}},"use_ocdbt":true,"use_zarr3":true,)j"
            R"j("store_array_data_equal_to_fill_value":false,"custom_metadata":null})j");
}

TEST(OrbaxMetadataTest, EntryNamesArePythonsTupleRepr) {
  EXPECT_EQ(OrbaxEntryName({{"lr", kDict}}), "('lr',)");
  EXPECT_EQ(OrbaxEntryName({{"opt", kDict}, {"0", kSeq}}), "('opt', '0')");
  EXPECT_EQ(OrbaxEntryName({{"it's", kDict}}), "(\"it's\",)");
  EXPECT_EQ(OrbaxEntryName({{"a'\"b", kDict}}), "('a\\'\"b',)");
  EXPECT_EQ(OrbaxEntryName({{"a\nb\\\x01", kDict}}), "('a\\nb\\\\\\x01',)");
  EXPECT_EQ(OrbaxEntryName({}), "()");
}

TEST(OrbaxMetadataTest, DecodesWhatOrbaxWrites) {
  Result<OrbaxMetadata> m = DecodeOrbaxMetadata(kOrbaxWritten, "Orbax metadata 'x'");
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<std::string> names;
  for (const OrbaxTreeEntry& e : m->tree) names.push_back(e.name);
  // The order written (Orbax sorts dict keys), not the order of a std::map.
  EXPECT_THAT(names, ::testing::ElementsAre("('lr',)", "('opt', '0')", "('opt', '1')",
                                            "('params', 'b')", "('params', 'w')", "('step',)"));
  for (const OrbaxTreeEntry& e : m->tree) EXPECT_EQ(e.name, OrbaxEntryName(e.keys)) << e.name;
  EXPECT_EQ(m->tree[0].value_type, kOrbaxScalarType);
  EXPECT_EQ(m->tree[1].keys, (std::vector<OrbaxKey>{{"opt", kDict}, {"0", kSeq}}));
  EXPECT_EQ(m->tree[1].value_type, kOrbaxNoneType);
  EXPECT_EQ(m->tree[1].skip_deserialize, true);
  EXPECT_EQ(m->tree[2].value_type, kOrbaxEmptyDictType);
  EXPECT_EQ(m->tree[3].value_type, kOrbaxNumpyArrayType);
  EXPECT_EQ(m->tree[3].write_shape, std::nullopt);
  EXPECT_EQ(m->tree[4].value_type, kOrbaxJaxArrayType);
  EXPECT_EQ(m->tree[4].skip_deserialize, false);
  EXPECT_EQ(m->tree[4].write_shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(m->use_ocdbt, true);
  EXPECT_EQ(m->use_zarr3, true);
  EXPECT_EQ(m->store_array_data_equal_to_fill_value, true);
  // Re-encoded, it decodes the same.
  EXPECT_EQ(DecodeOrbaxMetadata(EncodeOrbaxMetadata(*m), "x").value(), *m);
}

TEST(OrbaxMetadataTest, EveryTruncationIsDataLossNamingTheFile) {
  const std::string text = kOrbaxWritten;
  for (size_t n = 0; n < text.size(); ++n) {
    SCOPED_TRACE(n);
    const std::string message = DecodeError(text.substr(0, n));
    if (n > 0) {
      EXPECT_THAT(message, HasSubstr("not valid JSON"));
    }
  }
  EXPECT_THAT(DecodeError("{not json"), HasSubstr("not valid JSON (parse error at line 1"));
  EXPECT_THAT(DecodeError(text + " x"), HasSubstr("not valid JSON"));
  EXPECT_THAT(DecodeError("{\"tree_metadata\": {\"\xff\xfe\": 1}}"), HasSubstr("not valid JSON"));
}

TEST(OrbaxMetadataTest, WrongTypesAreDataLossSayingWhat) {
  const auto leaf = [](const std::string& key_metadata, const std::string& value_metadata) {
    return R"j({"tree_metadata": {"('a',)": {"key_metadata": )j" + key_metadata +
           R"j(, "value_metadata": )j" + value_metadata + "}}}";
  };
  const std::string keys = R"j([{"key": "a", "key_type": 2}])j";
  const std::string value = R"j({"value_type": "np.ndarray"})j";
  ASSERT_TRUE(DecodeOrbaxMetadata(leaf(keys, value), "t").ok());

  for (const char* text :
       {"[]", "3", "null", "\"x\"", "{}", R"j({"tree_metadata": 3})j",
        R"j({"tree_metadata": [{"('a',)": {}}]})j", R"j({"tree_metadata": null})j"}) {
    EXPECT_THAT(DecodeError(text), HasSubstr("has no \"tree_metadata\" object")) << text;
  }
  EXPECT_THAT(DecodeError(R"j({"tree_metadata": {"('a',)": 1}})j"),
              HasSubstr("entry ('a',): expected key_metadata and value_metadata"));
  EXPECT_THAT(DecodeError(leaf("{}", value)), HasSubstr("expected key_metadata"));
  EXPECT_THAT(DecodeError(leaf(keys, "[]")), HasSubstr("expected key_metadata"));
  EXPECT_THAT(DecodeError(R"j({"tree_metadata": {"('a',)": {"key_metadata": []}}})j"),
              HasSubstr("expected key_metadata and value_metadata"));
  for (const char* bad_keys :
       {R"j([1])j", R"j([{"key": 1, "key_type": 2}])j", R"j([{"key_type": 2}])j",
        R"j([{"key": "a"}])j", R"j([{"key": "a", "key_type": "2"}])j",
        R"j([{"key": "a", "key_type": 2.0}])j", R"j([{"key": "a", "key_type": null}])j"}) {
    EXPECT_THAT(DecodeError(leaf(bad_keys, value)),
                HasSubstr("entry ('a',): malformed key_metadata"))
        << bad_keys;
  }
  EXPECT_THAT(DecodeError(leaf(R"j([{"key": "a", "key_type": 7}])j", value)),
              HasSubstr("unknown key_type 7"));
  // Would be 1 (a sequence key) if narrowed to int.
  EXPECT_THAT(DecodeError(leaf(R"j([{"key": "a", "key_type": 4294967297}])j", value)),
              HasSubstr("unknown key_type 4294967297"));
  EXPECT_THAT(DecodeError(leaf(R"j([{"key": "a", "key_type": -1}])j", value)),
              HasSubstr("unknown key_type -1"));
  EXPECT_THAT(DecodeError(leaf(R"j([{"key": "a", "key_type": 18446744073709551615}])j", value)),
              HasSubstr("unknown key_type 18446744073709551615"));
  EXPECT_THAT(DecodeError(leaf(keys, "{}")), HasSubstr("value_metadata has no value_type"));
  EXPECT_THAT(DecodeError(leaf(keys, R"j({"value_type": 3})j")),
              HasSubstr("value_metadata has no value_type"));
  EXPECT_THAT(DecodeError(R"j({"tree_metadata": {"('a',)": {"key_metadata": [], )j"
                          R"j("value_metadata": {"value_type": "None"}}, "('a',)": 3}})j"),
              HasSubstr("entry ('a',): appears twice"));
}

// Fields tensorstash does not need are read as absent when they have another type.
TEST(OrbaxMetadataTest, OptionalFieldsOfAnotherTypeAreAbsent) {
  const std::string text =
      R"j({"tree_metadata": {"('a',)": {"key_metadata": [{"key": "a", "key_type": 2}], )j"
      R"j("value_metadata": {"value_type": "jax.Array", "skip_deserialize": "no", )j"
      R"j("write_shape": [1.5]}}, "('b',)": {"key_metadata": [], "value_metadata": )j"
      R"j({"value_type": "x", "write_shape": [18446744073709551615]}}}, "use_ocdbt": 1, )j"
      R"j("use_zarr3": null, "store_array_data_equal_to_fill_value": "true", "extra": [{}]})j";
  Result<OrbaxMetadata> m = DecodeOrbaxMetadata(text, "t");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->tree.size(), 2u);
  EXPECT_EQ(m->tree[0].skip_deserialize, std::nullopt);
  EXPECT_EQ(m->tree[0].write_shape, std::nullopt);
  EXPECT_EQ(m->tree[1].write_shape, std::nullopt);
  EXPECT_EQ(m->use_ocdbt, std::nullopt);
  EXPECT_EQ(m->use_zarr3, std::nullopt);
  EXPECT_EQ(m->store_array_data_equal_to_fill_value, std::nullopt);
}

// A repeated top-level "tree_metadata" is read as JSON parsers (Python's too) read it: the last.
TEST(OrbaxMetadataTest, TheLastOfARepeatedTreeMetadataCounts) {
  Result<OrbaxMetadata> m = DecodeOrbaxMetadata(
      R"j({"tree_metadata": {"('a',)": 1}, "tree_metadata": {"('b',)": {"key_metadata": [], )j"
      R"j("value_metadata": {"value_type": "None"}}}})j",
      "t");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->tree.size(), 1u);
  EXPECT_EQ(m->tree[0].name, "('b',)");
}

TEST(OrbaxMetadataTest, AbsurdNestingIsRefusedWithoutRecursion) {
  for (const auto& [open, close] :
       {std::pair<std::string, std::string>{"[", "]"}, {"{\"a\":", "}"}}) {
    const int depth = 1000000;
    std::string text;
    for (int i = 0; i < depth; ++i) text += open;
    text += "1";
    for (int i = 0; i < depth; ++i) text += close;
    EXPECT_THAT(DecodeError(text), HasSubstr("nested deeper than 1000 levels"));
    // Unclosed, too.
    EXPECT_THAT(DecodeError(text.substr(0, depth * open.size())), HasSubstr("nested deeper"));
  }
  // Deep but within the limit, in a field tensorstash ignores: read.
  std::string custom;
  for (int i = 0; i < kMaxOrbaxMetadataNesting - 2; ++i) custom += "[";
  for (int i = 0; i < kMaxOrbaxMetadataNesting - 2; ++i) custom += "]";
  EXPECT_TRUE(DecodeOrbaxMetadata(R"j({"tree_metadata": {}, "custom_metadata": {"x": )j" + custom +
                                      "}}",
                                  "t")
                  .ok());
}

// Names that are not UTF-8 cannot come from Python; should one reach the encoder, it writes
// U+FFFD rather than throwing.
TEST(OrbaxMetadataTest, EncodingBytesThatAreNotUtf8DoesNotThrow) {
  OrbaxMetadata m;
  m.tree.push_back(Entry({{"a\xff", kDict}}, kOrbaxNoneType));
  const std::string text = EncodeOrbaxMetadata(m);
  Result<OrbaxMetadata> back = DecodeOrbaxMetadata(text, "t");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tree[0].keys[0].name, "a\xEF\xBF\xBD");
}

}  // namespace
}  // namespace tensorstash
