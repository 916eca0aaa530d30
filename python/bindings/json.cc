// tensorstash._ext.json_loads / json_dumps: JSON text <-> Python objects, for tree nodes nested
// as deeply as the format allows.
//
// Python's json module cannot: its C encoder and decoder recurse under the interpreter's
// recursion limit (1000 by default; from Python 3.12 also a fixed C limit of about 1500), while
// a tree of the format's 512 levels is about 1540 JSON levels deep (a dict level is three:
// {"entries": [[key, node]]}). nlohmann's parser does not recurse; the conversions below do, on
// the C++ stack, and refuse to go deeper than kMaxJsonDepth, the bound that tree.cc puts on tree
// JSON before parsing it. They are slower than the json module (text -> nlohmann -> Python is
// two steps), which the package therefore still uses where its recursion suffices (_tree.py).
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

nb::object ToPython(const Json& j, int depth) {
  switch (j.type()) {
    case Json::value_t::null:
      return nb::none();
    case Json::value_t::boolean:
      return nb::bool_(j.get<bool>());
    case Json::value_t::number_integer:
      return nb::int_(j.get<int64_t>());
    case Json::value_t::number_unsigned:
      return nb::steal(PyLong_FromUnsignedLongLong(j.get<uint64_t>()));
    case Json::value_t::number_float:
      return nb::float_(j.get<double>());
    case Json::value_t::string: {
      const std::string& s = j.get_ref<const std::string&>();
      return nb::str(s.data(), s.size());
    }
    case Json::value_t::array: {
      CheckDepth(depth + 1);
      nb::list list;
      for (const Json& item : j) list.append(ToPython(item, depth + 1));
      return list;
    }
    case Json::value_t::object: {
      CheckDepth(depth + 1);
      nb::dict dict;
      for (const auto& [key, value] : j.items()) {
        dict[nb::str(key.data(), key.size())] = ToPython(value, depth + 1);
      }
      return dict;
    }
    default:  // binary values and discarded documents do not come out of parsing text
      throw nb::value_error("unexpected JSON value");
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

nb::object JsonLoads(const std::string& text) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw nb::value_error("not valid JSON");
  return ToPython(j, 0);
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
  m.def("json_loads", &JsonLoads, nb::arg("text"),
        nb::sig("def json_loads(text: str) -> typing.Any"),
        "json.loads for documents nested up to the depth of a tree of MAX_TREE_DEPTH levels "
        "(Python's json module stops at about a fifth of that). ValueError for invalid or "
        "deeper JSON.");
  m.def("json_dumps", &JsonDumps, nb::arg("obj"), nb::sig("def json_dumps(obj: typing.Any) -> str"),
        "Compact json.dumps of dicts (str keys), lists, tuples, str, 64-bit int, finite float, "
        "bool and None, nested as deeply as json_loads reads. TypeError for other objects, "
        "ValueError for deeper ones, UnicodeEncodeError for a str with a lone surrogate.");
}

}  // namespace tensorstash::python
