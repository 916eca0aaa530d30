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
};

// Indexed by the enum value; the static_assert below keeps it in step with the enum.
constexpr std::array<DTypeInfo, kNumDTypes> kInfos = {{
    {DType::kBool, "bool", 1, DTypeKind::kBool},
    {DType::kInt8, "int8", 1, DTypeKind::kSignedInt},
    {DType::kInt16, "int16", 2, DTypeKind::kSignedInt},
    {DType::kInt32, "int32", 4, DTypeKind::kSignedInt},
    {DType::kInt64, "int64", 8, DTypeKind::kSignedInt},
    {DType::kUint8, "uint8", 1, DTypeKind::kUnsignedInt},
    {DType::kUint16, "uint16", 2, DTypeKind::kUnsignedInt},
    {DType::kUint32, "uint32", 4, DTypeKind::kUnsignedInt},
    {DType::kUint64, "uint64", 8, DTypeKind::kUnsignedInt},
    {DType::kFloat16, "float16", 2, DTypeKind::kFloat},
    {DType::kBfloat16, "bfloat16", 2, DTypeKind::kFloat},
    {DType::kFloat32, "float32", 4, DTypeKind::kFloat},
    {DType::kFloat64, "float64", 8, DTypeKind::kFloat},
    {DType::kComplex64, "complex64", 8, DTypeKind::kComplex},
    {DType::kComplex128, "complex128", 16, DTypeKind::kComplex},
    {DType::kFloat8E4m3fn, "float8_e4m3fn", 1, DTypeKind::kFloat},
    {DType::kFloat8E5m2, "float8_e5m2", 1, DTypeKind::kFloat},
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
