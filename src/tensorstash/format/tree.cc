#include "tensorstash/format/tree.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "nlohmann/json.hpp"
#include "simdjson.h"

namespace tensorstash {

TreeNode::TreeNode() = default;
namespace {

using json = nlohmann::json;
using Kind = TreeNode::Kind;

constexpr std::string_view kTreeFormatName = "tensorstash/tree";

std::string Base64Encode(const std::string& raw) {
  std::string out;
  absl::Base64Escape(absl::string_view(raw.data(), raw.size()), &out);
  return out;
}
bool Base64Decode(const std::string& text, std::string* out) {
  return absl::Base64Unescape(absl::string_view(text.data(), text.size()), out);
}

json NodeToJson(const TreeNode& node) {
  json j;
  j["kind"] = node.keys.empty() ? TreeNodeKindName(node.kind) : "typed_dict";
  switch (node.kind) {
    case Kind::kNone:
      break;
    case Kind::kDict: {
      json entries = json::array();
      for (const auto& [key, child] : node.entries)
        entries.push_back(json::array({key, NodeToJson(child)}));
      j["entries"] = std::move(entries);
      if (!node.keys.empty()) {
        json keys = json::array();
        for (const TreeNode& key : node.keys) keys.push_back(NodeToJson(key));
        j["keys"] = std::move(keys);
      }
      break;
    }
    case Kind::kList:
    case Kind::kTuple: {
      json items = json::array();
      for (const TreeNode& child : node.items) items.push_back(NodeToJson(child));
      j["items"] = std::move(items);
      break;
    }
    case Kind::kArray:
      j["array"] = node.array_id;
      // Text the decoder took from an object (or a caller checked with TreeNodeFromJson):
      // it parses. A malformed one is left out rather than thrown over; the core does not throw.
      if (!node.sharding.empty()) {
        json sharding = json::parse(node.sharding, nullptr, /*allow_exceptions=*/false);
        if (sharding.is_object()) j["sharding"] = std::move(sharding);
      }
      break;
    case Kind::kInt:
      j["value"] = node.int_value;
      break;
    case Kind::kFloat:
      j["value"] = TreeFloatText(node.float_value);
      break;
    case Kind::kBool:
      j["value"] = node.bool_value;
      break;
    case Kind::kString:
      j["value"] = node.string_value;
      break;
    case Kind::kBytes:
      j["base64"] = Base64Encode(node.string_value);
      break;
  }
  return j;
}

// Reads the node schema out of a parsed document. simdjson, not nlohmann, parses here: the
// tree.json of a step of many arrays is megabytes, and nlohmann's DOM took most of the time of
// opening such a step (4,000 arrays: 20 ms of a 38 ms open, bench/micro_bench.cc).
using Element = simdjson::dom::element;
using Object = simdjson::dom::object;
using ElementType = simdjson::dom::element_type;

class Decoder {
 public:
  explicit Decoder(std::string_view where) : where_(where) {}

  Status Error(std::string_view what) const {
    return DataLossError(StrCat("invalid tree.json '", where_, "': ", what));
  }

  // The member `field` of `object` if it is there and of type `type`.
  static bool Member(Object object, std::string_view field, ElementType type, Element* out) {
    return !object.at_key(field).get(*out) && out->type() == type;
  }
  static bool Text(Object object, std::string_view field, std::string_view* out) {
    Element e;
    return Member(object, field, ElementType::STRING, &e) && !e.get_string().get(*out);
  }
  // The array that `e` is (checked by the caller to be one), held by value: the range of a
  // range-for over a temporary simdjson_result would dangle.
  static simdjson::dom::array Items(Element e) {
    simdjson::dom::array items;
    if (e.get_array().get(items)) return simdjson::dom::array();
    return items;
  }
  static bool Int(Object object, std::string_view field, int64_t* out) {
    Element e;
    return !object.at_key(field).get(e) && !e.get_int64().get(*out);
  }

  Result<std::vector<int64_t>> Ints(Object j, std::string_view field, std::string_view ctx) {
    Element list;
    if (!Member(j, field, ElementType::ARRAY, &list)) {
      return Error(StrCat(ctx, ": missing or non-list \"", field, "\""));
    }
    std::vector<int64_t> out;
    for (Element v : Items(list)) {
      int64_t value;
      if (v.get_int64().get(value))
        return Error(StrCat(ctx, ": \"", field, "\" holds a non-integer"));
      out.push_back(value);
    }
    return out;
  }

  Result<ArrayMetadata> Array(Element element, size_t i) {
    const std::string ctx = StrCat("arrays[", i, "]");
    Object j;
    if (element.get_object().get(j)) return Error(StrCat(ctx, " is not an object"));
    ArrayMetadata a;
    std::string_view text;
    if (!Text(j, "path", &text)) return Error(StrCat(ctx, ": no \"path\""));
    a.path = std::string(text);
    if (!Text(j, "dtype", &text)) return Error(StrCat(ctx, ": no \"dtype\""));
    auto dtype = ParseDType(std::string(text));
    if (!dtype.ok()) return Error(StrCat("array '", a.path, "': ", dtype.status().message()));
    a.dtype = *dtype;
    TS_ASSIGN_OR_RETURN(a.grid.shape, Ints(j, "shape", ctx));
    TS_ASSIGN_OR_RETURN(a.grid.cell_shape, Ints(j, "cell_shape", ctx));
    TS_ASSIGN_OR_RETURN(a.grid.chunk_shape, Ints(j, "chunk_shape", ctx));
    Status grid_ok = ValidateChunkGrid(a.grid, ItemSize(a.dtype), StrCat("array '", a.path, "'"));
    if (!grid_ok.ok()) return Error(MessageOf(grid_ok));
    std::string_view codec = "none";
    Element member;
    if (!j.at_key("codec").get(member) && member.get_string().get(codec)) {
      return Error(StrCat("array '", a.path, "': \"codec\" is not a string"));
    }
    if (codec == "none") {
      a.codec = Codec::kNone;
    } else if (codec == "zstd") {
      a.codec = Codec::kZstd;
      int64_t level = 0;
      if (!j.at_key("zstd_level").get(member) &&
          (member.get_int64().get(level) || level < INT32_MIN || level > INT32_MAX)) {
        return Error(StrCat("array '", a.path, "': \"zstd_level\" is not an int"));
      }
      a.zstd_level = static_cast<int>(level);
    } else {
      return Error(StrCat("array '", a.path, "': unknown codec \"", codec, "\""));
    }
    return a;
  }

  // Whether `key` may be a typed_dict key: a scalar leaf, none, or a tuple of such.
  static bool IsKeyNode(const TreeNode& key) {
    if (key.kind == Kind::kTuple) {
      for (const TreeNode& item : key.items)
        if (!IsKeyNode(item)) return false;
      return true;
    }
    return key.kind != Kind::kArray && key.kind != Kind::kDict && key.kind != Kind::kList;
  }

  Result<TreeNode> Node(Element element, int depth) {
    if (depth > kMaxTreeDepth) return Error("tree nested too deeply");
    Object j;
    std::string_view kind;
    if (element.get_object().get(j) || !Text(j, "kind", &kind)) {
      return Error("a tree node lacks \"kind\"");
    }
    TreeNode node;
    Element member;
    std::string_view text;
    if (kind == "none") {
      node.kind = Kind::kNone;
    } else if (kind == "dict" || kind == "typed_dict") {
      node.kind = Kind::kDict;
      if (!Member(j, "entries", ElementType::ARRAY, &member))
        return Error("dict without \"entries\"");
      absl::flat_hash_set<std::string_view> seen;
      for (Element e : Items(member)) {
        simdjson::dom::array pair;
        std::string_view key;
        Element value;
        if (e.get_array().get(pair) || pair.size() != 2 || pair.at(0).get_string().get(key) ||
            pair.at(1).get(value))
          return Error("malformed dict entry");
        if (!seen.insert(key).second) return Error(StrCat("duplicate dict key \"", key, "\""));
        TS_ASSIGN_OR_RETURN(TreeNode child, Node(value, depth + 1));
        node.entries.emplace_back(std::string(key), std::move(child));
      }
      if (kind == "typed_dict") {
        if (!Member(j, "keys", ElementType::ARRAY, &member))
          return Error("typed_dict without \"keys\"");
        for (Element k : Items(member)) {
          TS_ASSIGN_OR_RETURN(TreeNode key, Node(k, depth + 1));
          if (!IsKeyNode(key)) return Error("a typed_dict key is not a scalar or tuple");
          node.keys.push_back(std::move(key));
        }
        if (node.keys.empty() || node.keys.size() != node.entries.size())
          return Error("typed_dict whose \"keys\" do not match its entries one to one");
      }
    } else if (kind == "list" || kind == "tuple") {
      node.kind = kind == "list" ? Kind::kList : Kind::kTuple;
      if (!Member(j, "items", ElementType::ARRAY, &member))
        return Error(StrCat(kind, " without \"items\""));
      for (Element item : Items(member)) {
        TS_ASSIGN_OR_RETURN(TreeNode child, Node(item, depth + 1));
        node.items.push_back(std::move(child));
      }
    } else if (kind == "array") {
      node.kind = Kind::kArray;
      if (!Int(j, "array", &node.array_id)) return Error("array leaf without \"array\"");
      if (!j.at_key("sharding").get(member)) {
        if (member.type() != ElementType::OBJECT)
          return Error("array leaf whose \"sharding\" is not an object");
        node.sharding = simdjson::minify(member);
      }
    } else if (kind == "int") {
      node.kind = Kind::kInt;
      if (!Text(j, "value", &text)) return Error("int leaf without \"value\"");
      node.int_value = std::string(text);
      std::string_view digits = node.int_value;
      if (!digits.empty() && digits[0] == '-') digits.remove_prefix(1);
      if (digits.empty() || digits.find_first_not_of("0123456789") != std::string_view::npos) {
        return Error(StrCat("int leaf with value \"", node.int_value, "\""));
      }
    } else if (kind == "float") {
      node.kind = Kind::kFloat;
      if (!Text(j, "value", &text)) return Error("float leaf without \"value\"");
      auto parsed = std::from_chars(text.data(), text.data() + text.size(), node.float_value);
      if (text.empty() || parsed.ec != std::errc() || parsed.ptr != text.data() + text.size()) {
        return Error(StrCat("float leaf with value \"", text, "\""));
      }
    } else if (kind == "bool") {
      node.kind = Kind::kBool;
      if (!Member(j, "value", ElementType::BOOL, &member) ||
          member.get_bool().get(node.bool_value))
        return Error("bool leaf without \"value\"");
    } else if (kind == "string") {
      node.kind = Kind::kString;
      if (!Text(j, "value", &text)) return Error("string leaf without \"value\"");
      node.string_value = std::string(text);
    } else if (kind == "bytes") {
      node.kind = Kind::kBytes;
      if (!Text(j, "base64", &text) || !Base64Decode(std::string(text), &node.string_value)) {
        return Error("bytes leaf without valid \"base64\"");
      }
    } else {
      return Error(StrCat("unknown node kind \"", kind, "\""));
    }
    return node;
  }

 private:
  std::string where_;
};

// Parses `text` into `parser`'s document, as deep as the node schema allows: deeper is
// DEPTH_ERROR, found by simdjson without recursion, so a hostile million-deep document is
// refused before the decoder (which recurses) sees it.
simdjson::error_code ParseJson(std::string_view text, simdjson::dom::parser* parser,
                               Element* doc) {
  // A dict level takes three JSON levels ({"entries": [[key, node]]}).
  constexpr size_t kMaxJsonDepth = 3 * kMaxTreeDepth + 8;
  if (simdjson::error_code e = parser->allocate(text.size(), kMaxJsonDepth); e) return e;
  return parser->parse(text.data(), text.size(), /*realloc_if_needed=*/true).get(*doc);
}

// Counts the leaves that refer to each array, and checks that an array's path is the path of
// its leaf (so a path always says where the array sits in the tree). `path` is null at the root.
Status CheckArrayRefs(const TreeNode& node, const std::string* path,
                      const std::vector<ArrayMetadata>& arrays, std::vector<int>* refs,
                      const Decoder& decoder) {
  const std::string here = path == nullptr ? std::string() : *path;
  if (node.kind == Kind::kArray) {
    if (node.array_id < 0 || node.array_id >= static_cast<int64_t>(refs->size())) {
      return decoder.Error(
          StrCat("array leaf refers to array ", node.array_id, " of ", refs->size()));
    }
    if (arrays[node.array_id].path != here) {
      return decoder.Error(
          StrCat("array '", arrays[node.array_id].path, "' sits in the tree at path '", here, "'"));
    }
    ++(*refs)[node.array_id];
  }
  auto child = [&](std::string_view segment) {
    return path == nullptr ? std::string(segment) : StrCat(*path, "/", segment);
  };
  for (const auto& [key, value] : node.entries) {
    const std::string child_path = child(EscapePathKey(key));
    TS_RETURN_IF_ERROR(CheckArrayRefs(value, &child_path, arrays, refs, decoder));
  }
  for (size_t i = 0; i < node.items.size(); ++i) {
    const std::string child_path = child(std::to_string(i));
    TS_RETURN_IF_ERROR(CheckArrayRefs(node.items[i], &child_path, arrays, refs, decoder));
  }
  return OkStatus();
}

}  // namespace

std::string_view TreeNodeKindName(TreeNode::Kind kind) {
  using Kind = TreeNode::Kind;
  switch (kind) {
    case Kind::kNone:
      return "none";
    case Kind::kDict:
      return "dict";
    case Kind::kList:
      return "list";
    case Kind::kTuple:
      return "tuple";
    case Kind::kArray:
      return "array";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kBool:
      return "bool";
    case Kind::kString:
      return "string";
    case Kind::kBytes:
      return "bytes";
  }
  return "?";
}

std::string TreeFloatText(double v) {
  char buf[64];
  auto result = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, result.ptr);
}

std::string_view CodecName(Codec codec) { return codec == Codec::kZstd ? "zstd" : "none"; }

std::string EscapePathKey(std::string_view key) {
  std::string out;
  out.reserve(key.size());
  for (char c : key) {
    if (c == '~')
      out += "~0";
    else if (c == '/')
      out += "~1";
    else
      out += c;
  }
  return out;
}

Result<std::vector<std::string>> SplitArrayPath(std::string_view path) {
  std::vector<std::string> keys(1);
  for (size_t i = 0; i < path.size(); ++i) {
    const char c = path[i];
    if (c == '/') {
      keys.emplace_back();
    } else if (c == '~') {
      if (i + 1 < path.size() && (path[i + 1] == '0' || path[i + 1] == '1')) {
        keys.back() += path[i + 1] == '0' ? '~' : '/';
        ++i;
      } else {
        return InvalidArgumentError(
            StrCat("array path '", path, "' has '~' not followed by 0 or 1 at byte ", i));
      }
    } else {
      keys.back() += c;
    }
  }
  return keys;
}

Result<TreeNode> TreeFromArrayPaths(const std::vector<ArrayMetadata>& arrays) {
  TreeNode root = TreeNode::Dict();
  for (size_t i = 0; i < arrays.size(); ++i) {
    TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, SplitArrayPath(arrays[i].path));
    TreeNode* node = &root;
    for (size_t k = 0; k < keys.size(); ++k) {
      if (node->kind != Kind::kDict) {
        return InvalidArgumentError(
            StrCat("array path '", arrays[i].path, "' goes below another array's path"));
      }
      TreeNode* child = nullptr;
      for (auto& entry : node->entries) {
        if (entry.first == keys[k]) child = &entry.second;
      }
      const bool last = k + 1 == keys.size();
      if (child == nullptr) {
        node->entries.emplace_back(
            keys[k], last ? TreeNode::Array(static_cast<int64_t>(i)) : TreeNode::Dict());
        child = &node->entries.back().second;
      } else if (last) {
        return InvalidArgumentError(
            StrCat("array path '", arrays[i].path, "' is used twice or is a prefix of another"));
      }
      node = child;
    }
  }
  return root;
}

Result<std::string> EncodeTreeJson(const TreeFile& tree) {
  json arrays = json::array();
  for (const ArrayMetadata& a : tree.arrays) {
    json j;
    j["path"] = a.path;
    j["dtype"] = DTypeName(a.dtype);
    j["shape"] = a.grid.shape;
    j["cell_shape"] = a.grid.cell_shape;
    j["chunk_shape"] = a.grid.chunk_shape;
    j["codec"] = CodecName(a.codec);
    if (a.codec == Codec::kZstd) j["zstd_level"] = a.zstd_level;
    arrays.push_back(std::move(j));
  }
  json doc;
  doc["format"] = kTreeFormatName;
  doc["version"] = {kTreeMajorVersion, kTreeMinorVersion};
  doc["arrays"] = std::move(arrays);
  doc["tree"] = NodeToJson(tree.root);
  try {
    return doc.dump(1);
  } catch (const json::exception& e) {
    // nlohmann reports invalid UTF-8 in keys or strings by throwing; the core does not throw.
    return InvalidArgumentError(StrCat("cannot encode tree: ", e.what()));
  }
}

Result<TreeFile> DecodeTreeJson(std::string_view text, std::string_view where) {
  Decoder decoder(where);
  simdjson::dom::parser parser;
  Element root;
  Object doc;
  const simdjson::error_code parsed = ParseJson(text, &parser, &root);
  if (parsed == simdjson::DEPTH_ERROR) return decoder.Error("nested too deeply");
  if (parsed || root.get_object().get(doc)) return decoder.Error("not a JSON object");
  std::string_view format;
  if (!Decoder::Text(doc, "format", &format) || format != kTreeFormatName) {
    return decoder.Error("missing \"format\": \"tensorstash/tree\"");
  }
  Element version;
  int64_t major = 0, minor = 0;
  if (!Decoder::Member(doc, "version", ElementType::ARRAY, &version) ||
      Decoder::Items(version).size() != 2 || version.at(0).get_int64().get(major) ||
      version.at(1).get_int64().get(minor)) {
    return decoder.Error("missing or malformed \"version\"");
  }
  if (major != kTreeMajorVersion) {
    return UnimplementedError(StrCat("tree.json '", where, "' has format version ", major, ".",
                                     minor, "; this tensorstash reads version ",
                                     kTreeMajorVersion, ".x only (upgrade tensorstash)"));
  }
  Element arrays;
  if (!Decoder::Member(doc, "arrays", ElementType::ARRAY, &arrays))
    return decoder.Error("no \"arrays\" list");
  TreeFile tree;
  absl::flat_hash_set<std::string_view> paths;
  size_t position = 0;
  for (Element a : Decoder::Items(arrays)) {
    TS_ASSIGN_OR_RETURN(ArrayMetadata array, decoder.Array(a, position++));
    tree.arrays.push_back(std::move(array));
  }
  for (const ArrayMetadata& a : tree.arrays) {
    if (!paths.insert(a.path).second) {
      return decoder.Error(StrCat("array path '", a.path, "' appears twice"));
    }
  }
  Element node;
  if (doc.at_key("tree").get(node)) return decoder.Error("no \"tree\"");
  TS_ASSIGN_OR_RETURN(tree.root, decoder.Node(node, 0));
  std::vector<int> refs(tree.arrays.size(), 0);
  TS_RETURN_IF_ERROR(CheckArrayRefs(tree.root, nullptr, tree.arrays, &refs, decoder));
  for (size_t i = 0; i < refs.size(); ++i) {
    if (refs[i] != 1) {
      return decoder.Error(StrCat("array '", tree.arrays[i].path, "' is referenced ", refs[i],
                                  " times by the tree (must be once)"));
    }
  }
  return tree;
}

Result<std::string> TreeNodeToJson(const TreeNode& node) {
  try {
    return NodeToJson(node).dump();
  } catch (const json::exception& e) {
    return InvalidArgumentError(StrCat("cannot encode tree: ", e.what()));
  }
}

Result<TreeNode> TreeNodeFromJson(std::string_view text) {
  Decoder decoder("tree node");
  simdjson::dom::parser parser;
  Element doc;
  const simdjson::error_code parsed = ParseJson(text, &parser, &doc);
  if (parsed == simdjson::DEPTH_ERROR) return InvalidArgumentError("tree nested too deeply");
  if (parsed) return InvalidArgumentError("tree node is not valid JSON");
  Result<TreeNode> node = decoder.Node(doc, 0);
  if (!node.ok()) return InvalidArgumentError(MessageOf(node.status()));
  return node;
}


}  // namespace tensorstash
