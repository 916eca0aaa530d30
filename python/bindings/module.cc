// tensorstash._ext: the native core of the tensorstash Python package. The package's Python
// modules build on it; users do not import it directly.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "errors.h"
#include "tensorstash/array/dtype.h"

namespace nb = nanobind;

namespace tensorstash::python {

namespace {

std::vector<std::string> DTypeNames() {
  std::vector<std::string> names;
  for (int i = 0; i < kNumDTypes; ++i) names.emplace_back(DTypeName(AllDTypes()[i]));
  return names;
}

size_t ItemSizeOf(const std::string& dtype) { return ItemSize(ValueOrThrow(ParseDType(dtype))); }

}  // namespace
}  // namespace tensorstash::python

NB_MODULE(_ext, m) {
  namespace py = tensorstash::python;
  m.doc() = "Native core of tensorstash: checkpoint writer, reader and manager.";
  m.def("dtype_names", &py::DTypeNames,
        "The element type names a checkpoint can store, as NumPy and ml_dtypes spell them.");
  m.def("item_size", &py::ItemSizeOf, nb::arg("dtype"),
        "Bytes per element of `dtype`; ValueError for an unknown name.");
  py::DefineWriter(m);
  py::DefineReader(m);
  py::DefineManager(m);
  py::DefineOrbaxWriter(m);
}
