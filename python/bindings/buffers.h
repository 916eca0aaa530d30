// The byte buffers that cross the binding: array shards handed to the writer and destinations
// handed to the reader, both flat C-contiguous CPU uint8 arrays (the Python layer passes
// `array.reshape(-1).view(np.uint8)`), plus small conversions shared by writer.cc and reader.cc.
//
// Thread-safety: every function here needs the GIL.
#ifndef TENSORSTASH_PYTHON_BINDINGS_BUFFERS_H_
#define TENSORSTASH_PYTHON_BINDINGS_BUFFERS_H_

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string_view>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/array/dtype.h"
#include "tensorstash/util/status.h"

namespace tensorstash::python {

using ReadOnlyBytes =
    nanobind::ndarray<uint8_t, nanobind::c_contig, nanobind::device::cpu, nanobind::ro>;
using WritableBytes = nanobind::ndarray<uint8_t, nanobind::c_contig, nanobind::device::cpu>;

// `object` as a read-only / writable byte array, without nanobind's implicit conversion: a
// converted copy would make the writer save, or the reader fill, a temporary. TypeError naming
// `what` when it is not a C-contiguous CPU uint8 array (or not writable, for WritableBytes).
ReadOnlyBytes CastReadOnlyBytes(nanobind::handle object, std::string_view what);
WritableBytes CastWritableBytes(nanobind::handle object, std::string_view what);

// Checks `box` (ValidateBox) and that a buffer of `nbytes` holds exactly its elements of
// `dtype`. InvalidArgument naming `what` otherwise.
Status CheckBufferSize(const Box& box, DType dtype, size_t nbytes, std::string_view what);

// A shape as a Python tuple, as NumPy reports shapes.
nanobind::tuple ShapeTuple(const std::vector<int64_t>& shape);

}  // namespace tensorstash::python

#endif  // TENSORSTASH_PYTHON_BINDINGS_BUFFERS_H_
