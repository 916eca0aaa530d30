// Element-wise dtype conversion, used when a reader asks for a different dtype than stored.
//
// Supported conversions (anything else is Unimplemented, naming both dtypes):
//  - same dtype: a plain copy;
//  - float -> float (float16, bfloat16, float32, float64, every float8, float6 and float4 of
//    ml_dtypes): round to nearest even, bit-exact with ml_dtypes / NumPy casts; overflow gives inf
//    where the target has one, NaN where it has not (float8_e4m3fn, the fnuz types, e8m0fnu) and
//    the largest value where it has neither (float6, float4); NaN stays NaN where it can;
//  - complex64 <-> complex128 (each part as float32 <-> float64);
//  - integer/bool -> integer/bool (int2, int4, uint2, uint4 included: read from their low bits,
//    written with the high bits zero): exact; a value that does not fit the target is
//    InvalidArgument naming `what` (the array) and the value; to bool: nonzero -> true;
//  - integer/bool -> float: round to nearest even, as NumPy's astype.
//
// Thread-safety: pure functions.
#ifndef TENSORSTASH_ARRAY_CONVERT_H_
#define TENSORSTASH_ARRAY_CONVERT_H_

#include <cstddef>
#include <string_view>

#include "tensorstash/array/dtype.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// True when ConvertElements(from, to, ...) is supported.
bool CanConvert(DType from, DType to);

// Converts `count` contiguous elements of `from` at `src` into `count` elements of `to` at `dst`.
// `src` and `dst` must not overlap. `what` names the data in error messages (an array path).
// On failure `dst` may be partly written.
Status ConvertElements(DType from, const void* src, DType to, void* dst, size_t count,
                       std::string_view what);

}  // namespace tensorstash

#endif  // TENSORSTASH_ARRAY_CONVERT_H_
