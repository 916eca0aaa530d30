// Little-endian fixed-width integer encoding for the binary formats.
#ifndef TENSORSTASH_UTIL_ENDIAN_H_
#define TENSORSTASH_UTIL_ENDIAN_H_

#include <cstdint>
#include <cstring>
#include <string>

namespace tensorstash {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "tensorstash assumes a little-endian host (x86-64, arm64)");

template <typename T>
inline void PutLE(std::string* out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out->append(bytes, sizeof(T));
}
inline void PutLE16(std::string* out, uint16_t v) { PutLE(out, v); }
inline void PutLE32(std::string* out, uint32_t v) { PutLE(out, v); }
inline void PutLE64(std::string* out, uint64_t v) { PutLE(out, v); }

template <typename T>
inline T GetLE(const char* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}
inline uint16_t GetLE16(const char* p) { return GetLE<uint16_t>(p); }
inline uint32_t GetLE32(const char* p) { return GetLE<uint32_t>(p); }
inline uint64_t GetLE64(const char* p) { return GetLE<uint64_t>(p); }

}  // namespace tensorstash

#endif  // TENSORSTASH_UTIL_ENDIAN_H_
