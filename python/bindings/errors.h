// Status <-> Python exceptions: the one place where a non-OK Status becomes a Python exception,
// and where a Python exception (raised by a Python coordinator) becomes a Status.
//
// Thread-safety: every function here needs the GIL.
#ifndef TENSORSTASH_PYTHON_BINDINGS_ERRORS_H_
#define TENSORSTASH_PYTHON_BINDINGS_ERRORS_H_

#include <nanobind/nanobind.h>

#include <string>
#include <utility>

#include "tensorstash/util/status.h"

namespace tensorstash::python {

// Raises the Python exception that matches `status.code()` (see errors.cc), with the status
// message unchanged, by throwing nanobind::python_error. Does nothing for OK.
void ThrowIfError(const Status& status);

template <typename T>
T ValueOrThrow(Result<T> result) {
  ThrowIfError(result.status());
  return std::move(result).value();
}

// The exception held by `error` as a Status: DeadlineExceeded for TimeoutError (and its
// subclasses), Internal otherwise. The message is str(exception), or the exception's type name
// when that is empty.
Status StatusFromPythonError(const nanobind::python_error& error);

// UTF-8 text of a Python object's str(); undecodable characters are backslash-escaped so that
// building an error message never fails.
std::string StrOf(nanobind::handle object);

}  // namespace tensorstash::python

#endif  // TENSORSTASH_PYTHON_BINDINGS_ERRORS_H_
