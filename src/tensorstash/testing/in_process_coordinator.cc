#include "tensorstash/testing/in_process_coordinator.h"

namespace tensorstash {

Status InProcessCoordinator::Barrier(std::string_view name, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(group_->mutex_);
  auto& arrivals = group_->barrier_arrivals_[std::string(name)];
  ++arrivals;
  group_->cv_.notify_all();
  const int needed = group_->process_count_;
  if (!group_->cv_.wait_for(lock, timeout, [&] { return arrivals >= needed; })) {
    return DeadlineExceededError(
        StrCat("barrier '", name, "' timed out: ", arrivals, " of ", needed, " processes arrived"));
  }
  return OkStatus();
}

Status InProcessCoordinator::KeyValueSet(std::string_view key, std::string_view value) {
  std::lock_guard<std::mutex> lock(group_->mutex_);
  if (!group_->values_.emplace(std::string(key), std::string(value)).second) {
    return AlreadyExistsError(StrCat("coordinator key '", key, "' is already set"));
  }
  group_->cv_.notify_all();
  return OkStatus();
}

Result<std::string> InProcessCoordinator::KeyValueGet(std::string_view key,
                                                      std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(group_->mutex_);
  auto found = [&] { return group_->values_.find(key) != group_->values_.end(); };
  if (!group_->cv_.wait_for(lock, timeout, found)) {
    return DeadlineExceededError(StrCat("timed out waiting for coordinator key '", key, "'"));
  }
  return group_->values_.find(key)->second;
}

Result<std::optional<std::string>> InProcessCoordinator::KeyValueTryGet(std::string_view key) {
  std::lock_guard<std::mutex> lock(group_->mutex_);
  auto it = group_->values_.find(key);
  if (it == group_->values_.end()) return std::optional<std::string>();
  return std::optional<std::string>(it->second);
}

}  // namespace tensorstash
