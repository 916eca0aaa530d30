// Collectives: the few exchanges a multi-process job makes through its Coordinator's key-value
// store, written once: every process's value (AllGather), one process's value or error
// (Broadcast), and one verdict on how an operation went (AgreeOnStatus). The writer's commit,
// the manager and the local tier are built from them.
//
// Every process of the job calls the same collective with the same key (or key prefix), in the
// same order. A key is written once, so the caller makes it unique per call (e.g. with
// Coordinator::NextOperationId). Each call waits at most `timeout` in all, however many
// processes it waits for; a process that has not arrived by then is named in DeadlineExceeded
// with the key it was awaited under. With one process nothing is waited for, and only
// AgreeOnStatus publishes (its status, where a caller's coordinator can see the operation).
//
// Thread-safety: as Coordinator (one thread of each process at a time).
#ifndef TENSORSTASH_COORDINATION_COLLECTIVES_H_
#define TENSORSTASH_COORDINATION_COLLECTIVES_H_

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/coordination/coordinator.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

// How long a process waits for the others at any collective step, unless told otherwise: the
// one default of every coordination timeout (writer, manager, local tier, the Python fronts
// through _ext.defaults()["coordination_timeout_s"]). A wait on other processes includes the
// time they take to write their share of a save, so it is long: a stuck or lost process is
// found late, but a slow one never fails a save.
inline constexpr std::chrono::milliseconds kDefaultCoordinationTimeout = std::chrono::minutes(30);

// Statuses cross process boundaries as text: "<code>|<message>".
std::string EncodeStatusForPeers(const Status& status);
// The inverse; Internal when `text` is not such a status.
Status DecodeStatusFromPeer(std::string_view text);

// Publishes this process's `value` under "<key_prefix><process index>" (nothing with one
// process). The coordinator's error (AlreadyExists for a key used before) on failure.
Status PublishValue(Coordinator& coordinator, std::string_view key_prefix, std::string_view value);

// The values `processes` published (PublishValue) under `key_prefix`, by process index. Waits at
// most `timeout` in all; DeadlineExceeded names every process that had not published by then
// ("process 3 of 4 did not arrive at '<key_prefix>' within 30 s (coordination_timeout)").
Result<std::map<int, std::string>> CollectValues(Coordinator& coordinator,
                                                 std::string_view key_prefix,
                                                 const std::vector<int>& processes,
                                                 std::chrono::milliseconds timeout);

// Every process's value, by process index (keys "<key_prefix><p>"). Errors: as PublishValue and
// CollectValues.
Result<std::vector<std::string>> AllGather(Coordinator& coordinator, std::string_view key_prefix,
                                           std::string_view my_value,
                                           std::chrono::milliseconds timeout);

// Process `root`'s outcome, for every process, under `key`. On `root`: publishes `from_root` (a
// value or an error) and returns it. Elsewhere `from_root` is ignored and root's value is
// returned, or root's error annotated with `root_failed` (default "process <root>"), e.g.
// "process 0 could not prepare the step: <root's message>". DeadlineExceeded naming root and
// `key` when it does not publish within `timeout`.
Result<std::string> Broadcast(Coordinator& coordinator, std::string_view key,
                              const Result<std::string>& from_root, int root,
                              std::chrono::milliseconds timeout, std::string_view root_failed = {});

// One verdict on an operation, the same in every process: OK when every process's `my_status`
// is OK, else the first error by process index, annotated "process <p>" (with one process:
// `my_status` as it is). Process 0 gathers the
// statuses (keys "<key_prefix>status/<p>"; it waits for every one, even after an error, so that
// nobody still works on what it then cleans up) and publishes the verdict ("<key_prefix>result").
// `decide`, when given, runs on process 0 alone with that gathered status and returns the
// verdict instead (e.g. the commit that follows when everything went well, or a clean-up).
// A process that does not arrive in time makes the verdict DeadlineExceeded naming it, unless
// another reported an error; a process that cannot learn the verdict in time returns
// DeadlineExceeded naming process 0.
Status AgreeOnStatus(Coordinator& coordinator, std::string_view key_prefix, const Status& my_status,
                     std::chrono::milliseconds timeout,
                     const std::function<Status(const Status& gathered)>& decide = nullptr);

}  // namespace tensorstash

#endif  // TENSORSTASH_COORDINATION_COLLECTIVES_H_
