#include "tensorstash/tiers/holdings.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <set>
#include <system_error>

#include "nlohmann/json.hpp"
#include "tensorstash/array/dtype.h"
#include "tensorstash/engine/layout.h"
#include "tensorstash/manager/step_store.h"
#include "tensorstash/tiers/tiered_source.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/endian.h"
#include "tensorstash/util/random_id.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

using json = nlohmann::json;

constexpr std::string_view kValuesMagic = "tensorstash per-process values 3\n";

}  // namespace

std::vector<int> ValueRing(int index, int count) {
  std::vector<int> ring;
  for (int d = 0; d < std::min(count, kValueReplicas + 1); ++d) ring.push_back((index + d) % count);
  return ring;
}

std::string HoldingFolder(int process_index, int process_count) {
  return StrCat("p", process_index, "-of-", process_count);
}

std::optional<std::pair<int, int>> ParseHoldingFolder(std::string_view name) {
  if (name.size() < 6 || name[0] != 'p') return std::nullopt;
  const size_t of = name.find("-of-");
  if (of == std::string_view::npos) return std::nullopt;
  int index = 0;
  int count = 0;
  const std::string_view index_text = name.substr(1, of - 1);
  const std::string_view count_text = name.substr(of + 4);
  // Digits only: from_chars would take a sign.
  auto digits = [](std::string_view s) {
    return !s.empty() &&
           std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (!digits(index_text) || !digits(count_text) || !ParseInt(index_text, &index) ||
      !ParseInt(count_text, &count) || index >= count) {
    return std::nullopt;
  }
  return std::make_pair(index, count);
}

std::string PackValues(const PackedValues& packed) {
  std::string out(kValuesMagic);
  for (const std::string& text : {packed.run, packed.save_id}) {
    PutLE32(&out, static_cast<uint32_t>(text.size()));
    out.append(text);
  }
  PutLE32(&out, static_cast<uint32_t>(packed.values.size()));
  for (const auto& [index, value] : packed.values) {
    PutLE32(&out, static_cast<uint32_t>(index));
    out.push_back(value.has_value() ? 1 : 0);
    PutLE64(&out, value.has_value() ? value->size() : 0);
    if (value.has_value()) out.append(*value);
  }
  return out;
}

Result<PackedValues> UnpackValues(std::string_view data, std::string_view where) {
  auto malformed = [&](std::string_view why) {
    return DataLossError(StrCat("the per-process values of ", where, " are malformed: ", why));
  };
  if (data.substr(0, kValuesMagic.size()) != kValuesMagic) return malformed("no magic");
  size_t pos = kValuesMagic.size();
  auto take = [&](size_t n) -> std::optional<std::string_view> {
    if (n > data.size() - pos) return std::nullopt;
    std::string_view part = data.substr(pos, n);
    pos += n;
    return part;
  };
  PackedValues packed;
  for (std::string* text : {&packed.run, &packed.save_id}) {
    std::optional<std::string_view> length = take(4);
    std::optional<std::string_view> bytes = length ? take(GetLE32(length->data())) : std::nullopt;
    if (!bytes) return malformed("truncated");
    *text = std::string(*bytes);
  }
  std::optional<std::string_view> count = take(4);
  if (!count) return malformed("truncated");
  ProcessValues& values = packed.values;
  for (uint32_t i = 0, n = GetLE32(count->data()); i < n; ++i) {
    std::optional<std::string_view> head = take(4 + 1 + 8);
    if (!head) return malformed("truncated");
    const int index = static_cast<int>(GetLE32(head->data()));
    const bool present = (*head)[4] != 0;
    std::optional<std::string_view> value = take(GetLE64(head->data() + 5));
    if (!value) return malformed("truncated");
    values[index] = present ? std::optional<std::string>(std::string(*value)) : std::nullopt;
  }
  return packed;
}

std::string NewSaveId() {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  char time_text[32];
  std::snprintf(
      time_text, sizeof(time_text), "%020lld",
      static_cast<long long>(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count()));
  return StrCat(time_text, "-", RandomHexId(12));
}

std::string ArraysDigest(const std::vector<ArrayMetadata>& arrays) {
  std::vector<std::string> lines;
  for (const ArrayMetadata& array : arrays) {
    json line = {array.path, DTypeName(array.dtype), array.grid.shape, array.grid.cell_shape,
                 array.grid.chunk_shape};
    lines.push_back(line.dump());
  }
  std::sort(lines.begin(), lines.end());
  uint32_t crc = 0;
  for (const std::string& line : lines) crc = Crc32c(line + "\n", crc);
  char text[16];
  std::snprintf(text, sizeof(text), "%08x", crc);
  return StrCat(arrays.size(), "-", text);
}

std::optional<SaveKey> Holding::save() const {
  std::optional<std::pair<int, int>> saved_by = ParseHoldingFolder(folder);
  if (!saved_by) return std::nullopt;
  return SaveKey{step, save_id, digest, saved_by->second};
}

std::string HoldingsToJson(const std::vector<Holding>& holdings) {
  json out = json::array();
  for (const Holding& h : holdings) {
    out.push_back({{"holder", h.holder},
                   {"folder", h.folder},
                   {"run", h.run},
                   {"step", h.step},
                   {"save_id", h.save_id},
                   {"digest", h.digest},
                   {"num_chunks", h.num_chunks},
                   {"chunks", h.chunks},
                   {"values", h.values}});
  }
  return out.dump();
}

Result<std::vector<Holding>> HoldingsFromJson(std::string_view text) {
  std::vector<Holding> out;
  try {
    for (const json& doc : json::parse(text)) {
      Holding h;
      h.holder = doc.at("holder").get<int>();
      h.folder = doc.at("folder").get<std::string>();
      h.run = doc.value("run", std::string());
      h.step = doc.at("step").get<int64_t>();
      h.save_id = doc.at("save_id").get<std::string>();
      h.digest = doc.at("digest").get<std::string>();
      h.num_chunks = doc.at("num_chunks").get<std::map<std::string, int64_t>>();
      h.chunks = doc.at("chunks").get<std::map<std::string, std::vector<int64_t>>>();
      h.values = doc.at("values").get<std::vector<int>>();
      out.push_back(std::move(h));
    }
  } catch (const json::exception& e) {
    return InvalidArgumentError(StrCat("a list of holdings that is not valid: ", e.what()));
  }
  return out;
}

std::map<int64_t, SaveKey> RestorableSaves(const std::vector<Holding>& holdings) {
  std::map<SaveKey, std::vector<const Holding*>> by_save;
  for (const Holding& h : holdings) {
    if (std::optional<SaveKey> save = h.save()) by_save[*save].push_back(&h);
  }
  std::map<int64_t, SaveKey> chosen;
  for (const auto& [save, group] : by_save) {  // ascending: a later save of a step wins
    std::set<int> values;
    for (const Holding* h : group) values.insert(h->values.begin(), h->values.end());
    bool complete = true;
    for (int p = 0; p < save.process_count && complete; ++p) complete = values.count(p) > 0;
    for (const auto& [path, n] : group.front()->num_chunks) {
      if (!complete) break;
      std::set<int64_t> held;
      for (const Holding* h : group) {
        auto it = h->chunks.find(path);
        if (it == h->chunks.end()) continue;
        for (int64_t c : it->second) {
          if (c >= 0 && c < n) held.insert(c);
        }
      }
      complete = static_cast<int64_t>(held.size()) == n;
    }
    if (complete) chosen[save.step] = save;
  }
  return chosen;
}

std::vector<int64_t> RestorableSteps(const std::vector<Holding>& holdings,
                                     const std::vector<int64_t>& persistent_steps) {
  std::set<int64_t> steps(persistent_steps.begin(), persistent_steps.end());
  for (const auto& [step, save] : RestorableSaves(holdings)) steps.insert(step);
  return std::vector<int64_t>(steps.begin(), steps.end());
}

std::vector<Holding> DescribeHoldings(const std::string& local_dir, int holder) {
  namespace fs = std::filesystem;
  std::vector<Holding> out;
  std::error_code error;
  std::set<std::string> folders;
  for (const fs::directory_entry& entry : fs::directory_iterator(local_dir, error)) {
    const std::string name = entry.path().filename().string();
    if (ParseHoldingFolder(name)) folders.insert(name);
  }
  for (const std::string& folder : folders) {
    std::set<std::string> steps;
    for (const fs::directory_entry& entry :
         fs::directory_iterator(fs::path(local_dir) / folder, error)) {
      const std::string name = entry.path().filename().string();
      if (StepStore::ParseStepName(name) && fs::exists(entry.path() / kCommitFileName, error)) {
        steps.insert(name);
      }
    }
    for (const std::string& step : steps) {
      Result<std::unique_ptr<KvStore>> kv = OpenKvStore(local_dir, {.create = false});
      if (!kv.ok()) return out;
      std::vector<StepHolder> holders;
      holders.push_back({Tier::kLocal, *std::move(kv), StrCat(folder, "/", step), ""});
      Result<std::unique_ptr<TieredStepSource>> source = TieredStepSource::Open(std::move(holders));
      if (!source.ok()) continue;
      Result<std::string> packed = (*source)->ReadFile(ProcessStateFileName(0));
      if (!packed.ok()) continue;
      Result<PackedValues> values =
          UnpackValues(*packed, StrCat(local_dir, "/", folder, "/", step));
      if (!values.ok()) continue;
      Holding h;
      h.holder = holder;
      h.folder = folder;
      h.run = values->run;
      h.step = *StepStore::ParseStepName(step);
      h.save_id = values->save_id;
      for (const auto& [index, value] : values->values) h.values.push_back(index);
      const std::vector<ArrayMetadata>& arrays = (*source)->arrays();
      h.digest = ArraysDigest(arrays);
      const std::vector<std::vector<int64_t>>& held = (*source)->held_chunks(0);
      for (size_t i = 0; i < arrays.size(); ++i) {
        h.num_chunks[arrays[i].path] = (*source)->NumChunks(i);
        h.chunks[arrays[i].path] = held[i];
      }
      out.push_back(std::move(h));
    }
  }
  return out;
}

std::function<bool(std::string_view key)> CommittedHoldingKeys(std::string local_dir) {
  return [root = std::move(local_dir)](std::string_view key) {
    const size_t first = key.find('/');
    const size_t second = first == std::string_view::npos ? first : key.find('/', first + 1);
    if (second == std::string_view::npos) return false;
    if (!StepStore::ParseStepName(key.substr(first + 1, second - first - 1))) return false;
    std::error_code error;
    return std::filesystem::exists(
        std::filesystem::path(root) / key.substr(0, second) / kCommitFileName, error);
  };
}

}  // namespace tensorstash
