#include "tensorstash/format/commit_record.h"

#include "nlohmann/json.hpp"
#include "tensorstash/kvstore/kvstore.h"

namespace tensorstash {
namespace {

using json = nlohmann::json;
constexpr std::string_view kCommitFormatName = "tensorstash/commit";

Result<CommitRecord> DecodeImpl(std::string_view text, std::string_view where) {
  auto bad = [&](std::string_view what) {
    return DataLossError(StrCat("invalid commit record '", where, "': ", what));
  };
  if (text.size() > (1 << 20)) return bad("larger than 1 MiB");
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return bad("not a JSON object (torn write?)");
  if (doc.value("format", std::string()) != kCommitFormatName) {
    return bad("missing \"format\": \"tensorstash/commit\"");
  }
  const json& version = doc["version"];
  if (!version.is_array() || version.size() != 2 || !version[0].is_number_integer()) {
    return bad("missing or malformed \"version\"");
  }
  if (version[0].get<int64_t>() != kCommitMajorVersion) {
    return UnimplementedError(StrCat(
        "commit record '", where, "' has format version ", version[0].dump(), ".",
        version[1].dump(), "; this tensorstash reads version ", kCommitMajorVersion,
        ".x only (upgrade tensorstash)"));
  }
  CommitRecord record;
  record.created_unix_ms = doc.at("created_unix_ms").get<int64_t>();
  record.process_count = doc.at("process_count").get<int>();
  if (record.process_count < 1) return bad("process_count < 1");
  const json& items = doc.at("items");
  if (!items.is_object()) return bad("\"items\" is not an object");
  for (const auto& [name, item] : items.items()) {
    if (!ValidateKey(name).ok() || name.find('/') != std::string::npos) {
      return bad(StrCat("invalid item name \"", name, "\""));
    }
    CommitItem c;
    c.tree_crc32c = item.at("tree_crc32c").get<uint32_t>();
    c.tree_size = item.at("tree_size").get<uint64_t>();
    c.index_crc32c = item.at("index_crc32c").get<uint32_t>();
    c.index_size = item.at("index_size").get<uint64_t>();
    c.data_bytes = item.at("data_bytes").get<uint64_t>();
    c.num_arrays = item.at("num_arrays").get<uint64_t>();
    record.items[name] = c;
  }
  return record;
}

}  // namespace

std::string EncodeCommitRecord(const CommitRecord& record) {
  json doc;
  doc["format"] = kCommitFormatName;
  doc["version"] = {kCommitMajorVersion, kCommitMinorVersion};
  doc["created_unix_ms"] = record.created_unix_ms;
  doc["process_count"] = record.process_count;
  json items = json::object();
  for (const auto& [name, c] : record.items) {
    items[name] = {{"tree_crc32c", c.tree_crc32c}, {"tree_size", c.tree_size},
                   {"index_crc32c", c.index_crc32c}, {"index_size", c.index_size},
                   {"data_bytes", c.data_bytes}, {"num_arrays", c.num_arrays}};
  }
  doc["items"] = std::move(items);
  return doc.dump(1) + "\n";
}

Result<CommitRecord> DecodeCommitRecord(std::string_view text, std::string_view where) {
  try {
    return DecodeImpl(text, where);
  } catch (const json::exception& e) {
    return DataLossError(StrCat("invalid commit record '", where, "': ", e.what()));
  }
}

}  // namespace tensorstash
