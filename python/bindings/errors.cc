#include "errors.h"

#include <Python.h>

namespace nb = nanobind;

namespace tensorstash::python {
namespace {

PyObject* ExceptionTypeFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      return PyExc_ValueError;
    case absl::StatusCode::kNotFound:
      return PyExc_FileNotFoundError;
    case absl::StatusCode::kAlreadyExists:
      return PyExc_FileExistsError;
    case absl::StatusCode::kPermissionDenied:
      return PyExc_PermissionError;
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kUnknown:
      return PyExc_OSError;
    case absl::StatusCode::kUnimplemented:
      return PyExc_NotImplementedError;
    case absl::StatusCode::kDeadlineExceeded:
      return PyExc_TimeoutError;
    case absl::StatusCode::kUnavailable:  // a peer that does not answer
      return PyExc_ConnectionError;
    default:
      return PyExc_RuntimeError;
  }
}

}  // namespace

void ThrowIfError(const Status& status) {
  if (status.ok()) return;
  // Messages quote file paths, which need not be valid UTF-8; PyErr_SetString would then raise
  // UnicodeDecodeError instead of the error itself.
  const std::string message = MessageOf(status);
  nb::object text = nb::steal(PyUnicode_DecodeUTF8(
      message.data(), static_cast<Py_ssize_t>(message.size()), "backslashreplace"));
  if (!text.is_valid()) throw nb::python_error();
  PyErr_SetObject(IsOutOfMemory(status) ? PyExc_MemoryError : ExceptionTypeFor(status.code()),
                  text.ptr());
  throw nb::python_error();
}

std::string StrOf(nb::handle object) {
  nb::object text = nb::steal(PyObject_Str(object.ptr()));
  if (!text.is_valid()) {
    PyErr_Clear();
    return "<unprintable object>";
  }
  nb::object bytes = nb::steal(PyUnicode_AsEncodedString(text.ptr(), "utf-8", "backslashreplace"));
  if (!bytes.is_valid()) {
    PyErr_Clear();
    return "<unprintable object>";
  }
  return std::string(PyBytes_AS_STRING(bytes.ptr()),
                     static_cast<size_t>(PyBytes_GET_SIZE(bytes.ptr())));
}

Status StatusFromPythonError(const nb::python_error& error) {
  std::string message = StrOf(error.value());
  if (message.empty()) message = StrOf(nb::getattr(error.type(), "__name__", error.type()));
  if (error.matches(PyExc_TimeoutError)) return DeadlineExceededError(message);
  return InternalError(message);
}

}  // namespace tensorstash::python
