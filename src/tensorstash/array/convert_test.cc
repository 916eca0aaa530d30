#include "tensorstash/array/convert.h"

#include <bit>
#include <complex>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "tensorstash/array/dtype.h"

// Expected bits come from numpy 2.4 / ml_dtypes 0.6 (`np.asarray(x, src).astype(dst)`);
// tests/crosscheck/dtype_conversion.py checks the same thing exhaustively.

namespace tensorstash {
namespace {

template <typename Out, typename In>
Result<std::vector<Out>> Convert(DType from, const std::vector<In>& in, DType to) {
  EXPECT_EQ(sizeof(In), ItemSize(from));
  EXPECT_EQ(sizeof(Out), ItemSize(to));
  std::vector<Out> out(in.size());
  TS_RETURN_IF_ERROR(ConvertElements(from, in.data(), to, out.data(), in.size(), "test/array"));
  return out;
}

// Converts and returns the result, failing the test on error.
template <typename Out, typename In>
std::vector<Out> MustConvert(DType from, const std::vector<In>& in, DType to) {
  Result<std::vector<Out>> out = Convert<Out>(from, in, to);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *std::move(out) : std::vector<Out>(in.size());
}

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
float F32(uint32_t bits) { return std::bit_cast<float>(bits); }
double F64(uint64_t bits) { return std::bit_cast<double>(bits); }

constexpr float kInfF = std::numeric_limits<float>::infinity();

TEST(ConvertTest, SameDTypeIsAPlainCopy) {
  // A signalling NaN payload survives untouched.
  const std::vector<uint32_t> in = {0x7f800001, 0x3eaaaaab, 0x80000000};
  EXPECT_EQ(MustConvert<uint32_t>(DType::kFloat32, in, DType::kFloat32), in);
  const std::vector<uint8_t> bools = {0, 1, 2};
  EXPECT_EQ(MustConvert<uint8_t>(DType::kBool, bools, DType::kBool), bools);
}

TEST(ConvertTest, Float32ToBfloat16) {
  const std::vector<float> in = {
      1.0f / 3,        -1.0f / 3,       std::numeric_limits<float>::max(),
      F32(0x7f7f0000), F32(0x7f7f7fff), F32(0x7f7f8000),
      F32(0x3f808000),                                    // tie: stays even
      F32(0x3f818000),                                    // tie: rounds up to even
      F32(0x00008000), F32(0x00018000), F32(0x00000001),  // subnormals
      -0.0f,           kInfF,           -kInfF};
  const std::vector<uint16_t> expected = {0x3eab, 0xbeab, 0x7f80, 0x7f7f, 0x7f7f, 0x7f80, 0x3f80,
                                          0x3f82, 0x0000, 0x0002, 0x0000, 0x8000, 0x7f80, 0xff80};
  EXPECT_EQ(MustConvert<uint16_t>(DType::kFloat32, in, DType::kBfloat16), expected);
}

TEST(ConvertTest, NaNsBecomeTheCanonicalNaNOfMlDtypesTargets) {
  const std::vector<float> in = {F32(0x7f800001), F32(0xffc00001), F32(0x7fa00000)};
  EXPECT_EQ(MustConvert<uint16_t>(DType::kFloat32, in, DType::kBfloat16),
            (std::vector<uint16_t>{0x7fc0, 0xffc0, 0x7fc0}));
  EXPECT_EQ(MustConvert<uint8_t>(DType::kFloat32, in, DType::kFloat8E4m3fn),
            (std::vector<uint8_t>{0x7f, 0xff, 0x7f}));
  EXPECT_EQ(MustConvert<uint8_t>(DType::kFloat32, in, DType::kFloat8E5m2),
            (std::vector<uint8_t>{0x7e, 0xfe, 0x7e}));
  // bfloat16 -> float16 is ml_dtypes' own cast: canonical too.
  EXPECT_EQ(MustConvert<uint16_t>(DType::kBfloat16, std::vector<uint16_t>{0x7f81}, DType::kFloat16),
            std::vector<uint16_t>{0x7e00});
}

TEST(ConvertTest, Float16NaNPayloadsFollowNumpy) {
  // NumPy keeps payload bits (without quieting) and never lets them truncate to an inf.
  EXPECT_EQ(MustConvert<uint32_t>(DType::kFloat16, std::vector<uint16_t>{0x7c01, 0xfe00},
                                  DType::kFloat32),
            (std::vector<uint32_t>{0x7f802000, 0xffc00000}));
  EXPECT_EQ(MustConvert<uint64_t>(DType::kFloat16, std::vector<uint16_t>{0x7c01}, DType::kFloat64),
            std::vector<uint64_t>{0x7ff0040000000000});
  EXPECT_EQ(
      MustConvert<uint16_t>(DType::kFloat32, std::vector<float>{F32(0x7f800001)}, DType::kFloat16),
      std::vector<uint16_t>{0x7c01});
  EXPECT_EQ(MustConvert<uint16_t>(DType::kFloat64, std::vector<double>{F64(0x7ff0000000000001)},
                                  DType::kFloat16),
            std::vector<uint16_t>{0x7c01});
}

TEST(ConvertTest, Float16KnownValues) {
  const std::vector<float> in = {65504,      65519, 65520,    0x1p-24f, 0x1p-25f,
                                 0x1.8p-25f, -0.0f, 0x1p-14f, 1e-10f,   1.0f / 3};
  const std::vector<uint16_t> expected = {0x7bff, 0x7bff, 0x7c00, 0x0001, 0x0000,
                                          0x0001, 0x8000, 0x0400, 0x0000, 0x3555};
  EXPECT_EQ(MustConvert<uint16_t>(DType::kFloat32, in, DType::kFloat16), expected);
}

TEST(ConvertTest, Float8E4m3fnHasNoInfinity) {
  const std::vector<float> in = {448,      464,        465,  kInfF, -kInfF,  0x1p-9f,
                                 0x1p-10f, 0x1.8p-10f, -500, 240,   0x1p-6f, 1.0f / 3};
  // 464 is the tie between 448 and the (missing) 480: it rounds to the even 448; above is NaN.
  const std::vector<uint8_t> expected = {0x7e, 0x7e, 0x7f, 0x7f, 0xff, 0x01,
                                         0x00, 0x01, 0xff, 0x77, 0x08, 0x2b};
  EXPECT_EQ(MustConvert<uint8_t>(DType::kFloat32, in, DType::kFloat8E4m3fn), expected);
}

TEST(ConvertTest, Float8E5m2) {
  const std::vector<float> in = {57344,    61439,    61440,    kInfF,   -kInfF,
                                 0x1p-16f, 0x1p-17f, 0x1p-14f, 1.0f / 3};
  const std::vector<uint8_t> expected = {0x7b, 0x7b, 0x7c, 0x7c, 0xfc, 0x01, 0x00, 0x04, 0x35};
  EXPECT_EQ(MustConvert<uint8_t>(DType::kFloat32, in, DType::kFloat8E5m2), expected);
}

TEST(ConvertTest, Float64RoundingPathsMatchMlDtypes) {
  // Just above a tie, by less than half a float32 ulp: rounding once goes up, rounding via
  // float32 first lands on the tie and then goes to even.
  const double bf16_case = 1 + 0x1p-8 + 0x1p-30;
  const double f16_case = 1 + 0x1p-11 + 0x1p-30;
  const double f8_case = 1 + 0x1p-4 + 0x1p-30;
  // ml_dtypes: via float32.
  EXPECT_EQ(
      MustConvert<uint16_t>(DType::kFloat64, std::vector<double>{bf16_case}, DType::kBfloat16),
      std::vector<uint16_t>{0x3f80});
  EXPECT_EQ(
      MustConvert<uint8_t>(DType::kFloat64, std::vector<double>{f8_case}, DType::kFloat8E4m3fn),
      std::vector<uint8_t>{0x38});
  // NumPy's float16: directly.
  EXPECT_EQ(MustConvert<uint16_t>(DType::kFloat64, std::vector<double>{f16_case}, DType::kFloat16),
            std::vector<uint16_t>{0x3c01});
  EXPECT_EQ(MustConvert<uint16_t>(DType::kFloat64, std::vector<double>{1.0 / 3}, DType::kBfloat16),
            std::vector<uint16_t>{0x3eab});
}

TEST(ConvertTest, WideningIsExact) {
  // Every float16 / bfloat16 / float8 value survives a trip through float32 (NaNs included for
  // the NumPy-style float16; ml_dtypes types come back as their canonical NaN).
  std::vector<uint16_t> all16(1 << 16);
  for (size_t i = 0; i < all16.size(); ++i) all16[i] = static_cast<uint16_t>(i);
  EXPECT_EQ(MustConvert<uint16_t>(DType::kFloat32,
                                  MustConvert<float>(DType::kFloat16, all16, DType::kFloat32),
                                  DType::kFloat16),
            all16);
  const std::vector<uint16_t> bf16_back = MustConvert<uint16_t>(
      DType::kFloat32, MustConvert<float>(DType::kBfloat16, all16, DType::kFloat32),
      DType::kBfloat16);
  for (size_t i = 0; i < all16.size(); ++i) {
    const bool is_nan = (i & 0x7fff) > 0x7f80;
    EXPECT_EQ(bf16_back[i], is_nan ? (i & 0x8000) | 0x7fc0 : i) << std::hex << i;
  }
  std::vector<uint8_t> all8(256);
  for (size_t i = 0; i < all8.size(); ++i) all8[i] = static_cast<uint8_t>(i);
  for (DType f8 : {DType::kFloat8E4m3fn, DType::kFloat8E5m2}) {
    const std::vector<double> wide = MustConvert<double>(f8, all8, DType::kFloat64);
    const std::vector<uint8_t> back = MustConvert<uint8_t>(DType::kFloat64, wide, f8);
    const unsigned canonical_nan = f8 == DType::kFloat8E4m3fn ? 0x7f : 0x7e;
    for (size_t i = 0; i < all8.size(); ++i) {
      const bool is_nan = wide[i] != wide[i];
      EXPECT_EQ(back[i], is_nan ? (i & 0x80) | canonical_nan : i) << DTypeName(f8) << " " << i;
    }
  }
  EXPECT_EQ(MustConvert<double>(DType::kFloat8E4m3fn, std::vector<uint8_t>{0x7e, 0x01, 0x80},
                                DType::kFloat64),
            (std::vector<double>{448, 0x1p-9, -0.0}));
}

TEST(ConvertTest, IntegersToFloats) {
  // int64 -> bfloat16 goes through float32: this value is just above a bfloat16 tie, but the
  // float32 step drops the +1 and the tie then goes to even.
  const int64_t near_tie = (int64_t{1} << 62) + (int64_t{1} << 54) + 1;
  EXPECT_EQ(MustConvert<uint16_t>(
                DType::kInt64,
                std::vector<int64_t>{near_tie, -near_tie, std::numeric_limits<int64_t>::max()},
                DType::kBfloat16),
            (std::vector<uint16_t>{0x5e80, 0xde80, 0x5f00}));
  EXPECT_EQ(MustConvert<float>(DType::kInt32, std::vector<int32_t>{16777217, -3}, DType::kFloat32),
            (std::vector<float>{16777216.0f, -3.0f}));
  EXPECT_EQ(Bits(MustConvert<float>(DType::kUint64,
                                    std::vector<uint64_t>{std::numeric_limits<uint64_t>::max()},
                                    DType::kFloat32)[0]),
            0x5f800000u);
  EXPECT_EQ(
      MustConvert<double>(DType::kInt64, std::vector<int64_t>{std::numeric_limits<int64_t>::min()},
                          DType::kFloat64),
      std::vector<double>{-0x1p63});
  EXPECT_EQ(MustConvert<uint16_t>(DType::kInt32, std::vector<int32_t>{65519, 65520, -70000},
                                  DType::kFloat16),
            (std::vector<uint16_t>{0x7bff, 0x7c00, 0xfc00}));
  EXPECT_EQ(MustConvert<uint8_t>(DType::kInt16, std::vector<int16_t>{464, 465, -1000},
                                 DType::kFloat8E4m3fn),
            (std::vector<uint8_t>{0x7e, 0x7f, 0xff}));
  // Any nonzero bool byte is true.
  EXPECT_EQ(MustConvert<uint8_t>(DType::kBool, std::vector<uint8_t>{0, 1, 2}, DType::kFloat8E4m3fn),
            (std::vector<uint8_t>{0x00, 0x38, 0x38}));
}

TEST(ConvertTest, IntegersToIntegersInRange) {
  EXPECT_EQ(MustConvert<int8_t>(DType::kInt64, std::vector<int64_t>{-128, 127, 0}, DType::kInt8),
            (std::vector<int8_t>{-128, 127, 0}));
  EXPECT_EQ(MustConvert<uint64_t>(DType::kInt8, std::vector<int8_t>{0, 127}, DType::kUint64),
            (std::vector<uint64_t>{0, 127}));
  EXPECT_EQ(MustConvert<int64_t>(DType::kUint32, std::vector<uint32_t>{0xffffffff}, DType::kInt64),
            std::vector<int64_t>{0xffffffff});
  EXPECT_EQ(MustConvert<uint8_t>(DType::kInt32, std::vector<int32_t>{0, -5, 1 << 20}, DType::kBool),
            (std::vector<uint8_t>{0, 1, 1}));
  EXPECT_EQ(MustConvert<int32_t>(DType::kBool, std::vector<uint8_t>{0, 1, 7}, DType::kInt32),
            (std::vector<int32_t>{0, 1, 1}));
}

void ExpectRangeError(const Status& status, const std::vector<std::string>& needles) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  const std::string message(status.message());
  for (const std::string& needle : needles) {
    EXPECT_NE(message.find(needle), std::string::npos) << message << " lacks " << needle;
  }
}

TEST(ConvertTest, IntegerOutOfRangeNamesArrayValueAndDTypes) {
  ExpectRangeError(
      Convert<int8_t>(DType::kInt16, std::vector<int16_t>{5, 300, 7}, DType::kInt8).status(),
      {"test/array", "element 1", "300", "int8", "int16"});
  ExpectRangeError(
      Convert<uint32_t>(DType::kInt8, std::vector<int8_t>{-1}, DType::kUint32).status(),
      {"test/array", "-1", "uint32", "int8"});
  ExpectRangeError(
      Convert<int64_t>(DType::kUint64, std::vector<uint64_t>{std::numeric_limits<uint64_t>::max()},
                       DType::kInt64)
          .status(),
      {"18446744073709551615", "int64", "uint64"});
  ExpectRangeError(
      Convert<uint8_t>(DType::kInt64, std::vector<int64_t>{std::numeric_limits<int64_t>::min()},
                       DType::kUint8)
          .status(),
      {"-9223372036854775808", "uint8", "int64"});
}

TEST(ConvertTest, UnsupportedConversionsAreUnimplemented) {
  const std::vector<std::pair<DType, DType>> pairs = {
      {DType::kFloat32, DType::kInt32},     {DType::kFloat16, DType::kBool},
      {DType::kComplex64, DType::kFloat32}, {DType::kFloat64, DType::kComplex128},
      {DType::kInt32, DType::kComplex64},   {DType::kComplex128, DType::kUint8}};
  for (const auto& [from, to] : pairs) {
    EXPECT_FALSE(CanConvert(from, to));
    unsigned char src[16] = {};
    unsigned char dst[16] = {};
    const Status status = ConvertElements(from, src, to, dst, 1, "some/array");
    EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << status;
    const std::string message(status.message());
    EXPECT_NE(message.find(DTypeName(from)), std::string::npos) << message;
    EXPECT_NE(message.find(DTypeName(to)), std::string::npos) << message;
    EXPECT_NE(message.find("some/array"), std::string::npos) << message;
  }
}

TEST(ConvertTest, CanConvertAgreesWithConvertElements) {
  for (int i = 0; i < kNumDTypes; ++i) {
    for (int j = 0; j < kNumDTypes; ++j) {
      const DType from = AllDTypes()[i];
      const DType to = AllDTypes()[j];
      unsigned char src[16] = {};  // zero converts without range errors everywhere
      unsigned char dst[16] = {};
      const Status status = ConvertElements(from, src, to, dst, 1, "x");
      EXPECT_EQ(status.ok(), CanConvert(from, to))
          << DTypeName(from) << " -> " << DTypeName(to) << ": " << status;
      const bool expected = from == to ||
                            (Kind(from) != DTypeKind::kComplex && Kind(to) == DTypeKind::kFloat) ||
                            (Kind(from) != DTypeKind::kComplex && Kind(from) != DTypeKind::kFloat &&
                             Kind(to) != DTypeKind::kComplex && Kind(to) != DTypeKind::kFloat) ||
                            (Kind(from) == DTypeKind::kComplex && Kind(to) == DTypeKind::kComplex);
      EXPECT_EQ(CanConvert(from, to), expected) << DTypeName(from) << " -> " << DTypeName(to);
    }
  }
}

TEST(ConvertTest, ComplexPrecision) {
  const std::vector<std::complex<double>> in = {{1.0 / 3, -2.5}, {1e300, 1e-300}};
  const std::vector<std::complex<float>> narrow =
      MustConvert<std::complex<float>>(DType::kComplex128, in, DType::kComplex64);
  EXPECT_EQ(narrow[0], std::complex<float>(1.0f / 3, -2.5f));
  EXPECT_EQ(narrow[1], std::complex<float>(kInfF, 0.0f));
  EXPECT_EQ(MustConvert<std::complex<double>>(DType::kComplex64, narrow, DType::kComplex128)[0],
            std::complex<double>(static_cast<double>(1.0f / 3), -2.5));
}

TEST(ConvertTest, UnalignedBuffersAndEmptyInput) {
  alignas(8) unsigned char src[1 + 3 * sizeof(double)];
  alignas(8) unsigned char dst[1 + 3 * sizeof(float)];
  const double values[3] = {1.5, -0.25, 1e10};
  std::memcpy(src + 1, values, sizeof(values));
  ASSERT_TRUE(ConvertElements(DType::kFloat64, src + 1, DType::kFloat32, dst + 1, 3, "x").ok());
  float out[3];
  std::memcpy(out, dst + 1, sizeof(out));
  EXPECT_EQ(out[0], 1.5f);
  EXPECT_EQ(out[1], -0.25f);
  EXPECT_EQ(out[2], 1e10f);
  EXPECT_TRUE(ConvertElements(DType::kInt64, nullptr, DType::kInt8, nullptr, 0, "x").ok());
  EXPECT_TRUE(ConvertElements(DType::kInt64, nullptr, DType::kInt64, nullptr, 0, "x").ok());
}


// ---- the narrower ml_dtypes types (expected bits from ml_dtypes 0.6 `astype`) ----

TEST(ConvertTest, SubByteIntegersReadTheirLowBits) {
  const std::vector<uint8_t> bytes = {0x0f, 0x08, 0x07, 0xff, 0x8f, 0x70};
  EXPECT_EQ(MustConvert<int8_t>(DType::kInt4, bytes, DType::kInt8),
            (std::vector<int8_t>{-1, -8, 7, -1, -1, 0}));
  EXPECT_EQ(MustConvert<uint8_t>(DType::kUint4, bytes, DType::kUint8),
            (std::vector<uint8_t>{15, 8, 7, 15, 15, 0}));
  EXPECT_EQ(MustConvert<int16_t>(DType::kInt2, bytes, DType::kInt16),
            (std::vector<int16_t>{-1, 0, -1, -1, -1, 0}));
  EXPECT_EQ(MustConvert<uint8_t>(DType::kUint2, bytes, DType::kUint8),
            (std::vector<uint8_t>{3, 0, 3, 3, 3, 0}));
  EXPECT_EQ(MustConvert<float>(DType::kInt4, bytes, DType::kFloat32),
            (std::vector<float>{-1, -8, 7, -1, -1, 0}));
  // Same dtype: the bytes as stored, high bits included.
  EXPECT_EQ(MustConvert<uint8_t>(DType::kInt4, bytes, DType::kInt4), bytes);
}

TEST(ConvertTest, IntoSubByteIntegersWritesLowBitsAndChecksRange) {
  EXPECT_EQ(MustConvert<uint8_t>(DType::kInt8, std::vector<int8_t>{-8, -1, 7, 0}, DType::kInt4),
            (std::vector<uint8_t>{0x08, 0x0f, 0x07, 0x00}));
  EXPECT_EQ(MustConvert<uint8_t>(DType::kInt64, std::vector<int64_t>{-2, 1}, DType::kInt2),
            (std::vector<uint8_t>{0x02, 0x01}));
  EXPECT_EQ(MustConvert<uint8_t>(DType::kUint4, std::vector<uint8_t>{0xf3, 0x02}, DType::kUint2),
            (std::vector<uint8_t>{0x03, 0x02}));
}

TEST(ConvertTest, SubByteOutOfRangeIsAnErrorNamingTheValue) {
  for (const auto& [from, value, to] :
       std::vector<std::tuple<DType, int8_t, DType>>{{DType::kInt8, 8, DType::kInt4},
                                                     {DType::kInt8, -9, DType::kInt4},
                                                     {DType::kInt8, 2, DType::kInt2},
                                                     {DType::kInt8, 16, DType::kUint4},
                                                     {DType::kInt8, -1, DType::kUint2}}) {
    Result<std::vector<uint8_t>> out = Convert<uint8_t>(from, std::vector<int8_t>{0, value}, to);
    ASSERT_FALSE(out.ok()) << DTypeName(to) << " " << int{value};
    EXPECT_TRUE(absl::IsInvalidArgument(out.status()));
    const std::string message(out.status().message());
    EXPECT_NE(message.find("value " + std::to_string(value)), std::string::npos) << message;
    EXPECT_NE(message.find(std::string(DTypeName(to))), std::string::npos) << message;
    EXPECT_NE(message.find("test/array"), std::string::npos) << message;
  }
  // int4 -1 into uint4 does not fit either (the low bits alone would read 15).
  EXPECT_FALSE(Convert<uint8_t>(DType::kInt4, std::vector<uint8_t>{0x0f}, DType::kUint4).ok());
}

TEST(ConvertTest, NarrowFloatsDecode) {
  struct Case {
    DType dtype;
    std::vector<uint8_t> codes;
    std::vector<uint32_t> float32_bits;
  };
  const std::vector<Case> cases = {
      {DType::kFloat8E4m3fnuz,
       {0x40, 0x48, 0x80, 0x00, 0x01},
       {0x3f800000, 0x40000000, 0xffc00000, 0, 0x3a800000}},
      {DType::kFloat8E5m2fnuz, {0x40, 0x44, 0x80}, {0x3f800000, 0x40000000, 0xffc00000}},
      {DType::kFloat8E4m3b11fnuz, {0x58, 0x80}, {0x3f800000, 0xffc00000}},
      {DType::kFloat8E3m4,
       {0x30, 0x70, 0xf0, 0x71},
       {0x3f800000, 0x7f800000, 0xff800000, 0x7fc00000}},
      {DType::kFloat8E4m3, {0x38, 0x78, 0x7c}, {0x3f800000, 0x7f800000, 0x7fc00000}},
      {DType::kFloat8E8m0fnu,
       {0x7f, 0x80, 0x00, 0xff},
       {0x3f800000, 0x40000000, 0x00400000, 0x7fc00000}},
      // float4/float6: any bit from the sign bit up reads as negative, as in ml_dtypes.
      {DType::kFloat4E2m1fn,
       {0x02, 0x07, 0x0f, 0xff, 0x20},
       {0x3f800000, 0x40c00000, 0xc0c00000, 0xc0c00000, 0x80000000}},
      {DType::kFloat6E2m3fn, {0x08, 0x1f, 0x40}, {0x3f800000, 0x40f00000, 0x80000000}},
      {DType::kFloat6E3m2fn, {0x0c, 0x1f}, {0x3f800000, 0x41e00000}},
  };
  for (const Case& c : cases) {
    const std::vector<float> got = MustConvert<float>(c.dtype, c.codes, DType::kFloat32);
    for (size_t i = 0; i < c.codes.size(); ++i) {
      EXPECT_EQ(Bits(got[i]), c.float32_bits[i])
          << DTypeName(c.dtype) << " code 0x" << std::hex << int{c.codes[i]};
    }
  }
}

TEST(ConvertTest, NarrowFloatsEncodeAsMlDtypes) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    DType dtype;
    std::vector<float> in;
    std::vector<uint8_t> expected;
  };
  const std::vector<Case> cases = {
      // Saturating formats: overflow and inf give the largest value; NaN a zero of the other sign.
      {DType::kFloat4E2m1fn,
       {1e9f, kInfF, nan, -nan, -0.0f, 2.5f, 5.0f},
       {7, 7, 8, 0, 8, 0x4, 0x6}},
      {DType::kFloat6E2m3fn, {1e9f, kInfF, nan, -0.0f}, {31, 31, 32, 32}},
      // fnuz: one NaN, no -0.
      {DType::kFloat8E4m3fnuz,
       {1e9f, kInfF, nan, -0.0f, -1e-30f, 1.0f},
       {0x80, 0x80, 0x80, 0, 0, 0x40}},
      // e8m0: no sign and no zero; ties round up; a float32 subnormal above 2^-127 gives 2^-126.
      {DType::kFloat8E8m0fnu,
       {1e9f, kInfF, nan, -0.0f, 0.0f, -1.0f, 1.5f, 3.0f, 0.75f, 0x1.4p-127f, 1e-45f},
       {157, 255, 255, 255, 255, 255, 128, 129, 127, 1, 0}},
      // IEEE-like: overflow gives inf.
      {DType::kFloat8E4m3, {1e9f, kInfF, nan, -0.0f}, {0x78, 0x78, 0x7c, 0x80}},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(MustConvert<uint8_t>(DType::kFloat32, c.in, c.dtype), c.expected)
        << DTypeName(c.dtype);
  }
  // float64 goes through float32 (as ml_dtypes), and integers through float32 too.
  EXPECT_EQ(MustConvert<uint8_t>(DType::kFloat64, std::vector<double>{3.0, -6.0},
                                 DType::kFloat4E2m1fn),
            (std::vector<uint8_t>{0x5, 0xf}));
  EXPECT_EQ(MustConvert<uint8_t>(DType::kInt32, std::vector<int32_t>{1, 2, 3, 4},
                                 DType::kFloat8E4m3fnuz),
            (std::vector<uint8_t>{0x40, 0x48, 0x4c, 0x50}));
}

TEST(ConvertTest, NarrowFloatsRoundTripThroughFloat32) {
  for (DType dtype : {DType::kFloat8E3m4, DType::kFloat8E4m3, DType::kFloat8E4m3fnuz,
                      DType::kFloat8E5m2fnuz, DType::kFloat8E4m3b11fnuz, DType::kFloat8E8m0fnu,
                      DType::kFloat6E2m3fn, DType::kFloat6E3m2fn, DType::kFloat4E2m1fn}) {
    std::vector<uint8_t> codes(size_t{1} << BitWidth(dtype));
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i);
    const std::vector<float> wide = MustConvert<float>(dtype, codes, DType::kFloat32);
    const std::vector<uint8_t> back = MustConvert<uint8_t>(DType::kFloat32, wide, dtype);
    for (size_t i = 0; i < codes.size(); ++i) {
      if (wide[i] != wide[i]) continue;  // NaNs: their canonical code (checked above)
      EXPECT_EQ(back[i], codes[i]) << DTypeName(dtype) << " code " << i;
    }
    // Float to integer stays refused.
    EXPECT_FALSE(CanConvert(dtype, DType::kInt32)) << DTypeName(dtype);
    EXPECT_TRUE(CanConvert(DType::kInt4, dtype)) << DTypeName(dtype);
  }
}

}  // namespace
}  // namespace tensorstash
