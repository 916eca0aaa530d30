#include "tensorstash/engine/object_store_commit.h"

#include <algorithm>
#include <map>
#include <vector>

#include "tensorstash/engine/publish.h"
#include "tensorstash/kvstore/read_only_kvstore.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

constexpr int kRecordDigits = 10;
// Overwriters that lose the race for a record number try the next one this many times.
constexpr int kMaxRecordRaces = 8;

// The step as one commit record describes it: keys "<dir>/<path>" are read from
// "<dir>/<attempt>/<path>" at the committed generation.
class CommittedStepView final : public ReadOnlyKvStore {
 public:
  CommittedStepView(KvStore* kv, std::string dir, std::string record_text, CommitRecord record)
      : ReadOnlyKvStore("a committed step"),
        kv_(kv),
        dir_(std::move(dir)),
        record_text_(std::move(record_text)),
        record_(std::move(record)) {}

  std::string Describe() const override { return kv_->Describe(); }

  Result<std::string> Read(std::string_view key) override {
    if (IsRecord(key)) return record_text_;
    TS_ASSIGN_OR_RETURN(const CommitObject* object, Find(key));
    std::string bytes(object->size, '\0');
    if (object->size > 0) {
      TS_RETURN_IF_ERROR(Checked(kv_->ReadRangeAtGeneration(Target(key), object->generation, 0,
                                                            object->size, bytes.data()),
                                 key));
    }
    return bytes;
  }

  Status ReadRange(std::string_view key, uint64_t offset, size_t size, void* dest) override {
    if (IsRecord(key)) return ReadFromText(record_text_, key, offset, size, dest);
    TS_ASSIGN_OR_RETURN(const CommitObject* object, Find(key));
    if (offset > object->size || size > object->size - offset) {
      return DataLossError(StrCat("'", key, "' in ", Describe(), " is truncated: it has ",
                                  object->size, " bytes, not ", offset + size));
    }
    if (size == 0) return OkStatus();
    return Checked(kv_->ReadRangeAtGeneration(Target(key), object->generation, offset, size, dest),
                   key);
  }

  Result<uint64_t> Size(std::string_view key) override {
    if (IsRecord(key)) return record_text_.size();
    TS_ASSIGN_OR_RETURN(const CommitObject* object, Find(key));
    return object->size;
  }

  Result<ObjectInfo> Stat(std::string_view key) override {
    if (IsRecord(key)) return ObjectInfo{record_text_.size(), "record"};
    TS_ASSIGN_OR_RETURN(const CommitObject* object, Find(key));
    return ObjectInfo{object->size, object->generation};
  }

  Result<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view key) override {
    TS_ASSIGN_OR_RETURN(uint64_t size, Size(key));
    return RangeReadableFile(this, std::string(key), size);
  }

  Result<std::vector<std::string>> List(std::string_view prefix) override {
    TS_RETURN_IF_ERROR(ValidatePrefix(prefix));
    std::vector<std::string> keys;
    const std::string record_key = StrCat(dir_, "/COMMIT");
    if (record_key.starts_with(prefix)) keys.push_back(record_key);
    for (const auto& [path, object] : record_.objects) {
      std::string key = StrCat(dir_, "/", path);
      if (key.starts_with(prefix)) keys.push_back(std::move(key));
    }
    std::sort(keys.begin(), keys.end());
    return keys;
  }

 private:
  bool IsRecord(std::string_view key) const {
    return key.size() == dir_.size() + 7 && key.starts_with(dir_) && key.ends_with("/COMMIT");
  }
  std::string Target(std::string_view key) const {
    return StrCat(dir_, "/", record_.attempt, key.substr(dir_.size()));
  }
  Result<const CommitObject*> Find(std::string_view key) const {
    TS_RETURN_IF_ERROR(ValidateKey(key));
    if (key.size() > dir_.size() + 1 && key.starts_with(dir_) && key[dir_.size()] == '/') {
      auto it = record_.objects.find(std::string(key.substr(dir_.size() + 1)));
      if (it != record_.objects.end()) return &it->second;
    }
    return NotFoundError(
        StrCat("'", key, "' is not an object of the committed step '", dir_, "' in ", Describe()));
  }
  // A replaced or deleted object is named with the attempt it belongs to.
  Status Checked(Status status, std::string_view key) const {
    if (status.ok()) return status;
    if (absl::IsFailedPrecondition(status) || absl::IsNotFound(status)) {
      return DataLossError(StrCat("object '", Target(key), "' of committed step '", dir_, "' in ",
                                  Describe(), " was replaced or removed after the commit (",
                                  status.message(), ")"));
    }
    return status;
  }
  static Status ReadFromText(const std::string& text, std::string_view key, uint64_t offset,
                             size_t size, void* dest) {
    if (offset > text.size() || size > text.size() - offset) {
      return DataLossError(StrCat("'", key, "' is truncated"));
    }
    std::copy_n(text.data() + offset, size, static_cast<char*>(dest));
    return OkStatus();
  }

  KvStore* const kv_;
  const std::string dir_;
  const std::string record_text_;
  const CommitRecord record_;
};

}  // namespace

Result<std::vector<int64_t>> CommitRecordNumbers(KvStore* kv, std::string_view dir) {
  const std::string prefix = StrCat(dir, "/");
  TS_ASSIGN_OR_RETURN(ListedChildren children, kv->ListChildren(prefix));
  std::vector<int64_t> numbers;
  for (const std::string& key : children.keys) {
    if (std::optional<int64_t> n =
            ParseCommitRecordName(std::string_view(key).substr(prefix.size()))) {
      numbers.push_back(*n);
    }
  }
  std::sort(numbers.begin(), numbers.end());
  return numbers;
}

std::string CommitRecordKey(std::string_view dir, int64_t number) {
  if (number <= 1) return StrCat(dir, "/", kCommitFileName);
  std::string digits = std::to_string(number);
  return StrCat(dir, "/", kCommitFileName, ".",
                std::string(kRecordDigits - std::min<size_t>(kRecordDigits, digits.size()), '0'),
                digits);
}

std::optional<int64_t> ParseCommitRecordName(std::string_view name) {
  if (name == kCommitFileName) return 1;
  const std::string prefix = StrCat(kCommitFileName, ".");
  if (!name.starts_with(prefix) || name.size() != prefix.size() + kRecordDigits)
    return std::nullopt;
  int64_t number = 0;
  if (!ParseInt(name.substr(prefix.size()), &number) || number < 2) return std::nullopt;
  return number;
}

bool IsAttemptName(std::string_view name) {
  return name.starts_with(kAttemptPrefix) &&
         IsHexId(name.substr(std::string_view(kAttemptPrefix).size()));
}

Result<int64_t> LatestCommitRecord(KvStore* kv, std::string_view dir) {
  TS_ASSIGN_OR_RETURN(std::vector<int64_t> numbers, CommitRecordNumbers(kv, dir));
  return numbers.empty() ? 0 : numbers.back();
}

Status CommitAttempt(KvStore* kv, std::string_view dir, std::string_view work_dir,
                     CommitRecord record, const std::map<std::string, uint64_t>& written,
                     bool overwrite, bool* outcome_unknown) {
  record.attempt = std::string(work_dir.substr(work_dir.rfind('/') + 1));
  TS_ASSIGN_OR_RETURN(auto there, CheckWrittenFiles(kv, std::string(work_dir), written));
  for (auto& [name, info] : there) {
    if (info.generation.empty()) {
      return FailedPreconditionError(StrCat("'", work_dir, "/", name, "' in ", kv->Describe(),
                                            ": the store's listing gives no generation (ETag)"));
    }
    record.objects[name] = {info.size, std::move(info.generation)};
  }
  const std::string text = EncodeCommitRecord(record);
  if (text.size() > kMaxCommitRecordBytes) {
    return ResourceExhaustedError(
        StrCat("the commit record of step '", dir, "' would take ", text.size(), " bytes for its ",
               record.objects.size(),
               " objects, more than the format's 1 MiB; raise target_data_file_bytes"));
  }
  std::vector<int64_t> numbers;
  int64_t committed = 0;
  for (int race = 0; race < kMaxRecordRaces && committed == 0; ++race) {
    TS_ASSIGN_OR_RETURN(numbers, CommitRecordNumbers(kv, dir));
    const bool exists = !numbers.empty() && numbers.front() == 1;
    if (exists && !overwrite) {
      return AlreadyExistsError(StrCat("step '", dir, "' already exists in ", kv->Describe(),
                                       (race > 0 ? " (another writer committed it first)" : ""),
                                       "; pass overwrite to replace it"));
    }
    if (!exists) {
      // Records without COMMIT are a deletion cut short: never read, and they must not outrank
      // the COMMIT about to be written.
      for (int64_t number : numbers) (void)kv->Delete(CommitRecordKey(dir, number));
      numbers.clear();
    }
    const int64_t next = numbers.empty() ? 1 : numbers.back() + 1;
    const std::string key = CommitRecordKey(dir, next);
    Status created = kv->WriteIfAbsent(key, text);
    if (!created.ok()) {
      // A create whose answer was lost may have landed (a retry then finds the key taken): the
      // record there is ours when it is byte for byte ours (it names our attempt).
      Result<std::string> found = kv->Read(key);
      if (found.ok() && *found == text) {
        created = OkStatus();
      } else if (found.ok() || absl::IsAlreadyExists(created)) {
        continue;  // another writer's record: the race is lost (or, overwriting, try the next)
      } else if (!absl::IsNotFound(found.status())) {
        if (outcome_unknown != nullptr) *outcome_unknown = true;
        return Annotate(created,
                        StrCat("committing step '", dir, "' (whether the record ", key,
                               " was created is unknown: ", found.status().message(), ")"));
      } else {
        return created;  // it was not created
      }
    }
    committed = next;
  }
  if (committed == 0) {
    if (!overwrite) {
      return AlreadyExistsError(StrCat("step '", dir, "' already exists in ", kv->Describe(),
                                       " (another writer committed it first)"));
    }
    return AbortedError(StrCat("step '", dir, "' in ", kv->Describe(), ": ", kMaxRecordRaces,
                               " other writers committed it while this one tried"));
  }
  // What the new record supersedes: the records below it (all but the step's mark, COMMIT) and
  // the attempts they name. Never another attempt: it may be a concurrent writer's, in
  // progress. Best effort: leftovers are never read, and `tensorstash gc` removes them. Records
  // go first, so that no record is left naming a removed attempt.
  std::vector<std::string> superseded;
  for (int64_t number : numbers) {
    if (number >= committed) continue;
    Result<std::string> old_text = kv->Read(CommitRecordKey(dir, number));
    if (!old_text.ok()) continue;
    Result<CommitRecord> old = DecodeCommitRecord(*old_text, CommitRecordKey(dir, number));
    if (old.ok() && IsAttemptName(old->attempt) && old->attempt != record.attempt) {
      superseded.push_back(old->attempt);
    }
    if (number > 1) (void)kv->Delete(CommitRecordKey(dir, number));
  }
  for (const std::string& attempt : superseded) {
    (void)kv->DeletePrefix(StrCat(dir, "/", attempt, "/"));
  }
  return OkStatus();
}

Result<std::unique_ptr<KvStore>> OpenCommittedStep(KvStore* kv, std::string_view dir) {
  TS_ASSIGN_OR_RETURN(std::vector<int64_t> numbers, CommitRecordNumbers(kv, dir));
  if (numbers.empty() || numbers.front() != 1) return kv->OpenFolderView(dir);  // no step
  const std::string key = CommitRecordKey(dir, numbers.back());
  Result<uint64_t> size = kv->Size(key);
  if (size.ok() && *size > kMaxCommitRecordBytes) {
    return DataLossError(
        StrCat("commit record '", key, "' in ", kv->Describe(), " is larger than 1 MiB"));
  }
  TS_ASSIGN_OR_RETURN(std::string text, kv->Read(key));
  TS_ASSIGN_OR_RETURN(CommitRecord record, DecodeCommitRecord(text, key));
  if (record.attempt.empty()) return kv->OpenFolderView(dir);  // written in place
  return std::unique_ptr<KvStore>(
      new CommittedStepView(kv, std::string(dir), std::move(text), std::move(record)));
}

}  // namespace tensorstash
