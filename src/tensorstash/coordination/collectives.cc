#include "tensorstash/coordination/collectives.h"

#include <algorithm>
#include <optional>

#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using Clock = std::chrono::steady_clock;

// A Broadcast's value travels as "+<value>", its error as EncodeStatusForPeers does it.
constexpr std::string_view kValueMark = "+";

// One deadline for a whole collective step: each wait gets what is left of it (at least a
// millisecond, so that a value already there is still read).
class Deadline {
 public:
  explicit Deadline(std::chrono::milliseconds timeout)
      : timeout_(timeout), end_(Clock::now() + timeout) {}
  std::chrono::milliseconds left() const {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end_ - Clock::now());
    return std::max(left, std::chrono::milliseconds(1));
  }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  std::chrono::milliseconds timeout_;
  Clock::time_point end_;
};

// DeadlineExceeded naming the processes that did not publish `awaited` in time. Coordinators
// report a timed-out wait in their own ways (JAX's as an internal error): any failed wait
// counts as "did not arrive", and a message that is not a plain timeout is kept at the end.
Status NotArrived(const std::vector<int>& missing, int process_count, std::string_view awaited,
                  std::chrono::milliseconds timeout, const Status& first_error) {
  std::string names;
  for (int p : missing) names += StrCat(names.empty() ? "" : ", ", p);
  std::string message =
      StrCat("process", missing.size() > 1 ? "es " : " ", names, " of ", process_count,
             " did not arrive at '", awaited, "' within ", timeout.count() / 1000.0,
             " s (coordination_timeout): a process that was not started or restarted, that "
             "failed before it got there, or that is stuck");
  if (!absl::IsDeadlineExceeded(first_error)) {
    message += StrCat(" (the coordinator: ", first_error.message(), ")");
  }
  return DeadlineExceededError(std::move(message));
}

// The value under `key`, published by `process`, waiting at most what is left of `deadline`.
Result<std::string> AwaitKey(Coordinator& coordinator, std::string_view key, int process,
                             const Deadline& deadline) {
  Result<std::string> value = coordinator.KeyValueGet(key, deadline.left());
  if (value.ok()) return value;
  return NotArrived({process}, coordinator.process_count(), key, deadline.timeout(),
                    value.status());
}

}  // namespace

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

Status PublishValue(Coordinator& coordinator, std::string_view key_prefix, std::string_view value) {
  if (coordinator.process_count() == 1) return OkStatus();
  return coordinator.KeyValueSet(StrCat(key_prefix, coordinator.process_index()), value);
}

Result<std::map<int, std::string>> CollectValues(Coordinator& coordinator,
                                                 std::string_view key_prefix,
                                                 const std::vector<int>& processes,
                                                 std::chrono::milliseconds timeout) {
  const Deadline deadline(timeout);
  std::map<int, std::string> out;
  std::vector<int> missing;
  Status first_error;
  for (int p : processes) {
    Result<std::string> value = coordinator.KeyValueGet(StrCat(key_prefix, p), deadline.left());
    if (value.ok()) {
      out[p] = *std::move(value);
    } else {
      if (missing.empty()) first_error = value.status();
      missing.push_back(p);
    }
  }
  if (missing.empty()) return out;
  return NotArrived(missing, coordinator.process_count(), key_prefix, timeout, first_error);
}

Result<std::vector<std::string>> AllGather(Coordinator& coordinator, std::string_view key_prefix,
                                           std::string_view my_value,
                                           std::chrono::milliseconds timeout) {
  const int index = coordinator.process_index();
  const int count = coordinator.process_count();
  TS_RETURN_IF_ERROR(PublishValue(coordinator, key_prefix, my_value));
  std::vector<int> others;
  for (int p = 0; p < count; ++p) {
    if (p != index) others.push_back(p);
  }
  TS_ASSIGN_OR_RETURN(auto got, CollectValues(coordinator, key_prefix, others, timeout));
  std::vector<std::string> out(count);
  for (int p = 0; p < count; ++p) out[p] = p == index ? std::string(my_value) : std::move(got[p]);
  return out;
}

Result<std::string> Broadcast(Coordinator& coordinator, std::string_view key,
                              const Result<std::string>& from_root, int root,
                              std::chrono::milliseconds timeout, std::string_view root_failed) {
  if (coordinator.process_index() == root) {
    if (coordinator.process_count() > 1) {
      TS_RETURN_IF_ERROR(coordinator.KeyValueSet(
          key, from_root.ok() ? StrCat(kValueMark, *from_root)
                              : EncodeStatusForPeers(from_root.status())));
    }
    return from_root;
  }
  // Kept as a Result (not unwrapped into a string) so that GCC's -Wmaybe-uninitialized does not
  // misread the moved-from string.
  Result<std::string> value = AwaitKey(coordinator, key, root, Deadline(timeout));
  if (!value.ok()) return value.status();
  if (value->starts_with(kValueMark)) return value->substr(kValueMark.size());
  return Annotate(DecodeStatusFromPeer(*value),
                  root_failed.empty() ? StrCat("process ", root) : std::string(root_failed));
}

Status AgreeOnStatus(Coordinator& coordinator, std::string_view key_prefix, const Status& my_status,
                     std::chrono::milliseconds timeout,
                     const std::function<Status(const Status& gathered)>& decide) {
  const int index = coordinator.process_index();
  const int count = coordinator.process_count();
  const std::string status_prefix = StrCat(key_prefix, "status/");
  const std::string result_key = StrCat(key_prefix, "result");
  if (count == 1) {
    // One process agrees with itself, but still says where it is, as a save always did: a
    // coordinator of the caller's may follow the save there (the manager tests hold a save's
    // commit at its status).
    TS_RETURN_IF_ERROR(
        coordinator.KeyValueSet(StrCat(status_prefix, index), EncodeStatusForPeers(my_status)));
    return decide ? decide(my_status) : my_status;
  }
  TS_RETURN_IF_ERROR(PublishValue(coordinator, status_prefix, EncodeStatusForPeers(my_status)));
  if (index != 0) {
    TS_ASSIGN_OR_RETURN(std::string verdict,
                        AwaitKey(coordinator, result_key, 0, Deadline(timeout)));
    return DecodeStatusFromPeer(verdict);
  }
  // Every status is awaited, even after an error; the first error by process index wins, and a
  // process that did not arrive only when none reported an error (which says more).
  Status gathered = Annotate(my_status, "process 0");
  std::vector<int> others;
  for (int p = 1; p < count; ++p) others.push_back(p);
  const Deadline deadline(timeout);
  std::vector<int> missing;
  Status first_missing_error;
  for (int p : others) {
    Result<std::string> text =
        coordinator.KeyValueGet(StrCat(status_prefix, p), deadline.left());
    if (!text.ok()) {
      if (missing.empty()) first_missing_error = text.status();
      missing.push_back(p);
      continue;
    }
    if (gathered.ok()) gathered = Annotate(DecodeStatusFromPeer(*text), StrCat("process ", p));
  }
  if (gathered.ok() && !missing.empty()) {
    gathered = NotArrived(missing, count, status_prefix, timeout, first_missing_error);
  }
  const Status verdict = decide ? decide(gathered) : gathered;
  TS_RETURN_IF_ERROR(coordinator.KeyValueSet(result_key, EncodeStatusForPeers(verdict)));
  return verdict;
}

}  // namespace tensorstash
