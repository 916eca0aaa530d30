#include "tensorstash/engine/step_committer.h"
#include "tensorstash/manager/step_store.h"

#include <cstring>
#include <vector>

#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/engine/step_folder.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {}  // namespace

Result<std::string> StepStore::StepDir(int64_t step) {
  if (step < 0) return InvalidArgumentError(StrCat("step ", step, " is negative"));
  std::string digits = std::to_string(step);
  if (digits.size() > static_cast<size_t>(kStepDigits)) {
    return InvalidArgumentError(
        StrCat("step ", step, " does not fit in a ", kStepDigits, "-digit folder name"));
  }
  return std::string(kStepDigits - digits.size(), '0') + digits;
}

std::optional<int64_t> StepStore::ParseStepName(std::string_view name) {
  if (name.size() != kStepDigits) return std::nullopt;
  for (char c : name) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  int64_t step = 0;
  if (!ParseInt(name, &step)) return std::nullopt;
  return step;
}

Status StepStore::Lock() {
  TS_ASSIGN_OR_RETURN(lock_, kv_->TryLock(kLockKey));
  return OkStatus();
}

Result<StepStore::StepListing> StepStore::CleanUpAndList(const OpenedStep& on_open,
                                                         const MayClean& may_clean) {
  const auto cleanable = [&](const std::string& folder) -> Result<bool> {
    return may_clean ? may_clean(folder) : Result<bool>(true);
  };
  // Top-level folders (one listing with the delimiter, not every data file of every step), and
  // whether each has a COMMIT. Loose files (LOCK, stray files) are not folders.
  TS_ASSIGN_OR_RETURN(ListedChildren top, kv_->ListChildren(""));
  std::map<std::string, bool, std::less<>> folders;
  for (const std::string& prefix : top.prefixes) {
    const std::string name = prefix.substr(0, prefix.size() - 1);
    Result<uint64_t> commit = kv_->Size(StrCat(name, "/", kCommitFileName));
    // A COMMIT that is not a regular file (a directory, a symlink) counts as present: the step
    // is then checked by opening it, and reported damaged, never deleted as incomplete.
    const bool present = commit.ok() || IsNotAnObject(commit.status()) ||
                         absl::IsFailedPrecondition(commit.status());
    if (!present && !absl::IsNotFound(commit.status())) return commit.status();
    folders[name] = present;
  }
  // Folders tensorstash wrote and nothing reads: "<step>.tmp-<id>", "<step>.old-<id>" of a
  // 10-digit step, and step folders without COMMIT that hold only what a save writes (a crashed
  // save on a store without rename, or a crashed deletion: COMMIT goes first). Anything else in
  // the root is the user's and left alone (step_folder.h).
  const auto is_ours_incomplete = [&](const std::string& name) -> Result<bool> {
    TS_ASSIGN_OR_RETURN(FolderContent content, ClassifyStepFolder(kv_, name));
    return content == FolderContent::kEmpty || content == FolderContent::kTensorstashLeftover;
  };
  // An overwrite that crashed between its two renames left "<step>.old-<id>" complete and
  // <step> absent (or incomplete): the old step is the one to keep (rolled back as the writer
  // does). Only the first such folder by name, like the writer.
  std::set<std::string> restored;
  std::set<std::string> left_alone;  // not `cleanable`
  const StepCommitter committer(kv_);
  if (committer.protocol() == CommitProtocol::kRename) {
    for (const auto& [name, complete] : folders) {
      const std::optional<std::string_view> base_view = LeftoverBase(name);
      if (!base_view || !complete || !ParseStepName(*base_view) ||
          name.compare(base_view->size(), std::strlen(kOldMarker), kOldMarker) != 0) {
        continue;
      }
      const std::string base(*base_view);
      auto base_it = folders.find(base);
      if ((base_it != folders.end() && base_it->second) || restored.count(base) > 0) continue;
      TS_ASSIGN_OR_RETURN(bool may_roll_back, cleanable(name));
      if (may_roll_back && base_it != folders.end()) {
        TS_ASSIGN_OR_RETURN(may_roll_back, cleanable(base));
      }
      if (!may_roll_back) {  // an overwrite may be between its renames: both left as they are
        left_alone.insert(name);
        left_alone.insert(base);
        continue;
      }
      if (base_it != folders.end()) {
        TS_ASSIGN_OR_RETURN(bool ours, is_ours_incomplete(base));
        if (!ours) continue;  // someone else's folder took the step's name: leave both
      }
      TS_RETURN_IF_ERROR(committer.RollBack(name, base));
      restored.insert(base);
      restored.insert(name);
    }
  }
  StepListing listing;
  std::set<int64_t>& complete_steps = listing.complete;
  std::map<int64_t, std::string>& damaged_steps = listing.damaged;
  for (const std::string& name : restored) {
    std::optional<int64_t> step = ParseStepName(name);
    if (!step) continue;
    TS_ASSIGN_OR_RETURN(bool retired, IsRetired(*step));
    if (retired) {
      listing.retired.insert(*step);
      continue;
    }
    complete_steps.insert(*step);
    if (on_open) {
      Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv_, name);
      if (reader.ok()) on_open(*step, **reader);
    }
  }
  for (const auto& [name, complete] : folders) {
    if (restored.count(name) > 0) continue;
    if (const std::optional<std::string_view> base = LeftoverBase(name)) {
      if (!ParseStepName(*base) || left_alone.count(name) > 0) continue;
      TS_ASSIGN_OR_RETURN(bool may_remove, cleanable(name));
      if (may_remove) TS_RETURN_IF_ERROR(kv_->DeletePrefix(name + "/"));
      continue;
    }
    std::optional<int64_t> step = ParseStepName(name);
    if (!step) continue;  // not ours: left alone
    if (complete) {
      // A retired step is a committed step retention dropped: not listed, and not opened (it
      // may refer to the data of steps deleted since; only kept steps' references must hold).
      TS_ASSIGN_OR_RETURN(bool retired, IsRetired(*step));
      if (retired) {
        listing.retired.insert(*step);
        continue;
      }
      // Listed only when it opens: a damaged COMMIT (or tree.json, index) would otherwise be the
      // latest step and fail at restore. It is reported, never deleted.
      Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv_, name);
      if (reader.ok()) {
        complete_steps.insert(*step);
        if (on_open) on_open(*step, **reader);
      } else {
        damaged_steps[*step] = std::string(reader.status().message());
      }
      continue;
    }
    // No managed save runs while we hold the lock, so an incomplete step of ours is dead (or,
    // for gc, not `cleanable`: written too recently).
    if (left_alone.count(name) > 0) continue;
    TS_ASSIGN_OR_RETURN(bool ours, is_ours_incomplete(name));
    if (!ours) continue;
    TS_ASSIGN_OR_RETURN(bool may_remove, cleanable(name));
    if (may_remove) TS_RETURN_IF_ERROR(kv_->DeletePrefix(name + "/"));
  }
  return listing;
}

Status StepStore::Retire(int64_t step) {
  TS_ASSIGN_OR_RETURN(std::string dir, StepDir(step));
  const std::string key = StrCat(dir, "/", kRetiredFileName);
  TS_RETURN_IF_ERROR(kv_->Write(
      key, "dropped by retention; kept for the data of steps that depend on it (incremental)\n"));
  return kv_->Sync(key);
}

Result<bool> StepStore::IsRetired(int64_t step) {
  TS_ASSIGN_OR_RETURN(std::string dir, StepDir(step));
  Result<uint64_t> size = kv_->Size(StrCat(dir, "/", kRetiredFileName));
  if (size.ok()) return true;
  if (absl::IsNotFound(size.status())) return false;
  return size.status();
}

Status StepStore::DeleteStep(int64_t step) {
  TS_ASSIGN_OR_RETURN(std::string dir, StepDir(step));
  return StepCommitter(kv_).Delete(dir);
}

}  // namespace tensorstash
