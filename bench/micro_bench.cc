// Micro-benchmarks of the engine's inner loops: CRC-32C, strided box copies, dtype casts.
// Run: build/tensorstash_micro_bench [--benchmark_filter=...]. For whole save/restore speeds
// use examples/sharded_save_restore.
#include <benchmark/benchmark.h>

#include <vector>

#include "tensorstash/array/box.h"
#include "tensorstash/array/convert.h"
#include "tensorstash/util/crc32c.h"

namespace tensorstash {
namespace {

void BM_Crc32c(benchmark::State& state) {
  std::vector<char> data(state.range(0), 'x');
  for (auto _ : state) benchmark::DoNotOptimize(Crc32c(data.data(), data.size()));
  state.SetBytesProcessed(state.iterations() * data.size());
}
BENCHMARK(BM_Crc32c)->Arg(64 << 10)->Arg(8 << 20);

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

}  // namespace
}  // namespace tensorstash

BENCHMARK_MAIN();
