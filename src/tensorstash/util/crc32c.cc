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

uint32_t Crc32(const void* data, size_t size, uint32_t crc) {
  // crc32_gzip_refl inverts on entry and exit itself, and takes a 64-bit length.
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), size);
}

namespace {

// Appending a zero bit to the message is linear over GF(2) on the 32-bit CRC register; a
// 32x32 bit matrix (one column per word) is that map. Squaring it doubles the zeros appended.
uint32_t MatrixTimes(const uint32_t* matrix, uint32_t vector) {
  uint32_t sum = 0;
  for (int i = 0; vector != 0; ++i, vector >>= 1) {
    if (vector & 1) sum ^= matrix[i];
  }
  return sum;
}

void MatrixSquare(uint32_t* square, const uint32_t* matrix) {
  for (int n = 0; n < 32; ++n) square[n] = MatrixTimes(matrix, matrix[n]);
}

}  // namespace

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t size_b) {
  if (size_b == 0) return crc_a;
  uint32_t odd[32];   // the operator of an odd power of two of zero bits
  uint32_t even[32];  // and of an even one
  odd[0] = 0x82F63B78u;  // one zero bit: the reflected Castagnoli polynomial
  for (int n = 1; n < 32; ++n) odd[n] = uint32_t{1} << (n - 1);
  MatrixSquare(even, odd);  // two zero bits
  MatrixSquare(odd, even);  // four
  // Shift crc_a past size_b zero bytes, one square per bit of size_b (the first square gives
  // one zero byte), then add crc_b: the inversions on entry and exit cancel in the XOR.
  do {
    MatrixSquare(even, odd);
    if (size_b & 1) crc_a = MatrixTimes(even, crc_a);
    size_b >>= 1;
    if (size_b == 0) break;
    MatrixSquare(odd, even);
    if (size_b & 1) crc_a = MatrixTimes(odd, crc_a);
    size_b >>= 1;
  } while (size_b != 0);
  return crc_a ^ crc_b;
}

}  // namespace tensorstash
