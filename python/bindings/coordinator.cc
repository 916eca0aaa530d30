#include "coordinator.h"

#include <Python.h>

#include <exception>
#include <utility>

#include "errors.h"

namespace nb = nanobind;

namespace tensorstash::python {
namespace {

// Keys and values cross as str. The writer only sends text, but a status message may quote a
// non-UTF-8 path; surrogateescape carries such bytes through unchanged.
nb::str ToPyStr(std::string_view text) {
  PyObject* str =
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "surrogateescape");
  if (str == nullptr) throw nb::python_error();
  return nb::steal<nb::str>(str);
}

std::string FromPyStr(nb::handle value) {
  if (!PyUnicode_Check(value.ptr())) {
    throw nb::type_error("key_value_get() must return a str");
  }
  nb::object bytes = nb::steal(PyUnicode_AsEncodedString(value.ptr(), "utf-8", "surrogateescape"));
  if (!bytes.is_valid()) throw nb::python_error();
  return std::string(PyBytes_AS_STRING(bytes.ptr()),
                     static_cast<size_t>(PyBytes_GET_SIZE(bytes.ptr())));
}

// Runs `fn` with the GIL held and turns any exception into a Status: nothing may unwind through
// the writer, which does not expect exceptions.
template <typename Fn>
Status CallPython(std::string_view method, Fn&& fn) {
  nb::gil_scoped_acquire gil;
  try {
    fn();
    return OkStatus();
  } catch (nb::python_error& error) {
    return StatusFromPythonError(error);
  } catch (const std::exception& error) {
    return InternalError(StrCat("coordinator.", method, "(): ", error.what()));
  }
}

int64_t Milliseconds(std::chrono::milliseconds timeout) {
  return static_cast<int64_t>(timeout.count());
}

}  // namespace

PyCoordinator::PyCoordinator(nb::object object, int process_index, int process_count)
    : object_(std::move(object)), process_index_(process_index), process_count_(process_count) {}

Result<std::unique_ptr<PyCoordinator>> PyCoordinator::Create(nb::object object) {
  int index = -1;
  int count = 0;
  if (!nb::try_cast(object.attr("process_index")(), index) ||
      !nb::try_cast(object.attr("process_count")(), count)) {
    return InvalidArgumentError("coordinator: process_index() and process_count() must return int");
  }
  if (count < 1 || index < 0 || index >= count) {
    return InvalidArgumentError(StrCat("coordinator: process_index() ", index,
                                       " is out of range for process_count() ", count));
  }
  return std::unique_ptr<PyCoordinator>(new PyCoordinator(std::move(object), index, count));
}

Status PyCoordinator::Barrier(std::string_view name, std::chrono::milliseconds timeout) {
  return CallPython("barrier",
                    [&] { object_.attr("barrier")(ToPyStr(name), Milliseconds(timeout)); });
}

Status PyCoordinator::KeyValueSet(std::string_view key, std::string_view value) {
  return CallPython("key_value_set",
                    [&] { object_.attr("key_value_set")(ToPyStr(key), ToPyStr(value)); });
}

Result<std::string> PyCoordinator::KeyValueGet(std::string_view key,
                                               std::chrono::milliseconds timeout) {
  std::string value;
  Status status = CallPython("key_value_get", [&] {
    value = FromPyStr(object_.attr("key_value_get")(ToPyStr(key), Milliseconds(timeout)));
  });
  if (!status.ok()) return status;
  return value;
}

Result<std::optional<std::string>> PyCoordinator::KeyValueTryGet(std::string_view key) {
  std::optional<std::string> value;
  bool has_try_get = false;
  Status status = CallPython("key_value_try_get", [&] {
    has_try_get = nb::hasattr(object_, "key_value_try_get");
    if (has_try_get) {
      nb::object got = object_.attr("key_value_try_get")(ToPyStr(key));
      if (!got.is_none()) value = FromPyStr(got);
    } else {
      value = FromPyStr(object_.attr("key_value_get")(ToPyStr(key), int64_t{0}));
    }
  });
  // A coordinator without key_value_try_get: its timeout of a zero wait means "not set yet".
  if (!has_try_get && status.code() == absl::StatusCode::kDeadlineExceeded) {
    return std::optional<std::string>();
  }
  if (!status.ok()) return status;
  return value;
}

}  // namespace tensorstash::python
