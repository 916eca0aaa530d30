// AWS Signature Version 4 for S3 requests (the signer of the S3 store; issue 16).
//
// Written here rather than taken from curl (CURLOPT_AWS_SIGV4 in curl 7.88 mis-signs unsorted
// and valueless query parameters and unencoded paths). The algorithm (AWS's "Signature Version
// 4 signing process"):
//   canonical request = method, the URI-encoded path, the sorted and encoded query, the signed
//                       headers (lowercase names, trimmed values, sorted), their names, and the
//                       payload's SHA-256 (or "UNSIGNED-PAYLOAD"), one per line;
//   string to sign    = "AWS4-HMAC-SHA256", the time, the scope "<date>/<region>/s3/aws4_request"
//                       and the canonical request's SHA-256;
//   signature         = HMAC-SHA256 of it under a key derived from the secret, date, region and
//                       service.
// S3 paths are encoded once (not twice as for other services) and never normalised.
//
//   SignV4({.method = "GET", .path = "/bucket/a b.txt", .headers = {{"host", "s3.local:8333"}}},
//          credentials, "us-east-1", "20240101T000000Z") -> headers to add:
//     Authorization, x-amz-date, x-amz-content-sha256 (and x-amz-security-token)
//
// Thread-safety: pure functions.
#ifndef TENSORSTASH_KVSTORE_S3_SIGV4_H_
#define TENSORSTASH_KVSTORE_S3_SIGV4_H_

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tensorstash/util/status.h"

namespace tensorstash {

struct AwsCredentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // temporary credentials only
};

inline constexpr char kUnsignedPayload[] = "UNSIGNED-PAYLOAD";

struct SigV4Request {
  std::string method;  // "GET", "PUT", ...
  std::string path;    // not encoded: "/bucket/key with spaces"
  // Not encoded; in any order; a parameter without a value has an empty one ("uploads").
  std::vector<std::pair<std::string, std::string>> query;
  // Every header to sign, "host" among them (names in any case).
  std::vector<std::pair<std::string, std::string>> headers;
  // Lowercase hex SHA-256 of the body, or kUnsignedPayload.
  std::string payload_sha256 = kUnsignedPayload;
};

// Percent-encodes every byte but A-Z a-z 0-9 - _ . ~ (and '/' unless `encode_slash`), as
// uppercase %XX: S3's URI encoding, for paths and query parameters alike.
std::string AwsUriEncode(std::string_view text, bool encode_slash);

// The encoded query string of a request: parameters sorted by encoded name then value, "name=value"
// joined by '&' (what goes after '?' in the URL, and in the canonical request).
std::string CanonicalQueryString(const std::vector<std::pair<std::string, std::string>>& query);

// The canonical request (for tests and error messages: S3 returns it when signatures differ).
std::string CanonicalRequest(const SigV4Request& request, std::string_view amz_date);

// Lowercase hex SHA-256 of `data`.
std::string Sha256Hex(std::string_view data);

// The headers that sign `request` at `amz_date` ("YYYYMMDDTHHMMSSZ"): "authorization",
// "x-amz-date", "x-amz-content-sha256" and, with a session token, "x-amz-security-token" (which
// are signed too). InvalidArgument for a malformed date or missing credentials.
Result<std::vector<std::pair<std::string, std::string>>> SignV4(const SigV4Request& request,
                                                                const AwsCredentials& credentials,
                                                                std::string_view region,
                                                                std::string_view amz_date,
                                                                std::string_view service = "s3");

// The current UTC time as "YYYYMMDDTHHMMSSZ".
std::string AmzDateNow();

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_S3_SIGV4_H_
