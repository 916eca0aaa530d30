#include "tensorstash/kvstore/gcs/gcs_json.h"

#include <nlohmann/json.hpp>

#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using nlohmann::json;

Status Bad(std::string_view what, std::string_view field, std::string_view why) {
  return DataLossError(StrCat(what, ": the server's answer is not valid (", field, " ", why, ")"));
}

// A string field, "" when absent.
Status GetString(const json& object, const char* field, std::string_view what, std::string* out) {
  const auto it = object.find(field);
  if (it == object.end() || it->is_null()) return OkStatus();
  if (!it->is_string()) return Bad(what, field, "is not a string");
  *out = it->get<std::string>();
  return OkStatus();
}

// A uint64 sent as a decimal string (GCS's way for int64 fields) or as a number.
Status GetUint64(const json& object, const char* field, std::string_view what, bool required,
                 uint64_t* out) {
  const auto it = object.find(field);
  if (it == object.end() || it->is_null()) {
    return required ? Bad(what, field, "is missing") : OkStatus();
  }
  if (it->is_number_unsigned()) {
    *out = it->get<uint64_t>();
    return OkStatus();
  }
  if (it->is_string() && ParseInt(it->get_ref<const std::string&>(), out)) return OkStatus();
  return Bad(what, field, "is not a whole number");
}

Result<GcsObject> ObjectFrom(const json& object, std::string_view what) {
  if (!object.is_object()) return Bad(what, "an object", "is not a JSON object");
  GcsObject out;
  TS_RETURN_IF_ERROR(GetString(object, "name", what, &out.name));
  if (out.name.empty()) return Bad(what, "name", "is missing");
  TS_RETURN_IF_ERROR(GetUint64(object, "size", what, /*required=*/true, &out.size));
  uint64_t generation = 0;
  TS_RETURN_IF_ERROR(GetUint64(object, "generation", what, /*required=*/true, &generation));
  if (generation > static_cast<uint64_t>(INT64_MAX)) {
    return Bad(what, "generation", "is past the int64 range");
  }
  out.generation = std::to_string(generation);
  TS_RETURN_IF_ERROR(GetString(object, "crc32c", what, &out.crc32c));
  TS_RETURN_IF_ERROR(GetString(object, "updated", what, &out.updated));
  TS_RETURN_IF_ERROR(GetString(object, "timeCreated", what, &out.time_created));
  const auto metadata = object.find("metadata");
  if (metadata != object.end() && !metadata->is_null()) {
    if (!metadata->is_object()) return Bad(what, "metadata", "is not a JSON object");
    for (const auto& [name, value] : metadata->items()) {
      if (value.is_string()) out.metadata[name] = value.get<std::string>();
    }
  }
  return out;
}

Result<json> ParseBody(std::string_view body, std::string_view what) {
  json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return Bad(what, "the body", "is not JSON");
  if (!parsed.is_object()) return Bad(what, "the body", "is not a JSON object");
  return parsed;
}

}  // namespace

Result<GcsObject> ParseGcsObject(std::string_view body, std::string_view what) {
  TS_ASSIGN_OR_RETURN(json parsed, ParseBody(body, what));
  return ObjectFrom(parsed, what);
}

Result<GcsListPage> ParseGcsListPage(std::string_view body, std::string_view what) {
  TS_ASSIGN_OR_RETURN(json parsed, ParseBody(body, what));
  GcsListPage page;
  TS_RETURN_IF_ERROR(GetString(parsed, "nextPageToken", what, &page.next_page_token));
  const auto items = parsed.find("items");
  if (items != parsed.end() && !items->is_null()) {
    if (!items->is_array()) return Bad(what, "items", "is not a list");
    for (const json& item : *items) {
      TS_ASSIGN_OR_RETURN(GcsObject object, ObjectFrom(item, what));
      page.items.push_back(std::move(object));
    }
  }
  const auto prefixes = parsed.find("prefixes");
  if (prefixes != parsed.end() && !prefixes->is_null()) {
    if (!prefixes->is_array()) return Bad(what, "prefixes", "is not a list");
    for (const json& prefix : *prefixes) {
      if (!prefix.is_string()) return Bad(what, "prefixes", "holds something not a string");
      page.prefixes.push_back(prefix.get<std::string>());
    }
  }
  return page;
}

GcsError ParseGcsError(std::string_view body) {
  GcsError error;
  json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || !parsed.is_object()) return error;
  const auto inner = parsed.find("error");
  if (inner == parsed.end() || !inner->is_object()) return error;
  const auto code = inner->find("code");
  if (code != inner->end() && code->is_number_integer()) {
    const int64_t value = code->get<int64_t>();
    if (value >= 0 && value < 1000) error.code = static_cast<int>(value);
  }
  const auto message = inner->find("message");
  if (message != inner->end() && message->is_string()) error.message = message->get<std::string>();
  const auto errors = inner->find("errors");
  if (errors != inner->end() && errors->is_array() && !errors->empty() &&
      errors->front().is_object()) {
    const auto reason = errors->front().find("reason");
    if (reason != errors->front().end() && reason->is_string()) {
      error.reason = reason->get<std::string>();
    }
  }
  return error;
}

Result<std::chrono::system_clock::time_point> ParseRfc3339(std::string_view text) {
  const auto bad = [&] {
    return InvalidArgumentError(StrCat("'", EscapeBytes(text), "' is not an RFC 3339 time"));
  };
  // YYYY-MM-DDTHH:MM:SS[.fraction](Z|+HH:MM|-HH:MM)
  if (text.size() < 20 || text[4] != '-' || text[7] != '-' || (text[10] != 'T' && text[10] != 't') ||
      text[13] != ':' || text[16] != ':') {
    return bad();
  }
  // Every numeric field is digits only (ParseInt alone would take a sign: "T-1:00:00Z").
  for (size_t at : {0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18}) {
    if (text[at] < '0' || text[at] > '9') return bad();
  }
  int year = 0, month = 0, day = 0, hour = 0, minute = 0, second = 0;
  if (!ParseInt(text.substr(0, 4), &year) || !ParseInt(text.substr(5, 2), &month) ||
      !ParseInt(text.substr(8, 2), &day) || !ParseInt(text.substr(11, 2), &hour) ||
      !ParseInt(text.substr(14, 2), &minute) || !ParseInt(text.substr(17, 2), &second)) {
    return bad();
  }
  size_t i = 19;
  int64_t nanos = 0;
  if (i < text.size() && text[i] == '.') {
    ++i;
    int digits = 0;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
      if (digits < 9) nanos = nanos * 10 + (text[i] - '0'), ++digits;
      ++i;
    }
    if (digits == 0) return bad();
    while (digits < 9) nanos *= 10, ++digits;
  }
  int offset_minutes = 0;
  if (i < text.size() && (text[i] == 'Z' || text[i] == 'z') && i + 1 == text.size()) {
  } else if (i + 6 == text.size() && (text[i] == '+' || text[i] == '-') && text[i + 3] == ':') {
    int oh = 0, om = 0;
    for (size_t at : {i + 1, i + 2, i + 4, i + 5}) {
      if (text[at] < '0' || text[at] > '9') return bad();
    }
    if (!ParseInt(text.substr(i + 1, 2), &oh) || !ParseInt(text.substr(i + 4, 2), &om)) {
      return bad();
    }
    offset_minutes = (text[i] == '+' ? 1 : -1) * (oh * 60 + om);
  } else {
    return bad();
  }
  const std::chrono::year_month_day date{std::chrono::year(year),
                                         std::chrono::month(static_cast<unsigned>(month)),
                                         std::chrono::day(static_cast<unsigned>(day))};
  if (!date.ok() || hour > 23 || minute > 59 || second > 60) return bad();
  return std::chrono::sys_days(date) + std::chrono::hours(hour) + std::chrono::minutes(minute) +
         std::chrono::seconds(second) - std::chrono::minutes(offset_minutes) +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             std::chrono::nanoseconds(nanos));
}

}  // namespace tensorstash
