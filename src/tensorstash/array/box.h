// Box: an n-dimensional index hyper-rectangle (origin + shape), and copies between buffers
// laid out over different boxes.
//
// A buffer "over a box" holds the box's elements in C (row-major) order, densely packed.
// Thread-safety: value types and pure functions.
#ifndef TENSORSTASH_ARRAY_BOX_H_
#define TENSORSTASH_ARRAY_BOX_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/array/dtype.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// The largest rank any array may have.
inline constexpr int kMaxRank = 32;

struct Box {
  std::vector<int64_t> origin;
  std::vector<int64_t> shape;

  Box() = default;
  Box(std::vector<int64_t> origin_in, std::vector<int64_t> shape_in)
      : origin(std::move(origin_in)), shape(std::move(shape_in)) {}
  // The box [0, shape).
  static Box FromShape(std::vector<int64_t> shape);

  int rank() const { return static_cast<int>(shape.size()); }
  // Product of the extents (1 for rank 0). Assumes a validated box (no overflow).
  int64_t num_elements() const;
  bool empty() const { return num_elements() == 0; }
  // True when every point of `inner` lies in this box (an empty box is contained anywhere of the
  // same rank).
  bool Contains(const Box& inner) const;
  bool operator==(const Box& other) const = default;
  std::string ToString() const;  // "[0:4, 2:6]" (half-open ranges)
};

// Checks rank <= kMaxRank, origin.size() == shape.size(), non-negative extents and origins, and
// that origin + shape and the element count times `item_size` fit in int64. InvalidArgument
// naming `what` otherwise.
Status ValidateBox(const Box& box, size_t item_size, std::string_view what);

// Checked product of `shape`; InvalidArgument naming `what` on overflow or negative extents.
Result<int64_t> CheckedNumElements(const std::vector<int64_t>& shape, std::string_view what);

// The intersection of two boxes of the same rank; an empty box (some extent 0) when disjoint.
Box Intersect(const Box& a, const Box& b);

// True when `sub` (contained in `outer`) occupies one contiguous run of a buffer over `outer`.
bool IsContiguousIn(const Box& sub, const Box& outer);

// Byte offset of the first element of `sub` (contained in `outer`) in a buffer over `outer`.
int64_t ByteOffsetIn(const Box& sub, const Box& outer, size_t item_size);

// Copies the elements of `region` from `src` (a buffer over `src_box`, elements of `src_dtype`)
// to `dst` (a buffer over `dst_box`, elements of `dst_dtype`), converting element types when
// they differ (see convert.h). `region` must lie inside both boxes. `what` names the data in
// errors (conversion failures, unsupported casts).
Status CopyBox(const Box& region, DType src_dtype, const void* src, const Box& src_box,
               DType dst_dtype, void* dst, const Box& dst_box, std::string_view what);

}  // namespace tensorstash

#endif  // TENSORSTASH_ARRAY_BOX_H_
