// `tensorstash ls ROOT`: the steps under a checkpoint root, complete or not. Orbax manager roots
// and zarr-group roots are recognized too (their steps show their format as status).
#include <iostream>
#include <map>

#include "commands.h"
#include "common.h"
#include "nlohmann/json.hpp"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/layout.h"
#include "tensorstash/checkpoint/step_source.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/kvstore/registry.h"

namespace tensorstash::cli {
namespace {

struct StepRow {
  uint64_t bytes = 0;
  bool has_commit = false;
};

int RunLs(const std::string& root) {
  Result<std::unique_ptr<KvStore>> kv = OpenKvStore(root, {.create = false});
  if (!kv.ok()) return Fail(kv.status());
  Result<std::vector<std::string>> keys = (*kv)->List("");
  if (!keys.ok()) return Fail(keys.status());
  std::map<std::string, StepRow> steps;
  for (const std::string& key : *keys) {
    const size_t slash = key.find('/');
    if (slash == std::string::npos) continue;  // a loose file, not a step
    const std::string step = key.substr(0, slash);
    StepRow& row = steps[step];
    if (Result<uint64_t> size = (*kv)->Size(key); size.ok()) row.bytes += *size;
    if (key.substr(slash + 1) == kCommitFileName) row.has_commit = true;
  }
  std::printf("%-28s %-11s %12s  %s\n", "STEP", "STATUS", "SIZE", "CREATED");
  std::vector<std::string> damaged;  // why each damaged step does not open
  for (const auto& [step, row] : steps) {
    std::string status = "incomplete";
    std::string created = "-";
    if (IsTemporaryStepName(step) || step.find(".orbax-checkpoint-tmp") != std::string::npos) {
      status = "temporary";
    } else if (!row.has_commit) {
      // A foreign step: Orbax (an item with _METADATA) or a zarr group with write_completed.
      Result<DetectedStep> detected = DetectStepFormat(kv->get(), step);
      if (detected.ok() && detected->format != StepFormat::kNative) {
        status = std::string(StepFormatName(detected->format));
        if (detected->format == StepFormat::kZarrGroup) {
          Result<std::string> attrs = (*kv)->Read(StrCat(detected->dir, "/.zattrs"));
          const nlohmann::json doc = attrs.ok() ? nlohmann::json::parse(*attrs, nullptr, false)
                                                : nlohmann::json();
          if (!doc.is_object() || !doc.contains("write_completed") || doc["write_completed"] != true) {
            status = "incomplete";
          }
        }
        Result<std::string> meta = (*kv)->Read(StrCat(step, "/_CHECKPOINT_METADATA"));
        if (meta.ok()) {
          const nlohmann::json doc = nlohmann::json::parse(*meta, nullptr, false);
          if (doc.is_object() && doc.contains("commit_timestamp_nsecs") &&
              doc["commit_timestamp_nsecs"].is_number_integer()) {
            created = HumanTime(doc["commit_timestamp_nsecs"].get<int64_t>() / 1000000);
          }
        }
      }
    } else {
      // Complete only when it opens: COMMIT (size checked before it is read), tree.json and
      // index all check, as a restore and the manager require.
      Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv->get(), step);
      if (reader.ok()) {
        status = "complete";
        created = HumanTime((*reader)->commit_record().created_unix_ms);
      } else {
        status = "damaged";
        damaged.push_back(StrCat(step, ": ", reader.status().message()));
      }
    }
    std::printf("%-28s %-11s %12s  %s\n", step.c_str(), status.c_str(), HumanBytes(row.bytes).c_str(),
                created.c_str());
  }
  if (steps.empty()) std::printf("(no steps under %s)\n", root.c_str());
  for (const std::string& why : damaged) std::fprintf(stderr, "damaged: %s\n", why.c_str());
  return 0;
}

}  // namespace

void AddLsCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand("ls", "List the steps under a checkpoint root: complete or not, size, time");
  auto root = std::make_shared<std::string>();
  cmd->add_option("ROOT", *root, "Folder holding step folders")->required();
  cmd->callback([root, exit_code] { *exit_code = RunLs(*root); });
}

}  // namespace tensorstash::cli
