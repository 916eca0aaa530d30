// `tensorstash gc ROOT`: removes what killed and failed saves left under a checkpoint root
// (unnamed attempts and superseded commit records on object stores, stale multipart uploads,
// crashed saves' folders), never a committed step. The logic is checkpoint/garbage.h.
#include <cstdio>

#include "commands.h"
#include "common.h"
#include "tensorstash/checkpoint/garbage.h"
#include "tensorstash/kvstore/registry.h"

namespace tensorstash::cli {
namespace {

struct GcArgs {
  std::string root;
  bool dry_run = false;
  int64_t upload_min_age_s = 3600;
};

int RunGc(const GcArgs& args) {
  Result<std::unique_ptr<KvStore>> kv = OpenKvStore(args.root, {.create = false});
  if (!kv.ok()) return Fail(kv.status());
  GarbageOptions options;
  options.dry_run = args.dry_run;
  options.upload_min_age = std::chrono::seconds(args.upload_min_age_s);
  Result<GarbageReport> report = CollectGarbage(kv->get(), options);
  if (!report.ok()) return Fail(report.status());
  const char* verb = args.dry_run ? "would remove" : "removed";
  for (const std::string& key : report->removed) std::printf("%s %s\n", verb, key.c_str());
  for (const std::string& key : report->aborted_uploads) {
    std::printf("%s the unfinished upload of %s\n", args.dry_run ? "would abort" : "aborted",
                key.c_str());
  }
  std::printf("%s %zu folders or objects (%s) and %zu unfinished uploads under %s\n",
              args.dry_run ? "gc would remove" : "gc removed", report->removed.size(),
              HumanBytes(report->bytes).c_str(), report->aborted_uploads.size(), args.root.c_str());
  return 0;
}

}  // namespace

void AddGcCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand(
      "gc",
      "Remove what killed or failed saves left under a checkpoint root (never a committed "
      "step); takes the root's lock, so it refuses while a manager runs there");
  auto args = std::make_shared<GcArgs>();
  cmd->add_option("ROOT", args->root, "Folder or store URL holding step folders")->required();
  cmd->add_flag("--dry-run,-n", args->dry_run, "Only say what would be removed");
  cmd->add_option("--upload-min-age", args->upload_min_age_s,
                  "Abort S3 multipart uploads started at least this many seconds ago")
      ->default_val(3600)
      ->check(CLI::NonNegativeNumber);
  cmd->callback([args, exit_code] { *exit_code = RunGc(*args); });
}

}  // namespace tensorstash::cli
