// Replays every seed input (fuzz/corpus/<target>/) and every input a fuzzer once crashed on
// (fuzz/regressions/<target>/) through the fuzz target bodies, so that the normal suite keeps
// each fix without clang. A regression comes back as a crash or an abort of this binary.
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz/fuzz_targets.h"
#include "gtest/gtest.h"

namespace tensorstash {
namespace {

namespace fs = std::filesystem;

struct Target {
  std::string name;
  std::function<void(const uint8_t*, size_t)> run;
};

std::vector<Target> Targets() {
  return {{"index", fuzz::FuzzIndex},
          {"tree_json", fuzz::FuzzTreeJson},
          {"commit_record", fuzz::FuzzCommitRecord},
          {"chunk_codec", fuzz::FuzzChunkCodec},
          {"step", fuzz::FuzzStep},
          {"ocdbt", fuzz::FuzzOcdbt},
          {"foreign_step", fuzz::FuzzForeignStep},
          {"safetensors_header", fuzz::FuzzSafetensorsHeader},
          {"dcp_pickle", fuzz::FuzzDcpPickle},
          {"torch_zip", fuzz::FuzzTorchZip}};
}

// Runs every file under `dir` (if it exists) through `target`; returns how many.
int ReplayDirectory(const fs::path& dir, const Target& target) {
  int count = 0;
  if (!fs::is_directory(dir)) return 0;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    const std::string input = bytes.str();
    SCOPED_TRACE(entry.path().string());
    target.run(reinterpret_cast<const uint8_t*>(input.data()), input.size());
    ++count;
  }
  return count;
}

class FuzzReplayTest : public ::testing::TestWithParam<Target> {};

TEST_P(FuzzReplayTest, SeedCorpusAndRegressionsRunClean) {
  const fs::path root = TS_FUZZ_DIR;
  const int seeds = ReplayDirectory(root / "corpus" / GetParam().name, GetParam());
  EXPECT_GT(seeds, 0) << "no seed corpus in " << (root / "corpus" / GetParam().name);
  ReplayDirectory(root / "regressions" / GetParam().name, GetParam());
}

TEST(FuzzBundleTest, RoundTrips) {
  const std::map<std::string, std::string> files = {{"COMMIT", "{}"}, {"state/index", ""}};
  EXPECT_EQ(fuzz::DecodeBundle(fuzz::EncodeBundle(files)), files);
  // A record that does not fit ends the bundle.
  std::string cut = fuzz::EncodeBundle(files);
  cut.pop_back();
  EXPECT_EQ(fuzz::DecodeBundle(cut).size(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzReplayTest, ::testing::ValuesIn(Targets()),
                         [](const ::testing::TestParamInfo<Target>& param_info) {
                           return param_info.param.name;
                         });

}  // namespace
}  // namespace tensorstash
