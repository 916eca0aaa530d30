#include "tensorstash/array/box.h"

#include <algorithm>
#include <cstring>

#include "tensorstash/array/convert.h"
#include "tensorstash/util/copy_bytes.h"

namespace tensorstash {

Box Box::FromShape(std::vector<int64_t> shape) {
  std::vector<int64_t> origin(shape.size(), 0);
  return Box(std::move(origin), std::move(shape));
}

int64_t Box::num_elements() const {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

bool Box::Contains(const Box& inner) const {
  if (inner.rank() != rank()) return false;
  if (inner.empty()) return true;
  for (int d = 0; d < rank(); ++d) {
    if (inner.origin[d] < origin[d] || inner.origin[d] + inner.shape[d] > origin[d] + shape[d]) {
      return false;
    }
  }
  return true;
}

std::string Box::ToString() const {
  std::vector<std::string> parts;
  for (int d = 0; d < rank(); ++d) {
    parts.push_back(StrCat(origin[d], ":", origin[d] + shape[d]));
  }
  return StrCat("[", StrJoin(parts, ", "), "]");
}

Result<int64_t> CheckedNumElements(const std::vector<int64_t>& shape, std::string_view what) {
  int64_t n = 1;
  for (int64_t extent : shape) {
    if (extent < 0) {
      return InvalidArgumentError(
          StrCat(what, ": negative extent ", extent, " in shape [", StrJoin(shape, ", "), "]"));
    }
    if (__builtin_mul_overflow(n, extent, &n)) {
      return InvalidArgumentError(
          StrCat(what, ": shape [", StrJoin(shape, ", "), "] has more than 2^63 elements"));
    }
  }
  return n;
}

Status ValidateBox(const Box& box, size_t item_size, std::string_view what) {
  if (box.origin.size() != box.shape.size()) {
    return InvalidArgumentError(StrCat(what, ": origin has rank ", box.origin.size(),
                                       " but shape has rank ", box.shape.size()));
  }
  if (box.rank() > kMaxRank) {
    return InvalidArgumentError(
        StrCat(what, ": rank ", box.rank(), " exceeds the limit of ", kMaxRank));
  }
  for (int d = 0; d < box.rank(); ++d) {
    int64_t end;
    if (box.origin[d] < 0 || box.shape[d] < 0 ||
        __builtin_add_overflow(box.origin[d], box.shape[d], &end)) {
      return InvalidArgumentError(StrCat(what, ": invalid box dimension ", d, " (origin ",
                                         box.origin[d], ", extent ", box.shape[d], ")"));
    }
  }
  TS_ASSIGN_OR_RETURN(int64_t n, CheckedNumElements(box.shape, what));
  int64_t bytes;
  if (__builtin_mul_overflow(n, static_cast<int64_t>(item_size), &bytes)) {
    return InvalidArgumentError(
        StrCat(what, ": ", n, " elements of ", item_size, " bytes overflow int64"));
  }
  return OkStatus();
}

Box Intersect(const Box& a, const Box& b) {
  Box out;
  out.origin.resize(a.rank());
  out.shape.resize(a.rank());
  for (int d = 0; d < a.rank(); ++d) {
    int64_t lo = std::max(a.origin[d], b.origin[d]);
    int64_t hi = std::min(a.origin[d] + a.shape[d], b.origin[d] + b.shape[d]);
    out.origin[d] = lo;
    out.shape[d] = std::max<int64_t>(0, hi - lo);
  }
  return out;
}

bool IsContiguousIn(const Box& sub, const Box& outer) {
  // Row-major: contiguous iff, past the first dimension where sub is shorter than outer, sub
  // spans outer entirely, and before it sub has extent 1.
  int d = 0;
  const int rank = sub.rank();
  while (d < rank && sub.shape[d] == 1) ++d;
  if (d == rank) return true;
  for (int k = d + 1; k < rank; ++k) {
    if (sub.shape[k] != outer.shape[k]) return false;
  }
  return true;
}

int64_t ByteOffsetIn(const Box& sub, const Box& outer, size_t item_size) {
  int64_t offset = 0;
  for (int d = 0; d < outer.rank(); ++d) {
    offset = offset * outer.shape[d] + (sub.origin[d] - outer.origin[d]);
  }
  return offset * static_cast<int64_t>(item_size);
}

Status CopyBox(const Box& region, DType src_dtype, const void* src, const Box& src_box,
               DType dst_dtype, void* dst, const Box& dst_box, std::string_view what) {
  if (region.empty()) return OkStatus();
  const int rank = region.rank();
  const size_t src_item = ItemSize(src_dtype);
  const size_t dst_item = ItemSize(dst_dtype);
  const bool same = src_dtype == dst_dtype;

  // Collapse the innermost dimensions that are contiguous in both buffers into one run.
  int inner = rank;  // dims [inner, rank) form the contiguous run
  int64_t run = 1;
  while (inner > 0) {
    int d = inner - 1;
    run *= region.shape[d];
    --inner;
    if (region.shape[d] != src_box.shape[d] || region.shape[d] != dst_box.shape[d]) break;
  }
  // Element strides of each buffer for the outer dims.
  std::vector<int64_t> src_stride(rank, 1), dst_stride(rank, 1);
  for (int d = rank - 2; d >= 0; --d) {
    src_stride[d] = src_stride[d + 1] * src_box.shape[d + 1];
    dst_stride[d] = dst_stride[d + 1] * dst_box.shape[d + 1];
  }
  const auto* src_bytes = static_cast<const char*>(src) + ByteOffsetIn(region, src_box, src_item);
  auto* dst_bytes = static_cast<char*>(dst) + ByteOffsetIn(region, dst_box, dst_item);

  std::vector<int64_t> index(inner, 0);
  for (;;) {
    int64_t src_off = 0, dst_off = 0;
    for (int d = 0; d < inner; ++d) {
      src_off += index[d] * src_stride[d];
      dst_off += index[d] * dst_stride[d];
    }
    const char* s = src_bytes + src_off * static_cast<int64_t>(src_item);
    char* t = dst_bytes + dst_off * static_cast<int64_t>(dst_item);
    if (same) {
      CopyBytes(t, s, static_cast<size_t>(run) * src_item);
    } else {
      TS_RETURN_IF_ERROR(
          ConvertElements(src_dtype, s, dst_dtype, t, static_cast<size_t>(run), what));
    }
    // Advance the odometer over the outer dims.
    int d = inner - 1;
    while (d >= 0) {
      if (++index[d] < region.shape[d]) break;
      index[d] = 0;
      --d;
    }
    if (d < 0) break;
  }
  return OkStatus();
}

}  // namespace tensorstash
