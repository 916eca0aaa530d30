#include "tensorstash/checkpoint/garbage.h"

#include "tensorstash/checkpoint/object_store_commit.h"
#include "tensorstash/checkpoint/step_folder.h"
#include "tensorstash/checkpoint/step_store.h"
#include "tensorstash/kvstore/s3/aws_config.h"
#include "tensorstash/kvstore/s3/s3_kvstore.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

class Collector {
 public:
  Collector(KvStore* kv, const GarbageOptions& options) : kv_(kv), options_(options) {}

  // Removes every object under `prefix` (a folder, ending in '/'), counting its bytes.
  Status RemoveFolder(const std::string& prefix) {
    TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, kv_->List(prefix));
    if (keys.empty()) return OkStatus();  // an emptied folder some servers still list
    for (const std::string& key : keys) {
      Result<uint64_t> size = kv_->Size(key);
      if (size.ok()) report_.bytes += *size;
    }
    report_.removed.push_back(prefix);
    return options_.dry_run ? OkStatus() : kv_->DeletePrefix(prefix);
  }

  Status RemoveObject(const std::string& key) {
    Result<uint64_t> size = kv_->Size(key);
    if (absl::IsNotFound(size.status())) return OkStatus();
    TS_RETURN_IF_ERROR(size.status());
    report_.bytes += *size;
    report_.removed.push_back(key);
    return options_.dry_run ? OkStatus() : kv_->Delete(key);
  }

  // One step folder on an object store.
  Status CollectStep(const std::string& dir) {
    TS_ASSIGN_OR_RETURN(std::vector<int64_t> numbers, CommitRecordNumbers(kv_, dir));
    if (numbers.empty() || numbers.front() != 1) {
      // Never committed (or being deleted): removed when it holds only what saves write.
      TS_ASSIGN_OR_RETURN(FolderContent content, ClassifyStepFolder(kv_, dir));
      if (content == FolderContent::kTensorstashLeftover) return RemoveFolder(dir + "/");
      return OkStatus();
    }
    const std::string latest_key = CommitRecordKey(dir, numbers.back());
    TS_ASSIGN_OR_RETURN(std::string text, kv_->Read(latest_key));
    TS_ASSIGN_OR_RETURN(CommitRecord latest, DecodeCommitRecord(text, latest_key));
    for (int64_t number : numbers) {
      if (number > 1 && number < numbers.back()) {
        TS_RETURN_IF_ERROR(RemoveObject(CommitRecordKey(dir, number)));
      }
    }
    if (latest.attempt.empty()) return OkStatus();  // written in place: no attempts
    TS_ASSIGN_OR_RETURN(ListedChildren children, kv_->ListChildren(dir + "/"));
    for (const std::string& prefix : children.prefixes) {
      const std::string name = prefix.substr(dir.size() + 1, prefix.size() - dir.size() - 2);
      if (IsAttemptName(name) && name != latest.attempt) TS_RETURN_IF_ERROR(RemoveFolder(prefix));
    }
    return OkStatus();
  }

  Status AbortStaleUploads() {
    auto* s3 = dynamic_cast<S3KvStore*>(kv_);
    if (s3 == nullptr) return OkStatus();
    TS_ASSIGN_OR_RETURN(std::vector<S3KvStore::PendingUpload> uploads, s3->ListPendingUploads(""));
    const auto now = std::chrono::system_clock::now();
    for (const S3KvStore::PendingUpload& upload : uploads) {
      Result<std::chrono::system_clock::time_point> started = ParseAwsTimestamp(upload.initiated);
      if (started.ok() && now - *started < options_.upload_min_age) continue;  // may be running
      report_.aborted_uploads.push_back(upload.key);
      if (!options_.dry_run) TS_RETURN_IF_ERROR(s3->AbortUpload(upload));
    }
    return OkStatus();
  }

  GarbageReport& report() { return report_; }

 private:
  KvStore* const kv_;
  const GarbageOptions& options_;
  GarbageReport report_;
};

}  // namespace

Result<GarbageReport> CollectGarbage(KvStore* kv, const GarbageOptions& options) {
  StepStore steps(kv);
  TS_RETURN_IF_ERROR(steps.Lock());
  Collector collector(kv, options);
  if (UsesCommitRecords(*kv)) {
    TS_ASSIGN_OR_RETURN(ListedChildren top, kv->ListChildren(""));
    for (const std::string& prefix : top.prefixes) {
      const std::string name = prefix.substr(0, prefix.size() - 1);
      if (StepStore::ParseStepName(name)) TS_RETURN_IF_ERROR(collector.CollectStep(name));
    }
  } else if (!options.dry_run) {
    // Stores that rename: the cleanup a manager does when it opens.
    TS_RETURN_IF_ERROR(steps.CleanUpAndList().status());
  }
  TS_RETURN_IF_ERROR(collector.AbortStaleUploads());
  return std::move(collector.report());
}

}  // namespace tensorstash
