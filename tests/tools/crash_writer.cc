// crash_writer ROOT: saves steps into a FileKvStore at ROOT, one after another, forever, until it
// is killed. checkpoint_crash_test.cc kills it at random moments and checks what is left.
//
// It starts after the newest complete step already in ROOT (leftovers of earlier runs, killed
// mid-save, are the writer's to cope with). Each step holds the arrays of CrashStepArrays(step)
// (a few MiB, content derived from the step number), saved with sync on. After each commit it
// writes "<step>\n" to stdout, unbuffered. Errors go to stderr with exit status 1.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#define TS_CHECKPOINT_TEST_UTIL_NO_GTEST
#include "tensorstash/testing/checkpoint_test_util.h"
#include "tensorstash/checkpoint/checkpoint_writer.h"
#include "tensorstash/format/commit_record.h"
#include "tensorstash/kvstore/file/file_kvstore.h"

using namespace tensorstash;

namespace {

// The newest step folder of `root` that has a COMMIT (0 if none).
int64_t NewestCompleteStep(const std::string& root) {
  int64_t newest = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(root, error)) {
    const std::string name = entry.path().filename().string();
    int64_t step = 0;
    if (name.size() != 10 || !ParseInt(name, &step)) continue;
    if (std::filesystem::exists(entry.path() / kCommitFileName, error)) {
      newest = std::max(newest, step);
    }
  }
  return newest;
}

Status SaveStep(KvStore* kv, int64_t step) {
  WriterOptions options;
  options.sync = true;
  options.target_chunk_bytes = 256 << 10;
  options.target_data_file_bytes = 1 << 20;
  options.io_threads = 4;
  TS_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                      CheckpointWriter::Create(kv, test::StepName(step), options));
  const std::vector<test::TestArray> arrays = test::CrashStepArrays(step);
  std::vector<test::HeldShards> held;
  held.reserve(arrays.size());
  for (const test::TestArray& a : arrays) {
    held.push_back(test::HoldAllShards(a.spec, a.seed, a.sharding));
    TS_RETURN_IF_ERROR(writer->AddArray(a.spec, held.back().shards));
  }
  return writer->Commit();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s ROOT\n", argv[0]);
    return 2;
  }
  const std::string root = argv[1];
  Result<std::unique_ptr<FileKvStore>> kv = FileKvStore::Open(root);
  if (!kv.ok()) {
    std::fprintf(stderr, "crash_writer: %s\n", kv.status().ToString().c_str());
    return 1;
  }
  for (int64_t step = NewestCompleteStep(root) + 1;; ++step) {
    const Status status = SaveStep(kv->get(), step);
    if (!status.ok()) {
      std::fprintf(stderr, "crash_writer: step %lld: %s\n", static_cast<long long>(step),
                   status.ToString().c_str());
      return 1;
    }
    const std::string line = StrCat(step, "\n");
    if (::write(STDOUT_FILENO, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
      return 1;
    }
  }
}
