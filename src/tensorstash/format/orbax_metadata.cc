#include "tensorstash/format/orbax_metadata.h"

#include <limits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

// _METADATA is parsed with nlohmann::json (objects as std::map) rather than ordered_json, whose
// objects insert each key by a linear search: quadratic in tree_metadata's entries (profiled:
// the top cost of opening a checkpoint of 20k leaves). The order of the entries, which is the
// pytree's, comes from a SAX pass over the same text before it (MetadataScan).
using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// The SAX pass: records the keys of the top-level "tree_metadata" object in order (of the last
// one, should the key repeat: the parsed document keeps the last), refuses nesting deeper than
// kMaxOrbaxMetadataNesting, and keeps the parser's message on bad JSON. (A parser callback would
// do it in the DOM pass, but nlohmann's callback parser walks the parent object at every
// object's end: quadratic again.)
class MetadataScan final : public nlohmann::json_sax<Json> {
 public:
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return Enter(); }
  bool end_object() override {
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override { return Enter(); }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool key(string_t& key) override {
    if (depth_ == 1) {
      in_tree_ = key == "tree_metadata";
      if (in_tree_) order_.clear();
    } else if (depth_ == 2 && in_tree_) {
      order_.push_back(key);
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    // "[json.exception.parse_error.101] parse error at line 1, column 9: ...": the part after
    // the bracket says where and what.
    error_ = e.what();
    if (const size_t end = error_.find("] "); end != std::string::npos) error_.erase(0, end + 2);
    return false;
  }

  const std::vector<std::string>& order() const { return order_; }
  bool too_deep() const { return too_deep_; }
  const std::string& error() const { return error_; }

 private:
  bool Enter() {
    if (++depth_ > kMaxOrbaxMetadataNesting) too_deep_ = true;
    return !too_deep_;
  }

  std::vector<std::string> order_;
  int depth_ = 0;
  bool in_tree_ = false;
  bool too_deep_ = false;
  std::string error_;
};

// Python's repr() of a str, as Orbax's str(tuple(keys)) spells each key.
std::string PyRepr(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (unsigned char c : s) {
    if (c == '\\' || c == static_cast<unsigned char>(quote)) {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      static const char* kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  out += quote;
  return out;
}

// JSON text of a value; bytes that are not UTF-8 become U+FFFD rather than an exception.
template <typename J>
std::string Dump(const J& value) {
  return value.dump(-1, ' ', false, nlohmann::detail::error_handler_t::replace);
}

std::optional<bool> OptionalBool(const Json& object, const char* field) {
  const auto it = object.find(field);
  if (it == object.end() || !it->is_boolean()) return std::nullopt;
  return it->get<bool>();
}

std::optional<std::vector<int64_t>> OptionalShape(const Json& object, const char* field) {
  const auto it = object.find(field);
  if (it == object.end() || !it->is_array()) return std::nullopt;
  std::vector<int64_t> shape;
  for (const Json& e : *it) {
    if (e.is_number_unsigned() &&
        e.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return std::nullopt;
    }
    if (!e.is_number_integer()) return std::nullopt;
    shape.push_back(e.get<int64_t>());
  }
  return shape;
}

bool HasObject(const Json& object, const char* field) {
  const auto it = object.find(field);
  return it != object.end() && it->is_object();
}

Result<OrbaxTreeEntry> DecodeEntry(const std::string& name, const Json& entry,
                                   const std::string& entry_where) {
  if (!entry.is_object() || !entry.contains("key_metadata") ||
      !entry["key_metadata"].is_array() || !HasObject(entry, "value_metadata")) {
    return DataLossError(StrCat(entry_where, ": expected key_metadata and value_metadata"));
  }
  OrbaxTreeEntry out;
  out.name = name;
  for (const Json& k : entry["key_metadata"]) {
    if (!k.is_object() || !k.contains("key") || !k["key"].is_string() ||
        !k.contains("key_type") || !k["key_type"].is_number_integer()) {
      return DataLossError(StrCat(entry_where, ": malformed key_metadata"));
    }
    const Json& type = k["key_type"];
    if (type != static_cast<int>(OrbaxKeyType::kSequence) &&
        type != static_cast<int>(OrbaxKeyType::kDict)) {
      return DataLossError(StrCat(entry_where, ": unknown key_type ", Dump(type)));
    }
    out.keys.push_back({k["key"].get<std::string>(), static_cast<OrbaxKeyType>(type.get<int>())});
  }
  const Json& value = entry["value_metadata"];
  if (!value.contains("value_type") || !value["value_type"].is_string()) {
    return DataLossError(StrCat(entry_where, ": value_metadata has no value_type"));
  }
  out.value_type = value["value_type"].get<std::string>();
  out.skip_deserialize = OptionalBool(value, "skip_deserialize");
  out.write_shape = OptionalShape(value, "write_shape");
  return out;
}

}  // namespace

std::string OrbaxEntryName(const std::vector<OrbaxKey>& keys) {
  std::string out = "(";
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i > 0) out += ", ";
    out += PyRepr(keys[i].name);
  }
  if (keys.size() == 1) out += ",";
  return out + ")";
}

std::string EncodeOrbaxMetadata(const OrbaxMetadata& metadata) {
  // tree_metadata is joined by hand: ordered_json would search its keys at every insertion.
  std::string out = "{\"tree_metadata\":{";
  for (size_t i = 0; i < metadata.tree.size(); ++i) {
    const OrbaxTreeEntry& e = metadata.tree[i];
    OrderedJson keys = OrderedJson::array();
    for (const OrbaxKey& k : e.keys) {
      keys.push_back(OrderedJson{{"key", k.name}, {"key_type", static_cast<int>(k.type)}});
    }
    OrderedJson value = {{"value_type", e.value_type}};
    if (e.skip_deserialize.has_value()) value["skip_deserialize"] = *e.skip_deserialize;
    if (e.write_shape.has_value()) value["write_shape"] = *e.write_shape;
    if (i > 0) out += ',';
    out += Dump(Json(e.name));
    out += ':';
    out += Dump(
        OrderedJson{{"key_metadata", std::move(keys)}, {"value_metadata", std::move(value)}});
  }
  out += '}';
  for (const auto& [field, flag] :
       {std::pair{"use_ocdbt", metadata.use_ocdbt}, std::pair{"use_zarr3", metadata.use_zarr3},
        std::pair{"store_array_data_equal_to_fill_value",
                  metadata.store_array_data_equal_to_fill_value}}) {
    if (flag.has_value()) out += StrCat(",\"", field, "\":", *flag ? "true" : "false");
  }
  return out + ",\"custom_metadata\":null}";
}

Result<OrbaxMetadata> DecodeOrbaxMetadata(std::string_view json, std::string_view where_view) {
  const std::string where(where_view);
  if (json.size() > kMaxOrbaxMetadataBytes) {
    return DataLossError(StrCat(where, " is ", json.size(), " bytes, more than the limit of ",
                                kMaxOrbaxMetadataBytes));
  }
  MetadataScan scan;
  if (!Json::sax_parse(json, &scan)) {
    if (scan.too_deep()) {
      return DataLossError(
          StrCat(where, " is nested deeper than ", kMaxOrbaxMetadataNesting, " levels"));
    }
    return DataLossError(StrCat(where, " is not valid JSON (", scan.error(), ")"));
  }
  const Json doc = Json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return DataLossError(StrCat(where, " is not valid JSON"));
  if (!HasObject(doc, "tree_metadata")) {
    return DataLossError(StrCat(where,
                                " has no \"tree_metadata\" object (an Orbax version "
                                "before 0.5 or not an Orbax PyTree checkpoint)"));
  }
  OrbaxMetadata out;
  out.use_ocdbt = OptionalBool(doc, "use_ocdbt");
  out.use_zarr3 = OptionalBool(doc, "use_zarr3");
  out.store_array_data_equal_to_fill_value =
      OptionalBool(doc, "store_array_data_equal_to_fill_value");
  const Json& tree = doc["tree_metadata"];
  // A repeated entry: the parsed document kept its last value only.
  if (scan.order().size() != tree.size()) {
    std::unordered_set<std::string_view> seen;
    for (const std::string& name : scan.order()) {
      if (!seen.insert(name).second) {
        return DataLossError(StrCat(where, ", entry ", name, ": appears twice in tree_metadata"));
      }
    }
  }
  out.tree.reserve(scan.order().size());
  for (const std::string& name : scan.order()) {
    const std::string entry_where = StrCat(where, ", entry ", name);
    const auto found = tree.find(name);
    if (found == tree.end()) {
      return InternalError(StrCat(entry_where, ": scanned but not parsed"));
    }
    TS_ASSIGN_OR_RETURN(OrbaxTreeEntry entry, DecodeEntry(name, *found, entry_where));
    out.tree.push_back(std::move(entry));
  }
  return out;
}

}  // namespace tensorstash
