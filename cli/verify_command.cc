// `tensorstash verify CKPT`: read every chunk, check every CRC, name each bad chunk. Foreign
// formats (Orbax, zarr groups) are detected; their chunks are read and decoded.
#include <chrono>
#include <iostream>
#include <mutex>

#include "commands.h"
#include "common.h"
#include "tensorstash/checkpoint/open_step.h"

namespace tensorstash::cli {
namespace {

int RunVerify(const std::string& path) {
  Result<StepLocation> location = OpenStepPath(path);
  if (!location.ok()) return Fail(location.status());
  ReaderOptions options;
  options.open_damaged = true;  // report chunks in missing or truncated files one by one
  Result<std::unique_ptr<StepSource>> reader =
      OpenStepSource(location->kv.get(), location->key, options);
  if (!reader.ok()) return Fail(reader.status());
  const uint64_t total = (*reader)->VerifyTotalBytes();
  const std::string format(StepFormatName((*reader)->format()));
  const auto start = std::chrono::steady_clock::now();
  Result<std::vector<BadChunk>> bad;
  {
    ProgressBar bar("verify", total);
    bad = (*reader)->Verify([&](uint64_t done, uint64_t) { bar.Update(done); });
  }
  if (!bad.ok()) return Fail(bad.status());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const BadChunk& chunk : *bad) {
    if (chunk.array_path.empty()) {  // a committed file (metadata, per-process state)
      std::printf("BAD  file %s: %s\n", chunk.file.c_str(), chunk.error.c_str());
      continue;
    }
    std::printf("BAD  %s chunk %s (%s): %s\n", chunk.array_path.c_str(), chunk.chunk.c_str(),
                chunk.file.c_str(), chunk.error.c_str());
  }
  const size_t items = (*reader)->VerifyTotalItems();
  if (!bad->empty()) {
    std::printf("FAILED: %zu of %zu chunks and files are bad in %s (format %s)\n", bad->size(),
                items, path.c_str(), format.c_str());
    return 1;
  }
  if ((*reader)->format() == StepFormat::kSafetensors) {
    // safetensors records no checksums: the headers were checked at open, the bytes read.
    std::printf("OK: %zu tensors (format safetensors), headers checked and %s read in %.2f s; "
                "safetensors has no checksums, so the values themselves cannot be verified\n",
                items, HumanBytes(total).c_str(), seconds);
    return 0;
  }
  if (CheckpointReader* native = (*reader)->native(); native == nullptr) {
    std::printf("OK: %zu chunks in %zu arrays (format %s), %s decoded in %.2f s\n", items,
                (*reader)->arrays().size(), format.c_str(), HumanBytes(total).c_str(), seconds);
    return 0;
  }
  const size_t chunks = (*reader)->native()->index().entries.size();
  const size_t files = (*reader)->native()->commit_record().files.size();
  std::printf(
      "OK: %zu chunks in %zu arrays, %zu files, %s verified in %.2f s (%s/s)\n", chunks,
      (*reader)->arrays().size(), files, HumanBytes(total).c_str(), seconds,
      HumanBytes(seconds > 0 ? static_cast<uint64_t>(static_cast<double>(total) / seconds) : total)
          .c_str());
  return 0;
}

}  // namespace

void AddVerifyCommand(CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand(
      "verify",
      "Read every chunk of a step (tensorstash, Orbax, zarr group or safetensors) and check its "
      "CRC-32C or decoding (safetensors: the headers' structure; it has no checksums); exit 1 "
      "if any is bad");
  auto path = std::make_shared<std::string>();
  cmd->add_option("CKPT", *path, "A step folder (e.g. ckpts/0000001000)")->required();
  cmd->callback([path, exit_code] { *exit_code = RunVerify(*path); });
}

}  // namespace tensorstash::cli
