// FaultInjectionKvStore. Faults are decided under one mutex (the rules, their counters and the
// seeded generator), then the call runs on the base without it, so a slow call does not stall
// the others.
//
// The durability model is a small in-memory file system tree kept beside the base store: nodes
// are files or directories (so a renamed directory keeps its identity, as an inode does). Each
// directory holds its current entries and its entries as of its last sync; each file holds its
// current bytes and its bytes as of its last sync. Calls that succeed on the base update the
// current side; syncs copy current to durable. SimulateCrash walks the durable side from the
// root, wipes the base and writes back what it found: the store as a power loss could leave it.
#include "tensorstash/testing/fault_injection_kvstore.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "tensorstash/util/str_util.h"

namespace tensorstash {

std::string_view KvOpName(KvOp op) {
  switch (op) {
    case KvOp::kRead:
      return "read";
    case KvOp::kReadRange:
      return "read range";
    case KvOp::kSize:
      return "size";
    case KvOp::kOpenForRead:
      return "open for read";
    case KvOp::kFileReadAt:
      return "file read";
    case KvOp::kWrite:
      return "write";
    case KvOp::kOpenForWrite:
      return "open for write";
    case KvOp::kFileWriteAt:
      return "file write";
    case KvOp::kFileSync:
      return "file sync";
    case KvOp::kFileClose:
      return "file close";
    case KvOp::kList:
      return "list";
    case KvOp::kDelete:
      return "delete";
    case KvOp::kDeletePrefix:
      return "delete prefix";
    case KvOp::kRenameDirectory:
      return "rename directory";
    case KvOp::kSync:
      return "sync";
    case KvOp::kSyncDirectory:
      return "sync directory";
    case KvOp::kTryLock:
      return "lock";
  }
  return "?";
}

struct FaultInjectionKvStore::Decision {
  Status status;             // non-OK: return this without calling the base
  bool short_write = false;  // write half, then fail with `status_after`
  Status status_after;
  std::chrono::milliseconds delay{0};
};

// ---------------------------------------------------------------------------------------------
// The durability model.

struct FaultInjectionKvStore::Model {
  using Entries = std::map<std::string, int, std::less<>>;
  struct Node {
    bool dir = false;
    Entries entries;              // directories: names now
    Entries durable;              // directories: names as of the last sync
    std::string content;          // files: bytes now
    std::string durable_content;  // files: bytes as of the last sync
  };
  std::vector<Node> nodes;             // nodes[0] is the root directory
  bool names_durable_at_once = false;  // DurabilityModel::kObjectStore

  Model() { nodes.push_back(Node{true, {}, {}, {}, {}}); }

  int NewNode(bool dir) {
    nodes.push_back(Node{dir, {}, {}, {}, {}});
    return static_cast<int>(nodes.size() - 1);
  }

  static std::vector<std::string_view> Segments(std::string_view key) {
    if (key.empty()) return {};
    return StrSplit(key, '/');
  }

  // The node at `key` ("" is the root), or -1.
  int Lookup(std::string_view key) const {
    int node = 0;
    for (std::string_view segment : Segments(key)) {
      if (!nodes[node].dir) return -1;
      auto it = nodes[node].entries.find(segment);
      if (it == nodes[node].entries.end()) return -1;
      node = it->second;
    }
    return node;
  }

  // The directory at `dir`, created (with its parents) where missing; -1 if a file is in the way.
  int EnsureDir(std::string_view dir) {
    int node = 0;
    for (std::string_view segment : Segments(dir)) {
      auto it = nodes[node].entries.find(segment);
      int next;
      if (it == nodes[node].entries.end()) {
        next = NewNode(true);
        nodes[node].entries.emplace(std::string(segment), next);
      } else {
        next = it->second;
      }
      if (!nodes[next].dir) return -1;
      node = next;
    }
    return node;
  }

  static std::pair<std::string_view, std::string_view> Split(std::string_view key) {
    const size_t slash = key.rfind('/');
    if (slash == std::string_view::npos) return {std::string_view(), key};
    return {key.substr(0, slash), key.substr(slash + 1)};
  }

  // A new file at `key` holding `bytes`, durable as bytes but not as a name.
  void PutFile(std::string_view key, std::string bytes) {
    auto [dir, name] = Split(key);
    const int parent = EnsureDir(dir);
    if (parent < 0) return;
    const int file = NewNode(false);
    nodes[file].durable_content = bytes;
    nodes[file].content = std::move(bytes);
    nodes[parent].entries[std::string(name)] = file;
  }

  // The file at `key` after OpenForWrite: the same file truncated, or a new empty one.
  int OpenFile(std::string_view key) {
    auto [dir, name] = Split(key);
    const int parent = EnsureDir(dir);
    if (parent < 0) return -1;
    auto it = nodes[parent].entries.find(name);
    if (it != nodes[parent].entries.end() && !nodes[it->second].dir) {
      nodes[it->second].content.clear();
      return it->second;
    }
    const int file = NewNode(false);
    nodes[parent].entries[std::string(name)] = file;
    return file;
  }

  void Remove(std::string_view key) {
    auto [dir, name] = Split(key);
    const int parent = Lookup(dir);
    if (parent < 0 || !nodes[parent].dir) return;
    auto it = nodes[parent].entries.find(name);
    if (it != nodes[parent].entries.end()) nodes[parent].entries.erase(it);
  }

  void RemovePrefix(std::string_view prefix) {
    if (prefix.empty()) {
      nodes[0].entries.clear();
      return;
    }
    if (prefix.back() == '/') {
      const std::string_view dir = prefix.substr(0, prefix.size() - 1);
      const int node = Lookup(dir);
      if (node > 0 && nodes[node].dir) Remove(dir);
      return;
    }
    auto [dir, filter] = Split(prefix);
    const int parent = Lookup(dir);
    if (parent < 0 || !nodes[parent].dir) return;
    Entries& entries = nodes[parent].entries;
    for (auto it = entries.lower_bound(filter);
         it != entries.end() && it->first.starts_with(filter);) {
      it = entries.erase(it);
    }
  }

  void Rename(std::string_view from, std::string_view to) {
    const int node = Lookup(from);
    if (node <= 0) return;
    Remove(from);
    auto [dir, name] = Split(to);
    const int parent = EnsureDir(dir);
    if (parent >= 0) nodes[parent].entries[std::string(name)] = node;
  }

  void SyncDir(std::string_view dir) {
    const int node = Lookup(dir);
    if (node >= 0 && nodes[node].dir) nodes[node].durable = nodes[node].entries;
  }

  void SyncFile(int file) {
    if (file >= 0 && !nodes[file].dir) nodes[file].durable_content = nodes[file].content;
  }

  // After a change of names: with kObjectStore every name is durable at once.
  void Changed() {
    if (!names_durable_at_once) return;
    for (Node& node : nodes) {
      if (node.dir) node.durable = node.entries;
    }
  }

  // Every file reachable through durable entries, with its durable bytes.
  void CollectDurable(int node, const std::string& prefix,
                      std::map<std::string, std::string>* out) const {
    for (const auto& [name, child] : nodes[node].durable) {
      const std::string key = prefix.empty() ? name : StrCat(prefix, "/", name);
      if (nodes[child].dir) {
        CollectDurable(child, key, out);
      } else {
        (*out)[key] = nodes[child].durable_content;
      }
    }
  }

  // A model in which `files` exist and are all durable.
  static std::unique_ptr<Model> FromFiles(const std::map<std::string, std::string>& files) {
    auto model = std::make_unique<Model>();
    for (const auto& [key, bytes] : files) model->PutFile(key, bytes);
    for (Node& node : model->nodes) node.durable = node.entries;
    return model;
  }
};

// ---------------------------------------------------------------------------------------------
// Files.

class FaultWritableFile final : public WritableFile {
 public:
  FaultWritableFile(FaultInjectionKvStore* store, std::unique_ptr<WritableFile> base,
                    std::string key, int node, uint64_t generation)
      : store_(store),
        base_(std::move(base)),
        key_(std::move(key)),
        node_(node),
        generation_(generation) {}

  Status WriteAt(uint64_t offset, const void* data, size_t size) override {
    FaultInjectionKvStore::Decision d = store_->Decide(KvOp::kFileWriteAt, key_);
    if (!d.status.ok()) return d.status;
    TS_RETURN_IF_ERROR(CheckGeneration("file write"));
    if (d.short_write) {
      const size_t part = size / 2;
      TS_RETURN_IF_ERROR(base_->WriteAt(offset, data, part));
      Record(offset, data, part);
      return d.status_after;
    }
    TS_RETURN_IF_ERROR(base_->WriteAt(offset, data, size));
    Record(offset, data, size);
    return OkStatus();
  }

  Status Sync() override {
    FaultInjectionKvStore::Decision d = store_->Decide(KvOp::kFileSync, key_);
    if (!d.status.ok()) return d.status;
    TS_RETURN_IF_ERROR(CheckGeneration("file sync"));
    TS_RETURN_IF_ERROR(base_->Sync());
    std::lock_guard<std::mutex> lock(store_->mutex_);
    if (store_->model_ && generation_ == store_->generation_) store_->model_->SyncFile(node_);
    return OkStatus();
  }

  // A hint with no effect on what survives a simulated crash: passed on, never failed.
  Status StartWriteback() override {
    TS_RETURN_IF_ERROR(CheckGeneration("file writeback"));
    return base_->StartWriteback();
  }

  // A hint as well; the crash model still keeps only what Sync() made durable.
  void PreferDirectWrites() override { base_->PreferDirectWrites(); }

  Status Close() override {
    FaultInjectionKvStore::Decision d = store_->Decide(KvOp::kFileClose, key_);
    // A failed close still releases the descriptor, as close(2) does.
    Status closed = base_->Close();
    if (!d.status.ok()) return d.status;
    return closed;
  }

 private:
  Status CheckGeneration(std::string_view operation) {
    std::lock_guard<std::mutex> lock(store_->mutex_);
    if (generation_ == store_->generation_) return OkStatus();
    return FailedPreconditionError(
        StrCat(operation, " '", key_, "' failed: file opened before a simulated crash"));
  }

  void Record(uint64_t offset, const void* data, size_t size) {
    std::lock_guard<std::mutex> lock(store_->mutex_);
    if (!store_->model_ || generation_ != store_->generation_ || node_ < 0) return;
    std::string& bytes = store_->model_->nodes[node_].content;
    if (bytes.size() < offset + size) bytes.resize(offset + size);
    if (size > 0) std::memcpy(bytes.data() + offset, data, size);
  }

  FaultInjectionKvStore* store_;
  std::unique_ptr<WritableFile> base_;
  std::string key_;
  int node_;
  uint64_t generation_;
};

class FaultReadableFile final : public ReadableFile {
 public:
  FaultReadableFile(FaultInjectionKvStore* store, std::unique_ptr<ReadableFile> base,
                    std::string key)
      : store_(store), base_(std::move(base)), key_(std::move(key)) {}

  uint64_t size() const override { return base_->size(); }

  Status ReadAt(uint64_t offset, size_t size, void* dest) const override {
    FaultInjectionKvStore::Decision d = store_->Decide(KvOp::kFileReadAt, key_);
    if (!d.status.ok()) return d.status;
    return base_->ReadAt(offset, size, dest);
  }

 private:
  FaultInjectionKvStore* store_;
  std::unique_ptr<ReadableFile> base_;
  std::string key_;
};

// ---------------------------------------------------------------------------------------------
// The store.

FaultInjectionKvStore::FaultInjectionKvStore(KvStore* base, uint64_t seed)
    : ForwardingKvStore(base), rng_(seed) {}

FaultInjectionKvStore::FaultInjectionKvStore(std::unique_ptr<KvStore> base, uint64_t seed)
    : ForwardingKvStore(base.get()), owned_base_(std::move(base)), rng_(seed) {}

FaultInjectionKvStore::~FaultInjectionKvStore() = default;

void FaultInjectionKvStore::AddRule(FaultRule rule) {
  std::lock_guard<std::mutex> lock(mutex_);
  rules_.emplace_back(std::move(rule), 0);
  rule_hits_.push_back(0);
}

void FaultInjectionKvStore::ClearRules() {
  std::lock_guard<std::mutex> lock(mutex_);
  rules_.clear();
  rule_hits_.clear();
}

int64_t FaultInjectionKvStore::calls(KvOpMask ops) const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t total = 0;
  for (int i = 0; i < kNumKvOps; ++i) {
    if ((ops & (KvOpMask{1} << i)) != 0) total += calls_[i];
  }
  return total;
}

int64_t FaultInjectionKvStore::faults_injected() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(fault_log_.size());
}

std::vector<std::string> FaultInjectionKvStore::fault_log() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return fault_log_;
}

bool FaultInjectionKvStore::crashed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return crashed_;
}

FaultInjectionKvStore::Decision FaultInjectionKvStore::Decide(KvOp op, std::string_view key) {
  Decision decision;
  std::unique_lock<std::mutex> lock(mutex_);
  const std::string_view name = KvOpName(op);
  if (crashed_) {
    decision.status =
        Status(absl::StatusCode::kUnavailable, StrCat(name, " '", key,
                                                      "' failed: simulated crash (the store is "
                                                      "down until SimulateCrash)"));
    return decision;
  }
  ++calls_[static_cast<int>(op)];
  for (size_t i = 0; i < rules_.size(); ++i) {
    auto& [rule, matches] = rules_[i];
    if ((rule.ops & Mask(op)) == 0) continue;
    if (!rule.key_substring.empty() && key.find(rule.key_substring) == std::string_view::npos) {
      continue;
    }
    ++matches;
    bool hit;
    if (rule.nth > 0) {
      hit = matches == rule.nth;
    } else {
      hit = rule.probability >= 1.0 ||
            std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < rule.probability;
    }
    if (!hit || (rule.max_faults >= 0 && rule_hits_[i] >= rule.max_faults)) continue;
    ++rule_hits_[i];
    const std::string number = StrCat(" (injected fault #", fault_log_.size() + 1, ")");
    auto injected = [&](int error) {
      Status s = ErrnoToStatus(error, name, key);
      return Status(s.code(), StrCat(s.message(), number));
    };
    switch (rule.kind) {
      case FaultKind::kIoError:
        decision.status = injected(EIO);
        break;
      case FaultKind::kNoSpace:
        decision.status = injected(ENOSPC);
        break;
      case FaultKind::kShortWrite:
        if (op == KvOp::kWrite || op == KvOp::kFileWriteAt) {
          decision.short_write = true;
          decision.status_after = injected(ENOSPC);
          decision.status_after =
              Status(decision.status_after.code(),
                     StrCat(decision.status_after.message(), " after a short write"));
        } else {
          decision.status = injected(ENOSPC);
        }
        break;
      case FaultKind::kSlow:
        decision.delay = rule.delay;
        fault_log_.push_back(
            StrCat(name, " '", key, "' delayed by ", rule.delay.count(), " ms", number));
        continue;  // a slow call may still be hit by a later rule
      case FaultKind::kCrash:
        crashed_ = true;
        decision.status = Status(absl::StatusCode::kUnavailable,
                                 StrCat(name, " '", key, "' failed: simulated crash", number));
        break;
    }
    fault_log_.push_back(
        std::string((decision.short_write ? decision.status_after : decision.status).message()));
    break;
  }
  if (decision.delay.count() > 0) {
    // Sleep without the lock; the decision is already made.
    lock.unlock();
    std::this_thread::sleep_for(decision.delay);
  }
  return decision;
}

Status FaultInjectionKvStore::StartDurabilityTracking(DurabilityModel model) {
  TS_ASSIGN_OR_RETURN(std::vector<std::string> keys, base()->List(""));
  std::map<std::string, std::string> files;
  for (const std::string& key : keys) {
    TS_ASSIGN_OR_RETURN(files[key], base()->Read(key));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  model_ = Model::FromFiles(files);
  model_->names_durable_at_once = model == DurabilityModel::kObjectStore;
  ++generation_;
  return OkStatus();
}

Status FaultInjectionKvStore::SimulateCrash() {
  std::map<std::string, std::string> files;
  bool names_durable_at_once = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!model_) {
      return FailedPreconditionError(
          "SimulateCrash needs StartDurabilityTracking first (nothing is known about syncs)");
    }
    model_->CollectDurable(0, "", &files);
    names_durable_at_once = model_->names_durable_at_once;
    // Open files die with the "machine"; calls fail until the base holds the durable state.
    ++generation_;
    crashed_ = true;
  }
  TS_RETURN_IF_ERROR(Annotate(base()->DeletePrefix(""), "simulated crash: wiping the store"));
  for (const auto& [key, bytes] : files) {
    TS_RETURN_IF_ERROR(Annotate(base()->Write(key, bytes), "simulated crash: restoring"));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  model_ = Model::FromFiles(files);
  model_->names_durable_at_once = names_durable_at_once;
  crashed_ = false;
  return OkStatus();
}

std::string FaultInjectionKvStore::Describe() const {
  return StrCat("fault-injection:", base()->Describe());
}

Result<std::string> FaultInjectionKvStore::Read(std::string_view key) {
  Decision d = Decide(KvOp::kRead, key);
  if (!d.status.ok()) return d.status;
  return base()->Read(key);
}

Status FaultInjectionKvStore::ReadRange(std::string_view key, uint64_t offset, size_t size,
                                        void* dest) {
  Decision d = Decide(KvOp::kReadRange, key);
  if (!d.status.ok()) return d.status;
  return base()->ReadRange(key, offset, size, dest);
}

Result<uint64_t> FaultInjectionKvStore::Size(std::string_view key) {
  Decision d = Decide(KvOp::kSize, key);
  if (!d.status.ok()) return d.status;
  return base()->Size(key);
}

Result<std::unique_ptr<ReadableFile>> FaultInjectionKvStore::OpenForRead(std::string_view key) {
  Decision d = Decide(KvOp::kOpenForRead, key);
  if (!d.status.ok()) return d.status;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, base()->OpenForRead(key));
  return std::unique_ptr<ReadableFile>(
      std::make_unique<FaultReadableFile>(this, std::move(file), std::string(key)));
}

Status FaultInjectionKvStore::Write(std::string_view key, std::string_view value) {
  Decision d = Decide(KvOp::kWrite, key);
  if (!d.status.ok()) return d.status;
  const std::string_view stored = d.short_write ? value.substr(0, value.size() / 2) : value;
  TS_RETURN_IF_ERROR(base()->Write(key, stored));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (model_) {
      model_->PutFile(key, std::string(stored));
      model_->Changed();
    }
  }
  return d.short_write ? d.status_after : OkStatus();
}

Result<std::unique_ptr<WritableFile>> FaultInjectionKvStore::OpenForWrite(std::string_view key) {
  Decision d = Decide(KvOp::kOpenForWrite, key);
  if (!d.status.ok()) return d.status;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, base()->OpenForWrite(key));
  int node = -1;
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (model_) {
      node = model_->OpenFile(key);
      model_->Changed();
    }
    generation = generation_;
  }
  return std::unique_ptr<WritableFile>(std::make_unique<FaultWritableFile>(
      this, std::move(file), std::string(key), node, generation));
}

Result<std::vector<std::string>> FaultInjectionKvStore::List(std::string_view prefix) {
  Decision d = Decide(KvOp::kList, prefix);
  if (!d.status.ok()) return d.status;
  return base()->List(prefix);
}

Status FaultInjectionKvStore::Delete(std::string_view key) {
  Decision d = Decide(KvOp::kDelete, key);
  if (!d.status.ok()) return d.status;
  TS_RETURN_IF_ERROR(base()->Delete(key));
  std::lock_guard<std::mutex> lock(mutex_);
  if (model_) {
    model_->Remove(key);
    model_->Changed();
  }
  return OkStatus();
}

Status FaultInjectionKvStore::DeletePrefix(std::string_view prefix) {
  Decision d = Decide(KvOp::kDeletePrefix, prefix);
  if (!d.status.ok()) return d.status;
  Status status = base()->DeletePrefix(prefix);
  // Even a failed removal may have removed some names; the model follows what is certain only
  // when it succeeded (a crash then brings back what the model still has, which is allowed).
  if (status.ok()) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (model_) {
      model_->RemovePrefix(prefix);
      model_->Changed();
    }
  }
  return status;
}

Status FaultInjectionKvStore::RenameDirectory(std::string_view from, std::string_view to) {
  Decision d = Decide(KvOp::kRenameDirectory, from);
  if (!d.status.ok()) return d.status;
  TS_RETURN_IF_ERROR(base()->RenameDirectory(from, to));
  std::lock_guard<std::mutex> lock(mutex_);
  if (model_) {
    model_->Rename(from, to);
    model_->Changed();
  }
  return OkStatus();
}

Status FaultInjectionKvStore::Sync(std::string_view key) {
  Decision d = Decide(KvOp::kSync, key);
  if (!d.status.ok()) return d.status;
  TS_RETURN_IF_ERROR(base()->Sync(key));
  std::lock_guard<std::mutex> lock(mutex_);
  if (model_) {
    model_->SyncFile(model_->Lookup(key));
    model_->SyncDir(Model::Split(key).first);
  }
  return OkStatus();
}

Status FaultInjectionKvStore::SyncDirectory(std::string_view dir) {
  Decision d = Decide(KvOp::kSyncDirectory, dir);
  if (!d.status.ok()) return d.status;
  TS_RETURN_IF_ERROR(base()->SyncDirectory(dir));
  if (!dir.empty() && dir.back() == '/') dir.remove_suffix(1);
  std::lock_guard<std::mutex> lock(mutex_);
  if (model_) model_->SyncDir(dir);
  return OkStatus();
}

Result<std::unique_ptr<KvLock>> FaultInjectionKvStore::TryLock(std::string_view key) {
  Decision d = Decide(KvOp::kTryLock, key);
  if (!d.status.ok()) return d.status;
  return base()->TryLock(key);
}

}  // namespace tensorstash
