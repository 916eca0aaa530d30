#include "tensorstash/checkpoint/materialize.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <utility>

#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/util/str_util.h"

namespace tensorstash {

Status MaterializeStep(KvStore* src, const std::string& src_dir, KvStore* dst,
                       const std::string& dst_dir, WriterOptions options,
                       const std::function<Status(uint64_t done, uint64_t total)>& progress) {
  if (!options.base.empty() || options.holding) {
    return InvalidArgumentError("a materialized step is self-contained: no base, no holding");
  }
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                      CheckpointReader::Open(src, src_dir));
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      CheckpointWriter::Create(dst, dst_dir, options));
  for (const auto& [name, file] : reader->commit_record().files) {
    TS_ASSIGN_OR_RETURN(std::string contents, reader->ReadFile(name));
    TS_RETURN_IF_ERROR(writer->AddFile(name, std::move(contents)));
  }
  CheckpointReader* from = reader.get();
  uint64_t total = 0;
  for (const ArrayMetadata& a : reader->arrays()) {
    total += static_cast<uint64_t>(Box::FromShape(a.shape()).num_elements()) * ItemSize(a.dtype);
  }
  std::mutex progress_mutex;  // chunks are read from the writer's threads
  uint64_t done = 0;
  for (const ArrayMetadata& a : reader->arrays()) {
    ArraySpec spec;
    spec.path = a.path;
    spec.dtype = a.dtype;
    spec.shape = a.shape();
    spec.codec = a.codec;
    spec.zstd_level = a.zstd_level > 0 ? a.zstd_level : ArraySpec{}.zstd_level;
    // The same grid: the chunk shape follows from the chunk size in bytes.
    int64_t chunk_elements = 1;
    for (int64_t c : a.grid.chunk_shape) chunk_elements *= std::max<int64_t>(c, 1);
    spec.target_chunk_bytes = chunk_elements * static_cast<int64_t>(ItemSize(a.dtype));
    const std::string path = a.path;
    const DType dtype = a.dtype;
    ChunkSource read = [&, from, path, dtype](const Box& box, void* dest) -> Status {
      TS_RETURN_IF_ERROR(from->Read({path, box, dtype, dest}));
      if (progress) {
        std::lock_guard<std::mutex> lock(progress_mutex);
        done += static_cast<uint64_t>(box.num_elements()) * ItemSize(dtype);
        TS_RETURN_IF_ERROR(progress(done, total));
      }
      return OkStatus();
    };
    TS_RETURN_IF_ERROR(writer->AddArrayFromSource(std::move(spec), std::move(read)));
  }
  writer->SetTree(reader->tree());
  return Annotate(writer->Commit(), StrCat("materializing step '", src_dir, "' as '", dst_dir,
                                           "'"));
}

}  // namespace tensorstash
