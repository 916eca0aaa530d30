#include "tensorstash/engine/data_file_set.h"

#include <algorithm>

#include "tensorstash/util/crc32c.h"

namespace tensorstash {

struct DataFileSet::File {
  std::string name;  // relative to the item folder
  std::unique_ptr<WritableFile> handle;
  uint64_t size = 0;
  uint64_t unqueued = 0;  // bytes written since its writeback was last started
  uint64_t written = 0;   // bytes written so far, padding included (one_request_below only)
  bool rolled = false;    // no more allocations go into it
  bool closed = false;    // closed early (one_request_below); `closed_status` is the outcome
  Status closed_status;
};

DataFileSet::DataFileSet(KvStore* kv, std::string item_dir, int process_index,
                         uint64_t target_file_bytes, int lanes, uint64_t writeback_bytes,
                         bool direct_writes, uint64_t one_request_below)
    : kv_(kv),
      item_dir_(std::move(item_dir)),
      process_index_(process_index),
      target_file_bytes_(target_file_bytes == 0 ? 1 : target_file_bytes),
      writeback_bytes_(writeback_bytes),
      direct_writes_(direct_writes),
      one_request_below_(one_request_below),
      lane_file_(std::max(1, lanes), -1) {}

DataFileSet::~DataFileSet() {
  for (auto& file : files_) {
    if (file->handle) (void)file->handle->Close();
  }
}

// Where a chunk of `length` bytes would start in a file now `size` bytes long.
static uint64_t AlignedOffset(uint64_t size, uint64_t length, bool continues) {
  if (continues && size % kSmallChunkAlignment == 0) return size;
  const uint64_t align = length >= kAlignChunksFrom ? kChunkAlignment : kSmallChunkAlignment;
  return (size + align - 1) / align * align;
}

Result<DataFileSet::Location> DataFileSet::Allocate(uint64_t length, int lane, bool continues) {
  File* to_close = nullptr;
  std::unique_ptr<WritableFile> handle_to_close;
  Result<Location> location = [&]() -> Result<Location> {
    std::lock_guard<std::mutex> lock(mutex_);
    int& current = lane_file_[static_cast<size_t>(lane) % lane_file_.size()];
    bool roll = current < 0 || files_[current]->size >= target_file_bytes_;
    if (!roll && one_request_below_ > 0) {  // the file must stay below one request's size
      const File& file = *files_[current];
      roll = file.size > 0 && AlignedOffset(file.size, length, continues) + length >=
                                  one_request_below_;
    }
    if (roll) {
      if (files_.size() >= kMaxDataFiles) {
        return ResourceExhaustedError(
            StrCat("more than ", kMaxDataFiles, " data files; raise target_data_file_bytes"));
      }
      if (current >= 0 && one_request_below_ > 0) {
        File& old = *files_[current];
        old.rolled = true;
        if (old.written == old.size && !old.closed) {  // every byte already written: close now
          old.closed = true;
          to_close = &old;
          handle_to_close = std::move(old.handle);
        }
      }
      auto file = std::make_unique<File>();
      file->name = StrCat("data/", process_index_, "-", files_.size(), ".dat");
      TS_ASSIGN_OR_RETURN(file->handle, kv_->OpenForWrite(StrCat(item_dir_, "/", file->name)));
      if (direct_writes_) file->handle->PreferDirectWrites();
      files_.push_back(std::move(file));
      current = static_cast<int>(files_.size() - 1);
    }
    File& file = *files_[current];
    const uint64_t offset = AlignedOffset(file.size, length, continues);
    const uint32_t padding =
        kv_->Capabilities().object_store ? static_cast<uint32_t>(offset - file.size) : 0;
    file.size = offset + length;
    return Location{static_cast<uint32_t>(current), offset, padding};
  }();
  if (to_close != nullptr) TS_RETURN_IF_ERROR(CloseEarly(to_close, std::move(handle_to_close)));
  return location;
}

Status DataFileSet::CloseEarly(File* file, std::unique_ptr<WritableFile> handle) {
  Status status = handle->Close();
  std::lock_guard<std::mutex> lock(mutex_);
  file->closed_status = status;
  return status;
}

Status DataFileSet::Write(const Location& where, const void* data, size_t size,
                          std::optional<uint32_t> crc32c, bool borrowed) {
  WritableFile* handle;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    handle = files_.at(where.file_id)->handle.get();
  }
  if (handle == nullptr) return FailedPreconditionError("data file already closed");
  if (where.padding > 0) {
    static const char kZeros[kChunkAlignment] = {};
    if (crc32c.has_value()) {  // static zeros outlive every file: borrowed
      TS_RETURN_IF_ERROR(handle->WriteChunkAt(where.offset - where.padding, kZeros, where.padding,
                                              Crc32c(kZeros, size_t{where.padding}),
                                              /*borrowed=*/true));
    } else {
      TS_RETURN_IF_ERROR(handle->WriteAt(where.offset - where.padding, kZeros, where.padding));
    }
  }
  if (crc32c.has_value()) {
    TS_RETURN_IF_ERROR(handle->WriteChunkAt(where.offset, data, size, *crc32c, borrowed));
  } else {
    TS_RETURN_IF_ERROR(handle->WriteAt(where.offset, data, size));
  }
  if (one_request_below_ > 0) {
    File* to_close = nullptr;
    std::unique_ptr<WritableFile> owned;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      File& file = *files_[where.file_id];
      file.written += where.padding + size;
      if (file.rolled && file.written == file.size && !file.closed) {
        file.closed = true;
        to_close = &file;
        owned = std::move(file.handle);
      }
    }
    if (to_close != nullptr) return CloseEarly(to_close, std::move(owned));
  }
  if (writeback_bytes_ == 0) return OkStatus();
  bool start = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    File& file = *files_[where.file_id];
    file.unqueued += size;
    if (file.unqueued >= writeback_bytes_) {
      file.unqueued = 0;
      start = true;
    }
  }
  return start ? handle->StartWriteback() : OkStatus();
}

Status DataFileSet::Finish(bool sync, std::vector<DataFileInfo>* files, ThreadPool* pool) {
  std::lock_guard<std::mutex> lock(mutex_);
  files->clear();
  if (finished_) return FailedPreconditionError("data files already finished");
  finished_ = true;
  // Files closed early (one_request_below) are complete already; their outcome counts here.
  for (auto& file : files_) {
    if (file->closed) TS_RETURN_IF_ERROR(file->closed_status);
  }
  if (sync) {
    // One fsync per file, side by side: each waits mostly on the storage.
    if (pool != nullptr && files_.size() > 1) {
      TaskGroup group(pool);
      for (auto& file : files_) {
        WritableFile* handle = file->handle.get();
        if (handle != nullptr) group.Run([handle] { return handle->Sync(); });
      }
      TS_RETURN_IF_ERROR(group.Wait());
    } else {
      for (auto& file : files_) {
        if (file->handle) TS_RETURN_IF_ERROR(file->handle->Sync());
      }
    }
  }
  for (auto& file : files_) {
    if (file->handle) {
      TS_RETURN_IF_ERROR(file->handle->Close());
      file->handle.reset();
    }
    files->push_back({file->name, file->size});
  }
  // The files' directory entries must be durable too.
  if (sync && !files_.empty()) TS_RETURN_IF_ERROR(kv_->SyncDirectory(StrCat(item_dir_, "/data")));
  return OkStatus();
}

}  // namespace tensorstash
