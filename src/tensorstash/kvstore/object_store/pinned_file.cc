#include "tensorstash/kvstore/object_store/pinned_file.h"

#include <utility>

#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

class PinnedFile final : public ReadableFile {
 public:
  PinnedFile(ObjectInfo info, std::string where, PinnedRead read)
      : info_(std::move(info)), where_(std::move(where)), read_(std::move(read)) {}
  uint64_t size() const override { return info_.size; }
  Status ReadAt(uint64_t offset, size_t size, void* dest) const override {
    if (offset > info_.size || size > info_.size - offset) {
      return DataLossError(StrCat(where_, " is truncated: it ends at ", info_.size, ", before ",
                                  offset + size));
    }
    if (size == 0) return OkStatus();
    return read_(offset, size, dest, info_.generation);
  }

 private:
  const ObjectInfo info_;
  const std::string where_;
  const PinnedRead read_;
};

}  // namespace

std::unique_ptr<ReadableFile> NewPinnedFile(ObjectInfo info, std::string where, PinnedRead read) {
  return std::make_unique<PinnedFile>(std::move(info), std::move(where), std::move(read));
}

}  // namespace tensorstash
