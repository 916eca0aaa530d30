// Retries with exponential backoff and jitter, for object-store drivers: the driver gives a
// function that sends one attempt and a classifier that says which outcomes are worth another
// attempt (S3: 5xx, SlowDown, a reset connection; never 304 or 412); the runner does the rest.
//
//   TS_ASSIGN_OR_RETURN(HttpResponse response,
//                       RunWithRetries<HttpResponse>(policy, what, send_once, classify));
//
// RunWithRetries makes at most policy.max_attempts attempts (at least one), sleeping
// policy.Backoff(n) before attempt n (n >= 1). It returns the first outcome the classifier calls
// an answer (a success or a failure alike). When every attempt was retryable, it returns the last
// attempt's result if that was a success (a final 503 is the caller's to judge, with its body),
// and otherwise UnavailableError "<last failure> (after N attempts)".
//
// Thread-safety: RunWithRetries may run on several threads at once; Backoff is thread-safe.
#ifndef TENSORSTASH_KVSTORE_OBJECT_STORE_RETRY_H_
#define TENSORSTASH_KVSTORE_OBJECT_STORE_RETRY_H_

#include <chrono>
#include <functional>
#include <optional>
#include <string_view>
#include <thread>

#include "tensorstash/util/status.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {

struct RetryPolicy {
  int max_attempts = 8;  // the first included
  std::chrono::milliseconds initial_backoff{50};
  std::chrono::milliseconds max_backoff{5000};

  // The wait before attempt `attempt` (1 = the first retry): a random duration in [cap/2, cap],
  // cap = min(max_backoff, initial_backoff * 2^attempt). The jitter keeps many clients that failed
  // together from retrying together.
  std::chrono::milliseconds Backoff(int attempt) const;
};

// What the classifier says of one attempt's outcome: nullopt when it is an answer (returned as
// is), or the status that describes it when it is worth another attempt (kept as the last
// failure, e.g. UnavailableError("reading 'k': HTTP 503")).
template <typename R>
using RetryClassifier = std::function<std::optional<Status>(const Result<R>&)>;

// `attempts`, when not null, gets how many attempts were made (1 = no retry).
template <typename R>
Result<R> RunWithRetries(const RetryPolicy& policy, const std::function<Result<R>()>& send,
                         const RetryClassifier<R>& classify, int* attempts = nullptr) {
  const int max_attempts = policy.max_attempts < 1 ? 1 : policy.max_attempts;
  Status last = OkStatus();
  for (int attempt = 0; attempt < max_attempts; ++attempt) {
    if (attempts != nullptr) *attempts = attempt + 1;
    if (attempt > 0) std::this_thread::sleep_for(policy.Backoff(attempt));
    Result<R> outcome = send();
    std::optional<Status> retry = classify(outcome);
    if (!retry.has_value()) return outcome;
    if (attempt + 1 == max_attempts && outcome.ok()) return outcome;
    last = retry->ok() ? UnavailableError("a retryable outcome") : *std::move(retry);
  }
  return UnavailableError(StrCat(last.message(), " (after ", max_attempts, " attempts)"));
}

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OBJECT_STORE_RETRY_H_
