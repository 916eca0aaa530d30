#include "tensorstash/format/tree.h"

#include <cmath>
#include <functional>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;
using Kind = TreeNode::Kind;

ArrayMetadata Array(std::string path, std::vector<int64_t> shape) {
  ArrayMetadata a;
  a.path = std::move(path);
  a.grid = {shape, shape, shape};
  for (auto& v : a.grid.cell_shape) v = std::max<int64_t>(v, 1);
  a.grid.chunk_shape = a.grid.cell_shape;
  return a;
}

TreeNode Leaf(Kind kind) {
  TreeNode n;
  n.kind = kind;
  return n;
}

TEST(TreeTest, PathEscapingRoundTrips) {
  EXPECT_EQ(EscapePathKey("a/b~c"), "a~1b~0c");
  EXPECT_EQ(SplitArrayPath("opt/mu/layer~10").value(),
            (std::vector<std::string>{"opt", "mu", "layer/0"}));
  EXPECT_EQ(SplitArrayPath("").value(), (std::vector<std::string>{""}));
  EXPECT_FALSE(SplitArrayPath("a~2").ok());
  EXPECT_FALSE(SplitArrayPath("a~").ok());
  for (std::string key : {"", "~", "/", "~1", "a/b/c", "ü/ñ"}) {
    EXPECT_EQ(SplitArrayPath(EscapePathKey(key)).value(), std::vector<std::string>{key});
  }
}

TEST(TreeTest, TreeFromPathsBuildsNestedDicts) {
  std::vector<ArrayMetadata> arrays = {Array("params/w", {2}), Array("params/b", {2}),
                                       Array("step", {})};
  TreeNode root = TreeFromArrayPaths(arrays).value();
  ASSERT_EQ(root.kind, Kind::kDict);
  ASSERT_EQ(root.entries.size(), 2u);
  EXPECT_EQ(root.entries[0].first, "params");
  EXPECT_EQ(root.entries[0].second.entries[1].second.array_id, 1);
  EXPECT_FALSE(TreeFromArrayPaths({Array("a", {1}), Array("a/b", {1})}).ok());
  EXPECT_FALSE(TreeFromArrayPaths({Array("a/b", {1}), Array("a", {1})}).ok());
  EXPECT_FALSE(TreeFromArrayPaths({Array("a", {1}), Array("a", {1})}).ok());
}

TEST(TreeTest, EveryKindSurvivesARoundTrip) {
  TreeFile tree;
  tree.arrays = {Array("a~1b~0c/0", {3, 0}), Array("ключ", {})};
  tree.arrays[0].dtype = DType::kBfloat16;
  tree.arrays[0].codec = Codec::kZstd;
  tree.arrays[0].zstd_level = 5;
  TreeNode root = TreeNode::Dict();
  TreeNode list = Leaf(Kind::kList);
  list.items.push_back(TreeNode::Array(0));
  list.items.push_back(Leaf(Kind::kNone));
  TreeNode tuple = Leaf(Kind::kTuple);
  TreeNode i = Leaf(Kind::kInt);
  i.int_value = "-123456789012345678901234567890";
  TreeNode f = Leaf(Kind::kFloat);
  f.float_value = 0.1;
  TreeNode nan = Leaf(Kind::kFloat);
  nan.float_value = NAN;
  TreeNode inf = Leaf(Kind::kFloat);
  inf.float_value = -INFINITY;
  TreeNode b = Leaf(Kind::kBool);
  b.bool_value = true;
  TreeNode s = Leaf(Kind::kString);
  s.string_value = "héllo \"quoted\"\n";
  TreeNode bytes = Leaf(Kind::kBytes);
  bytes.string_value = std::string("\0\xff\x01", 3);
  for (TreeNode* leaf : {&i, &f, &nan, &inf, &b, &s, &bytes}) tuple.items.push_back(*leaf);
  root.entries.emplace_back("a/b~c", list);
  root.entries.emplace_back("", tuple);
  root.entries.emplace_back("ключ", TreeNode::Array(1));
  tree.root = root;

  std::string json = EncodeTreeJson(tree).value();
  TreeFile back = DecodeTreeJson(json, "tree.json").value();
  ASSERT_EQ(back.arrays.size(), 2u);
  EXPECT_EQ(back.arrays[0].path, "a~1b~0c/0");
  EXPECT_EQ(back.arrays[0].dtype, DType::kBfloat16);
  EXPECT_EQ(back.arrays[0].codec, Codec::kZstd);
  EXPECT_EQ(back.arrays[0].zstd_level, 5);
  EXPECT_EQ(back.arrays[0].grid.shape, (std::vector<int64_t>{3, 0}));
  ASSERT_EQ(back.root.entries.size(), 3u);
  EXPECT_EQ(back.root.entries[0].first, "a/b~c");
  EXPECT_EQ(back.root.entries[1].first, "");
  EXPECT_EQ(back.root.entries[2].first, "ключ");
  const TreeNode& t = back.root.entries[1].second;
  ASSERT_EQ(t.kind, Kind::kTuple);
  EXPECT_EQ(t.items[0].int_value, i.int_value);
  EXPECT_EQ(t.items[1].float_value, 0.1);
  EXPECT_TRUE(std::isnan(t.items[2].float_value));
  EXPECT_EQ(t.items[3].float_value, -INFINITY);
  EXPECT_TRUE(t.items[4].bool_value);
  EXPECT_EQ(t.items[5].string_value, s.string_value);
  EXPECT_EQ(t.items[6].string_value, bytes.string_value);
  EXPECT_EQ(back.root.entries[0].second.items[1].kind, Kind::kNone);
  EXPECT_EQ(EncodeTreeJson(back).value(), json);
}

// An array leaf's "sharding" (docs/format.md 4.2) is kept as its compact JSON text through
// decoding and encoding, from a stored tree.json and from a front's tree node alike; a
// sharding that is not an object is refused; a tree.json without one reads as before.
TEST(TreeTest, ArrayLeafShardingIsKeptAndChecked) {
  TreeFile tree;
  tree.arrays = {Array("w", {8, 4}), Array("b", {4})};
  TreeNode root = TreeNode::Dict();
  TreeNode w = TreeNode::Array(0);
  w.sharding = R"({"type":"NamedSharding","mesh_shape":[2,4],"axis_names":["a","b"],)"
               R"("partition_spec":[["a","b"],null]})";
  root.entries.emplace_back("w", w);
  root.entries.emplace_back("b", TreeNode::Array(1));
  tree.root = root;
  const std::string json = EncodeTreeJson(tree).value();
  EXPECT_THAT(json, HasSubstr("\"sharding\""));
  TreeFile back = DecodeTreeJson(json, "tree.json").value();
  EXPECT_EQ(nlohmann::json::parse(back.root.entries[0].second.sharding),
            nlohmann::json::parse(w.sharding));
  EXPECT_EQ(back.root.entries[1].second.sharding, "");
  EXPECT_EQ(EncodeTreeJson(back).value(), json);

  // Through a front's tree node (TreeNodeFromJson / TreeNodeToJson) too.
  const std::string node = TreeNodeToJson(root).value();
  TreeNode node_back = TreeNodeFromJson(node).value();
  EXPECT_EQ(nlohmann::json::parse(node_back.entries[0].second.sharding),
            nlohmann::json::parse(w.sharding));

  // Not an object: refused, naming the member.
  std::string bad = json;
  const std::string from = "\"sharding\": {";
  const size_t at = bad.find(from);
  ASSERT_NE(at, std::string::npos) << json;
  const size_t end = bad.find('}', at);
  bad.replace(at, end - at + 1, "\"sharding\": [1, 2]");
  Result<TreeFile> refused = DecodeTreeJson(bad, "tree.json");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(refused.status().message(), HasSubstr("sharding"));
  EXPECT_EQ(TreeNodeFromJson(R"({"kind":"array","array":0,"sharding":"mesh"})").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TreeTest, InvalidUtf8IsAnErrorNotACrash) {
  TreeFile tree;
  tree.root = TreeNode::Dict();
  tree.root.entries.emplace_back(std::string("\xff\xfe"), Leaf(Kind::kNone));
  EXPECT_EQ(EncodeTreeJson(tree).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TreeTest, BadDocumentsAreDataLossNamingTheFile) {
  TreeFile tree;
  tree.arrays = {Array("w", {4})};
  tree.root = TreeNode::Dict();
  tree.root.entries.emplace_back("w", TreeNode::Array(0));
  const std::string good = EncodeTreeJson(tree).value();
  auto expect_bad = [](const std::string& text, const char* needle) {
    Result<TreeFile> r = DecodeTreeJson(text, "step/state/tree.json");
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("step/state/tree.json"));
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(needle));
  };
  // Edits one field of the good document.
  auto edit = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json j = nlohmann::json::parse(good);
    change(j);
    return j.dump();
  };
  expect_bad("{", "not a JSON object");
  expect_bad(std::string(1000000, '[') + std::string(1000000, ']'), "nested too deeply");
  expect_bad(edit([](auto& j) { j["arrays"][0]["dtype"] = "float33"; }), "float33");
  expect_bad(edit([](auto& j) { j["tree"]["entries"][0][1]["array"] = 7; }), "refers to array 7");
  expect_bad(edit([](auto& j) { j["arrays"][0]["codec"] = 5; }), "tree.json");
  expect_bad(edit([](auto& j) { j["arrays"][0]["shape"] = {-4}; }), "extent -4");
  expect_bad(edit([](auto& j) { j["tree"]["entries"].push_back(j["tree"]["entries"][0]); }),
             "duplicate");
  expect_bad(edit([](auto& j) {
               j["tree"]["entries"][0][0] = "v";
               j["tree"]["entries"].push_back({"w", {{"kind", "array"}, {"array", 0}}});
             }),
             "sits in the tree at path 'v'");
  Result<TreeFile> newer = DecodeTreeJson(edit([](auto& j) { j["version"][0] = 2; }), "t");
  EXPECT_EQ(newer.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(newer.status().message()), HasSubstr("version 2"));
}

}  // namespace
}  // namespace tensorstash

namespace tensorstash {
namespace {

TEST(TreeNodeJsonTest, RoundTripsAndRejectsBadInput) {
  TreeNode root = TreeNode::Dict();
  TreeNode list;
  list.kind = TreeNode::Kind::kList;
  list.items.push_back(TreeNode::Array(0));
  root.entries.emplace_back("a/b", list);
  std::string text = TreeNodeToJson(root).value();
  TreeNode back = TreeNodeFromJson(text).value();
  EXPECT_EQ(TreeNodeToJson(back).value(), text);
  EXPECT_EQ(TreeNodeFromJson("{\"kind\": \"frob\"}").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TreeNodeFromJson("[").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TreeNodeFromJson(std::string(100000, '[')).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tensorstash

namespace tensorstash {
namespace {

// A dict of keys that are not strings keeps each key's node (kind "typed_dict"), and its
// entries' texts stay the path segments; a malformed typed_dict is refused.
TEST(TreeNodeJsonTest, TypedDictKeepsItsKeys) {
  TreeNode root = TreeNode::Dict();
  root.entries.emplace_back("3", TreeNode::Array(0));
  root.entries.emplace_back("('a', 1)", Leaf(Kind::kNone));
  TreeNode three = Leaf(Kind::kInt);
  three.int_value = "3";
  TreeNode pair = Leaf(Kind::kTuple);
  TreeNode a = Leaf(Kind::kString);
  a.string_value = "a";
  TreeNode one = Leaf(Kind::kInt);
  one.int_value = "1";
  pair.items = {a, one};
  root.keys = {three, pair};
  const std::string text = TreeNodeToJson(root).value();
  EXPECT_THAT(text, HasSubstr("\"typed_dict\""));
  TreeNode back = TreeNodeFromJson(text).value();
  ASSERT_EQ(back.keys.size(), 2u);
  EXPECT_EQ(back.keys[0].int_value, "3");
  EXPECT_EQ(back.keys[1].kind, Kind::kTuple);
  EXPECT_EQ(TreeNodeToJson(back).value(), text);

  // The path of the array under key 3 is its entry's text.
  TreeFile file;
  file.root = root;
  file.arrays = {Array("3", {2})};
  const std::string doc = EncodeTreeJson(file).value();
  EXPECT_EQ(DecodeTreeJson(doc, "t").value().root.keys.size(), 2u);

  for (const char* bad : {
           R"({"kind":"typed_dict","entries":[["1",{"kind":"none"}]]})",
           R"({"kind":"typed_dict","entries":[["1",{"kind":"none"}]],"keys":[]})",
           R"({"kind":"typed_dict","entries":[["1",{"kind":"none"}]],)"
           R"("keys":[{"kind":"int","value":"1"},{"kind":"int","value":"2"}]})",
           R"({"kind":"typed_dict","entries":[["1",{"kind":"none"}]],)"
           R"("keys":[{"kind":"array","array":0}]})",
           R"({"kind":"typed_dict","entries":[["1",{"kind":"none"}]],)"
           R"("keys":[{"kind":"list","items":[]}]})"}) {
    EXPECT_EQ(TreeNodeFromJson(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace tensorstash
