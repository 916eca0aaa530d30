#include "tensorstash/tiers/multi_tier_manager.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <utility>

#include "tensorstash/array/box.h"
#include "tensorstash/array/dtype.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {

MultiTierManager::MultiTierManager(std::unique_ptr<CheckpointManager> persistent,
                                   std::unique_ptr<LocalTier> local, KvStore* persistent_kv)
    : persistent_(std::move(persistent)), local_(std::move(local)), persistent_kv_(persistent_kv) {}

MultiTierManager::~MultiTierManager() { (void)Close(); }

Result<std::unique_ptr<MultiTierManager>> MultiTierManager::Open(KvStore* persistent,
                                                                 MultiTierOptions options) {
  if (options.local.coordinator == nullptr) {
    options.local.coordinator = options.persistent.coordinator;
  }
  Result<std::unique_ptr<CheckpointManager>> manager =
      CheckpointManager::Open(persistent, std::move(options.persistent));
  if (!manager.ok()) return manager.status();
  if (options.local.run.empty() &&
      (options.local.coordinator == nullptr || options.local.coordinator->process_index() == 0)) {
    Result<std::string> run_id = (*manager)->RunId();
    if (!run_id.ok()) return run_id.status();
    options.local.run = StrCat(
        options.persistent_name.empty() ? persistent->Describe() : options.persistent_name, " ",
        *run_id);
  }
  Result<std::unique_ptr<LocalTier>> local = LocalTier::Open(std::move(options.local));
  if (!local.ok()) return local.status();
  return std::unique_ptr<MultiTierManager>(
      new MultiTierManager(*std::move(manager), *std::move(local), persistent));
}

std::optional<SaveRequest> WriteBackRequest(const StepSource& source,
                                            std::vector<RestoredBox> boxes, Codec codec,
                                            int zstd_level) {
  std::map<std::string_view, size_t> index;
  for (size_t i = 0; i < source.arrays().size(); ++i) index[source.arrays()[i].path] = i;
  SaveRequest request;
  request.tree = source.tree();
  for (const ArrayMetadata& a : source.arrays()) {
    ArrayToSave array;
    array.spec.path = a.path;
    array.spec.dtype = a.dtype;
    array.spec.shape = a.shape();
    array.spec.codec = codec;
    array.spec.zstd_level = zstd_level;
    // The stored chunks' size as the target, so that the holding gets the stored chunk grid (the
    // one the other holdings of the save have) whatever the writer's default.
    int64_t chunk_bytes = static_cast<int64_t>(ItemSize(a.dtype));
    for (int64_t extent : a.grid.chunk_shape) chunk_bytes *= std::max<int64_t>(1, extent);
    array.spec.target_chunk_bytes = chunk_bytes;
    request.arrays.push_back(std::move(array));
  }
  for (const RestoredBox& restored : boxes) {
    auto found = index.find(restored.request.path);
    if (found == index.end()) return std::nullopt;
    const ArrayMetadata& stored = source.arrays()[found->second];
    if (restored.request.dtype != stored.dtype ||
        !Box::FromShape(stored.shape()).Contains(restored.request.box) ||
        restored.buffer == nullptr ||
        restored.buffer->size() !=
            static_cast<uint64_t>(restored.request.box.num_elements()) * ItemSize(stored.dtype)) {
      return std::nullopt;  // a cast, or zeros past the stored shape: not the bytes as stored
    }
    std::vector<ShardData>& shards = request.arrays[found->second].shards;
    // Replicas of a box (devices holding the same block) are one shard of the holding.
    bool seen = false;
    for (const ShardData& shard : shards) seen = seen || shard.box == restored.request.box;
    if (seen) continue;
    shards.push_back({restored.request.box, restored.buffer->data(), 0, 1, /*stable=*/true});
  }
  request.keep_alive = std::make_shared<std::vector<RestoredBox>>(std::move(boxes));
  return request;
}

bool MultiTierManager::ShouldSave(int64_t step) const {
  return persistent_->ShouldSave(step) || local_->ShouldSave(step);
}

Result<bool> MultiTierManager::Save(int64_t step, SaveRequest request, bool async, bool force,
                                    SaveStats* stats) {
  const bool persistent_due = force || persistent_->ShouldSave(step);
  const bool local_due = force || local_->ShouldSave(step);
  if (local_due) {
    // A copy: the request's arrays point at the caller's buffers, which both tiers read.
    Result<bool> saved = local_->Save(step, persistent_due ? request : std::move(request), async);
    if (!saved.ok() && !persistent_due) return saved.status();
    // The persistent save is collective: this process takes part whatever became of its local
    // one (the others are waiting for it); the local failure is a warning then.
    if (!saved.ok()) {
      local_->Warn(StrCat("local save of step ", step, " failed: ", saved.status().message()));
    }
  }
  if (!persistent_due) return local_due;
  TS_RETURN_IF_ERROR(async ? persistent_->SaveAsync(step, std::move(request))
                           : persistent_->Save(step, std::move(request), stats));
  return true;
}

Status MultiTierManager::GatherJob() {
  // The local tier's work in flight first: a save's retention deletes older local steps on the
  // tier's worker, and a holding listed while it is being deleted would be offered to the job as
  // a source (a restore then chose a local copy that was going away). Its error, if any, is
  // still the caller's to get (the next wait, save or close).
  local_->Settle();
  Result<JobHoldings> job = local_->Gather(persistent_->AllSteps());
  if (!job.ok()) return job.status();
  job_ = *std::move(job);
  return OkStatus();
}

Result<std::optional<int64_t>> MultiTierManager::LatestStep() {
  TS_RETURN_IF_ERROR(GatherJob());
  return job_->LatestStep();
}

Result<std::vector<int64_t>> MultiTierManager::RestorableSteps() {
  TS_RETURN_IF_ERROR(GatherJob());
  return job_->RestorableSteps();
}

Result<TieredRestore> MultiTierManager::OpenRestore(int64_t step, ReaderOptions options) {
  TS_RETURN_IF_ERROR(GatherJob());
  return local_->OpenStep(step, *job_, persistent_kv_, options);
}

Status MultiTierManager::FinishRestore(const TieredRestore* restore_or_null,
                                       SaveRequest* write_back, std::string error,
                                       std::vector<std::string>* words_out, bool* wrote_back) {
  if (wrote_back != nullptr) *wrote_back = false;
  TS_ASSIGN_OR_RETURN(std::vector<std::string> words,
                      local_->FinishRestore(restore_or_null, std::move(error)));
  if (words_out != nullptr) *words_out = words;
  // This process failed already (and said so to the others): nothing to drop or write.
  if (restore_or_null == nullptr) return OkStatus();
  std::string failed;
  for (size_t p = 0; p < words.size(); ++p) {
    if (!words[p].empty()) failed += StrCat(failed.empty() ? "" : "; ", "process ", p, ": ", words[p]);
  }
  if (!failed.empty()) {
    return AbortedError(StrCat("the restore of step ", restore_or_null->step,
                               " failed in processes: ", failed));
  }
  if (restore_or_null->source == nullptr || write_back == nullptr) return OkStatus();
  const TieredRestore& restore = *restore_or_null;
  if (!restore.verified) return OkStatus();  // unchecked bytes are never stored (local_tier.h)
  const TierStats& stats = restore.source->tier_stats();
  if (!stats.local_failed && stats.bytes[static_cast<int>(Tier::kPeer)] == 0 &&
      stats.bytes[static_cast<int>(Tier::kPersistent)] == 0) {
    return OkStatus();
  }
  if (restore.extras.metadata) write_back->metadata_json = *restore.extras.metadata;
  TS_RETURN_IF_ERROR(local_
                         ->SaveHolding(restore.step, std::move(*write_back), restore.extras.save_id,
                                       restore.extras.ring_values, /*async=*/false)
                         .status());
  if (wrote_back != nullptr) *wrote_back = true;
  return OkStatus();
}

CheckpointManager& MultiTierManager::persistent() { return *persistent_; }
LocalTier& MultiTierManager::local() { return *local_; }

Status MultiTierManager::Close() {
  Status local = local_->Close();
  Status persistent = persistent_->Close();
  return local.ok() ? persistent : local;
}

}  // namespace tensorstash
