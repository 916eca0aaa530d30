#include "tensorstash/engine/step_committer.h"

#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "tensorstash/engine/layout.h"
#include "tensorstash/engine/object_store_commit.h"
#include "tensorstash/engine/publish.h"
#include "tensorstash/engine/step_folder.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

CommitProtocol ChooseProtocol(const KvStore& kv) {
  if (kv.SupportsRename()) return CommitProtocol::kRename;
  const KvStoreCapabilities caps = kv.Capabilities();
  if (caps.object_store && caps.conditional_write) return CommitProtocol::kRecord;
  // A store that neither renames nor creates only-if-absent: the step is written in place.
  return CommitProtocol::kInPlace;
}

}  // namespace

std::string_view CommitProtocolName(CommitProtocol protocol) {
  switch (protocol) {
    case CommitProtocol::kRename:
      return "rename";
    case CommitProtocol::kRecord:
      return "record";
    case CommitProtocol::kInPlace:
      return "in place";
  }
  return "unknown";
}

StepCommitter::StepCommitter(KvStore* kv) : kv_(kv), protocol_(ChooseProtocol(*kv)) {}

Result<std::string> StepCommitter::Prepare(const std::string& dir, const std::string& nonce,
                                           const PrepareOptions& options) const {
  KvStore* const kv = kv_;
  // What is at <dir> decides what the save may do (step_folder.h): never delete a folder that
  // tensorstash did not write.
  TS_ASSIGN_OR_RETURN(FolderContent content, ClassifyStepFolder(kv, dir));
  if (protocol_ == CommitProtocol::kRecord) {
    // An object store: the files go under a fresh attempt prefix, and nothing is deleted here
    // (an attempt without a record may be another writer's, in progress; object_store_commit.h).
    TS_ASSIGN_OR_RETURN(content, CheckSaveDestination(kv, dir, options.overwrite));
    if (content == FolderContent::kOrbaxCheckpoint) {
      return FailedPreconditionError(
          StrCat("'", dir, "' in ", kv->Describe(),
                 " holds an Orbax checkpoint, which an object store cannot replace in place; "
                 "delete it first"));
    }
    return StrCat(dir, "/", kAttemptPrefix, nonce);
  }
  if (protocol_ == CommitProtocol::kInPlace && kv->Capabilities().object_store &&
      ((options.overwrite && content == FolderContent::kTensorstashStep) || options.writers > 1)) {
    // Without create-only writes a step can only be written in place, by one writer.
    return FailedPreconditionError(
        StrCat(kv->Describe(), " does not honour create-only writes (If-None-Match), so ",
               options.overwrite ? "overwriting a step" : "a save by several processes",
               " cannot be made safe there and is refused"));
  }
  if (protocol_ == CommitProtocol::kRename) {
    // Leftovers of earlier saves of this step: "<dir>.tmp-<id>" (failed or crashed saves) and
    // "<dir>.old-<id>" (a replaced step whose removal was cut short). When <dir> has no COMMIT
    // (nor anything else but our leftovers) and an ".old-" folder has one, a crash hit an
    // overwrite between its two renames: the old step is put back first so that it is not lost.
    // (One save per step at a time: a second writer of the same step would see the first one's
    // folder as a leftover.)
    TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, kv->List(dir + "."));
    std::set<std::string> leftovers;
    for (const std::string& key : keys) {
      const size_t slash = key.find('/', dir.size());
      if (slash == std::string::npos) continue;
      const std::string folder = key.substr(0, slash);
      // Only "<dir>.tmp-<id>" and "<dir>.old-<id>": not "<dir>.b.tmp-<id>" (step "<dir>.b").
      if (LeftoverBase(folder) == std::string_view(dir)) leftovers.insert(folder);
    }
    for (const std::string& folder : leftovers) {
      const bool rollback_possible =
          content == FolderContent::kEmpty || content == FolderContent::kTensorstashLeftover;
      if (rollback_possible &&
          folder.compare(dir.size(), std::strlen(kOldMarker), kOldMarker) == 0) {
        // An error here must not read as "no COMMIT": the folder may hold the only copy of a
        // committed step, which the deletion below would destroy.
        Result<uint64_t> old_commit = kv->Size(StrCat(folder, "/", kCommitFileName));
        if (!old_commit.ok() && !absl::IsNotFound(old_commit.status())) {
          return old_commit.status();
        }
        if (old_commit.ok()) {
          TS_RETURN_IF_ERROR(RollBack(folder, dir));
          content = FolderContent::kTensorstashStep;
          continue;
        }
      }
      TS_RETURN_IF_ERROR(kv->DeletePrefix(folder + "/"));
    }
  }
  // AlreadyExists for a complete step without `overwrite`, and for anything not ours.
  TS_ASSIGN_OR_RETURN(content, CheckSaveDestination(kv, dir, options.overwrite));
  // An empty folder, or a crashed save's or deletion's leftover: nothing in it is ever read.
  if (content == FolderContent::kEmpty || content == FolderContent::kTensorstashLeftover) {
    TS_RETURN_IF_ERROR(kv->DeletePrefix(dir + "/"));
  }
  if (protocol_ == CommitProtocol::kRename) {
    // What is left at <dir> (a step or an Orbax checkpoint to overwrite) is replaced at publish.
    const std::string temp = StrCat(dir, kTempMarker, nonce);
    TS_RETURN_IF_ERROR(kv->DeletePrefix(temp + "/"));
    return temp;
  }
  // Without rename the step is rewritten in place; removing COMMIT first makes it invisible.
  if (content == FolderContent::kTensorstashStep) {
    TS_RETURN_IF_ERROR(kv->Delete(StrCat(dir, "/", kCommitFileName)));
  }
  TS_RETURN_IF_ERROR(kv->DeletePrefix(dir + "/"));
  return dir;
}

Status StepCommitter::Commit(const std::string& dir, const std::string& work_dir,
                             const std::string& nonce, CommitRecord record,
                             const std::map<std::string, uint64_t>& written,
                             const CommitOptions& options, bool* outcome_unknown) const {
  if (protocol_ == CommitProtocol::kRecord) {  // a create-only record names the attempt
    return CommitAttempt(kv_, dir, work_dir, std::move(record), written, options.overwrite,
                         outcome_unknown);
  }
  TS_RETURN_IF_ERROR(CheckWrittenFiles(kv_, work_dir, written).status());
  const std::string commit_key = StrCat(work_dir, "/", kCommitFileName);
  TS_RETURN_IF_ERROR(kv_->Write(commit_key, EncodeCommitRecord(record)));
  // Sync(key) also syncs the key's folder, work_dir: its entries (COMMIT, state/) are durable.
  if (options.sync) TS_RETURN_IF_ERROR(kv_->Sync(commit_key));
  if (protocol_ == CommitProtocol::kInPlace) return OkStatus();  // COMMIT, last, was the commit
  // Rename the finished folder into place; what <dir> held (an overwrite) is moved aside first
  // and removed after. On failure PublishFolder puts everything back as it was.
  return PublishFolder(kv_, work_dir, dir, StrCat(dir, kOldMarker, nonce), options.sync);
}

Result<std::unique_ptr<KvStore>> StepCommitter::OpenCommitted(std::string_view dir) const {
  if (protocol_ != CommitProtocol::kRecord) return kv_->OpenFolderView(dir);
  return OpenCommittedStep(kv_, dir);
}

Status StepCommitter::RollBack(const std::string& replaced, const std::string& dir) const {
  if (protocol_ != CommitProtocol::kRename) {
    return FailedPreconditionError(StrCat("no overwrite to roll back on ", kv_->Describe(),
                                          ", which commits by ", CommitProtocolName(protocol_)));
  }
  TS_RETURN_IF_ERROR(kv_->DeletePrefix(dir + "/"));
  return kv_->RenameDirectory(replaced, dir);
}

Status StepCommitter::Delete(const std::string& dir) const {
  Status commit = kv_->Delete(StrCat(dir, "/", kCommitFileName));
  if (!commit.ok() && !absl::IsNotFound(commit)) return commit;
  return kv_->DeletePrefix(dir + "/");
}

}  // namespace tensorstash
