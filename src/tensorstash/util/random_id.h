// Random identifiers for temporary names (".tmp-<id>" folders, OCDBT file names).
#ifndef TENSORSTASH_UTIL_RANDOM_ID_H_
#define TENSORSTASH_UTIL_RANDOM_ID_H_

#include <string>
#include <string_view>

namespace tensorstash {

// `hex_digits` random lowercase hex digits from std::random_device (never seeded from the clock,
// so two processes started at once do not collide). Thread-safe.
std::string RandomHexId(int hex_digits = 16);

// True when `s` is exactly `hex_digits` lowercase hex digits (what RandomHexId returns).
bool IsHexId(std::string_view s, int hex_digits = 16);

}  // namespace tensorstash

#endif  // TENSORSTASH_UTIL_RANDOM_ID_H_
