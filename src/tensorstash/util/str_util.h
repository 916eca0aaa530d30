// Small string helpers for messages and keys.
//
// Debian's Abseil is built with its own absl::string_view (not std::string_view), so
// absl::StrCat does not take std::string_view; these helpers take anything that can be
// streamed, including std::string_view and absl::string_view (e.g. Status::message()).
#ifndef TENSORSTASH_UTIL_STR_UTIL_H_
#define TENSORSTASH_UTIL_STR_UTIL_H_

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace tensorstash {

namespace str_internal {
template <typename T>
void Append(std::string* out, const T& value) {
  if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out->append(std::string_view(value));
  } else if constexpr (std::is_same_v<T, char>) {
    out->push_back(value);
  } else if constexpr (std::is_same_v<T, bool>) {
    out->append(value ? "true" : "false");
  } else if constexpr (std::is_integral_v<T>) {
    out->append(std::to_string(value));
  } else {
    std::ostringstream stream;
    stream << value;
    out->append(stream.str());
  }
}
}  // namespace str_internal

// Concatenates the textual forms of `parts` (strings, string views, numbers, chars).
template <typename... Parts>
std::string StrCat(const Parts&... parts) {
  std::string out;
  (str_internal::Append(&out, parts), ...);
  return out;
}

// Joins `values` with `separator` ("1, 2, 3").
template <typename Container>
std::string StrJoin(const Container& values, std::string_view separator) {
  std::string out;
  bool first = true;
  for (const auto& value : values) {
    if (!first) out.append(separator);
    first = false;
    str_internal::Append(&out, value);
  }
  return out;
}

// "0x%08x" without the 0x: eight lowercase hex digits.
inline std::string Hex32(uint32_t value) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", value);
  return buf;
}

// Splits `text` at every `separator` (no trimming; "a,,b" gives three pieces).
inline std::vector<std::string_view> StrSplit(std::string_view text, char separator) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (;;) {
    const size_t pos = text.find(separator, start);
    if (pos == std::string_view::npos) {
      out.push_back(text.substr(start));
      return out;
    }
    out.push_back(text.substr(start, pos - start));
    start = pos + 1;
  }
}

// Parses a whole decimal integer; false on any junk or overflow.
template <typename Int>
bool ParseInt(std::string_view text, Int* out) {
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, *out);
  return ec == std::errc() && ptr == end && !text.empty();
}

// Whether `text` is well-formed UTF-8 (no overlong forms, no surrogates, at most U+10FFFF).
inline bool IsValidUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    size_t n = 0;
    uint32_t code = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      n = 1, code = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      n = 2, code = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      n = 3, code = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= text.size()) return false;  // truncated sequence
    for (size_t k = 1; k <= n; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next & 0xc0) != 0x80) return false;
      code = (code << 6) | (next & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (code < kMin[n] || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff)) return false;
    i += n + 1;
  }
  return true;
}

// `text` for a message: '"' and '\\' escaped with a backslash and bytes outside printable ASCII
// written as \xNN ("a\x00b"), so that a key or name with control bytes stays legible and can be
// put between double quotes.
inline std::string EscapeBytes(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (byte < 0x20 || byte >= 0x7f) {
      out += "\\x";
      out.push_back(kHex[byte >> 4]);
      out.push_back(kHex[byte & 0xf]);
    } else {
      out.push_back(c);
    }
  }
  return out;
}

}  // namespace tensorstash

#endif  // TENSORSTASH_UTIL_STR_UTIL_H_
