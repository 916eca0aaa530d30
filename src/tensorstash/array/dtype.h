// Element types of stored arrays, named as NumPy and ml_dtypes spell them.
//
// Thread-safety: everything here is immutable or a pure function.
#ifndef TENSORSTASH_ARRAY_DTYPE_H_
#define TENSORSTASH_ARRAY_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tensorstash/util/status.h"

namespace tensorstash {

enum class DType : uint8_t {
  kBool,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kUint8,
  kUint16,
  kUint32,
  kUint64,
  kFloat16,
  kBfloat16,
  kFloat32,
  kFloat64,
  kComplex64,
  kComplex128,
  kFloat8E4m3fn,
  kFloat8E5m2,
  // Added in format 1.x after the first release; values above never change (tests pin them).
  kInt2,
  kInt4,
  kUint2,
  kUint4,
  kFloat4E2m1fn,
  kFloat6E2m3fn,
  kFloat6E3m2fn,
  kFloat8E3m4,
  kFloat8E4m3,
  kFloat8E4m3b11fnuz,
  kFloat8E4m3fnuz,
  kFloat8E5m2fnuz,
  kFloat8E8m0fnu,
};

inline constexpr int kNumDTypes = 30;

enum class DTypeKind : uint8_t { kBool, kSignedInt, kUnsignedInt, kFloat, kComplex };

// Size of one element in bytes (bool is 1 byte, as in NumPy). The sub-byte types (int2, int4,
// float4_e2m1fn, float6_*) take one byte per element, as NumPy and ml_dtypes hold them in memory:
// the value in the low BitWidth bits.
size_t ItemSize(DType dtype);
// Bits that carry the value: 8 * ItemSize, except 2 (int2, uint2), 4 (int4, uint4,
// float4_e2m1fn) and 6 (float6_e2m3fn, float6_e3m2fn).
int BitWidth(DType dtype);
DTypeKind Kind(DType dtype);

// The NumPy / ml_dtypes name: "bool", "int8", ..., "bfloat16", "float8_e4m3fn", "complex64",
// "int4", "float4_e2m1fn", "float8_e8m0fnu".
std::string_view DTypeName(DType dtype);

// Parses a name produced by DTypeName. Unknown names -> InvalidArgument quoting the name.
Result<DType> ParseDType(std::string_view name);

// All dtypes, in enum order (for tests and tables).
const DType* AllDTypes();

}  // namespace tensorstash

#endif  // TENSORSTASH_ARRAY_DTYPE_H_
