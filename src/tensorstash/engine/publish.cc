// The publish sequence (engine/publish.h). The old folder is moved aside rather than deleted
// first, so that until the new one is in place and its rename is durable, a failure can put
// everything back: readers see the old checkpoint or the new one, whole, and a failed save
// leaves the old one as it was. The one window without anything at `dir` lies between the two
// renames; a crash there leaves the old folder under `aside_dir`, which the writers and the
// manager roll back on their next run (docs/format.md, section 13).
#include "tensorstash/engine/publish.h"

#include <vector>

#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

std::string ParentOf(const std::string& key) {
  const size_t slash = key.rfind('/');
  return slash == std::string::npos ? std::string() : key.substr(0, slash);
}

}  // namespace

Status PublishFolder(KvStore* kv, const std::string& work_dir, const std::string& dir,
                     const std::string& aside_dir, bool sync) {
  if (!kv->SupportsRename()) {
    return UnimplementedError(StrCat(kv->Describe(), " cannot rename folders"));
  }
  TS_ASSIGN_OR_RETURN(std::vector<std::string> existing, kv->List(dir + "/"));
  // An empty folder left at `dir` would block the rename; it holds nothing to keep.
  if (existing.empty()) TS_RETURN_IF_ERROR(kv->DeletePrefix(dir + "/"));
  const bool moved_aside = !existing.empty();
  if (moved_aside) {
    // Where the store can, swap the two folders in one step: readers then never find `dir`
    // missing, and the old folder ends up at `work_dir`, to be removed.
    Status exchanged = kv->ExchangeDirectories(work_dir, dir);
    if (exchanged.ok()) {
      if (sync) {
        if (Status synced = kv->SyncDirectory(ParentOf(dir)); !synced.ok()) {
          (void)kv->ExchangeDirectories(work_dir, dir);  // undo: the new one back at work_dir
          return synced;
        }
      }
      (void)kv->DeletePrefix(work_dir + "/");
      return OkStatus();
    }
    if (!absl::IsUnimplemented(exchanged)) return exchanged;
  }
  if (moved_aside) {
    TS_RETURN_IF_ERROR(
        Annotate(kv->RenameDirectory(dir, aside_dir), StrCat("moving the old '", dir, "' aside")));
  }
  const auto put_back = [&] {
    if (moved_aside) (void)kv->RenameDirectory(aside_dir, dir);
  };
  if (Status moved = kv->RenameDirectory(work_dir, dir); !moved.ok()) {
    put_back();
    return moved;
  }
  if (sync) {
    if (Status synced = kv->SyncDirectory(ParentOf(dir)); !synced.ok()) {
      // The renames may not be durable, and the save is about to fail: undo them, so that a
      // failed save leaves nothing new visible.
      (void)kv->RenameDirectory(dir, work_dir);
      put_back();
      return synced;
    }
  }
  if (moved_aside) (void)kv->DeletePrefix(aside_dir + "/");
  return OkStatus();
}

Result<std::map<std::string, ObjectInfo>> CheckWrittenFiles(
    KvStore* kv, const std::string& work_dir, const std::map<std::string, uint64_t>& written) {
  const std::string prefix = work_dir + "/";
  TS_ASSIGN_OR_RETURN(std::vector<ListedObject> listed, kv->ListWithInfo(prefix));
  std::map<std::string, ObjectInfo> there;
  for (ListedObject& object : listed) {
    there.emplace(object.key.substr(prefix.size()), std::move(object.info));
  }
  std::map<std::string, ObjectInfo> out;
  for (const auto& [name, size] : written) {
    auto it = there.find(name);
    if (it == there.end() || it->second.size != size) {
      return DataLossError(StrCat(
          "file '", prefix, name, "' in ", kv->Describe(), " that this save wrote ",
          it == there.end() ? std::string("is gone")
                            : StrCat("has ", it->second.size, " bytes instead of ", size),
          " before the commit: something removed or replaced the save's files while it ran (e.g. "
          "`tensorstash gc` with a --min-age shorter than the save); nothing was committed"));
    }
    out.emplace(name, std::move(it->second));
  }
  return out;
}

}  // namespace tensorstash
