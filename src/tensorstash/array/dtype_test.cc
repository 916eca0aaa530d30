#include "tensorstash/array/dtype.h"

#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tensorstash {
namespace {

TEST(DTypeTest, NamesMatchNumpyAndRoundTrip) {
  const std::vector<std::string> expected = {
      "bool",    "int8",      "int16",      "int32",         "int64",      "uint8",
      "uint16",  "uint32",    "uint64",     "float16",       "bfloat16",   "float32",
      "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
      "int2",    "int4",      "uint2",      "uint4",         "float4_e2m1fn", "float6_e2m3fn",
      "float6_e3m2fn", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fnuz",
      "float8_e5m2fnuz", "float8_e8m0fnu"};
  ASSERT_EQ(expected.size(), static_cast<size_t>(kNumDTypes));
  for (int i = 0; i < kNumDTypes; ++i) {
    const DType dtype = AllDTypes()[i];
    EXPECT_EQ(static_cast<int>(dtype), i) << "AllDTypes must be in enum order";
    EXPECT_EQ(DTypeName(dtype), expected[i]);
    Result<DType> parsed = ParseDType(expected[i]);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, dtype);
  }
}

TEST(DTypeTest, ParseRejectsUnknownNamesQuotingThem) {
  for (const std::string name : {"", "float", "Float32", "float32 ", "f4", "<f4", "bfloat",
                                 "float8_e4m3b11", "int1", "uint1", "int3", "float6", "float4_e2m1",
                                 "complex", "int128", "bool_"}) {
    Result<DType> parsed = ParseDType(name);
    ASSERT_FALSE(parsed.ok()) << name;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(parsed.status().message()).find("\"" + name + "\""), std::string::npos)
        << parsed.status();
  }
}

TEST(DTypeTest, ItemSizes) {
  EXPECT_EQ(ItemSize(DType::kBool), 1u);
  EXPECT_EQ(ItemSize(DType::kInt8), 1u);
  EXPECT_EQ(ItemSize(DType::kUint8), 1u);
  EXPECT_EQ(ItemSize(DType::kInt16), 2u);
  EXPECT_EQ(ItemSize(DType::kUint16), 2u);
  EXPECT_EQ(ItemSize(DType::kInt32), 4u);
  EXPECT_EQ(ItemSize(DType::kUint32), 4u);
  EXPECT_EQ(ItemSize(DType::kInt64), 8u);
  EXPECT_EQ(ItemSize(DType::kUint64), 8u);
  EXPECT_EQ(ItemSize(DType::kFloat16), 2u);
  EXPECT_EQ(ItemSize(DType::kBfloat16), 2u);
  EXPECT_EQ(ItemSize(DType::kFloat32), 4u);
  EXPECT_EQ(ItemSize(DType::kFloat64), 8u);
  EXPECT_EQ(ItemSize(DType::kComplex64), 8u);
  EXPECT_EQ(ItemSize(DType::kComplex128), 16u);
  EXPECT_EQ(ItemSize(DType::kFloat8E4m3fn), 1u);
  EXPECT_EQ(ItemSize(DType::kFloat8E5m2), 1u);
  // The new types, sub-byte ones included, take one byte per element, as NumPy holds them.
  for (int i = static_cast<int>(DType::kInt2); i < kNumDTypes; ++i) {
    EXPECT_EQ(ItemSize(AllDTypes()[i]), 1u) << DTypeName(AllDTypes()[i]);
  }
}

TEST(DTypeTest, BitWidths) {
  for (int i = 0; i < kNumDTypes; ++i) {
    const DType d = AllDTypes()[i];
    const std::string name(DTypeName(d));
    const int expected = name == "int2" || name == "uint2"                            ? 2
                         : name == "int4" || name == "uint4" || name == "float4_e2m1fn" ? 4
                         : name.rfind("float6_", 0) == 0                                ? 6
                                                          : static_cast<int>(8 * ItemSize(d));
    EXPECT_EQ(BitWidth(d), expected) << name;
  }
  EXPECT_EQ(BitWidth(static_cast<DType>(200)), 0);
}

TEST(DTypeTest, EnumValuesAreStable) {
  // New dtypes are appended: the earlier ones keep their codes.
  EXPECT_EQ(static_cast<int>(DType::kFloat8E5m2), 16);
  EXPECT_EQ(static_cast<int>(DType::kInt2), 17);
  EXPECT_EQ(static_cast<int>(DType::kFloat8E8m0fnu), 29);
}

TEST(DTypeTest, Kinds) {
  EXPECT_EQ(Kind(DType::kBool), DTypeKind::kBool);
  for (DType d : {DType::kInt8, DType::kInt16, DType::kInt32, DType::kInt64}) {
    EXPECT_EQ(Kind(d), DTypeKind::kSignedInt) << DTypeName(d);
  }
  for (DType d : {DType::kUint8, DType::kUint16, DType::kUint32, DType::kUint64}) {
    EXPECT_EQ(Kind(d), DTypeKind::kUnsignedInt) << DTypeName(d);
  }
  for (DType d : {DType::kFloat16, DType::kBfloat16, DType::kFloat32, DType::kFloat64,
                  DType::kFloat8E4m3fn, DType::kFloat8E5m2, DType::kFloat4E2m1fn,
                  DType::kFloat6E2m3fn, DType::kFloat6E3m2fn, DType::kFloat8E3m4,
                  DType::kFloat8E4m3, DType::kFloat8E4m3b11fnuz, DType::kFloat8E4m3fnuz,
                  DType::kFloat8E5m2fnuz, DType::kFloat8E8m0fnu}) {
    EXPECT_EQ(Kind(d), DTypeKind::kFloat) << DTypeName(d);
  }
  EXPECT_EQ(Kind(DType::kInt2), DTypeKind::kSignedInt);
  EXPECT_EQ(Kind(DType::kInt4), DTypeKind::kSignedInt);
  EXPECT_EQ(Kind(DType::kUint2), DTypeKind::kUnsignedInt);
  EXPECT_EQ(Kind(DType::kUint4), DTypeKind::kUnsignedInt);
  EXPECT_EQ(Kind(DType::kComplex64), DTypeKind::kComplex);
  EXPECT_EQ(Kind(DType::kComplex128), DTypeKind::kComplex);
}

TEST(DTypeTest, NamesAreDistinct) {
  std::set<std::string> names;
  for (int i = 0; i < kNumDTypes; ++i) names.insert(std::string(DTypeName(AllDTypes()[i])));
  EXPECT_EQ(names.size(), static_cast<size_t>(kNumDTypes));
}

TEST(DTypeTest, OutOfRangeCodeIsHarmless) {
  const auto bogus = static_cast<DType>(200);
  EXPECT_EQ(ItemSize(bogus), 0u);
  EXPECT_FALSE(ParseDType(DTypeName(bogus)).ok());
}

}  // namespace
}  // namespace tensorstash
