#include "tensorstash/engine/step_source.h"

#include <sys/mman.h>

#include <utility>

#include "tensorstash/array/convert.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {

Status ValidateReadRequest(const ReadRequest& req, const ArrayMetadata& a,
                           std::optional<DType> cast_to) {
  // The text naming the array is made for errors only: a restore checks thousands of requests.
  auto what = [&] { return StrCat("read of array '", a.path, "'"); };
  if (req.box.rank() != a.grid.rank()) {
    return InvalidArgumentError(StrCat(what(), ": box ", req.box.ToString(), " has rank ",
                                       req.box.rank(), " but the array has rank ", a.grid.rank()));
  }
  const size_t item = ItemSize(cast_to.value_or(a.dtype));
  if (!ValidateBox(req.box, item, "").ok()) return ValidateBox(req.box, item, what());
  if (!cast_to) return OkStatus();
  if (!CanConvert(a.dtype, *cast_to)) {
    return InvalidArgumentError(StrCat(what(), ": cannot convert stored ", DTypeName(a.dtype),
                                       " to ", DTypeName(*cast_to)));
  }
  if (!req.box.empty() && req.dest == nullptr) {
    return InvalidArgumentError(StrCat(what(), ": no destination"));
  }
  return OkStatus();
}

MappedBox::MappedBox(MappedBox&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_size_(std::exchange(other.mapped_size_, 0)),
      region_(std::move(other.region_)) {}

MappedBox& MappedBox::operator=(MappedBox&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr && region_ == nullptr) ::munmap(data_, mapped_size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_size_ = std::exchange(other.mapped_size_, 0);
    region_ = std::move(other.region_);
  }
  return *this;
}

MappedBox::~MappedBox() {
  if (data_ != nullptr && region_ == nullptr) ::munmap(data_, mapped_size_);
}

std::string_view StepFormatName(StepFormat format) {
  switch (format) {
    case StepFormat::kNative:
      return "tensorstash";
    case StepFormat::kOrbaxOcdbt:
      return "orbax-ocdbt";
    case StepFormat::kOrbaxFolders:
      return "orbax-zarr-folders";
    case StepFormat::kZarrGroup:
      return "zarr-group";
    case StepFormat::kSafetensors:
      return "safetensors";
    case StepFormat::kDcp:
      return "dcp";
  }
  return "unknown";
}

std::vector<Result<MappedBox>> StepSource::MapMany(const std::vector<ReadRequest>& requests,
                                                   const MapOptions& /*options*/) {
  std::vector<Result<MappedBox>> out;
  out.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    out.emplace_back(
        UnimplementedError(StrCat(StepFormatName(format()), " steps are read, not mapped")));
  }
  return out;
}

}  // namespace tensorstash
