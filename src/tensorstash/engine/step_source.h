// StepSource: one checkpoint step (or item) as the engine reads it, whatever its format, and
// the types of a read: what to read (ReadRequest), how (ReaderOptions, MapOptions), what it
// cost (ReadStats), what verification found (BadChunk) and mapped boxes (MappedBox).
//
// The engine's restore (host_restore.h) and every front read through this interface. The
// native CheckpointReader and the OrbaxReader (checkpoint/) implement it, and so does the RAM
// tier's TieredStepSource (tiers/); checkpoint/open_step.h opens a folder as one. Every source
// offers the same things: the pytree (format/tree.h schema) and its arrays' metadata, box reads
// with dtype casts and zeros past the stored shape, and a full verification.
//
// Thread-safety: after Open, const methods and ReadMany may be called from several threads.
#ifndef TENSORSTASH_ENGINE_STEP_SOURCE_H_
#define TENSORSTASH_ENGINE_STEP_SOURCE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/array/dtype.h"
#include "tensorstash/engine/executor.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

class CheckpointReader;  // checkpoint/checkpoint_reader.h

struct ReaderOptions {
  bool verify_checksums = true;
  // Cap on bytes held in staging buffers (chunks that cannot be read in place).
  uint64_t max_inflight_bytes = kDefaultMaxInflightBytes;
  // Reader threads; 0 picks a default from the number of cores.
  int io_threads = 0;
  // Neighbouring chunks separated by at most this many unused bytes are read in one request.
  uint64_t coalesce_gap_bytes = 64 << 10;
  // Upper bound of one coalesced request.
  uint64_t max_request_bytes = uint64_t{32} << 20;
  // Open even when data files are missing or truncated; reads of their chunks then fail. For
  // `verify`, which reports every damaged chunk instead of stopping at the first file.
  bool open_damaged = false;
  // Open a holding (WriterOptions::holding): an index with fewer chunks than the arrays have.
  // Reads of the chunks it lacks are DataLoss ("not in the index"). TieredStepSource sets it.
  bool open_holding = false;
  // Chunks that must be cut into pieces (another layout, a cast) are read from a mapping of the
  // data file rather than from a staging copy when every chunk of the read is uncompressed and
  // page-aligned: each byte is then copied once, from the page cache into its destination.
  // False: always staged.
  bool map_spans = true;
};

struct ReadRequest {
  std::string path;  // array path
  Box box;           // region of the array to read (may reach past its shape: zeros there)
  DType dtype;       // element type of `dest` (a cast when it differs from the stored dtype)
  void* dest;        // box.num_elements() elements of `dtype`, C order
};

// Checks one read request against the array it names, for every reader (native, Orbax): the
// box's rank and size, and with `cast_to` the cast from the stored dtype and a destination for a
// non-empty box. OK, or InvalidArgument naming the array. (MapMany passes no cast: it maps
// stored bytes and has no destination.)
Status ValidateReadRequest(const ReadRequest& request, const ArrayMetadata& array,
                           std::optional<DType> cast_to);

struct ReadStats {
  uint64_t bytes_read = 0;     // stored bytes fetched from storage
  uint64_t requests = 0;       // storage read calls
  uint64_t direct_chunks = 0;  // chunks read straight into the destination
  uint64_t staged_chunks = 0;  // chunks read through a staging buffer or a mapped span
  uint64_t mapped_spans = 0;   // of the staged spans, those mapped (ReaderOptions::map_spans)
  uint64_t peak_staging_bytes = 0;
};

struct BadChunk {
  std::string array_path;
  std::string chunk;  // grid coordinates, "[0, 3]"
  std::string file;   // data file key
  std::string error;
};

// A box of an array mapped from the data files (CheckpointReader::MapMany): its elements in C
// order, in the stored dtype, at data() (64-byte aligned). Either it owns its mapping, or it is a
// view into a mapping shared with neighbouring boxes, which stays mapped while any of them
// lives. Unmapped when the last owner is destroyed. Move-only.
class MappedBox {
 public:
  MappedBox() = default;
  // Owns the `mapped_size` bytes mapped at `data`.
  MappedBox(char* data, size_t size, size_t mapped_size)
      : data_(data), size_(size), mapped_size_(mapped_size) {}
  // `size` bytes at `data`, inside `region`, which it keeps mapped.
  MappedBox(std::shared_ptr<const MappedBox> region, char* data, size_t size)
      : data_(data), size_(size), region_(std::move(region)) {}
  MappedBox(MappedBox&& other) noexcept;
  MappedBox& operator=(MappedBox&& other) noexcept;
  MappedBox(const MappedBox&) = delete;
  MappedBox& operator=(const MappedBox&) = delete;
  ~MappedBox();

  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_size_ = 0;                   // of an owned mapping; 0 for a view
  std::shared_ptr<const MappedBox> region_;  // of a view
};

// How CheckpointReader::MapMany may map.
struct MapOptions {
  // Kernel mapping entries the call may add (vm.max_map_count bounds them per process): a
  // shared mapping costs one, a box mapped chunk by chunk one per chunk and one more. Boxes past
  // the budget are Unimplemented (read them). With mappings_made set, the budget of all the
  // calls that share it: a call adds at most max_mappings - *mappings_made.
  uint64_t max_mappings = UINT64_MAX;
  // Boxes stored as runs of one data file share a mapping of up to this many bytes with the
  // boxes stored near them (a larger run gets one of its own).
  uint64_t shared_mapping_bytes = uint64_t{64} << 20;
  // Where set, the entries made by earlier calls; MapMany adds those it made, so that a caller
  // mapping in several calls (or through several readers) keeps one budget.
  uint64_t* mappings_made = nullptr;
};

enum class StepFormat {
  kNative,        // a tensorstash step (COMMIT, state/tree.json, index)
  kOrbaxOcdbt,    // Orbax PyTree item, arrays as zarr v2/v3 keys inside an OCDBT database
  kOrbaxFolders,  // Orbax PyTree item, one zarr folder per parameter (use_ocdbt=False)
  kZarrGroup,     // a zarr group of arrays named by pytree key path, `write_completed` attribute
  kSafetensors,   // a .safetensors file, or a Hugging Face folder of them (safetensors_reader.h)
  kDcp,           // a PyTorch DCP FileSystemWriter folder: .metadata, *.distcp (dcp_reader.h)
};

// "tensorstash", "orbax-ocdbt", "orbax-zarr-folders", "zarr-group", "safetensors", "dcp".
std::string_view StepFormatName(StepFormat format);

class StepSource {
 public:
  virtual ~StepSource() = default;

  virtual StepFormat format() const = 0;
  // The folder read (after detection), relative to the KvStore.
  virtual const std::string& dir() const = 0;
  virtual const TreeNode& tree() const = 0;
  // One entry per array leaf, in the order of the tree's array ids. For zarr arrays
  // grid.chunk_shape and grid.cell_shape are both the stored chunk (shard) shape.
  virtual const std::vector<ArrayMetadata>& arrays() const = 0;
  // Stored bytes and stored chunk count of array `id` (for zarr: listed on first use).
  virtual uint64_t StoredBytes(size_t id) const = 0;
  virtual int64_t NumChunks(size_t id) const = 0;
  // "none", "zstd" for native arrays; a short description of the zarr codec chain otherwise.
  virtual std::string CodecDescription(size_t id) const = 0;
  // Creation time (0 when the format does not record it) and writer process count (0 likewise).
  virtual int64_t created_unix_ms() const = 0;
  virtual int process_count() const = 0;

  // As CheckpointReader::ReadMany: the first error wins; on error destinations hold unspecified
  // data. Errors name the array path (and, for stored data, the chunk key).
  virtual Status ReadMany(const std::vector<ReadRequest>& requests, ReadStats* stats,
                          const std::function<void(uint64_t, uint64_t)>& progress) = 0;
  // As CheckpointReader::MapMany, where the source can map (native steps, and a tiered step's
  // local holdings); the default answers Unimplemented for every request (read them instead).
  virtual std::vector<Result<MappedBox>> MapMany(const std::vector<ReadRequest>& requests,
                                                 const MapOptions& options);
  // A whole file committed with a native step (checked against its COMMIT); for an Orbax
  // checkpoint, one of Orbax's own files of its folder as stored (`_sharding`,
  // `array_metadatas/process_0`: Orbax records no checksum of them). NotFound when there is no
  // such file; InvalidArgument for a name that leaves the folder.
  virtual Result<std::string> ReadFile(std::string_view name) const = 0;
  // Reads and decodes every stored chunk; returns the bad ones (empty when all are good).
  // Non-OK only when verification could not run. progress(done, total) in bytes.
  virtual Result<std::vector<BadChunk>> Verify(
      const std::function<void(uint64_t, uint64_t)>& progress) = 0;
  // Bytes and items (chunks, files) that Verify checks, for progress and summaries.
  virtual uint64_t VerifyTotalBytes() const = 0;
  virtual size_t VerifyTotalItems() const = 0;

  // The native reader behind a kNative source, else nullptr.
  virtual CheckpointReader* native() { return nullptr; }
};

}  // namespace tensorstash

#endif  // TENSORSTASH_ENGINE_STEP_SOURCE_H_
