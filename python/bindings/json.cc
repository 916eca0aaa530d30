// tensorstash._ext.json_dumps: Python objects -> JSON text, for tree nodes nested as deeply as
// the format allows.
//
// Python's json module cannot: its C encoder recurses under the interpreter's recursion limit
// (1000 by default; from Python 3.12 also a fixed C limit of about 1500), while a tree of the
// format's 512 levels is about 1540 JSON levels deep (a dict level is three:
// {"entries": [[key, node]]}). The conversion below recurses on the C++ stack and refuses to go
// deeper than kMaxJsonDepth, the bound that tree.cc puts on tree JSON when it parses it. It is
// slower than the json module (Python -> nlohmann -> text is two steps), which the package
// therefore still uses where its recursion suffices (_tree.py). The way back needs no such
// helper: a step's reader builds its tree's Python objects directly (Reader.tree, reader.cc).
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "bindings.h"
#include "errors.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/util/str_util.h"

namespace nb = nanobind;

namespace tensorstash::python {
namespace {

// Insertion order kept, as json.dumps and json.loads keep it.
using Json = nlohmann::ordered_json;

// The deepest JSON a tree of kMaxTreeDepth levels needs, with the tree.json document around it.
constexpr int kMaxJsonDepth = 3 * kMaxTreeDepth + 8;

void CheckDepth(int depth) {
  if (depth > kMaxJsonDepth) {
    throw nb::value_error(StrCat("JSON nested more than ", kMaxJsonDepth, " levels deep").c_str());
  }
}

std::string Utf8(nb::handle text) {
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(text.ptr(), &size);
  if (data == nullptr) throw nb::python_error();  // UnicodeEncodeError: a lone surrogate
  return std::string(data, static_cast<size_t>(size));
}

Json FromPython(nb::handle object, int depth) {
  PyObject* o = object.ptr();
  if (o == Py_None) return nullptr;
  if (PyBool_Check(o)) return o == Py_True;
  if (PyLong_Check(o)) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow != 0) throw nb::value_error("a JSON int must fit 64 bits");
    if (value == -1 && PyErr_Occurred()) throw nb::python_error();
    return static_cast<int64_t>(value);
  }
  if (PyFloat_Check(o)) {
    const double value = PyFloat_AS_DOUBLE(o);
    if (!std::isfinite(value)) throw nb::value_error("JSON has no inf or nan");
    return value;
  }
  if (PyUnicode_Check(o)) return Utf8(object);
  if (PyList_Check(o) || PyTuple_Check(o)) {
    CheckDepth(depth + 1);
    Json array = Json::array();
    for (nb::handle item : object) array.push_back(FromPython(item, depth + 1));
    return array;
  }
  if (PyDict_Check(o)) {
    CheckDepth(depth + 1);
    Json dict = Json::object();
    for (auto [key, value] : nb::borrow<nb::dict>(object)) {
      if (!PyUnicode_Check(key.ptr())) throw nb::type_error("JSON object keys must be str");
      dict[Utf8(key)] = FromPython(value, depth + 1);
    }
    return dict;
  }
  throw nb::type_error(
      StrCat("cannot write a ", StrOf(nb::type_name(object.type())), " as JSON").c_str());
}

std::string JsonDumps(nb::handle object) {
  try {
    return FromPython(object, 0).dump();
  } catch (const Json::exception& e) {  // dump() refuses strings that are not UTF-8
    throw nb::value_error(e.what());
  }
}

}  // namespace

void DefineJson(nb::module_& m) {
  m.attr("MAX_TREE_DEPTH") = kMaxTreeDepth;
  m.def("json_dumps", &JsonDumps, nb::arg("obj"), nb::sig("def json_dumps(obj: typing.Any) -> str"),
        "Compact json.dumps of dicts (str keys), lists, tuples, str, 64-bit int, finite float, "
        "bool and None, nested up to the depth of a tree of MAX_TREE_DEPTH levels (Python's json "
        "module stops at about a fifth of that). TypeError for other objects, "
        "ValueError for deeper ones, UnicodeEncodeError for a str with a lone surrogate.");
}

}  // namespace tensorstash::python
