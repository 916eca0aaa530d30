#include "buffers.h"

#include <Python.h>

#include <string>

#include "errors.h"

namespace nb = nanobind;

namespace tensorstash::python {
namespace {

// "ndarray of float32, shape (4, 4)": enough to see which requirement an array misses.
std::string Describe(nb::handle object) {
  std::string text = StrOf(nb::type_name(object.type()));
  if (nb::hasattr(object, "dtype")) text += StrCat(" of ", StrOf(object.attr("dtype")));
  if (nb::hasattr(object, "shape")) text += StrCat(", shape ", StrOf(object.attr("shape")));
  return text;
}

template <typename Array>
Array CastBytes(nb::handle object, std::string_view what, std::string_view expected) {
  Array array;
  // No implicit conversion: a converted copy is not the caller's memory.
  if (!nb::try_cast(object, array, /*convert=*/false)) {
    const std::string message = StrCat(what, ": expected ", expected, ", got ", Describe(object));
    throw nb::type_error(message.c_str());
  }
  return array;
}

}  // namespace

ReadOnlyBytes CastReadOnlyBytes(nb::handle object, std::string_view what) {
  return CastBytes<ReadOnlyBytes>(object, what, "a C-contiguous CPU uint8 array");
}

WritableBytes CastWritableBytes(nb::handle object, std::string_view what) {
  return CastBytes<WritableBytes>(object, what, "a writable C-contiguous CPU uint8 array");
}

Status CheckBufferSize(const Box& box, DType dtype, size_t nbytes, std::string_view what) {
  const size_t item_size = ItemSize(dtype);
  TS_RETURN_IF_ERROR(ValidateBox(box, item_size, what));
  const uint64_t expected = static_cast<uint64_t>(box.num_elements()) * item_size;
  if (nbytes != expected) {
    return InvalidArgumentError(StrCat(what, ": the buffer holds ", nbytes, " bytes, but ",
                                       box.ToString(), " of ", DTypeName(dtype), " needs ",
                                       expected));
  }
  return OkStatus();
}

nb::tuple ShapeTuple(const std::vector<int64_t>& shape) {
  nb::list items;
  for (int64_t extent : shape) items.append(extent);
  return nb::tuple(items);
}

}  // namespace tensorstash::python
