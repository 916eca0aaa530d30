#include "tensorstash/coordination/coordinator.h"

#include "tensorstash/util/str_util.h"

namespace tensorstash {

std::string EncodeStatusForPeers(const Status& status) {
  return StrCat(static_cast<int>(status.code()), "|", status.message());
}

Status DecodeStatusFromPeer(std::string_view text) {
  const size_t bar = text.find('|');
  int code = 0;
  if (bar == std::string_view::npos || !ParseInt(text.substr(0, bar), &code)) {
    return InternalError(StrCat("malformed status from another process: ", text));
  }
  return Status(static_cast<absl::StatusCode>(code), std::string(text.substr(bar + 1)));
}

}  // namespace tensorstash
