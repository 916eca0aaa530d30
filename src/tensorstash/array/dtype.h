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
};

inline constexpr int kNumDTypes = 17;

enum class DTypeKind : uint8_t { kBool, kSignedInt, kUnsignedInt, kFloat, kComplex };

// Size of one element in bytes (bool is 1 byte, as in NumPy).
size_t ItemSize(DType dtype);
DTypeKind Kind(DType dtype);

// The NumPy / ml_dtypes name: "bool", "int8", ..., "bfloat16", "float8_e4m3fn", "complex64".
std::string_view DTypeName(DType dtype);

// Parses a name produced by DTypeName. Unknown names -> InvalidArgument quoting the name.
Result<DType> ParseDType(std::string_view name);

// All dtypes, in enum order (for tests and tables).
const DType* AllDTypes();

}  // namespace tensorstash

#endif  // TENSORSTASH_ARRAY_DTYPE_H_
