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
  // OWNED: the bytes under the step's folder; BORROWED: the bytes of its chunks that lie in
  // other steps' files (incremental steps), and which steps.
  std::printf("%-28s %-11s %12s %12s  %-24s %s\n", "STEP", "STATUS", "OWNED", "BORROWED",
              "CREATED", "DEPENDS ON");
  for (const StepListing& row : *rows) {
    const std::string created = row.created_unix_ms > 0 ? HumanTime(row.created_unix_ms) : "-";
    const std::string borrowed = row.depends_on.empty() ? "-" : HumanBytes(row.borrowed_bytes);
    const std::string depends_on = row.depends_on.empty() ? "-" : StrJoin(row.depends_on, ",");
    std::printf("%-28s %-11s %12s %12s  %-24s %s\n", row.name.c_str(), row.status.c_str(),
                HumanBytes(row.bytes).c_str(), borrowed.c_str(), created.c_str(),
                depends_on.c_str());
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
      "ls", "List the steps under a checkpoint root: complete, retired or not, the bytes each "
            "owns and borrows from other steps (incremental), time, the steps it depends on");
  auto root = std::make_shared<std::string>();
  cmd->add_option("ROOT", *root, "Folder holding step folders")->required();
  cmd->callback([root, exit_code] { *exit_code = RunLs(*root); });
}

}  // namespace tensorstash::cli
