#include "tensorstash/util/crc32c.h"

#include <isa-l/crc.h>

namespace tensorstash {

uint32_t Crc32c(const void* data, size_t size, uint32_t crc) {
  // ISA-L works on the un-inverted register; the standard CRC-32C inverts on entry and exit.
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint32_t state = ~crc;
  // crc32_iscsi takes an int length; feed very large buffers in pieces.
  constexpr size_t kMaxPiece = size_t{1} << 30;
  while (size > 0) {
    size_t piece = size < kMaxPiece ? size : kMaxPiece;
    state = crc32_iscsi(const_cast<unsigned char*>(bytes), static_cast<int>(piece), state);
    bytes += piece;
    size -= piece;
  }
  return ~state;
}

}  // namespace tensorstash
