#include "tensorstash/kvstore/object_store/part_uploader.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "tensorstash/util/str_util.h"

namespace tensorstash {

PartBufferPool::PartBufferPool(size_t buffer_bytes, int max_kept)
    : buffer_bytes_(buffer_bytes), max_kept_(max_kept) {}

PartBufferPool::~PartBufferPool() = default;

std::unique_ptr<char[]> PartBufferPool::Take() {
  std::unique_ptr<char[]> buffer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!kept_.empty()) {
      buffer = std::move(kept_.back());
      kept_.pop_back();
    }
  }
  if (buffer == nullptr) return std::make_unique<char[]>(buffer_bytes_);
  // Zeros, as a new buffer: bytes of a part never written go up as zeros. Clearing memory
  // already mapped costs a fraction of faulting in new memory.
  std::memset(buffer.get(), 0, buffer_bytes_);
  return buffer;
}

void PartBufferPool::Give(std::unique_ptr<char[]> buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (buffer != nullptr && open_ > 0 && static_cast<int>(kept_.size()) < max_kept_) {
    kept_.push_back(std::move(buffer));
  }
  // else: freed here (under the lock: a free of memory the pool no longer counts is harmless)
}

int PartBufferPool::kept() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(kept_.size());
}

void PartBufferPool::Opened() {
  std::lock_guard<std::mutex> lock(mu_);
  ++open_;
}

void PartBufferPool::Closed() {
  std::vector<std::unique_ptr<char[]>> freed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--open_ == 0) freed.swap(kept_);
  }
}

namespace {

class PartUploader final : public WritableFile {
 public:
  PartUploader(std::unique_ptr<PartSink> sink, PartUploaderOptions options)
      : sink_(std::move(sink)),
        part_size_(std::max<size_t>(1, options.part_size)),
        max_parts_(options.max_parts),
        buffers_(options.buffers != nullptr && options.buffers->buffer_bytes() == part_size_
                     ? std::move(options.buffers)
                     : nullptr) {
    if (buffers_ != nullptr) buffers_->Opened();
  }
  ~PartUploader() override {
    (void)Close();
    if (buffers_ != nullptr) {
      std::map<uint64_t, Part> left;
      {
        std::lock_guard<std::mutex> lock(mu_);
        left.swap(pending_);
      }
      for (auto& [index, part] : left) GiveBack(std::move(part.bytes));
      buffers_->Closed();
    }
  }

  Status WriteAt(uint64_t offset, const void* data, size_t size) override {
    const char* bytes = static_cast<const char*>(data);
    while (size > 0) {
      const uint64_t index = offset / part_size_;
      const size_t within = offset % part_size_;
      const size_t length = std::min(size, part_size_ - within);
      if (index >= static_cast<uint64_t>(max_parts_)) {
        return InvalidArgumentError(StrCat("writing ", sink_->Where(), ": offset ", offset,
                                           " is past the largest object of ", max_parts_,
                                           " parts of ", part_size_, " bytes"));
      }
      char* buffer = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (finished_) {
          return FailedPreconditionError(
              StrCat("writing ", sink_->Where(), ": the file was already synced or closed"));
        }
        if (!failed_.ok()) return failed_;
        if (uploaded_.count(index) > 0) {
          return FailedPreconditionError(
              StrCat("writing ", sink_->Where(), " at offset ", offset, ": part ", index + 1,
                     " was already uploaded (an object store cannot rewrite it)"));
        }
        Part& part = pending_[index];
        if (part.bytes == nullptr) part.bytes = NewBuffer();
        buffer = part.bytes.get();
        ++part.writers;
        end_ = std::max<uint64_t>(end_, offset + length);
      }
      std::memcpy(buffer + within, bytes, length);
      std::unique_ptr<char[]> full;
      {
        std::lock_guard<std::mutex> lock(mu_);
        Part& part = pending_[index];
        part.filled += length;
        --part.writers;
        if (part.filled >= part_size_ && part.writers == 0) {
          full = std::move(part.bytes);
          pending_.erase(index);
          uploaded_[index] = "";  // claimed
        }
      }
      if (full != nullptr) {
        Status status = UploadPart(index, std::string_view(full.get(), part_size_));
        GiveBack(std::move(full));
        if (!status.ok()) {
          std::lock_guard<std::mutex> lock(mu_);
          if (failed_.ok()) failed_ = status;
          return status;
        }
      }
      offset += length;
      bytes += length;
      size -= length;
    }
    return OkStatus();
  }

  Status Sync() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return FailedPreconditionError(StrCat(sink_->Where(), " is closed"));
    }
    return Finish();
  }

  Status Close() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return FailedPreconditionError(StrCat(sink_->Where(), " is closed"));
      closed_ = true;
    }
    return Finish();
  }

 private:
  struct Part {
    std::unique_ptr<char[]> bytes;
    size_t filled = 0;
    int writers = 0;  // copies into it in progress
  };

  std::unique_ptr<char[]> NewBuffer() {  // zeros
    return buffers_ != nullptr ? buffers_->Take() : std::make_unique<char[]>(part_size_);
  }

  void GiveBack(std::unique_ptr<char[]> buffer) {
    if (buffers_ != nullptr && buffer != nullptr) buffers_->Give(std::move(buffer));
  }

  Result<std::string> UploadId() {
    std::lock_guard<std::mutex> lock(upload_mu_);
    if (!upload_id_.empty()) return upload_id_;
    TS_ASSIGN_OR_RETURN(upload_id_, sink_->BeginUpload());
    return upload_id_;
  }

  Status UploadPart(uint64_t index, std::string_view bytes) {
    TS_ASSIGN_OR_RETURN(std::string upload_id, UploadId());
    TS_ASSIGN_OR_RETURN(std::string token,
                        sink_->PutPart(upload_id, static_cast<int>(index + 1), bytes));
    std::lock_guard<std::mutex> lock(mu_);
    uploaded_[index] = std::move(token);
    return OkStatus();
  }

  Status Finish() {
    // One finish at a time: a second Sync or Close waits for the first's outcome.
    std::lock_guard<std::mutex> finishing(finish_mu_);
    std::map<uint64_t, Part> rest;
    uint64_t end = 0;
    Status failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return finish_status_;
      finished_ = true;
      failed = failed_;
      rest = std::move(pending_);
      end = end_;
    }
    finish_status_ = failed.ok() ? Complete(std::move(rest), end) : failed;
    if (!finish_status_.ok()) AbortUpload();
    return finish_status_;
  }

  // A failed upload's parts are dropped (best effort; gc finds what is left of a crash).
  void AbortUpload() {
    std::string upload_id;
    {
      std::lock_guard<std::mutex> lock(upload_mu_);
      upload_id = upload_id_;
    }
    if (!upload_id.empty()) (void)sink_->Abort(upload_id);
  }

  bool IsUploaded(uint64_t index) {
    std::lock_guard<std::mutex> lock(mu_);
    return uploaded_.count(index) > 0;
  }

  Status Complete(std::map<uint64_t, Part> rest, uint64_t end) {
    bool none_uploaded = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      none_uploaded = uploaded_.empty();
    }
    if (none_uploaded && end <= part_size_) {  // one request
      auto it = rest.find(0);
      const std::string_view bytes =
          it == rest.end() ? std::string_view() : std::string_view(it->second.bytes.get(), end);
      Status status = sink_->PutWhole(bytes);
      for (auto& [index, part] : rest) GiveBack(std::move(part.bytes));
      return status;
    }
    const uint64_t parts = (end + part_size_ - 1) / part_size_;
    std::unique_ptr<char[]> zeros;
    for (uint64_t index = 0; index < parts; ++index) {
      if (IsUploaded(index)) continue;
      const size_t length = index + 1 == parts ? end - index * part_size_ : part_size_;
      auto it = rest.find(index);
      const char* bytes = nullptr;
      if (it != rest.end()) {
        bytes = it->second.bytes.get();
      } else {  // never written: zeros, as a file's gap reads
        if (zeros == nullptr) zeros = std::make_unique<char[]>(part_size_);
        bytes = zeros.get();
      }
      TS_RETURN_IF_ERROR(UploadPart(index, std::string_view(bytes, length)));
      if (it != rest.end()) GiveBack(std::move(it->second.bytes));
    }
    std::vector<UploadedPart> completed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [index, token] : uploaded_) {
        completed.push_back({static_cast<int>(index + 1), token});
      }
    }
    std::string upload_id;
    {
      std::lock_guard<std::mutex> lock(upload_mu_);
      upload_id = upload_id_;
    }
    return sink_->Complete(upload_id, completed, end);
  }

  const std::unique_ptr<PartSink> sink_;
  const size_t part_size_;
  const int max_parts_;
  const std::shared_ptr<PartBufferPool> buffers_;  // null: fresh memory for each part
  std::mutex mu_;
  std::map<uint64_t, Part> pending_;          // parts being written; guarded by mu_
  std::map<uint64_t, std::string> uploaded_;  // part index -> token ("" while uploading); mu_
  uint64_t end_ = 0;                          // guarded by mu_
  bool finished_ = false;                     // guarded by mu_
  bool closed_ = false;                       // guarded by mu_
  Status failed_;                             // guarded by mu_
  std::mutex finish_mu_;
  Status finish_status_;  // guarded by finish_mu_
  std::mutex upload_mu_;
  std::string upload_id_;  // guarded by upload_mu_
};

}  // namespace

std::unique_ptr<WritableFile> NewPartUploader(std::unique_ptr<PartSink> sink,
                                              PartUploaderOptions options) {
  return std::make_unique<PartUploader>(std::move(sink), options);
}

}  // namespace tensorstash
