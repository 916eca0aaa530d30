// The JSON bodies of Google Cloud Storage's JSON API that the gs:// store reads: an object
// resource, a page of a listing, an error. Bad input (not JSON, a field of the wrong type, a
// generation or size that is not a decimal integer) is DataLoss naming `what` and the field,
// never a crash. Fields the store does not use are ignored.
//
// Thread-safety: pure functions.
#ifndef TENSORSTASH_KVSTORE_GCS_GCS_JSON_H_
#define TENSORSTASH_KVSTORE_GCS_GCS_JSON_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/util/status.h"

namespace tensorstash {

// An object resource (https://cloud.google.com/storage/docs/json_api/v1/objects).
struct GcsObject {
  std::string name;
  uint64_t size = 0;
  std::string generation;  // a decimal int64, as GCS sends it (a string)
  std::string crc32c;      // base64 of the big-endian CRC-32C; "" when absent
  std::string updated;     // RFC 3339; "" when absent
  std::string time_created;
  std::map<std::string, std::string> metadata;  // the custom metadata
};

struct GcsListPage {
  std::vector<GcsObject> items;
  std::vector<std::string> prefixes;  // with a delimiter: the "folders"
  std::string next_page_token;        // "" on the last page
};

// `{"error": {"code": 412, "message": ..., "errors": [{"reason": "conditionNotMet"}]}}`;
// empty fields for a body that is not such an error.
struct GcsError {
  int code = 0;
  std::string message;
  std::string reason;  // of the first entry of "errors"
};

Result<GcsObject> ParseGcsObject(std::string_view body, std::string_view what);
Result<GcsListPage> ParseGcsListPage(std::string_view body, std::string_view what);
GcsError ParseGcsError(std::string_view body);

// "2026-11-29T08:21:50.123Z" (RFC 3339, any offset). InvalidArgument when it does not parse.
Result<std::chrono::system_clock::time_point> ParseRfc3339(std::string_view text);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_GCS_GCS_JSON_H_
