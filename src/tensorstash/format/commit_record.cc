#include "tensorstash/format/commit_record.h"

#include <cstdint>

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
  if (text.size() > kMaxCommitRecordBytes) return bad("larger than 1 MiB");
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return bad("not a JSON object (torn write?)");
  if (doc.value("format", std::string()) != kCommitFormatName) {
    return bad("missing \"format\": \"tensorstash/commit\"");
  }
  const json& version = doc["version"];
  if (!version.is_array() || version.size() != 2 || !version[0].is_number_integer() ||
      !version[1].is_number_integer()) {
    return bad("missing or malformed \"version\"");
  }
  if (version[0].get<int64_t>() != kCommitMajorVersion) {
    return UnimplementedError(StrCat("commit record '", where, "' has format version ",
                                     version[0].dump(), ".", version[1].dump(),
                                     "; this tensorstash reads version ", kCommitMajorVersion,
                                     ".x only (upgrade tensorstash)"));
  }
  CommitRecord record;
  // Integers must be JSON integers: get<> of a float outside the target's range is undefined
  // behaviour (found by fuzz/commit_record_fuzzer), and an int64 wraps silently into an int.
  const json& created = doc.at("created_unix_ms");
  if (!created.is_number_integer() ||
      (created.is_number_unsigned() && created.get<uint64_t>() > uint64_t{INT64_MAX})) {
    return bad("\"created_unix_ms\" is not an integer in range");
  }
  record.created_unix_ms = created.get<int64_t>();
  const json& processes = doc.at("process_count");
  // (An unsigned value past INT64_MAX reads back negative here, and is refused too.)
  if (!processes.is_number_integer() || processes.get<int64_t>() < 1 ||
      processes.get<int64_t>() > INT32_MAX) {
    return bad("\"process_count\" is not an integer from 1 to 2^31 - 1");
  }
  record.process_count = static_cast<int>(processes.get<int64_t>());
  const json& items = doc.at("items");
  if (!items.is_object()) return bad("\"items\" is not an object");
  for (const auto& entry : items.items()) {
    // Named copies, not structured bindings: lambdas below use them (clang < 16 cannot).
    const std::string& name = entry.key();
    const json& item = entry.value();
    if (!ValidateKey(name).ok() || name.find('/') != std::string::npos) {
      return bad(StrCat("invalid item name \"", name, "\""));
    }
    // Unsigned fields must hold unsigned numbers in range (get<> would silently wrap).
    auto field = [&](const char* key, uint64_t max, uint64_t* out) -> Status {
      const json& v = item.at(key);
      if (!v.is_number_unsigned() || v.get<uint64_t>() > max) {
        return bad(StrCat("item \"", name, "\": \"", key, "\" is not a number in range"));
      }
      *out = v.get<uint64_t>();
      return OkStatus();
    };
    CommitItem c;
    uint64_t tree_crc = 0, index_crc = 0;
    TS_RETURN_IF_ERROR(field("tree_crc32c", UINT32_MAX, &tree_crc));
    TS_RETURN_IF_ERROR(field("tree_size", UINT64_MAX, &c.tree_size));
    TS_RETURN_IF_ERROR(field("index_crc32c", UINT32_MAX, &index_crc));
    TS_RETURN_IF_ERROR(field("index_size", UINT64_MAX, &c.index_size));
    TS_RETURN_IF_ERROR(field("data_bytes", UINT64_MAX, &c.data_bytes));
    TS_RETURN_IF_ERROR(field("num_arrays", UINT64_MAX, &c.num_arrays));
    c.tree_crc32c = static_cast<uint32_t>(tree_crc);
    c.index_crc32c = static_cast<uint32_t>(index_crc);
    record.items[name] = c;
  }
  if (doc.contains("files")) {
    const json& files = doc["files"];
    if (!files.is_object()) return bad("\"files\" is not an object");
    for (const auto& [name, file] : files.items()) {
      if (!ValidateKey(name).ok()) return bad(StrCat("invalid file name \"", name, "\""));
      if (!file.is_object()) return bad(StrCat("file \"", name, "\" is not an object"));
      const json& size = file.at("size");
      const json& crc = file.at("crc32c");
      if (!size.is_number_unsigned() || !crc.is_number_unsigned() ||
          crc.get<uint64_t>() > UINT32_MAX) {
        return bad(StrCat("file \"", name, "\": \"size\" or \"crc32c\" is not a number in range"));
      }
      record.files[name] = {size.get<uint64_t>(), static_cast<uint32_t>(crc.get<uint64_t>())};
    }
  }
  if (doc.contains("attempt")) {
    const json& attempt = doc["attempt"];
    if (!attempt.is_string() || !ValidateKey(attempt.get<std::string>()).ok() ||
        attempt.get<std::string>().find('/') != std::string::npos) {
      return bad("\"attempt\" is not a folder name");
    }
    record.attempt = attempt.get<std::string>();
    const json& objects = doc.at("objects");
    if (!objects.is_object()) return bad("\"objects\" is not an object");
    for (const auto& [name, object] : objects.items()) {
      if (!ValidateKey(name).ok()) return bad(StrCat("invalid object name \"", name, "\""));
      if (!object.is_object()) return bad(StrCat("object \"", name, "\" is not an object"));
      const json& size = object.at("size");
      const json& generation = object.at("generation");
      if (!size.is_number_unsigned() || !generation.is_string()) {
        return bad(StrCat("object \"", name, "\": \"size\" or \"generation\" is malformed"));
      }
      record.objects[name] = {size.get<uint64_t>(), generation.get<std::string>()};
    }
  }
  if (doc.contains("depends_on")) {
    const json& steps = doc["depends_on"];
    if (!steps.is_array()) return bad("\"depends_on\" is not a list");
    for (const json& step : steps) {
      if (!step.is_string() || !ValidateKey(step.get<std::string>()).ok()) {
        return bad("\"depends_on\" holds something that is not a step folder");
      }
      if (!record.depends_on.empty() && record.depends_on.back() >= step.get<std::string>()) {
        return bad("\"depends_on\" is not sorted or names a step twice");
      }
      record.depends_on.push_back(step.get<std::string>());
    }
  }
  return record;
}

}  // namespace

std::string EncodeCommitRecord(const CommitRecord& record) {
  json doc;
  doc["format"] = kCommitFormatName;
  doc["version"] = {kCommitMajorVersion,
                    !record.depends_on.empty() ? 3
                    : !record.attempt.empty()  ? 2
                                               : (record.files.empty() ? 0 : 1)};
  doc["created_unix_ms"] = record.created_unix_ms;
  doc["process_count"] = record.process_count;
  json items = json::object();
  for (const auto& [name, c] : record.items) {
    items[name] = {{"tree_crc32c", c.tree_crc32c},   {"tree_size", c.tree_size},
                   {"index_crc32c", c.index_crc32c}, {"index_size", c.index_size},
                   {"data_bytes", c.data_bytes},     {"num_arrays", c.num_arrays}};
  }
  doc["items"] = std::move(items);
  if (!record.files.empty()) {
    json files = json::object();
    for (const auto& [name, f] : record.files) {
      files[name] = {{"size", f.size}, {"crc32c", f.crc32c}};
    }
    doc["files"] = std::move(files);
  }
  if (!record.attempt.empty()) {
    doc["attempt"] = record.attempt;
    json objects = json::object();
    for (const auto& [name, o] : record.objects) {
      objects[name] = {{"size", o.size}, {"generation", o.generation}};
    }
    doc["objects"] = std::move(objects);
  }
  if (!record.depends_on.empty()) doc["depends_on"] = record.depends_on;
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
