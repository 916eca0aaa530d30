#include "tensorstash/tiers/tiered_source.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/open_step.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <utility>

#include "tensorstash/array/box.h"
#include "tensorstash/array/dtype.h"
#include "tensorstash/engine/read_plan.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {

std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kLocal:
      return "local";
    case Tier::kPeer:
      return "peer";
    case Tier::kPersistent:
      return "persistent";
  }
  return "unknown";
}

namespace {

struct OpenHolder {
  Tier tier;
  std::string name;
  std::unique_ptr<KvStore> kv;  // declared before `source`, which reads through it
  std::unique_ptr<StepSource> source;
  // Per array of the reference tree: the chunks this holder stores, sorted; empty for an array
  // it cut into other chunks than the reference.
  std::vector<std::vector<int64_t>> chunks;

  bool Has(uint32_t array_id, int64_t chunk) const {
    const std::vector<int64_t>& held = chunks[array_id];
    return std::binary_search(held.begin(), held.end(), chunk);
  }
};

// A piece of a request that is read on its own, through a buffer.
struct PendingPiece {
  size_t request;
  Box region;
  uint32_t array_id;
  int64_t chunk;
  size_t next_candidate = 0;  // index into the chunk's candidate holders
  std::vector<std::string> errors;
};

}  // namespace

struct TieredStepSource::Impl {
  std::vector<OpenHolder> holders;  // [0] is the reference
  std::vector<std::string> open_errors;
  TierStats stats;
  // Holders that stopped answering (Unavailable): skipped from then on, so that a dead peer
  // costs one stall timeout, not one per chunk.
  std::vector<bool> gone;
  mutable std::mutex mu;  // guards stats and gone

  bool Gone(size_t h) const {
    std::lock_guard<std::mutex> lock(mu);
    return gone[h];
  }

  StepSource& primary() const { return *holders.front().source; }

  void Account(Tier tier, uint64_t bytes, double seconds) {
    std::lock_guard<std::mutex> lock(mu);
    stats.bytes[static_cast<int>(tier)] += bytes;
    stats.seconds[static_cast<int>(tier)] += seconds;
  }
  void Fail(const OpenHolder& holder, const Status& status) {
    std::lock_guard<std::mutex> lock(mu);
    if (absl::IsUnavailable(status)) gone[static_cast<size_t>(&holder - holders.data())] = true;
    stats.failures.push_back(StrCat(holder.name, ": ", status.message()));
    if (holder.tier == Tier::kLocal) stats.local_failed = true;
  }

  // Reads `requests` from holder `h`, timed and accounted.
  Status ReadFrom(size_t h, const std::vector<ReadRequest>& requests, ReadStats* read_stats) {
    uint64_t bytes = 0;
    for (const ReadRequest& r : requests) {
      bytes += static_cast<uint64_t>(r.box.num_elements()) * ItemSize(r.dtype);
    }
    const auto started = std::chrono::steady_clock::now();
    ReadStats here;
    Status status = holders[h].source->ReadMany(requests, &here, nullptr);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (read_stats != nullptr) {
      read_stats->bytes_read += here.bytes_read;
      read_stats->requests += here.requests;
      read_stats->direct_chunks += here.direct_chunks;
      read_stats->staged_chunks += here.staged_chunks;
      read_stats->peak_staging_bytes =
          std::max(read_stats->peak_staging_bytes, here.peak_staging_bytes);
    }
    Account(holders[h].tier, status.ok() ? bytes : 0, seconds);
    return status;
  }

  Status ReadPieces(std::vector<PendingPiece> pieces, const std::vector<ReadRequest>& requests,
                    const std::vector<std::vector<size_t>>& candidates_of_chunk,
                    const std::map<std::pair<uint32_t, int64_t>, size_t>& chunk_slot,
                    ReadStats* read_stats);
};

TieredStepSource::TieredStepSource(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TieredStepSource::~TieredStepSource() = default;

Result<std::unique_ptr<TieredStepSource>> TieredStepSource::Open(std::vector<StepHolder> holders,
                                                                 ReaderOptions options) {
  auto impl = std::make_unique<Impl>();
  options.open_holding = true;
  for (StepHolder& h : holders) {
    OpenHolder open{h.tier,
                    h.name.empty() ? StrCat(h.kv->Describe(), " ", h.dir) : h.name,
                    std::move(h.kv),
                    nullptr,
                    {}};
    open.name = StrCat(TierName(h.tier), " copy (", open.name, ")");
    Result<std::unique_ptr<StepSource>> source = OpenStepSource(open.kv.get(), h.dir, options);
    if (!source.ok()) {
      impl->open_errors.push_back(StrCat(open.name, ": ", source.status().message()));
      continue;
    }
    open.source = *std::move(source);
    CheckpointReader* reader = open.source->native();
    if (reader == nullptr) {
      impl->open_errors.push_back(StrCat(open.name, ": not a tensorstash step"));
      continue;
    }
    const std::vector<ArrayMetadata>& arrays = reader->arrays();
    const std::vector<ArrayMetadata>& reference =
        impl->holders.empty() ? arrays : impl->primary().arrays();
    // The holder's array of each reference array, matched by path (holders may list the
    // arrays in another order: a write-back saves the tree in the restore target's order).
    std::map<std::string_view, size_t> own_id;
    for (size_t i = 0; i < arrays.size(); ++i) own_id.emplace(arrays[i].path, i);
    std::vector<size_t> reference_id_of(arrays.size(), 0);
    bool same = arrays.size() == reference.size();
    for (size_t r = 0; same && r < reference.size(); ++r) {
      auto it = own_id.find(reference[r].path);
      same = it != own_id.end() && arrays[it->second].dtype == reference[r].dtype &&
             arrays[it->second].shape() == reference[r].shape();
      if (same) reference_id_of[it->second] = r;
    }
    if (!same) {
      impl->open_errors.push_back(
          StrCat(open.name, ": holds other arrays than ", impl->holders.front().name));
      continue;
    }
    open.chunks.resize(reference.size());
    for (const IndexEntry& e : reader->index().entries) {
      const size_t r = reference_id_of[e.array_id];
      if (arrays[e.array_id].grid == reference[r].grid) {
        open.chunks[r].push_back(static_cast<int64_t>(e.chunk));
      }
    }
    for (std::vector<int64_t>& held : open.chunks) std::sort(held.begin(), held.end());
    impl->holders.push_back(std::move(open));
  }
  impl->gone.assign(impl->holders.size(), false);
  if (impl->holders.empty()) {
    return NotFoundError(
        StrCat("no holder of the step could be opened: ", StrJoin(impl->open_errors, "; ")));
  }
  return std::unique_ptr<TieredStepSource>(new TieredStepSource(std::move(impl)));
}

const std::string& TieredStepSource::dir() const { return impl_->primary().dir(); }
const TreeNode& TieredStepSource::tree() const { return impl_->primary().tree(); }
const std::vector<ArrayMetadata>& TieredStepSource::arrays() const {
  return impl_->primary().arrays();
}
uint64_t TieredStepSource::StoredBytes(size_t id) const { return impl_->primary().StoredBytes(id); }
int64_t TieredStepSource::NumChunks(size_t id) const {
  return impl_->primary().arrays()[id].grid.NumStoredChunks();
}
std::string TieredStepSource::CodecDescription(size_t id) const {
  return impl_->primary().CodecDescription(id);
}
int64_t TieredStepSource::created_unix_ms() const { return impl_->primary().created_unix_ms(); }
int TieredStepSource::process_count() const { return impl_->primary().process_count(); }
const std::vector<std::string>& TieredStepSource::open_errors() const { return impl_->open_errors; }
const TierStats& TieredStepSource::tier_stats() const { return impl_->stats; }
void TieredStepSource::ResetTierStats() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stats = TierStats();
}
const std::vector<std::vector<int64_t>>& TieredStepSource::held_chunks(size_t holder) const {
  return impl_->holders.at(holder).chunks;
}

std::vector<std::pair<Tier, std::string>> TieredStepSource::holders() const {
  std::vector<std::pair<Tier, std::string>> out;
  for (const OpenHolder& h : impl_->holders) out.emplace_back(h.tier, h.name);
  return out;
}

// Where each request of a read goes: the chunks it needs and their holders, cheapest first.
struct TieredStepSource::Routing {
  std::map<std::string_view, uint32_t> id_of;
  std::vector<NeededChunk> needed;
  std::vector<std::vector<size_t>> candidates;          // per needed chunk: holders
  std::map<std::pair<uint32_t, int64_t>, size_t> slot;  // (array, chunk) -> needed index
  std::vector<std::vector<size_t>> chunks_of;           // per request: needed indices
  // A request goes whole to one holder when that holder is the cheapest for every one of its
  // chunks (e.g. this process's local copy of its own shards); the others are split.
  std::vector<std::vector<size_t>> whole;  // per holder: requests
  std::vector<size_t> split;
};

Result<TieredStepSource::Routing> TieredStepSource::Route(
    const std::vector<ReadRequest>& requests) const {
  const Impl& s = *impl_;
  const std::vector<ArrayMetadata>& arrays = s.primary().arrays();
  Routing route;
  std::vector<BoxRead> box_reads;
  box_reads.reserve(requests.size());
  for (uint32_t i = 0; i < arrays.size(); ++i) route.id_of.emplace(arrays[i].path, i);
  for (const ReadRequest& r : requests) {
    auto it = route.id_of.find(r.path);
    if (it == route.id_of.end()) {
      return NotFoundError(StrCat("no array '", r.path, "' in step ", dir()));
    }
    if (r.box.rank() != arrays[it->second].grid.rank()) {
      return InvalidArgumentError(StrCat("array '", r.path, "' has rank ",
                                         arrays[it->second].grid.rank(), ", the box ",
                                         r.box.rank()));
    }
    box_reads.push_back({it->second, &arrays[it->second].grid, r.box});
  }
  route.needed = PlanChunkPieces(box_reads);
  const std::vector<NeededChunk>& needed = route.needed;
  route.candidates.resize(needed.size());
  for (size_t i = 0; i < needed.size(); ++i) {
    route.slot.emplace(std::make_pair(needed[i].array_id, needed[i].chunk), i);
    for (size_t h = 0; h < s.holders.size(); ++h) {
      if (!s.Gone(h) && s.holders[h].Has(needed[i].array_id, needed[i].chunk)) {
        route.candidates[i].push_back(h);
      }
    }
    if (route.candidates[i].empty()) {
      const ArrayMetadata& a = arrays[needed[i].array_id];
      return DataLossError(StrCat("chunk ", a.grid.ChunkName(needed[i].chunk), " of array '",
                                  a.path, "' of step ", dir(), " is held by none of the ",
                                  s.holders.size(), " holders"));
    }
  }
  route.chunks_of.resize(requests.size());
  for (size_t i = 0; i < needed.size(); ++i) {
    for (const ChunkPiece& p : needed[i].pieces) route.chunks_of[p.read].push_back(i);
  }
  route.whole.resize(s.holders.size());
  for (size_t r = 0; r < requests.size(); ++r) {
    const std::vector<size_t>& chunks = route.chunks_of[r];
    size_t chosen = chunks.empty() ? 0 : route.candidates[chunks.front()].front();
    for (size_t c : chunks) {
      if (route.candidates[c].front() != chosen) chosen = s.holders.size();
    }
    if (chosen < s.holders.size()) {
      route.whole[chosen].push_back(r);
    } else {
      route.split.push_back(r);
    }
  }
  return route;
}

std::vector<Result<MappedBox>> TieredStepSource::MapMany(const std::vector<ReadRequest>& requests,
                                                         const MapOptions& options) {
  Impl& s = *impl_;
  std::vector<Result<MappedBox>> out;
  out.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    out.emplace_back(UnimplementedError("read it: the tiered source maps local holdings only"));
  }
  Result<Routing> route = Route(requests);
  if (!route.ok()) return out;  // the read reports the error
  // Requests that this node's RAM tier serves whole are mapped from its files, as a native step
  // maps its own: no copy, and the page is the holding's. The node may hold several holdings of
  // the save; the mapping budget is one for all of them.
  uint64_t made = 0;  // where the caller does not count
  MapOptions holder_options = options;
  if (holder_options.mappings_made == nullptr) holder_options.mappings_made = &made;
  for (size_t h = 0; h < s.holders.size(); ++h) {
    if (s.holders[h].tier != Tier::kLocal || route->whole[h].empty()) continue;
    std::vector<ReadRequest> group;
    uint64_t bytes = 0;
    for (size_t r : route->whole[h]) group.push_back(requests[r]);
    const auto started = std::chrono::steady_clock::now();
    std::vector<Result<MappedBox>> mapped = s.holders[h].source->MapMany(group, holder_options);
    for (size_t k = 0; k < mapped.size(); ++k) {
      if (mapped[k].ok()) {
        bytes += mapped[k]->size();
        out[route->whole[h][k]] = std::move(mapped[k]);
      } else if (!absl::IsUnimplemented(mapped[k].status())) {
        // A damaged local copy: the read goes to the next holder.
        s.Fail(s.holders[h], mapped[k].status());
      }
    }
    s.Account(Tier::kLocal, bytes,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  }
  return out;
}

Status TieredStepSource::ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                                  const std::function<void(uint64_t, uint64_t)>& progress) {
  Impl& s = *impl_;
  const std::vector<ArrayMetadata>& arrays = s.primary().arrays();
  TS_ASSIGN_OR_RETURN(Routing route, Route(requests));
  const std::vector<NeededChunk>& needed = route.needed;
  const auto& candidates = route.candidates;
  const auto& slot = route.slot;
  const auto& chunks_of = route.chunks_of;
  const auto& id_of = route.id_of;
  auto& whole = route.whole;
  auto& split = route.split;
  uint64_t total = 0, done = 0;
  for (const ReadRequest& r : requests) {
    total += static_cast<uint64_t>(r.box.num_elements()) * ItemSize(r.dtype);
  }
  auto advance = [&](const std::vector<size_t>& group) {
    for (size_t r : group) {
      done += static_cast<uint64_t>(requests[r].box.num_elements()) * ItemSize(requests[r].dtype);
    }
    if (progress) progress(done, total);
  };
  for (size_t h = 0; h < s.holders.size(); ++h) {
    if (whole[h].empty()) continue;
    std::vector<ReadRequest> group;
    for (size_t r : whole[h]) group.push_back(requests[r]);
    Status status = s.ReadFrom(h, group, stats);
    if (status.ok()) {
      advance(whole[h]);
      continue;
    }
    // Which chunk failed is not known: the group is read again piece by piece, and the pieces
    // this holder cannot give go to the next.
    s.Fail(s.holders[h], status);
    split.insert(split.end(), whole[h].begin(), whole[h].end());
  }
  // Zeros where a request reaches past the array (no chunk covers it); pieces fill the rest.
  std::vector<PendingPiece> pieces;
  for (size_t r : split) {
    const ReadRequest& req = requests[r];
    const Box shape_box = Box::FromShape(arrays[id_of.at(req.path)].shape());
    if (!shape_box.Contains(req.box)) {
      std::memset(req.dest, 0, static_cast<size_t>(req.box.num_elements()) * ItemSize(req.dtype));
    }
    for (size_t c : chunks_of[r]) {
      for (const ChunkPiece& p : needed[c].pieces) {
        if (p.read == r)
          pieces.push_back({r, p.region, needed[c].array_id, needed[c].chunk, 0, {}});
      }
    }
  }
  TS_RETURN_IF_ERROR(s.ReadPieces(std::move(pieces), requests, candidates, slot, stats));
  advance(split);
  return OkStatus();
}

Status TieredStepSource::Impl::ReadPieces(
    std::vector<PendingPiece> pieces, const std::vector<ReadRequest>& requests,
    const std::vector<std::vector<size_t>>& candidates_of_chunk,
    const std::map<std::pair<uint32_t, int64_t>, size_t>& chunk_slot, ReadStats* read_stats) {
  const std::vector<ArrayMetadata>& arrays = primary().arrays();
  // Rounds: every pending piece asks its next candidate; the pieces of one holder are read
  // together (in parallel, by that holder's reader), each into a buffer of its own.
  while (!pieces.empty()) {
    std::map<size_t, std::vector<size_t>> by_holder;  // holder -> indices into `pieces`
    for (size_t i = 0; i < pieces.size(); ++i) {
      PendingPiece& p = pieces[i];
      const std::vector<size_t>& candidates =
          candidates_of_chunk[chunk_slot.at({p.array_id, p.chunk})];
      while (p.next_candidate < candidates.size() && Gone(candidates[p.next_candidate])) {
        p.errors.push_back(
            StrCat(holders[candidates[p.next_candidate]].name, ": stopped answering"));
        ++p.next_candidate;
      }
      if (p.next_candidate >= candidates.size()) {
        const ArrayMetadata& a = arrays[p.array_id];
        return DataLossError(StrCat("no holder gave an intact copy of chunk ",
                                    a.grid.ChunkName(p.chunk), " of array '", a.path, "' of step ",
                                    primary().dir(), ": ", StrJoin(p.errors, "; ")));
      }
      by_holder[candidates[p.next_candidate]].push_back(i);
    }
    std::vector<PendingPiece> retry;
    for (const auto& [h, members] : by_holder) {
      std::vector<std::string> buffers(members.size());
      std::vector<ReadRequest> reads(members.size());
      for (size_t k = 0; k < members.size(); ++k) {
        const PendingPiece& p = pieces[members[k]];
        const ReadRequest& req = requests[p.request];
        buffers[k].resize(static_cast<size_t>(p.region.num_elements()) * ItemSize(req.dtype));
        reads[k] = {req.path, p.region, req.dtype, buffers[k].data()};
      }
      std::vector<Status> outcome(members.size());
      Status together = ReadFrom(h, reads, read_stats);
      if (together.ok()) {
        std::fill(outcome.begin(), outcome.end(), OkStatus());
      } else if (members.size() == 1 || absl::IsUnavailable(together)) {
        // One piece, or a holder that stopped answering: no piece is read from it again.
        std::fill(outcome.begin(), outcome.end(), together);
      } else {
        for (size_t k = 0; k < members.size(); ++k)
          outcome[k] = ReadFrom(h, {reads[k]}, read_stats);
      }
      for (size_t k = 0; k < members.size(); ++k) {
        PendingPiece& p = pieces[members[k]];
        const ReadRequest& req = requests[p.request];
        if (!outcome[k].ok()) {
          Fail(holders[h], outcome[k]);
          p.errors.push_back(StrCat(holders[h].name, ": ", outcome[k].message()));
          ++p.next_candidate;
          retry.push_back(std::move(p));
          continue;
        }
        TS_RETURN_IF_ERROR(CopyBox(p.region, req.dtype, buffers[k].data(), p.region, req.dtype,
                                   req.dest, req.box, StrCat("array '", req.path, "'")));
      }
    }
    pieces = std::move(retry);
  }
  return OkStatus();
}

Result<std::string> TieredStepSource::ReadFile(std::string_view name) const {
  std::vector<std::string> errors;
  bool damaged = false;
  for (const OpenHolder& h : impl_->holders) {
    Result<std::string> file = h.source->ReadFile(name);
    if (file.ok()) return file;
    errors.push_back(StrCat(h.name, ": ", file.status().message()));
    if (!absl::IsNotFound(file.status())) {
      impl_->Fail(h, file.status());
      damaged = true;
    }
  }
  // NotFound only when no holder has the file: a file the step was saved with whose every copy
  // is damaged (or unreadable) is lost data, never "the step has no such file" (a restore would
  // then go on without the step's metadata instead of trying another step).
  std::string message =
      StrCat("no holder of step ", dir(), " has '", name, "' intact: ", StrJoin(errors, "; "));
  return damaged ? DataLossError(std::move(message)) : NotFoundError(std::move(message));
}

Result<std::vector<BadChunk>> TieredStepSource::Verify(
    const std::function<void(uint64_t, uint64_t)>& progress) {
  std::vector<BadChunk> bad;
  for (OpenHolder& h : impl_->holders) {
    TS_ASSIGN_OR_RETURN(std::vector<BadChunk> found, h.source->Verify(progress));
    for (BadChunk& b : found) {
      b.file = StrCat(h.name, ": ", b.file);
      bad.push_back(std::move(b));
    }
  }
  return bad;
}

uint64_t TieredStepSource::VerifyTotalBytes() const {
  uint64_t total = 0;
  for (const OpenHolder& h : impl_->holders) total += h.source->VerifyTotalBytes();
  return total;
}

size_t TieredStepSource::VerifyTotalItems() const {
  size_t total = 0;
  for (const OpenHolder& h : impl_->holders) total += h.source->VerifyTotalItems();
  return total;
}

}  // namespace tensorstash
