// Base64 (RFC 4648): the standard alphabet with padding, which object stores use for checksums
// in headers and JSON (S3's x-amz-checksum-crc32c, GCS's crc32c), and the URL-safe alphabet
// without padding (JSON Web Tokens). Pure functions; thread-safe.
#ifndef TENSORSTASH_UTIL_BASE64_H_
#define TENSORSTASH_UTIL_BASE64_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "tensorstash/util/status.h"

namespace tensorstash {

// "" -> "", "f" -> "Zg==", "foob" -> "Zm9vYg==".
std::string Base64Encode(std::string_view bytes);
// The URL-safe alphabet ('-' and '_' for '+' and '/'), no '=' padding: "foob" -> "Zm9vYg".
std::string Base64UrlEncode(std::string_view bytes);
// The bytes of standard base64 text (padding required). InvalidArgument naming the text when it
// is not base64.
Result<std::string> Base64Decode(std::string_view text);

// The big-endian 4 bytes of a CRC-32C in base64 (8 characters): how S3 and GCS write a
// CRC-32C. Crc32cBase64(Crc32c("")) == "AAAAAA==".
std::string Crc32cBase64(uint32_t crc);

}  // namespace tensorstash

#endif  // TENSORSTASH_UTIL_BASE64_H_
