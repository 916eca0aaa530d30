// Micro-benchmarks of the engine's inner loops: CRC-32C and the chunk digest, strided box copies, dtype casts, and
// decoding the tree.json of a step of many small arrays (the fixed cost of opening a step).
// Run: build/tensorstash_micro_bench [--benchmark_filter=...]. For whole save/restore speeds
// use examples/sharded_save_restore.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/array/convert.h"
#include "tensorstash/format/tree.h"
#include "tensorstash/util/chunk_digest.h"
#include "tensorstash/util/crc32c.h"

namespace tensorstash {
namespace {

void BM_Crc32c(benchmark::State& state) {
  std::vector<char> data(state.range(0), 'x');
  for (auto _ : state) benchmark::DoNotOptimize(Crc32c(data.data(), data.size()));
  state.SetBytesProcessed(state.iterations() * data.size());
}
BENCHMARK(BM_Crc32c)->Arg(64 << 10)->Arg(8 << 20)->Arg(64 << 20);

// The chunk digest of incremental saves (util/chunk_digest.h): XXH3-128 alone, and fused with
// the CRC-32C in one pass (what a save computes for each chunk it may reference).
void BM_Xxh3Digest(benchmark::State& state) {
  std::vector<char> data(state.range(0), 'x');
  for (auto _ : state) benchmark::DoNotOptimize(Xxh3Digest(data.data(), data.size()));
  state.SetBytesProcessed(state.iterations() * data.size());
}
BENCHMARK(BM_Xxh3Digest)->Arg(64 << 10)->Arg(8 << 20)->Arg(64 << 20);

void BM_Crc32cAndDigest(benchmark::State& state) {
  std::vector<char> data(state.range(0), 'x');
  for (auto _ : state) benchmark::DoNotOptimize(Crc32cAndDigest(data.data(), data.size()));
  state.SetBytesProcessed(state.iterations() * data.size());
}
BENCHMARK(BM_Crc32cAndDigest)->Arg(64 << 10)->Arg(8 << 20)->Arg(64 << 20);

// Copies the middle half of the columns of a 2048 x 2048 float32 array: rows of 4 KiB.
void BM_CopyBoxRows(benchmark::State& state) {
  Box src_box = Box::FromShape({2048, 2048});
  Box region({0, 512}, {2048, 1024});
  std::vector<float> src(src_box.num_elements(), 1.0f), dst(region.num_elements());
  for (auto _ : state) {
    benchmark::DoNotOptimize(CopyBox(region, DType::kFloat32, src.data(), src_box, DType::kFloat32,
                                     dst.data(), region, "bench"));
  }
  state.SetBytesProcessed(state.iterations() * dst.size() * sizeof(float));
}
BENCHMARK(BM_CopyBoxRows);

void BM_ConvertFloat32ToBfloat16(benchmark::State& state) {
  std::vector<float> src(1 << 20, 1.5f);
  std::vector<uint16_t> dst(src.size());
  for (auto _ : state) {
    benchmark::DoNotOptimize(ConvertElements(DType::kFloat32, src.data(), DType::kBfloat16,
                                             dst.data(), src.size(), "bench"));
  }
  state.SetBytesProcessed(state.iterations() * src.size() * sizeof(float));
}
BENCHMARK(BM_ConvertFloat32ToBfloat16);

// tree.json of 4,000 arrays of 8 row shards each, as bench/run.py's many-small scenario saves.
std::string ManySmallTreeJson() {
  TreeFile tree;
  tree.root = TreeNode::Dict();
  for (int i = 0; i < 4000; ++i) {
    ArrayMetadata a;
    a.path = "p" + std::to_string(10000 + i).substr(1);
    a.dtype = DType::kFloat32;
    const int64_t rows = 8 * (1 + i % 64);
    a.grid.shape = {rows, 128};
    a.grid.cell_shape = {rows / 8, 128};
    a.grid.chunk_shape = {rows / 8, 128};
    tree.root.entries.emplace_back(a.path, TreeNode::Array(i));
    tree.arrays.push_back(std::move(a));
  }
  return EncodeTreeJson(tree).value();
}

void BM_DecodeTreeJsonManySmall(benchmark::State& state) {
  const std::string text = ManySmallTreeJson();
  for (auto _ : state) benchmark::DoNotOptimize(DecodeTreeJson(text, "bench").ok());
  state.SetBytesProcessed(state.iterations() * text.size());
}
BENCHMARK(BM_DecodeTreeJsonManySmall)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tensorstash

BENCHMARK_MAIN();
