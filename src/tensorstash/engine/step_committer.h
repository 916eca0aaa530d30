// StepCommitter: how a step becomes visible on a store, decided in one place.
//
// A save never writes where a reader looks, and a reader sees a step whole or not at all. How
// that is achieved depends on what the store can do; the protocol is chosen once, from the
// store's capabilities, when the committer is made:
//
//   kRename   the store renames folders (file, memory). A save writes "<step>.tmp-<nonce>",
//             then renames it to "<step>" (engine/publish.h); an overwrite moves the old step
//             aside to "<step>.old-<nonce>" first (or exchanges the two folders where the store
//             can) and removes it after. A crash between the two renames is rolled back by the
//             next save of the step, or by the manager when it opens the root (RollBack).
//   kRecord   an object store with create-only writes (S3). A save writes
//             "<step>/attempt-<nonce>/..." and commits with one create-only write of the
//             record "<step>/COMMIT" (or "<step>/COMMIT.<n>" for an overwrite) naming the
//             attempt and every object's size and generation (engine/object_store_commit.h).
//             Readers read the attempt of the highest record, each object at its recorded
//             generation. Nothing is deleted before the commit.
//   kInPlace  a store that can neither rename nor create only-if-absent. A save writes "<step>"
//             itself, COMMIT last (an overwrite deletes the old COMMIT first, so that the step is
//             never seen half old). On an object store (a server that ignores If-None-Match,
//             where a half-written object can be read) several writers and overwrites of a
//             complete step are refused: they cannot be made safe there.
//
// The native writer (checkpoint/checkpoint_writer.h) prepares and commits through it, the Orbax
// writer asks it for the protocol (Orbax's own layout has no record: it is written in place on
// object stores, renamed into place elsewhere), the reader opens committed steps through it,
// and the manager's step store and gc clean up and delete through it. docs/format.md describes
// the files; this is the one place that explains and decides the protocol.
//
// Thread-safety: a committer holds no mutable state; its methods may run on several threads
// for different steps. One save per step at a time (the manager's lock ensures it).
#ifndef TENSORSTASH_ENGINE_STEP_COMMITTER_H_
#define TENSORSTASH_ENGINE_STEP_COMMITTER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "tensorstash/format/commit_record.h"
#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

enum class CommitProtocol { kRename, kRecord, kInPlace };

// "rename", "record", "in place".
std::string_view CommitProtocolName(CommitProtocol protocol);

class StepCommitter {
 public:
  // Chooses `kv`'s protocol (above). `kv` must outlive the committer.
  explicit StepCommitter(KvStore* kv);

  CommitProtocol protocol() const { return protocol_; }

  struct PrepareOptions {
    bool overwrite = false;  // a complete step (or an Orbax checkpoint) at `dir` may be replaced
    int writers = 1;         // processes writing the step together
  };
  // Prepares a save of step folder `dir` (process 0 of a save, before anything is written):
  // rolls back an overwrite a crash interrupted, removes this step's leftovers, and checks what
  // `dir` holds (engine/step_folder.h: never a folder tensorstash did not write; AlreadyExists
  // for a complete step without `overwrite`). Returns the folder the save writes in:
  // "<dir>.tmp-<nonce>", "<dir>/attempt-<nonce>" or `dir`. FailedPrecondition for what the
  // protocol cannot do safely (kInPlace on an object store: several writers, or an overwrite;
  // kRecord: replacing an Orbax checkpoint).
  Result<std::string> Prepare(const std::string& dir, const std::string& nonce,
                              const PrepareOptions& options) const;

  struct CommitOptions {
    bool overwrite = false;
    bool sync = true;  // make the commit durable (fsync) where the store needs it
  };
  // Commits the native step written in `work_dir` (what Prepare returned, for the same `nonce`)
  // as `dir`, with `record` as its COMMIT. `written` names every file the save wrote (relative
  // to `work_dir`) with its size: one listing checks them all before anything is committed
  // (DataLoss naming a missing or resized file; engine/publish.h, CheckWrittenFiles). On
  // failure nothing new is visible and what `dir` held is as it was. With kRecord, a commit
  // whose answer was lost sets `outcome_unknown` (optional): the attempt must then be kept.
  Status Commit(const std::string& dir, const std::string& work_dir, const std::string& nonce,
                CommitRecord record, const std::map<std::string, uint64_t>& written,
                const CommitOptions& options, bool* outcome_unknown = nullptr) const;

  // Opens committed step `dir` for reading, keys as in the store ("<dir>/state/index", ...):
  // with kRecord the attempt the highest record names, each object read at its committed
  // generation; otherwise the store's view of the folder. NotFound when `dir` is not there.
  Result<std::unique_ptr<KvStore>> OpenCommitted(std::string_view dir) const;

  // Puts back step `dir` from `replaced` ("<dir>.old-<nonce>", complete) after a crash between
  // an overwrite's two renames: what is at `dir` (incomplete, ours) is removed first. kRename
  // only (FailedPrecondition otherwise).
  Status RollBack(const std::string& replaced, const std::string& dir) const;

  // Deletes step `dir`: its COMMIT first, so that a deletion cut short leaves no step that
  // looks complete, then everything else under it.
  Status Delete(const std::string& dir) const;

 private:
  KvStore* kv_;
  CommitProtocol protocol_;
};

}  // namespace tensorstash

#endif  // TENSORSTASH_ENGINE_STEP_COMMITTER_H_
