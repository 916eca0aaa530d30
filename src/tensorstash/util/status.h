// Status and Result: how every fallible call in tensorstash reports failure.
//
// The core never throws. A function that can fail returns `Status` (absl::Status) or
// `Result<T>` (absl::StatusOr<T>). Messages name the thing that failed: the key, the file, the
// array path, the chunk. The codes carry meaning the fronts rely on:
//   InvalidArgument  - the caller's input is wrong (bad key, shape, dtype, option).
//   NotFound         - a key, file, step or array does not exist.
//   AlreadyExists    - a complete step is already there.
//   DataLoss         - stored bytes are corrupt, truncated or inconsistent.
//   FailedPrecondition - the request cannot be served in the current state (e.g. no COMMIT).
//   Unimplemented    - a newer format version or an unsupported conversion.
//   Internal / Unknown - an OS error or a broken invariant; the message carries errno text.
#ifndef TENSORSTASH_UTIL_STATUS_H_
#define TENSORSTASH_UTIL_STATUS_H_

#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {

using Status = absl::Status;
template <typename T>
using Result = absl::StatusOr<T>;

inline Status OkStatus() { return absl::OkStatus(); }

// Status constructors that take std::string_view (Debian's Abseil wants absl::string_view).
#define TS_DEFINE_ERROR_(Name, Code)                             \
  inline Status Name(std::string_view message) {                 \
    return Status(absl::StatusCode::Code, std::string(message)); \
  }
TS_DEFINE_ERROR_(InvalidArgumentError, kInvalidArgument)
TS_DEFINE_ERROR_(NotFoundError, kNotFound)
TS_DEFINE_ERROR_(AlreadyExistsError, kAlreadyExists)
TS_DEFINE_ERROR_(DataLossError, kDataLoss)
TS_DEFINE_ERROR_(FailedPreconditionError, kFailedPrecondition)
TS_DEFINE_ERROR_(UnimplementedError, kUnimplemented)
TS_DEFINE_ERROR_(InternalError, kInternal)
TS_DEFINE_ERROR_(UnknownError, kUnknown)
TS_DEFINE_ERROR_(ResourceExhaustedError, kResourceExhausted)
TS_DEFINE_ERROR_(PermissionDeniedError, kPermissionDenied)
TS_DEFINE_ERROR_(DeadlineExceededError, kDeadlineExceeded)
TS_DEFINE_ERROR_(AbortedError, kAborted)
TS_DEFINE_ERROR_(OutOfRangeError, kOutOfRange)
TS_DEFINE_ERROR_(CancelledError, kCancelled)
TS_DEFINE_ERROR_(UnavailableError, kUnavailable)
#undef TS_DEFINE_ERROR_

// ResourceExhausted for memory that could not be allocated (rather than storage that is full:
// the fronts raise MemoryError for it, not OSError); IsOutOfMemory tells it apart.
Status OutOfMemoryError(std::string_view message);
bool IsOutOfMemory(const Status& status);

// The message of a status as a std::string.
inline std::string MessageOf(const Status& status) { return std::string(status.message()); }

// Returns `status` with `context` prepended to its message ("context: message"); OK stays OK.
Status Annotate(const Status& status, std::string_view context);

// Turns an errno value from a call on `path` into a Status with a matching code:
// ENOENT -> NotFound, EEXIST -> AlreadyExists, EINVAL/ENAMETOOLONG -> InvalidArgument,
// ENOSPC/EDQUOT -> ResourceExhausted, EACCES/EPERM -> PermissionDenied, else Unknown.
Status ErrnoToStatus(int error_number, std::string_view operation, std::string_view path);

}  // namespace tensorstash

#define TS_STATUS_CONCAT_INNER_(a, b) a##b
#define TS_STATUS_CONCAT_(a, b) TS_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (a Status); returns it from the current function when it is not OK.
#define TS_RETURN_IF_ERROR(expr)               \
  do {                                         \
    ::tensorstash::Status ts_status_ = (expr); \
    if (!ts_status_.ok()) return ts_status_;   \
  } while (false)

// Evaluates `rexpr` (a Result<T>); on error returns its status, else moves the value into `lhs`.
#define TS_ASSIGN_OR_RETURN(lhs, rexpr) \
  TS_ASSIGN_OR_RETURN_IMPL_(TS_STATUS_CONCAT_(ts_result_, __LINE__), lhs, rexpr)
#define TS_ASSIGN_OR_RETURN_IMPL_(result, lhs, rexpr)  \
  auto result = (rexpr);                               \
  if (!result.ok()) return std::move(result).status(); \
  lhs = std::move(result).value()

#endif  // TENSORSTASH_UTIL_STATUS_H_
