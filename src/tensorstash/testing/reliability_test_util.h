// Helpers of the reliability tests (fault injection, full disk, concurrency): a small step whose
// contents are a function of (step, version), saving it, checking that it restores bit for bit,
// checking that nothing incomplete opens, and counting descriptors and threads for leak checks.
#ifndef TENSORSTASH_TESTING_RELIABILITY_TEST_UTIL_H_
#define TENSORSTASH_TESTING_RELIABILITY_TEST_UTIL_H_

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tensorstash/checkpoint/checkpoint_reader.h"
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/engine/layout.h"

namespace tensorstash {
namespace test {

// The arrays of version `version` of step `step`: about 60 KB of four arrays (one zstd, one
// 0-d), sharded, so that with SmallFilesOptions a save writes a dozen chunks into several files.
inline std::vector<TestArray> ReliabilityStepArrays(int64_t step, int version, int scale = 1) {
  const uint64_t base = Mix64(static_cast<uint64_t>(step) * 7919 + static_cast<uint64_t>(version));
  std::vector<TestArray> arrays;
  arrays.push_back({{"params/w", DType::kFloat32, {64, 96 * scale}}, base + 1, {{2, 2}, {0, 1}}});
  arrays.push_back({{"params/b", DType::kBfloat16, {96}}, base + 2, {{2}, {0}}});
  arrays.push_back({{"opt/mu", DType::kFloat32, {80, 50}, Codec::kZstd}, base + 3, {{2}, {0, -1}}});
  arrays.push_back({{"step", DType::kInt64, {}}, base + 4, Replicated(0, 2)});
  return arrays;
}

// Small chunks and data files, so that a save makes many calls.
inline WriterOptions SmallFilesOptions() {
  WriterOptions options;
  options.target_chunk_bytes = 4096;
  options.target_data_file_bytes = 16 << 10;
  options.io_threads = 2;
  options.sync = true;
  return options;
}

// Saves version `version` of `step` under `dir`.
inline Status SaveReliabilityStep(KvStore* kv, const std::string& dir, int64_t step, int version,
                                  WriterOptions options, int scale = 1) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      CheckpointWriter::Create(kv, dir, options));
  std::vector<HeldShards> held;
  const std::vector<TestArray> arrays = ReliabilityStepArrays(step, version, scale);
  held.reserve(arrays.size());
  for (const TestArray& a : arrays) {
    held.push_back(HoldAllShards(a.spec, a.seed, a.sharding));
    TS_RETURN_IF_ERROR(writer->AddArray(a.spec, held.back().shards));
  }
  return writer->Commit();
}

// Opens `dir` and reads every array whole. OK and *version set when it matches one of
// `versions` of `step` bit for bit; the open or read error otherwise, or DataLoss if the bytes
// match none of them.
inline Status RestoreReliabilityStep(KvStore* kv, const std::string& dir, int64_t step,
                                     const std::set<int>& versions, int* version, int scale = 1,
                                     ReaderOptions options = {}) {
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                      CheckpointReader::Open(kv, dir, options));
  std::vector<std::vector<char>> got;
  const std::vector<TestArray> shapes = ReliabilityStepArrays(step, 0, scale);
  if (reader->arrays().size() != shapes.size()) {
    return DataLossError(
        StrCat(dir, ": ", reader->arrays().size(), " arrays, expected ", shapes.size()));
  }
  for (const TestArray& a : shapes) {
    const Box whole = Box::FromShape(a.spec.shape);
    got.emplace_back(static_cast<size_t>(whole.num_elements()) * ItemSize(a.spec.dtype));
    TS_RETURN_IF_ERROR(reader->Read({a.spec.path, whole, a.spec.dtype, got.back().data()}));
  }
  for (int v : versions) {
    const std::vector<TestArray> arrays = ReliabilityStepArrays(step, v, scale);
    bool same = true;
    for (size_t i = 0; i < arrays.size() && same; ++i) {
      same = MakeArrayData(arrays[i].spec.dtype, arrays[i].spec.shape, arrays[i].seed) == got[i];
    }
    if (same) {
      *version = v;
      return OkStatus();
    }
  }
  return DataLossError(StrCat(dir, " opened but its contents match no saved version"));
}

// The step number of a step folder name ("0000000042" -> 42).
inline int64_t Step(const std::string& folder) { return std::stoll(folder); }

// The top-level folder names of `kv` under `root` ("" or "a/b/"), sorted.
inline std::set<std::string> TopFolders(KvStore* kv, const std::string& root) {
  std::set<std::string> folders;
  Result<std::vector<std::string>> keys = kv->List(root);
  EXPECT_EQ(OkStatus(), keys.status());
  if (!keys.ok()) return folders;
  for (const std::string& key : *keys) {
    const size_t slash = key.find('/', root.size());
    if (slash != std::string::npos) folders.insert(key.substr(root.size(), slash - root.size()));
  }
  return folders;
}

// Every folder under `root` other than a committed step of `committed` (step -> versions it may
// hold) must refuse to open, and must do so as an incomplete or temporary folder would.
inline void ExpectNothingIncompleteOpens(KvStore* kv, const std::string& root,
                                         const std::map<std::string, std::set<int>>& committed) {
  for (const std::string& folder : TopFolders(kv, root)) {
    if (committed.count(folder) != 0) continue;
    Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(kv, root + folder);
    EXPECT_FALSE(reader.ok()) << "folder '" << folder << "' opened as a complete step";
    if (!reader.ok()) {
      EXPECT_TRUE(absl::IsFailedPrecondition(reader.status()) || absl::IsNotFound(reader.status()))
          << folder << ": " << reader.status();
    }
  }
}

// Entries of a /proc/self directory: open descriptors ("fd") or threads ("task").
inline int CountProcEntries(const char* what) {
  int n = 0;
  std::error_code error;
  for (auto it = std::filesystem::directory_iterator(std::string("/proc/self/") + what, error);
       !error && it != std::filesystem::directory_iterator(); it.increment(error)) {
    ++n;
  }
  return n;
}

// Threads of this process, or -1 under ThreadSanitizer, whose runtime starts a background thread
// of its own at some point (leak checks then compare -1 with -1).
inline int CountThreads() {
#if defined(__SANITIZE_THREAD__)
  return -1;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
  return -1;
#endif
#endif
  return CountProcEntries("task");
}

// CountThreads() once it equals `expected`, or after 2 s whatever it is then. A joined thread can
// still be listed in /proc/self/task for a moment after pthread_join returns (the kernel wakes
// the joiner before it has reaped the thread), which made leak checks flaky on a loaded machine.
// The number of threads once no more than `expected` run (waiting up to 2 s for threads that
// are ending). Fewer is no leak: a thread of an earlier test may end meanwhile.
inline int CountThreadsSettled(int expected) {
  int count = CountThreads();
  for (int i = 0; i < 200 && count > expected; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    count = CountThreads();
  }
  return count;
}

}  // namespace test
}  // namespace tensorstash

#endif  // TENSORSTASH_TESTING_RELIABILITY_TEST_UTIL_H_
