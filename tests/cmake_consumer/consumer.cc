// Saves a sharded array into a folder and restores a box of it that cuts across the shards,
// through the installed headers and library only. Exit code 0 when the restored values are
// right; a message and 1 otherwise.
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/kvstore/registry.h"
#include "tensorstash/version.h"

namespace ts = tensorstash;

int Fail(const std::string& what, const ts::Status& status) {
  std::fprintf(stderr, "consumer: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer FOLDER\n");
    return 2;
  }
  std::printf("tensorstash %s\n", ts::kVersion);
  ts::Result<std::unique_ptr<ts::KvStore>> store = ts::OpenKvStore(argv[1]);
  if (!store.ok()) return Fail("opening the store", store.status());
  // An [8, 6] float32 array held as two shards of 4 rows.
  std::vector<float> values(48);
  std::iota(values.begin(), values.end(), 0.0f);
  {
    auto writer = ts::CheckpointWriter::Create(store->get(), "step_1");
    if (!writer.ok()) return Fail("creating the writer", writer.status());
    ts::Status added = (*writer)->AddArray(
        {"params/w", ts::DType::kFloat32, {8, 6}},
        {{ts::Box({0, 0}, {4, 6}), values.data()}, {ts::Box({4, 0}, {4, 6}), values.data() + 24}});
    if (!added.ok()) return Fail("adding the array", added);
    if (ts::Status committed = (*writer)->Commit(); !committed.ok()) {
      return Fail("committing", committed);
    }
  }
  auto reader = ts::CheckpointReader::Open(store->get(), "step_1");
  if (!reader.ok()) return Fail("opening the step", reader.status());
  // Rows 2-5, columns 1-3: across both shards, as another device layout would ask.
  std::vector<double> box(4 * 3);
  ts::Status read = (*reader)->Read(
      {"params/w", ts::Box({2, 1}, {4, 3}), ts::DType::kFloat64, box.data()}, nullptr);
  if (!read.ok()) return Fail("reading", read);
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 3; ++c) {
      if (box[r * 3 + c] != values[(r + 2) * 6 + c + 1]) {
        std::fprintf(stderr, "consumer: wrong value at [%d, %d]\n", r + 2, c + 1);
        return 1;
      }
    }
  }
  std::printf("consumer: saved and restored through the installed package\n");
  return 0;
}
