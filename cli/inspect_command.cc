// `tensorstash inspect CKPT`: what a step holds, read from its metadata only. Works on native
// steps, Orbax checkpoints and zarr groups (the format is detected and printed).
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "commands.h"
#include "common.h"
#include "absl/strings/escaping.h"
#include "nlohmann/json.hpp"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/open_step.h"
#include "tensorstash/format/tree.h"

namespace tensorstash::cli {
namespace {

std::string ShapeText(const std::vector<int64_t>& shape) {
  return StrCat("(", StrJoin(shape, ", "), shape.size() == 1 ? ",)" : ")");
}

// The arrays that are the key data of typed PRNG keys, by array id, with the implementation:
// the marked dict nodes of docs/format.md 4.2 (written by the Python front).
std::map<int64_t, std::string> PrngKeyImpls(const TreeNode& root) {
  std::map<int64_t, std::string> out;
  std::vector<const TreeNode*> stack{&root};  // (the tree may be 512 levels deep)
  while (!stack.empty()) {
    const TreeNode* node = stack.back();
    stack.pop_back();
    if (node->kind == TreeNode::Kind::kDict) {
      const auto& e = node->entries;
      if (e.size() == 2 && e[0].first == "__tensorstash_prng_key__" &&
          e[0].second.kind == TreeNode::Kind::kString && e[1].first == "key_data" &&
          e[1].second.kind == TreeNode::Kind::kArray) {
        out[e[1].second.array_id] = e[0].second.string_value;
        continue;
      }
      for (const auto& entry : e) stack.push_back(&entry.second);
    } else {
      for (const TreeNode& item : node->items) stack.push_back(&item);
    }
  }
  return out;
}

// The recorded sharding of each array (docs/format.md 4.2), by array id, as JSON objects: the
// "sharding" of the native format's array leaves; for an Orbax checkpoint, its `_sharding` file
// ({base64url of the parameter name, the array path's keys joined by '.': JSON text}). Arrays
// with none are left out; an unreadable `_sharding` gives none (inspect shows what it can).
std::map<int64_t, nlohmann::json> RecordedShardings(StepSource& r) {
  std::map<int64_t, nlohmann::json> out;
  if (r.native() != nullptr) {
    std::vector<const TreeNode*> stack{&r.tree()};  // (the tree may be 512 levels deep)
    while (!stack.empty()) {
      const TreeNode* node = stack.back();
      stack.pop_back();
      if (node->kind == TreeNode::Kind::kArray && !node->sharding.empty()) {
        nlohmann::json doc = nlohmann::json::parse(node->sharding, nullptr, false);
        if (doc.is_object()) out[node->array_id] = std::move(doc);
      }
      for (const auto& entry : node->entries) stack.push_back(&entry.second);
      for (const TreeNode& item : node->items) stack.push_back(&item);
    }
    return out;
  }
  if (r.format() != StepFormat::kOrbaxOcdbt && r.format() != StepFormat::kOrbaxFolders) return out;
  Result<std::string> text = r.ReadFile("_sharding");
  if (!text.ok()) return out;
  nlohmann::json doc = nlohmann::json::parse(*text, nullptr, false);
  if (!doc.is_object()) return out;
  for (size_t i = 0; i < r.arrays().size(); ++i) {
    Result<std::vector<std::string>> keys = SplitArrayPath(r.arrays()[i].path);
    if (!keys.ok()) continue;
    std::string encoded;
    const std::string name = StrJoin(*keys, ".");
    absl::Base64Escape(name, &encoded);  // standard alphabet, padded; then Python's urlsafe one
    for (char& c : encoded) c = c == '+' ? '-' : c == '/' ? '_' : c;
    auto entry = doc.find(encoded);
    if (entry == doc.end() || !entry->is_string()) continue;
    nlohmann::json sharding = nlohmann::json::parse(entry->get<std::string>(), nullptr, false);
    if (sharding.is_object()) out[static_cast<int64_t>(i)] = std::move(sharding);
  }
  return out;
}

// A recorded sharding in a line: "NamedSharding mesh (2, 4) axes (a, b) spec ((a, b), None)
// devices [1, 0, ...]" (device ids only when recorded, i.e. not 0..n-1), or its type. Reads the
// object defensively: it is whatever the writer recorded, and a member of an unexpected type is
// left out rather than thrown over.
std::string ShardingText(const nlohmann::json& doc) {
  auto member = [&doc](const char* name) -> const nlohmann::json* {
    auto it = doc.find(name);
    return it == doc.end() ? nullptr : &*it;
  };
  auto text = [](const nlohmann::json& v) -> std::string {
    if (v.is_null()) return "None";
    if (v.is_string()) return v.get<std::string>();
    return v.dump();
  };
  auto list = [&text](const nlohmann::json& items) {
    std::vector<std::string> parts;
    for (const auto& item : items) {
      if (item.is_array()) {
        std::vector<std::string> inner;
        for (const auto& x : item) inner.push_back(text(x));
        parts.push_back(StrCat("(", StrJoin(inner, ", "), ")"));
      } else {
        parts.push_back(text(item));
      }
    }
    return StrCat("(", StrJoin(parts, ", "), parts.size() == 1 ? ",)" : ")");
  };
  const nlohmann::json* type = member("sharding_type");
  const std::string kind = type != nullptr && type->is_string() ? type->get<std::string>() : "?";
  if (kind == "SingleDeviceSharding") {
    const nlohmann::json* device = member("device_str");
    return StrCat(kind, " ", device != nullptr ? text(*device) : "?");
  }
  if (kind != "NamedSharding") return kind;
  std::string out = kind;
  if (const nlohmann::json* shape = member("shape"); shape != nullptr && shape->is_array()) {
    out += StrCat(" mesh ", list(*shape));
  }
  if (const nlohmann::json* axes = member("axis_names"); axes != nullptr && axes->is_array()) {
    out += StrCat(" axes ", list(*axes));
  }
  if (const nlohmann::json* spec = member("partition_spec"); spec != nullptr && spec->is_array()) {
    out += StrCat(" spec ", list(*spec));
  }
  if (const nlohmann::json* mesh = member("device_mesh"); mesh != nullptr && mesh->is_object()) {
    std::vector<int64_t> ids;
    std::vector<const nlohmann::json*> stack;
    if (auto it = mesh->find("mesh"); it != mesh->end()) stack.push_back(&*it);
    while (!stack.empty()) {
      const nlohmann::json* x = stack.back();
      stack.pop_back();
      if (x->is_array()) {
        for (auto it = x->rbegin(); it != x->rend(); ++it) stack.push_back(&*it);
      } else if (auto id = x->is_object() ? x->find("id") : x->end();
                 x->is_object() && id != x->end() && id->is_number_integer()) {
        ids.push_back(id->get<int64_t>());
      }
    }
    out += StrCat(" devices [", StrJoin(ids, ", "), "]");
  }
  return out;
}

int RunInspect(const std::string& path, bool as_json) {
  Result<StepLocation> location = OpenStepPath(path);
  if (!location.ok()) return Fail(location.status());
  ReaderOptions options;
  options.open_damaged = true;  // inspect reads metadata only; damaged data is verify's business
  Result<std::unique_ptr<StepSource>> reader =
      OpenStepSource(location->kv.get(), location->key, options);
  if (!reader.ok()) return Fail(reader.status());
  StepSource& r = **reader;
  const std::string format(StepFormatName(r.format()));
  uint64_t total = 0;
  for (size_t i = 0; i < r.arrays().size(); ++i) total += r.StoredBytes(i);
  // Native steps count their data files; foreign ones are described by their format.
  const CheckpointReader* native = r.native();
  size_t data_files = 0;
  // Incremental steps (docs/format.md, 6.1): the bytes that lie in other steps' files.
  uint64_t borrowed = 0;
  std::vector<std::string> depends_on;
  if (native != nullptr) {
    const ChunkIndex& index = native->index();
    for (const DataFileInfo& f : index.files) data_files += f.step.empty() ? 1 : 0;
    for (const IndexEntry& e : index.entries) {
      if (!index.files[e.file_id].step.empty()) borrowed += e.length;
    }
    depends_on = native->commit_record().depends_on;
  }
  const std::map<int64_t, std::string> keys = PrngKeyImpls(r.tree());
  const std::map<int64_t, nlohmann::json> shardings = RecordedShardings(r);

  if (as_json) {
    nlohmann::json doc;
    doc["path"] = path;
    doc["format"] = format;
    doc["created_unix_ms"] = r.created_unix_ms();
    doc["process_count"] = r.process_count();
    doc["stored_bytes"] = total;
    if (native != nullptr) {
      doc["data_files"] = data_files;
      doc["depends_on"] = depends_on;
      doc["borrowed_bytes"] = borrowed;
    }
    nlohmann::json arrays = nlohmann::json::array();
    for (size_t i = 0; i < r.arrays().size(); ++i) {
      const ArrayMetadata& a = r.arrays()[i];
      arrays.push_back({{"path", a.path},
                        {"dtype", std::string(DTypeName(a.dtype))},
                        {"shape", a.shape()},
                        {"chunk_shape", a.grid.chunk_shape},
                        {"cell_shape", a.grid.cell_shape},
                        {"chunks", r.NumChunks(i)},
                        {"stored_bytes", r.StoredBytes(i)},
                        {"codec", r.CodecDescription(i)}});
      if (auto key = keys.find(static_cast<int64_t>(i)); key != keys.end()) {
        arrays.back()["prng_key_impl"] = key->second;
      }
      if (auto sharding = shardings.find(static_cast<int64_t>(i)); sharding != shardings.end()) {
        arrays.back()["sharding"] = sharding->second;
      }
    }
    doc["arrays"] = std::move(arrays);
    std::cout << doc.dump(2) << "\n";
    return 0;
  }
  std::printf("checkpoint %s\n", path.c_str());
  if (native != nullptr) {
    std::printf("  format tensorstash\n");
    std::printf("  created %s by %d process(es); %zu arrays, %s in %zu data file(s)\n\n",
                HumanTime(r.created_unix_ms()).c_str(), r.process_count(), r.arrays().size(),
                HumanBytes(total).c_str(), data_files);
    if (!depends_on.empty()) {
      std::string steps;
      for (const std::string& d : depends_on) steps += (steps.empty() ? "" : ", ") + d;
      std::printf("  incremental: %s of it in the files of step(s) %s\n\n",
                  HumanBytes(borrowed).c_str(), steps.c_str());
    }
  } else {
    std::printf("  format %s (%s)\n", format.c_str(), r.dir().c_str());
    std::printf("  created %s; %zu arrays, %s stored\n\n",
                r.created_unix_ms() > 0 ? HumanTime(r.created_unix_ms()).c_str() : "(unknown)",
                r.arrays().size(), HumanBytes(total).c_str());
  }
  size_t path_width = 4;
  for (const ArrayMetadata& a : r.arrays()) path_width = std::max(path_width, a.path.size());
  path_width = std::min<size_t>(path_width, 60);
  std::printf("%-*s  %-13s %-20s %-20s %7s %12s  %s\n", static_cast<int>(path_width), "PATH",
              "DTYPE", "SHAPE", "CHUNK", "CHUNKS", "STORED", "CODEC");
  for (size_t i = 0; i < r.arrays().size(); ++i) {
    const ArrayMetadata& a = r.arrays()[i];
    std::printf("%-*s  %-13s %-20s %-20s %7lld %12s  %s\n", static_cast<int>(path_width),
                a.path.c_str(), std::string(DTypeName(a.dtype)).c_str(),
                ShapeText(a.shape()).c_str(), ShapeText(a.grid.chunk_shape).c_str(),
                static_cast<long long>(r.NumChunks(i)), HumanBytes(r.StoredBytes(i)).c_str(),
                r.CodecDescription(i).c_str());
  }
  if (!shardings.empty()) {
    std::printf("\nShardings as saved (tensorstash.metadata gives them as .sharding):\n");
    for (const auto& [id, doc] : shardings) {
      std::printf("  %s  %s\n", r.arrays()[id].path.c_str(), ShardingText(doc).c_str());
    }
  }
  if (!keys.empty()) {
    std::printf("\nPRNG key arrays (stored as their uint32 key data; tensorstash.restore gives "
                "keys):\n");
    for (const auto& [id, impl] : keys) {
      const std::string& data_path = r.arrays()[id].path;
      const size_t slash = data_path.rfind('/');
      const std::string leaf =
          slash == std::string::npos ? "(the root)" : data_path.substr(0, slash);
      std::printf("  %s  %s\n", leaf.c_str(), impl.c_str());
    }
  }
  return 0;
}

}  // namespace

void AddInspectCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand(
      "inspect",
      "Show the arrays of a step (tensorstash, Orbax or zarr group): path, dtype, shape, chunk "
      "shape, stored bytes, codec");
  auto path = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  cmd->add_option("CKPT", *path,
                  "A step folder (e.g. ckpts/0000001000) or an Orbax checkpoint folder")
      ->required();
  cmd->add_flag("--json", *as_json, "Print JSON for machines");
  cmd->callback([path, as_json, exit_code] { *exit_code = RunInspect(*path, *as_json); });
}

}  // namespace tensorstash::cli
