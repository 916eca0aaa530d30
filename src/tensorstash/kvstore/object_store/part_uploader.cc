#include "tensorstash/kvstore/object_store/part_uploader.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include "tensorstash/util/crc32c.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {

Result<std::string> PartSink::PutPartPieces(const std::string&, int, const PartBytes&) {
  return UnimplementedError(StrCat("writing ", Where(), ": the store does not take pieces"));
}

Status PartSink::PutWholePieces(const PartBytes&) {
  return UnimplementedError(StrCat("writing ", Where(), ": the store does not take pieces"));
}

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

// Zeros for the gaps of a part sent as pieces (bytes never written), sent from here.
constexpr size_t kZeroBlockBytes = size_t{64} << 10;
const char* ZeroBlock() {
  static const char* const zeros = new char[kZeroBlockBytes]();
  return zeros;
}

class PartUploader final : public WritableFile {
 public:
  PartUploader(std::unique_ptr<PartSink> sink, PartUploaderOptions options)
      : sink_(std::move(sink)),
        part_size_(std::max<size_t>(1, options.part_size)),
        max_parts_(options.max_parts),
        buffers_(options.buffers != nullptr && options.buffers->buffer_bytes() == part_size_
                     ? std::move(options.buffers)
                     : nullptr),
        pieces_(sink_->TakesPieces()) {
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
    return Write(offset, static_cast<const char*>(data), size, std::nullopt, false);
  }

  Status WriteChunkAt(uint64_t offset, const void* data, size_t size, uint32_t crc32c,
                      bool borrowed) override {
    return Write(offset, static_cast<const char*>(data), size, crc32c, borrowed);
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
  // Bytes of a part, for a sink that takes pieces: in the writer's memory (borrowed) or in the
  // part's buffer.
  struct Piece {
    const char* data = nullptr;
    size_t size = 0;
    uint32_t crc = 0;
  };
  struct Part {
    std::unique_ptr<char[]> bytes;  // copied bytes (zeros elsewhere); null until needed
    // Pieces mode: the written pieces by their offset in the part. Empty once `flat`.
    std::map<size_t, Piece> pieces;
    // Pieces mode: a write overlapped an earlier one; every byte is in `bytes` now, and the
    // CRC is computed over it at upload.
    bool flat = false;
    size_t filled = 0;
    int writers = 0;  // copies into it in progress
  };

  // Writes `size` bytes at `offset`, whose CRC-32C is `crc` when known; `borrowed`: valid
  // until Close (WriteChunkAt).
  Status Write(uint64_t offset, const char* bytes, size_t size, std::optional<uint32_t> crc,
               bool borrowed) {
    const bool whole_write_crc = crc.has_value();
    const size_t total = size;
    while (size > 0) {
      const uint64_t index = offset / part_size_;
      const size_t within = offset % part_size_;
      const size_t length = std::min(size, part_size_ - within);
      if (index >= static_cast<uint64_t>(max_parts_)) {
        return InvalidArgumentError(StrCat("writing ", sink_->Where(), ": offset ", offset,
                                           " is past the largest object of ", max_parts_,
                                           " parts of ", part_size_, " bytes"));
      }
      // The piece's CRC: the caller's when the write is one piece, else computed here (only
      // for a sink that takes pieces; the others checksum what they send themselves).
      uint32_t piece_crc = 0;
      if (pieces_) {
        piece_crc = whole_write_crc && length == total ? *crc : Crc32c(bytes, length);
      }
      char* buffer = nullptr;  // where to copy the bytes, if anywhere
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
        if (pieces_ && !part.flat && Overlaps(part, within, length)) Flatten(&part);
        const bool copy = !pieces_ || !borrowed || part.flat;
        if (copy) {
          if (part.bytes == nullptr) part.bytes = NewBuffer();
          buffer = part.bytes.get() + within;
        }
        if (pieces_ && !part.flat) {
          part.pieces[within] = Piece{copy ? buffer : bytes, length, piece_crc};
        }
        ++part.writers;
        end_ = std::max<uint64_t>(end_, offset + length);
      }
      if (buffer != nullptr) std::memcpy(buffer, bytes, length);
      std::optional<Part> full;
      {
        std::lock_guard<std::mutex> lock(mu_);
        Part& part = pending_[index];
        part.filled += length;
        --part.writers;
        if (part.filled >= part_size_ && part.writers == 0) {
          full = std::move(part);
          pending_.erase(index);
          uploaded_[index] = "";  // claimed
        }
      }
      if (full.has_value()) {
        Status status = UploadPart(index, &*full, part_size_);
        GiveBack(std::move(full->bytes));
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

  // Whether [within, within + length) meets a piece of `part` already written.
  static bool Overlaps(const Part& part, size_t within, size_t length) {
    auto next = part.pieces.lower_bound(within);
    if (next != part.pieces.end() && next->first < within + length) return true;
    if (next == part.pieces.begin()) return false;
    auto before = std::prev(next);
    return before->first + before->second.size > within;
  }

  // Copies the borrowed pieces of `part` into its buffer, which then holds every byte (a
  // rewrite of bytes already written: the later bytes win, as in a file). Called under mu_.
  void Flatten(Part* part) {
    if (part->bytes == nullptr) part->bytes = NewBuffer();
    for (const auto& [within, piece] : part->pieces) {
      char* to = part->bytes.get() + within;
      if (piece.data != to) std::memcpy(to, piece.data, piece.size);
    }
    part->pieces.clear();
    part->flat = true;
  }

  // The first `length` bytes of `part` as pieces, gaps as zeros, with their CRC-32C.
  static PartBytes Gather(const Part& part, size_t length) {
    PartBytes out;
    out.size = length;
    if (part.flat) {
      out.pieces.emplace_back(part.bytes.get(), length);
      out.crc32c = Crc32c(part.bytes.get(), length);
      return out;
    }
    size_t at = 0;
    const auto zeros_to = [&](size_t end) {
      uint32_t gap_crc = 0;
      const size_t gap = end - at;
      while (at < end) {
        const size_t n = std::min(end - at, kZeroBlockBytes);
        out.pieces.emplace_back(ZeroBlock(), n);
        gap_crc = Crc32c(ZeroBlock(), n, gap_crc);
        at += n;
      }
      out.crc32c = Crc32cCombine(out.crc32c, gap_crc, gap);
    };
    for (const auto& [within, piece] : part.pieces) {
      if (within >= length) break;
      if (within > at) zeros_to(within);
      const size_t n = std::min(piece.size, length - within);
      out.pieces.emplace_back(piece.data, n);
      // A piece cut by the object's end was written past it: impossible, since the end is
      // the furthest byte written; checksum what is sent all the same.
      out.crc32c = Crc32cCombine(out.crc32c, n == piece.size ? piece.crc : Crc32c(piece.data, n),
                                 n);
      at = within + n;
    }
    if (at < length) zeros_to(length);
    return out;
  }

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

  // Sends the first `length` bytes of `part` (null: never written, zeros) as part index + 1.
  Status UploadPart(uint64_t index, const Part* part, size_t length) {
    TS_ASSIGN_OR_RETURN(std::string upload_id, UploadId());
    const int number = static_cast<int>(index + 1);
    std::string token;
    if (pieces_) {
      static const Part kNeverWritten;
      TS_ASSIGN_OR_RETURN(token, sink_->PutPartPieces(
                                     upload_id, number,
                                     Gather(part != nullptr ? *part : kNeverWritten, length)));
    } else {
      std::unique_ptr<char[]> zeros;
      const char* bytes = part != nullptr ? part->bytes.get() : nullptr;
      if (bytes == nullptr) {  // never written: zeros, as a file's gap reads
        zeros = std::make_unique<char[]>(length);
        bytes = zeros.get();
      }
      TS_ASSIGN_OR_RETURN(token, sink_->PutPart(upload_id, number, std::string_view(bytes, length)));
    }
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
      Status status;
      if (pieces_) {
        static const Part kNeverWritten;
        status = sink_->PutWholePieces(Gather(it == rest.end() ? kNeverWritten : it->second, end));
      } else {
        status = sink_->PutWhole(it == rest.end() || it->second.bytes == nullptr
                                     ? std::string_view()
                                     : std::string_view(it->second.bytes.get(), end));
      }
      for (auto& [index, part] : rest) GiveBack(std::move(part.bytes));
      return status;
    }
    const uint64_t parts = (end + part_size_ - 1) / part_size_;
    for (uint64_t index = 0; index < parts; ++index) {
      if (IsUploaded(index)) continue;
      const size_t length = index + 1 == parts ? end - index * part_size_ : part_size_;
      auto it = rest.find(index);
      TS_RETURN_IF_ERROR(UploadPart(index, it != rest.end() ? &it->second : nullptr, length));
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
  const bool pieces_;                              // sink_->TakesPieces()
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
