#include "tensorstash/array/dtype.h"

#include <array>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"

namespace tensorstash {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t item_size;
  DTypeKind kind;
  int bit_width;
};

// Indexed by the enum value; the static_assert below keeps it in step with the enum.
constexpr std::array<DTypeInfo, kNumDTypes> kInfos = {{
    {DType::kBool, "bool", 1, DTypeKind::kBool, 8},
    {DType::kInt8, "int8", 1, DTypeKind::kSignedInt, 8},
    {DType::kInt16, "int16", 2, DTypeKind::kSignedInt, 16},
    {DType::kInt32, "int32", 4, DTypeKind::kSignedInt, 32},
    {DType::kInt64, "int64", 8, DTypeKind::kSignedInt, 64},
    {DType::kUint8, "uint8", 1, DTypeKind::kUnsignedInt, 8},
    {DType::kUint16, "uint16", 2, DTypeKind::kUnsignedInt, 16},
    {DType::kUint32, "uint32", 4, DTypeKind::kUnsignedInt, 32},
    {DType::kUint64, "uint64", 8, DTypeKind::kUnsignedInt, 64},
    {DType::kFloat16, "float16", 2, DTypeKind::kFloat, 16},
    {DType::kBfloat16, "bfloat16", 2, DTypeKind::kFloat, 16},
    {DType::kFloat32, "float32", 4, DTypeKind::kFloat, 32},
    {DType::kFloat64, "float64", 8, DTypeKind::kFloat, 64},
    {DType::kComplex64, "complex64", 8, DTypeKind::kComplex, 64},
    {DType::kComplex128, "complex128", 16, DTypeKind::kComplex, 128},
    {DType::kFloat8E4m3fn, "float8_e4m3fn", 1, DTypeKind::kFloat, 8},
    {DType::kFloat8E5m2, "float8_e5m2", 1, DTypeKind::kFloat, 8},
    {DType::kInt2, "int2", 1, DTypeKind::kSignedInt, 2},
    {DType::kInt4, "int4", 1, DTypeKind::kSignedInt, 4},
    {DType::kUint2, "uint2", 1, DTypeKind::kUnsignedInt, 2},
    {DType::kUint4, "uint4", 1, DTypeKind::kUnsignedInt, 4},
    {DType::kFloat4E2m1fn, "float4_e2m1fn", 1, DTypeKind::kFloat, 4},
    {DType::kFloat6E2m3fn, "float6_e2m3fn", 1, DTypeKind::kFloat, 6},
    {DType::kFloat6E3m2fn, "float6_e3m2fn", 1, DTypeKind::kFloat, 6},
    {DType::kFloat8E3m4, "float8_e3m4", 1, DTypeKind::kFloat, 8},
    {DType::kFloat8E4m3, "float8_e4m3", 1, DTypeKind::kFloat, 8},
    {DType::kFloat8E4m3b11fnuz, "float8_e4m3b11fnuz", 1, DTypeKind::kFloat, 8},
    {DType::kFloat8E4m3fnuz, "float8_e4m3fnuz", 1, DTypeKind::kFloat, 8},
    {DType::kFloat8E5m2fnuz, "float8_e5m2fnuz", 1, DTypeKind::kFloat, 8},
    {DType::kFloat8E8m0fnu, "float8_e8m0fnu", 1, DTypeKind::kFloat, 8},
}};

constexpr bool InfosMatchEnum() {
  for (int i = 0; i < kNumDTypes; ++i) {
    if (static_cast<int>(kInfos[i].dtype) != i) return false;
  }
  return true;
}
static_assert(InfosMatchEnum(), "kInfos must list the dtypes in enum order");

constexpr std::array<DType, kNumDTypes> MakeAll() {
  std::array<DType, kNumDTypes> all{};
  for (int i = 0; i < kNumDTypes; ++i) all[i] = kInfos[i].dtype;
  return all;
}
constexpr std::array<DType, kNumDTypes> kAll = MakeAll();

// A DType cast from a corrupt byte may lie outside the enum; callers get neutral answers
// instead of reading past the table.
const DTypeInfo* Find(DType dtype) {
  const auto index = static_cast<size_t>(dtype);
  return index < kInfos.size() ? &kInfos[index] : nullptr;
}

}  // namespace

size_t ItemSize(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  return info ? info->item_size : 0;
}

int BitWidth(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  return info ? info->bit_width : 0;
}

DTypeKind Kind(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  return info ? info->kind : DTypeKind::kBool;
}

std::string_view DTypeName(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  return info ? info->name : std::string_view("<invalid dtype>");
}

Result<DType> ParseDType(std::string_view name) {
  for (const DTypeInfo& info : kInfos) {
    if (info.name == name) return info.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype \"", std::string(name), "\""));
}

const DType* AllDTypes() { return kAll.data(); }

}  // namespace tensorstash
