// `tensorstash ls ROOT`: the steps under a checkpoint root, complete or not. Orbax manager roots
// and zarr-group roots are recognized too (their steps show their format as status).
// The listing itself is library logic (manager/step_listing.h); this prints it.
#include <cstdio>

#include "commands.h"
#include "common.h"
#include "tensorstash/manager/step_listing.h"
#include "tensorstash/kvstore/registry.h"

namespace tensorstash::cli {
namespace {

int RunLs(const std::string& root) {
  Result<std::unique_ptr<KvStore>> kv = OpenKvStore(root, {.create = false});
  if (!kv.ok()) return Fail(kv.status());
  Result<std::vector<StepListing>> rows = ListCheckpointRoot(kv->get());
  if (!rows.ok()) return Fail(rows.status());
  std::printf("%-28s %-11s %12s  %s\n", "STEP", "STATUS", "SIZE", "CREATED");
  for (const StepListing& row : *rows) {
    const std::string created = row.created_unix_ms > 0 ? HumanTime(row.created_unix_ms) : "-";
    std::printf("%-28s %-11s %12s  %s\n", row.name.c_str(), row.status.c_str(),
                HumanBytes(row.bytes).c_str(), created.c_str());
  }
  if (rows->empty()) std::printf("(no steps under %s)\n", root.c_str());
  for (const StepListing& row : *rows) {
    if (!row.problem.empty())
      std::fprintf(stderr, "damaged: %s: %s\n", row.name.c_str(), row.problem.c_str());
  }
  return 0;
}

}  // namespace

void AddLsCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand(
      "ls", "List the steps under a checkpoint root: complete or not, size, time");
  auto root = std::make_shared<std::string>();
  cmd->add_option("ROOT", *root, "Folder holding step folders")->required();
  cmd->callback([root, exit_code] { *exit_code = RunLs(*root); });
}

}  // namespace tensorstash::cli
