// `tensorstash inspect CKPT`: what a step holds, read from its metadata only. Works on native
// steps, Orbax checkpoints and zarr groups (the format is detected and printed).
#include <iostream>
#include <map>

#include "commands.h"
#include "common.h"
#include "nlohmann/json.hpp"
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
  const size_t data_files = native != nullptr ? native->index().files.size() : 0;
  const std::map<int64_t, std::string> keys = PrngKeyImpls(r.tree());

  if (as_json) {
    nlohmann::json doc;
    doc["path"] = path;
    doc["format"] = format;
    doc["created_unix_ms"] = r.created_unix_ms();
    doc["process_count"] = r.process_count();
    doc["stored_bytes"] = total;
    if (native != nullptr) doc["data_files"] = data_files;
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
