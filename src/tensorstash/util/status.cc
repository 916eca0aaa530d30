#include "tensorstash/util/status.h"

#include <cerrno>
#include <cstring>

namespace tensorstash {

namespace {
constexpr char kOutOfMemoryPayload[] = "tensorstash/out-of-memory";
}  // namespace

Status OutOfMemoryError(std::string_view message) {
  Status status = ResourceExhaustedError(message);
  status.SetPayload(kOutOfMemoryPayload, absl::Cord("1"));
  return status;
}

bool IsOutOfMemory(const Status& status) {
  return absl::IsResourceExhausted(status) && status.GetPayload(kOutOfMemoryPayload).has_value();
}

Status Annotate(const Status& status, std::string_view context) {
  if (status.ok()) return status;
  return Status(status.code(), StrCat(context, ": ", status.message()));
}

Status ErrnoToStatus(int error_number, std::string_view operation, std::string_view path) {
  std::string message = StrCat(operation, " '", path, "' failed: ", std::strerror(error_number));
  switch (error_number) {
    case ENOENT:
    case ENOTDIR:
      return NotFoundError(message);
    case EEXIST:
    case ENOTEMPTY:
      return AlreadyExistsError(message);
    case EINVAL:
    case ENAMETOOLONG:
      return InvalidArgumentError(message);
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
      return ResourceExhaustedError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return PermissionDeniedError(message);
    default:
      return UnknownError(message);
  }
}

}  // namespace tensorstash
