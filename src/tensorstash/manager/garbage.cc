#include "tensorstash/manager/garbage.h"

#include <cstring>
#include <optional>
#include <set>

#include "tensorstash/engine/object_store_commit.h"
#include "tensorstash/engine/step_committer.h"
#include "tensorstash/engine/step_folder.h"
#include "tensorstash/manager/step_dependencies.h"
#include "tensorstash/manager/step_store.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/format/orbax_names.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

class Collector {
 public:
  Collector(KvStore* kv, const GarbageOptions& options)
      : kv_(kv), options_(options), now_(std::chrono::system_clock::now()) {}

  // The store's pending writes (S3's multipart uploads): one under a folder makes it recent.
  Status ListUploads() {
    TS_ASSIGN_OR_RETURN(uploads_, kv_->ListPendingWrites(""));
    return OkStatus();
  }

  bool Recent(std::chrono::system_clock::time_point when) const {
    return now_ - when < options_.min_age;
  }

  // Whether anything under `folder` (no trailing '/') was written within min_age: its objects'
  // times and, on S3, the start of uploads into it. A folder with nothing in it counts as
  // recent: a save may have just made it, and it holds no bytes to reclaim. Recent folders are
  // reported in kept_young.
  Result<bool> Old(const std::string& folder) {
    const std::string prefix = folder + "/";
    TS_ASSIGN_OR_RETURN(std::vector<ListedObject> objects, kv_->ListWithInfo(prefix));
    bool recent = objects.empty();
    for (const ListedObject& object : objects) recent = recent || Recent(object.info.modified);
    for (const PendingWrite& upload : uploads_) {
      if (!upload.key.starts_with(prefix)) continue;
      recent = recent || !upload.started || Recent(*upload.started);
    }
    if (recent) report_.kept_young.push_back(prefix);
    return !recent;
  }

  // Removes every object under `prefix` (a folder, ending in '/'), counting its bytes.
  Status RemoveFolder(const std::string& prefix) {
    TS_ASSIGN_OR_RETURN(std::vector<ListedObject> objects, kv_->ListWithInfo(prefix));
    if (objects.empty()) return OkStatus();  // an emptied folder some servers still list
    for (const ListedObject& object : objects) report_.bytes += object.info.size;
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
      // Never committed (or being deleted): removed when it holds only what saves write and
      // nothing in it is recent (a save without a lock may be writing its first attempt).
      TS_ASSIGN_OR_RETURN(FolderContent content, ClassifyStepFolder(kv_, dir));
      if (content != FolderContent::kTensorstashLeftover) return OkStatus();
      TS_ASSIGN_OR_RETURN(bool old, Old(dir));
      return old ? RemoveFolder(dir + "/") : OkStatus();
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
      if (!IsAttemptName(name) || name == latest.attempt) continue;
      // An attempt the record does not name may be an overwrite in flight.
      TS_ASSIGN_OR_RETURN(bool old, Old(prefix.substr(0, prefix.size() - 1)));
      if (old) TS_RETURN_IF_ERROR(RemoveFolder(prefix));
    }
    return OkStatus();
  }

  // Orbax's temporary folders at the top of the root ("<name>.orbax-checkpoint-tmp-<id>"): an
  // interrupted Orbax save or `tensorstash convert --to orbax`, once nothing in them is recent.
  Status CollectOrbaxTemporaries(const ListedChildren& top) {
    for (const std::string& prefix : top.prefixes) {
      const std::string name = prefix.substr(0, prefix.size() - 1);
      const size_t marker = name.rfind(kOrbaxTmpMarker);
      if (marker == std::string::npos || marker == 0 ||
          name.compare(marker + std::strlen(kOrbaxTmpMarker), 1, "-") != 0) {
        continue;
      }
      TS_ASSIGN_OR_RETURN(bool old, Old(name));
      if (old) TS_RETURN_IF_ERROR(RemoveFolder(prefix));
    }
    return OkStatus();
  }

  // Retired steps (dropped by a manager's retention, kept for the data of incremental steps)
  // that no other committed step refers to any more: deleted whole, COMMIT first, each before
  // the steps it depends on. Reachability comes from every committed step that is not retired
  // (a damaged one's record when it can be read), so gc never removes data a step refers to.
  Status CollectRetired(const ListedChildren& top, StepStore* steps) {
    std::set<int64_t> retired, others;
    for (const std::string& prefix : top.prefixes) {
      const std::string name = prefix.substr(0, prefix.size() - 1);
      const std::optional<int64_t> step = StepStore::ParseStepName(name);
      if (!step) continue;
      Result<uint64_t> commit = kv_->Size(StrCat(name, "/", kCommitFileName));
      if (absl::IsNotFound(commit.status())) continue;
      TS_ASSIGN_OR_RETURN(bool is_retired, steps->IsRetired(*step));
      (is_retired ? retired : others).insert(*step);
    }
    if (retired.empty()) return OkStatus();
    StepDependencies dependencies(kv_);
    TS_ASSIGN_OR_RETURN(StepDependencies::Sorted sorted,
                        dependencies.Sort(/*kept=*/{}, /*also_protecting=*/others, retired));
    for (int64_t step : sorted.remove) {
      TS_ASSIGN_OR_RETURN(std::string dir, StepStore::StepDir(step));
      TS_ASSIGN_OR_RETURN(std::vector<ListedObject> objects, kv_->ListWithInfo(dir + "/"));
      for (const ListedObject& object : objects) report_.bytes += object.info.size;
      report_.removed.push_back(dir + "/");
      if (!options_.dry_run) TS_RETURN_IF_ERROR(StepCommitter(kv_).Delete(dir));
    }
    return OkStatus();
  }

  Status AbortStaleUploads() {
    for (const PendingWrite& upload : uploads_) {
      if (!upload.started || Recent(*upload.started)) continue;  // may be running
      report_.aborted_uploads.push_back(upload.key);
      if (!options_.dry_run) TS_RETURN_IF_ERROR(kv_->AbortPendingWrite(upload));
    }
    return OkStatus();
  }

  GarbageReport& report() { return report_; }

 private:
  KvStore* const kv_;
  const GarbageOptions& options_;
  const std::chrono::system_clock::time_point now_;
  std::vector<PendingWrite> uploads_;
  GarbageReport report_;
};

}  // namespace

Result<GarbageReport> CollectGarbage(KvStore* kv, const GarbageOptions& options) {
  if (options.min_age.count() < 0) {
    return InvalidArgumentError(StrCat("gc's min_age must not be negative (", options.min_age.count(),
                                       " s)"));
  }
  StepStore steps(kv);
  TS_RETURN_IF_ERROR(steps.Lock());
  Collector collector(kv, options);
  TS_RETURN_IF_ERROR(collector.ListUploads());
  TS_ASSIGN_OR_RETURN(ListedChildren top, kv->ListChildren(""));
  if (StepCommitter(kv).protocol() == CommitProtocol::kRecord) {
    for (const std::string& prefix : top.prefixes) {
      const std::string name = prefix.substr(0, prefix.size() - 1);
      if (StepStore::ParseStepName(name)) TS_RETURN_IF_ERROR(collector.CollectStep(name));
    }
  } else if (!options.dry_run) {
    // Stores that rename: the cleanup a manager does when it opens, but only of what is old.
    TS_RETURN_IF_ERROR(
        steps.CleanUpAndList(nullptr, [&](const std::string& folder) { return collector.Old(folder); })
            .status());
  }
  TS_RETURN_IF_ERROR(collector.CollectOrbaxTemporaries(top));
  TS_RETURN_IF_ERROR(collector.CollectRetired(top, &steps));
  TS_RETURN_IF_ERROR(collector.AbortStaleUploads());
  return std::move(collector.report());
}

}  // namespace tensorstash
