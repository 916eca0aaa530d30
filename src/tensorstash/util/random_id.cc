#include "tensorstash/util/random_id.h"

#include <random>

namespace tensorstash {

std::string RandomHexId(int hex_digits) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::random_device device;
  std::string out;
  out.reserve(hex_digits);
  uint32_t word = 0;
  for (int i = 0; i < hex_digits; ++i, word >>= 4) {
    if (i % 8 == 0) word = device();
    out.push_back(kDigits[word & 15]);
  }
  return out;
}

bool IsHexId(std::string_view s, int hex_digits) {
  if (s.size() != static_cast<size_t>(hex_digits)) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace tensorstash
