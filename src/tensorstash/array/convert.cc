#include "tensorstash/array/convert.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorstash/util/copy_bytes.h"

// Reference behaviour (numpy 2.4 + ml_dtypes 0.6, established by probing `astype`; the cross-check
// tests/crosscheck/dtype_conversion.py pins it down bit for bit):
//  - float64 -> float16 rounds once (NumPy's own double->half); float64 -> bfloat16 / float8 goes
//    through float32 first, so it rounds twice, and we do the same.
//  - integers -> bfloat16 / float8 / float16 go through float32 (one correctly rounded int->float
//    cast, then a second rounding); integers -> float32 / float64 are plain C casts.
//  - NaN: NumPy's float16 codec keeps payload bits (float32/float64 -> float16 truncates them and
//    keeps the NaN nonzero; float16 -> float32/float64 shifts them up without quieting).
//    bfloat16 -> float32 is a bit shift. Anything that ml_dtypes converts itself (to bfloat16 or
//    float8, from float8, bfloat16 -> float16) yields the target's canonical quiet NaN with the
//    source sign. float32 <-> float64 are hardware casts (quiet bit set, payload kept).
//  - float8_e4m3fn has no inf: inf and overflow become NaN (0x7F | sign).

namespace tensorstash {
namespace {

// A binary floating-point format with an implicit leading bit. `kIeeeSpecials`: the all-ones
// exponent is inf/NaN; otherwise (the "fn" float8 formats) only the all-ones pattern is NaN.
template <typename BitsT, int kExp, int kMant, bool kIeeeSpecials, uint64_t kQuietNan>
struct FloatFormat {
  static constexpr bool kIsFloat = true;
  using Bits = BitsT;
  static constexpr int kExpBits = kExp;
  static constexpr int kMantBits = kMant;
  static constexpr int kTotalBits = 1 + kExp + kMant;
  static constexpr int kBias = (1 << (kExp - 1)) - 1;
  static constexpr bool kHasInf = kIeeeSpecials;
  static constexpr Bits kSignMask = static_cast<Bits>(uint64_t{1} << (kTotalBits - 1));
  static constexpr Bits kMantMask = static_cast<Bits>((uint64_t{1} << kMant) - 1);
  static constexpr Bits kExpAllOnes = static_cast<Bits>(((uint64_t{1} << kExp) - 1) << kMant);
  static constexpr Bits kInfBits = kExpAllOnes;  // meaningful only when kHasInf
  static constexpr Bits kMaxFinite =
      static_cast<Bits>(kIeeeSpecials ? kExpAllOnes - 1 : (kExpAllOnes | kMantMask) - 1);
  static constexpr Bits kCanonicalNan = static_cast<Bits>(kQuietNan);
  static_assert(sizeof(Bits) * 8 == kTotalBits);
};

using F16 = FloatFormat<uint16_t, 5, 10, true, 0x7e00>;
using BF16 = FloatFormat<uint16_t, 8, 7, true, 0x7fc0>;
using F8E4M3FN = FloatFormat<uint8_t, 4, 3, false, 0x7f>;
using F8E5M2 = FloatFormat<uint8_t, 5, 2, true, 0x7e>;
using F32 = FloatFormat<uint32_t, 8, 23, true, 0x7fc00000>;
using F64 = FloatFormat<uint64_t, 11, 52, true, 0x7ff8000000000000>;

// kKeepPayload is NumPy's float16 codec; kCanonical is what ml_dtypes does.
enum class NanMode { kCanonical, kKeepPayload };

// The result of an inf or overflow in Dst (NaN where Dst has no inf).
template <typename Dst>
constexpr typename Dst::Bits OverflowBits() {
  return Dst::kHasInf ? Dst::kInfBits : Dst::kCanonicalNan;
}

// Rounds a wider format (float32/float64) to a narrower one, to nearest even, with subnormals.
template <typename Dst, typename Src, NanMode kNan>
typename Dst::Bits Narrow(typename Src::Bits bits) {
  using S = typename Src::Bits;
  using D = typename Dst::Bits;
  static_assert(std::is_unsigned_v<S> && sizeof(S) >= 4, "source must not promote to int");
  constexpr int kShift = Src::kMantBits - Dst::kMantBits;
  constexpr int kBiasDiff = Src::kBias - Dst::kBias;
  static_assert(kShift > 0 && kBiasDiff >= 0);

  const D sign = static_cast<D>((bits >> (Src::kTotalBits - 1)) << (Dst::kTotalBits - 1));
  const S abs = bits & static_cast<S>(~Src::kSignMask);
  if (abs >= Src::kExpAllOnes) [[unlikely]] {
    if (abs == Src::kExpAllOnes) return static_cast<D>(sign | OverflowBits<Dst>());
    if constexpr (kNan == NanMode::kKeepPayload) {
      // Keep the top payload bits, but never let the payload vanish into an inf.
      D payload = static_cast<D>((abs & Src::kMantMask) >> kShift);
      if (payload == 0) payload = 1;
      return static_cast<D>(sign | Dst::kExpAllOnes | payload);
    } else {
      return static_cast<D>(sign | Dst::kCanonicalNan);
    }
  }
  const int exp = static_cast<int>(abs >> Src::kMantBits);
  if (exp > kBiasDiff) {
    // Normal in Dst before rounding. A carry out of the mantissa bumps the exponent, which is
    // exactly right, and may reach the overflow range.
    const S rebiased = abs - (static_cast<S>(kBiasDiff) << Src::kMantBits);
    const S rounded =
        (rebiased + ((S{1} << (kShift - 1)) - 1) + ((rebiased >> kShift) & 1)) >> kShift;
    if (rounded > Dst::kMaxFinite) return static_cast<D>(sign | OverflowBits<Dst>());
    return static_cast<D>(sign | static_cast<D>(rounded));
  }
  // Subnormal (or zero) in Dst: scale the full significand to units of Dst's smallest subnormal.
  const S sig = (abs & Src::kMantMask) | (exp != 0 ? (S{1} << Src::kMantBits) : S{0});
  const int shift = kBiasDiff + kShift + 1 - (exp != 0 ? exp : 1);
  // sig < 2^(kMantBits+1), so beyond this shift it is below half the smallest subnormal.
  if (shift > Src::kMantBits + 1) return sign;
  const S rounded = (sig + ((S{1} << (shift - 1)) - 1) + ((sig >> shift) & 1)) >> shift;
  return static_cast<D>(sign | static_cast<D>(rounded));
}

// Decodes a narrow format exactly into float32 bits.
template <typename Src, NanMode kNan>
uint32_t WidenToF32(typename Src::Bits bits) {
  constexpr int kShift = F32::kMantBits - Src::kMantBits;
  constexpr int kBiasDiff = F32::kBias - Src::kBias;
  const uint32_t sign = static_cast<uint32_t>(bits >> (Src::kTotalBits - 1)) << 31;
  const uint32_t abs = bits & static_cast<typename Src::Bits>(~Src::kSignMask);
  if constexpr (Src::kHasInf) {
    if (abs >= Src::kExpAllOnes) [[unlikely]] {
      if (abs == Src::kExpAllOnes) return sign | F32::kInfBits;
      if constexpr (kNan == NanMode::kKeepPayload) {
        return sign | F32::kExpAllOnes | ((abs & Src::kMantMask) << kShift);
      } else {
        return sign | F32::kCanonicalNan;
      }
    }
  } else {
    if (abs == (Src::kExpAllOnes | Src::kMantMask)) [[unlikely]]
      return sign | F32::kCanonicalNan;
  }
  if constexpr (kBiasDiff == 0) {
    // Same exponent range (bfloat16): subnormals line up too.
    return sign | (abs << kShift);
  } else {
    const uint32_t exp = abs >> Src::kMantBits;
    if (exp == 0) {
      uint32_t mant = abs & Src::kMantMask;
      if (mant == 0) return sign;
      // Normalise: move the leading one up to the implicit-bit position.
      const int lshift = Src::kMantBits + 1 - std::bit_width(mant);
      mant = (mant << lshift) & Src::kMantMask;
      const uint32_t new_exp = static_cast<uint32_t>(1 - lshift + kBiasDiff);
      return sign | (new_exp << F32::kMantBits) | (mant << kShift);
    }
    return sign | ((abs << kShift) + (static_cast<uint32_t>(kBiasDiff) << F32::kMantBits));
  }
}

// float32 bits -> float64 bits without quieting a signalling NaN (NumPy's half -> double).
uint64_t WidenF32ToF64KeepNan(uint32_t bits) {
  if ((bits & 0x7fffffffu) > F32::kInfBits) [[unlikely]] {
    return (static_cast<uint64_t>(bits >> 31) << 63) | F64::kExpAllOnes |
           (static_cast<uint64_t>(bits & F32::kMantMask) << (F64::kMantBits - F32::kMantBits));
  }
  return std::bit_cast<uint64_t>(static_cast<double>(std::bit_cast<float>(bits)));
}

uint32_t HardwareF64ToF32(uint64_t bits) {
  return std::bit_cast<uint32_t>(static_cast<float>(std::bit_cast<double>(bits)));
}

uint64_t HardwareF32ToF64(uint32_t bits) {
  return std::bit_cast<uint64_t>(static_cast<double>(std::bit_cast<float>(bits)));
}

// NumPy's float16 keeps NaN payloads; ml_dtypes' float8 formats do not.
template <typename Src>
constexpr NanMode kDecodeNan =
    std::is_same_v<Src, F16> || std::is_same_v<Src, BF16> ? NanMode::kKeepPayload
                                                          : NanMode::kCanonical;

template <typename From, typename To>
typename To::Bits CastFloat(typename From::Bits x) {
  if constexpr (std::is_same_v<From, F64>) {
    if constexpr (std::is_same_v<To, F32>) {
      return HardwareF64ToF32(x);
    } else if constexpr (std::is_same_v<To, F16>) {
      return Narrow<F16, F64, NanMode::kKeepPayload>(x);  // NumPy rounds double -> half once
    } else {
      return Narrow<To, F32, NanMode::kCanonical>(HardwareF64ToF32(x));  // ml_dtypes: via float
    }
  } else if constexpr (std::is_same_v<From, F32>) {
    if constexpr (std::is_same_v<To, F64>) {
      return HardwareF32ToF64(x);
    } else {
      return Narrow < To, F32,
             std::is_same_v<To, F16> ? NanMode::kKeepPayload : NanMode::kCanonical > (x);
    }
  } else {
    // A narrow source is exact in float32; only the final step can round.
    const uint32_t wide = WidenToF32<From, kDecodeNan<From>>(x);
    if constexpr (std::is_same_v<To, F32>) {
      return wide;
    } else if constexpr (std::is_same_v<To, F64>) {
      if constexpr (std::is_same_v<From, F16>) return WidenF32ToF64KeepNan(wide);
      return HardwareF32ToF64(wide);  // ml_dtypes: static_cast<double>(float)
    } else {
      return Narrow<To, F32, NanMode::kCanonical>(wide);
    }
  }
}

// ---- The formats ml_dtypes added after float8_e4m3fn / float8_e5m2 ----
//
// float8_e3m4, float8_e4m3 (IEEE-like), float8_e4m3fnuz, float8_e5m2fnuz, float8_e4m3b11fnuz
// (no inf, one NaN at 0x80, no -0), float8_e8m0fnu (no sign, no zero, NaN 0xFF, powers of two),
// float6_e2m3fn, float6_e3m2fn, float4_e2m1fn (no inf, no NaN: overflow saturates). Each has at
// most 256 codes, so they go through float32 by table: decoding is exact, and encoding picks the
// nearest code (ties to the even code, which is round-to-nearest-even on the bits), with the
// specials ml_dtypes gives (probed with numpy 2.4 + ml_dtypes 0.6; tests/crosscheck pins them).
enum class SmallNan { kIeee, kNegativeZero, kAllOnes, kNone };

struct SmallSpec {
  int bits;
  int exp_bits;
  int mant_bits;
  int bias;
  bool has_sign;
  SmallNan nan;
};

template <DType D>
struct SmallFloat {
  static constexpr DType kDType = D;
  static constexpr bool kIsFloat = true;
  static constexpr bool kIsSmall = true;
  using Bits = uint8_t;
};

template <typename T>
concept IsSmall = requires { T::kIsSmall; };

constexpr SmallSpec SpecOf(DType dtype) {
  switch (dtype) {
    case DType::kFloat8E3m4:
      return {8, 3, 4, 3, true, SmallNan::kIeee};
    case DType::kFloat8E4m3:
      return {8, 4, 3, 7, true, SmallNan::kIeee};
    case DType::kFloat8E4m3fnuz:
      return {8, 4, 3, 8, true, SmallNan::kNegativeZero};
    case DType::kFloat8E5m2fnuz:
      return {8, 5, 2, 16, true, SmallNan::kNegativeZero};
    case DType::kFloat8E4m3b11fnuz:
      return {8, 4, 3, 11, true, SmallNan::kNegativeZero};
    case DType::kFloat8E8m0fnu:
      return {8, 8, 0, 127, false, SmallNan::kAllOnes};
    case DType::kFloat6E2m3fn:
      return {6, 2, 3, 1, true, SmallNan::kNone};
    case DType::kFloat6E3m2fn:
      return {6, 3, 2, 3, true, SmallNan::kNone};
    default:  // kFloat4E2m1fn
      return {4, 2, 1, 1, true, SmallNan::kNone};
  }
}

// The decoding of every code of one format, and its non-negative finite codes sorted by value.
struct SmallTable {
  SmallSpec spec;
  uint32_t decoded[256];  // float32 bits of every byte
  std::vector<std::pair<double, uint8_t>> ladder;  // ascending magnitudes, with a virtual top
  uint8_t nan_code;
  uint8_t max_code;
  uint8_t sign_bit;
};

uint32_t F32Bits(float f) { return std::bit_cast<uint32_t>(f); }

SmallTable MakeTable(DType dtype) {
  SmallTable t{};
  const SmallSpec sp = SpecOf(dtype);
  t.spec = sp;
  const int mag_bits = sp.bits - (sp.has_sign ? 1 : 0);
  const unsigned mag_mask = (1u << mag_bits) - 1;
  const unsigned mant_mask = (1u << sp.mant_bits) - 1;
  const unsigned exp_ones = (1u << sp.exp_bits) - 1;
  t.sign_bit = sp.has_sign ? static_cast<uint8_t>(1u << (sp.bits - 1)) : 0;
  for (unsigned code = 0; code < 256; ++code) {
    // As ml_dtypes reads a byte: any bit above the magnitude bits makes float4/float6 negative.
    const bool negative = sp.has_sign && (code >> (sp.bits - 1)) != 0;
    const unsigned mag = code & mag_mask;
    const unsigned exp = mag >> sp.mant_bits;
    const unsigned mant = mag & mant_mask;
    float value;
    bool is_nan = false;
    bool is_inf = false;
    switch (sp.nan) {
      case SmallNan::kIeee:
        is_inf = exp == exp_ones && mant == 0;
        is_nan = exp == exp_ones && mant != 0;
        break;
      case SmallNan::kNegativeZero:  // 8-bit formats only
        is_nan = code == t.sign_bit;
        break;
      case SmallNan::kAllOnes:
        is_nan = code == 0xff;
        break;
      case SmallNan::kNone:
        break;
    }
    if (is_nan) {
      // ml_dtypes: a quiet NaN with the code's sign bit.
      t.decoded[code] = (negative ? 0x80000000u : 0u) | F32::kCanonicalNan;
      continue;
    }
    if (is_inf) {
      value = std::numeric_limits<float>::infinity();
    } else if (sp.mant_bits == 0) {
      value = std::ldexp(1.0f, static_cast<int>(exp) - sp.bias);  // e8m0: 2^(e - 127)
    } else if (exp == 0) {
      value = std::ldexp(static_cast<float>(mant), 1 - sp.bias - sp.mant_bits);
    } else {
      value = std::ldexp(static_cast<float>(mant | (1u << sp.mant_bits)),
                         static_cast<int>(exp) - sp.bias - sp.mant_bits);
    }
    t.decoded[code] = F32Bits(negative ? -value : value);
    if (code <= mag_mask && !is_inf) t.ladder.emplace_back(value, static_cast<uint8_t>(code));
  }
  std::sort(t.ladder.begin(), t.ladder.end());
  t.max_code = t.ladder.back().second;
  // The value one step above the largest finite one: reaching its half-way point overflows.
  // (In double: for float8_e8m0fnu it is 2^128.)
  const double max = t.ladder.back().first;
  const double step = sp.mant_bits == 0 ? max : max - t.ladder[t.ladder.size() - 2].first;
  t.ladder.emplace_back(max + step, static_cast<uint8_t>(t.max_code + 1));
  switch (sp.nan) {
    case SmallNan::kIeee:  // the quiet NaN: exponent all ones, top mantissa bit
      t.nan_code = static_cast<uint8_t>((exp_ones << sp.mant_bits) | (1u << (sp.mant_bits - 1)));
      break;
    case SmallNan::kNegativeZero:
      t.nan_code = t.sign_bit;
      break;
    case SmallNan::kAllOnes:
      t.nan_code = static_cast<uint8_t>((1u << sp.bits) - 1);
      break;
    case SmallNan::kNone:
      t.nan_code = 0;
      break;
  }
  return t;
}

template <DType kDType>
const SmallTable& TableOf() {
  static const SmallTable table = MakeTable(kDType);
  return table;
}

template <DType kDType>
uint32_t DecodeSmall(uint8_t code) {
  return TableOf<kDType>().decoded[code];
}

template <DType kDType>
uint8_t EncodeSmall(uint32_t bits) {
  const SmallTable& t = TableOf<kDType>();
  const SmallSpec& sp = t.spec;
  const float f = std::bit_cast<float>(bits);
  const bool negative = (bits >> 31) != 0;
  const auto overflow = [&]() -> uint8_t {
    if (sp.nan == SmallNan::kIeee) {  // inf
      return static_cast<uint8_t>((negative ? t.sign_bit : 0) |
                                  (((1u << sp.exp_bits) - 1) << sp.mant_bits));
    }
    if (sp.nan == SmallNan::kNone) {  // saturate
      return static_cast<uint8_t>((negative ? t.sign_bit : 0) | t.max_code);
    }
    return t.nan_code;
  };
  if (std::isnan(f)) {
    if (sp.nan == SmallNan::kIeee) {
      return static_cast<uint8_t>((negative ? t.sign_bit : 0) | t.nan_code);
    }
    // ml_dtypes gives the formats without NaN a zero whose sign is the NaN's, inverted.
    if (sp.nan == SmallNan::kNone) return negative ? 0 : t.sign_bit;
    return t.nan_code;
  }
  if (!sp.has_sign && (negative || f == 0)) return t.nan_code;  // e8m0 has neither
  if (std::isinf(f)) return overflow();
  const float a = std::fabs(f);
  if (sp.mant_bits == 0 && a < std::numeric_limits<float>::min()) {
    // float8_e8m0fnu from a float32 subnormal: ml_dtypes gives 2^-127 up to 2^-127 itself and
    // 2^-126 above it (not the nearest: its rounding works on the float32 bits).
    return a > std::ldexp(1.0f, -127) ? 1 : 0;
  }
  const auto& ladder = t.ladder;
  // First rung >= a; the answer is it or the one below.
  auto it = std::lower_bound(ladder.begin(), ladder.end(),
                             std::make_pair(static_cast<double>(a), uint8_t{0}));
  uint8_t code;
  if (it == ladder.end()) {
    return overflow();
  } else if (it == ladder.begin() || it->first == a) {
    code = it->second;
  } else {
    const auto below = it - 1;
    const double up = it->first - a;  // exact: float32 values, near each other, in double
    const double down = a - below->first;
    // A tie goes to the even code (round half to even on the bits); float8_e8m0fnu, which has
    // no mantissa, rounds ties up, as ml_dtypes does.
    const bool tie_up = (it->second & 1) == 0 || sp.mant_bits == 0;
    code = up < down ? it->second : down < up ? below->second : tie_up ? it->second : below->second;
  }
  if (code > t.max_code) return overflow();
  if (code == 0 && sp.nan == SmallNan::kNegativeZero) return 0;  // no -0
  return static_cast<uint8_t>((negative ? t.sign_bit : 0) | code);
}

// Any float format to any other where one of them is a SmallFloat: through float32, as ml_dtypes
// converts (a float64 source is rounded to float32 first).
template <typename From, typename To>
typename To::Bits CastViaF32(typename From::Bits x) {
  uint32_t wide;
  if constexpr (IsSmall<From>) {
    wide = DecodeSmall<From::kDType>(x);
  } else if constexpr (std::is_same_v<From, F64>) {
    wide = HardwareF64ToF32(x);
  } else if constexpr (std::is_same_v<From, F32>) {
    wide = x;
  } else {
    wide = WidenToF32<From, kDecodeNan<From>>(x);
  }
  if constexpr (IsSmall<To>) {
    return EncodeSmall<To::kDType>(wide);
  } else if constexpr (std::is_same_v<To, F32>) {
    return wide;
  } else if constexpr (std::is_same_v<To, F64>) {
    return HardwareF32ToF64(wide);
  } else {
    return Narrow<To, F32, NanMode::kCanonical>(wide);
  }
}

template <typename From, typename To>
typename To::Bits AnyFloatCast(typename From::Bits x) {
  if constexpr (IsSmall<From> || IsSmall<To>) {
    return CastViaF32<From, To>(x);
  } else {
    return CastFloat<From, To>(x);
  }
}

// Integer-like element types. Bool is stored as a byte; any nonzero byte reads as true.
struct BoolElem {
  static constexpr bool kIsFloat = false;
  static constexpr bool kIsBool = true;
  using Storage = uint8_t;
  static constexpr uint8_t kMin = 0;
  static constexpr uint8_t kMax = 1;
  static uint8_t Value(uint8_t stored) { return stored != 0 ? 1 : 0; }
};

template <typename T>
struct IntElem {
  static constexpr bool kIsFloat = false;
  static constexpr bool kIsBool = false;
  using Storage = T;
  using ValueType = T;
  static constexpr T kMin = std::numeric_limits<T>::min();
  static constexpr T kMax = std::numeric_limits<T>::max();
  static T Value(T stored) { return stored; }
  static T Encode(T value) { return value; }
};

// int2/int4/uint2/uint4: one byte per element, the value in the low kBits. The high bits are
// ignored when reading (as ml_dtypes does) and written as zeros (as ml_dtypes writes them).
template <typename T, int kBits>
struct SubByteIntElem {
  static constexpr bool kIsFloat = false;
  static constexpr bool kIsBool = false;
  using Storage = uint8_t;
  using ValueType = T;
  static constexpr T kMin = std::is_signed_v<T> ? static_cast<T>(-(1 << (kBits - 1))) : T{0};
  static constexpr T kMax =
      static_cast<T>(std::is_signed_v<T> ? (1 << (kBits - 1)) - 1 : (1 << kBits) - 1);
  static T Value(uint8_t stored) {
    const unsigned low = stored & ((1u << kBits) - 1);
    if constexpr (std::is_signed_v<T>) {
      return static_cast<T>(static_cast<int>(low << (32 - kBits)) >> (32 - kBits));
    } else {
      return static_cast<T>(low);
    }
  }
  static uint8_t Encode(T value) {
    return static_cast<uint8_t>(static_cast<unsigned>(value) & ((1u << kBits) - 1));
  }
};

template <typename Elem, typename To>
typename To::Bits IntToFloat(typename Elem::Storage stored) {
  const auto value = Elem::Value(stored);
  if constexpr (IsSmall<To>) {
    return EncodeSmall<To::kDType>(std::bit_cast<uint32_t>(static_cast<float>(value)));
  } else if constexpr (std::is_same_v<To, F64>) {
    return std::bit_cast<uint64_t>(static_cast<double>(value));
  } else {
    const uint32_t f = std::bit_cast<uint32_t>(static_cast<float>(value));
    if constexpr (std::is_same_v<To, F32>) {
      return f;
    } else {
      return Narrow<To, F32, NanMode::kCanonical>(f);
    }
  }
}

// absl may be built with its own string_view (Debian's is), so hand StrCat a std::string.
std::string Name(DType dtype) { return std::string(DTypeName(dtype)); }

struct Context {
  DType from;
  DType to;
  std::string_view what;
};

using Kernel = Status (*)(const unsigned char* src, unsigned char* dst, size_t count,
                          const Context& context);

// memcpy keeps unaligned buffers legal; it compiles to plain loads and stores.
template <typename T>
T Load(const unsigned char* base, size_t index) {
  T value;
  std::memcpy(&value, base + index * sizeof(T), sizeof(T));
  return value;
}

template <typename T>
void Store(unsigned char* base, size_t index, T value) {
  std::memcpy(base + index * sizeof(T), &value, sizeof(T));
}

template <typename In, typename Out, Out (*kFn)(In)>
Status MapKernel(const unsigned char* src, unsigned char* dst, size_t count, const Context&) {
  for (size_t i = 0; i < count; ++i) Store<Out>(dst, i, kFn(Load<In>(src, i)));
  return OkStatus();
}

// complex64 <-> complex128: each complex is two independent parts.
template <typename From, typename To>
Status ComplexKernel(const unsigned char* src, unsigned char* dst, size_t count,
                     const Context& context) {
  return MapKernel<typename From::Bits, typename To::Bits, &CastFloat<From, To>>(
      src, dst, 2 * count, context);
}

template <typename T>
auto Widest(T value) {
  if constexpr (std::is_signed_v<T>) {
    return static_cast<int64_t>(value);
  } else {
    return static_cast<uint64_t>(value);
  }
}

template <typename From, typename To>
Status IntToIntKernel(const unsigned char* src, unsigned char* dst, size_t count,
                      const Context& context) {
  using In = typename From::Storage;
  using Out = typename To::Storage;
  for (size_t i = 0; i < count; ++i) {
    const auto value = From::Value(Load<In>(src, i));
    if constexpr (To::kIsBool) {
      Store<Out>(dst, i, value != 0 ? 1 : 0);
    } else {
      constexpr bool kAlwaysFits =
          std::cmp_less_equal(To::kMin, From::kMin) && std::cmp_less_equal(From::kMax, To::kMax);
      if constexpr (!kAlwaysFits) {
        if (std::cmp_less(value, To::kMin) || std::cmp_greater(value, To::kMax)) [[unlikely]] {
          return absl::InvalidArgumentError(
              absl::StrCat(std::string(context.what), ": element ", i, " has value ", Widest(value),
                           ", which does not fit in ", Name(context.to), " (converting ",
                           Name(context.from), " to ", Name(context.to), ")"));
        }
      }
      Store<Out>(dst, i, To::Encode(static_cast<typename To::ValueType>(value)));
    }
  }
  return OkStatus();
}

template <typename From, typename To>
constexpr Kernel SelectKernel() {
  if constexpr (std::is_same_v<From, To>) {
    return nullptr;  // never asked for: the caller copies same-dtype data
  } else if constexpr (From::kIsFloat && To::kIsFloat) {
    return &MapKernel<typename From::Bits, typename To::Bits, &AnyFloatCast<From, To>>;
  } else if constexpr (!From::kIsFloat && To::kIsFloat) {
    return &MapKernel<typename From::Storage, typename To::Bits, &IntToFloat<From, To>>;
  } else if constexpr (!From::kIsFloat && !To::kIsFloat) {
    return &IntToIntKernel<From, To>;
  } else {
    return nullptr;  // float -> integer is not offered: it would have to truncate silently
  }
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls fn(Tag<element type>) for the real (non-complex) dtypes; nullptr for the rest.
template <typename Fn>
Kernel VisitReal(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBool:
      return fn(Tag<BoolElem>{});
    case DType::kInt8:
      return fn(Tag<IntElem<int8_t>>{});
    case DType::kInt16:
      return fn(Tag<IntElem<int16_t>>{});
    case DType::kInt32:
      return fn(Tag<IntElem<int32_t>>{});
    case DType::kInt64:
      return fn(Tag<IntElem<int64_t>>{});
    case DType::kUint8:
      return fn(Tag<IntElem<uint8_t>>{});
    case DType::kUint16:
      return fn(Tag<IntElem<uint16_t>>{});
    case DType::kUint32:
      return fn(Tag<IntElem<uint32_t>>{});
    case DType::kUint64:
      return fn(Tag<IntElem<uint64_t>>{});
    case DType::kFloat16:
      return fn(Tag<F16>{});
    case DType::kBfloat16:
      return fn(Tag<BF16>{});
    case DType::kFloat32:
      return fn(Tag<F32>{});
    case DType::kFloat64:
      return fn(Tag<F64>{});
    case DType::kFloat8E4m3fn:
      return fn(Tag<F8E4M3FN>{});
    case DType::kFloat8E5m2:
      return fn(Tag<F8E5M2>{});
    case DType::kInt2:
      return fn(Tag<SubByteIntElem<int8_t, 2>>{});
    case DType::kInt4:
      return fn(Tag<SubByteIntElem<int8_t, 4>>{});
    case DType::kUint2:
      return fn(Tag<SubByteIntElem<uint8_t, 2>>{});
    case DType::kUint4:
      return fn(Tag<SubByteIntElem<uint8_t, 4>>{});
    case DType::kFloat4E2m1fn:
      return fn(Tag<SmallFloat<DType::kFloat4E2m1fn>>{});
    case DType::kFloat6E2m3fn:
      return fn(Tag<SmallFloat<DType::kFloat6E2m3fn>>{});
    case DType::kFloat6E3m2fn:
      return fn(Tag<SmallFloat<DType::kFloat6E3m2fn>>{});
    case DType::kFloat8E3m4:
      return fn(Tag<SmallFloat<DType::kFloat8E3m4>>{});
    case DType::kFloat8E4m3:
      return fn(Tag<SmallFloat<DType::kFloat8E4m3>>{});
    case DType::kFloat8E4m3b11fnuz:
      return fn(Tag<SmallFloat<DType::kFloat8E4m3b11fnuz>>{});
    case DType::kFloat8E4m3fnuz:
      return fn(Tag<SmallFloat<DType::kFloat8E4m3fnuz>>{});
    case DType::kFloat8E5m2fnuz:
      return fn(Tag<SmallFloat<DType::kFloat8E5m2fnuz>>{});
    case DType::kFloat8E8m0fnu:
      return fn(Tag<SmallFloat<DType::kFloat8E8m0fnu>>{});
    case DType::kComplex64:
    case DType::kComplex128:
      return nullptr;
  }
  return nullptr;
}

// nullptr when unsupported. Same-dtype copies are handled by the caller.
Kernel FindKernel(DType from, DType to) {
  if (from == DType::kComplex64 && to == DType::kComplex128) return &ComplexKernel<F32, F64>;
  if (from == DType::kComplex128 && to == DType::kComplex64) return &ComplexKernel<F64, F32>;
  return VisitReal(from, [to](auto from_tag) {
    return VisitReal(to, [](auto to_tag) {
      return SelectKernel<typename decltype(from_tag)::type, typename decltype(to_tag)::type>();
    });
  });
}

bool IsValid(DType dtype) { return static_cast<int>(dtype) < kNumDTypes; }

}  // namespace

bool CanConvert(DType from, DType to) {
  if (!IsValid(from) || !IsValid(to)) return false;
  return from == to || FindKernel(from, to) != nullptr;
}

Status ConvertElements(DType from, const void* src, DType to, void* dst, size_t count,
                       std::string_view what) {
  if (!IsValid(from) || !IsValid(to)) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": invalid dtype code ",
                                                   static_cast<int>(IsValid(from) ? to : from)));
  }
  if (from == to) {
    CopyBytes(dst, src, count * ItemSize(from));
    return OkStatus();
  }
  const Kernel kernel = FindKernel(from, to);
  if (kernel == nullptr) {
    return absl::UnimplementedError(absl::StrCat(std::string(what), ": conversion from ",
                                                 Name(from), " to ", Name(to),
                                                 " is not supported"));
  }
  if (count == 0) return OkStatus();
  return kernel(static_cast<const unsigned char*>(src), static_cast<unsigned char*>(dst), count,
                Context{from, to, what});
}

}  // namespace tensorstash
