#include "tensorstash/coordination/single_process_coordinator.h"

namespace tensorstash {

Status SingleProcessCoordinator::KeyValueSet(std::string_view key, std::string_view value) {
  if (!values_.emplace(std::string(key), std::string(value)).second) {
    return AlreadyExistsError(StrCat("coordinator key '", key, "' is already set"));
  }
  return OkStatus();
}

Result<std::string> SingleProcessCoordinator::KeyValueGet(std::string_view key,
                                                          std::chrono::milliseconds) {
  auto it = values_.find(key);
  if (it == values_.end()) {
    return NotFoundError(StrCat("coordinator key '", key, "' is not set"));
  }
  return it->second;
}

Result<std::optional<std::string>> SingleProcessCoordinator::KeyValueTryGet(std::string_view key) {
  auto it = values_.find(key);
  if (it == values_.end()) return std::optional<std::string>();
  return std::optional<std::string>(it->second);
}

}  // namespace tensorstash
