// Small file helpers for tests that read fixtures from disk (tests/data, TS_TEST_DATA_DIR).
#ifndef TENSORSTASH_TESTING_TEST_FILES_H_
#define TENSORSTASH_TESTING_TEST_FILES_H_

#include <fstream>
#include <sstream>
#include <string>

namespace tensorstash {

// The whole content of the file at `path`; "" when it cannot be opened (the test's own
// expectations on the content then fail and name what they wanted).
inline std::string ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace tensorstash

#endif  // TENSORSTASH_TESTING_TEST_FILES_H_
