#include "tensorstash/format/tree.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>

#include "absl/strings/escaping.h"
#include "nlohmann/json.hpp"

namespace tensorstash {

TreeNode::TreeNode() = default;
namespace {

using json = nlohmann::json;
using Kind = TreeNode::Kind;

constexpr std::string_view kTreeFormatName = "tensorstash/tree";

std::string_view KindName(Kind kind) {
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

std::string Base64Encode(const std::string& raw) {
  std::string out;
  absl::Base64Escape(absl::string_view(raw.data(), raw.size()), &out);
  return out;
}
bool Base64Decode(const std::string& text, std::string* out) {
  return absl::Base64Unescape(absl::string_view(text.data(), text.size()), out);
}

// Shortest text that parses back to the same double, independent of the process locale;
// "nan", "-nan", "inf" and "-inf" for the special values.
std::string FormatFloat(double v) {
  char buf[64];
  auto result = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, result.ptr);
}

json NodeToJson(const TreeNode& node) {
  json j;
  j["kind"] = KindName(node.kind);
  switch (node.kind) {
    case Kind::kNone:
      break;
    case Kind::kDict: {
      json entries = json::array();
      for (const auto& [key, child] : node.entries)
        entries.push_back(json::array({key, NodeToJson(child)}));
      j["entries"] = std::move(entries);
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
      break;
    case Kind::kInt:
      j["value"] = node.int_value;
      break;
    case Kind::kFloat:
      j["value"] = FormatFloat(node.float_value);
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

// Nesting depth of JSON text, counted without parsing (the parser recurses, so a hostile
// million-deep document must be refused before it is parsed).
int JsonDepth(std::string_view text) {
  int depth = 0, max_depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      max_depth = std::max(max_depth, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return max_depth;
}

class Decoder {
 public:
  explicit Decoder(std::string_view where) : where_(where) {}

  Status Error(std::string_view what) const {
    return DataLossError(StrCat("invalid tree.json '", where_, "': ", what));
  }

  Result<std::vector<int64_t>> Ints(const json& j, std::string_view field, std::string_view ctx) {
    if (!j.contains(field) || !j[field].is_array()) {
      return Error(StrCat(ctx, ": missing or non-list \"", field, "\""));
    }
    std::vector<int64_t> out;
    for (const json& v : j[field]) {
      if (!v.is_number_integer())
        return Error(StrCat(ctx, ": \"", field, "\" holds a non-integer"));
      out.push_back(v.get<int64_t>());
    }
    return out;
  }

  Result<ArrayMetadata> Array(const json& j, size_t i) {
    const std::string ctx = StrCat("arrays[", i, "]");
    if (!j.is_object()) return Error(StrCat(ctx, " is not an object"));
    ArrayMetadata a;
    if (!j.contains("path") || !j["path"].is_string()) return Error(StrCat(ctx, ": no \"path\""));
    a.path = j["path"].get<std::string>();
    if (!j.contains("dtype") || !j["dtype"].is_string())
      return Error(StrCat(ctx, ": no \"dtype\""));
    auto dtype = ParseDType(j["dtype"].get<std::string>());
    if (!dtype.ok()) return Error(StrCat("array '", a.path, "': ", dtype.status().message()));
    a.dtype = *dtype;
    TS_ASSIGN_OR_RETURN(a.grid.shape, Ints(j, "shape", ctx));
    TS_ASSIGN_OR_RETURN(a.grid.cell_shape, Ints(j, "cell_shape", ctx));
    TS_ASSIGN_OR_RETURN(a.grid.chunk_shape, Ints(j, "chunk_shape", ctx));
    Status grid_ok = ValidateChunkGrid(a.grid, ItemSize(a.dtype), StrCat("array '", a.path, "'"));
    if (!grid_ok.ok()) return Error(MessageOf(grid_ok));
    const std::string codec = j.value("codec", std::string("none"));
    if (codec == "none") {
      a.codec = Codec::kNone;
    } else if (codec == "zstd") {
      a.codec = Codec::kZstd;
      a.zstd_level = j.value("zstd_level", 0);
    } else {
      return Error(StrCat("array '", a.path, "': unknown codec \"", codec, "\""));
    }
    return a;
  }

  Result<TreeNode> Node(const json& j, int depth) {
    if (depth > kMaxTreeDepth) return Error("tree nested too deeply");
    if (!j.is_object() || !j.contains("kind") || !j["kind"].is_string()) {
      return Error("a tree node lacks \"kind\"");
    }
    const std::string kind = j["kind"].get<std::string>();
    TreeNode node;
    if (kind == "none") {
      node.kind = Kind::kNone;
    } else if (kind == "dict") {
      node.kind = Kind::kDict;
      if (!j.contains("entries") || !j["entries"].is_array())
        return Error("dict without \"entries\"");
      std::set<std::string> seen;
      for (const json& e : j["entries"]) {
        if (!e.is_array() || e.size() != 2 || !e[0].is_string())
          return Error("malformed dict entry");
        std::string key = e[0].get<std::string>();
        if (!seen.insert(key).second) return Error(StrCat("duplicate dict key \"", key, "\""));
        TS_ASSIGN_OR_RETURN(TreeNode child, Node(e[1], depth + 1));
        node.entries.emplace_back(std::move(key), std::move(child));
      }
    } else if (kind == "list" || kind == "tuple") {
      node.kind = kind == "list" ? Kind::kList : Kind::kTuple;
      if (!j.contains("items") || !j["items"].is_array())
        return Error(StrCat(kind, " without \"items\""));
      for (const json& item : j["items"]) {
        TS_ASSIGN_OR_RETURN(TreeNode child, Node(item, depth + 1));
        node.items.push_back(std::move(child));
      }
    } else if (kind == "array") {
      node.kind = Kind::kArray;
      if (!j.contains("array") || !j["array"].is_number_integer())
        return Error("array leaf without \"array\"");
      node.array_id = j["array"].get<int64_t>();
    } else if (kind == "int") {
      node.kind = Kind::kInt;
      if (!j.contains("value") || !j["value"].is_string())
        return Error("int leaf without \"value\"");
      node.int_value = j["value"].get<std::string>();
      std::string_view digits = node.int_value;
      if (!digits.empty() && digits[0] == '-') digits.remove_prefix(1);
      if (digits.empty() || digits.find_first_not_of("0123456789") != std::string_view::npos) {
        return Error(StrCat("int leaf with value \"", node.int_value, "\""));
      }
    } else if (kind == "float") {
      node.kind = Kind::kFloat;
      if (!j.contains("value") || !j["value"].is_string())
        return Error("float leaf without \"value\"");
      const std::string text = j["value"].get<std::string>();
      auto parsed = std::from_chars(text.data(), text.data() + text.size(), node.float_value);
      if (text.empty() || parsed.ec != std::errc() || parsed.ptr != text.data() + text.size()) {
        return Error(StrCat("float leaf with value \"", text, "\""));
      }
    } else if (kind == "bool") {
      node.kind = Kind::kBool;
      if (!j.contains("value") || !j["value"].is_boolean())
        return Error("bool leaf without \"value\"");
      node.bool_value = j["value"].get<bool>();
    } else if (kind == "string") {
      node.kind = Kind::kString;
      if (!j.contains("value") || !j["value"].is_string())
        return Error("string leaf without \"value\"");
      node.string_value = j["value"].get<std::string>();
    } else if (kind == "bytes") {
      node.kind = Kind::kBytes;
      if (!j.contains("base64") || !j["base64"].is_string() ||
          !Base64Decode(j["base64"].get<std::string>(), &node.string_value)) {
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

namespace {

Result<TreeFile> DecodeTreeJsonImpl(std::string_view text, std::string_view where) {
  Decoder decoder(where);
  // A dict level takes three JSON levels ({"entries": [[key, node]]}).
  if (JsonDepth(text) > 3 * kMaxTreeDepth + 8) return decoder.Error("nested too deeply");
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return decoder.Error("not a JSON object");
  if (doc.value("format", std::string()) != kTreeFormatName) {
    return decoder.Error("missing \"format\": \"tensorstash/tree\"");
  }
  if (!doc.contains("version") || !doc["version"].is_array() || doc["version"].size() != 2 ||
      !doc["version"][0].is_number_integer() || !doc["version"][1].is_number_integer()) {
    return decoder.Error("missing or malformed \"version\"");
  }
  const int64_t major = doc["version"][0].get<int64_t>();
  if (major != kTreeMajorVersion) {
    return UnimplementedError(StrCat(
        "tree.json '", where, "' has format version ", major, ".", doc["version"][1].get<int64_t>(),
        "; this tensorstash reads version ", kTreeMajorVersion, ".x only (upgrade tensorstash)"));
  }
  if (!doc.contains("arrays") || !doc["arrays"].is_array())
    return decoder.Error("no \"arrays\" list");
  TreeFile tree;
  std::set<std::string> paths;
  for (size_t i = 0; i < doc["arrays"].size(); ++i) {
    TS_ASSIGN_OR_RETURN(ArrayMetadata a, decoder.Array(doc["arrays"][i], i));
    if (!paths.insert(a.path).second) {
      return decoder.Error(StrCat("array path '", a.path, "' appears twice"));
    }
    tree.arrays.push_back(std::move(a));
  }
  if (!doc.contains("tree")) return decoder.Error("no \"tree\"");
  TS_ASSIGN_OR_RETURN(tree.root, decoder.Node(doc["tree"], 0));
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

}  // namespace

Result<std::string> TreeNodeToJson(const TreeNode& node) {
  try {
    return NodeToJson(node).dump();
  } catch (const json::exception& e) {
    return InvalidArgumentError(StrCat("cannot encode tree: ", e.what()));
  }
}

Result<TreeNode> TreeNodeFromJson(std::string_view text) {
  Decoder decoder("tree node");
  if (JsonDepth(text) > 3 * kMaxTreeDepth + 8)
    return InvalidArgumentError("tree nested too deeply");
  try {
    json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (doc.is_discarded()) return InvalidArgumentError("tree node is not valid JSON");
    Result<TreeNode> node = decoder.Node(doc, 0);
    if (!node.ok()) return InvalidArgumentError(MessageOf(node.status()));
    return node;
  } catch (const json::exception& e) {
    return InvalidArgumentError(StrCat("invalid tree node: ", e.what()));
  }
}

Result<TreeFile> DecodeTreeJson(std::string_view text, std::string_view where) {
  try {
    return DecodeTreeJsonImpl(text, where);
  } catch (const nlohmann::json::exception& e) {
    // A field of the wrong JSON type makes nlohmann throw; turn it into a status.
    return DataLossError(StrCat("invalid tree.json '", where, "': ", e.what()));
  }
}

}  // namespace tensorstash
