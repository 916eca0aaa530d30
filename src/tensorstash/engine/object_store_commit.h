// Steps on object stores: commit without rename (docs/format.md, "Steps on object stores").
//
// An object store cannot rename a folder into place, and an object overwritten in place can be
// read half old, half new. So a save there never writes where a reader looks:
//   <step>/attempt-<16 hex>/...   the files of one save attempt, under a fresh prefix, never
//                                 overwritten (each process writes its own objects there);
//   <step>/COMMIT                 the commit record, created with one create-only write
//                                 (KvStore::WriteIfAbsent: of two writers exactly one wins);
//                                 it names the attempt and the size and generation (ETag) of
//                                 every object in it;
//   <step>/COMMIT.<10 digits>     an overwrite: a new record numbered one past the highest.
// The step exists while <step>/COMMIT does; its content is the attempt named by the highest
// record. Readers read every object with its committed generation (ReadRangeAtGeneration), so
// an object replaced after the commit is an error naming it, never other bytes.
//
// The record protocol of engine/step_committer.h (kRecord), which explains when it is used and
// is the one caller of CommitAttempt and OpenCommittedStep outside tests.
// Thread-safety: functions of their arguments; the store must be thread-safe as KvStore is.
#ifndef TENSORSTASH_ENGINE_OBJECT_STORE_COMMIT_H_
#define TENSORSTASH_ENGINE_OBJECT_STORE_COMMIT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/format/commit_record.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

inline constexpr char kAttemptPrefix[] = "attempt-";

// The key of record `number` of step folder `dir`: 1 is "<dir>/COMMIT", n > 1 is
// "<dir>/COMMIT.<n, 10 digits>".
std::string CommitRecordKey(std::string_view dir, int64_t number);
// The number of a record's name ("COMMIT" -> 1, "COMMIT.0000000003" -> 3); nullopt otherwise.
std::optional<int64_t> ParseCommitRecordName(std::string_view name);
// Whether `name` is "attempt-<16 hex>".
bool IsAttemptName(std::string_view name);

// The numbers of the records of step `dir`, ascending (empty when it has none).
Result<std::vector<int64_t>> CommitRecordNumbers(KvStore* kv, std::string_view dir);
// The highest record number of step `dir` (0 when it has none); the store's error otherwise.
Result<int64_t> LatestCommitRecord(KvStore* kv, std::string_view dir);

// Commits the attempt in folder `work_dir` (= "<dir>/attempt-<id>") as step `dir`: `record`
// gets the attempt and the size and generation of each object of `written` (every object the
// save wrote, relative to `work_dir`, with its size), all from one listing, and is created as
// the next record. An object missing or of another size is DataLoss naming it, and nothing is
// committed (engine/publish.h, CheckWrittenFiles); objects under `work_dir` that the save did
// not write are not named. Without `overwrite` only as the first: AlreadyExists when the
// step exists, or when another writer committed it first. With `overwrite`, the record after
// the highest (a writer that loses that race tries the next number). On success, the records
// and attempts it supersedes are removed (best effort; "<dir>/COMMIT" stays, the step's mark).
// A create whose answer was lost is recognised by reading the record back. When even that fails,
// `outcome_unknown` (optional) is set: the record may exist, so the attempt must be kept.
// ResourceExhausted for a record over the format's 1 MiB (too many objects).
Status CommitAttempt(KvStore* kv, std::string_view dir, std::string_view work_dir,
                     CommitRecord record, const std::map<std::string, uint64_t>& written,
                     bool overwrite, bool* outcome_unknown = nullptr);

// A read-only view of committed step `dir` on a store that commits by records, keys as in the
// store ("<dir>/state/index", ...), resolved in the attempt of the highest record and read at
// their committed generations; "<dir>/COMMIT" reads as that record. NotFound without
// "<dir>/COMMIT". For a step without attempts (written in place), the store's own folder view.
Result<std::unique_ptr<KvStore>> OpenCommittedStep(KvStore* kv, std::string_view dir);

}  // namespace tensorstash

#endif  // TENSORSTASH_ENGINE_OBJECT_STORE_COMMIT_H_
