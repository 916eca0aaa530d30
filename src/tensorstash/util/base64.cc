#include "tensorstash/util/base64.h"

#include "absl/strings/escaping.h"
#include "tensorstash/util/str_util.h"

// The codecs are Abseil's (absl/strings/escaping.h, which format/tree.cc uses too); this file
// only fixes the policy: padding required when decoding, and the CRC-32C form object stores use.

namespace tensorstash {

std::string Base64Encode(std::string_view bytes) { return absl::Base64Escape(absl::string_view(bytes.data(), bytes.size())); }

std::string Base64UrlEncode(std::string_view bytes) { return absl::WebSafeBase64Escape(
      absl::string_view(bytes.data(), bytes.size())); }

Result<std::string> Base64Decode(std::string_view text) {
  std::string out;
  // Abseil also takes text without its padding; the callers' formats always pad.
  if (text.size() % 4 != 0 || !absl::Base64Unescape(absl::string_view(text.data(), text.size()), &out)) {
    return InvalidArgumentError(StrCat("'", EscapeBytes(text.substr(0, 64)), "' is not base64"));
  }
  return out;
}

std::string Crc32cBase64(uint32_t crc) {
  const char bytes[4] = {static_cast<char>(crc >> 24), static_cast<char>(crc >> 16),
                         static_cast<char>(crc >> 8), static_cast<char>(crc)};
  return Base64Encode(std::string_view(bytes, 4));
}

}  // namespace tensorstash
