// `tensorstash gc ROOT`: removes what killed and failed saves left under a checkpoint root
// (unnamed attempts and superseded commit records on object stores, stale multipart uploads,
// crashed saves' folders, Orbax's temporary folders), never a committed step, and nothing
// written within --min-age (a save in flight). The logic is manager/garbage.h.
#include <cstdio>

#include "commands.h"
#include "common.h"
#include "tensorstash/manager/garbage.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash::cli {
namespace {

// "6 h", "90 s": how long --min-age is, for the summary.
std::string HumanSeconds(int64_t seconds) {
  if (seconds >= 3600 && seconds % 3600 == 0) return StrCat(seconds / 3600, " h");
  if (seconds >= 60 && seconds % 60 == 0) return StrCat(seconds / 60, " min");
  return StrCat(seconds, " s");
}

struct GcArgs {
  std::string root;
  bool dry_run = false;
  int64_t min_age_s = kDefaultGarbageMinAge.count();
};

int RunGc(const GcArgs& args) {
  Result<std::unique_ptr<KvStore>> kv = OpenKvStore(args.root, {.create = false});
  if (!kv.ok()) return Fail(kv.status());
  GarbageOptions options;
  options.dry_run = args.dry_run;
  options.min_age = std::chrono::seconds(args.min_age_s);
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
  if (!report->kept_young.empty()) {
    std::printf("left %zu folders written less than %s ago (a save may still be writing them; "
                "--min-age):",
                report->kept_young.size(), HumanSeconds(args.min_age_s).c_str());
    for (const std::string& key : report->kept_young) std::printf(" %s", key.c_str());
    std::printf("\n");
  }
  return 0;
}

}  // namespace

void AddGcCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand(
      "gc",
      "Remove what killed or failed saves left under a checkpoint root, and retired steps "
      "(incremental bases a manager's retention dropped) that no step refers to any more; "
      "never a step that is listed or whose data a step refers to. Takes the root's lock, so "
      "it refuses while a manager runs there");
  auto args = std::make_shared<GcArgs>();
  cmd->add_option("ROOT", args->root, "Folder or store URL holding step folders")->required();
  cmd->add_flag("--dry-run,-n", args->dry_run, "Only say what would be removed");
  cmd->add_option("--min-age,--upload-min-age", args->min_age_s,
                  "Leave alone what was written less than this many seconds ago (temporary "
                  "folders, attempts, uncommitted steps, S3 uploads): a save that takes no lock "
                  "may still be writing it")
      ->default_val(kDefaultGarbageMinAge.count())
      ->check(CLI::NonNegativeNumber);
  cmd->callback([args, exit_code] { *exit_code = RunGc(*args); });
}

}  // namespace tensorstash::cli
