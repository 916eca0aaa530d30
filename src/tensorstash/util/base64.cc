#include "tensorstash/util/base64.h"

#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

constexpr char kStandard[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
constexpr char kUrlSafe[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

std::string Encode(std::string_view bytes, const char* alphabet, bool pad) {
  std::string out;
  out.reserve(4 * ((bytes.size() + 2) / 3));
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t v = (uint32_t{static_cast<unsigned char>(bytes[i])} << 16) |
                       (uint32_t{static_cast<unsigned char>(bytes[i + 1])} << 8) |
                       uint32_t{static_cast<unsigned char>(bytes[i + 2])};
    out += alphabet[(v >> 18) & 63];
    out += alphabet[(v >> 12) & 63];
    out += alphabet[(v >> 6) & 63];
    out += alphabet[v & 63];
  }
  const size_t left = bytes.size() - i;
  if (left > 0) {
    uint32_t v = uint32_t{static_cast<unsigned char>(bytes[i])} << 16;
    if (left == 2) v |= uint32_t{static_cast<unsigned char>(bytes[i + 1])} << 8;
    out += alphabet[(v >> 18) & 63];
    out += alphabet[(v >> 12) & 63];
    if (left == 2) out += alphabet[(v >> 6) & 63];
    if (pad) out.append(3 - left, '=');
  }
  return out;
}

int DecodeChar(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

}  // namespace

std::string Base64Encode(std::string_view bytes) { return Encode(bytes, kStandard, true); }

std::string Base64UrlEncode(std::string_view bytes) { return Encode(bytes, kUrlSafe, false); }

Result<std::string> Base64Decode(std::string_view text) {
  const auto bad = [&] {
    return InvalidArgumentError(StrCat("'", EscapeBytes(text.substr(0, 64)), "' is not base64"));
  };
  if (text.size() % 4 != 0) return bad();
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    int pads = 0;
    uint32_t v = 0;
    for (size_t j = 0; j < 4; ++j) {
      const char c = text[i + j];
      if (c == '=' && last && j >= 2) {
        ++pads;
        v <<= 6;
        continue;
      }
      const int d = DecodeChar(c);
      if (d < 0 || pads > 0) return bad();
      v = (v << 6) | static_cast<uint32_t>(d);
    }
    out += static_cast<char>(v >> 16);
    if (pads < 2) out += static_cast<char>((v >> 8) & 255);
    if (pads < 1) out += static_cast<char>(v & 255);
  }
  return out;
}

std::string Crc32cBase64(uint32_t crc) {
  const char bytes[4] = {static_cast<char>(crc >> 24), static_cast<char>((crc >> 16) & 255),
                         static_cast<char>((crc >> 8) & 255), static_cast<char>(crc & 255)};
  return Base64Encode(std::string_view(bytes, 4));
}

}  // namespace tensorstash
