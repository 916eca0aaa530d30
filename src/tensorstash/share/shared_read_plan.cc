#include "tensorstash/share/shared_read_plan.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tensorstash {
namespace {

constexpr uint8_t kNeedsVersion = 1;
constexpr uint64_t kMaxScalarBoxes = 1024;

void PutVarint(std::string* out, uint64_t value) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

// Reads a varint at *pos; false when the bytes end first or it has more than 64 bits.
bool GetVarint(std::string_view in, size_t* pos, uint64_t* value) {
  uint64_t result = 0;
  for (int shift = 0; shift < 64 && *pos < in.size(); shift += 7) {
    const uint8_t byte = static_cast<uint8_t>(in[(*pos)++]);
    if (shift == 63 && byte > 1) return false;
    result |= uint64_t{byte & 0x7fu} << shift;
    if ((byte & 0x80) == 0) {
      *value = result;
      return true;
    }
  }
  return false;
}

std::string ArrayName(const std::vector<SharedArray>& arrays, size_t a) {
  return arrays[a].path.empty() ? absl::StrCat("array ", a) : absl::StrCat("'", arrays[a].path, "'");
}

// The part of `box` inside the array (empty when none).
Box ClipToArray(const Box& box, const std::vector<int64_t>& shape) {
  Box clipped = box;
  for (size_t d = 0; d < shape.size(); ++d) {
    const int64_t end = std::min(box.origin[d] + box.shape[d], shape[d]);
    clipped.shape[d] = std::max<int64_t>(0, end - box.origin[d]);
  }
  return clipped;
}

// The chunks of `array` that `boxes` need, sorted, each once.
std::vector<int64_t> ChunksOf(const SharedArray& array, const std::vector<Box>& boxes) {
  std::vector<int64_t> chunks;
  for (const Box& box : boxes) {
    const Box clipped = ClipToArray(box, array.grid.shape);
    if (clipped.empty()) continue;
    array.grid.ForEachChunkIntersecting(clipped,
                                        [&](int64_t chunk, const Box&) { chunks.push_back(chunk); });
  }
  std::sort(chunks.begin(), chunks.end());
  chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
  return chunks;
}

Status CheckNeeds(const ProcessNeeds& needs, const std::vector<SharedArray>& arrays,
                  const std::string& whose) {
  if (needs.boxes.size() != arrays.size()) {
    return InvalidArgumentError(absl::StrCat(whose, " names boxes of ", needs.boxes.size(),
                                             " arrays; the step has ", arrays.size()));
  }
  for (size_t a = 0; a < arrays.size(); ++a) {
    for (const Box& box : needs.boxes[a]) {
      TS_RETURN_IF_ERROR(ValidateBox(box, 1, absl::StrCat(whose, ", ", ArrayName(arrays, a))));
      if (box.rank() != arrays[a].grid.rank()) {
        return InvalidArgumentError(absl::StrCat(whose, ": a box of rank ", box.rank(), " for ",
                                                 ArrayName(arrays, a), " of rank ",
                                                 arrays[a].grid.rank()));
      }
    }
  }
  return OkStatus();
}

}  // namespace

std::string EncodeNeeds(const ProcessNeeds& needs) {
  std::string out(1, static_cast<char>(kNeedsVersion));
  PutVarint(&out, needs.boxes.size());
  for (const std::vector<Box>& boxes : needs.boxes) {
    PutVarint(&out, boxes.size());
    for (const Box& box : boxes) {
      for (int64_t v : box.origin) PutVarint(&out, static_cast<uint64_t>(v));
      for (int64_t v : box.shape) PutVarint(&out, static_cast<uint64_t>(v));
    }
  }
  return out;
}

Result<ProcessNeeds> DecodeNeeds(std::string_view encoded, const std::vector<SharedArray>& arrays,
                                 int process) {
  const std::string whose = absl::StrCat("the boxes process ", process, " needs");
  auto corrupt = [&](const std::string& what) {
    return InvalidArgumentError(absl::StrCat(whose, " are not a valid box list: ", what));
  };
  if (encoded.empty() || static_cast<uint8_t>(encoded[0]) != kNeedsVersion) {
    return corrupt("unknown version");
  }
  size_t pos = 1;
  uint64_t num_arrays = 0;
  if (!GetVarint(encoded, &pos, &num_arrays)) return corrupt("truncated");
  if (num_arrays != arrays.size()) {
    return InvalidArgumentError(absl::StrCat(whose, " name ", num_arrays, " arrays; the step has ",
                                             arrays.size()));
  }
  ProcessNeeds needs;
  needs.boxes.resize(arrays.size());
  for (size_t a = 0; a < arrays.size(); ++a) {
    uint64_t num_boxes = 0;
    if (!GetVarint(encoded, &pos, &num_boxes)) return corrupt("truncated");
    const size_t rank = arrays[a].grid.shape.size();
    // A box takes at least 2 * rank bytes (a scalar's none): a count past what is left, or past
    // kMaxScalarBoxes for a scalar, is corrupt, before anything is allocated for it.
    const uint64_t most = rank == 0 ? kMaxScalarBoxes : (encoded.size() - pos) / (2 * rank);
    if (num_boxes > most) {
      return corrupt(absl::StrCat("box count ", num_boxes, " for ", ArrayName(arrays, a)));
    }
    needs.boxes[a].resize(num_boxes);
    for (Box& box : needs.boxes[a]) {
      box.origin.resize(rank);
      box.shape.resize(rank);
      for (std::vector<int64_t>* values : {&box.origin, &box.shape}) {
        for (int64_t& v : *values) {
          uint64_t raw = 0;
          if (!GetVarint(encoded, &pos, &raw)) return corrupt("truncated");
          if (raw > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            return corrupt(absl::StrCat("a coordinate past int64 for ", ArrayName(arrays, a)));
          }
          v = static_cast<int64_t>(raw);
        }
      }
    }
  }
  if (pos != encoded.size()) return corrupt("bytes after the last box");
  TS_RETURN_IF_ERROR(CheckNeeds(needs, arrays, whose));
  return needs;
}

JobNeeds GroupNeeds(const std::vector<ProcessNeeds>& per_process) {
  JobNeeds job;
  job.list_of_process.reserve(per_process.size());
  for (const ProcessNeeds& needs : per_process) {
    auto it = std::find(job.distinct.begin(), job.distinct.end(), needs);
    if (it == job.distinct.end()) {
      job.distinct.push_back(needs);
      it = job.distinct.end() - 1;
    }
    job.list_of_process.push_back(static_cast<int>(it - job.distinct.begin()));
  }
  return job;
}

const SharedChunk* SharedReadPlan::Find(uint32_t array, int64_t chunk) const {
  if (array + size_t{1} >= array_begin_.size()) return nullptr;
  auto begin = shared_.begin() + static_cast<ptrdiff_t>(array_begin_[array]);
  auto end = shared_.begin() + static_cast<ptrdiff_t>(array_begin_[array + 1]);
  auto it = std::lower_bound(begin, end, chunk,
                             [](const SharedChunk& c, int64_t value) { return c.chunk < value; });
  return it != end && it->chunk == chunk ? &*it : nullptr;
}

uint64_t SharedReadPlan::total_storage_bytes() const {
  return std::accumulate(storage_bytes_.begin(), storage_bytes_.end(), uint64_t{0});
}

ProcessShare SharedReadPlan::ForProcess(const JobNeeds& needs,
                                        const std::vector<SharedArray>& arrays, int p) const {
  ProcessShare share;
  const ProcessNeeds& mine = needs.distinct[needs.list_of_process[p]];
  for (size_t a = 0; a < arrays.size(); ++a) {
    for (int64_t chunk : ChunksOf(arrays[a], mine.boxes[a])) {
      const SharedChunk* shared = Find(static_cast<uint32_t>(a), chunk);
      if (shared == nullptr) {
        share.alone.emplace_back(static_cast<uint32_t>(a), chunk);
      } else if (shared->reader == p) {
        share.serves.push_back(*shared);
      } else {
        share.receives.push_back(*shared);
      }
    }
  }
  return share;
}

Result<SharedReadPlan> PlanSharedReads(const std::vector<SharedArray>& arrays,
                                       const JobNeeds& needs) {
  for (size_t a = 0; a < arrays.size(); ++a) {
    if (arrays[a].chunk_bytes.size() != static_cast<uint64_t>(arrays[a].grid.NumChunks())) {
      return InvalidArgumentError(absl::StrCat(
          ArrayName(arrays, a), " has ", arrays[a].chunk_bytes.size(), " chunk sizes for ",
          arrays[a].grid.NumChunks(), " chunks"));
    }
  }
  for (size_t l = 0; l < needs.distinct.size(); ++l) {
    TS_RETURN_IF_ERROR(CheckNeeds(needs.distinct[l], arrays, absl::StrCat("box list ", l)));
  }
  // The processes of each distinct list, in increasing order.
  std::vector<std::vector<int32_t>> members(needs.distinct.size());
  for (int p = 0; p < needs.process_count(); ++p) {
    const int l = needs.list_of_process[p];
    if (l < 0 || static_cast<size_t>(l) >= needs.distinct.size()) {
      return InvalidArgumentError(
          absl::StrCat("process ", p, " needs box list ", l, " of ", needs.distinct.size()));
    }
    members[l].push_back(p);
  }

  SharedReadPlan plan;
  plan.storage_bytes_.assign(needs.process_count(), 0);
  plan.array_begin_.reserve(arrays.size() + 1);
  // The lists that need each shared chunk (parallel to plan.shared_, as offsets into lists).
  std::vector<uint32_t> lists;
  std::vector<size_t> lists_begin;
  std::vector<std::pair<int64_t, uint32_t>> pairs;  // (chunk, list), per array
  for (size_t a = 0; a < arrays.size(); ++a) {
    plan.array_begin_.push_back(plan.shared_.size());
    pairs.clear();
    for (size_t l = 0; l < needs.distinct.size(); ++l) {
      if (members[l].empty()) continue;
      for (int64_t chunk : ChunksOf(arrays[a], needs.distinct[l].boxes[a])) {
        pairs.emplace_back(chunk, static_cast<uint32_t>(l));
      }
    }
    std::sort(pairs.begin(), pairs.end());
    for (size_t i = 0; i < pairs.size();) {
      size_t j = i;
      uint64_t needers = 0;
      for (; j < pairs.size() && pairs[j].first == pairs[i].first; ++j) {
        needers += members[pairs[j].second].size();
      }
      const uint64_t bytes = arrays[a].chunk_bytes[pairs[i].first];
      plan.unshared_bytes_ += bytes * needers;
      if (needers == 1) {
        plan.storage_bytes_[members[pairs[i].second].front()] += bytes;
      } else {
        plan.shared_.push_back(SharedChunk{static_cast<uint32_t>(a), pairs[i].first, bytes, -1,
                                           static_cast<uint32_t>(needers)});
        lists_begin.push_back(lists.size());
        for (size_t k = i; k < j; ++k) lists.push_back(pairs[k].second);
      }
      i = j;
    }
  }
  plan.array_begin_.push_back(plan.shared_.size());
  lists_begin.push_back(lists.size());

  // Chunks needed by the same lists form a group. Each group's chunks, in (array, chunk) order
  // (the order they lie in in the data files), are cut into runs, one per needer at most, that
  // bring its needers' loads as close to even as its bytes allow (least loaded first): a
  // process reads runs of neighbouring chunks (one request for several, and the storage's
  // read-ahead past a chunk reads what the same process reads next), and the bytes stay even.
  std::vector<std::vector<uint32_t>> groups;  // shared_ indices, in order
  {
    std::map<std::vector<uint32_t>, uint32_t> ids;
    std::vector<uint32_t> key;
    for (size_t s = 0; s < plan.shared_.size(); ++s) {
      key.assign(lists.begin() + static_cast<ptrdiff_t>(lists_begin[s]),
                 lists.begin() + static_cast<ptrdiff_t>(lists_begin[s + 1]));
      auto [it, added] = ids.emplace(key, static_cast<uint32_t>(groups.size()));
      if (added) groups.emplace_back();
      groups[it->second].push_back(static_cast<uint32_t>(s));
    }
  }
  std::vector<uint64_t> group_bytes(groups.size(), 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    for (uint32_t s : groups[g]) group_bytes[g] += plan.shared_[s].bytes;
  }
  // Largest groups first; ties by their first chunk.
  std::vector<uint32_t> order(groups.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t x, uint32_t y) { return group_bytes[x] > group_bytes[y]; });
  std::vector<int32_t> needers;
  for (uint32_t g : order) {
    const std::vector<uint32_t>& chunks = groups[g];
    needers.clear();
    for (size_t k = lists_begin[chunks[0]]; k < lists_begin[chunks[0] + 1]; ++k) {
      needers.insert(needers.end(), members[lists[k]].begin(), members[lists[k]].end());
    }
    std::sort(needers.begin(), needers.end(), [&](int32_t x, int32_t y) {
      return plan.storage_bytes_[x] != plan.storage_bytes_[y]
                 ? plan.storage_bytes_[x] < plan.storage_bytes_[y]
                 : x < y;
    });
    // Water-filling: the m least loaded needers take the group's bytes, each up to the level
    // (T + their loads) / m that they then all reach; a needer already above it takes none.
    // In integers: needer j's run ends at (j + 1) * (T + S_m) / m - S_(j+1) bytes into the
    // group, S_i the load of the i least loaded.
    // (128 bits: the products of bytes and process counts exceed 64 bits past ~1e19.)
    __extension__ typedef unsigned __int128 u128;
    const u128 total = group_bytes[g];
    size_t m = needers.size();
    u128 loads = 0;  // S_m
    for (size_t i = 0; i < m; ++i) loads += plan.storage_bytes_[needers[i]];
    while (m > 1 && u128{plan.storage_bytes_[needers[m - 1]]} * m >= total + loads) {
      loads -= plan.storage_bytes_[needers[--m]];
    }
    size_t j = 0;
    u128 loads_through_j = plan.storage_bytes_[needers[0]];  // S_(j+1)
    u128 before = 0;  // bytes of the group's chunks before this one
    for (uint32_t s : chunks) {
      SharedChunk& chunk = plan.shared_[s];
      // The run that holds the chunk's middle byte: 2 * middle * m < 2 * m * end_j.
      const u128 middle2 = 2 * before + chunk.bytes;
      while (j + 1 < m &&
             middle2 * m >= 2 * ((j + 1) * (total + loads) - m * loads_through_j)) {
        ++j;
        loads_through_j += plan.storage_bytes_[needers[j]];
      }
      chunk.reader = needers[j];
      before += chunk.bytes;
    }
    for (uint32_t s : chunks) plan.storage_bytes_[plan.shared_[s].reader] += plan.shared_[s].bytes;
  }
  return plan;
}

}  // namespace tensorstash
