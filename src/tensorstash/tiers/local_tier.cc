#include "tensorstash/tiers/local_tier.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <system_error>
#include <utility>

#include "absl/strings/escaping.h"
#include "nlohmann/json.hpp"
#include "tensorstash/array/dtype.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/coordination/collectives.h"
#include "tensorstash/coordination/single_process_coordinator.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/manager/step_store.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/kvstore/forwarding_kvstore.h"
#include "tensorstash/kvstore/http/http_kvstore.h"
#include "tensorstash/kvstore/http/peer_server.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The control plane: values exchanged through the coordinator's key-value store
// (coordination/collectives.h), every wait bounded by the tier's timeout. Every process makes the
// same calls in the same order; the keys, "local-tier/<instance>/<sequence>/<name>/...", carry
// a sequence number. Without a coordinator each exchange returns this process's value alone.
class Collective {
 public:
  // Every process must construct its Collectives in the same order: each takes the next
  // operation id of the coordinator, so that a tier opened again on the same coordinator uses
  // keys of its own.
  Collective(Coordinator* coordinator, std::chrono::milliseconds timeout)
      : coordinator_(coordinator != nullptr ? *coordinator : own_coordinator_),
        timeout_(timeout),
        instance_(coordinator_.NextOperationId()) {}

  int index() const { return coordinator_.process_index(); }
  int count() const { return coordinator_.process_count(); }

  // Every process's value, by process index.
  Result<std::vector<std::string>> AllGather(std::string_view name, std::string value) {
    return tensorstash::AllGather(coordinator_, NextPrefix(name), value, timeout_);
  }

  // Process 0's value (`value` is ignored elsewhere).
  Result<std::string> Broadcast(std::string_view name, std::string value) {
    return tensorstash::Broadcast(coordinator_, StrCat(NextPrefix(name), 0), value, /*root=*/0,
                                  timeout_);
  }

  // Publishes this process's per-process value; returns those of ValueRing(index).
  Result<ProcessValues> ExchangeRing(std::string_view name, std::optional<std::string> value) {
    const std::string prefix = NextPrefix(name);
    ProcessValues out;
    out[index()] = value;
    if (count() == 1) return out;
    // Base64: values are bytes, the store carries text.
    const std::string mine = value ? "+" + absl::Base64Escape(*value) : "-";
    if (Status s = PublishValue(coordinator_, prefix, mine); !s.ok()) return s;
    std::vector<int> ring = ValueRing(index(), count());
    ring.erase(ring.begin());
    Result<std::map<int, std::string>> got = CollectValues(coordinator_, prefix, ring, timeout_);
    if (!got.ok()) return got.status();
    for (const auto& [p, text] : *got) {
      std::string decoded;
      if (text.empty() || (text[0] == '+' && !absl::Base64Unescape(text.substr(1), &decoded))) {
        return InternalError(StrCat("the per-process value process ", p, " published is garbled"));
      }
      out[p] = text[0] == '+' ? std::optional<std::string>(std::move(decoded)) : std::nullopt;
    }
    return out;
  }

  Status Barrier(std::string_view name) { return AllGather(name, "").status(); }

 private:
  // The key prefix of the next exchange: "local-tier/<instance>/<sequence>/<name>/".
  std::string NextPrefix(std::string_view name) {
    return StrCat("local-tier/", instance_, "/", ++sequence_, "/", name, "/");
  }

  SingleProcessCoordinator own_coordinator_;  // without a coordinator: a job of one process
  Coordinator& coordinator_;
  std::chrono::milliseconds timeout_;
  uint64_t instance_;
  uint64_t sequence_ = 0;
};

// Creates `path` (0700) if missing; refuses one another user owns, and takes away the others'
// write access: its holdings are published to the job and restored from.
Status MakePrivateFolder(const std::string& path) {
  std::error_code error;
  fs::create_directories(path, error);
  if (error)
    return UnavailableError(StrCat("cannot create local_dir ", path, ": ", error.message()));
  struct stat info;
  if (::stat(path.c_str(), &info) != 0) {
    return UnavailableError(StrCat("cannot stat local_dir ", path));
  }
  if (info.st_uid != ::geteuid()) {
    return PermissionDeniedError(StrCat("local_dir ", path, " belongs to user ", info.st_uid,
                                        ", not to this process's user ", ::geteuid()));
  }
  if ((info.st_mode & 0077) != 0 && ::chmod(path.c_str(), info.st_mode & 0700) != 0) {
    return PermissionDeniedError(StrCat("cannot make local_dir ", path, " private"));
  }
  return OkStatus();
}

// The bytes of the distinct boxes among a save's shards: what a holding stores.
uint64_t HoldingBytes(const SaveRequest& request) {
  uint64_t total = 0;
  for (const ArrayToSave& array : request.arrays) {
    std::vector<const Box*> seen;
    for (const ShardData& shard : array.shards) {
      if (std::any_of(seen.begin(), seen.end(), [&](const Box* b) { return *b == shard.box; })) {
        continue;
      }
      seen.push_back(&shard.box);
      total += static_cast<uint64_t>(shard.box.num_elements()) * ItemSize(array.spec.dtype);
    }
  }
  return total;
}

// Whether no live manager holds the lock of `folder` (its process is gone).
bool Unlocked(const fs::path& folder) {
  Result<std::unique_ptr<KvStore>> kv = OpenKvStore(folder.string(), {.create = false});
  if (!kv.ok()) return false;
  return (*kv)->TryLock(StepStore::kLockKey).ok();
}

}  // namespace

std::vector<int64_t> JobHoldings::RestorableSteps() const {
  std::set<int64_t> steps(persistent_steps.begin(), persistent_steps.end());
  for (const auto& [step, save] : saves) steps.insert(step);
  return std::vector<int64_t>(steps.begin(), steps.end());
}

std::optional<int64_t> JobHoldings::LatestStep() const {
  std::vector<int64_t> steps = RestorableSteps();
  if (steps.empty()) return std::nullopt;
  return steps.back();
}

struct LocalTier::Impl {
  LocalTierOptions options;
  Collective collective;
  std::string folder;  // "p<index>-of-<count>"
  std::unique_ptr<KvStore> folder_kv;
  std::unique_ptr<CheckpointManager> manager;
  Status unreported;  // a background save's error that Settle kept for WaitUntilFinished
  std::string secret;
  std::unique_ptr<PeerServer> server;
  std::vector<std::string> urls;  // by process index
  bool closed = false;

  Impl(LocalTierOptions o)
      : options(std::move(o)), collective(options.coordinator, options.timeout) {}

  void Warn(const std::string& text) const {
    if (options.warn) {
      options.warn(text);
    } else {
      std::fprintf(stderr, "tensorstash: %s\n", text.c_str());
    }
  }

  Status OpenManager() {
    manager.reset();
    folder_kv.reset();
    Result<std::unique_ptr<KvStore>> kv =
        OpenKvStore((fs::path(options.dir) / folder).string(), {.create = true});
    if (!kv.ok()) return kv.status();
    folder_kv = *std::move(kv);
    ManagerOptions m;
    m.max_to_keep = options.max_to_keep;
    m.save_interval_steps = options.save_interval_steps;
    m.max_staging_bytes = options.max_staging_bytes;
    m.writer = options.writer;
    m.writer.holding = true;
    // A write-back replaces a step in place; never synced: the tier is RAM, and a node that
    // loses power loses it whatever was synced.
    m.writer.overwrite = true;
    m.writer.sync = false;
    Result<std::unique_ptr<CheckpointManager>> opened = CheckpointManager::Open(folder_kv.get(), m);
    if (!opened.ok()) return opened.status();
    manager = *std::move(opened);
    return OkStatus();
  }

  // This run's holdings on this node (LocalTierOptions::run).
  std::vector<Holding> OwnRunHoldings() const {
    std::vector<Holding> holdings = DescribeHoldings(options.dir, collective.index());
    std::erase_if(holdings, [&](const Holding& h) { return h.run != options.run; });
    return holdings;
  }

  // Committed steps of other runs (or of no run: an older release's) in the folders no live
  // process holds, this process's own included (before its manager opens, so that they neither
  // restore nor win its retention): they cannot be anyone's live data, and are removed with a
  // warning. Those in folders a live process holds are left to it, and named in a warning.
  void RemoveOtherRuns() {
    std::error_code error;
    std::vector<std::string> removed;
    std::vector<std::string> left;
    for (const fs::directory_entry& entry : fs::directory_iterator(options.dir, error)) {
      const std::string name = entry.path().filename().string();
      if (!ParseHoldingFolder(name)) continue;
      std::vector<fs::path> foreign;
      std::error_code inner;
      for (const fs::directory_entry& item : fs::directory_iterator(entry.path(), inner)) {
        const std::string step = item.path().filename().string();
        if (!StepStore::ParseStepName(step) || !fs::exists(item.path() / kCommitFileName, inner)) {
          continue;
        }
        std::string packed;
        {
          std::ifstream in(item.path() / ProcessStateFileName(0), std::ios::binary);
          packed.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
        }
        Result<PackedValues> values = UnpackValues(packed, item.path().string());
        if (!values.ok() || values->run != options.run) foreign.push_back(item.path());
      }
      if (foreign.empty()) continue;
      // Only now is the folder's lock probed: a probe may collide with its process opening it.
      const bool unlocked = Unlocked(entry.path());
      for (const fs::path& step : foreign) {
        const std::string what = StrCat(name, "/", step.filename().string());
        if (!unlocked) {
          left.push_back(what);
          continue;
        }
        std::error_code remove_error;
        fs::remove_all(step, remove_error);
        removed.push_back(what);
      }
    }
    auto names = [](const std::vector<std::string>& list) {
      std::string out;
      for (const std::string& s : list) out += StrCat(out.empty() ? "" : ", ", s);
      return out;
    };
    if (!removed.empty()) {
      Warn(StrCat("local_dir ", options.dir, " held ", removed.size(),
                  " local step(s) of another run (not of ", options.run,
                  "), removed: they are never restored: ", names(removed)));
    }
    if (!left.empty()) {
      Warn(StrCat("local_dir ", options.dir, " holds ", left.size(),
                  " local step(s) of another run that a live process keeps: ignored, not "
                  "restored: ",
                  names(left)));
    }
  }

  // Holdings in other folders on this node whose process is gone (an earlier run, or a process
  // now elsewhere) serve restores until this process has committed a newer step of its own;
  // then their older steps go, so that the tier stays bounded.
  void DropStaleFolders() {
    const std::vector<int64_t> own = manager->AllSteps();  // the holding manager's list
    if (own.empty()) return;
    std::error_code error;
    for (const fs::directory_entry& entry : fs::directory_iterator(options.dir, error)) {
      const std::string name = entry.path().filename().string();
      if (name == folder || !ParseHoldingFolder(name) || !Unlocked(entry.path())) continue;
      for (const fs::directory_entry& item : fs::directory_iterator(entry.path(), error)) {
        const std::string item_name = item.path().filename().string();
        std::optional<int64_t> step = StepStore::ParseStepName(item_name);
        const bool keep = step && *step >= own.back();
        if (item_name != StepStore::kLockKey && !keep) fs::remove_all(item.path(), error);
      }
    }
  }
};

LocalTier::LocalTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

void LocalTier::Warn(const std::string& text) const { impl_->Warn(text); }

LocalTier::~LocalTier() { (void)Close(); }

Result<std::unique_ptr<LocalTier>> LocalTier::Open(LocalTierOptions options) {
  if (options.dir.empty()) return InvalidArgumentError("the local tier needs a folder (local_dir)");
  if (options.save_interval_steps < 1 || options.max_to_keep < 1) {
    return InvalidArgumentError(
        StrCat("local_save_interval_steps and local_max_to_keep must be >= 1 (got ",
               options.save_interval_steps, ", ", options.max_to_keep, ")"));
  }
  if (options.timeout.count() <= 0) {
    return InvalidArgumentError("coordination_timeout must be positive");
  }
  options.dir = fs::absolute(options.dir).lexically_normal().string();
  if (Status s = MakePrivateFolder(options.dir); !s.ok()) return s;
  auto impl = std::make_unique<Impl>(std::move(options));
  Impl& t = *impl;
  t.folder = HoldingFolder(t.collective.index(), t.collective.count());
  Result<std::string> run =
      t.collective.Broadcast("run", t.collective.index() == 0 ? t.options.run : "");
  if (!run.ok()) return run.status();
  t.options.run = *std::move(run);
  t.RemoveOtherRuns();
  if (Status s = t.OpenManager(); !s.ok()) return s;
  std::unique_ptr<LocalTier> tier(new LocalTier(std::move(impl)));
  if (t.collective.count() > 1) {
    Result<std::string> secret =
        t.collective.Broadcast("secret", t.collective.index() == 0 ? RandomHexId(64) : "");
    if (!secret.ok()) return secret.status();
    t.secret = *std::move(secret);
    PeerServerOptions server;
    server.bind_address = t.options.server_address;
    server.port = t.options.server_port;
    server.secret = t.secret;
    server.may_serve = CommittedHoldingKeys(t.options.dir);
    server.process_count = t.collective.count();  // sizes its connection limits
    Result<std::unique_ptr<PeerServer>> started =
        PeerServer::Start(t.options.dir, std::move(server));
    if (!started.ok()) return started.status();
    t.server = *std::move(started);
  }
  Result<std::vector<std::string>> urls = t.collective.AllGather("server", tier->url());
  if (!urls.ok()) return urls.status();
  t.urls = *std::move(urls);
  return tier;
}

int LocalTier::process_index() const { return impl_->collective.index(); }
int LocalTier::process_count() const { return impl_->collective.count(); }
const std::string& LocalTier::dir() const { return impl_->options.dir; }
std::string LocalTier::url() const { return impl_->server ? impl_->server->url() : ""; }

bool LocalTier::ShouldSave(int64_t step) const {
  // From the options alone: every process must decide alike (a save is collective), whatever
  // state its holding manager is in.
  return step % impl_->options.save_interval_steps == 0;
}

Result<bool> LocalTier::Save(int64_t step, SaveRequest request, bool async) {
  Impl& t = *impl_;
  if (t.closed) return FailedPreconditionError("the local tier is closed");
  Result<std::string> save_id =
      t.collective.Broadcast(StrCat("save-", step), t.collective.index() == 0 ? NewSaveId() : "");
  if (!save_id.ok()) return save_id.status();
  Result<ProcessValues> values =
      t.collective.ExchangeRing(StrCat("values-", step), std::move(request.process_state));
  if (!values.ok()) return values.status();
  return SaveHolding(step, std::move(request), *save_id, *values, async);
}

Result<bool> LocalTier::SaveHolding(int64_t step, SaveRequest request, std::string_view save_id,
                                    const ProcessValues& values, bool async) {
  Impl& t = *impl_;
  if (t.closed || t.manager == nullptr) return FailedPreconditionError("the local tier is closed");
  // The previous local save first (it may still be writing): the free space counts it.
  if (Status s = WaitUntilFinished(); !s.ok()) return s;
  t.DropStaleFolders();
  const uint64_t needed = HoldingBytes(request);
  std::error_code error;
  const fs::space_info space = fs::space(t.options.dir, error);
  if (!error && space.available < needed + t.options.free_space_margin) {
    t.Warn(StrCat("local save of step ", step, " skipped: ", t.options.dir, " needs ", needed,
                  " bytes, ", space.available, " are free (a save would fill the node's memory)"));
    return false;
  }
  request.process_state = PackValues({t.options.run, std::string(save_id), values});
  request.metrics.clear();
  Status s = async ? t.manager->SaveAsync(step, std::move(request))
                   : t.manager->Save(step, std::move(request));
  if (!s.ok()) return s;
  return true;
}

Status LocalTier::WaitUntilFinished() {
  Impl& t = *impl_;
  Status finished = t.manager ? t.manager->WaitUntilFinished() : OkStatus();
  if (!t.unreported.ok()) return std::exchange(t.unreported, OkStatus());
  return finished;
}

void LocalTier::Settle() {
  Impl& t = *impl_;
  Status finished = t.manager ? t.manager->WaitUntilFinished() : OkStatus();
  if (!finished.ok() && t.unreported.ok()) t.unreported = std::move(finished);
}

std::vector<int64_t> LocalTier::LocalSteps() const {
  std::set<int64_t> steps;
  for (const Holding& h : impl_->OwnRunHoldings()) steps.insert(h.step);
  return std::vector<int64_t>(steps.begin(), steps.end());
}

Result<JobHoldings> LocalTier::Gather(const std::vector<int64_t>& persistent_steps) {
  Impl& t = *impl_;
  JobHoldings job;
  Result<std::vector<std::string>> docs =
      t.collective.AllGather("holdings", HoldingsToJson(t.OwnRunHoldings()));
  if (!docs.ok()) return docs.status();
  for (const std::string& doc : *docs) {
    Result<std::vector<Holding>> holdings = HoldingsFromJson(doc);
    if (!holdings.ok()) return holdings.status();
    for (Holding& h : *holdings) job.holdings.push_back(std::move(h));
  }
  Result<std::string> persistent = t.collective.Broadcast(
      "persistent", t.collective.index() == 0 ? json(persistent_steps).dump() : "");
  if (!persistent.ok()) return persistent.status();
  try {
    job.persistent_steps = json::parse(*persistent).get<std::vector<int64_t>>();
  } catch (const json::exception& e) {
    return InternalError(StrCat("process 0's list of persistent steps is garbled: ", e.what()));
  }
  job.saves = RestorableSaves(job.holdings);
  return job;
}

Result<TieredRestore> LocalTier::OpenStep(int64_t step, const JobHoldings& job, KvStore* persistent,
                                          ReaderOptions options) {
  Impl& t = *impl_;
  const bool in_persistent = persistent != nullptr && std::count(job.persistent_steps.begin(),
                                                                 job.persistent_steps.end(), step);
  auto chosen = job.saves.find(step);
  if (!in_persistent && chosen == job.saves.end()) {
    return NotFoundError(StrCat("step ", step,
                                " cannot be restored from the persistent tier or "
                                "the local tiers: no tier holds all of it"));
  }
  TieredRestore restore;
  restore.step = step;
  restore.verified = options.verify_checksums;
  if (chosen != job.saves.end()) restore.save = chosen->second;
  Result<std::string> step_dir = StepStore::StepDir(step);
  if (!step_dir.ok()) return step_dir.status();
  const int index = process_index();
  const int count = process_count();

  // A holder of one holding of the chosen save: this node's folder, or the peer's server.
  auto holder_of = [&](const Holding& h) -> Result<StepHolder> {
    StepHolder holder;
    holder.dir = StrCat(h.folder, "/", *step_dir);
    if (h.holder == index) {
      holder.tier = Tier::kLocal;
      Result<std::unique_ptr<KvStore>> kv = OpenKvStore(t.options.dir, {.create = false});
      if (!kv.ok()) return kv.status();
      holder.kv = *std::move(kv);
      return holder;
    }
    if (h.holder < 0 || h.holder >= static_cast<int>(t.urls.size()) || t.urls[h.holder].empty()) {
      return InvalidArgumentError(StrCat("no server is known for process ", h.holder));
    }
    holder.tier = Tier::kPeer;
    HttpKvStoreOptions http;
    http.stall_timeout = t.options.peer_stall_timeout;
    Result<std::unique_ptr<HttpKvStore>> kv = HttpKvStore::Open(t.urls[h.holder], t.secret, http);
    if (!kv.ok()) return kv.status();
    holder.kv = *std::move(kv);
    return holder;
  };
  std::vector<const Holding*> of_save;
  for (const Holding& h : job.holdings) {
    if (restore.save && h.save() == restore.save) of_save.push_back(&h);
  }
  std::vector<StepHolder> holders;
  for (int offset = 0; offset < count; ++offset) {  // this node, then the next processes
    const int p = (index + offset) % count;
    for (const Holding* h : of_save) {
      if (h->holder != p) continue;
      Result<StepHolder> holder = holder_of(*h);
      if (!holder.ok()) return holder.status();
      holders.push_back(*std::move(holder));
    }
  }
  if (in_persistent) {
    StepHolder holder;
    holder.tier = Tier::kPersistent;
    holder.kv = std::make_unique<ForwardingKvStore>(persistent);
    holder.dir = *step_dir;
    holders.push_back(std::move(holder));
  }
  Result<std::unique_ptr<TieredStepSource>> source =
      TieredStepSource::Open(std::move(holders), options);
  if (!source.ok()) return source.status();
  restore.source = *std::move(source);

  // The extras: the metadata from the first holder that has it; the values of ValueRing(index)
  // from the holdings that carry them (those carrying this process's own first, this node's
  // first among them), else this process's value from the persistent step.
  RestoredExtras& extras = restore.extras;
  Result<std::string> metadata = restore.source->ReadFile(kMetadataFileName);
  if (metadata.ok()) {
    extras.metadata = *std::move(metadata);
  } else if (!absl::IsNotFound(metadata.status())) {
    return metadata.status();
  }
  const std::vector<int> ring = ValueRing(index, count);
  // The values the chosen save's holdings can carry: those of the processes of the job that
  // saved it (a restart with more processes has indices that job did not have).
  const auto held_by_save = [&](int p) { return !restore.save || p < restore.save->process_count; };
  std::vector<const Holding*> candidates;
  for (const Holding* h : of_save) {
    if (std::any_of(ring.begin(), ring.end(),
                    [&](int p) { return std::count(h->values.begin(), h->values.end(), p) > 0; })) {
      candidates.push_back(h);
    }
  }
  std::stable_sort(candidates.begin(), candidates.end(), [&](const Holding* a, const Holding* b) {
    auto rank = [&](const Holding* h) {
      return std::make_pair(std::count(h->values.begin(), h->values.end(), index) == 0,
                            h->holder != index);
    };
    return rank(a) < rank(b);
  });
  std::vector<std::string> errors;
  for (const Holding* h : candidates) {
    if (std::all_of(ring.begin(), ring.end(),
                    [&](int p) { return !held_by_save(p) || extras.ring_values.count(p); })) {
      break;
    }
    Result<StepHolder> holder = holder_of(*h);
    if (!holder.ok()) {
      errors.push_back(holder.status().ToString());
      continue;
    }
    const std::string where = StrCat(holder->kv->Describe(), "/", holder->dir);
    Result<std::unique_ptr<CheckpointReader>> reader =
        CheckpointReader::Open(holder->kv.get(), holder->dir, {.open_holding = true});
    Result<std::string> packed = reader.ok() ? (*reader)->ReadFile(ProcessStateFileName(0))
                                             : Result<std::string>(reader.status());
    Result<PackedValues> found =
        packed.ok() ? UnpackValues(*packed, where) : Result<PackedValues>(packed.status());
    if (!found.ok()) {
      errors.push_back(StrCat(where, ": ", found.status().message()));
      continue;
    }
    for (auto& [p, value] : found->values) {
      if (std::count(ring.begin(), ring.end(), p)) extras.ring_values.emplace(p, std::move(value));
    }
  }
  // What the holdings did not give comes from the persistent step, when there is one: this
  // process's own value, and those of indices the saving job did not have (a local save made by
  // a smaller job, e.g. the write-back of a persistent restore, while the persistent step was
  // saved by a job of this size). Otherwise such an index saved no value: None.
  std::unique_ptr<CheckpointReader> persistent_reader;
  for (int p : ring) {
    if (extras.ring_values.count(p) || (p != index && held_by_save(p))) continue;
    if (!in_persistent) {
      if (!held_by_save(p)) extras.ring_values.emplace(p, std::nullopt);
      continue;
    }
    if (persistent_reader == nullptr) {
      Result<std::unique_ptr<CheckpointReader>> reader =
          CheckpointReader::Open(persistent, *step_dir);
      if (!reader.ok()) return reader.status();
      persistent_reader = *std::move(reader);
    }
    Result<std::string> value = persistent_reader->ReadFile(ProcessStateFileName(p));
    if (value.ok()) {
      extras.ring_values[p] = *std::move(value);
    } else if (absl::IsNotFound(value.status())) {
      extras.ring_values[p] = std::nullopt;
    } else if (p == index) {
      return value.status();
    }
  }
  if (!extras.ring_values.count(index)) {
    std::string why;
    for (const std::string& e : errors) why += StrCat(why.empty() ? "" : "; ", e);
    return DataLossError(
        StrCat("the per-process value of process ", index, " saved with step ", step,
               " could not be read from any holder: ", why.empty() ? "none carries it" : why));
  }
  extras.per_process = extras.ring_values[index];
  extras.save_id = restore.save ? restore.save->save_id : StrCat("persistent-", step);
  return restore;
}

Result<std::vector<std::string>> LocalTier::FinishRestore(const TieredRestore* restore,
                                                          std::string error) {
  Impl& t = *impl_;
  if (restore == nullptr && error.empty()) error = "the restore failed";
  Result<std::vector<std::string>> words = t.collective.AllGather("restored", std::move(error));
  if (!words.ok()) return words.status();
  const bool all_restored =
      std::all_of(words->begin(), words->end(), [](const std::string& w) { return w.empty(); });
  if (restore == nullptr || !all_restored) return words;
  const int64_t step = restore->step;
  const std::optional<SaveKey>& save = restore->save;
  // Holdings in the folders of other processes that are alive (on this node) are theirs to
  // remove: their managers cache their step lists.
  std::vector<Holding> stale;
  bool own_stale = false;
  for (Holding& h : t.OwnRunHoldings()) {
    if (!(h.step > step || (h.step == step && save && h.save() != save))) continue;
    if (h.folder != t.folder && !Unlocked(fs::path(t.options.dir) / h.folder)) continue;
    own_stale = own_stale || h.folder == t.folder;
    stale.push_back(std::move(h));
  }
  if (stale.empty()) return words;
  // The manager caches its step list: closed while the folders go, then opened again, whatever
  // the close returned (the error of an earlier local save, which no longer matters).
  Status closed = OkStatus();
  if (own_stale && t.manager != nullptr) {
    closed = t.manager->Close();
    t.manager.reset();
  }
  std::error_code remove_error;
  for (const Holding& h : stale) {
    Result<std::string> step_dir = StepStore::StepDir(h.step);
    if (step_dir.ok()) {
      fs::remove_all(fs::path(t.options.dir) / h.folder / *step_dir, remove_error);
    }
  }
  if (!closed.ok()) t.Warn(StrCat("an earlier local save failed: ", closed.message()));
  if (t.manager == nullptr) {
    if (Status s = t.OpenManager(); !s.ok()) return s;
  }
  return words;
}

Status LocalTier::Close() {
  Impl& t = *impl_;
  if (t.closed) return OkStatus();
  t.closed = true;
  Status status = t.manager ? t.manager->Close() : OkStatus();
  t.server.reset();
  return t.unreported.ok() ? status : std::exchange(t.unreported, OkStatus());
}

}  // namespace tensorstash
