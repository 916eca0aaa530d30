#include "tensorstash/kvstore/s3/sigv4.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <ctime>

#include "tensorstash/kvstore/http/http_client.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

std::string Hex(const unsigned char* data, size_t size) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(size * 2, '0');
  for (size_t i = 0; i < size; ++i) {
    out[2 * i] = kDigits[data[i] >> 4];
    out[2 * i + 1] = kDigits[data[i] & 15];
  }
  return out;
}

std::string HmacSha256(std::string_view key, std::string_view data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &size);
  return std::string(reinterpret_cast<const char*>(out), size);
}

std::string Lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Leading and trailing spaces removed, runs of spaces inside made one.
std::string TrimHeaderValue(std::string_view value) {
  std::string out;
  bool space = false;
  for (char c : value) {
    if (c == ' ' || c == '\t') {
      space = !out.empty();
      continue;
    }
    if (space) out.push_back(' ');
    space = false;
    out.push_back(c);
  }
  return out;
}

bool IsAmzDate(std::string_view date) {
  if (date.size() != 16 || date[8] != 'T' || date[15] != 'Z') return false;
  for (size_t i = 0; i < 15; ++i) {
    if (i != 8 && !std::isdigit(static_cast<unsigned char>(date[i]))) return false;
  }
  return true;
}

// The headers to sign, lowercase and trimmed, sorted by name; values of a repeated name joined
// by ','.
std::vector<std::pair<std::string, std::string>> CanonicalHeaders(
    const std::vector<std::pair<std::string, std::string>>& headers) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [name, value] : headers) out.emplace_back(Lower(name), TrimHeaderValue(value));
  std::stable_sort(out.begin(), out.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::pair<std::string, std::string>> merged;
  for (auto& [name, value] : out) {
    if (!merged.empty() && merged.back().first == name) {
      merged.back().second += "," + value;
    } else {
      merged.emplace_back(std::move(name), std::move(value));
    }
  }
  return merged;
}

std::string SignedHeaderNames(const std::vector<std::pair<std::string, std::string>>& canonical) {
  std::string out;
  for (const auto& [name, value] : canonical) out += StrCat(out.empty() ? "" : ";", name);
  return out;
}

}  // namespace

std::string AwsUriEncode(std::string_view text, bool encode_slash) {
  return UrlEscape(text, /*keep_slash=*/!encode_slash);
}

std::string CanonicalQueryString(const std::vector<std::pair<std::string, std::string>>& query) {
  std::vector<std::pair<std::string, std::string>> encoded;
  for (const auto& [name, value] : query) {
    encoded.emplace_back(AwsUriEncode(name, true), AwsUriEncode(value, true));
  }
  std::sort(encoded.begin(), encoded.end());
  std::string out;
  for (const auto& [name, value] : encoded) out += StrCat(out.empty() ? "" : "&", name, "=", value);
  return out;
}

std::string Sha256Hex(std::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(data.data(), data.size(), digest, &size, EVP_sha256(), nullptr);
  return Hex(digest, size);
}

std::string CanonicalRequest(const SigV4Request& request, std::string_view amz_date) {
  (void)amz_date;  // the date is signed as the x-amz-date header, which SignV4 adds
  const std::vector<std::pair<std::string, std::string>> headers =
      CanonicalHeaders(request.headers);
  std::string out = StrCat(request.method, "\n", AwsUriEncode(request.path, false), "\n",
                           CanonicalQueryString(request.query), "\n");
  for (const auto& [name, value] : headers) out += StrCat(name, ":", value, "\n");
  out += StrCat("\n", SignedHeaderNames(headers), "\n", request.payload_sha256);
  return out;
}

Result<std::vector<std::pair<std::string, std::string>>> SignV4(const SigV4Request& request,
                                                                const AwsCredentials& credentials,
                                                                std::string_view region,
                                                                std::string_view amz_date,
                                                                std::string_view service) {
  if (!IsAmzDate(amz_date)) {
    return InvalidArgumentError(
        StrCat("'", amz_date, "' is not a date of the form YYYYMMDDTHHMMSSZ"));
  }
  if (credentials.access_key_id.empty() || credentials.secret_access_key.empty()) {
    return InvalidArgumentError("S3 credentials need an access key id and a secret access key");
  }
  std::vector<std::pair<std::string, std::string>> added = {
      {"x-amz-date", std::string(amz_date)}, {"x-amz-content-sha256", request.payload_sha256}};
  if (!credentials.session_token.empty()) {
    added.emplace_back("x-amz-security-token", credentials.session_token);
  }
  SigV4Request signed_request = request;
  for (const auto& header : added) signed_request.headers.push_back(header);
  const std::string date(amz_date.substr(0, 8));
  const std::string scope = StrCat(date, "/", region, "/", service, "/aws4_request");
  const std::string canonical = CanonicalRequest(signed_request, amz_date);
  const std::string to_sign =
      StrCat("AWS4-HMAC-SHA256\n", amz_date, "\n", scope, "\n", Sha256Hex(canonical));
  std::string key = HmacSha256(StrCat("AWS4", credentials.secret_access_key), date);
  key = HmacSha256(key, region);
  key = HmacSha256(key, service);
  key = HmacSha256(key, "aws4_request");
  const std::string signature = HmacSha256(key, to_sign);
  added.emplace_back(
      "authorization",
      StrCat("AWS4-HMAC-SHA256 Credential=", credentials.access_key_id, "/", scope,
             ", SignedHeaders=", SignedHeaderNames(CanonicalHeaders(signed_request.headers)),
             ", Signature=",
             Hex(reinterpret_cast<const unsigned char*>(signature.data()), signature.size())));
  return added;
}

std::string AmzDateNow() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[17];
  std::strftime(text, sizeof(text), "%Y%m%dT%H%M%SZ", &utc);
  return text;
}

}  // namespace tensorstash
